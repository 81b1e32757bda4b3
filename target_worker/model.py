"""Llama-architecture decoder with a static, truncatable KV cache (gpt-fast style).

The decoder is the target model of speculative decoding: it scores a block of n proposed tokens
in one forward and rolls the cache back to the accepted prefix by shortening its length. Layout
and numerics follow Hugging Face ``LlamaForCausalLM`` (RMSNorm, "rotate_half" RoPE, grouped-query
attention with KV head ``h // (n_heads // n_kv_heads)`` serving query head ``h``, SwiGLU FFN), so
weights converted from a Llama/SmolLM2 checkpoint give the same logits. Compute is float32 by
default; a bfloat16/float16 decoder (``Decoder.to(dtype)``) keeps RMSNorm and the attention
softmax in float32, as transformers does, and returns float32 logits and hidden rows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, RopeScaling
from .invariant import (
    CALL_ROWS,
    InvariancePlan,
    bmm_function,
    invariant_linear,
    one_thread,
    plan_bmm,
    plan_linear,
    planned,
    pointwise,
    prepare_linear,
)

__all__ = ["Decoder", "KvCache", "KEY_BLOCK", "describe_forward"]

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
    with :meth:`Decoder.new_cache`.
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if not 1 <= capacity <= max_seq_len:
            raise ValueError(f"capacity must be in [1, max_seq_len={max_seq_len}], got {capacity}")
        self.max_seq_len = max_seq_len
        shape = (n_layers, -(-capacity // KEY_BLOCK), n_kv_heads, KEY_BLOCK, head_dim)
        # Uninitialised is fine: attention reads positions [0, end), all written first, and
        # the rest of end's key block, which each forward zeroes first (`zero_tail`).
        # Allocated in inference mode so forward passes (also in inference mode) can write them.
        with torch.inference_mode():
            self.k = torch.empty(shape, dtype=dtype)
            self.v = torch.empty(shape, dtype=dtype)
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


#: Fewest rows `fast_linear` computes in the ``weight @ x.T`` order: below it ``F.linear`` is
#: faster. Measured (``python scripts/linear_paths.py``, torch 2.13.0 CPU, this 2-core
#: machine, SmolLM2's shapes, 1 and 2 threads): at 1-6 rows ``F.linear`` took 0.3-0.6x the
#: time (the LM head at 1 row: 8.1 ms against 20.0 ms), from 8 rows the other order 0.6-0.9x.
FAST_LINEAR_MIN_ROWS = 8


def fast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [n, in]``, ``weight [out, in]``; returns ``[n, out]``
    (any other rank of ``x`` goes to ``F.linear``).

    A weight a batch-invariant decoder planned (`Decoder.make_batch_invariant`) is
    multiplied by its plan (`target_worker.invariant.invariant_linear`): each row's result is
    bitwise the same whatever the other rows. Any other weight (drafters, training) takes
    the fastest order: for ``FAST_LINEAR_MIN_ROWS <= n <= 64`` rows on the CPU
    ``(weight @ x.T).T``, which MKL runs faster than ``F.linear`` there (the result is then a
    non-contiguous view), else ``F.linear``.
    """
    y = invariant_linear(x, weight, bias)
    if y is not None:
        return y
    n = x.shape[0]
    if not FAST_LINEAR_MIN_ROWS <= n <= 64 or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    x = x.contiguous()  # a row-major x makes x.T the operand layout MKL handles fast
    y = (weight @ x.T).T
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` computed with :func:`fast_linear` (same weight layout ``[out, in]``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias)


def _linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    # Uninitialised: weights come from Decoder.random or a checkpoint, so skip Kaiming init.
    return torch.nn.utils.skip_init(Linear, in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension (weight ``[dim]``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out: F.rms_norm dispatches to a slower composite on CPU for one-row inputs.
        if x.dtype != torch.float32:  # bf16 (GPU shards): normalise in float32, as HF does
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True).add_(self.eps))
            return y.to(x.dtype) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps)) * self.weight


def swiglu(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ffn: int
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x [n, hidden]`` (or ``[B, T, hidden]``),
    ``w_gate_up [2*ffn, hidden]`` (gate rows first), ``w_down [hidden, ffn]``: the dense FFN,
    each MoE expert and the EAGLE head's FFN."""
    gate, up = fast_linear(x, w_gate_up).split(ffn, dim=-1)
    return fast_linear(pointwise(F.silu, gate).mul_(up), w_down)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2*ffn, hidden]`` matmul.

    ``w_gate_up.weight`` rows ``[0, ffn)`` are the gate projection, ``[ffn, 2*ffn)`` the up one.
    """

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.ffn = ffn
        self.w_gate_up = _linear(hidden, 2 * ffn)
        self.w_down = _linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w_gate_up.weight, self.w_down.weight, self.ffn)


class MoE(nn.Module):
    """Routed + shared SwiGLU experts, whole (``tp == 1``) or one rank's expert-parallel part.

    Router: ``softmax(router(x))`` over experts, top-k, the k weights renormalised to sum to 1.
    Output: weighted sum of the k routed experts plus the shared experts. The shared experts are
    stored as one SwiGLU whose intermediate is the concatenation of theirs (same sum).
    Weights: ``router.weight [E, hidden]``, ``w_gate_up [E/tp, 2*F, hidden]`` (gate rows first),
    ``w_down [E/tp, hidden, F]``.

    With ``tp > 1`` (`target_worker.sharded`) rank ``r`` holds experts ``[r*E/tp, (r+1)*E/tp)``
    and ``1/tp`` of the shared experts' columns; the router is replicated, so every rank routes
    identically, and the output is this rank's partial sum (the caller all-reduces it).
    """

    def __init__(self, hidden: int, config: ModelConfig, rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        m = config.moe
        assert m is not None
        n_local = m.n_experts // tp
        self.top_k = m.n_experts_active
        self.ffn = m.expert_ffn_dim
        self.first = rank * n_local
        self.router = _linear(hidden, m.n_experts)
        self.w_gate_up = nn.Parameter(torch.empty(n_local, 2 * m.expert_ffn_dim, hidden))
        self.w_down = nn.Parameter(torch.empty(n_local, hidden, m.expert_ffn_dim))
        shared = m.n_shared_experts * m.expert_ffn_dim // tp
        self.shared = SwiGLU(hidden, shared) if m.n_shared_experts else None
        self._views: tuple[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def expert_weights(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per local expert, its ``(w_gate_up [2*F, hidden], w_down [hidden, F])``: views kept
        from call to call (made again only when the parameters get new storage), so the
        batch-invariant plan made for each (`Decoder.make_batch_invariant`) is found again."""
        key = (self.w_gate_up.data_ptr(), self.w_down.data_ptr())
        if self._views is None or self._views[0] != key:
            self._views = (key, [(self.w_gate_up[e], self.w_down[e])
                                 for e in range(self.w_gate_up.shape[0])])
        return self._views[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        probs = torch.softmax(self.router(x), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [n, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).flatten()
        experts = experts.flatten()
        token_of = torch.arange(n).repeat_interleave(self.top_k)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        views = self.expert_weights()
        # Loop over the experts actually hit (at most n*k), each on its tokens only, in
        # increasing expert id: a token's sum has the same order whatever its batch mates.
        for e in experts.unique().tolist():
            local = e - self.first
            if not 0 <= local < len(views):
                continue  # another rank's expert
            slots = (experts == e).nonzero().squeeze(1)
            tokens = token_of[slots]
            y = swiglu(x[tokens], views[local][0], views[local][1], self.ffn)
            out.index_add_(0, tokens, y * weights[slots, None])
        return out


def describe_forward(decoder, report: dict | None) -> str:
    """One line naming the forward ``decoder`` runs, from `Decoder.make_batch_invariant`'s
    ``report`` (None: not batch invariant): e.g. "native q8 forward (avx512, 16 lanes;
    weights Q4_1, Q8_0; KV float16)" or "torch bfloat16 forward (native: ...)"."""
    if report and "native" in report:
        r = report["native"]
        kv = str(decoder.kv_dtype).removeprefix("torch.")
        return (f"native {r['mode']} forward ({r['isa']}; weights {', '.join(r['weights'])}; "
                f"KV {kv})")
    dtype = str(decoder.dtype).removeprefix("torch.")
    if report is None:
        return f"torch {dtype} forward, not batch invariant"
    return f"torch {dtype} forward (native off: {report.get('native_off')})"


def rope_tables(
    head_dim: int, theta: float, size: int, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE tables for positions ``[0, size)``: float32 ``(cos, signed sin)``, ``[size,
    head_dim]`` each, in HF's "rotate_half" layout and arithmetic (float32 inv_freq times
    float32 position), with rotate_half's minus sign folded into the first half of sin (see
    :func:`apply_rope`). ``scaling`` rescales the frequencies as Llama 3.x does
    (`RopeScaling`; transformers' ``_compute_llama3_parameters``, attention factor 1).

    This is the only RoPE layout: GGUF files (llama.cpp's interleaved Q/K rows) are converted
    to it at load time (`target_worker.loader`); HF checkpoints already use it."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim)
    )
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    freqs = torch.outer(torch.arange(size, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    # rotate_half(x) = cat(-x2, x1): fold the minus sign into the first half of sin.
    sin[:, : head_dim // 2].neg_()
    return emb.cos(), sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the last dimension (``head_dim``), with
    ``cos``/``sin`` from :func:`rope_tables` broadcast against ``x`` (e.g. ``[n, 1, d]``
    against ``[n, heads, d]``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


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


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


@dataclass(frozen=True)
class QueryChunk:
    """Query rows of one segment that attend in one go: activation rows ``[lo, hi)`` at
    absolute positions ``[pos, pos + hi - lo)``, reading key blocks ``[0, blocks)``.

    ``rows`` is the folded row count ``group * (hi - lo)`` padded to what the attention
    plans call with (`target_worker.invariant.InvariancePlan.padded_rows`); ``masked`` is
    bool ``[blocks - pos // KEY_BLOCK, 1, rows, KEY_BLOCK]``, True where a key lies after
    the row's position (the padded rows see every key up to the chunk's last position), for
    blocks ``[pos // KEY_BLOCK, blocks)`` only: the blocks before hold no key after any of
    the rows."""

    lo: int
    hi: int
    pos: int
    blocks: int
    rows: int
    masked: torch.Tensor


@dataclass(frozen=True)
class Segment:
    """One sequence inside a packed forward: activation rows ``[lo, hi)`` are fed at absolute
    positions ``[start, start + hi - lo)`` of ``cache``, attending in ``chunks``."""

    lo: int
    hi: int
    start: int
    cache: KvCache
    chunks: Sequence[QueryChunk]


@dataclass(frozen=True)
class AttentionPlans:
    """Batch-invariant plans of attention's two batched matmuls (`target_worker.invariant`):
    scores ``q [blocks, rows, head_dim] @ keys.T [blocks, head_dim, KEY_BLOCK]`` and values
    ``weights [blocks, rows, KEY_BLOCK] @ values [blocks, KEY_BLOCK, head_dim]``."""

    scores: InvariancePlan
    values: InvariancePlan

    def padded_rows(self, rows: int) -> int:
        return max(self.scores.padded_rows(rows), self.values.padded_rows(rows))

    @property
    def max_rows(self) -> int:
        """The most (folded) query rows one call of either matmul is proven at."""
        return min(self.scores.max_rows, self.values.max_rows)

    def threads_for(self, rows: int) -> int | None:
        """1 when either matmul must run ``rows`` padded rows on one thread, else None."""
        return 1 if 1 in (self.scores.threads_for(rows), self.values.threads_for(rows)) \
            else None


@dataclass(frozen=True)
class Rows:
    """Layout of the activation rows of one (packed) forward, shared by every layer: RoPE
    ``cos`` and signed ``sin`` ``[N, 1, head_dim]`` per row (`rope_tables`), the `Segment`
    each row range belongs to, and the attention plans (None: plain ``bmm``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    segments: Sequence[Segment]
    plans: AttentionPlans | None = None


def query_chunks(lo: int, hi: int, start: int, group: int, plans: AttentionPlans | None,
                 device: torch.device | None = None) -> list[QueryChunk]:
    """`QueryChunk` s for a segment's activation rows ``[lo, hi)`` fed at ``start``: at most
    ``plans.max_rows // group`` tokens each (``CALL_ROWS[-1]`` without plans: a proven call
    size once folded), each reading the key blocks up to its own last position (a long
    prompt's causal chunks skip the blocks after them)."""
    step = max(1, (CALL_ROWS[-1] if plans is None else plans.max_rows) // group)
    chunks = []
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        m, pos = b - a, start + a - lo
        end = pos + m
        folded = group * m
        rows = plans.padded_rows(folded) if plans is not None else folded
        blocks = -(-end // KEY_BLOCK)
        # Row r of the folded layout is token r % m (query heads of a KV group are stacked).
        q_pos = torch.full((rows,), end - 1, dtype=torch.long, device=device)
        q_pos[:folded] = torch.arange(pos, end, device=device).repeat(group)
        first = pos // KEY_BLOCK
        keys = torch.arange(first * KEY_BLOCK, blocks * KEY_BLOCK, device=device)
        masked = keys.view(-1, 1, 1, KEY_BLOCK) > q_pos[None, None, :, None]
        chunks.append(QueryChunk(a, b, pos, blocks, rows, masked))
    return chunks


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 (a power of two long) by halving: ``x[:h] + x[h:]`` until one is left.
    Zero entries appended at the end leave the result bitwise unchanged (each extra level
    adds exact zeros), so a row's sum does not depend on how many blocks follow it."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and a fused QKV projection.

    ``wqkv.weight`` is ``[(n_heads + 2*n_kv_heads) * head_dim, hidden]``: Q rows, then K, then V,
    each head-major (HF ``q_proj``/``k_proj``/``v_proj`` stacked). ``wo.weight`` is
    ``[hidden, n_heads * head_dim]``.

    Attention of a query row has one reduction order whatever else is computed with it (a
    decode step, a verify block, a prompt chunk, other requests): keys are taken in blocks of
    `KEY_BLOCK` positions from position 0; per block, scores (``bmm``, scaled, keys after the
    row masked to -inf), ``exp(score - max)`` with the row's max over every visible key
    (exact in any order), and the block's partial weighted sum of values and of weights; the
    partials are summed over blocks by `_tree_sum` and divided (a softmax written as
    ``sum_j e_j v_j / sum_j e_j``). Blocks wholly after a row contribute exact zeros. The
    batched matmuls run by the decoder's `AttentionPlans`; scores, weights and sums are
    float32 whatever the cache dtype (as transformers' eager attention, the matmuls
    themselves in the cache's dtype).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.group = config.n_heads // config.n_kv_heads
        self.scale = 1.0 / math.sqrt(config.head_dim)
        qkv_out = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = _linear(config.hidden_size, qkv_out, bias=config.qkv_bias)
        self.wo = _linear(config.n_heads * config.head_dim, config.hidden_size)

    def forward(self, x: torch.Tensor, layer: int, rows: Rows) -> torch.Tensor:
        n = x.shape[0]
        h, kvh, d = self.n_heads, self.n_kv_heads, self.head_dim
        # Projections run once over the rows of every segment; attention runs per segment.
        qkv = self.wqkv(x).reshape(n, h + 2 * kvh, d)
        # RoPE on Q and K heads together; sin carries rotate_half's sign (rope_tables).
        qk = apply_rope(qkv[:, : h + kvh], rows.cos, rows.sin)
        outs = []
        for seg in rows.segments:
            lo, hi, cache = seg.lo, seg.hi, seg.cache
            cache.write(layer, seg.start, qk[lo:hi, h:], qkv[lo:hi, h + kvh :])
            for chunk in seg.chunks:
                outs.append(self._attend(qk[chunk.lo : chunk.hi, :h], cache, layer, chunk,
                                         rows.plans))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.wo(out.to(x.dtype))

    def _attend(self, q: torch.Tensor, cache: KvCache, layer: int, chunk: QueryChunk,
                plans: AttentionPlans | None) -> torch.Tensor:
        """Attention output ``[m, h * d]`` (float32) of query rows ``q [m, h, d]``."""
        m = q.shape[0]
        kvh, g, d, B = self.n_kv_heads, self.group, self.head_dim, KEY_BLOCK
        folded, rows, J = g * m, chunk.rows, chunk.blocks
        # Fold each KV group's query heads into the row axis so K/V are never repeated.
        qf = q.reshape(m, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, folded, d)
        # Scaled before the product (transformers scales after): exact when the scale is a
        # power of two (head_dim 64, 256, ...), and one pass over the scores fewer.
        qf = qf * self.scale
        if rows > folded:
            qf = F.pad(qf, (0, 0, 0, rows - folded))
        # [J * kvh, rows, d]: block j, head i at j * kvh + i, the cache's block-major order.
        q_blocks = qf[None].expand(J, kvh, rows, d).reshape(J * kvh, rows, d)
        keys = cache.k[layer, :J].view(J * kvh, B, d)
        values = cache.v[layer, :J].view(J * kvh, B, d)
        kv_dtype = cache.k.dtype
        # Both plans prove calls of this many rows on one thread; the scores plan says
        # whether every thread is proven too (`AttentionPlans.threads_for`).
        alone = plans is not None and plans.threads_for(rows) == 1
        with one_thread() if alone else contextlib.nullcontext():
            scores = bmm_function(plans and plans.scores)(q_blocks, keys.transpose(1, 2))
            scores = scores.view(J, kvh, rows, B)
            scores = scores.float() if kv_dtype != torch.float32 else scores
            # Only blocks from the chunk's first position on hold a key after some row.
            first = chunk.pos // B
            scores[first:].masked_fill_(chunk.masked, float("-inf"))
            # [kvh, rows, 1]: exact in any order (a max), per block first (a contiguous pass).
            top = scores.amax(dim=3).amax(dim=0)[..., None]
            weights = pointwise(lambda t: t.sub_(top).exp_(), scores)
            blocks = 1 << (J - 1).bit_length()  # a power of two: `_tree_sum`
            sums = torch.empty(blocks, kvh, rows, dtype=torch.float32, device=q.device)
            torch.sum(weights, -1, out=sums[:J])
            sums[J:] = 0
            parts = torch.empty(blocks, kvh, rows, d, dtype=kv_dtype, device=q.device)
            parts[J:] = 0
            weights = weights if kv_dtype == torch.float32 else weights.to(kv_dtype)
            out = parts[:J].view(J * kvh, rows, d)
            bmm_function(plans and plans.values)(weights.view(J * kvh, rows, B), values, out)
            out = _tree_sum(parts.float()) / _tree_sum(sums)[..., None]  # [kvh, rows, d]
        return out[:, :folded].reshape(kvh, g, m, d).permute(2, 0, 1, 3).reshape(m, kvh * g * d)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``.

    With ``tp > 1`` it holds rank ``rank``'s ``1/tp`` of the attention heads, FFN columns or
    experts (`target_worker.sharded`, whose block all-reduces each branch).
    """

    def __init__(self, config: ModelConfig, rank: int = 0, tp: int = 1) -> None:
        super().__init__()
        heads = replace(config, n_heads=config.n_heads // tp, n_kv_heads=config.n_kv_heads // tp)
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(heads)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn: nn.Module = (
            MoE(config.hidden_size, config, rank, tp)
            if config.moe is not None
            else SwiGLU(config.hidden_size, config.ffn_dim // tp)
        )

    def forward(self, x: torch.Tensor, layer: int, rows: Rows) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), layer, rows)
        return x + self.ffn(self.ffn_norm(x))


class Decoder(nn.Module):
    """Causal language model over a :class:`KvCache`.

    Attributes:
        config: the hyper-parameters.
        embed_tokens: ``nn.Embedding(vocab_size, hidden_size)``.
        lm_head: ``nn.Linear(hidden_size, vocab_size, bias=False)``; its weight *is*
            ``embed_tokens.weight`` when ``config.tie_embeddings``.

    Weights are uninitialised after ``__init__``: use :meth:`random` or ``load_state_dict``.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = _linear(config.hidden_size, config.vocab_size)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)
        self._cos = torch.empty(0, config.head_dim)
        self._sin = torch.empty(0, config.head_dim)

    def head_weight(self) -> torch.Tensor:
        """The LM head's weight ``[vocab_size, hidden_size]`` (the embedding when tied)."""
        return self.lm_head.weight

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> Decoder:
        """Random weights, a pure function of ``(config, seed)`` (own ``torch.Generator``).

        Scaled so next-token distributions are spread out rather than near one-hot: embeddings
        and projections are N(0, 1/fan_in)-ish, output projections shrunk by sqrt(2 * n_layers)
        so the residual stream stays O(1), and the final norm weight ~0.7 keeps the logits'
        standard deviation below 1.
        """
        model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        out_scale = 1.0 / math.sqrt(2 * config.n_layers)
        with torch.no_grad():
            for name, p in model.named_parameters(remove_duplicate=True):
                if name.endswith("norm.weight"):
                    # The final norm scales the logits: 0.7 keeps their spread around 0.7.
                    base = 0.7 if name == "norm.weight" else 1.0
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
                    continue
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=gen))
                    continue
                std = 1.0 / math.sqrt(p.shape[-1])  # fan-in (hidden for the embedding)
                if name.endswith(("wo.weight", "w_down.weight", "w_down")):
                    std *= out_scale
                p.copy_(std * torch.randn(p.shape, generator=gen))
        return model

    def new_cache(self, capacity: int | None = None) -> KvCache:
        """An empty cache for this model, of `kv_dtype`.

        Args:
            capacity: initial positions; default ``min(1024, max_seq_len)``. Grows on demand.

        Raises:
            ValueError: if capacity is not in ``[1, max_seq_len]``.
        """
        c = self.config
        if capacity is None:
            capacity = min(DEFAULT_CACHE_CAPACITY, c.max_seq_len)
        return KvCache(c.n_layers, self.cache_kv_heads, c.head_dim, capacity, c.max_seq_len,
                       dtype=self.kv_dtype)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of this decoder's KV caches: its compute dtype, or float16 when the
        native forward runs in ``q8`` (`target_worker.native.KV_DTYPES`)."""
        if self._native_wanted:
            from .native import KV_DTYPES

            return KV_DTYPES[self._native_arithmetic()]
        return self.dtype

    def _native_arithmetic(self) -> str:
        """The native forward's mode for this decoder: ``bfloat16`` for bfloat16 weights,
        else `native_mode`."""
        return "bfloat16" if self.dtype == torch.bfloat16 else self.native_mode

    @property
    def cache_kv_heads(self) -> int:
        """KV heads a cache of this decoder holds (a tensor-parallel shard holds its own only)."""
        return self.config.n_kv_heads

    #: Attention's batch-invariant plans (`make_batch_invariant`); None: plain ``bmm``.
    _attention_plans: AttentionPlans | None = None
    #: The hidden rows a forward returns (`set_capture_layers`): () the final-norm output.
    capture_layers: tuple[int, ...] = ()

    def set_capture_layers(self, layers: Sequence[int]) -> None:
        """Makes every forward return, as its hidden rows, the residual stream entering each
        of ``layers`` instead of the final-norm output: float32 ``[n, len(layers) *
        hidden_size]``, the layers' streams side by side in ascending order. Layer ``i`` in
        ``[0, n_layers)`` is the input of decoder layer ``i`` (transformers'
        ``output_hidden_states[i]``; EAGLE-3's "capture before layer i"), ``n_layers`` the
        last layer's output before the final norm. Nothing extra is computed: the rows are
        the forward's own activations (an EAGLE-3 drafter reads layers ``(2, N // 2, N -
        3)``, arXiv 2503.01840). ``()`` restores the final-norm rows.

        Raises:
            ValueError: a layer outside ``[0, n_layers]`` or a repeated one.
        """
        layers = tuple(int(i) for i in layers)
        n = self.config.n_layers
        bad = [i for i in layers if not 0 <= i <= n]
        if bad:
            raise ValueError(f"capture layer {bad[0]} is outside [0, {n}] (n_layers {n})")
        if len(set(layers)) != len(layers):
            raise ValueError(f"capture layers repeat: {list(layers)}")
        self.capture_layers = tuple(sorted(layers))
    #: The thread counts `make_batch_invariant` proved its plans for (None: not made so).
    _invariant_threads: tuple[int, ...] | None = None
    #: The native forward (`target_worker.native`) when `make_batch_invariant` chose it;
    #: None in a copy, which builds its own at its first forward.
    _native = None
    #: Whether forwards run natively (`make_batch_invariant` chose it).
    _native_wanted: bool = False
    #: The weights as the model file stores them (`target_worker.native.StoredWeight` by
    #: name: ``embed``, ``head``, ``{layer}.q`` / ``k`` / ``v`` / ``o`` / ``gate`` / ``up`` /
    #: ``down``), set by the loader; the native forward multiplies these while
    #: ``stored_fingerprint`` (`target_worker.native.fingerprint`) says the float32 weights
    #: are still the ones they were loaded with.
    stored_weights: dict | None = None
    stored_fingerprint: tuple | None = None
    #: The native forward's arithmetic for float32 weights (`target_worker.native.MODES`):
    #: ``float32``, or ``q8`` (activations rounded to 8-bit blocks for quantized weights, as
    #: llama.cpp); bfloat16 weights always run ``bfloat16``.
    native_mode: str = "float32"

    def make_batch_invariant(self, threads: Sequence[int] | None = None) -> dict:
        """Runs the forward batch-invariantly from now on: each row's logits, hidden state
        and KV entries are then bitwise the same whatever else the forward computes (one
        token, a verify block, a prompt chunk of any size, other sequences, which chunk a
        position was prefilled in, the thread count).

        A float32 dense decoder on the CPU runs the native forward (`target_worker.native`:
        invariant by construction, and proven so on this machine once, at each of
        ``threads``). Any other decoder, or where the native forward cannot be built, has
        each weight shape (and attention's two batched matmuls) take the first kernel and
        padding that `target_worker.invariant` proves invariant on this machine at each of
        ``threads`` (default: the current count); the verdicts are checked once per
        machine and kept on disk. Called again after ``Module.to`` moves the weights.

        Returns:
            A report: natively ``{"native": {"isa": ..., "weights": [type names]}}``; else
            ``{"linear": {"OUTxIN dtype": plan, ...}, "scores": plan, "values": plan}``,
            each plan `target_worker.invariant.InvariancePlan`, with ``"native_off"`` saying
            why the native forward is not used.
        """
        threads = tuple(dict.fromkeys(threads or (torch.get_num_threads(),)))
        from . import native

        why = native.supports(self) if native.native_enabled() else "SPECD_NATIVE=0"
        if why is None:
            try:
                self._native_wanted = True
                self._native = None
                report = native.prove(self, threads)
                self._invariant_threads = threads
                return {"native": report}
            except native.NativeUnavailable as exc:
                why = str(exc)
        self._native_wanted = False
        self._native = None
        report: dict = {"linear": {}, "native_off": why}
        weights: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        for module in self.modules():
            if isinstance(module, nn.Linear):
                weights.setdefault(id(module.weight), (module.weight, module.bias))
            elif isinstance(module, MoE):
                for gate_up, down in module.expert_weights():
                    weights.setdefault(id(gate_up), (gate_up, None))
                    weights.setdefault(id(down), (down, None))
        head = self.head_weight()
        if head is not None:
            weights.setdefault(id(head), (head, None))
        for weight, bias in weights.values():
            plan = plan_linear(weight, bias, threads)
            prepare_linear(weight, plan)
            name = f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).split('.')[-1]}"
            report["linear"][name] = plan
        d = self.config.head_dim
        kv_dtype, device = self.dtype, self.norm.weight.device
        self._attention_plans = AttentionPlans(
            plan_bmm(1, d, KEY_BLOCK, True, kv_dtype, device, threads),
            plan_bmm(1, KEY_BLOCK, d, False, kv_dtype, device, threads))
        report["scores"] = self._attention_plans.scores
        report["values"] = self._attention_plans.values
        self._invariant_threads = threads
        return report

    @property
    def batch_invariant(self) -> bool:
        """Whether `make_batch_invariant` planned this decoder's matmuls."""
        return self._invariant_threads is not None

    def _apply(self, fn, recurse=True):
        # Module.to / .float() / .cuda() give the weights new tensors: plan those too.
        out = super()._apply(fn, recurse)
        if self._invariant_threads is not None:
            self.make_batch_invariant(self._invariant_threads)
        return out

    def __getstate__(self):
        # A copy's stored weights describe its own float32 weights when the original's
        # described the original's: `__setstate__` records the copy's fingerprint then.
        state = super().__getstate__()
        if self.stored_weights:
            from .native import fingerprint

            state["_stored_current"] = self.stored_fingerprint == fingerprint(self)
        return state

    def __setstate__(self, state):
        current = state.pop("_stored_current", False)
        super().__setstate__(state)
        if current:
            from .native import fingerprint

            self.stored_fingerprint = fingerprint(self)

    def _native_forward(self):
        """The native forward this decoder runs (built at first use, e.g. in a copy), or
        None when it runs the torch forward."""
        if not self._native_wanted:
            return None
        if self._native is None:
            from .native import NativeForward

            self._native = NativeForward(self, self._native_arithmetic())
        return self._native

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: the weights' (float32 here; a GPU shard may use bfloat16)."""
        return self.norm.weight.dtype

    def forward_batch(
        self, tokens: Sequence[int] | torch.Tensor, start_pos: int, cache: KvCache
    ) -> torch.Tensor:
        """Feed ``n >= 1`` tokens at absolute positions ``[start_pos, start_pos + n)``.

        Args:
            tokens: token ids, a sequence of ints or a 1-D integer tensor.
            start_pos: must equal ``cache.seq_len`` (truncate the cache first to roll back).
            cache: written at those positions; ``seq_len`` becomes ``start_pos + n``.

        Returns:
            float32 logits ``[n, vocab_size]``; row i predicts the token after ``tokens[i]``.

        Raises:
            ValueError: empty ``tokens``, an id outside ``[0, vocab_size)``, ``start_pos`` not
                the cache's length, or ``start_pos + n > max_seq_len``.
        """
        return self._forward_packed([(tokens, start_pos, cache)], [False])[0][0]

    def forward_batch_with_hidden(
        self,
        tokens: Sequence[int] | torch.Tensor,
        start_pos: int,
        cache: KvCache,
        last_logits_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Like :meth:`forward_batch`, also returning the final hidden states.

        Args:
            last_logits_only: compute logits for the last position only (a prefill needs just
                that row; the LM head over every prompt row is ~20% of a prefill's FLOPs).

        Returns:
            ``(logits [n, vocab_size], hidden [n, hidden_size])``, both float32, where ``hidden``
            is the final-RMSNorm output and ``logits == lm_head(hidden)``; logits are
            ``[1, vocab_size]`` with ``last_logits_only``.
        """
        return self._forward_packed([(tokens, start_pos, cache)], [last_logits_only])[0]

    def forward_token(self, token: int, pos: int, cache: KvCache) -> torch.Tensor:
        """One token at position ``pos``; float32 logits ``[vocab_size]``. See forward_batch."""
        return self._forward_packed([([token], pos, cache)], [False])[0][0][0]

    def _as_tokens(self, tokens: Sequence[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(tokens, torch.Tensor):
            if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
                raise ValueError(
                    f"tokens must be a 1-D integer tensor, got {tokens.dtype} {tuple(tokens.shape)}"
                )
            idx = tokens.to(torch.long)
        else:
            idx = torch.tensor(list(tokens), dtype=torch.long)
        if idx.numel() == 0:
            raise ValueError("tokens must contain at least one token id")
        lo, hi = int(idx.min()), int(idx.max())
        vocab = self.config.vocab_size
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        return idx

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[end - start, 1, head_dim]`` for positions ``[start, end)``."""
        if end > self._cos.shape[0]:  # grow geometrically
            size = min(max(end, 2 * self._cos.shape[0], 256), self.config.max_seq_len)
            c = self.config
            # A whole number of 256-position rows on one thread: a position's sin/cos are
            # computed by the same (vector) code whatever the table's size.
            with one_thread():
                cos, sin = rope_tables(c.head_dim, c.rope_theta, _round_up(size, 256),
                                       c.rope_scaling)
            self._cos, self._sin = cos.to(self.dtype), sin.to(self.dtype)
        return self._cos[start:end, None, :], self._sin[start:end, None, :]

    def forward_packed(
        self,
        segments: Sequence[tuple[Sequence[int] | torch.Tensor, int, KvCache]],
        last_logits_only: Sequence[bool] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward for several independent sequences, each over its own cache.

        The rows of all segments are concatenated into one ``[N, hidden_size]`` activation, so
        every projection (QKV, attention output, FFN/MoE, LM head) is one matmul over all
        ``N = sum(n_i)`` rows; RoPE positions, KV writes and attention are per segment.
        Results equal separate :meth:`forward_batch_with_hidden` calls up to float rounding,
        since a matmul over more rows may block differently (measured: < 2e-6 on the tiny test
        models, < 6e-5 on SmolLM2-135M logits, argmax identical).

        Args:
            segments: ``(tokens, start_pos, cache)`` per sequence, each as in
                :meth:`forward_batch`; every cache must be a distinct object.
            last_logits_only: per segment, compute logits for its last row only (default:
                all rows for every segment).

        Returns:
            Per segment, in order, ``(logits [n_i or 1, vocab_size], hidden [n_i,
            hidden_size])``, float32. Both are views into buffers shared by all segments:
            clone one before keeping it alone or sending it to another process.

        Raises:
            ValueError: no segments, a ``last_logits_only`` of another length, the same cache
                twice, or (message prefixed ``segment i:``) anything :meth:`forward_batch`
                rejects. Raised before any cache is written.
        """
        if last_logits_only is None:
            last_logits_only = [False] * len(segments)
        return self._forward_packed(segments, last_logits_only)

    def _check_segment(
        self, tokens: Sequence[int] | torch.Tensor, start_pos: int, cache: KvCache
    ) -> torch.Tensor:
        """Token ids as a long tensor ``[n]``, after checking the segment can be fed."""
        idx = self._as_tokens(tokens)
        if start_pos != cache.seq_len:
            raise ValueError(
                f"start_pos must be the cache's current length: got start_pos={start_pos}, "
                f"cache.seq_len={cache.seq_len}"
            )
        c = self.config
        if cache.k.shape[0] != c.n_layers or cache.n_kv_heads != self.cache_kv_heads:
            raise ValueError("cache was not created for this model (layer/KV-head shape differs)")
        end = start_pos + idx.numel()
        if end > c.max_seq_len:
            raise ValueError(
                f"start_pos {start_pos} + {idx.numel()} tokens = {end} exceeds "
                f"max_seq_len={c.max_seq_len}"
            )
        return idx

    @torch.inference_mode()
    def _forward_packed(
        self,
        segments: Sequence[tuple[Sequence[int] | torch.Tensor, int, KvCache]],
        last_logits_only: Sequence[bool],
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if not segments:
            raise ValueError("forward_packed needs at least one segment")
        if len(last_logits_only) != len(segments):
            raise ValueError(
                f"last_logits_only has {len(last_logits_only)} entries for "
                f"{len(segments)} segments"
            )
        single = len(segments) == 1
        # Validate everything before writing anything, so a bad segment leaves all caches as
        # they were.
        ids, seen = [], set()
        for i, (tokens, start_pos, cache) in enumerate(segments):
            if id(cache) in seen:
                raise ValueError(f"segment {i}: its cache already appears in another segment")
            seen.add(id(cache))
            try:
                ids.append(self._check_segment(tokens, start_pos, cache))
            except ValueError as e:
                if single:
                    raise
                raise ValueError(f"segment {i}: {e}") from None
        native = self._native_forward()
        if native is not None:
            for idx, (_, start, cache) in zip(ids, segments, strict=True):
                cache.reserve(start + idx.numel())
            out = native.forward(self, ids, segments, last_logits_only, self.capture_layers)
            for idx, (_, start, cache) in zip(ids, segments, strict=True):
                cache._seq_len = start + idx.numel()
            return out
        head = self.head_weight()
        if self._invariant_threads is not None and head is not None and planned(head) is None:
            # A copy (deepcopy) or reassigned weights: plan the tensors it multiplies now.
            self.make_batch_invariant(self._invariant_threads)
        segs, cos, sin, lo = [], [], [], 0
        group = self.config.n_heads // self.config.n_kv_heads
        device = self.norm.weight.device
        for idx, (_, start, cache) in zip(ids, segments, strict=True):
            n = idx.numel()
            end = start + n
            cache.reserve(end)
            cache.zero_tail(end)
            c, s = self._rope(start, end)
            cos.append(c)
            sin.append(s)
            chunks = query_chunks(lo, lo + n, start, group, self._attention_plans, device)
            segs.append(Segment(lo, lo + n, start, cache, chunks))
            lo += n
        x = self.embed_tokens(ids[0] if single else torch.cat(ids))
        rows = Rows(cos[0] if single else torch.cat(cos), sin[0] if single else torch.cat(sin),
                    segs, self._attention_plans)
        capture = self.capture_layers
        captured = []
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured.append(x)
            x = layer(x, i, rows)
        if len(self.layers) in capture:
            captured.append(x)
        for seg in segs:
            seg.cache._seq_len = seg.start + seg.hi - seg.lo
        hidden = self.norm(x)
        if not any(last_logits_only):
            head_in, counts = hidden, [seg.hi - seg.lo for seg in segs]
        elif single:
            head_in, counts = hidden[-1:], [1]
        else:
            rows = [
                torch.arange(seg.hi - 1, seg.hi) if last else torch.arange(seg.lo, seg.hi)
                for seg, last in zip(segs, last_logits_only, strict=True)
            ]
            head_in, counts = hidden[torch.cat(rows)], [r.numel() for r in rows]
        logits = self._logits(head_in)
        if capture:
            # The residual streams asked for, in ascending layer order, side by side.
            hidden = captured[0] if len(captured) == 1 else torch.cat(captured, dim=1)
        hidden = hidden.float()  # the hidden-row contract is float32 whatever the compute dtype
        out, row = [], 0
        for seg, k in zip(segs, counts, strict=True):
            rows = None if logits is None else logits[row : row + k]
            out.append((rows, hidden[seg.lo : seg.hi]))
            row += k
        return out

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """LM head over ``hidden [n, hidden_size]``: float32 ``[n, vocab_size]``, contiguous.
        A tensor-parallel shard overrides it (and returns None on ranks other than 0)."""
        return self.lm_head(hidden).float().contiguous()
