"""Bench flags come from config dataclasses: the forms they need, and the CLI staying light."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from kvserve.bench.executor_command import ExecutorBenchConfig
from kvserve.bench.quality import QualityBenchConfig, parse_config
from kvserve.bench.serve_config import BenchConfig
from kvserve.config.flags import add_flags, config_from_args, config_to_argv, flag


@dataclass(frozen=True, slots=True)
class _Options:
    sizes: tuple[int, ...] = field(default=(1, 8), metadata=flag("sizes", nargs="+"))
    names: tuple[str, ...] = field(default=("a",), metadata=flag("names (repeatable)", name="--name"))
    out: str | None = field(default=None, metadata=flag("out", nargs="?", const="-"))


def _parse(cls: type, argv: list[str]) -> object:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return config_from_args(cls, parser.parse_args(argv))


def test_nargs_repeat_and_optional_values() -> None:
    assert _parse(_Options, []) == _Options()
    assert _parse(_Options, ["--sizes", "2", "4", "6"]) == _Options(sizes=(2, 4, 6))
    # A repeatable flag replaces its default rather than adding to it.
    assert _parse(_Options, ["--name", "b", "--name", "c"]) == _Options(names=("b", "c"))
    assert _parse(_Options, ["--out"]) == _Options(out="-")
    assert _parse(_Options, ["--out", "x.json"]) == _Options(out="x.json")


def test_config_to_argv_round_trips_every_form() -> None:
    config = _Options(sizes=(3, 5), names=("x", "y"), out="r.json")
    assert _parse(_Options, config_to_argv(config)) == config


def test_bench_configs_parse_their_spellings() -> None:
    serve = _parse(BenchConfig, ["--workload", "all", "--concurrency", "0", "--request-rate", "inf"])
    assert isinstance(serve, BenchConfig)
    assert serve.workloads == ("mixed", "shared-prefix", "multi-turn", "cold-warm", "multi-prefix", "copy")
    assert serve.concurrency is None and serve.request_rate is None  # no limit, one spelling in the meta
    bench = _parse(ExecutorBenchConfig, ["--batches", "1", "64", "--prefill-batches"])
    assert bench == ExecutorBenchConfig(batches=(1, 64), prefill_batches=())
    quality = _parse(QualityBenchConfig, [])
    assert isinstance(quality, QualityBenchConfig)
    assert [parse_config(spec).max_ppl_increase for spec in quality.configs] == [0.02, 0.01]
    with pytest.raises(ValueError, match="--configs 'float64/native'"):
        parse_config("float64/native")
    kv = parse_config("float32/native/float32")  # a KV cache's dtype keeps its configuration's goal
    assert (kv.name, kv.kv_cache_dtype, kv.max_ppl_increase) == ("float32/native/float32", "float32", 0.02)
    assert parse_config("float16").name == "float16/dequantized"
    with pytest.raises(ValueError, match="--configs 'float32/native/int8'"):
        parse_config("float32/native/int8")


def test_the_cli_and_every_bench_parser_load_without_torch() -> None:
    script = (
        "import sys; from kvserve.cli import build_parser; p = build_parser(); "
        "[p.parse_args(['bench', b]) for b in ('scheduler', 'executor', 'structured', 'quality', 'serve', "
        "'baseline-hf', 'viewers')]; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
