"""`kvserve bench serve`'s flags: the workloads, the load, the servers, the baselines and targets.

One `BenchConfig` is one run; `serve.py` runs it, and `run_meta.py` records it in the report's meta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvserve.bench import workloads as wl
from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.testing.server_launcher import DEFAULT_STARTUP_TIMEOUT_S

BASELINES = ("hf", "no-cache", "prealloc")
APIS = ("grpc", "openai")


@dataclass(slots=True)
class BenchConfig:
    """One `bench serve` run; each field but `command_line` is a `kvserve bench serve` flag."""

    workloads: tuple[str, ...] = field(
        default=("mixed",),
        metadata=flag(
            "mixed: 64-512 prompt, 32-256 output; shared-prefix: 1,500-token system prompt + 50-300-token "
            "questions; multi-turn: chats up to 10 turns; cold-warm: the shared-prefix requests on an empty "
            "then a primed cache; multi-prefix: 8 distinct 1,000-token system prompts at random (for replicas "
            "behind a router: --target ROUTER, or bench scale-out); copy: real editing requests whose answers copy "
            "their prompts (repeat, rewrite, fix spelling, fix a bug; for --speculative); all: every one",
            name="--workload",
            nargs="+",
            choices=(*wl.WORKLOAD_NAMES, "all"),
        ),
    )
    num_requests: int = field(default=32, metadata=flag("requests per workload"))
    concurrency: int | None = field(default=16, metadata=flag("most requests in flight (0: no limit)"))
    request_rate: float | None = field(
        default=None, metadata=flag("Poisson arrival rate in requests/s (unset or inf: all arrive at once)")
    )
    seed: int = field(default=0, metadata=flag("seed of the workloads and the arrivals"))
    max_tokens_cap: int | None = field(
        default=None,
        metadata=flag("cap every request's max_tokens (unset or 0: the workload's own lengths); for short CPU runs"),
    )
    start_server: bool = field(
        default=False, metadata=flag("start kvserve serve (and the no-cache server) as subprocesses on free ports")
    )
    executor: str = field(default="torch", metadata=flag("executor of the started servers", choices=("torch", "fake")))
    host: str = field(default=defaults.GRPC_HOST, metadata=flag("server host (started servers listen here too)"))
    port: int = field(default=defaults.GRPC_PORT, metadata=flag("port of an already running server"))
    server_args: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "extra argument passed to every started server, e.g. --server-arg=--num-blocks=512 (repeatable)",
            name="--server-arg",
            metavar="ARG",
        ),
    )
    no_cache_target: str | None = field(
        default=None,
        metadata=flag(
            "an already running server with --no-prefix-caching; when unset, one is started with "
            "--start-server, else that baseline is skipped",
            metavar="HOST:PORT",
        ),
    )
    baselines: tuple[str, ...] = field(
        default=BASELINES,
        metadata=flag(
            "baselines to run in the same run; prealloc: the contiguous-preallocation estimate, and with "
            "--start-server a server run for real with --kv-reservation max-model-len --no-prefix-caching "
            "(--max-model-len = each workload's longest request), shown as three tiers with the two paged ones",
            nargs="*",
            choices=BASELINES,
        ),
    )
    model: str = field(
        default=defaults.DEFAULT_MODEL,
        metadata=flag("model the hf baseline loads; its tokenizer also decodes text prompts for --target"),
    )
    hf_batch_size: int = field(default=8, metadata=flag("static batch size of the hf baseline"))
    progress: bool = field(default=True, metadata=flag("show a progress bar"))
    startup_timeout_s: float = field(
        default=DEFAULT_STARTUP_TIMEOUT_S, metadata=flag("seconds to wait for SERVING", name="--startup-timeout")
    )
    api: str = field(
        default="grpc",
        metadata=flag(
            "how kvserve is driven: grpc (the async client) or openai (streaming /v1/completions on its HTTP API, "
            "the fair side of a comparison with --target); server counters come from gRPC either way",
            choices=APIS,
        ),
    )
    http_port: int = field(
        default=defaults.HTTP_PORT,
        metadata=flag("with --api openai and no --start-server: the HTTP port of the already running server on --host"),
    )
    targets: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "another OpenAI-compatible server measured in the same run with the same requests, after kvserve's "
            "servers have stopped (repeatable), e.g. llama-server=http://127.0.0.1:8080 (see "
            "scripts/llama_server.sh). Prompts go as token ids, or as text decoded with the model's tokenizer; "
            "default: probe on the warm-up request. Every workload but cold-warm",
            name="--target",
            metavar="NAME=URL[,tokens|,text]",
        ),
    )
    sweep: str | None = field(
        default=None,
        metadata=flag(
            "run the workload once per value of one kvserve serve flag, each on a fresh server started with "
            "--FLAG V (after every --server-arg), e.g. block-size=8,16,32; prints one table of output tok/s, "
            "TTFT p50/p99, ITL p99, KV partial-block waste and peak running against the value (--json, --plot "
            "too). Starts its servers itself; baselines and --target do not run",
            metavar="FLAG=V1,V2,...",
        ),
    )
    command_line: str = ""
    """How the run was invoked, recorded in the report's meta (not a flag)."""

    def __post_init__(self) -> None:
        # One spelling per meaning in the report's meta: "all" is every workload, 0 or inf is no limit.
        if "all" in self.workloads:
            self.workloads = tuple(wl.WORKLOAD_NAMES)
        if self.concurrency == 0:
            self.concurrency = None
        if self.request_rate is not None and math.isinf(self.request_rate):
            self.request_rate = None
        if self.max_tokens_cap == 0:
            self.max_tokens_cap = None
