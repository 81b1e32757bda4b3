"""Conversions between torch / draft-block objects and the ``specd.v1`` drafter messages.

No gRPC logic here: the server and client both build on these functions.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specd.v1 import drafter_pb2
from specd_core.draft import DraftBlock, DraftDist

#: Wire dtypes and their little-endian numpy storage types. bfloat16 has no numpy type, so
#: it travels as its raw 16-bit patterns.
_STORAGE = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<i2"),
}

#: The dtypes a `Tensor` message may carry.
DTYPES: tuple[str, ...] = tuple(_STORAGE)


def _check_dtype(dtype: str) -> np.dtype:
    try:
        return _STORAGE[dtype]
    except KeyError:
        raise ValueError(
            f"unknown tensor dtype {dtype!r}; expected one of {', '.join(DTYPES)}"
        ) from None


def tensor_to_proto(t: torch.Tensor, dtype: str = "float32") -> drafter_pb2.Tensor:
    """Encodes a floating tensor of any shape as a ``Tensor`` message in ``dtype``.

    Args:
        t: any floating tensor, any device; it is copied to the CPU and cast to ``dtype``
            (16-bit dtypes round; values beyond float16's range become +-inf).
        dtype: the wire dtype, "float32", "float16" or "bfloat16".

    Returns:
        A message with ``shape == list(t.shape)`` and ``data`` the row-major little-endian
        bytes (4 or 2 bytes per element).

    Raises:
        ValueError: ``dtype`` is not one of those, or ``t`` is not floating point.
    """
    storage = _check_dtype(dtype)
    if not torch.is_floating_point(t):
        raise ValueError(f"tensor_to_proto needs a floating tensor, got {t.dtype}")
    t = t.detach().to("cpu")
    if dtype == "bfloat16":
        array = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    else:
        array = t.to(getattr(torch, dtype)).contiguous().numpy()
    data = array.astype(storage, copy=False).tobytes(order="C")
    return drafter_pb2.Tensor(dtype=dtype, shape=list(t.shape), data=data)


def tensor_from_proto(msg: drafter_pb2.Tensor) -> torch.Tensor:
    """Decodes a ``Tensor`` message into a new float32 CPU tensor of its shape.

    Raises:
        ValueError: an unknown dtype, a negative dimension, or ``data`` whose byte count is
            not ``prod(shape) * itemsize``.
    """
    storage = _check_dtype(msg.dtype)
    shape = [int(d) for d in msg.shape]
    if any(d < 0 for d in shape):
        raise ValueError(f"tensor shape {shape} has a negative dimension")
    expected = math.prod(shape) * storage.itemsize
    if len(msg.data) != expected:
        raise ValueError(
            f"tensor data size mismatch: {msg.dtype} {shape} needs {expected} bytes, "
            f"got {len(msg.data)}"
        )
    # frombuffer views the immutable message bytes; copy so the tensor owns writable memory.
    array = np.frombuffer(msg.data, dtype=storage).reshape(shape).copy()
    if msg.dtype == "bfloat16":
        return torch.from_numpy(array).view(torch.bfloat16).to(torch.float32)
    return torch.from_numpy(array).to(torch.float32)


def block_to_proto(block: DraftBlock) -> drafter_pb2.DraftBlock:
    """Encodes a `DraftBlock`; each `DraftDist` becomes parallel ``tokens`` / ``probs`` arrays
    in support order (probabilities narrowed to float32).

    Raises:
        ValueError: a token id outside int32 (the wire type).
    """
    msg = drafter_pb2.DraftBlock(tokens=list(block.tokens))
    for dist in block.dists:
        pairs = dist.support()
        msg.dists.add(tokens=[t for t, _ in pairs], probs=[p for _, p in pairs])
    return msg


def block_from_proto(msg: drafter_pb2.DraftBlock) -> DraftBlock:
    """Decodes a ``DraftBlock`` message.

    Probabilities arrive as float32; `DraftDist` accepts sums within 1e-3 of 1, far looser
    than float32 rounding.

    Raises:
        ValueError: a dist whose ``tokens`` and ``probs`` lengths differ, or anything
            `DraftDist` / `DraftBlock` reject (token and dist counts differ, an invalid or
            non-normalised distribution, a token with zero probability under its own dist).
    """
    dists = []
    for i, d in enumerate(msg.dists):
        if len(d.tokens) != len(d.probs):
            raise ValueError(
                f"draft position {i}: dist has {len(d.tokens)} tokens but {len(d.probs)} probs"
            )
        dists.append(DraftDist(zip(d.tokens, d.probs, strict=True)))
    return DraftBlock(list(msg.tokens), dists)
