from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExecutorInfo(_message.Message):
    __slots__ = ("model_id", "num_blocks", "block_size", "num_cpu_blocks", "vocab_size", "max_model_len", "eos_token_ids", "tokenizer_path", "executor_kind", "device", "dtype", "attention_backend", "num_threads", "draft_model_id", "lora_names", "kv_fingerprint", "kv_disk_keys", "kv_block_bytes", "kv_tiers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_PATH_FIELD_NUMBER: _ClassVar[int]
    EXECUTOR_KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    NUM_THREADS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    KV_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_KEYS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    num_blocks: int
    block_size: int
    num_cpu_blocks: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    tokenizer_path: str
    executor_kind: str
    device: str
    dtype: str
    attention_backend: str
    num_threads: int
    draft_model_id: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    kv_fingerprint: str
    kv_disk_keys: _containers.RepeatedScalarFieldContainer[int]
    kv_block_bytes: int
    kv_tiers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., tokenizer_path: _Optional[str] = ..., executor_kind: _Optional[str] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., attention_backend: _Optional[str] = ..., num_threads: _Optional[int] = ..., draft_model_id: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ..., kv_fingerprint: _Optional[str] = ..., kv_disk_keys: _Optional[_Iterable[int]] = ..., kv_block_bytes: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[str]] = ...) -> None: ...

class Handshake(_message.Message):
    __slots__ = ("protocol_version", "session_id", "pid", "info")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    session_id: str
    pid: int
    info: ExecutorInfo
    def __init__(self, protocol_version: _Optional[int] = ..., session_id: _Optional[str] = ..., pid: _Optional[int] = ..., info: _Optional[_Union[ExecutorInfo, _Mapping]] = ...) -> None: ...

