"""Unset sampling fields take the model's generation_config.json defaults, else the API's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from kvserve.protos.kvserve.v1 import api_pb2
from kvserve.protos.sampling import SamplingParams
from kvserve.scheduler.server.intake.generation_defaults import (
    SamplingDefaults,
    load_sampling_defaults,
    sampling_defaults_from,
)
from kvserve.scheduler.server.intake.request_parsing import ModelLimits, parse_generate
from kvserve.scheduler.server.intake.tokenizer import Tokenizer

MODEL_GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": [2, 7],
    "do_sample": True,
    "temperature": 0.6,
    "top_p": 0.8,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 40,
    "transformers_version": "4.51.0",
}
API = SamplingParams()


@pytest.fixture(scope="module")
def tokenizer(default_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture
def model_dir(tmp_path: Path, default_model_dir: Path) -> Path:
    """A model directory as an executor reports it: tokenizer files plus a generation_config.json."""
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_dir / name).is_file():
            shutil.copy(default_model_dir / name, model / name)
    (model / "generation_config.json").write_text(json.dumps(MODEL_GENERATION_CONFIG))
    return model


def _generate(**sampling) -> api_pb2.GenerateRequest:
    return api_pb2.GenerateRequest(text="Hello there", sampling=api_pb2.SamplingParams(**sampling))


def _limits(defaults: SamplingDefaults, max_model_len: int = 2048) -> ModelLimits:
    return ModelLimits(max_model_len=max_model_len, vocab_size=49152, sampling_defaults=defaults)


def test_unset_fields_take_the_models_values(model_dir: Path, tokenizer: Tokenizer) -> None:
    defaults = load_sampling_defaults(model_dir)
    s = parse_generate(_generate(), Tokenizer.from_dir(model_dir), _limits(defaults)).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens) == (
        0.6,
        0.8,
        20,
        0.05,
        1.1,
        40,
    )
    # Fields generation_config has no say over keep the API's defaults.
    assert (s.presence_penalty, s.frequency_penalty, s.n, s.min_tokens) == (0.0, 0.0, 1, 0)


def test_set_fields_override_the_models_values(model_dir: Path, tokenizer: Tokenizer) -> None:
    limits = _limits(load_sampling_defaults(model_dir))
    request = _generate(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=5)
    s = parse_generate(request, tokenizer, limits).sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.max_tokens) == (0.0, 1.0, -1, 0.0, 1.0, 5)
    # Setting one field leaves the others at the model's values.
    s = parse_generate(_generate(temperature=1.5), tokenizer, limits).sampling
    assert (s.temperature, s.top_p, s.top_k) == (1.5, 0.8, 20)


def test_no_file_means_the_documented_defaults(tmp_path: Path, tokenizer: Tokenizer) -> None:
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == SamplingDefaults()
    s = parse_generate(_generate(), tokenizer, _limits(defaults)).sampling
    assert s == SamplingParams(max_tokens=16, seed=s.seed)
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repetition_penalty, s.max_tokens) == (
        1.0,
        -1,
        1.0,
        0.0,
        1.0,
        16,
    )
    # ModelLimits built without defaults (the HTTP edge, tests) behaves the same.
    assert ModelLimits(2048, 49152).sampling_defaults == SamplingDefaults()


def test_the_documented_defaults_are_the_api_ones() -> None:
    d = SamplingDefaults()
    assert (d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty, d.max_tokens) == (
        API.temperature,
        API.top_k,
        API.top_p,
        API.min_p,
        API.repetition_penalty,
        API.max_tokens,
    )


def test_source_api_ignores_the_file_and_a_folder_source_reads_that_folder(model_dir: Path, tmp_path: Path) -> None:
    assert load_sampling_defaults(model_dir, "api") == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert load_sampling_defaults(model_dir, str(other)) == SamplingDefaults(temperature=0.3)
    assert load_sampling_defaults(None) == SamplingDefaults()
    assert load_sampling_defaults("") == SamplingDefaults()


def test_model_max_new_tokens_is_clamped_to_the_context_left(model_dir: Path, tokenizer: Tokenizer) -> None:
    limits = _limits(load_sampling_defaults(model_dir), max_model_len=64)
    ids = list(range(10, 40))  # 30 prompt tokens: 34 left, which is under the model's 40
    s = parse_generate(api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=ids)), tokenizer, limits).sampling
    assert s.max_tokens == 34


def test_top_k_zero_in_the_file_means_off() -> None:
    defaults, taken = sampling_defaults_from({"top_k": 0})
    assert defaults.top_k == -1 and taken == {"top_k"}


@pytest.mark.parametrize(
    ("raw", "ignored"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": "0.9"}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": None, "temperature": float("nan")}, "temperature"),
    ],
)
def test_out_of_range_values_are_ignored_with_a_warning(raw: dict, ignored: str) -> None:
    with capture_logs() as logs:
        defaults, taken = sampling_defaults_from(raw)
    assert defaults == SamplingDefaults() and taken == set()
    warnings = [e for e in logs if e["event"] == "generation_config_value_ignored"]
    assert [w["key"] for w in warnings] == [ignored]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", "\xff"])
def test_an_unreadable_file_falls_back_to_the_api_defaults(tmp_path: Path, content: str) -> None:
    (tmp_path / "generation_config.json").write_bytes(content.encode("latin-1"))
    with capture_logs() as logs:
        assert load_sampling_defaults(tmp_path) == SamplingDefaults()
    assert [e["event"] for e in logs] == ["generation_config_unreadable", "sampling_defaults"]


def test_the_defaults_in_use_are_logged_once(model_dir: Path, tmp_path: Path) -> None:
    with capture_logs() as logs:
        load_sampling_defaults(model_dir)
        load_sampling_defaults(tmp_path)
    lines = [e for e in logs if e["event"] == "sampling_defaults"]
    assert len(lines) == 2
    from_model, api = lines
    assert from_model["source"] == str(model_dir / "generation_config.json")
    assert from_model["temperature"] == 0.6 and from_model["max_tokens"] == 40
    assert from_model["from_file"] == ["max_tokens", "min_p", "repetition_penalty", "temperature", "top_k", "top_p"]
    assert api["source"] == "api" and api["temperature"] == 1.0 and api["max_tokens"] == 16
