"""Every option of the scheduler service, with its default and help, in one dataclass.

`kvserve serve` and `kvserve scheduler` generate their flags from these fields
(kvserve.config.flags), so a new option is one field here and `--help` and the service
always agree. The scheduling policy is the scheduler core's own `SchedulerConfig`, held whole
in `scheduling`: each of its fields is a flag, with its default and help, except those the
executor's handshake sets (`HANDSHAKE_FIELDS`, filled in by `service.build_scheduler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import defaults
from kvserve.config.flags import flag, nested
from kvserve.scheduler.core import SchedulerConfig
from kvserve.scheduler.server.intake.generation_defaults import SOURCE_AUTO
from kvserve.scheduler.server.tools.tool_formats import FORMATS

_SCHEDULER = "scheduler"
_QUEUE = "admission and shutdown"
_API = "gRPC API"
_HTTP = "OpenAI-compatible HTTP API"
_SECURITY = "API security"
_OBSERVABILITY = "observability (metrics, KV events)"
_LINK = "executor link"
SECTIONS = (_SCHEDULER, _QUEUE, _API, _HTTP, _SECURITY, _OBSERVABILITY, _LINK)
"""The --help sections of these flags, in the order `kvserve serve` shows them."""
LINK_SECTION = _LINK
"""The link's section, where `kvserve serve` also shows the executor's own link flags."""

HANDSHAKE_FIELDS = ("num_blocks", "block_size", "num_cpu_blocks", "max_model_len", "eos_token_ids")
"""The `SchedulerConfig` fields the executor's handshake sets; every other one is a flag."""


def _scheduling_defaults() -> SchedulerConfig:
    """SchedulerConfig's own defaults; its handshake fields hold placeholders until an executor registers."""
    return SchedulerConfig(num_blocks=1)


@dataclass(slots=True)
class ServerConfig:
    # --- gRPC API
    host: str = field(default=defaults.GRPC_HOST, metadata=flag("address the gRPC API listens on", group=_API))
    port: int = field(default=defaults.GRPC_PORT, metadata=flag("gRPC port (0 picks a free one)", group=_API))
    max_request_bytes: int = field(
        default=defaults.MAX_REQUEST_BYTES,
        metadata=flag("largest accepted request: a gRPC message or an HTTP body (413 beyond)", group=_API),
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
    # --- API security (kvserve.scheduler.server.security.auth, .tls, .bind_policy)
    auth_token_file: str | None = field(
        default=None,
        metadata=flag(
            "file of `TOKEN TENANT` lines; every API call then needs `authorization: Bearer TOKEN`", group=_SECURITY
        ),
    )
    admin_tenant: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "a tenant of --auth-token-file with admin rights: its web page sees every tenant's requests and prompt "
            "text (others see their own), and it may load and unload LoRA adapters (--allow-runtime-lora); "
            "repeat for several",
            metavar="TENANT",
            group=_SECURITY,
        ),
    )
    allow_runtime_lora: bool = field(
        default=False,
        metadata=flag(
            "allow loading and unloading LoRA adapters while serving (POST /v1/load_lora_adapter, "
            "/v1/unload_lora_adapter, gRPC LoadLoraAdapter); admin tenants only when --auth-token-file is given",
            group=_SECURITY,
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

    # --- observability: metrics, and KV events for KV-aware routers (kvserve.scheduler.server.observability)
    metrics_port: int | None = field(
        default=None,
        metadata=flag(
            "serve Prometheus /metrics on this port, same host as the API (0 picks one); None: off",
            group=_OBSERVABILITY,
        ),
    )
    kv_events_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "publish the prefix cache's changes in vLLM's KV-event format on a ZeroMQ PUB socket bound here "
            "(tcp://HOST:PORT or ipc://PATH), for KV-aware routers; None: off",
            metavar="ENDPOINT",
            group=_OBSERVABILITY,
        ),
    )
    kv_events_replay_endpoint: str | None = field(
        default=None,
        metadata=flag(
            "a ZeroMQ ROUTER socket bound here answers replay requests for missed KV-event batches",
            metavar="ENDPOINT",
            group=_OBSERVABILITY,
        ),
    )
    kv_events_topic: str = field(
        default="", metadata=flag("the topic frame of each KV-event message", group=_OBSERVABILITY)
    )
    kv_events_allow_remote: bool = field(
        default=False,
        metadata=flag("allow non-loopback KV-event endpoints (the events carry token ids)", group=_OBSERVABILITY),
    )

    # --- scheduling: the SchedulerConfig policy; the executor's handshake sizes the rest
    max_model_len: int | None = field(
        default=None, metadata=flag("cap on the context length; None: the executor's max_model_len", group=_SCHEDULER)
    )
    scheduling: SchedulerConfig = field(
        default_factory=_scheduling_defaults,
        metadata=nested(
            group=_SCHEDULER,
            exclude=HANDSHAKE_FIELDS,
            overrides={"enable_prefix_caching": {"flag": "--no-prefix-caching"}},
        ),
    )
    generation_config: str = field(
        default=SOURCE_AUTO,
        metadata=flag(
            "where sampling fields a request leaves unset get their defaults: auto = the model's "
            "generation_config.json (else the API defaults), api = the API's documented defaults, or a "
            "directory holding a generation_config.json",
            group=_SCHEDULER,
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
