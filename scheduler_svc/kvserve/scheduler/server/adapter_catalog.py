"""The LoRA adapters requests may name, changed at run time (`--allow-runtime-lora`) and kept across
executor restarts.

Both APIs load and unload through `AdapterCatalog` (HTTP: vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`; gRPC: `LoadLoraAdapter`, `UnloadLoraAdapter`), one change at a time:

- **Load.** The executor reads and checks the adapter between two steps (the steps in flight run
  on); only once it holds it does the name become servable, with a new id (`ServedModels`). A
  refusal (another base model's shapes, a rank over `--max-lora-rank`, an unsupported target, a
  missing or corrupt file) names the problem, and what was loaded stays as it was.
- **Unload** is refused while a request in flight (queued or running) runs under the adapter:
  refused, rather than waiting, so a caller learns at once and no request is cut short. Once
  allowed, the name stops being servable before the executor is told, so no plan can name it after.
- **Executor restarts.** A new executor starts with its own `--lora` adapters; `restore` makes
  it hold what requests may name again: it loads those loaded at run time, unloads the start-up
  ones unloaded at run time, and drops (with a warning) a start-up adapter the new one lacks.

The served names live in `ModelLimits.models` (what requests are parsed against) and in
`Engine.loras` (what `submit` checks): both are replaced whole, never edited in place.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import PurePosixPath

import structlog

from kvserve.protos.sampling import InvalidFieldError
from kvserve.protos.step import ExecutorInfo
from kvserve.scheduler.server.engine import Engine
from kvserve.scheduler.server.executor_link.connection import ExecutorLink
from kvserve.scheduler.server.executor_link.link_errors import AdapterRefused, ExecutorLost
from kvserve.scheduler.server.intake.request_parsing import ModelLimits

log = structlog.get_logger(__name__)

MAX_ADAPTER_NAME_CHARS = 256
"""A name is what requests give as their `model`; the same bound keeps log lines and messages short."""


class RuntimeLoraOff(Exception):
    """Loading or unloading at run time was not enabled (`--allow-runtime-lora`)."""

    def __init__(self) -> None:
        super().__init__(
            "loading and unloading LoRA adapters at run time is off: start the server with --allow-runtime-lora"
        )


class AdapterInUse(Exception):
    """An unload of an adapter that requests in flight run under."""


class AdapterNotLoaded(InvalidFieldError):
    """An unload naming no loaded adapter: the field `lora_name`, answered 404 (NOT_FOUND on gRPC)."""

    def __init__(self, name: str, loaded: list[str]) -> None:
        listed = ", ".join(map(repr, loaded)) or "none"
        super().__init__("lora_name", f"no LoRA adapter {name[:MAX_ADAPTER_NAME_CHARS]!r} is loaded; loaded: {listed}")


@dataclass(frozen=True, slots=True)
class AdapterSource:
    """Where an adapter came from: a path given at run time, or None for the executor's own `--lora`."""

    path: str | None


