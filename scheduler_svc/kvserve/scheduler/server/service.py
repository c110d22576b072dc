"""The scheduler service's async main: link, gRPC and HTTP APIs, first executor, engine, drain.

Order matters: the link binds and both APIs listen first (gRPC health NOT_SERVING, HTTP
`/ready` 503), so an orchestrator can watch start-up; then the first executor's handshake
sizes the Scheduler, the engine starts, health turns SERVING and one line says where
each API listens. The OpenAI-compatible HTTP API (kvserve.scheduler.server.http) runs as a
task of this same loop and reads the same `ServingModel` as the gRPC servicer.
SIGTERM (or SIGINT) drains: health NOT_SERVING, new requests refused, in-flight ones
get `drain_grace_s` to finish, then the executor is told to shut down and we exit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import sys
from dataclasses import dataclass

import grpc
import structlog

from kvserve.config import defaults
from kvserve.link.curve import CurveKeys, load_keys
from kvserve.link.endpoint import private_ipc_endpoint
from kvserve.protos.step import ExecutorInfo
from kvserve.scheduler.core import Scheduler
from kvserve.scheduler.server.adapter_catalog import AdapterCatalog
from kvserve.scheduler.server.engine import Engine
from kvserve.scheduler.server.executor_link.child_supervisor import ChildSupervisor
from kvserve.scheduler.server.executor_link.connection import ExecutorLink
from kvserve.scheduler.server.grpc_api.api_server import ApiServer, KVServeServicer
from kvserve.scheduler.server.http.app import create_app
from kvserve.scheduler.server.http.browser_policy import BrowserPolicy, BrowserPolicyError
from kvserve.scheduler.server.http.context import HttpContext
from kvserve.scheduler.server.http.http_server import HttpListenError, HttpServer
from kvserve.scheduler.server.http.ui_routes import UiOptions
from kvserve.scheduler.server.intake.generation_defaults import load_sampling_defaults
from kvserve.scheduler.server.intake.request_parsing import ModelLimits
from kvserve.scheduler.server.intake.served_models import ServedModels
from kvserve.scheduler.server.intake.tokenizer import ChatTemplateError, Tokenizer, read_chat_template
from kvserve.scheduler.server.observability.kv_event_publisher import KvEventsConfigError, kv_event_publisher
from kvserve.scheduler.server.observability.kv_event_recorder import KvEventRecorder
from kvserve.scheduler.server.observability.metrics import ServerMetrics
from kvserve.scheduler.server.security.auth import BearerAuthInterceptor, TokenFileError, TokenTable, load_token_file
from kvserve.scheduler.server.security.bind_policy import BindSecurity, InsecureBindError, check_bind
from kvserve.scheduler.server.security.namespaces import namespace_lora
from kvserve.scheduler.server.security.tls import TlsConfigError, TlsFiles, server_credentials, tls_files
from kvserve.scheduler.server.server_config import ServerConfig
from kvserve.scheduler.server.serving_model import ServingModel
from kvserve.scheduler.server.structured.compiler import GrammarCompiler
from kvserve.scheduler.server.structured.llguidance_backend import LlguidanceBackend
from kvserve.scheduler.server.tools.tool_formats import FORMATS

log = structlog.get_logger(__name__)


class ExecutorStartError(RuntimeError):
    """The supervised executor exited before it ever registered; `refused`: because of its configuration."""

    def __init__(self, message: str, *, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class LinkKeyError(ValueError):
    """A CURVE certificate for the executor link is missing or unreadable."""


@dataclass(slots=True)
class ApiSecurity:
    tokens: TokenTable | None
    credentials: grpc.ServerCredentials | None
    browser: BrowserPolicy
    """What web pages may do with the HTTP API, checked once at start."""
    curve_keys: CurveKeys | None = None
    tls: TlsFiles | None = None
    """The same PEM files, for the HTTP API's TLS."""
    admins: frozenset[str] = frozenset()
    """The tenants with admin rights (`--admin-tenant`); empty without tokens, where everyone is."""


