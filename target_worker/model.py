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

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .config import ModelConfig, RopeScaling

__all__ = ["Decoder", "KvCache", "pack_weights"]

DEFAULT_CACHE_CAPACITY = 1024


class KvCache:
    """Keys and values of every layer for one sequence.

    ``k`` and ``v`` are preallocated float32 tensors of shape
    ``[n_layers, n_kv_heads, capacity, head_dim]``; positions ``[0, seq_len)`` are committed.
    Rolling back is O(1): :meth:`truncate` only lowers ``seq_len`` and later writes overwrite the
    stale entries. Capacity doubles (capped at ``max_seq_len``) when a forward needs more room.
    Create one with :meth:`Decoder.new_cache`.
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
        shape = (n_layers, n_kv_heads, capacity, head_dim)
        # Uninitialised is fine: attention reads only positions [0, end), all written first.
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
        """Positions that fit before the next reallocation."""
        return self.k.shape[2]

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
        new_cap = min(new_cap, self.max_seq_len)
        with torch.inference_mode():
            for name in ("k", "v"):
                old = getattr(self, name)
                shape = (*old.shape[:2], new_cap, old.shape[3])
                new = torch.empty(shape, dtype=old.dtype)
                new[:, :, : self._seq_len] = old[:, :, : self._seq_len]
                setattr(self, name, new)


#: Fewest rows `fast_linear` computes in the ``weight @ x.T`` order: below it ``F.linear`` is
#: faster. Measured (``python scripts/linear_paths.py``, torch 2.13.0 CPU, this 2-core
#: machine, SmolLM2's shapes, 1 and 2 threads): at 1-6 rows ``F.linear`` took 0.3-0.6x the
#: time (the LM head at 1 row: 8.1 ms against 20.0 ms), from 8 rows the other order 0.6-0.9x.
FAST_LINEAR_MIN_ROWS = 8

#: Most rows `fast_linear` multiplies against a weight's packed copy (`pack_weights`), and
#: the batch size the copies are packed for. Verify blocks and batched decode steps (2-128
#: rows) are where MKL's plain GEMM is slow: it re-packs the whole weight on every call, so
#: a forward over 8 rows cost 2x one over 1 row although both read the same 536 MB of
#: SmolLM2 weights. Measured (``python scripts/linear_paths.py --forward``, SmolLM2-135M, 300
#: cached positions, 2 threads): 8 rows 66 ms packed against 105 ms, 32 rows 101 against
#: 121, 100 rows 172 against 201; 1 row is unchanged (it stays on ``F.linear``'s GEMV).
PACKED_MAX_ROWS = 128

#: weight -> (its MKL-packed copy, ``(weight._version, weight.data_ptr())`` when packed):
#: `pack_weights`' copies, by identity (a weight shared by two modules, e.g. a tied LM head,
#: is packed once). A weight changed since, in place (its version moved on) or given new
#: data (``Module.to`` sets ``.data``), is multiplied unpacked.
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _packed_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight._version, weight.data_ptr()


def mkl_packing_available() -> bool:
    """Whether this torch has MKL's packed SGEMM (x86 CPU builds with MKL)."""
    return (torch.backends.mkl.is_available()
            and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")
            and hasattr(torch.ops.mkl, "_mkl_linear"))


def pack_weights(module: nn.Module, extra: Sequence[torch.Tensor] = ()) -> int:
    """Keeps an MKL-packed copy of every float32 CPU weight `fast_linear` multiplies in
    ``module`` (each ``nn.Linear``'s weight, plus ``extra``, e.g. a tied LM head used through
    ``fast_linear`` directly), so steps of 2 to `PACKED_MAX_ROWS` rows run MKL's packed GEMM
    (oneMKL ``cblas_sgemm_pack``/``cblas_sgemm_compute``, the kernel PyTorch Inductor's CPU
    weight freezing uses: ``torch.ops.mkl._mkl_linear``) instead of re-packing the weight on
    every call.

    The copies cost about the weights' own resident memory again (SmolLM2-135M: ~0.5 GB);
    results agree with ``F.linear`` to float32 rounding (a different summation order). Safe
    to call again: weights already packed and unchanged are skipped. Does nothing without
    MKL (`mkl_packing_available`), and skips weights on other devices or dtypes and weights
    that require grad (training multiplies them unpacked).

    Returns:
        how many weights were newly packed.
    """
    if not mkl_packing_available():
        return 0
    weights = [m.weight for m in module.modules() if isinstance(m, nn.Linear)]
    packed = 0
    for weight in [*weights, *extra]:
        if (weight is None or weight.device.type != "cpu" or weight.dtype != torch.float32
                or weight.dim() != 2 or weight.requires_grad):
            continue
        entry = _PACKED.get(weight)
        if entry is not None and entry[1] == _packed_key(weight):
            continue
        with torch.no_grad():
            copy = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PACKED_MAX_ROWS)
        _PACKED[weight] = (copy, _packed_key(weight))
        packed += 1
    return packed


