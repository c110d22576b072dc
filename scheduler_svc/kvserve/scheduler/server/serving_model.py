"""What both APIs (gRPC and HTTP) stand on once an executor has registered: the engine and the model.

Kept apart from either API so that neither imports the other (an import-linter contract).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.protos.step import ExecutorInfo
from kvserve.scheduler.server.adapter_catalog import AdapterCatalog
from kvserve.scheduler.server.engine import Engine
from kvserve.scheduler.server.intake.request_parsing import ModelLimits
from kvserve.scheduler.server.intake.tokenizer import Tokenizer
from kvserve.scheduler.server.structured.compiler import GrammarCompiler


@dataclass(slots=True)
class ServingModel:
    """What the APIs need once an executor has registered."""

    engine: Engine
    tokenizer: Tokenizer
    info: ExecutorInfo
    limits: ModelLimits
    grammars: GrammarCompiler
    """Structured-output specs, compiled for this model's tokenizer before their request is queued."""
    adapters: AdapterCatalog
    """The LoRA adapters served, loaded and unloaded at run time through either API."""