class AdapterCatalog:
    """The adapters served now, by name, with their ids and sources; loads and unloads them."""

    def __init__(
        self, link: ExecutorLink, engine: Engine, limits: ModelLimits, *, allow_runtime: bool, startup: list[str]
    ) -> None:
        self._link = link
        self._engine = engine
        self._limits = limits
        self.allow_runtime = allow_runtime
        self._sources = {name: AdapterSource(None) for name in startup}
        self._ids = limits.models.loras()
        self._next_id = max(self._ids.values(), default=0) + 1
        self._unloaded_startup: set[str] = set()
        """Start-up (`--lora`) adapters unloaded at run time: a restarted executor loads them again."""
        self._lock = asyncio.Lock()
        engine.loras = dict(self._ids)

    @property
    def names(self) -> list[str]:
        return list(self._ids)

    async def load(self, name: str, path: str) -> list[str]:
        """Load the adapter PEFT saved in `path` (absolute, on the executor's machine) as `name`; the
        adapters served then. InvalidFieldError names a bad `lora_name` or `lora_path`, RuntimeLoraOff,
        ExecutorLost (no executor, or lost meanwhile: nothing is served under `name`)."""
        if not self.allow_runtime:
            raise RuntimeLoraOff()
        _check_name(name)
        if not path:
            raise InvalidFieldError("lora_path", "required: the directory PEFT saved the adapter in")
        if not PurePosixPath(path).is_absolute():
            raise InvalidFieldError("lora_path", f"must be an absolute path on the server, got {path[:200]!r}")
        async with self._lock:
            models = self._limits.models
            if name in models.base_names:
                raise InvalidFieldError("lora_name", f"{name!r} is a name of the base model; give the adapter another")
            if name in self._ids:
                raise InvalidFieldError("lora_name", f"a LoRA adapter named {name!r} is already loaded")
            try:
                await self._link.load_adapter(name, path)
            except AdapterRefused as exc:
                raise InvalidFieldError("lora_path", str(exc)) from None
            self._sources[name] = AdapterSource(path)
            self._unloaded_startup.discard(name)
            self._publish({**self._ids, name: self._new_id()})
            log.info("lora_adapter_loaded", name=name, path=path, lora_id=self._ids[name])
            return self.names

    async def unload(self, name: str) -> list[str]:
        """Unload the adapter `name`; the adapters served then. AdapterNotLoaded, AdapterInUse (requests
        in flight run under it), RuntimeLoraOff."""
        if not self.allow_runtime:
            raise RuntimeLoraOff()
        async with self._lock:
            if name not in self._ids:
                raise AdapterNotLoaded(name, self.names)
            users = self._engine.requests_under(name)
            if users:
                raise AdapterInUse(
                    f"LoRA adapter {name!r} has {users} request(s) in flight; unload it once they have finished"
                )
            self._publish({n: i for n, i in self._ids.items() if n != name})  # no new request can name it now
            source = self._sources.pop(name)
            if source.path is None:
                self._unloaded_startup.add(name)
            try:
                await self._link.unload_adapter(name)
            except ExecutorLost:
                pass  # the next executor is given the catalog's adapters (`restore`), without this one
            log.info("lora_adapter_unloaded", name=name)
            return self.names

    async def restore(self, info: ExecutorInfo) -> None:
        """Give a newly registered executor (holding `info.lora_names`) the adapters served; drop those it
        cannot hold. ExecutorLost when it is lost meanwhile (the engine then waits for the next one)."""
        async with self._lock:
            held = list(info.lora_names)
            for name in held:
                if name in self._unloaded_startup:
                    await self._link.unload_adapter(name)
            served: dict[str, int] = {}
            for name, lora_id in self._ids.items():
                source = self._sources[name]
                if name in held:
                    served[name] = lora_id
                elif source.path is None:
                    log.warning("lora_adapter_dropped", name=name, reason="the restarted executor's --lora lacks it")
                elif await self._reload(name, source.path):
                    served[name] = lora_id
            for name in held:
                if name not in served and name not in self._unloaded_startup:
                    self._sources[name] = AdapterSource(None)
                    served[name] = self._new_id()
                    log.info("lora_adapter_added_by_executor", name=name)
            for name in set(self._sources) - set(served):
                del self._sources[name]
            self._publish(served)

    async def _reload(self, name: str, path: str) -> bool:
        try:
            await self._link.load_adapter(name, path)
        except AdapterRefused as exc:
            log.warning("lora_adapter_dropped", name=name, reason=str(exc))
            return False
        return True

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _publish(self, loras: dict[str, int]) -> None:
        """Serve `loras` (name -> id) from now: requests are parsed against them and submitted under them."""
        self._ids = loras
        self._limits.models = self._limits.models.with_loras(loras)
        self._engine.loras = dict(loras)


def _check_name(name: str) -> None:
    if not name:
        raise InvalidFieldError("lora_name", "required: the name requests will give as their `model`")
    if len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable():
        raise InvalidFieldError(
            "lora_name", f"must be printable and at most {MAX_ADAPTER_NAME_CHARS} characters, got {name[:64]!r}"
        )
