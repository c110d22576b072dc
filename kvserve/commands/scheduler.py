"""`kvserve scheduler`: the scheduler service alone (for compose and multi-host set-ups).

It binds the executor link and waits for an executor (`kvserve executor --link ...`) to
connect. The option set here is shared with `kvserve serve`.
"""

from __future__ import annotations

import argparse

from protos import defaults


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """Every ServerConfig option as a flag; defaults come from ServerConfig itself."""
    from scheduler_svc.server.server_config import ServerConfig

    d = ServerConfig()
    api = parser.add_argument_group("gRPC API")
    api.add_argument("--host", default=d.host, help="address the gRPC API listens on")
    api.add_argument("--port", type=int, default=d.port, help="gRPC port (0 picks a free one)")
    api.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help="largest accepted gRPC message")
    api.add_argument("--metrics-port", type=int, default=d.metrics_port,
                     help="serve Prometheus /metrics on this port (0 picks one); None: off")
    security = parser.add_argument_group("API security")
    security.add_argument("--auth-token-file", default=d.auth_token_file,
                          help="file of `TOKEN TENANT` lines; every API call then needs a bearer token")
    security.add_argument("--tls-cert", default=d.tls_cert, help="PEM certificate chain for gRPC TLS")
    security.add_argument("--tls-key", default=d.tls_key, help="PEM private key for gRPC TLS")
    security.add_argument("--tls-client-ca", default=d.tls_client_ca,
                          help="PEM CA bundle; clients must then present a certificate it signed")
    security.add_argument("--allow-insecure-remote", action="store_true",
                          help="listen on a non-loopback --host without --auth-token-file")
    link = parser.add_argument_group("executor link")
    link.add_argument("--allow-remote-link", action="store_true",
                      help="allow a non-loopback tcp link endpoint (a private network you chose)")
    link.add_argument("--curve-secret-key", metavar="FILE", default=d.curve_secret_key,
                      help="this scheduler's CURVE certificate (NAME.key_secret); encrypts and authenticates "
                           "a tcp link (executors then need --curve-server-key with its public NAME.key)")
    link.add_argument("--curve-executor-key", metavar="FILE", dest="curve_executor_keys", action="append",
                      default=list(d.curve_executor_keys),
                      help="public certificate (NAME.key) of an executor allowed to register; repeat for "
                           "several; none: any executor holding our public key")
    link.add_argument("--step-timeout-s", type=float, default=d.step_timeout_s,
                      help="a step unanswered this long (heartbeats alive) loses the executor")
    link.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                      help="heartbeat period on the executor link")
    link.add_argument("--executor-dead-after-s", type=float, default=d.executor_dead_after_s,
                      help="an executor silent this long is declared lost")
    link.add_argument("--executor-start-timeout", type=float, default=d.executor_start_timeout_s,
                      help="seconds to wait for the first executor; None: forever")
    link.add_argument("--executor-restart-timeout", type=float, default=d.executor_restart_timeout_s,
                      help="seconds a lost executor may take to come back before requests fail UNAVAILABLE")
    link.add_argument("--executor-losses-per-request", type=int, default=d.executor_losses_per_request,
                      help="a request in flight through this many executor losses fails UNAVAILABLE "
                           "instead of being recomputed again")
    sched = parser.add_argument_group("scheduling")
    sched.add_argument("--max-model-len", type=int, default=d.max_model_len,
                       help="cap on the context length; None: the executor's max_model_len")
    sched.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                       help="token budget per step")
    sched.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    sched.add_argument("--preemption-mode", choices=("recompute", "swap"), default=d.preemption_mode,
                       help="how running sequences give up memory under pressure")
    sched.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="disable the radix prefix cache (the default shown is whether caching is on)")
    sched.add_argument("--cache-aware-order", action="store_true",
                       help="admit the longest prefix-cache hit first within a priority")
    sched.add_argument("--debug-invariants", action="store_true",
                       help="check the KV block invariants after every step (slow)")
    queue = parser.add_argument_group("admission and shutdown")
    queue.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                       help="queued requests before RESOURCE_EXHAUSTED")
    queue.add_argument("--max-queued-prompt-tokens", type=int, default=d.max_queued_prompt_tokens,
                       help="queued prompt tokens before RESOURCE_EXHAUSTED")
    queue.add_argument("--stream-buffer-chunks", type=int, default=d.stream_buffer_chunks,
                       help="chunks buffered per stream before a slow reader's chunks are merged")
    queue.add_argument("--drain-grace-s", type=float, default=d.drain_grace_s,
                       help="on SIGTERM, seconds in-flight requests get to finish")


def server_config_from_args(args: argparse.Namespace, *, link: str = ""):
    from scheduler_svc.server.server_config import ServerConfig

    return ServerConfig(
        host=args.host, port=args.port, max_request_bytes=args.max_request_bytes, metrics_port=args.metrics_port,
        curve_secret_key=args.curve_secret_key, curve_executor_keys=tuple(args.curve_executor_keys),
        auth_token_file=args.auth_token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca, allow_insecure_remote=args.allow_insecure_remote, link=link,
        allow_remote_link=args.allow_remote_link, step_timeout_s=args.step_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval_s, executor_dead_after_s=args.executor_dead_after_s,
        executor_start_timeout_s=args.executor_start_timeout,
        executor_restart_timeout_s=args.executor_restart_timeout,
        executor_losses_per_request=args.executor_losses_per_request, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        preemption_mode=args.preemption_mode, enable_prefix_caching=args.enable_prefix_caching,
        cache_aware_order=args.cache_aware_order, debug_invariants=args.debug_invariants,
        max_queued_requests=args.max_queued_requests, max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        stream_buffer_chunks=args.stream_buffer_chunks, drain_grace_s=args.drain_grace_s)


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvserve.cli import HelpFormatter

    parser = subparsers.add_parser(
        "scheduler", help="run the scheduler service alone; an executor connects to --link",
        description="The CPU scheduler and gRPC API without a supervised executor. Start executors with "
                    "`kvserve executor --link ENDPOINT`. A tcp link off loopback should use a private network.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--link", default=f"tcp://127.0.0.1:{defaults.LINK_TCP_PORT}",
                        help="ZeroMQ endpoint to bind for the executor (tcp://HOST:PORT or ipc://PATH)")
    add_server_options(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from protos.log_config import configure_logging
    from scheduler_svc.server.service import run_service

    configure_logging(process="scheduler")
    config = server_config_from_args(args, link=args.link)
    return asyncio.run(run_service(config))
