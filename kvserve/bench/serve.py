"""One `bench serve` run: every configuration on the same requests, then the report.

Configurations, one after another so they never compete for the CPU:
1. `kvserve` — the server under test, prefix caching on;
2. the server baselines (`SERVER_BASELINES`), each a kvserve server of its own:
   `kvserve-no-cache`, started with `--no-prefix-caching` (or an already running one given by
   `no_cache_target`), and `kvserve-prealloc`, the contiguous-preallocation tier run for real
   (`--kv-reservation max-model-len --no-prefix-caching`, one server per workload with
   `--max-model-len` = that workload's longest request, the setting the estimate assumes);
3. every `--target NAME=URL`: another OpenAI-compatible server (llama.cpp's llama-server,
   vLLM), driven over HTTP with the same requests (`openai_driver.py`), every workload but
   `cold-warm` (the OpenAI API has no cache namespace to make a cold half with);
4. `hf-generate` — Hugging Face `generate`, static batches, in this process, on `mixed`;
5. the contiguous-preallocation estimate, computed from kvserve's trace and KV budget (beside
   the `kvserve-prealloc` run as its cross-check).

`sweep` (`--sweep FLAG=V1,V2,...`, sweep.py) replaces all of this with one `kvserve` run per
value, each on a fresh server started with `--FLAG V`; baselines and targets do not run.

`api` picks how the kvserve configurations are driven: `grpc` (the async client) or `openai`
(kvserve's own HTTP API: the fair side of a comparison with an HTTP target). Either way the
server's counters (peak running, preemptions, prefix hits) come from gRPC `server_stats()`.

Its parts: the flags (`serve_config.py`), one configuration driven on a listening server
(`configuration_runs.py`), the kvserve servers (`kvserve_servers.py`) and the command
(`serve_command.py`).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import structlog

from kvserve.bench import workloads as wl
from kvserve.bench.configuration_runs import run_on_http_target
from kvserve.bench.kvserve_servers import SERVER_BASELINES, run_server_baseline, run_server_under_test
from kvserve.bench.load_driver import RunResult
from kvserve.bench.openai_driver import HttpTarget
from kvserve.bench.report import (
    HF_GENERATE,
    KVSERVE,
    KVSERVE_NO_CACHE,
    KVSERVE_PREALLOC,
    BenchReport,
    compute_ratios,
    summarize_run,
)
from kvserve.bench.run_meta import run_meta
from kvserve.bench.serve_config import APIS, BenchConfig
from kvserve.bench.sweep import SweepSpec, sweep_points
from kvserve.config import defaults

log = structlog.get_logger(__name__)

RESERVED_NAMES = (KVSERVE, KVSERVE_NO_CACHE, KVSERVE_PREALLOC, HF_GENERATE)
"""Configuration names of the report's own; no `--target` may take one."""


async def run_serve_benchmark(config: BenchConfig) -> BenchReport:
    """Run every configuration (or every value of the sweep) and return the filled report."""
    started = dt.datetime.now(dt.UTC)
    if config.api not in APIS:
        raise ValueError(f"api must be one of {', '.join(APIS)}, got {config.api!r}")
    http_targets = [HttpTarget.parse(spec) for spec in config.targets]
    names = [t.name for t in http_targets]
    if len(set(names)) != len(names) or set(names) & set(RESERVED_NAMES):
        raise ValueError(f"--target names must be unique and none of {', '.join(RESERVED_NAMES)}")
    spec = SweepSpec.parse(config.sweep) if config.sweep else None
    variants = spec.variants() if spec is not None else [(KVSERVE, [])]
    runs, info, loads = await run_server_under_test(config, variants, start=config.start_server or spec is not None)
    vocab_size = int(info["vocab_size"])

    baseline_loads = [w for w in loads if w.name != "cold-warm"]
    target_meta: dict[str, dict[str, Any]] = {t.name: {} for t in http_targets}
    hf_extra: dict = {}
    if spec is None:
        for baseline in SERVER_BASELINES:  # one server at a time: they never share the CPU
            if baseline.baseline in config.baselines and baseline_loads:
                runs += await run_server_baseline(baseline, baseline_loads, config)
        for http_target in http_targets:  # after kvserve's servers have stopped
            if baseline_loads:
                runs += await run_on_http_target(http_target, baseline_loads, config, target_meta[http_target.name])
        mixed = next((w for w in loads if w.name == "mixed"), None)
        if "hf" in config.baselines:
            if mixed is None:
                log.warning("hf baseline skipped: it runs on the mixed workload")
            else:
                hf = _run_hf(config, mixed, vocab_size)
                if hf is not None:
                    runs.append(hf[0])
                    hf_extra = {"hf_batch_size": config.hf_batch_size, "hf_generated_tokens": hf[1]}

    report = BenchReport(meta=run_meta(config, started, info, targets=target_meta, **hf_extra))
    report.results = [summarize_run(r) for r in runs]
    block_size = int(info.get("block_size") or defaults.BLOCK_SIZE)
    num_blocks = int(info.get("num_blocks") or 0) if "prealloc" in config.baselines and spec is None else 0
    max_len: dict[str, int] = {}
    for w in loads:
        max_len[w.name] = max(max_len.get(w.name, 0), w.max_request_len())
    compute_ratios(
        report,
        runs,
        num_blocks=num_blocks,
        block_size=block_size,
        max_request_len_by_workload=max_len,
        targets=names,
    )
    if spec is not None:
        report.sweep = sweep_points(spec, report, runs)
    return report


def _run_hf(config: BenchConfig, mixed: wl.Workload, vocab_size: int) -> tuple[RunResult, int] | None:
    from kvserve.bench.baseline_hf import load_model, requests_from_workload, run_hf_baseline
    from kvserve.executor.weights.model_store import ensure_model_dir

    model = load_model(ensure_model_dir(config.model))
    if model.config.vocab_size < vocab_size:
        log.warning(
            "hf baseline skipped: its model's vocabulary is smaller than the server's; "
            "give --model the model the server runs",
            hf_vocab=model.config.vocab_size,
            server_vocab=vocab_size,
        )
        return None
    return run_hf_baseline(
        model, requests_from_workload(mixed), batch_size=config.hf_batch_size, progress=config.progress
    )
