"""`kvserve bench scale-out`: replicas behind vllm-router against one replica with their whole KV budget.

The workload is `multi-prefix` (K distinct 1,000-token system prompts, requests interleaved at
random across them), sent over the OpenAI HTTP API with the same driver `bench serve --target`
uses, so every configuration gets the same requests:

1. `1 replica`: one `kvserve serve` holding the KV budget of all N replicas together;
2. one fresh `kvserve serve --data-parallel-size N --router-policy P` per policy, each replica
   with 1/N of that budget, driven through the router.

Each configuration starts cold on fresh servers, one after another, so none competes with
another for the CPU. The prefix-cache hit rate is the sum of `usage.prompt_tokens_details.
cached_tokens` over prompt tokens, as every client sees it. Then the router's added latency:
sequential identical requests to one replica, direct and through a router in front of it
alone, in ABBA order, so drift in the machine and whatever the previous request left behind
hit both alike.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench import workloads as wl
from kvserve.bench.load_driver import RunResult, run_workload
from kvserve.bench.openai_driver import OpenAIDriver
from kvserve.bench.report import summarize_run
from kvserve.bench.report_command import run_report_command
from kvserve.bench.run_meta import run_meta
from kvserve.config.flags import HelpFormatter, add_flags, flag
from kvserve.replicas.router_command import POLICIES
from kvserve.testing.replica_launcher import serving_replicas, serving_router
from kvserve.testing.server_launcher import serving

SINGLE = "1 replica"
LATENCY_PROMPT_LEN = 64
LATENCY_MAX_TOKENS = 8


@dataclass(slots=True)
class ScaleOutBenchConfig:
    """`kvserve bench scale-out`'s flags."""

    replicas: int = field(default=2, metadata=flag("replicas behind the router (--data-parallel-size)"))
    policies: tuple[str, ...] = field(
        default=POLICIES,
        metadata=flag(
            "router policies to measure, each on fresh replicas (none: only the single replica and the latency)",
            nargs="*",
            choices=POLICIES,
        ),
    )
    prefixes: int = field(default=wl.MULTI_PREFIX_COUNT, metadata=flag("distinct 1,000-token system prompts (K)"))
    num_requests: int = field(default=64, metadata=flag("requests per configuration"))
    concurrency: int = field(default=8, metadata=flag("most requests in flight"))
    seed: int = field(default=0, metadata=flag("seed of the workload"))
    max_tokens_cap: int | None = field(default=None, metadata=flag("cap every request's max_tokens"))
    executor: str = field(default="torch", metadata=flag("executor of every server", choices=("torch", "fake")))
    replica_kv_gb: float = field(
        default=0.25,
        metadata=flag(
            "KV budget of each replica (torch); the single replica gets N times it. The default holds about 5 of "
            "the 1,000-token prompts in fp32 on SmolLM2-135M, so K=8 needs either the whole budget or a router "
            "that keeps each prompt on one replica"
        ),
    )
    replica_num_blocks: int = field(
        default=360, metadata=flag("KV blocks of each replica (fake executor); the single replica gets N times it")
    )
    serve_args: str = field(default="", metadata=flag("more `kvserve serve` options for every server, shell-quoted"))
    latency_requests: int = field(
        default=200, metadata=flag("sequential requests of the router-latency check, half of them direct")
    )
    startup_timeout_s: float = field(default=600.0, metadata=flag("seconds to wait for each server to serve"))
    progress: bool = field(default=True, metadata=flag("show a progress bar"))
    json: bool = field(default=False, metadata=flag("print the report as JSON"))
    command_line: str = ""
    """How the run was invoked, for the report's meta (not a flag)."""

    @property
    def api(self) -> str:
        """Every configuration is driven over the OpenAI HTTP API (run_meta records it)."""
        return "openai"


@dataclass(slots=True)
class RouterLatency:
    """Sequential requests to one replica, direct and through a router in front of it alone:
    the medians of each, and the median of the pairs' differences (what the router adds)."""

    direct_ttft_ms: float
    routed_ttft_ms: float
    added_ttft_ms: float
    direct_e2e_ms: float
    routed_e2e_ms: float
    added_e2e_ms: float
    requests: int


def _kv_args(config: ScaleOutBenchConfig, share: int) -> list[str]:
    """`share` replicas' worth of the KV budget, as the executor in use takes it."""
    if config.executor == "fake":
        return ["--num-blocks", str(config.replica_num_blocks * share)]
    return ["--kv-cache-gb", f"{config.replica_kv_gb * share:g}"]


def _workload(config: ScaleOutBenchConfig, vocab_size: int) -> wl.Workload:
    return wl.multi_prefix(
        config.num_requests, vocab_size, config.seed, config.max_tokens_cap, num_prefixes=config.prefixes
    )


async def _drive(
    url: str, name: str, workload: wl.Workload, config: ScaleOutBenchConfig, timeout_s: float
) -> RunResult:
    async with OpenAIDriver(url, name=name, prompt_mode="tokens") as http:
        await http.wait_ready(timeout_s)
        await http.warm_up(workload.sessions[0].turns[0].new_token_ids)
        return await run_workload(
            None,
            workload,
            configuration=name,
            concurrency=config.concurrency,
            request_rate=None,
            seed=config.seed,
            progress=config.progress,
            send_turn=http.send_turn,
        )


