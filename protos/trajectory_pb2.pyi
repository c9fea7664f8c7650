from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_ANSWERED: _ClassVar[FinishReason]
    FINISH_REASON_MAX_TURNS: _ClassVar[FinishReason]
    FINISH_REASON_RESPONSE_BUDGET: _ClassVar[FinishReason]
    FINISH_REASON_CONTEXT_LIMIT: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_TRUNCATED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_ANSWERED: FinishReason
FINISH_REASON_MAX_TURNS: FinishReason
FINISH_REASON_RESPONSE_BUDGET: FinishReason
FINISH_REASON_CONTEXT_LIMIT: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_TRUNCATED: FinishReason

class ToolCall(_message.Message):
    __slots__ = ("name", "arguments_json", "result", "error", "latency_s", "attempts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    arguments_json: str
    result: str
    error: str
    latency_s: float
    attempts: int
    def __init__(self, name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., result: _Optional[str] = ..., error: _Optional[str] = ..., latency_s: _Optional[float] = ..., attempts: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("index", "action", "query", "doc_ids", "tool_latency_s", "tool_attempts", "error", "generated_tokens", "observation_tokens", "generate_latency_s", "engine_finish_reason", "weight_version", "cached_tokens", "tool_calls", "reward")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    DOC_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    index: int
    action: str
    query: str
    doc_ids: _containers.RepeatedScalarFieldContainer[str]
    tool_latency_s: float
    tool_attempts: int
    error: str
    generated_tokens: int
    observation_tokens: int
    generate_latency_s: float
    engine_finish_reason: str
    weight_version: int
    cached_tokens: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    reward: float
    def __init__(self, index: _Optional[int] = ..., action: _Optional[str] = ..., query: _Optional[str] = ..., doc_ids: _Optional[_Iterable[str]] = ..., tool_latency_s: _Optional[float] = ..., tool_attempts: _Optional[int] = ..., error: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., observation_tokens: _Optional[int] = ..., generate_latency_s: _Optional[float] = ..., engine_finish_reason: _Optional[str] = ..., weight_version: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., reward: _Optional[float] = ...) -> None: ...

class Reward(_message.Message):
    __slots__ = ("total", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    total: float
    components: _containers.ScalarMap[str, float]
    def __init__(self, total: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("created_at", "finished_at", "generate_s", "tool_s", "reward_s")
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_S_FIELD_NUMBER: _ClassVar[int]
    created_at: float
    finished_at: float
    generate_s: float
    tool_s: float
    reward_s: float
    def __init__(self, created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., generate_s: _Optional[float] = ..., tool_s: _Optional[float] = ..., reward_s: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("schema_version", "trajectory_id", "group_id", "sample_index", "group_size", "data_source", "prompt_id", "prompt_token_ids", "response_token_ids", "loss_mask", "rollout_logprobs", "has_rollout_logprobs", "reward", "weight_version", "max_weight_version", "turns", "finish_reason", "error", "timings", "gold_answers", "rollout_step", "metadata", "temperature", "infrastructure_failure")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    HAS_ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    GOLD_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_STEP_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    INFRASTRUCTURE_FAILURE_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    trajectory_id: str
    group_id: str
    sample_index: int
    group_size: int
    data_source: str
    prompt_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: bytes
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    has_rollout_logprobs: bool
    reward: Reward
    weight_version: int
    max_weight_version: int
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    finish_reason: FinishReason
    error: str
    timings: Timings
    gold_answers: _containers.RepeatedScalarFieldContainer[str]
    rollout_step: int
    metadata: _containers.ScalarMap[str, str]
    temperature: float
    infrastructure_failure: bool
    def __init__(self, schema_version: _Optional[int] = ..., trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., data_source: _Optional[str] = ..., prompt_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[bytes] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., has_rollout_logprobs: _Optional[bool] = ..., reward: _Optional[_Union[Reward, _Mapping]] = ..., weight_version: _Optional[int] = ..., max_weight_version: _Optional[int] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., gold_answers: _Optional[_Iterable[str]] = ..., rollout_step: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., temperature: _Optional[float] = ..., infrastructure_failure: _Optional[bool] = ...) -> None: ...
