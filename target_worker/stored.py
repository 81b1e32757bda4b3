"""Weights as a GGUF file stores them, for the native forward (`target_worker.native`).

Kept apart from the native forward so that the GGUF reader and the disk cache can hold
stored weights without importing the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: ggml tensor types the native forward reads as stored: id -> (name, elements per block,
#: bytes per block). Other types are dequantized to float32 when loaded.
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}

@dataclass(frozen=True)
class StoredWeight:
    """A weight matrix ``[n, k]`` as its file stores it: ggml ``type`` (a key of
    `GGML_TYPES`), ``data`` uint8 ``[n, row_bytes]`` (rows of whole blocks)."""

    type: int
    n: int
    k: int
    data: torch.Tensor

    def __post_init__(self) -> None:
        if self.type not in GGML_TYPES:
            raise ValueError(f"ggml type {self.type} is not one the native forward reads")
        _, per, size = GGML_TYPES[self.type]
        if self.k % per:
            raise ValueError(f"a {GGML_TYPES[self.type][0]} row of {self.k} elements is not "
                             f"whole blocks of {per}")
        row = self.k // per * size
        if (self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.n, row)
                or not self.data.is_contiguous()):
            raise ValueError(f"stored weight data must be contiguous uint8 [{self.n}, {row}], "
                             f"got {self.data.dtype} {tuple(self.data.shape)}")