def fast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [n, in]``, ``weight [out, in]``; returns ``[n, out]``
    (any other rank of ``x`` goes to ``F.linear``).

    For 2 to `PACKED_MAX_ROWS` rows of a weight `pack_weights` packed (and not changed
    since), MKL's packed GEMM. Otherwise, for ``FAST_LINEAR_MIN_ROWS <= n <= 64`` rows on the
    CPU it is computed as ``(weight @ x.T).T``, which MKL runs faster than ``F.linear``
    there; the result is then a non-contiguous (transposed) view. Fewer rows (plain decoding,
    short blocks), prefill-sized inputs and GPU shards use ``F.linear``.
    """
    n = x.shape[0]
    if 2 <= n <= PACKED_MAX_ROWS and x.dim() == 2:
        entry = _PACKED.get(weight)
        if entry is not None and entry[1] == _packed_key(weight):
            return torch.ops.mkl._mkl_linear(x.contiguous(), entry[0], weight, bias, n)
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
    return fast_linear(F.silu(gate).mul_(up), w_down)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        probs = torch.softmax(self.router(x), dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)  # [n, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).flatten()
        experts = experts.flatten()
        token_of = torch.arange(n).repeat_interleave(self.top_k)
        out = self.shared(x) if self.shared is not None else torch.zeros_like(x)
        # Loop over the experts actually hit (at most n*k), each on its tokens only.
        for e in experts.unique().tolist():
            local = e - self.first
            if not 0 <= local < self.w_gate_up.shape[0]:
                continue  # another rank's expert
            slots = (experts == e).nonzero().squeeze(1)
            tokens = token_of[slots]
            y = swiglu(x[tokens], self.w_gate_up[local], self.w_down[local], self.ffn)
            out.index_add_(0, tokens, y * weights[slots, None])
        return out


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


def causal_mask(start: int, end: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask (0 / -inf, ``dtype``) ``[group * (end - start), end]``: query i (absolute
    position start + i) sees keys at positions <= start + i, tiled ``group`` times for the
    query heads that :class:`Attention` folds into the query axis."""
    allowed = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    return mask.repeat(group, 1)


#: Segments of more rows than this attend through ``scaled_dot_product_attention`` on the CPU
#: too (its flash kernel never materialises the scores). Measured here, SmolLM2 shapes (9 query
#: and 3 KV heads, head_dim 64), one layer, 1 thread, bmm path vs SDPA: 8 rows over 2,000 keys
#: 0.46 vs 0.49 ms and 64 over 6,000 8.1 vs 8.5 (bmm wins: verify blocks); 256 rows after 1,792
#: cached 14.0 vs 9.0 ms, a 512-row chunk after 5,632 cached 161 vs 61 ms, a whole 2,048-token
#: prompt 241 vs 42 ms and 6,144 tokens 2,204 vs 312 ms (`scripts/attention_paths.py`).
SDPA_MIN_ROWS = 65


@dataclass(frozen=True)
class Segment:
    """One sequence inside a packed forward: activation rows ``[lo, hi)`` are fed at absolute
    positions ``[start, start + hi - lo)`` of ``cache``.

    ``mask`` is its additive causal mask: tiled ``group`` times ``[group * m, end]`` for the
    bmm path (`causal_mask`), or, with ``sdpa``, untiled ``[m, end]`` for
    ``scaled_dot_product_attention``. None for a single row, and with ``sdpa`` for a segment
    that starts at position 0 (then attention is causal with no mask built: a ``[m, m]``
    mask of a 6k-token prompt alone is 150 MB)."""

    lo: int
    hi: int
    start: int
    cache: KvCache
    mask: torch.Tensor | None
    sdpa: bool = False


@dataclass(frozen=True)
class Rows:
    """Layout of the activation rows of one (packed) forward, shared by every layer: RoPE
    ``cos`` and signed ``sin`` ``[N, 1, head_dim]`` per row (`rope_tables`) and the
    `Segment` each row range belongs to."""

    cos: torch.Tensor
    sin: torch.Tensor
    segments: Sequence[Segment]


