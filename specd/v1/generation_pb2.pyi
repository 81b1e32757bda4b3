from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "name", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    name: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., name: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "continue_final_message")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    continue_final_message: bool
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ...) -> None: ...

class Tools(_message.Message):
    __slots__ = ("json", "choice", "parallel_calls")
    JSON_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_CALLS_FIELD_NUMBER: _ClassVar[int]
    json: str
    choice: str
    parallel_calls: bool
    def __init__(self, json: _Optional[str] = ..., choice: _Optional[str] = ..., parallel_calls: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SpeculationOptions(_message.Message):
    __slots__ = ("enabled", "max_draft_len", "drafter")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_draft_len: int
    drafter: str
    def __init__(self, enabled: _Optional[bool] = ..., max_draft_len: _Optional[int] = ..., drafter: _Optional[str] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "compact_json")
    class Choices(_message.Message):
        __slots__ = ("choices",)
        CHOICES_FIELD_NUMBER: _ClassVar[int]
        choices: _containers.RepeatedScalarFieldContainer[str]
        def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    COMPACT_JSON_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Constraint.Choices
    grammar: str
    compact_json: bool
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Constraint.Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., compact_json: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "chat", "token_ids", "sampling", "seed", "max_new_tokens", "stop", "stop_token_ids", "ignore_eos", "speculation", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "constraint", "cache_salt", "tools")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: SamplingParams
    seed: int
    max_new_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    speculation: SpeculationOptions
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    constraint: Constraint
    cache_salt: str
    tools: Tools
    def __init__(self, text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., speculation: _Optional[_Union[SpeculationOptions, _Mapping]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., cache_salt: _Optional[str] = ..., tools: _Optional[_Union[Tools, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SpeculationStats(_message.Message):
    __slots__ = ("forward_calls", "verification_steps", "drafted_tokens", "accepted_tokens", "acceptance_length", "accept_rate", "evaluated_at_position", "accepted_at_position", "drafter_failures", "forced_tokens", "grammar_rejected_tokens")
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_RATE_FIELD_NUMBER: _ClassVar[int]
    EVALUATED_AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_AT_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    FORCED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REJECTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    forward_calls: int
    verification_steps: int
    drafted_tokens: int
    accepted_tokens: int
    acceptance_length: float
    accept_rate: float
    evaluated_at_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_at_position: _containers.RepeatedScalarFieldContainer[int]
    drafter_failures: int
    forced_tokens: int
    grammar_rejected_tokens: int
    def __init__(self, forward_calls: _Optional[int] = ..., verification_steps: _Optional[int] = ..., drafted_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., acceptance_length: _Optional[float] = ..., accept_rate: _Optional[float] = ..., evaluated_at_position: _Optional[_Iterable[int]] = ..., accepted_at_position: _Optional[_Iterable[int]] = ..., drafter_failures: _Optional[int] = ..., forced_tokens: _Optional[int] = ..., grammar_rejected_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "usage", "speculation", "logprobs", "prompt_logprobs", "tool_calls", "content", "tool_call_deltas")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_DELTAS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    tool_call_deltas: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ..., tool_call_deltas: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "speculation", "logprobs", "prompt_logprobs", "tool_calls", "content")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., speculation: _Optional[_Union[SpeculationStats, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("name", "state", "tp", "active_requests", "waiting_requests", "used_slots", "total_slots", "requests_placed", "steps", "tokens_emitted", "tokens_per_second", "step_seconds", "forward_seconds_per_call", "bytes_sent_per_step", "bytes_received_per_step", "drafter_failures", "restarts", "failed", "draft_wait_seconds_per_step", "runahead_hits", "runahead_misses", "target_busy_fraction", "pipeline", "prefilling_requests", "ttft_p50_seconds", "ttft_p90_seconds", "itl_p50_seconds", "itl_p90_seconds", "prefill_p50_seconds", "prefix_hits", "prefix_queries", "prefix_hit_tokens", "node", "warm_positions", "warm_bytes", "pipeline_mode", "pipelined_steps", "serial_steps", "schedule_switches", "schedule_costs", "undrafted_steps")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_PLACED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_PER_CALL_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_WAIT_SECONDS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_HITS_FIELD_NUMBER: _ClassVar[int]
    RUNAHEAD_MISSES_FIELD_NUMBER: _ClassVar[int]
    TARGET_BUSY_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITL_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ITL_P90_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_P50_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    WARM_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    WARM_BYTES_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MODE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_STEPS_FIELD_NUMBER: _ClassVar[int]
    SERIAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_SWITCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_COSTS_FIELD_NUMBER: _ClassVar[int]
    UNDRAFTED_STEPS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: str
    tp: int
    active_requests: int
    waiting_requests: int
    used_slots: int
    total_slots: int
    requests_placed: int
    steps: int
    tokens_emitted: int
    tokens_per_second: float
    step_seconds: float
    forward_seconds_per_call: float
    bytes_sent_per_step: float
    bytes_received_per_step: float
    drafter_failures: int
    restarts: int
    failed: int
    draft_wait_seconds_per_step: float
    runahead_hits: int
    runahead_misses: int
    target_busy_fraction: float
    pipeline: bool
    prefilling_requests: int
    ttft_p50_seconds: float
    ttft_p90_seconds: float
    itl_p50_seconds: float
    itl_p90_seconds: float
    prefill_p50_seconds: float
    prefix_hits: int
    prefix_queries: int
    prefix_hit_tokens: int
    node: str
    warm_positions: int
    warm_bytes: int
    pipeline_mode: str
    pipelined_steps: int
    serial_steps: int
    schedule_switches: int
    schedule_costs: _containers.RepeatedCompositeFieldContainer[ScheduleCost]
    undrafted_steps: int
    def __init__(self, name: _Optional[str] = ..., state: _Optional[str] = ..., tp: _Optional[int] = ..., active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., used_slots: _Optional[int] = ..., total_slots: _Optional[int] = ..., requests_placed: _Optional[int] = ..., steps: _Optional[int] = ..., tokens_emitted: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., step_seconds: _Optional[float] = ..., forward_seconds_per_call: _Optional[float] = ..., bytes_sent_per_step: _Optional[float] = ..., bytes_received_per_step: _Optional[float] = ..., drafter_failures: _Optional[int] = ..., restarts: _Optional[int] = ..., failed: _Optional[int] = ..., draft_wait_seconds_per_step: _Optional[float] = ..., runahead_hits: _Optional[int] = ..., runahead_misses: _Optional[int] = ..., target_busy_fraction: _Optional[float] = ..., pipeline: _Optional[bool] = ..., prefilling_requests: _Optional[int] = ..., ttft_p50_seconds: _Optional[float] = ..., ttft_p90_seconds: _Optional[float] = ..., itl_p50_seconds: _Optional[float] = ..., itl_p90_seconds: _Optional[float] = ..., prefill_p50_seconds: _Optional[float] = ..., prefix_hits: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., node: _Optional[str] = ..., warm_positions: _Optional[int] = ..., warm_bytes: _Optional[int] = ..., pipeline_mode: _Optional[str] = ..., pipelined_steps: _Optional[int] = ..., serial_steps: _Optional[int] = ..., schedule_switches: _Optional[int] = ..., schedule_costs: _Optional[_Iterable[_Union[ScheduleCost, _Mapping]]] = ..., undrafted_steps: _Optional[int] = ...) -> None: ...

class ScheduleCost(_message.Message):
    __slots__ = ("active_requests", "pipelined_seconds_per_token", "serial_seconds_per_token", "best", "undrafted_seconds_per_token")
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SERIAL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BEST_FIELD_NUMBER: _ClassVar[int]
    UNDRAFTED_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    active_requests: int
    pipelined_seconds_per_token: float
    serial_seconds_per_token: float
    best: str
    undrafted_seconds_per_token: float
    def __init__(self, active_requests: _Optional[int] = ..., pipelined_seconds_per_token: _Optional[float] = ..., serial_seconds_per_token: _Optional[float] = ..., best: _Optional[str] = ..., undrafted_seconds_per_token: _Optional[float] = ...) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("name", "address", "state", "calls", "errors", "mean_latency_seconds", "assigned_requests", "in_flight", "restarts", "node", "has_cache", "cache_outputs", "cache_tokens", "cache_nodes", "cache_bytes", "cache_evicted", "proposals", "global_hits", "cache_partitions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    MEAN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ASSIGNED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    HAS_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    state: str
    calls: int
    errors: int
    mean_latency_seconds: float
    assigned_requests: int
    in_flight: int
    restarts: int
    node: str
    has_cache: bool
    cache_outputs: int
    cache_tokens: int
    cache_nodes: int
    cache_bytes: int
    cache_evicted: int
    proposals: int
    global_hits: int
    cache_partitions: int
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., state: _Optional[str] = ..., calls: _Optional[int] = ..., errors: _Optional[int] = ..., mean_latency_seconds: _Optional[float] = ..., assigned_requests: _Optional[int] = ..., in_flight: _Optional[int] = ..., restarts: _Optional[int] = ..., node: _Optional[str] = ..., has_cache: _Optional[bool] = ..., cache_outputs: _Optional[int] = ..., cache_tokens: _Optional[int] = ..., cache_nodes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_evicted: _Optional[int] = ..., proposals: _Optional[int] = ..., global_hits: _Optional[int] = ..., cache_partitions: _Optional[int] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("name", "requests", "prompt_tokens", "generation_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    requests: int
    prompt_tokens: int
    generation_tokens: int
    def __init__(self, name: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., generation_tokens: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("active_requests", "waiting_requests", "used_slots", "total_slots", "steps", "tokens_generated", "drafter_failures", "model", "drafter", "forward_calls", "replicas", "drafters", "failed", "tenants")
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    FORWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    active_requests: int
    waiting_requests: int
    used_slots: int
    total_slots: int
    steps: int
    tokens_generated: int
    drafter_failures: int
    model: str
    drafter: str
    forward_calls: int
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStatus]
    failed: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    def __init__(self, active_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., used_slots: _Optional[int] = ..., total_slots: _Optional[int] = ..., steps: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., drafter_failures: _Optional[int] = ..., model: _Optional[str] = ..., drafter: _Optional[str] = ..., forward_calls: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., drafters: _Optional[_Iterable[_Union[DrafterStatus, _Mapping]]] = ..., failed: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ...) -> None: ...

class ScaleRequest(_message.Message):
    __slots__ = ("target_replicas", "drafters")
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    target_replicas: int
    drafters: int
    def __init__(self, target_replicas: _Optional[int] = ..., drafters: _Optional[int] = ...) -> None: ...

class ScaleResponse(_message.Message):
    __slots__ = ("target_replicas", "drafters", "added", "removed")
    TARGET_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    target_replicas: int
    drafters: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, target_replicas: _Optional[int] = ..., drafters: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...
