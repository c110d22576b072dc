"""`kvserve bench quality` and the project's quality bar on the real default model.

The bar: native Q4_1 perplexity within 2% of the fp32 dequantized path, bfloat16 within 1%,
on the shipped public-domain text; teacher-forced greedy agreement stays high.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvserve.bench.quality import CANDIDATES, quality_text, text_windows
from kvserve.scheduler.server.intake.tokenizer import Tokenizer

MIN_TOP1_AGREEMENT = 0.95
"""Measured 98.6–99.0% on the 12 fixed prompts; a kernel bug drops it far below."""


def test_the_shipped_text_is_prose_without_its_header() -> None:
    text = quality_text()
    assert text.startswith("It was the best of times")
    assert "#" not in text
    assert len(text.split()) > 2500


def test_windows_cover_the_tokens_without_overlap() -> None:
    ids = list(range(1030))
    windows = text_windows(ids, 512)
    assert [len(w) for w in windows] == [512, 512, 6]
    assert [t for w in windows for t in w] == ids
    assert text_windows(ids, 512, max_tokens=513) == [ids[:512]]  # a 1-token tail predicts nothing


def test_the_quality_goals_are_the_issues() -> None:
    assert {c.name: c.max_ppl_increase for c in CANDIDATES} == {
        "float32/native": 0.02,
        "bfloat16/dequantized": 0.01,
    }


@pytest.mark.slow
def test_native_and_bf16_stay_within_the_quality_bar(default_model_dir) -> None:
    """The whole benchmark as users run it, on the whole text: about three minutes on 2 cores."""
    assert len(Tokenizer.from_dir(default_model_dir).encode(quality_text())) > 4000
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "quality", "--json"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(done.stdout.strip().splitlines()[-1])}
    assert set(rows) == {"float32/dequantized", "float32/native", "bfloat16/dequantized"}
    reference = rows["float32/dequantized"]
    assert reference["top1_agreement"] > 0.99  # prefill vs decode arithmetic of the same path
    assert 5 < reference["perplexity"] < 200  # a broken model scores in the thousands
    for name in ("float32/native", "bfloat16/dequantized"):
        row = rows[name]
        assert row["passes"], f"{name}: perplexity {row['perplexity']:.3f} vs {reference['perplexity']:.3f}"
        assert row["ppl_increase"] <= row["max_ppl_increase"]
        assert row["top1_agreement"] >= MIN_TOP1_AGREEMENT, name


def test_an_unknown_configuration_is_refused_before_any_model_loads() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve", "bench", "quality", "--configs", "float32/native", "fp8/native"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "kvserve bench quality: --configs 'fp8/native': expected DTYPE/WEIGHTS" in done.stderr
    assert "loading" not in done.stdout
