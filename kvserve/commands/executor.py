"""`kvserve executor`: run the executor process alone, connected to a scheduler's link.

Every `RunnerConfig` field is a flag (generated from the dataclass, so a new field gets a
flag without touching this file); the fake executor's knobs and the link's timing and
security options complete the set. `python -m kvserve.commands.executor` runs the same
command without building the whole `kvserve` parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from protos import defaults

RUNNER_FLAG_HELP = {
    "model": "the default model's name, an HF model directory, or a .gguf file",
    "device": "cpu, cuda, cuda:N, or auto (cuda when available)",
    "dtype": "float32, bfloat16, float16, or auto (float32 on cpu, bfloat16 on cuda)",
    "attention_backend": "torch, triton, or auto (triton on cuda, torch on cpu)",
    "block_size": "tokens per KV block",
    "kv_cache_gb": f"KV cache budget in GiB; None: {defaults.KV_CACHE_GB_CPU} on cpu, and on cuda "
                   "what --gpu-memory-utilization leaves",
    "gpu_memory_utilization": "fraction of GPU memory kvserve may use in total (cuda)",
    "swap_space_gb": "CPU swap space in GiB for swap-preemption (0 disables it)",
    "max_num_batched_tokens": "largest step, in tokens (sizes the CUDA profiling pass)",
    "max_num_seqs": "most sequences in one step",
    "max_model_len": "longest context; None: the model's max_position_embeddings",
    "num_threads": "torch intra-op threads on cpu; None: every usable core, less one for the scheduler above 4 cores",
}
_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
DESCRIPTION = ("Run the model (or the fake executor) in this process and serve step plans from a "
               "scheduler over ZeroMQ. The executor connects to the scheduler's link endpoint, "
               "exits when the scheduler says so or vanishes, and never outlives it.")
EPILOG = ("exit codes: 0 shut down by the scheduler or by SIGTERM/SIGINT; 3 the scheduler vanished "
          "(silent for --scheduler-timeout-s); 4 no scheduler answered within --connect-timeout-s; "
          "2 bad options")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "executor", help="run an executor that registers with a scheduler's link",
        description=DESCRIPTION, epilog=EPILOG, formatter_class=HelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from protos.link_endpoint import default_tcp_endpoint
    from executor_svc.fake_executor import FakeExecutorConfig
    from executor_svc.runner_config import RunnerConfig

    parser.add_argument("--executor", choices=("torch", "fake"), default="torch",
                        help="torch runs the model; fake emits deterministic tokens without a model (tests)")
    link = parser.add_argument_group("link")
    link.add_argument("--link", default=default_tcp_endpoint(), metavar="ENDPOINT",
                      help="the scheduler's ZeroMQ endpoint: ipc://PATH or tcp://HOST:PORT")
    link.add_argument("--allow-remote-link", action="store_true",
                      help="allow a tcp link to a non-loopback address (use CURVE keys or a private network)")
    link.add_argument("--heartbeat-interval-s", type=float, default=defaults.LINK_HEARTBEAT_INTERVAL_S,
                      help="send a heartbeat this often, also during long steps")
    link.add_argument("--scheduler-timeout-s", type=float, default=defaults.SCHEDULER_TIMEOUT_S,
                      help="exit (or re-register) after hearing nothing from the scheduler this long")
    link.add_argument("--connect-timeout-s", type=float, default=defaults.EXECUTOR_CONNECT_TIMEOUT_S,
                      help="exit if no scheduler acknowledges the handshake within this time (0: wait forever)")
    link.add_argument("--reregister", action="store_true",
                      help="when the scheduler vanishes, reset and wait to register with the next one "
                           "instead of exiting")
    link.add_argument("--curve-secret-key", metavar="FILE", default=None,
                      help="this executor's CURVE certificate (NAME.key_secret); turns CURVE on")
    link.add_argument("--curve-server-key", metavar="FILE", default=None,
                      help="the scheduler's public CURVE certificate (NAME.key); required with CURVE")

    runner = parser.add_argument_group("model runner (--executor torch)")
    for f in dataclasses.fields(RunnerConfig):
        kind, optional = _parse_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is dataclasses.MISSING else f.default
        if f.name == "model":
            default = defaults.DEFAULT_MODEL
        runner.add_argument(flag, dest=f.name, type=kind, default=default,
                            help=RUNNER_FLAG_HELP.get(f.name, f"RunnerConfig.{f.name}")
                            + (" (also used by the fake executor)" if f.name in _SHARED_WITH_FAKE else ""))

    fake_defaults = FakeExecutorConfig()
    fake = parser.add_argument_group("fake executor (--executor fake)")
    fake.add_argument("--num-blocks", type=int, default=fake_defaults.num_blocks, help="KV blocks")
    fake.add_argument("--num-cpu-blocks", type=int, default=fake_defaults.num_cpu_blocks,
                      help="CPU swap blocks (0: no swap-preemption)")
    fake.add_argument("--vocab-size", type=int, default=None,
                      help="vocabulary size (default: the model's config.json)")
    fake.add_argument("--tokenizer-path", default=None,
                      help="directory with tokenizer.json reported to the scheduler (default: --model's directory)")
    fake.add_argument("--step-latency-ms", type=float, default=fake_defaults.step_latency_ms,
                      help="minimum duration of each step")
    fake.add_argument("--eos-probability", type=float, default=fake_defaults.eos_probability,
                      help="deterministic chance that a sampled token is eos (0: never)")


_SHARED_WITH_FAKE = ("model", "block_size", "max_model_len")


def run(args: argparse.Namespace) -> int:
    from protos.log_config import configure_logging
    from executor_svc.link_worker import LinkWorkerConfig
    from executor_svc.process import run_executor

    from protos.link_endpoint import LinkEndpointError, check_endpoint

    configure_logging(process="executor")
    try:
        check_endpoint(args.link, allow_remote=args.allow_remote_link)
    except LinkEndpointError as exc:
        print(f"kvserve executor: {exc}", file=sys.stderr)
        return 2
    curve = None
    if args.curve_secret_key or args.curve_server_key:
        if not (args.curve_secret_key and args.curve_server_key):
            print("kvserve executor: CURVE needs both --curve-secret-key and --curve-server-key", file=sys.stderr)
            return 2
        from protos.link_curve import load_keys

        curve = load_keys(args.curve_secret_key, [args.curve_server_key])
    link = LinkWorkerConfig(
        endpoint=args.link, heartbeat_interval_s=args.heartbeat_interval_s,
        scheduler_timeout_s=args.scheduler_timeout_s, connect_timeout_s=args.connect_timeout_s,
        reregister=args.reregister, allow_remote=args.allow_remote_link, curve_keys=curve,
    )
    if args.executor == "fake":
        return run_executor("fake", link, fake=fake_config_from_args(args))
    return run_executor("torch", link, runner=runner_config_from_args(args))


def runner_config_from_args(args: argparse.Namespace):
    from executor_svc.runner_config import RunnerConfig

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunnerConfig)}
    return RunnerConfig(**values)


def fake_config_from_args(args: argparse.Namespace):
    from executor_svc.fake_executor import FakeExecutorConfig
    from executor_svc.model_store import ensure_model_dir

    tokenizer_path = args.tokenizer_path or str(ensure_model_dir(args.model))
    return FakeExecutorConfig(
        num_blocks=args.num_blocks, block_size=args.block_size, num_cpu_blocks=args.num_cpu_blocks,
        max_model_len=args.max_model_len, vocab_size=args.vocab_size, tokenizer_path=tokenizer_path,
        step_latency_ms=args.step_latency_ms, eos_probability=args.eos_probability,
    )


def _parse_type(annotation: object) -> tuple[type, bool]:
    """`int`, `"float | None"` ... -> (argparse type, optional); annotations are strings here."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    parts = [p.strip() for p in text.split("|")]
    optional = "None" in parts
    names = [p for p in parts if p != "None"]
    if len(names) != 1 or names[0] not in _TYPES:
        raise TypeError(f"RunnerConfig field type {text!r} has no CLI mapping; extend _TYPES")
    kind = _TYPES[names[0]]
    return (_parse_bool if kind is bool else kind), optional


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    """Run `kvserve executor` without the rest of the CLI (used by tests and `python -m`)."""
    from kvserve.cli import HelpFormatter

    parser = argparse.ArgumentParser(prog="kvserve executor", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