def load_api_security(config: ServerConfig) -> ApiSecurity:
    """Check the bind policy of each listener and read token and TLS files, before anything listens or starts."""
    files = tls_files(config.tls_cert, config.tls_key, config.tls_client_ca)
    hosts = [config.host]
    if config.http_listen_host is not None and config.http_listen_host != config.host:
        hosts.append(config.http_listen_host)
    for host in hosts:
        check_bind(
            BindSecurity(
                host=host,
                auth=config.auth_token_file is not None,
                tls=files is not None,
                allow_insecure_remote=config.allow_insecure_remote,
            )
        )
    browser = browser_policy(config)
    browser.check()
    if config.admin_tenant and config.auth_token_file is None:
        raise TokenFileError("--admin-tenant needs --auth-token-file: without tokens everyone is anonymous")
    tokens = load_token_file(config.auth_token_file) if config.auth_token_file is not None else None
    return ApiSecurity(
        tokens=tokens,
        credentials=server_credentials(files) if files is not None else None,
        curve_keys=link_curve_keys(config),
        tls=files,
        browser=browser,
        admins=frozenset(config.admin_tenant),
    )


def browser_policy(config: ServerConfig) -> BrowserPolicy:
    """What web pages may do with the HTTP API (http/browser_policy.py)."""
    return BrowserPolicy(
        auth=config.auth_token_file is not None,
        listen_host=config.http_listen_host or config.host,
        allowed_hosts=config.allowed_hosts,
        cors_origins=config.cors_origin,
    )


def ui_options(config: ServerConfig) -> UiOptions | None:
    """The web page's options (None: `--no-ui`), checked at start like the browser policy."""
    if not config.ui:
        return None
    if config.ui_interval_s < defaults.UI_MIN_INTERVAL_S:
        raise BrowserPolicyError(f"--ui-interval must be at least {defaults.UI_MIN_INTERVAL_S} s")
    return UiOptions(config.ui_interval_s, frozenset(config.admin_tenant))


def link_curve_keys(config: ServerConfig) -> CurveKeys | None:
    """The scheduler's CURVE keys (and the executors it admits), None when CURVE is off."""
    if config.curve_secret_key is None:
        if config.curve_executor_keys:
            raise LinkKeyError("--curve-executor-key needs --curve-secret-key")
        return None
    try:
        return load_keys(config.curve_secret_key, list(config.curve_executor_keys))
    except (OSError, ValueError) as exc:
        raise LinkKeyError(f"CURVE keys: {exc}") from exc


def resolve_link_endpoint(config: ServerConfig) -> str:
    """The configured endpoint, or an ipc socket in a fresh private (0700) directory."""
    return config.link or private_ipc_endpoint()


def build_scheduler(config: ServerConfig, info: ExecutorInfo) -> Scheduler:
    """The server's scheduling policy, with the fields the executor's handshake sets
    (`server_config.HANDSHAKE_FIELDS`); `--max-model-len` only caps the executor's."""
    max_model_len = min(info.max_model_len, config.max_model_len or info.max_model_len)
    scheduler = Scheduler(
        dataclasses.replace(
            config.scheduling,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            num_cpu_blocks=info.num_cpu_blocks,
            max_model_len=max_model_len,
            eos_token_ids=tuple(info.eos_token_ids),
        )
    )
    scheduler.set_disk_tier(info.kv_fingerprint, info.kv_disk_keys, info.kv_tiers, info.kv_block_bytes)
    return scheduler


def grammar_compiler(tokenizer: Tokenizer, info: ExecutorInfo) -> GrammarCompiler:
    """Structured output through llguidance for the served tokenizer, whose vocabulary index is
    built on the first structured request (about half a second), not at start-up."""
    return GrammarCompiler(
        lambda: LlguidanceBackend(tokenizer.to_json(), info.vocab_size, info.eos_token_ids),
        defaults.GRAMMAR_CACHE_SIZE,
    )