def _use_sdpa(x: torch.Tensor) -> bool:
    """Whether every segment attends as ``scaled_dot_product_attention``: off the CPU (fused
    GPU kernels, grouped-query heads native). On the CPU only long segments do
    (`SDPA_MIN_ROWS`): for verify blocks the bmm + softmax path measured faster (SmolLM2
    shapes, 30 layers, 2000 cached tokens, k=8: 13.1 vs 14.3 ms with 2 threads, 17.7 vs 20.5
    ms with 1, against SDPA with enable_gqa)."""
    return x.device.type != "cpu"


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE and a fused QKV projection.

    ``wqkv.weight`` is ``[(n_heads + 2*n_kv_heads) * head_dim, hidden]``: Q rows, then K, then V,
    each head-major (HF ``q_proj``/``k_proj``/``v_proj`` stacked). ``wo.weight`` is
    ``[hidden, n_heads * head_dim]``.
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
        h, kvh, d, g = self.n_heads, self.n_kv_heads, self.head_dim, self.group
        # Projections run once over the rows of every segment; attention runs per segment.
        qkv = self.wqkv(x).reshape(n, h + 2 * kvh, d)
        # RoPE on Q and K heads together; sin carries rotate_half's sign (rope_tables).
        qk = apply_rope(qkv[:, : h + kvh], rows.cos, rows.sin)
        outs = []
        for seg in rows.segments:
            lo, hi, cache = seg.lo, seg.hi, seg.cache
            m, end = hi - lo, seg.start + hi - lo
            cache.k[layer, :, seg.start : end] = qk[lo:hi, h:].transpose(0, 1)
            cache.v[layer, :, seg.start : end] = qkv[lo:hi, h + kvh :].transpose(0, 1)
            keys = cache.k[layer, :, :end]  # [kvh, end, d]
            values = cache.v[layer, :, :end]
            if seg.sdpa or _use_sdpa(x):
                # A tiled bmm mask's first m rows are the untiled [m, end] causal mask.
                mask = seg.mask if seg.sdpa or seg.mask is None else seg.mask[:m]
                o = F.scaled_dot_product_attention(
                    qk[lo:hi, :h].transpose(0, 1)[None], keys[None], values[None],
                    attn_mask=mask, is_causal=mask is None and m > 1, scale=self.scale,
                    enable_gqa=True)  # [1, h, m, d]
                outs.append(o[0].transpose(0, 1).reshape(m, h * d))
                continue
            # Fold each KV group's query heads into the query-length axis so K/V are never
            # repeated.
            q = qk[lo:hi, :h].reshape(m, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * m, d)
            # Plain bmm + softmax: ~2x faster than scaled_dot_product_attention here on CPU.
            if seg.mask is None:
                scores = torch.bmm(q, keys.transpose(1, 2)).mul_(self.scale)
            else:
                scores = torch.baddbmm(seg.mask, q, keys.transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # bf16 scores: as HF
            o = torch.bmm(probs if probs.dtype == values.dtype else probs.to(values.dtype), values)
            outs.append(o.view(kvh, g, m, d).permute(2, 0, 1, 3).reshape(m, h * d))
        return self.wo(outs[0] if len(outs) == 1 else torch.cat(outs))


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
        """An empty cache for this model, float32.

        Args:
            capacity: initial positions; default ``min(1024, max_seq_len)``. Grows on demand.

        Raises:
            ValueError: if capacity is not in ``[1, max_seq_len]``.
        """
        c = self.config
        if capacity is None:
            capacity = min(DEFAULT_CACHE_CAPACITY, c.max_seq_len)
        return KvCache(c.n_layers, self.cache_kv_heads, c.head_dim, capacity, c.max_seq_len,
                       dtype=self.dtype)

    @property
    def cache_kv_heads(self) -> int:
        """KV heads a cache of this decoder holds (a tensor-parallel shard holds its own only)."""
        return self.config.n_kv_heads

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
            cos, sin = rope_tables(c.head_dim, c.rope_theta, size, c.rope_scaling)
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
        if cache.k.shape[0] != c.n_layers or cache.k.shape[1] != self.cache_kv_heads:
            raise ValueError("cache was not created for this model (layer/KV-head shape differs)")
        end = start_pos + idx.numel()
        if end > c.max_seq_len:
            raise ValueError(
                f"start_pos {start_pos} + {idx.numel()} tokens = {end} exceeds "
                f"max_seq_len={c.max_seq_len}"
            )
        return idx

    def _causal_mask(self, start: int, end: int) -> torch.Tensor:
        """Additive float mask (0 / -inf) ``[group * (end - start), end]``: query i (absolute
        position start + i) sees keys at positions <= start + i, tiled over the query heads
        that Attention folds into the query axis. Built once per forward, shared by layers."""
        return causal_mask(start, end, self.config.n_heads // self.config.n_kv_heads, self.dtype)

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
        segs, cos, sin, lo = [], [], [], 0
        x_on_gpu = self.norm.weight.device.type != "cpu"
        for idx, (_, start, cache) in zip(ids, segments, strict=True):
            n = idx.numel()
            cache.reserve(start + n)
            c, s = self._rope(start, start + n)
            cos.append(c)
            sin.append(s)
            if n >= SDPA_MIN_ROWS or x_on_gpu:
                # Untiled, and none at all from position 0 (SDPA's own causal masking).
                mask = causal_mask(start, start + n, 1, self.dtype) if start and n > 1 else None
                segs.append(Segment(lo, lo + n, start, cache, mask, sdpa=True))
            else:
                mask = self._causal_mask(start, start + n) if n > 1 else None
                segs.append(Segment(lo, lo + n, start, cache, mask))
            lo += n
        x = self.embed_tokens(ids[0] if single else torch.cat(ids))
        rows = Rows(cos[0] if single else torch.cat(cos), sin[0] if single else torch.cat(sin),
                    segs)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, rows)
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
