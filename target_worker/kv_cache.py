"""The target's KV cache: keys and values of every layer for one sequence, in key blocks.

Split from `target_worker.model` (which re-exports these names): the cache's layout is what
attention (`target_worker.attention`) and the native forward read.
"""

from __future__ import annotations

import torch

__all__ = ["DEFAULT_CACHE_CAPACITY", "KEY_BLOCK", "KvCache"]

#: Keys are reduced in blocks of this many positions, aligned at position 0: a query row's
#: attention is the same sum of the same per-block partial sums whether it is decoded
#: alone, verified in a block or prefilled in a chunk (`Attention`). A multiple of 64, so
#: a block of float32 or bfloat16 scores has no scalar tail in a vectorised loop. Measured
#: (SmolLM2, float32, 2 threads, 2026-12-02; ms per forward, 300 / 3000 cached positions,
#: and a 6,000-token prompt in 128-token chunks): 64: 1 token 129 / 180, 64 tokens 407 /
#: 1257, prompt 80.9 s; 128: 123 / 152, 333 / 549, 62.0 s; 256: 114-124 / 180-184,
#: 335-368 / 534-574, 51.3-51.7 s; 512: 142 / 168, 473 / 707, 59.2 s (fewer, larger
#: matmuls against a block's masked tail).
KEY_BLOCK = 256

DEFAULT_CACHE_CAPACITY = 1024


