"""Every option of the scheduler service, with its default and help, in one dataclass.

`kvserve serve` and `kvserve scheduler` generate their flags from these fields
(kvserve.config.flags), so a new option is one field here and `--help` and the service
always agree. The scheduling-policy fields mirror `SchedulerConfig` by name: their default
and help are read from there (`_policy`), and `scheduling_policy()` hands them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.config import defaults
from kvserve.config.flags import flag
from kvserve.scheduler.core import SchedulerConfig
from kvserve.scheduler.server.intake.generation_defaults import SOURCE_AUTO
from kvserve.scheduler.server.tools.tool_formats import FORMATS

_API = "gRPC API"
_HTTP = "OpenAI-compatible HTTP API"
_SECURITY = "API security"
_LINK = "executor link"
_SCHEDULING = "scheduling"
_QUEUE = "admission and shutdown"
_KV_EVENTS = "KV events"
_SCHEDULER_FIELDS = {f.name: f for f in fields(SchedulerConfig)}


def _policy(name: str, **spelling: str) -> Any:
    """A field that is `SchedulerConfig.<name>` as the server sets it: same default and help."""
    source = _SCHEDULER_FIELDS[name]
    return field(default=source.default, metadata={**source.metadata, "group": _SCHEDULING, **spelling})


@dataclass(slots=True)
class ServerConfig:
    # --- gRPC API
    host: str = field(default=defaults.GRPC_HOST, metadata=flag("address the gRPC API listens on", group=_API))
    port: int = field(default=defaults.GRPC_PORT, metadata=flag("gRPC port (0 picks a free one)", group=_API))
    max_request_bytes: int = field(
        default=defaults.MAX_REQUEST_BYTES,
        metadata=flag("largest accepted request: a gRPC message or an HTTP body (413 beyond)", group=_API),
    )
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "serve Prometheus /metrics on this port, same host as the API (0 picks one); None: off", group=_API
        ),
    )

    # --- OpenAI-compatible HTTP API (kvserve.scheduler.server.http), same engine, security and limits as gRPC
    http_host: str | None = field(
        default=None,
        metadata=flag(
            "address the HTTP API listens on; None: the same as --host (the same bind policy applies)", group=_HTTP
        ),
    )
    http_port: int = field(
        default=defaults.HTTP_PORT,
        metadata=flag("port of the HTTP API (/v1/chat/completions, /v1/completions, ...); 0: HTTP off", group=_HTTP),
    )
    served_model_name: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "another name the HTTP API accepts as `model` and lists in /v1/models, beside the model id; "
            "repeat for several",
            metavar="NAME",
            group=_HTTP,
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=flag(
            "a Jinja chat template file that replaces the model's own (for chat prompts, tools and tool turns)",
            metavar="FILE",
            group=_API,
        ),
    )
    tool_call_format: str = field(
        default=defaults.TOOL_CALL_FORMAT,
        metadata=flag(
            "how tool calls are written, forced and parsed; its fallback template renders tools when the chat "
            "template does not (hermes: <tool_call> JSON on ChatML turns)",
            choices=tuple(FORMATS),
            group=_API,
        ),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "without --auth-token-file the HTTP API answers only requests whose Host is a loopback name or "
            "address or --http-host (DNS rebinding defence); this adds another name, repeat for several, "
            "'*' for any",
            metavar="NAME",
            group=_HTTP,
        ),
    )
    cors_origin: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a web origin (scheme://host[:port]) whose pages may call the HTTP API (CORS); repeat for several; "
            "'*' only with --auth-token-file. None given: CORS off",
            metavar="ORIGIN",
            group=_HTTP,
        ),
    )

    ui: bool = field(
        default=True,
        metadata=flag(
            "the web page at / on the HTTP port (a chat playground and a live view of the KV blocks, prefix "
            "tree and steps) and its /ui/events stream; --no-ui: both off",
            group=_HTTP,
        ),
    )
    ui_interval_s: float = field(
        default=defaults.UI_INTERVAL_S,
        metadata=flag(
            f"seconds between engine-view updates (at least {defaults.UI_MIN_INTERVAL_S})",
            name="--ui-interval",
            group=_HTTP,
        ),
    )
    ui_admin_tenant: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a tenant of --auth-token-file whose page sees every tenant's requests and prompt text (others see "
            "their own, and anonymous cells); repeat for several",
            metavar="TENANT",
            group=_HTTP,
        ),
    )

    # --- API security (kvserve.scheduler.server.security.auth, .tls, .bind_policy)
    auth_token_file: str | None = field(
        default=None,
        metadata=flag(
            "file of `TOKEN TENANT` lines; every API call then needs `authorization: Bearer TOKEN`", group=_SECURITY
        ),
    )
    tls_cert: str | None = field(
        default=None, metadata=flag("PEM certificate chain for TLS (gRPC and HTTP)", group=_SECURITY)
    )
    tls_key: str | None = field(default=None, metadata=flag("PEM private key for TLS (gRPC and HTTP)", group=_SECURITY))
    tls_client_ca: str | None = field(
        default=None, metadata=flag("PEM CA bundle; clients must then present a certificate it signed", group=_SECURITY)
    )
    allow_insecure_remote: bool = field(
        default=False,
        metadata=flag(
            "listen on a non-loopback --host without --auth-token-file (something in front authenticates)",
            group=_SECURITY,
        ),
    )

    # --- executor link
    link: str = field(
        default="",
        metadata=flag(
            "ZeroMQ endpoint the scheduler binds and the executor connects to (tcp://HOST:PORT or ipc://PATH); "
            "empty: an ipc socket in a private runtime dir",
            metavar="ENDPOINT",
            group=_LINK,
        ),
    )
    allow_remote_link: bool = field(
        default=False,
        metadata=flag("allow a non-loopback tcp link endpoint (a private network you chose)", group=_LINK),
    )
    curve_secret_key: str | None = field(
        default=None,
        metadata=flag(
            "this scheduler's CURVE certificate (NAME.key_secret); encrypts and authenticates a tcp link "
            "(executors then need --curve-server-key with its public NAME.key)",
            metavar="FILE",
            group=_LINK,
        ),
    )
    curve_executor_keys: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "public certificate (NAME.key) of an executor allowed to register; repeat for several; "
            "none: any executor holding our public key",
            name="--curve-executor-key",
            metavar="FILE",
            group=_LINK,
        ),
    )
    heartbeat_interval_s: float = field(
        default=defaults.LINK_HEARTBEAT_INTERVAL_S, metadata=flag("heartbeat period on the executor link", group=_LINK)
    )
    executor_dead_after_s: float = field(
        default=defaults.EXECUTOR_DEAD_AFTER_S,
        metadata=flag("an executor silent this long is declared lost", group=_LINK),
    )
    step_timeout_s: float | None = field(
        default=defaults.STEP_TIMEOUT_S,
        metadata=flag("a step unanswered this long (heartbeats alive) loses the executor", group=_LINK),
    )
    executor_start_timeout_s: float | None = field(
        default=None,
        metadata=flag(
            "seconds to wait for the first executor at start-up; None: forever",
            name="--executor-start-timeout",
            group=_LINK,
        ),
    )
    executor_restart_timeout_s: float = field(
        default=defaults.EXECUTOR_RESTART_TIMEOUT_S,
        metadata=flag(
            "seconds a lost executor may take to come back before requests fail UNAVAILABLE",
            name="--executor-restart-timeout",
            group=_LINK,
        ),
    )
    executor_losses_per_request: int = field(
        default=defaults.EXECUTOR_LOSSES_PER_REQUEST,
        metadata=flag(
            "a request in flight through this many executor losses fails UNAVAILABLE instead of being "
            "recomputed again (poison-request guard)",
            group=_LINK,
        ),
    )

    # --- KV events for KV-aware routers (kvserve.scheduler.server.observability.kv_event_publisher)
    kv_events_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "publish the prefix cache's changes in vLLM's KV-event format on a ZeroMQ PUB socket bound here "
            "(tcp://HOST:PORT or ipc://PATH), for KV-aware routers; None: off",
            metavar="ENDPOINT",
            group=_KV_EVENTS,
        ),
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "a ZeroMQ ROUTER socket bound here answers replay requests for missed KV-event batches",
            metavar="ENDPOINT",
            group=_KV_EVENTS,
        ),
    )
    kv_events_topic: str = field(
        default="", metadata=flag("the topic frame of each KV-event message", group=_KV_EVENTS)
    )
    kv_events_allow_remote: bool = field(
        default=False,
        metadata=flag("allow non-loopback KV-event endpoints (the events carry token ids)", group=_KV_EVENTS),
    )

    # --- scheduling (the SchedulerConfig policy; the executor's handshake sizes the rest)
    max_model_len: int | None = field(
        default=None, metadata=flag("cap on the context length; None: the executor's max_model_len", group=_SCHEDULING)
    )
    max_num_batched_tokens: int = _policy("max_num_batched_tokens")
    max_num_seqs: int = _policy("max_num_seqs")
    preemption_mode: str = _policy("preemption_mode")
    kv_reservation: str = _policy("kv_reservation")
    enable_prefix_caching: bool = _policy("enable_prefix_caching", flag="--no-prefix-caching")
    cache_aware_order: bool = _policy("cache_aware_order")
    cache_aware_window: int = _policy("cache_aware_window")
    cache_aware_max_skips: int = _policy("cache_aware_max_skips")
    debug_invariants: bool = _policy("debug_invariants")
    speculative: str = _policy("speculative")
    num_speculative_tokens: int = _policy("num_speculative_tokens")
    ngram_max: int = _policy("ngram_max")
    ngram_min: int = _policy("ngram_min")
    suffix_cache_tokens: int = _policy("suffix_cache_tokens")
    speculative_max_batch: int = _policy("speculative_max_batch")
    speculative_min_acceptance: float = _policy("speculative_min_acceptance")

    generation_config: str = field(
        default=SOURCE_AUTO,
        metadata=flag(
            "where sampling fields a request leaves unset get their defaults: auto = the model's "
            "generation_config.json (else the API defaults), api = the API's documented defaults, or a "
            "directory holding a generation_config.json",
            group=_SCHEDULING,
        ),
    )

    # --- admission and streaming
    max_queued_requests: int = field(
        default=defaults.MAX_QUEUED_REQUESTS, metadata=flag("queued requests before RESOURCE_EXHAUSTED", group=_QUEUE)
    )
    max_queued_prompt_tokens: int = field(
        default=defaults.MAX_QUEUED_PROMPT_TOKENS,
        metadata=flag("queued prompt tokens before RESOURCE_EXHAUSTED", group=_QUEUE),
    )
    stream_buffer_chunks: int = field(
        default=defaults.STREAM_BUFFER_CHUNKS,
        metadata=flag("chunks buffered per stream before a slow reader's chunks are merged", group=_QUEUE),
    )

    # --- shutdown
    drain_grace_s: float = field(
        default=defaults.DRAIN_GRACE_S,
        metadata=flag("on SIGTERM, seconds in-flight requests get to finish", group=_QUEUE),
    )

    @property
    def http_listen_host(self) -> str | None:
        """Where the HTTP API listens: `http_host`, else `host`; None when HTTP is off (`http_port` 0)."""
        if self.http_port == 0:
            return None
        return self.http_host or self.host

    def scheduling_policy(self) -> dict[str, Any]:
        """The `SchedulerConfig` fields this config sets, by name (for `SchedulerConfig(**...)`)."""
        return {name: getattr(self, name) for name in SCHEDULING_POLICY}


SCHEDULING_POLICY = tuple(
    f.name for f in fields(ServerConfig) if f.name in _SCHEDULER_FIELDS and f.name != "max_model_len"
)
"""The fields ServerConfig shares with SchedulerConfig, less max_model_len: the server's is only
a cap on the executor's, applied in service.build_scheduler."""
