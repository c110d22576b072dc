"""`kvserve bench speculative`: speculative decoding against none, per workload and concurrency, in one run.

For each concurrency level and each method (`off` first), a fresh `kvserve serve --speculative
METHOD` runs every workload over its OpenAI HTTP API with the same driver as `bench serve
--target`, so every configuration gets the same requests, greedy, each starting from a cold
prefix cache and an empty suffix index. Then every `--target` (an OpenAI-compatible server such
as llama-server, started with its own speculative setting) runs the same requests.

Per row: output tok/s and its ratio to `off` at the same workload and concurrency, TPOT p50
(per-token latency, the figure a token burst does not distort; ITL is per streamed chunk and
grows when a chunk carries several accepted tokens), TTFT p50, the share of draft tokens
accepted and the tokens each verifying step yielded (from the server's `ServerStats`
counters), and whether every reply's text equals `off`'s: greedy output must be the same.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.bench import workloads as wl
from kvserve.bench.copy_workload import ModelTextEncoder
from kvserve.bench.load_driver import RunResult, run_workload
from kvserve.bench.openai_driver import HttpTarget, OpenAIDriver
from kvserve.bench.report import summarize_run
from kvserve.bench.report_command import run_report_command
from kvserve.bench.run_meta import run_meta
from kvserve.config import defaults
from kvserve.config.flags import HelpFormatter, add_flags, flag
from kvserve.testing.server_launcher import serving

OFF = "off"
DRAFT_COUNTERS = ("draft_tokens_proposed", "draft_tokens_accepted", "draft_verify_steps")


@dataclass(slots=True)
class SpeculativeBenchConfig:
    """`kvserve bench speculative`'s flags."""

    methods: tuple[str, ...] = field(
        default=("ngram", "suffix"),
        metadata=flag(
            f"--speculative methods to measure, of {', '.join(defaults.SPECULATIVE_METHODS)} (off is always "
            "measured, first; draft needs --draft-model)",
            nargs="+",
        ),
    )
    draft_model: str | None = field(
        default=None, metadata=flag("the draft model of the draft method's servers (kvserve serve --draft-model)")
    )
    workloads: tuple[str, ...] = field(
        default=("copy", "mixed"),
        metadata=flag(
            "copy: editing requests whose answers copy their prompts; mixed: random-token prompts, nothing to copy",
            name="--workload",
            nargs="+",
            choices=wl.WORKLOAD_NAMES,
        ),
    )
    concurrency: tuple[int, ...] = field(
        default=(1, 4, 16), metadata=flag("concurrency levels, each on fresh servers", nargs="+")
    )
    num_requests: int = field(
        default=8, metadata=flag("requests per workload at concurrency 1; at least 2 per stream at higher levels")
    )
    max_tokens_cap: int | None = field(default=128, metadata=flag("cap every request's max_tokens (0: none)"))
    seed: int = field(default=0, metadata=flag("seed of the workloads"))
    executor: str = field(default="torch", metadata=flag("executor of every server", choices=("torch", "fake")))
    serve_args: str = field(default="", metadata=flag("more `kvserve serve` options for every server, shell-quoted"))
    targets: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "another OpenAI-compatible server run on the same requests after kvserve's (repeatable), e.g. "
            "llama-server-ngram=http://127.0.0.1:8080 started with its own speculative flags; it needs a slot "
            "per stream of the highest --concurrency",
            name="--target",
            metavar="NAME=URL",
        ),
    )
    model: str = field(default=defaults.DEFAULT_MODEL, metadata=flag("model whose tokenizer renders `copy`"))
    startup_timeout_s: float = field(default=600.0, metadata=flag("seconds to wait for each server to serve"))
    progress: bool = field(default=True, metadata=flag("show a progress bar"))
    json: bool = field(default=False, metadata=flag("print the report as JSON"))
    command_line: str = ""
    """How the run was invoked, for the report's meta (not a flag)."""

    def __post_init__(self) -> None:
        unknown = set(self.methods) - set(defaults.SPECULATIVE_METHODS)
        if unknown:
            raise ValueError(f"--methods: unknown {sorted(unknown)}; choose from {defaults.SPECULATIVE_METHODS}")
        self.methods = (OFF, *(m for m in self.methods if m != OFF))
        if "draft" in self.methods and not self.draft_model:
            raise ValueError("--methods draft needs --draft-model")
        if self.max_tokens_cap == 0:
            self.max_tokens_cap = None
        if any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency levels must be at least 1")

    @property
    def api(self) -> str:
        """Every configuration is driven over the OpenAI HTTP API (run_meta records it)."""
        return "openai"

    def requests_at(self, concurrency: int) -> int:
        return max(self.num_requests, 2 * concurrency)


@dataclass(slots=True)
class Row:
    """One workload at one concurrency on one configuration."""

    configuration: str
    workload: str
    concurrency: int
    summary: dict[str, Any]
    drafts: dict[str, int] | None
    """The server's draft counters over this run (None: not a kvserve server)."""
    texts: dict[str, str]
    """Reply text per session id."""


