"""The replica channel's data format: an explicit, versioned encoding of exactly the per-step
calls and their results, in msgpack with raw tensor buffers beside it. Nothing a peer sends is
unpickled: decoding builds only the types named here, after checking every field.

A message (the body of one channel frame, `target_worker.channel`) is::

    u32 little-endian header length | msgpack header | buffer 0 | buffer 1 | ...

The header is ``[WIRE_VERSION, payload, [len(buffer 0), len(buffer 1), ...]]``; tensors and
arrays in the payload are ``[dtype, shape, buffer index]`` and their bytes (row-major,
little-endian) are the buffers, so hidden and probability rows are not copied into msgpack.

Payloads (positional lists; ``tokens`` are lists of ints, ``sampling`` a `SamplingParams`):

- a call: ``[method, *args]`` for ``allocate`` (no args), ``allocate_prefix`` (tokens,
  partition: a str, "" the shared one),
  ``free`` (slot), ``prefill`` and ``verify`` (each a list of items, either kind in one
  step: a `PrefillItem` as ``[0, slot, tokens, sampling, want_hidden, start_pos, offset,
  last, logprobs, prompt_logprobs, next_token, mask, hidden_layers]``, a `VerifyItem` as
  ``[1, slot, start_pos, tokens, sampling, want_hidden, logprobs, mask, hidden_layers]``;
  logprobs, prompt_logprobs and next_token are ints or None, mask None or an int32 array, the
  grammar bitmask, hidden_layers a list of ints, [] for the final-norm rows);
  `SamplingParams` is ``[temperature, top_k,
  top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty]``. Any other method
  name travels with no arguments (the server refuses it by name).
- a result: ``[1, value]``: an int (allocate), ``[slot, reused]`` (allocate_prefix), None
  (free) or a list of `StepOutput` as ``[rows, hidden, logprobs]`` (prefill, verify), where
  rows are None, ``[0, argmax ints]`` (`GreedyRows`), ``[1, tensor]`` (`ProbRows`) or ``[2,
  offsets, token_ids, probs, vocab_size]`` (`SparseProbRows`), hidden is None or a tensor,
  and logprobs None or ``[top_ids, top_logprobs, offsets, token_ids, logprobs, full or
  None]`` arrays (`specd_core.logprobs.RowLogprobs`).
- an error: ``[0, type name, message]``; the client raises `ERRORS` [name] (RuntimeError for
  a name not listed) with the message.

Tensors and arrays may be float32, float16, bfloat16 (tensors only), int64 or int32. The wire
is little-endian; this module refuses to load on a big-endian host.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence

import msgpack
import numpy as np
import torch

from specd_core.logprobs import RowLogprobs
from specd_core.rule import GreedyRows, ProbRows, SparseProbRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, StepOutput, VerifyItem

from .engine import SlotsExhausted

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("the replica channel's wire format is little-endian only")

__all__ = ["ERRORS", "METHODS", "WIRE_VERSION", "WireError", "decode_call", "decode_reply",
           "encode_call", "encode_error", "encode_result"]

#: Bumped on any change to the layout above; a peer on another version is refused.
#: 2: log probabilities (item fields and `StepOutput.logprobs`).
#: 3: grammar bitmasks (the items' last field).
#: 4: allocate_prefix carries the request's cross-request partition.
#: 5: the items' hidden_layers (which residual streams the hidden rows are).
WIRE_VERSION = 5
#: The calls this format knows.
METHODS = ("allocate", "allocate_prefix", "free", "prefill", "verify")
#: Exception types an error reply may name (anything else arrives as RuntimeError).
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls for cls in (ValueError, TypeError, RuntimeError, KeyError, IndexError,
                                  NotImplementedError, MemoryError, SlotsExhausted)
}

_HLEN = struct.Struct("<I")
_TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32}
_TENSOR_NAMES = {v: k for k, v in _TENSOR_DTYPES.items()}
_ARRAY_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
                 "int64": np.dtype("<i8"), "int32": np.dtype("<i4")}
_ARRAY_NAMES = {v: k for k, v in _ARRAY_DTYPES.items()}
#: The most dimensions a tensor may declare.
_MAX_DIMS = 8


class WireError(ValueError):
    """A message that does not follow this format (wrong version, structure, type, size):
    nothing of it was used."""


# ---- encoding (our own objects: lenient about int-like numpy scalars) ----------------------

def _default(obj):
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return float(obj)
    raise TypeError(f"the replica channel cannot encode a {type(obj).__name__}")


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list = []

    def tensor(self, t: torch.Tensor) -> list:
        t = t.detach().to("cpu").contiguous()
        name = _TENSOR_NAMES.get(t.dtype)
        if name is None:
            raise TypeError(f"the replica channel cannot encode a {t.dtype} tensor")
        self.buffers.append(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
        return [name, list(t.shape), len(self.buffers) - 1]

    def array(self, a: np.ndarray) -> list:
        a = np.ascontiguousarray(a)
        name = _ARRAY_NAMES.get(a.dtype)
        if name is None:
            raise TypeError(f"the replica channel cannot encode a {a.dtype} array")
        # Byte-format views: a transport slices what it could not send by bytes.
        self.buffers.append(a.astype(_ARRAY_DTYPES[name], copy=False).reshape(-1)
                            .view(np.uint8).data)
        return [name, list(a.shape), len(self.buffers) - 1]

    def rows(self, rows) -> list | None:
        kind = type(rows)
        if rows is None:
            return None
        if kind is GreedyRows:
            return [0, list(rows.argmax)]
        if kind is ProbRows:
            return [1, self.tensor(rows.probs)]
        if kind is SparseProbRows:
            return [2, self.array(rows.offsets), self.array(rows.token_ids),
                    self.array(rows.probs), int(rows.vocab_size)]
        raise TypeError(f"the replica channel cannot encode rows of type {kind.__name__}")

    def output(self, out) -> list:
        if type(out) is not StepOutput:
            raise TypeError(f"the replica channel cannot encode a {type(out).__name__}")
        return [self.rows(out.rows), None if out.hidden is None else self.tensor(out.hidden),
                self.logprobs(out.logprobs)]

    def logprobs(self, lp) -> list | None:
        if lp is None:
            return None
        if type(lp) is not RowLogprobs:
            raise TypeError(f"the replica channel cannot encode a {type(lp).__name__}")
        return [self.array(lp.top_ids), self.array(lp.top_logprobs), self.array(lp.offsets),
                self.array(lp.token_ids), self.array(lp.logprobs),
                None if lp.full is None else self.array(lp.full)]

    def finish(self, payload) -> list:
        sizes = [memoryview(b).nbytes for b in self.buffers]
        header = msgpack.packb([WIRE_VERSION, payload, sizes], default=_default,
                               use_bin_type=True)
        return [_HLEN.pack(len(header)), header, *self.buffers]


def _sampling(p: SamplingParams) -> list:
    if type(p) is not SamplingParams:
        raise TypeError(f"the replica channel cannot encode sampling of type {type(p).__name__}")
    return [p.temperature, p.top_k, p.top_p, p.min_p, p.repetition_penalty,
            p.presence_penalty, p.frequency_penalty]


def _item(item, enc: _Encoder) -> list:
    kind = type(item)
    if kind is not PrefillItem and kind is not VerifyItem:
        raise TypeError(f"the replica channel cannot encode a {kind.__name__}")
    mask = None if item.mask is None else enc.array(np.asarray(item.mask))
    if kind is PrefillItem:
        return [_PREFILL, item.slot, item.tokens, _sampling(item.sampling), item.want_hidden,
                item.start_pos, item.offset, item.last, item.logprobs, item.prompt_logprobs,
                item.next_token, mask, [int(i) for i in item.hidden_layers]]
    if kind is VerifyItem:
        return [_VERIFY, item.slot, item.start_pos, item.tokens, _sampling(item.sampling),
                item.want_hidden, item.logprobs, mask, [int(i) for i in item.hidden_layers]]
    raise TypeError(f"the replica channel cannot encode a {kind.__name__}")


def encode_call(method: str, args: Sequence) -> list:
    """``method(*args)`` as a message: a list of bytes-like chunks to send in order.

    Raises:
        TypeError: an argument of a type this format does not carry.
        ValueError: arguments that do not fit ``method``.
    """
    if method not in METHODS:
        if args:
            raise ValueError(f"unknown target method {method!r} cannot carry arguments")
        return _Encoder().finish([method])
    if method == "allocate_prefix" and len(args) == 1:
        args = (*args, "")  # the shared partition
    want = {"allocate": 0, "allocate_prefix": 2, "free": 1, "prefill": 1, "verify": 1}[method]
    if len(args) != want:
        raise ValueError(f"{method} takes {want} argument(s), got {len(args)}")
    if method in ("prefill", "verify"):
        enc = _Encoder()
        return enc.finish([method, [_item(i, enc) for i in args[0]]])
    if method == "allocate_prefix":
        if not isinstance(args[1], str):
            raise TypeError(f"partition must be a str, got {type(args[1]).__name__}")
        return _Encoder().finish([method, list(args[0]), args[1]])
    return _Encoder().finish([method, *args])


def encode_result(method: str, value) -> list:
    """The successful result of ``method`` as a message (chunks).

    Raises:
        TypeError: a result of a type this format does not carry for ``method``.
    """
    enc = _Encoder()
    if method in ("prefill", "verify"):
        if not isinstance(value, list | tuple):
            raise TypeError(f"{method} must return a list of StepOutput")
        return enc.finish([1, [enc.output(o) for o in value]])
    if method == "allocate_prefix":
        slot, reused = value
        return enc.finish([1, [_int(slot, "slot", TypeError), _int(reused, "reused", TypeError)]])
    if method == "allocate":
        return enc.finish([1, _int(value, "slot", TypeError)])
    if method == "free":
        if value is not None:
            raise TypeError("free must return None")
        return enc.finish([1, None])
    raise TypeError(f"no result encoding for method {method!r}")


def encode_error(exc: BaseException) -> list:
    """An error reply naming the nearest `ERRORS` type of ``exc`` (chunks). Only that name
    and ``str(exc)`` (with the original type's name when it differs) travel."""
    name = next((c.__name__ for c in type(exc).__mro__ if ERRORS.get(c.__name__) is c),
                "RuntimeError")
    message = str(exc) if type(exc).__name__ == name else f"{type(exc).__name__}: {exc}"
    return _Encoder().finish([0, name, message])


# ---- decoding (a peer's bytes: strict) -----------------------------------------------------

def _int(value, what: str, error: type[Exception] = WireError) -> int:
    if type(value) is int:
        return value
    if error is not WireError and isinstance(value, np.integer):  # encoding our own
        value = int(value)
    if type(value) is not int:
        raise error(f"{what} must be an int, got {type(value).__name__}")
    return value


def _bool(value, what: str) -> bool:
    if type(value) is not bool:
        raise WireError(f"{what} must be a bool, got {type(value).__name__}")
    return value


def _list(value, what: str, n: int | None = None) -> list:
    if type(value) is not list:
        raise WireError(f"{what} must be a list, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise WireError(f"{what} must have {n} fields, got {len(value)}")
    return value


_PREFILL, _VERIFY = 0, 1  # item kinds
_INTS = frozenset({int})
_NUMBERS = frozenset({int, float})


def _tokens(value, what: str) -> list[int]:
    value = _list(value, what)
    if not _INTS.issuperset(map(type, value)):  # bools and floats are not token ids
        raise WireError(f"{what} must hold ints only")
    return value


class _Decoder:
    def __init__(self, body: bytes | bytearray | memoryview):
        view = memoryview(body)
        if view.nbytes < _HLEN.size:
            raise WireError("message shorter than its header length")
        (hlen,) = _HLEN.unpack(view[:_HLEN.size])
        if hlen > view.nbytes - _HLEN.size:
            raise WireError(f"header of {hlen} bytes exceeds the message")
        try:
            header = msgpack.unpackb(view[_HLEN.size:_HLEN.size + hlen], raw=False,
                                     strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack's own errors: ExtraData, FormatError, ValueError
            raise WireError(f"not a msgpack header: {exc!r}") from None
        header = _list(header, "header", 3)
        if type(header[0]) is not int or header[0] != WIRE_VERSION:
            raise WireError(f"wire version {header[0]!r}, expected {WIRE_VERSION}")
        self.payload = header[1]
        sizes = _tokens(header[2], "buffer sizes")
        self.buffers: list[memoryview] = []
        at = _HLEN.size + hlen
        for size in sizes:
            if size < 0 or at + size > view.nbytes:
                raise WireError("buffer sizes exceed the message")
            self.buffers.append(view[at:at + size])
            at += size
        if at != view.nbytes:
            raise WireError(f"{view.nbytes - at} bytes after the last buffer")

    def _ref(self, value, what: str, names) -> tuple[str, list[int], memoryview]:
        name, shape, index = _list(value, what, 3)
        if type(name) is not str or name not in names:
            raise WireError(f"{what}: dtype {name!r} not one of {', '.join(names)}")
        shape = _tokens(shape, f"{what} shape")
        if len(shape) > _MAX_DIMS or any(d < 0 for d in shape):
            raise WireError(f"{what}: bad shape {shape}")
        index = _int(index, f"{what} buffer index")
        if not 0 <= index < len(self.buffers):
            raise WireError(f"{what}: no buffer {index}")
        return name, shape, self.buffers[index]

    def tensor(self, value, what: str) -> torch.Tensor:
        name, shape, buf = self._ref(value, what, _TENSOR_DTYPES)
        dtype = _TENSOR_DTYPES[name]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if buf.nbytes != math.prod(shape) * itemsize:
            raise WireError(f"{what}: {name} {shape} needs {math.prod(shape) * itemsize} "
                            f"bytes, got {buf.nbytes}")
        if buf.nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(buf), dtype=dtype).reshape(shape)

    def array(self, value, what: str) -> np.ndarray:
        name, shape, buf = self._ref(value, what, _ARRAY_DTYPES)
        dtype = _ARRAY_DTYPES[name]
        if buf.nbytes != math.prod(shape) * dtype.itemsize:
            raise WireError(f"{what}: {name} {shape} needs "
                            f"{math.prod(shape) * dtype.itemsize} bytes, got {buf.nbytes}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))

    def rows(self, value):
        if value is None:
            return None
        value = _list(value, "rows")
        if not value or type(value[0]) is not int:
            raise WireError("rows need a kind")
        kind = value[0]
        if kind == 0 and len(value) == 2:
            return GreedyRows(tuple(_tokens(value[1], "argmax")))
        if kind == 1 and len(value) == 2:
            probs = self.tensor(value[1], "probs")
            if probs.dim() != 2:
                raise WireError("probability rows must be 2-D")
            return ProbRows(probs)
        if kind == 2 and len(value) == 5:
            offsets = self.array(value[1], "offsets")
            ids = self.array(value[2], "token_ids")
            probs = self.array(value[3], "sparse probs")
            vocab = _int(value[4], "vocab_size")
            if offsets.ndim != 1 or ids.ndim != 1 or probs.ndim != 1 or \
                    not offsets.size or ids.shape != probs.shape or \
                    int(offsets[0]) != 0 or int(offsets[-1]) != ids.shape[0] or \
                    np.any(np.diff(offsets) < 0):
                raise WireError("sparse rows with inconsistent offsets")
            return SparseProbRows(offsets, ids, probs, vocab)
        raise WireError(f"unknown rows kind {kind!r}")

    def output(self, value) -> StepOutput:
        rows, hidden, logprobs = _list(value, "step output", 3)
        return StepOutput(self.rows(rows),
                          None if hidden is None else self.tensor(hidden, "hidden"),
                          self.logprobs(logprobs))

    def logprobs(self, value) -> RowLogprobs | None:
        if value is None:
            return None
        top_ids, top, offsets, ids, values, full = _list(value, "logprobs", 6)
        top_ids, top = self.array(top_ids, "top_ids"), self.array(top, "top_logprobs")
        offsets, ids = self.array(offsets, "offsets"), self.array(ids, "token_ids")
        values = self.array(values, "logprobs")
        full = None if full is None else self.array(full, "full")
        n = offsets.shape[0] - 1 if offsets.ndim == 1 else -1
        if top_ids.ndim != 2 or top.shape != top_ids.shape or top_ids.shape[0] != n or \
                ids.ndim != 1 or values.shape != ids.shape or n < 0 or \
                int(offsets[0]) != 0 or int(offsets[-1]) != ids.shape[0] or \
                np.any(np.diff(offsets) < 0) or \
                (full is not None and (full.ndim != 2 or full.shape[0] != n)):
            raise WireError("log probabilities with inconsistent shapes")
        return RowLogprobs(top_ids, top, offsets, ids, values, full)


def _sampling_from(value, cache: dict) -> SamplingParams:
    """A `SamplingParams` from its 7 fields; ``cache`` (one per message) maps fields already
    seen to the object built from them (a batch's items mostly share them)."""
    if type(value) is not list or len(value) != 7 or \
            not _NUMBERS.issuperset(map(type, value)):
        raise WireError("sampling is a list of 7 numbers")
    key = tuple(value)  # only ints and floats, checked above (no bool can alias 0 or 1)
    params = cache.get(key)
    if params is None:
        try:
            params = cache[key] = SamplingParams(*value)
        except ValueError as exc:
            raise WireError(str(exc)) from None
    return params


def _optional_int(value, what: str) -> int | None:
    if value is not None and type(value) is not int:
        raise WireError(f"{what} must be an int or None, got {type(value).__name__}")
    return value


def _mask_from(value, decoder: _Decoder) -> np.ndarray | None:
    if value is None:
        return None
    mask = decoder.array(value, "mask")
    if mask.dtype != np.int32 or mask.ndim != 2:
        raise WireError("a grammar mask is a 2-D int32 array")
    return mask


def _item_from(value, cache: dict, decoder: _Decoder) -> PrefillItem | VerifyItem:
    """A `PrefillItem` (``[0, slot, tokens, sampling, want_hidden, start_pos, offset, last,
    logprobs, prompt_logprobs, next_token, mask, hidden_layers]``) or a `VerifyItem` (``[1,
    slot, start_pos, tokens, sampling, want_hidden, logprobs, mask, hidden_layers]``)."""
    if type(value) is not list or not value:
        raise WireError("an item is a non-empty list")
    kind = value[0]
    if kind == _VERIFY and type(kind) is int and len(value) == 9:
        _, slot, start_pos, tokens, sampling, want_hidden, logprobs, mask, layers = value
        if type(slot) is not int or type(start_pos) is not int or type(want_hidden) is not bool:
            raise WireError("verify item: slot and start_pos must be ints, want_hidden a bool")
        return VerifyItem(slot, start_pos, _tokens(tokens, "tokens"),
                          _sampling_from(sampling, cache), want_hidden,
                          _optional_int(logprobs, "logprobs"), _mask_from(mask, decoder),
                          tuple(_tokens(layers, "hidden_layers")))
    if kind == _PREFILL and type(kind) is int and len(value) == 13:
        (_, slot, tokens, sampling, want_hidden, start_pos, offset, last, logprobs,
         prompt_logprobs, next_token, mask, layers) = value
        if type(slot) is not int or type(start_pos) is not int or type(offset) is not int or \
                type(want_hidden) is not bool or type(last) is not bool:
            raise WireError("prefill item: slot, start_pos and offset must be ints, "
                            "want_hidden and last bools")
        return PrefillItem(slot, _tokens(tokens, "tokens"), _sampling_from(sampling, cache),
                           want_hidden, start_pos, offset, last,
                           _optional_int(logprobs, "logprobs"),
                           _optional_int(prompt_logprobs, "prompt_logprobs"),
                           _optional_int(next_token, "next_token"), _mask_from(mask, decoder),
                           tuple(_tokens(layers, "hidden_layers")))
    raise WireError(f"an item of unknown kind {kind!r} or with {len(value) - 1} fields")


def decode_call(body: bytes | bytearray | memoryview) -> tuple[str, tuple]:
    """``(method, args)`` from a call message. An unknown method name comes back with no
    args (the server refuses it by name).

    Raises:
        WireError: anything that does not follow the format.
    """
    decoder = _Decoder(body)
    payload = _list(decoder.payload, "call")
    if not payload or type(payload[0]) is not str:
        raise WireError("a call starts with its method name")
    method, args = payload[0], payload[1:]
    if method not in METHODS:
        if args:
            raise WireError(f"unknown method {method!r} with arguments")
        return method, ()
    if method == "allocate":
        _list(args, "allocate arguments", 0)
        return method, ()
    if method == "allocate_prefix":
        tokens, partition = _list(args, "allocate_prefix arguments", 2)
        if type(partition) is not str:
            raise WireError(f"partition must be a str, got {type(partition).__name__}")
        return method, (_tokens(tokens, "tokens"), partition)
    (arg,) = _list(args, f"{method} arguments", 1)
    if method == "free":
        return method, (_int(arg, "slot"),)
    cache: dict = {}
    return method, ([_item_from(item, cache, decoder) for item in
                     _list(arg, f"{method} items")],)


def decode_reply(method: str, body: bytes | bytearray | memoryview):
    """The result of ``method`` from a reply message, or raises the error it carries.

    Raises:
        WireError: anything that does not follow the format.
        The carried error: an `ERRORS` type (RuntimeError for another name) with its message.
    """
    decoder = _Decoder(body)
    payload = _list(decoder.payload, "reply")
    if len(payload) == 3 and payload[0] == 0:
        name, message = payload[1], payload[2]
        if type(name) is not str or type(message) is not str:
            raise WireError("an error reply carries a type name and a message")
        cls = ERRORS.get(name)
        if cls is None:
            raise RuntimeError(f"{name}: {message}")
        raise cls(message)
    if len(payload) != 2 or payload[0] != 1:
        raise WireError("a reply is [1, value] or [0, type, message]")
    value = payload[1]
    if method in ("prefill", "verify"):
        return [decoder.output(o) for o in _list(value, f"{method} outputs")]
    if method == "allocate_prefix":
        slot, reused = _list(value, "allocate_prefix result", 2)
        return _int(slot, "slot"), _int(reused, "reused")
    if method == "allocate":
        return _int(value, "slot")
    if method == "free":
        if value is not None:
            raise WireError("free returns nothing")
        return None
    raise WireError(f"no result decoding for method {method!r}")