async def run_service(
    config: ServerConfig, *, endpoint: str | None = None, supervisor: ChildSupervisor | None = None
) -> int:
    """Serve until SIGTERM/SIGINT; returns the process exit code (2: bad security options, or an executor that
    refused its configuration)."""
    try:
        security = load_api_security(config)
        ui = ui_options(config)
        kv_events = kv_event_publisher(
            config.kv_events_endpoint,
            config.kv_events_replay_endpoint,
            config.kv_events_topic,
            allow_remote=config.kv_events_allow_remote,
        )
        chat_template = read_chat_template(config.chat_template) if config.chat_template is not None else None
    except (
        TokenFileError,
        TlsConfigError,
        InsecureBindError,
        BrowserPolicyError,
        LinkKeyError,
        ChatTemplateError,
        KvEventsConfigError,
    ) as exc:
        print(f"kvserve: {exc}", file=sys.stderr, flush=True)
        return 2
    endpoint = endpoint or resolve_link_endpoint(config)
    engine: Engine | None = None
    registered_pid: int | None = None

    def on_link_change(connected: bool) -> None:
        nonlocal registered_pid
        if connected:
            registered_pid = link.executor_pid
        elif supervisor is not None:
            supervisor.kill_if_current(registered_pid)  # lost but maybe alive (hung): replace it
        if engine is not None:
            engine.on_link_change(connected)

    link = ExecutorLink(
        endpoint,
        heartbeat_interval_s=config.heartbeat_interval_s,
        dead_after_s=config.executor_dead_after_s,
        step_timeout_s=config.step_timeout_s,
        allow_remote=config.allow_remote_link,
        curve_keys=security.curve_keys,
        on_change=on_link_change,
    )
    await link.start()
    restarts = (lambda: supervisor.restarts) if supervisor else (lambda: max(0, link.generation - 1))
    servicer = KVServeServicer(restarts=restarts, tokens=security.tokens, admins=security.admins)
    interceptors = [BearerAuthInterceptor(security.tokens)] if security.tokens is not None else []
    api = ApiServer(config, servicer, interceptors=interceptors, credentials=security.credentials)
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    engine_task: asyncio.Task | None = None
    # Always built: it also drives the periodic stats log line; the HTTP endpoint is opt-in.
    metrics = ServerMetrics()
    http_context = HttpContext(
        model_source=lambda: servicer.model,
        tokens=security.tokens,
        admins=security.admins,
        metrics=metrics,
        max_request_bytes=config.max_request_bytes,
    )
    http: HttpServer | None = None
    if config.http_listen_host is not None:
        app = create_app(http_context, security.browser, ui)
        http = HttpServer(app, config.http_listen_host, config.http_port, tls=security.tls)
    try:
        port = await api.start()
        if config.metrics_port is not None:
            metrics_port = metrics.start_http_server(config.host, config.metrics_port)
            log.info("metrics_listening", host=config.host, port=metrics_port)
        log.info("grpc_listening", host=config.host, port=port, link=endpoint, health="NOT_SERVING")
        if http is not None:
            await http.start()
            log.info("http_listening", url=http.url, ready=False)
        if supervisor is not None:
            await supervisor.start()
        info = await _first_executor(link, supervisor, shutdown, config.executor_start_timeout_s)
        if info is None:
            return 0
        if config.scheduling.speculative == "draft" and not info.draft_model_id:
            print(
                "kvserve: --speculative draft needs a draft model in the executor: start it with --draft-model PATH "
                "(kvserve serve --draft-model PATH)",
                file=sys.stderr,
                flush=True,
            )
            return 2
        if info.draft_model_id and config.scheduling.speculative != "draft":
            log.warning(
                "the executor runs a draft model that --speculative does not use: it costs a forward pass a step",
                draft_model=info.draft_model_id,
                speculative=config.scheduling.speculative,
            )
        try:
            served = ServedModels.of(info.model_id, config.served_model_name, info.lora_names)
        except ValueError as exc:
            print(f"kvserve: {exc}", file=sys.stderr, flush=True)
            return 2
        tokenizer = Tokenizer.from_dir(
            info.tokenizer_path,
            chat_template=chat_template,
            tool_format=FORMATS[config.tool_call_format],
        )
        scheduler = build_scheduler(config, info)
        if kv_events is not None:
            recorder = KvEventRecorder(info.block_size, namespace_lora)
            scheduler.set_prefix_listener(recorder)
            kv_events.attach(recorder)
        catalog: AdapterCatalog | None = None

        async def restore_adapters(new: ExecutorInfo) -> None:
            if catalog is not None:
                await catalog.restore(new)

        engine = Engine(
            scheduler,
            link,
            tokenizer,
            config,
            on_state_change=api.on_executor_state,
            metrics=metrics,
            kv_events=kv_events,
            on_new_executor=restore_adapters,
        )
        limits = ModelLimits(
            max_model_len=min(info.max_model_len, config.max_model_len or info.max_model_len),
            vocab_size=info.vocab_size,
            max_request_bytes=config.max_request_bytes,
            sampling_defaults=load_sampling_defaults(info.tokenizer_path, config.generation_config),
            tool_call_format=config.tool_call_format,
            models=served,
        )
        catalog = AdapterCatalog(
            link, engine, limits, allow_runtime=config.allow_runtime_lora, startup=list(info.lora_names)
        )
        servicer.model = ServingModel(
            engine=engine,
            tokenizer=tokenizer,
            info=info,
            limits=limits,
            grammars=grammar_compiler(tokenizer, info),
            adapters=catalog,
        )
        engine_task = loop.create_task(engine.run())
        await api.set_serving(True)
        log.info(
            "serving",
            model_id=info.model_id,
            lora_names=info.lora_names,
            executor=info.executor_kind,
            num_blocks=info.num_blocks,
            max_model_len=limits.max_model_len,
            tool_template=tokenizer.tool_template_source,
            auth=security.tokens is not None,
            tls=security.credentials is not None,
            link_curve=security.curve_keys is not None,
            debug_invariants=config.scheduling.debug_invariants,
        )
        where = f"gRPC {config.host}:{port}" + (f", OpenAI HTTP {http.url}/v1" if http is not None else "")
        print(f"kvserve: serving {info.model_id} on {where} (executor {info.executor_kind})", flush=True)
        stop_wait = loop.create_task(shutdown.wait())
        await asyncio.wait({stop_wait, engine_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if engine_task.done():
            engine_task.result()  # the loop never ends on its own: surface its exception
        log.info("draining", active_requests=engine.num_active, grace_s=config.drain_grace_s)
        await api.enter_drain()
        http_context.draining = True
        await engine.drain(config.drain_grace_s)
        await engine_task
        return 0
    except ExecutorStartError as exc:
        log.error("executor_start_failed", error=str(exc))
        print(f"kvserve: {exc}", file=sys.stderr, flush=True)
        return 2 if exc.refused else 1
    except HttpListenError as exc:
        print(
            f"kvserve: HTTP API: {exc} (--http-port picks another port, 0 turns HTTP off)", file=sys.stderr, flush=True
        )
        return 2
    finally:
        if engine is not None:
            engine.stop()
        if engine_task is not None and not engine_task.done():
            engine_task.cancel()
        await api.stop(1.0)
        if http is not None:
            await http.stop()
        metrics.stop_http_server()
        if kv_events is not None:
            kv_events.close()
        await link.close(shutdown_executor=True)
        if supervisor is not None:
            await supervisor.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        log.info("stopped")


async def _first_executor(
    link: ExecutorLink, supervisor: ChildSupervisor | None, shutdown: asyncio.Event, timeout_s: float | None
) -> ExecutorInfo | None:
    """Wait for the first handshake; None if asked to shut down first."""
    loop = asyncio.get_running_loop()
    waits: dict[asyncio.Task, str] = {
        loop.create_task(link.wait_for_executor(timeout_s=timeout_s)): "executor",
        loop.create_task(shutdown.wait()): "shutdown",
    }
    if supervisor is not None:
        waits[loop.create_task(supervisor.exits.get())] = "exited"
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        first = next(iter(done))
        kind = waits[first]
        if kind == "executor":
            try:
                info = first.result()
            except TimeoutError:
                raise ExecutorStartError(f"no executor registered within {timeout_s:g} s") from None
            log.info(
                "executor_registered",
                model_id=info.model_id,
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                kind=info.executor_kind,
            )
            return info
        if kind == "exited":
            code = first.result()
            if code == defaults.EXECUTOR_REFUSED_EXIT:
                raise ExecutorStartError("the executor refused its configuration; its reason is above", refused=True)
            raise ExecutorStartError(
                f"the executor exited with code {code} before registering; see its log lines above"
            )
        return None
    finally:
        for task in waits:
            task.cancel()
