from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DraftDist(_message.Message):
    __slots__ = ("tokens", "probs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("tokens", "dists")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    dists: _containers.RepeatedCompositeFieldContainer[DraftDist]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., dists: _Optional[_Iterable[_Union[DraftDist, _Mapping]]] = ...) -> None: ...

class DraftSampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class ProposeItem(_message.Message):
    __slots__ = ("request_id", "known", "append", "hidden", "max_len", "sampling", "assumed", "ahead", "partition")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    known: int
    append: _containers.RepeatedScalarFieldContainer[int]
    hidden: Tensor
    max_len: int
    sampling: DraftSampling
    assumed: _containers.RepeatedScalarFieldContainer[int]
    ahead: bool
    partition: str
    def __init__(self, request_id: _Optional[str] = ..., known: _Optional[int] = ..., append: _Optional[_Iterable[int]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., max_len: _Optional[int] = ..., sampling: _Optional[_Union[DraftSampling, _Mapping]] = ..., assumed: _Optional[_Iterable[int]] = ..., ahead: _Optional[bool] = ..., partition: _Optional[str] = ...) -> None: ...

class ProposeRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ProposeItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ProposeItem, _Mapping]]] = ...) -> None: ...

class ProposeResult(_message.Message):
    __slots__ = ("block", "resync")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    block: DraftBlock
    resync: bool
    def __init__(self, block: _Optional[_Union[DraftBlock, _Mapping]] = ..., resync: _Optional[bool] = ...) -> None: ...

class ProposeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ProposeResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ProposeResult, _Mapping]]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("tokens", "partition")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    partition: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., partition: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_ids", "outputs")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    outputs: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., outputs: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("name", "wants_hidden", "max_draft_len", "remembers_outputs", "hidden_layers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    WANTS_HIDDEN_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_LEN_FIELD_NUMBER: _ClassVar[int]
    REMEMBERS_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    wants_hidden: bool
    max_draft_len: int
    remembers_outputs: bool
    hidden_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., wants_hidden: _Optional[bool] = ..., max_draft_len: _Optional[int] = ..., remembers_outputs: _Optional[bool] = ..., hidden_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("has_cache", "cache_outputs", "cache_tokens", "cache_nodes", "cache_bytes", "cache_evicted", "proposals", "global_hits", "cache_partitions")
    HAS_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NODES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    has_cache: bool
    cache_outputs: int
    cache_tokens: int
    cache_nodes: int
    cache_bytes: int
    cache_evicted: int
    proposals: int
    global_hits: int
    cache_partitions: int
    def __init__(self, has_cache: _Optional[bool] = ..., cache_outputs: _Optional[int] = ..., cache_tokens: _Optional[int] = ..., cache_nodes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_evicted: _Optional[int] = ..., proposals: _Optional[int] = ..., global_hits: _Optional[int] = ..., cache_partitions: _Optional[int] = ...) -> None: ...
