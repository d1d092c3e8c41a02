from omnibus.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop_token_ids", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "output_offset", "speculative_off", "prompt_logprobs", "structured_output", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_OFF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    output_offset: int
    speculative_off: bool
    prompt_logprobs: int
    structured_output: _inference_pb2.StructuredOutput
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., output_offset: _Optional[int] = ..., speculative_off: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_inference_pb2.StructuredOutput, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class EngineGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "priority", "adapter", "tenant", "tenant_weight", "deadline_ms", "handle", "cache_salt", "kv_hold", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANT_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    KV_HOLD_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSamplingParams
    priority: int
    adapter: str
    tenant: str
    tenant_weight: float
    deadline_ms: int
    handle: int
    cache_salt: str
    kv_hold: bool
    kv_source: KvHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., adapter: _Optional[str] = ..., tenant: _Optional[str] = ..., tenant_weight: _Optional[float] = ..., deadline_ms: _Optional[int] = ..., handle: _Optional[int] = ..., cache_salt: _Optional[str] = ..., kv_hold: _Optional[bool] = ..., kv_source: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("peer", "request_id", "num_tokens", "blocks", "regions", "block_bytes", "layout", "digest", "lease_addr", "lease_epoch", "rank_peers", "progress_addr")
    PEER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    LEASE_ADDR_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_PEERS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_ADDR_FIELD_NUMBER: _ClassVar[int]
    peer: str
    request_id: str
    num_tokens: int
    blocks: _containers.RepeatedScalarFieldContainer[int]
    regions: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    layout: str
    digest: bytes
    lease_addr: int
    lease_epoch: int
    rank_peers: _containers.RepeatedScalarFieldContainer[str]
    progress_addr: int
    def __init__(self, peer: _Optional[str] = ..., request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., blocks: _Optional[_Iterable[int]] = ..., regions: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., digest: _Optional[bytes] = ..., lease_addr: _Optional[int] = ..., lease_epoch: _Optional[int] = ..., rank_peers: _Optional[_Iterable[str]] = ..., progress_addr: _Optional[int] = ...) -> None: ...

class EngineGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "handle", "status_code", "status_message", "prompt_logprobs", "kv_handle")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    finish_reason: _inference_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    handle: int
    status_code: int
    status_message: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenLogprob]
    kv_handle: KvHandle
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_inference_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., handle: _Optional[int] = ..., status_code: _Optional[int] = ..., status_message: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_inference_pb2.TokenLogprob, _Mapping]]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("add", "abort", "packed_tokens")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    add: _containers.RepeatedCompositeFieldContainer[EngineGenerateRequest]
    abort: _containers.RepeatedScalarFieldContainer[str]
    packed_tokens: bool
    def __init__(self, add: _Optional[_Iterable[_Union[EngineGenerateRequest, _Mapping]]] = ..., abort: _Optional[_Iterable[str]] = ..., packed_tokens: _Optional[bool] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("outputs", "token_handles", "tokens")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_HANDLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineGenerateResponse]
    token_handles: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineGenerateResponse, _Mapping]]] = ..., token_handles: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "max_num_seqs", "block_size", "max_model_len", "resident_adapters", "draining", "cached_adapters", "available_adapters", "prefix_generation", "prefix_block_keys", "adapter_salts", "role", "kv_transfer", "kv_layout")
    class AdapterSaltsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CACHED_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_GENERATION_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SALTS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    max_num_seqs: int
    block_size: int
    max_model_len: int
    resident_adapters: _containers.RepeatedScalarFieldContainer[str]
    draining: bool
    cached_adapters: _containers.RepeatedScalarFieldContainer[str]
    available_adapters: _containers.RepeatedScalarFieldContainer[str]
    prefix_generation: int
    prefix_block_keys: _containers.RepeatedScalarFieldContainer[int]
    adapter_salts: _containers.ScalarMap[str, str]
    role: str
    kv_transfer: bool
    kv_layout: str
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., resident_adapters: _Optional[_Iterable[str]] = ..., draining: _Optional[bool] = ..., cached_adapters: _Optional[_Iterable[str]] = ..., available_adapters: _Optional[_Iterable[str]] = ..., prefix_generation: _Optional[int] = ..., prefix_block_keys: _Optional[_Iterable[int]] = ..., adapter_salts: _Optional[_Mapping[str, str]] = ..., role: _Optional[str] = ..., kv_transfer: _Optional[bool] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("load", "num_cached_blocks", "num_steps", "num_requests", "num_active_streams", "num_preemptions", "num_prefix_cache_hit_blocks", "slots_stepped", "useful_tokens", "kv_tokens_stored", "kv_tokens_reserved", "kv_transfer")
    LOAD_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_STREAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_STEPPED_FIELD_NUMBER: _ClassVar[int]
    USEFUL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_STORED_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    load: LoadReport
    num_cached_blocks: int
    num_steps: int
    num_requests: int
    num_active_streams: int
    num_preemptions: int
    num_prefix_cache_hit_blocks: int
    slots_stepped: int
    useful_tokens: int
    kv_tokens_stored: int
    kv_tokens_reserved: int
    kv_transfer: KvTransferStats
    def __init__(self, load: _Optional[_Union[LoadReport, _Mapping]] = ..., num_cached_blocks: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_active_streams: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_prefix_cache_hit_blocks: _Optional[int] = ..., slots_stepped: _Optional[int] = ..., useful_tokens: _Optional[int] = ..., kv_tokens_stored: _Optional[int] = ..., kv_tokens_reserved: _Optional[int] = ..., kv_transfer: _Optional[_Union[KvTransferStats, _Mapping]] = ...) -> None: ...