class HandshakeAck(_message.Message):
    __slots__ = ("session_id", "generation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    generation: int
    def __init__(self, session_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class StepSamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "n", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos", "logprobs", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: int
    n: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "prompt_len", "num_computed_tokens", "num_scheduled_tokens", "block_table", "sampling", "seed", "lora_name")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_len: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    sampling: StepSamplingParams
    seed: int
    lora_name: str
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., prompt_len: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[StepSamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class KnownSequences(_message.Message):
    __slots__ = ("seq_ids", "num_computed_tokens", "num_scheduled_tokens", "new_token_counts", "new_token_ids", "new_block_counts", "new_block_ids", "draft_counts", "draft_token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_counts: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_counts: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., new_token_counts: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_block_counts: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., draft_counts: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockPairs(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_seqs", "known_seqs", "copies", "swap_out", "swap_in", "drop_seq_ids", "mask_seq_ids", "token_masks", "trim_seq_ids", "trim_block_counts", "draft_request_seq_ids", "draft_request_counts", "store_blocks", "store_keys", "load_blocks", "load_keys")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_SEQS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    DROP_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    MASK_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    TRIM_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TRIM_BLOCK_COUNTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REQUEST_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_REQUEST_COUNTS_FIELD_NUMBER: _ClassVar[int]
    STORE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORE_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOAD_KEYS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    known_seqs: KnownSequences
    copies: BlockPairs
    swap_out: BlockPairs
    swap_in: BlockPairs
    drop_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    mask_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_masks: bytes
    trim_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    trim_block_counts: _containers.RepeatedScalarFieldContainer[int]
    draft_request_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_request_counts: _containers.RepeatedScalarFieldContainer[int]
    store_blocks: _containers.RepeatedScalarFieldContainer[int]
    store_keys: _containers.RepeatedScalarFieldContainer[int]
    load_blocks: _containers.RepeatedScalarFieldContainer[int]
    load_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., known_seqs: _Optional[_Union[KnownSequences, _Mapping]] = ..., copies: _Optional[_Union[BlockPairs, _Mapping]] = ..., swap_out: _Optional[_Union[BlockPairs, _Mapping]] = ..., swap_in: _Optional[_Union[BlockPairs, _Mapping]] = ..., drop_seq_ids: _Optional[_Iterable[int]] = ..., mask_seq_ids: _Optional[_Iterable[int]] = ..., token_masks: _Optional[bytes] = ..., trim_seq_ids: _Optional[_Iterable[int]] = ..., trim_block_counts: _Optional[_Iterable[int]] = ..., draft_request_seq_ids: _Optional[_Iterable[int]] = ..., draft_request_counts: _Optional[_Iterable[int]] = ..., store_blocks: _Optional[_Iterable[int]] = ..., store_keys: _Optional[_Iterable[int]] = ..., load_blocks: _Optional[_Iterable[int]] = ..., load_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "execute_time_s", "seq_ids", "token_ids", "has_logprob", "logprobs", "top_counts", "top_token_ids", "top_logprobs", "proposal_seq_ids", "proposal_counts", "proposal_token_ids", "failed_load_blocks", "disk_load_blocks", "dropped_keys")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_TIME_S_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_KEYS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    execute_time_s: float
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    has_logprob: _containers.RepeatedScalarFieldContainer[bool]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_counts: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    proposal_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    proposal_counts: _containers.RepeatedScalarFieldContainer[int]
    proposal_token_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_load_blocks: _containers.RepeatedScalarFieldContainer[int]
    disk_load_blocks: _containers.RepeatedScalarFieldContainer[int]
    dropped_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., execute_time_s: _Optional[float] = ..., seq_ids: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., has_logprob: _Optional[_Iterable[bool]] = ..., logprobs: _Optional[_Iterable[float]] = ..., top_counts: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., proposal_seq_ids: _Optional[_Iterable[int]] = ..., proposal_counts: _Optional[_Iterable[int]] = ..., proposal_token_ids: _Optional[_Iterable[int]] = ..., failed_load_blocks: _Optional[_Iterable[int]] = ..., disk_load_blocks: _Optional[_Iterable[int]] = ..., dropped_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_at",)
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    sent_at: float
    def __init__(self, sent_at: _Optional[float] = ...) -> None: ...

class StepError(_message.Message):
    __slots__ = ("step_id", "message", "error_type")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    message: str
    error_type: str
    def __init__(self, step_id: _Optional[int] = ..., message: _Optional[str] = ..., error_type: _Optional[str] = ...) -> None: ...

class Reset(_message.Message):
    __slots__ = ("reset_id",)
    RESET_ID_FIELD_NUMBER: _ClassVar[int]
    reset_id: int
    def __init__(self, reset_id: _Optional[int] = ...) -> None: ...

class ResetDone(_message.Message):
    __slots__ = ("reset_id",)
    RESET_ID_FIELD_NUMBER: _ClassVar[int]
    reset_id: int
    def __init__(self, reset_id: _Optional[int] = ...) -> None: ...

class Shutdown(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadAdapter(_message.Message):
    __slots__ = ("command_id", "name", "path")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    name: str
    path: str
    def __init__(self, command_id: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadAdapter(_message.Message):
    __slots__ = ("command_id", "name")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    name: str
    def __init__(self, command_id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class AdaptersChanged(_message.Message):
    __slots__ = ("command_id", "error", "lora_names")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LORA_NAMES_FIELD_NUMBER: _ClassVar[int]
    command_id: int
    error: str
    lora_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, command_id: _Optional[int] = ..., error: _Optional[str] = ..., lora_names: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("handshake_ack", "plan", "heartbeat", "reset", "shutdown", "load_adapter", "unload_adapter")
    HANDSHAKE_ACK_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_FIELD_NUMBER: _ClassVar[int]
    LOAD_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    UNLOAD_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    handshake_ack: HandshakeAck
    plan: StepPlan
    heartbeat: Heartbeat
    reset: Reset
    shutdown: Shutdown
    load_adapter: LoadAdapter
    unload_adapter: UnloadAdapter
    def __init__(self, handshake_ack: _Optional[_Union[HandshakeAck, _Mapping]] = ..., plan: _Optional[_Union[StepPlan, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., reset: _Optional[_Union[Reset, _Mapping]] = ..., shutdown: _Optional[_Union[Shutdown, _Mapping]] = ..., load_adapter: _Optional[_Union[LoadAdapter, _Mapping]] = ..., unload_adapter: _Optional[_Union[UnloadAdapter, _Mapping]] = ...) -> None: ...

class ExecutorMessage(_message.Message):
    __slots__ = ("handshake", "result", "heartbeat", "error", "reset_done", "goodbye", "adapters_changed")
    HANDSHAKE_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESET_DONE_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    handshake: Handshake
    result: StepResult
    heartbeat: Heartbeat
    error: StepError
    reset_done: ResetDone
    goodbye: Goodbye
    adapters_changed: AdaptersChanged
    def __init__(self, handshake: _Optional[_Union[Handshake, _Mapping]] = ..., result: _Optional[_Union[StepResult, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., error: _Optional[_Union[StepError, _Mapping]] = ..., reset_done: _Optional[_Union[ResetDone, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., adapters_changed: _Optional[_Union[AdaptersChanged, _Mapping]] = ...) -> None: ...
