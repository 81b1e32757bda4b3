"""RoPE and the target's batch-invariant attention over key blocks (`KEY_BLOCK`), with the
row layout of a packed forward (`Rows`, `Segment`, `QueryChunk`). Split from
`target_worker.model`, which re-exports these names."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, RopeScaling
from .invariant import CALL_ROWS, InvariancePlan, bmm_function, one_thread, pointwise
from .kv_cache import KEY_BLOCK, KvCache
from .layers import _linear

__all__ = ["Attention", "AttentionPlans", "QueryChunk", "Rows", "Segment", "apply_rope",
           "query_chunks", "rope_tables"]


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
    #: The rows' absolute positions as a long tensor on the forward's device, when they are
    #: known there only (a CUDA graph's replay, `target_worker.graphs`): keys and values are
    #: then written at them (`KvCache.write_at`) instead of from ``start``.
    positions: torch.Tensor | None = None


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
            if seg.positions is None:
                cache.write(layer, seg.start, qk[lo:hi, h:], qkv[lo:hi, h + kvh :])
            else:
                cache.write_at(layer, seg.positions, qk[lo:hi, h:], qkv[lo:hi, h + kvh :])
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