class KvTransferStats(_message.Message):
    __slots__ = ("held", "held_blocks", "sent", "released", "expired", "loads", "load_failures", "loaded_tokens", "loaded_bytes", "load_seconds", "refused", "layout", "sent_early", "load_wait_seconds", "dropped")
    HELD_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SENT_EARLY_FIELD_NUMBER: _ClassVar[int]
    LOAD_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    held: int
    held_blocks: int
    sent: int
    released: int
    expired: int
    loads: int
    load_failures: int
    loaded_tokens: int
    loaded_bytes: int
    load_seconds: float
    refused: int
    layout: str
    sent_early: int
    load_wait_seconds: float
    dropped: int
    def __init__(self, held: _Optional[int] = ..., held_blocks: _Optional[int] = ..., sent: _Optional[int] = ..., released: _Optional[int] = ..., expired: _Optional[int] = ..., loads: _Optional[int] = ..., load_failures: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., refused: _Optional[int] = ..., layout: _Optional[str] = ..., sent_early: _Optional[int] = ..., load_wait_seconds: _Optional[float] = ..., dropped: _Optional[int] = ...) -> None: ...

class LoadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "resident", "was_loaded")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    WAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    resident: bool
    was_loaded: bool
    def __init__(self, adapter: _Optional[str] = ..., resident: _Optional[bool] = ..., was_loaded: _Optional[bool] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    def __init__(self, adapter: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("adapter", "was_loaded")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    WAS_LOADED_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    was_loaded: bool
    def __init__(self, adapter: _Optional[str] = ..., was_loaded: _Optional[bool] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("resident", "cached", "available", "max_loras", "max_cpu_loras", "max_lora_rank", "enabled", "residency")
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    RESIDENCY_FIELD_NUMBER: _ClassVar[int]
    resident: _containers.RepeatedScalarFieldContainer[str]
    cached: _containers.RepeatedScalarFieldContainer[str]
    available: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    max_cpu_loras: int
    max_lora_rank: int
    enabled: bool
    residency: _containers.RepeatedCompositeFieldContainer[AdapterResidency]
    def __init__(self, resident: _Optional[_Iterable[str]] = ..., cached: _Optional[_Iterable[str]] = ..., available: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., max_cpu_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., enabled: _Optional[bool] = ..., residency: _Optional[_Iterable[_Union[AdapterResidency, _Mapping]]] = ...) -> None: ...

class AdapterResidency(_message.Message):
    __slots__ = ("adapter", "tier", "pins", "loads", "device_evictions", "host_evictions")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    LOADS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    tier: str
    pins: int
    loads: int
    device_evictions: int
    host_evictions: int
    def __init__(self, adapter: _Optional[str] = ..., tier: _Optional[str] = ..., pins: _Optional[int] = ..., loads: _Optional[int] = ..., device_evictions: _Optional[int] = ..., host_evictions: _Optional[int] = ...) -> None: ...

class EngineEmbedRequest(_message.Message):
    __slots__ = ("inputs", "pooling", "normalize", "priority", "queue_timeout_ms")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[_inference_pb2.TokenIds]
    pooling: _inference_pb2.Pooling
    normalize: bool
    priority: int
    queue_timeout_ms: int
    def __init__(self, inputs: _Optional[_Iterable[_Union[_inference_pb2.TokenIds, _Mapping]]] = ..., pooling: _Optional[_Union[_inference_pb2.Pooling, str]] = ..., normalize: _Optional[bool] = ..., priority: _Optional[int] = ..., queue_timeout_ms: _Optional[int] = ...) -> None: ...

class EngineEmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[_inference_pb2.Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[_inference_pb2.Embedding, _Mapping]]] = ...) -> None: ...