def _draft_counts(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    return {key: int(after.get(key) or 0) - int(before.get(key) or 0) for key in DRAFT_COUNTERS}


async def _drive(
    url: str, name: str, workload: wl.Workload, concurrency: int, config: SpeculativeBenchConfig
) -> RunResult:
    async with OpenAIDriver(url, name=name, prompt_mode="tokens") as http:
        await http.wait_ready(config.startup_timeout_s)
        await http.warm_up(workload.sessions[0].turns[0].new_token_ids)
        return await run_workload(
            None,
            workload,
            configuration=name,
            concurrency=concurrency,
            request_rate=None,
            seed=config.seed,
            progress=config.progress,
            send_turn=http.send_turn,
        )


def _row(run: RunResult, concurrency: int, drafts: dict[str, int] | None) -> Row:
    texts = {record.session_id: record.output_text for record in run.records}
    return Row(run.configuration, run.workload, concurrency, summarize_run(run), drafts, texts)


def _workloads(config: SpeculativeBenchConfig, vocab_size: int, concurrency: int) -> list[wl.Workload]:
    def model_dir() -> Path:
        from kvserve.executor.weights.model_store import ensure_model_dir

        return ensure_model_dir(config.model)

    encoder = ModelTextEncoder(model_dir)
    n = config.requests_at(concurrency)
    return [
        w
        for name in config.workloads
        for w in wl.build(name, n, vocab_size, config.seed, config.max_tokens_cap, encoder)
    ]


def run_speculative_bench(config: SpeculativeBenchConfig, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every concurrency level, method and target in turn; the report (rows and meta)."""
    from kvserve.clients import Client

    started = dt.datetime.now(dt.UTC)
    extra = shlex.split(config.serve_args)
    targets = [HttpTarget.parse(spec) for spec in config.targets]
    rows: list[Row] = []
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-speculative-") as tmp:
        for concurrency in config.concurrency:
            loads: list[wl.Workload] = []
            for method in config.methods:
                name = f"kvserve {method}"
                progress(f"concurrency {concurrency}: {name}: starting")
                args = ["--executor", config.executor, "--speculative", method, *extra]
                if method == "draft":
                    assert config.draft_model is not None
                    args += ["--draft-model", config.draft_model]
                with serving(
                    args, Path(tmp), name=f"{method}-c{concurrency}", timeout_s=config.startup_timeout_s, http=True
                ) as server:
                    assert server.http_url is not None
                    with Client(server.address) as client:
                        info = info or client.model_info()
                        loads = loads or _workloads(config, int(info["vocab_size"]), concurrency)
                        for workload in loads:
                            before = client.server_stats()
                            run = asyncio.run(_drive(server.http_url, name, workload, concurrency, config))
                            rows.append(_row(run, concurrency, _draft_counts(before, client.server_stats())))
            for target in targets:
                progress(f"concurrency {concurrency}: {target.name}")
                for workload in loads:
                    run = asyncio.run(_drive(target.url, target.name, workload, concurrency, config))
                    rows.append(_row(run, concurrency, None))
    return {
        "meta": run_meta(config, started, info, workload=",".join(config.workloads)),
        "results": [_result(row, rows) for row in rows],
    }


def _result(row: Row, rows: list[Row]) -> dict[str, Any]:
    """A row's summary with its speculative figures and its comparison with `off` at the same level."""
    off = next(
        r
        for r in rows
        if r.configuration == f"kvserve {OFF}" and (r.workload, r.concurrency) == (row.workload, row.concurrency)
    )
    result = dict(row.summary)
    result["concurrency"] = row.concurrency
    base = off.summary["output_throughput"]
    result["vs_off"] = row.summary["output_throughput"] / base if base else None
    if row.drafts is not None:
        proposed, accepted, verify_steps = (row.drafts[key] for key in DRAFT_COUNTERS)
        result["drafts"] = row.drafts
        result["acceptance"] = accepted / proposed if proposed else None
        result["tokens_per_verify_step"] = (accepted + verify_steps) / verify_steps if verify_steps else None
        different = [s for s, text in row.texts.items() if off.texts.get(s) != text]
        result["same_text_as_off"] = not different
        result["different_sessions"] = different[:5]
    return result


def render(report: dict[str, Any]) -> str:
    """One table per workload: configurations by concurrency."""
    lines = []
    results = report["results"]
    for workload in dict.fromkeys(r["workload"] for r in results):
        lines.append(f"workload {workload}")
        lines.append(
            f"{'configuration':<26} {'conc':>4} {'out tok/s':>9} {'vs off':>7} {'TPOT p50':>9} {'TTFT p50':>9} "
            f"{'accepted':>8} {'tok/verify':>10} {'same text':>9} {'failed':>6}"
        )
        for r in (r for r in results if r["workload"] == workload):
            acceptance = r.get("acceptance")
            per_step = r.get("tokens_per_verify_step")
            same = r.get("same_text_as_off")
            lines.append(
                f"{r['configuration']:<26} {r['concurrency']:>4} {r['output_throughput']:>9.1f} "
                f"{(r['vs_off'] or 0):>6.2f}x {1e3 * r['tpot']['p50']:>7.1f}ms {1e3 * r['ttft']['p50']:>7.0f}ms "
                f"{'-' if acceptance is None else f'{acceptance:.1%}':>8} "
                f"{'-' if per_step is None else f'{per_step:.2f}':>10} "
                f"{'-' if same is None else ('yes' if same else 'NO'):>9} {r['num_failed']:>6}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "speculative",
        help="speculative decoding methods against off, per workload and concurrency, on fresh servers",
        description="Each --speculative method (and off) on fresh servers at each concurrency level, on the copy "
        "workload (answers that copy their prompts) and mixed (nothing to copy): output tok/s against off, TPOT, "
        "TTFT, draft acceptance, and whether the greedy text equals off's. --target adds another server, e.g. "
        "llama-server with its own speculative flags. See docs/benchmarks.md.",
        formatter_class=HelpFormatter,
    )
    add_flags(parser, SpeculativeBenchConfig, exclude=("command_line",))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return run_report_command(SpeculativeBenchConfig, args, run_speculative_bench, render)
