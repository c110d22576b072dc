"""Every option of the scheduler service, with its default, in one dataclass.

`kvserve serve` and `kvserve scheduler` build their flags from these defaults, so
`--help` and the service always agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from protos import defaults


@dataclass(slots=True)
class ServerConfig:
    # --- gRPC API
    host: str = defaults.GRPC_HOST
    port: int = defaults.GRPC_PORT
    max_request_bytes: int = defaults.MAX_REQUEST_BYTES
    metrics_port: int | None = None
    """Serve Prometheus /metrics on this port (same host as the API); None: off."""

    # --- API security (scheduler_svc.server.auth, .tls, .bind_policy)
    auth_token_file: str | None = None
    """`TOKEN TENANT` lines; when set, every KVServe call needs `authorization: Bearer TOKEN`."""
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    """With a client CA, clients must present certificates it signed."""
    allow_insecure_remote: bool = False
    """Permit a non-loopback --host without auth (something in front authenticates)."""

    # --- executor link
    link: str = ""
    """ZeroMQ endpoint the scheduler binds and the executor connects to; "" = ipc in a private runtime dir."""
    allow_remote_link: bool = False
    """Permit a non-loopback tcp link (a private network the operator chose)."""
    curve_secret_key: str | None = None
    """The scheduler's CURVE certificate (NAME.key_secret); turns CURVE on for a tcp link."""
    curve_executor_keys: tuple[str, ...] = ()
    """Public certificates (NAME.key) of the executors allowed in; empty: any that knows our public key."""
    heartbeat_interval_s: float = defaults.LINK_HEARTBEAT_INTERVAL_S
    executor_dead_after_s: float = defaults.EXECUTOR_DEAD_AFTER_S
    step_timeout_s: float | None = defaults.STEP_TIMEOUT_S
    executor_start_timeout_s: float | None = None
    """How long to wait for the first executor at start-up; None waits forever."""
    executor_restart_timeout_s: float = defaults.EXECUTOR_RESTART_TIMEOUT_S
    executor_losses_per_request: int = defaults.EXECUTOR_LOSSES_PER_REQUEST
    """Executor losses a request may live through before it fails UNAVAILABLE (poison-request guard)."""

    # --- scheduling
    max_model_len: int | None = None
    """Cap on the context; None uses the executor's max_model_len."""
    max_num_batched_tokens: int = defaults.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    preemption_mode: str = "recompute"
    enable_prefix_caching: bool = True
    cache_aware_order: bool = False
    debug_invariants: bool = False

    # --- admission and streaming
    max_queued_requests: int = defaults.MAX_QUEUED_REQUESTS
    max_queued_prompt_tokens: int = defaults.MAX_QUEUED_PROMPT_TOKENS
    stream_buffer_chunks: int = defaults.STREAM_BUFFER_CHUNKS

    # --- shutdown
    drain_grace_s: float = defaults.DRAIN_GRACE_S
