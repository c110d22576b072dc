"""KV capacity arithmetic and the `kvserve kv-plan` command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.commands import kv_plan
from kvserve.config.defaults import BLOCK_SIZES
from kvserve.protos.kv_geometry import GIB, KvGeometry, bytes_per_token
from kvserve.scheduler.core.kv_capacity import plan_kv

LLAMA2_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096}
LLAMA2_13B = {"num_hidden_layers": 40, "num_attention_heads": 40, "hidden_size": 5120}


def test_llama2_bytes_per_token() -> None:
    assert bytes_per_token(KvGeometry.from_hf_config(LLAMA2_7B), "float16") == 524_288
    assert bytes_per_token(KvGeometry.from_hf_config(LLAMA2_13B), "float16") == 819_200
    assert bytes_per_token(KvGeometry.from_hf_config(LLAMA2_7B), "fp8") == 262_144
    assert bytes_per_token(KvGeometry.from_hf_config(LLAMA2_7B), "float32") == 1_048_576


def test_gqa_and_explicit_head_dim() -> None:
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "head_dim": 32,
    }
    assert KvGeometry.from_hf_config(config) == KvGeometry(2, 2, 32)


def test_plan_figures() -> None:
    plan = plan_kv(KvGeometry.from_hf_config(LLAMA2_7B), 4 * GIB, 16, "float16", 1000)
    assert plan.block_bytes == 524_288 * 16
    assert plan.num_blocks == 4 * GIB // (524_288 * 16) == 512
    assert plan.token_capacity == 8192
    assert plan.max_concurrency == 512 // 63
    assert plan.fragmentation_pct == pytest.approx(100 * 8 / 1008)


def run_cli(argv: list[str], capsys) -> str:
    parser = argparse.ArgumentParser()
    kv_plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kv-plan", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


def test_cli_json_from_a_config_file(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_13B))
    out = json.loads(run_cli([str(tmp_path), "--kv-memory-gb", "8", "--avg-context", "2048", "--json"], capsys))
    for key in kv_plan.JSON_KEYS:
        assert key in out
    assert out["bytes_per_token"] == 819_200
    assert out["num_blocks"] == 8 * GIB // (819_200 * 16)
    assert out["max_concurrency"] == out["num_blocks"] // 128
    by_size = out["by_block_size"]
    assert [entry["block_size"] for entry in by_size] == list(BLOCK_SIZES)
    for entry in by_size:
        assert set(entry) == set(kv_plan.BY_BLOCK_SIZE_KEYS)
        size = entry["block_size"]
        assert entry["fragmentation_pct"] == pytest.approx(100 * (size / 2) / (2048 + size / 2))
        assert entry["num_blocks"] == 8 * GIB // (819_200 * size)
    assert by_size[1]["num_blocks"] == out["num_blocks"]  # the selected size (16) agrees with the plan


def test_cli_text_names_every_figure(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA2_7B))
    text = run_cli([str(path), "--dtype", "bfloat16", "--block-size", "32", "--avg-context", "1000"], capsys)
    for label in ("bytes per token", "bytes per block", "blocks", "token capacity", "concurrency", "fragmentation"):
        assert label in text
    assert "524,288" in text
    table = text[text.index("by block size") :].splitlines()
    assert table[0] == "by block size, at 1,000 tokens per sequence:"
    assert table[1].split() == ["block", "size", "blocks", "concurrency", "fragmentation"]
    rows = [line.split() for line in table[2:]]
    assert [row[0] for row in rows] == [str(size) for size in BLOCK_SIZES]
    geometry = KvGeometry.from_hf_config(LLAMA2_7B)
    for row, size in zip(rows, BLOCK_SIZES, strict=True):
        plan = plan_kv(geometry, 4 * GIB, size, "bfloat16", 1000)
        assert row[1:4] == [f"{plan.num_blocks:,}", f"{plan.max_concurrency:,}", f"{plan.fragmentation_pct:.2f}%"]
        assert ("<-" in row) == (size == 32)  # the --block-size row is marked
    assert rows[0][3] == "0.40%" and rows[3][3] == "3.10%"  # 4 / 1004 and 32 / 1032 tail tokens


def test_cli_refuses_a_block_size_the_server_does_not_accept(capsys) -> None:
    parser = argparse.ArgumentParser()
    kv_plan.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["kv-plan", "--block-size", "12"])
    assert "--block-size" in capsys.readouterr().err


def test_cli_reports_a_bad_config(tmp_path: Path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    parser = argparse.ArgumentParser()
    kv_plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["kv-plan", str(tmp_path)])
    assert args.func(args) == 2
    assert "num_hidden_layers" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_defaults_to_the_built_in_model(default_model_dir: Path, capsys) -> None:
    out = json.loads(run_cli(["--json"], capsys))
    config = json.loads((default_model_dir / "config.json").read_text())
    assert out["bytes_per_token"] == bytes_per_token(KvGeometry.from_hf_config(config), "float16")