class KvCache:
    """Keys and values of every layer for one sequence, in blocks of `KEY_BLOCK` positions.

    ``k`` and ``v`` are preallocated tensors (the decoder's dtype) of shape ``[n_layers,
    capacity // KEY_BLOCK, n_kv_heads, KEY_BLOCK, head_dim]``: block-major, so attention
    reads the first ``J`` blocks of every KV head as one ``[J * n_kv_heads, KEY_BLOCK,
    head_dim]`` batch (`Attention`). Positions ``[0, seq_len)`` are committed; read them
    with :meth:`keys` / :meth:`values`. Rolling back is O(1): :meth:`truncate` only lowers
    ``seq_len`` and later writes overwrite the stale entries. Capacity doubles (capped at
    ``max_seq_len``, rounded up to whole blocks) when a forward needs more room. Create one
    with :meth:`Decoder.new_cache` (on the decoder's device; ``device`` None: torch's default).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if not 1 <= capacity <= max_seq_len:
            raise ValueError(f"capacity must be in [1, max_seq_len={max_seq_len}], got {capacity}")
        self.max_seq_len = max_seq_len
        shape = (n_layers, -(-capacity // KEY_BLOCK), n_kv_heads, KEY_BLOCK, head_dim)
        # Uninitialised is fine: attention reads positions [0, end), all written first, and
        # the rest of end's key block, which each forward zeroes first (`zero_tail`).
        # Allocated in inference mode so forward passes (also in inference mode) can write them.
        with torch.inference_mode():
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self._seq_len = 0

    @property
    def seq_len(self) -> int:
        """Number of committed positions (the absolute position of the next token)."""
        return self._seq_len

    @property
    def capacity(self) -> int:
        """Positions that fit before the next reallocation (a multiple of `KEY_BLOCK`)."""
        return self.k.shape[1] * KEY_BLOCK

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[2]

    def keys(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """A copy of the keys at positions ``[start, end)`` (default: to ``seq_len``):
        ``[n_layers, n_kv_heads, end - start, head_dim]``."""
        return self._positions(self.k, start, self._seq_len if end is None else end)

    def values(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Like :meth:`keys`, for the values."""
        return self._positions(self.v, start, self._seq_len if end is None else end)

    @staticmethod
    def _positions(t: torch.Tensor, start: int, end: int) -> torch.Tensor:
        layers, blocks, heads, _, d = t.shape
        flat = t.permute(0, 2, 1, 3, 4).reshape(layers, heads, blocks * KEY_BLOCK, d)
        return flat[:, :, start:end].clone()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores ``k``, ``v`` ``[m, n_kv_heads, head_dim]`` at positions ``[start, start +
        m)`` of ``layer`` (within the capacity; `reserve` first)."""
        end = start + k.shape[0]
        for block in range(start // KEY_BLOCK, (end - 1) // KEY_BLOCK + 1):
            lo, hi = max(start, block * KEY_BLOCK), min(end, (block + 1) * KEY_BLOCK)
            at = slice(lo - block * KEY_BLOCK, hi - block * KEY_BLOCK)
            self.k[layer, block, :, at] = k[lo - start : hi - start].transpose(0, 1)
            self.v[layer, block, :, at] = v[lo - start : hi - start].transpose(0, 1)

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> None:
        """Like :meth:`write`, at the distinct positions ``positions`` (a long tensor ``[m]``
        on the cache's device, within the capacity): the same entries, with no host-side
        position, as a captured CUDA graph needs (`target_worker.graphs`)."""
        blocks, offsets = positions // KEY_BLOCK, positions % KEY_BLOCK
        self.k[layer][blocks, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def zero_tail(self, end: int) -> None:
        """Zeroes every layer's entries after position ``end`` in its block: attention reads
        whole blocks, masking keys after a row, but the values must be finite (0 * NaN)."""
        if end % KEY_BLOCK:
            block = end // KEY_BLOCK
            self.k[:, block, :, end % KEY_BLOCK :] = 0
            self.v[:, block, :, end % KEY_BLOCK :] = 0

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (O(1)).

        Raises:
            ValueError: if ``n < 0`` or ``n > seq_len``.
        """
        if not 0 <= n <= self._seq_len:
            raise ValueError(f"truncate length must be in [0, seq_len={self._seq_len}], got {n}")
        self._seq_len = n

    def advance(self, n: int) -> None:
        """Commit the ``n`` positions a forward has just written after ``seq_len``.

        Raises:
            ValueError: if ``n < 0`` or ``seq_len + n`` exceeds the capacity.
        """
        if not 0 <= n <= self.capacity - self._seq_len:
            raise ValueError(f"advance must be in [0, {self.capacity - self._seq_len}], got {n}")
        self._seq_len += n

    def clone(self) -> KvCache:
        """Independent deep copy (committed positions only are meaningful)."""
        new = KvCache.__new__(KvCache)
        new.max_seq_len = self.max_seq_len
        with torch.inference_mode():
            new.k = self.k.clone()
            new.v = self.v.clone()
        new._seq_len = self._seq_len
        return new

    def prefix_copy(self, n: int, capacity: int | None = None) -> KvCache:
        """A new cache holding a copy of this one's first ``n`` positions (same dtype and
        device, the values bitwise the same; this cache is left as it is): what a request
        sharing only a prefix of a warm cache starts from (`TargetEngine.allocate_prefix`).

        Args:
            n: positions to copy, in ``[0, seq_len]``.
            capacity: the new cache's room in positions (at least ``n``; rounded up to whole
                blocks, capped at ``max_seq_len``); default this cache's capacity.

        Raises:
            ValueError: ``n`` outside ``[0, seq_len]``, or ``capacity`` below ``max(n, 1)``
                or above ``max_seq_len``.
        """
        if not 0 <= n <= self._seq_len:
            raise ValueError(f"prefix_copy length must be in [0, seq_len={self._seq_len}], "
                             f"got {n}")
        capacity = self.capacity if capacity is None else capacity
        if not max(n, 1) <= capacity <= self.max_seq_len:
            raise ValueError(f"capacity must be in [{max(n, 1)}, max_seq_len="
                             f"{self.max_seq_len}], got {capacity}")
        new = KvCache.__new__(KvCache)
        new.max_seq_len = self.max_seq_len
        # Whole blocks: the stale entries after ``n`` in its block are what a `truncate`
        # leaves too (each forward zeroes them first, `zero_tail`).
        new.k, new.v = self._copied_blocks(capacity, n)
        new._seq_len = n
        return new

    def _copied_blocks(self, capacity: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New keys and values tensors with room for ``capacity`` positions (whole blocks,
        at most ``max_seq_len``), holding copies of the blocks of the first ``n``."""
        blocks = -(-min(capacity, self.max_seq_len) // KEY_BLOCK)
        used = -(-n // KEY_BLOCK)
        out = []
        with torch.inference_mode():
            for old in (self.k, self.v):
                t = torch.empty((old.shape[0], blocks, *old.shape[2:]), dtype=old.dtype,
                                device=old.device)
                t[:, :used] = old[:, :used]
                out.append(t)
        return out[0], out[1]

    @property
    def position_bytes(self) -> int:
        """Bytes one position takes (keys and values of every layer and KV head)."""
        layers, _, heads, _, d = self.k.shape
        return 2 * layers * heads * d * self.k.element_size()

    def reserve(self, needed: int) -> None:
        """Make room for ``needed`` positions, doubling capacity up to ``max_seq_len``.

        Raises:
            ValueError: if ``needed > max_seq_len``.
        """
        if needed <= self.capacity:
            return
        if needed > self.max_seq_len:
            raise ValueError(
                f"sequence of {needed} positions exceeds max_seq_len={self.max_seq_len}"
            )
        new_cap = self.capacity
        while new_cap < needed:
            new_cap *= 2
        self.k, self.v = self._copied_blocks(new_cap, self._seq_len)
