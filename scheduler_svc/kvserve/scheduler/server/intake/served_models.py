"""The names a request may give as its `model`: the base model's, and each LoRA adapter's.

The base model answers to its id (the executor's `model_id`) and to every `--served-model-name`
alias; an adapter answers to the name it was loaded under (`--lora NAME=PATH`, reported in
`ExecutorInfo.lora_names`, or a runtime load: `adapter_catalog`). Each adapter also has an integer
id, never reused while the server runs: an adapter unloaded and another loaded under its name get
other ids, so their prefix caches stay apart (`prefix_namespace`) and KV events tell them apart.
Both APIs name the model the same way, vLLM's way: the OpenAI
`model` field, and `GenerateRequest.model` over gRPC, where empty means the base model too. Any
other name is `ModelNotFound` (HTTP 404 `model_not_found`, gRPC NOT_FOUND), naming it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.protos.sampling import InvalidFieldError

BASE_MODEL = ""
"""The adapter name of the base model (`ValidatedRequest.lora_name`, `NewSequence.lora_name`)."""
_SHOWN_CHARS = 200
"""How much of an unknown name an error message repeats."""


class ModelNotFound(InvalidFieldError):
    """A request named a model this server does not serve. An InvalidFieldError of the field `model`,
    so a caller that does not single it out still refuses it as a bad field; the APIs answer it with
    404 `model_not_found` (HTTP) and NOT_FOUND (gRPC)."""

    def __init__(self, name: str, served: Iterable[str]) -> None:
        listed = ", ".join(map(repr, served))
        super().__init__("model", f"the model {name[:_SHOWN_CHARS]!r} does not exist; this server serves {listed}")
        self.name = name


@dataclass(frozen=True, slots=True)
class ServedModels:
    """The base model's names (its id first, then its aliases) and the LoRA adapters' names, in order,
    with each adapter's id (`lora_ids[i]` is `lora_names[i]`'s)."""

    base_names: tuple[str, ...] = ()
    lora_names: tuple[str, ...] = ()
    lora_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, model_id: str, aliases: Iterable[str] = (), lora_names: Iterable[str] = ()) -> ServedModels:
        """The served names, the adapters numbered 1, 2, ... in order; ValueError when an adapter's name is
        also the base model's, which would hide it."""
        base = (model_id, *(name for name in aliases if name != model_id))
        adapters = tuple(lora_names)
        clash = sorted(set(base) & set(adapters))
        if clash:
            raise ValueError(
                f"the LoRA adapter name {clash[0]!r} is also a name of the base model: "
                "give the adapter another name (--lora NAME=PATH) or drop the --served-model-name"
            )
        return cls(base, adapters, tuple(range(1, len(adapters) + 1)))

    def with_loras(self, loras: dict[str, int]) -> ServedModels:
        """The same base model serving the adapters `loras` (name -> id, in order)."""
        return ServedModels(self.base_names, tuple(loras), tuple(loras.values()))

    def loras(self) -> dict[str, int]:
        """Each adapter's name -> its id, in order."""
        return dict(zip(self.lora_names, self.lora_ids, strict=True))

    def lora_id(self, name: str) -> int:
        """The id of the adapter `name` (0: the base model, `BASE_MODEL`)."""
        return self.lora_ids[self.lora_names.index(name)] if name else 0

    @property
    def base_id(self) -> str:
        return self.base_names[0] if self.base_names else ""

    def names(self) -> tuple[str, ...]:
        """Every name a request may give, the base model's first."""
        return self.base_names + self.lora_names

    def resolve(self, name: str) -> str:
        """The adapter `name` runs under (`BASE_MODEL` for the base model); ModelNotFound for a name not served."""
        if not name or name in self.base_names:
            return BASE_MODEL
        if name in self.lora_names:
            return name
        raise ModelNotFound(name, self.names())