async def _router_latency(
    direct_url: str, routed_url: str, model: str, vocab_size: int, requests: int
) -> RouterLatency:
    """Identical streamed completions on one cached prompt, direct and routed in ABBA order."""
    low, high = wl.token_id_range(vocab_size)
    prompt = [low + (i * 7919) % (high - low) for i in range(LATENCY_PROMPT_LEN)]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": LATENCY_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    pairs: list[dict[str, tuple[float, float]]] = []
    """Per pair: kind -> (TTFT ms, end-to-end ms)."""
    async with httpx.AsyncClient(timeout=60) as client:
        for i in range(requests + 2):  # the first pair only warms both paths and the cache
            order = [("direct", direct_url), ("routed", routed_url)]
            pair: dict[str, tuple[float, float]] = {}
            for kind, url in order if i % 2 == 0 else order[::-1]:  # ABBA: neither always goes first
                start = time.perf_counter()
                first = None
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if first is None and line.startswith("data: {"):
                            first = time.perf_counter()
                end = time.perf_counter()
                if first is not None:
                    pair[kind] = (1e3 * (first - start), 1e3 * (end - start))
            if i >= 2 and len(pair) == 2:
                pairs.append(pair)

    def median(kind: str, which: int) -> float:
        return statistics.median(p[kind][which] for p in pairs)

    def added(which: int) -> float:
        return statistics.median(p["routed"][which] - p["direct"][which] for p in pairs)

    return RouterLatency(
        direct_ttft_ms=median("direct", 0),
        routed_ttft_ms=median("routed", 0),
        added_ttft_ms=added(0),
        direct_e2e_ms=median("direct", 1),
        routed_e2e_ms=median("routed", 1),
        added_e2e_ms=added(1),
        requests=2 * len(pairs),
    )


def run_scale_out_bench(config: ScaleOutBenchConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every configuration in turn; the report (summaries per configuration, router latency, meta)."""
    from kvserve.clients import Client

    started = dt.datetime.now(dt.UTC)
    extra = shlex.split(config.serve_args)
    runs: list[RunResult] = []
    with tempfile.TemporaryDirectory(prefix="kvserve-scale-out-") as tmp:
        log_dir = Path(tmp)
        single_args = ["--executor", config.executor, *_kv_args(config, config.replicas), *extra]
        progress(f"{SINGLE}: starting with {config.replicas}× the replica KV budget")
        with serving(single_args, log_dir, name="single", timeout_s=config.startup_timeout_s, http=True) as single:
            with Client(single.address) as client:
                info = client.model_info()
            assert single.http_url is not None
            workload = _workload(config, int(info["vocab_size"]))
            runs.append(asyncio.run(_drive(single.http_url, SINGLE, workload, config, config.startup_timeout_s)))
            progress(f"{SINGLE}: done; measuring the router's added latency")
            router_args = ["--policy", "round_robin", "--worker-url", single.http_url]
            with serving_router(router_args, log_dir / "latency-router.log") as routed:
                latency = asyncio.run(
                    _router_latency(
                        single.http_url, routed, info["model_id"], int(info["vocab_size"]), config.latency_requests // 2
                    )
                )
        for policy in config.policies:
            name = f"{config.replicas} replicas, {policy}"
            progress(f"{name}: starting")
            args = ["--router-policy", policy, "--executor", config.executor, *_kv_args(config, 1), *extra]
            with serving_replicas(
                args, log_dir, replicas=config.replicas, timeout_s=config.startup_timeout_s, name=policy
            ) as replica_set:
                runs.append(asyncio.run(_drive(replica_set.url, name, workload, config, config.startup_timeout_s)))
    summaries = [summarize_run(run) for run in runs]
    return {
        "meta": run_meta(config, started, info, workload="multi-prefix", prefixes=config.prefixes),
        "results": summaries,
        "router_latency": asdict(latency),
    }


def render(report: dict[str, Any]) -> str:
    """The table docs/scale-out.md quotes: hit rate against the single replica's, TTFT, throughput."""
    results = report["results"]
    single = next(r for r in results if r["configuration"] == SINGLE)
    lines = [
        f"{'configuration':<28} {'hit rate':>8} {'vs 1 replica':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'out tok/s':>9} {'failed':>6}"
    ]
    for r in results:
        share = r["prefix_cache_hit_rate"] / single["prefix_cache_hit_rate"] if single["prefix_cache_hit_rate"] else 0
        lines.append(
            f"{r['configuration']:<28} {r['prefix_cache_hit_rate']:>8.1%} {share:>12.1%} "
            f"{1e3 * r['ttft']['p50']:>7.0f}ms {1e3 * r['ttft']['p99']:>7.0f}ms "
            f"{r['output_throughput']:>9.1f} {r['num_failed']:>6}"
        )
    lat = report["router_latency"]
    lines.append(
        f"router added latency (median of {lat['requests'] // 2} ABBA pairs' differences, same replica): TTFT "
        f"{lat['added_ttft_ms']:+.1f} ms ({lat['direct_ttft_ms']:.1f} → {lat['routed_ttft_ms']:.1f}), end-to-end "
        f"{lat['added_e2e_ms']:+.1f} ms ({lat['direct_e2e_ms']:.1f} → {lat['routed_e2e_ms']:.1f})"
    )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "scale-out",
        help="replicas behind vllm-router, per policy, against one replica with their whole KV budget",
        description="The multi-prefix workload (K distinct 1,000-token system prompts at random) on one replica "
        "holding N replicas' KV budget, then on N replicas behind vllm-router with each policy, each on fresh "
        "servers; prefix-cache hit rate, TTFT and output tok/s, and the router's added latency. See "
        "docs/scale-out.md.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, ScaleOutBenchConfig, exclude=("command_line",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_report_command(ScaleOutBenchConfig, args, run_scale_out_bench, render)
