"""One rank's shard of a tensor-parallel (TP) target decoder (Megatron-style, pure torch).

Sharding follows Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3) for a Llama block on ``S`` ranks:

- attention: the fused QKV projection is column-parallel (rank ``r`` holds query heads
  ``[r*h/S, (r+1)*h/S)`` and KV heads ``[r*kvh/S, (r+1)*kvh/S)``, which are exactly the KV heads
  its query heads read under grouped-query attention); the output projection is row-parallel
  (its input columns of those heads), followed by one all-reduce. The KV cache of a rank holds
  only its KV heads.
- dense SwiGLU: gate/up column-parallel, down row-parallel, one all-reduce.
- MoE: expert parallel (rank ``r`` holds experts ``[r*E/S, (r+1)*E/S)`` whole); the router is
  replicated so every rank routes identically; the shared experts are split column/row like the
  dense FFN; one all-reduce sums routed and shared partial outputs.
- embeddings and LM head: vocab-parallel by default (rank ``r`` holds rows ``[r*ceil(V/S), ...)``
  of the (tied) matrix): the lookup is zero outside a rank's rows and one all-reduce of
  ``[n, hidden]`` completes it (bit-exact: each token has exactly one nonzero contribution);
  the LM head computes ``[n, V/S]`` logits per rank and gathers them to rank 0. Chosen over
  replication because it splits both the memory (the tied 49152 x 576 matrix is 21% of
  SmolLM2-135M) and the LM head's matmul, the largest single matmul of a decode step; the
  gather moves ``n * V * 4`` bytes per step. ``vocab_parallel=False`` replicates the table on
  every rank (rank 0 alone computes the head, no gather). Measured on SmolLM2, TP=3, on the
  shared 2-core CPU (``benchmarks/tp_decode.py``): 607 vs 642 ms/token replicated vs
  vocab-parallel, inside the run-to-run spread (521-684 vs 583-664 ms), while a rank holds
  63.7M parameters replicated vs 44.9M vocab-parallel; so vocab-parallel is the default.

Two all-reduces per block (after attention, after the FFN) plus one for the embedding and one
gather for the logits per forward. Rank 0 returns full logits; other ranks return None (the
engine then skips turning them into rows, see `TargetEngine.prefill`).

Weights are read shard by shard from a `WeightSource` (a float32 safetensors file through
``safe_open(...).get_slice``, or an in-memory state dict for the tiny test model), so a rank
never materialises the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .model import Block, Decoder, KvCache, RMSNorm, _linear, fast_linear

__all__ = [
    "SafetensorsSource",
    "ShardedDecoder",
    "StateDictSource",
    "WeightSource",
    "decoder_state",
    "rank_parameter_counts",
    "tp_errors",
    "vocab_range",
]


def tp_errors(config: ModelConfig, tp: int) -> list[str]:
    """Why ``config`` cannot be split over ``tp`` ranks (empty when it can), naming numbers."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        return [f"tp must be a positive int, got {tp!r}"]
    errors = []

    def need(what: str, value: int) -> None:
        if value % tp:
            errors.append(f"{what} ({value}) is not divisible by tp={tp}")

    need("attention heads", config.n_heads)
    need("KV heads", config.n_kv_heads)
    if config.moe is None:
        need("FFN size", config.ffn_dim)
    else:
        need("experts", config.moe.n_experts)
        need("shared-expert FFN size", config.moe.n_shared_experts * config.moe.expert_ffn_dim)
    if config.vocab_size < tp:
        errors.append(f"vocabulary ({config.vocab_size}) is smaller than tp={tp}")
    return errors


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the embedding / LM head on ``rank``: blocks of ``ceil(V/tp)``,
    the last one shorter when ``tp`` does not divide ``V``."""
    per = math.ceil(vocab_size / tp)
    lo = min(rank * per, vocab_size)
    return lo, min(lo + per, vocab_size)


class WeightSource:
    """Reads (a slice of) a tensor by Decoder state-dict name; see the two implementations."""

    def get(self, name: str, *index: slice) -> torch.Tensor:
        """``tensor[index]`` as a new float tensor (``index``: one slice per leading dim)."""
        raise NotImplementedError

    def has(self, name: str) -> bool:
        raise NotImplementedError


class StateDictSource(WeightSource):
    """Slices of an in-memory state dict (the tiny random test model)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def get(self, name: str, *index: slice) -> torch.Tensor:
        return self.state[name][index].clone()

    def has(self, name: str) -> bool:
        return name in self.state


class SafetensorsSource(WeightSource):
    """Slices read from a safetensors file with ``get_slice``: only the requested rows/columns
    are read (memory-mapped), never the whole tensor."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(path), framework="pt")
        self._names = set(self._file.keys())

    def get(self, name: str, *index: slice) -> torch.Tensor:
        part = self._file.get_slice(name)[index] if index else self._file.get_tensor(name)
        return part.clone() if not part.is_contiguous() else part

    def has(self, name: str) -> bool:
        return name in self._names


def decoder_state(config: ModelConfig, source: WeightSource) -> dict[str, torch.Tensor]:
    """The whole `Decoder` state dict (no ``lm_head.weight`` when tied) read from ``source``:
    the ``tp == 1`` case of the shard reader, so one code path reads both."""
    return _shard_state(config, source, 0, 1, vocab_parallel=False)


def _shard_state(
    config: ModelConfig, source: WeightSource, rank: int, tp: int, vocab_parallel: bool
) -> dict[str, torch.Tensor]:
    """This rank's tensors, under the full Decoder's state-dict names."""
    h, kvh, d = config.n_heads, config.n_kv_heads, config.head_dim
    hl, kl = h // tp, kvh // tp

    def rows(lo: int, n: int) -> slice:
        return slice(lo + rank * n, lo + (rank + 1) * n)

    every = slice(None)
    q, k, v = rows(0, hl * d), rows(h * d, kl * d), rows((h + kvh) * d, kl * d)
    state = {}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        for part in ("weight", "bias") if config.qkv_bias else ("weight",):
            name = p + "attn.wqkv." + part
            state[name] = torch.cat([source.get(name, s) for s in (q, k, v)])
        state[p + "attn.wo.weight"] = source.get(p + "attn.wo.weight", every, rows(0, hl * d))
        for name in ("attn_norm.weight", "ffn_norm.weight"):
            state[p + name] = source.get(p + name)
        if config.moe is None:
            prefixes, ffn = [p + "ffn."], config.ffn_dim
        else:
            m = config.moe
            prefixes, ffn = [], m.n_shared_experts * m.expert_ffn_dim
            if m.n_shared_experts:
                prefixes.append(p + "ffn.shared.")
            state[p + "ffn.router.weight"] = source.get(p + "ffn.router.weight")
            experts = rows(0, m.n_experts // tp)
            state[p + "ffn.w_gate_up"] = source.get(p + "ffn.w_gate_up", experts)
            state[p + "ffn.w_down"] = source.get(p + "ffn.w_down", experts)
        for pre in prefixes:  # a SwiGLU split column/row: gate rows, up rows, down columns
            fl = ffn // tp
            name = pre + "w_gate_up.weight"
            gate, up = source.get(name, rows(0, fl)), source.get(name, rows(ffn, fl))
            state[name] = torch.cat([gate, up])
            state[pre + "w_down.weight"] = source.get(pre + "w_down.weight", every, rows(0, fl))
    state["norm.weight"] = source.get("norm.weight")
    lo, hi = vocab_range(config.vocab_size, rank, tp) if vocab_parallel else (0, config.vocab_size)
    state["embed_tokens.weight"] = source.get("embed_tokens.weight", slice(lo, hi))
    if not config.tie_embeddings and (vocab_parallel or rank == 0):
        state["lm_head.weight"] = source.get("lm_head.weight", slice(lo, hi))
    return state


class _Reduce:
    """The collectives of one rank, counting the bytes each sends (for the replica's metrics).

    ``group`` None means torch.distributed's default group; ``tp == 1`` never communicates."""

    def __init__(self, tp: int, group=None) -> None:
        self.tp = tp
        self.group = group
        self.bytes = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, each element summed in rank order whatever the
        tensor's size (batch invariance): with 2 ranks an element is one addition, which
        ``all_reduce`` does in either order alike; with more, a ring all-reduce starts an
        element's sum at the rank whose chunk it falls in, which moves with the row count,
        so the parts are gathered and added in rank order instead."""
        if self.tp == 1:
            return x
        x = x.contiguous()
        if self.tp == 2:
            dist.all_reduce(x, group=self.group)
            self.bytes += x.nbytes
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp)]
        dist.all_gather(parts, x, group=self.group)
        self.bytes += x.nbytes * (self.tp - 1)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather0(self, x: torch.Tensor, rank: int) -> list[torch.Tensor] | None:
        """Every rank's ``x`` (same shape) on rank 0, None on the others."""
        if self.tp == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp)] if rank == 0 else None
        dist.gather(x, parts, dst=0, group=self.group)
        self.bytes += x.nbytes
        return parts


class _ShardEmbedding(nn.Module):
    """Token embedding holding rows ``[lo, hi)``; the all-reduce fills in the other rows."""

    def __init__(self, lo: int, hi: int, hidden: int, reduce: _Reduce | None) -> None:
        super().__init__()
        self.lo, self.hi = lo, hi
        self.weight = nn.Parameter(torch.empty(hi - lo, hidden), requires_grad=False)
        self.reduce = reduce  # None: every row is here (replicated)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] -> [n, hidden]
        if self.reduce is None:
            return F.embedding(ids, self.weight)
        here = (ids >= self.lo) & (ids < self.hi)
        local = (ids - self.lo).clamp_(0, max(self.hi - self.lo - 1, 0))
        x = F.embedding(local, self.weight) * here[:, None].to(self.weight.dtype)
        return self.reduce.all_reduce(x)


class _ShardBlock(Block):
    """Pre-norm block over local heads / FFN columns / experts, all-reducing each branch."""

    def __init__(self, config: ModelConfig, rank: int, tp: int, reduce: _Reduce) -> None:
        super().__init__(config, rank, tp)
        self.reduce = reduce

    def forward(self, x, layer, rows):
        x = x + self.reduce.all_reduce(self.attn(self.attn_norm(x), layer, rows))
        return x + self.reduce.all_reduce(self.ffn(self.ffn_norm(x)))


class ShardedDecoder(Decoder):
    """Rank ``rank``'s shard of a `Decoder` split over ``tp`` ranks (see the module docstring).

    A drop-in for `Decoder` inside `TargetEngine`: same ``config`` (the full model's),
    ``new_cache`` (holding ``n_kv_heads / tp`` heads), ``forward_packed``. Every rank must run
    the same forwards in the same order (the collectives pair up across ranks); rank 0 gets
    float32 logits ``[n, vocab_size]`` on the CPU, other ranks None. Hidden rows are the full
    ``[n, hidden_size]`` (replicated) on every rank, float32 on the CPU.

    Build with `ShardedDecoder.load`; the torch.distributed process group must be initialised
    (``tp > 1``) before the first forward.

    Attributes:
        rank, tp: this rank and the number of ranks.
        vocab_parallel: embeddings / LM head split by vocabulary rows (else replicated).
        comm_bytes: bytes this rank has sent into collectives so far (int).
    """

    def __init__(
        self,
        config: ModelConfig,
        rank: int,
        tp: int,
        vocab_parallel: bool = True,
        group=None,
    ) -> None:
        nn.Module.__init__(self)
        errors = tp_errors(config, tp)
        if errors:
            raise ValueError("; ".join(errors))
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, tp={tp}), got {rank!r}")
        self.config, self.rank, self.tp = config, rank, tp
        self.vocab_parallel = vocab_parallel and tp > 1
        self._reduce = _Reduce(tp, group)
        if self.vocab_parallel:
            lo, hi = vocab_range(config.vocab_size, rank, tp)
        else:
            lo, hi = 0, config.vocab_size
        self._vocab_pad = math.ceil(config.vocab_size / tp)
        hidden = config.hidden_size
        with torch.device("meta"):  # shapes only: `load` assigns the real shard tensors
            self.embed_tokens = _ShardEmbedding(
                lo, hi, hidden, self._reduce if self.vocab_parallel else None
            )
            self.layers = nn.ModuleList(
                _ShardBlock(config, rank, tp, self._reduce) for _ in range(config.n_layers)
            )
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            head = self.vocab_parallel or rank == 0
            self.lm_head = _linear(hidden, hi - lo) if head and not config.tie_embeddings else None
        self.requires_grad_(False)

    @classmethod
    def load(
        cls,
        config: ModelConfig,
        source: WeightSource,
        rank: int,
        tp: int,
        vocab_parallel: bool = True,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        group=None,
    ) -> ShardedDecoder:
        """This rank's shard, read slice by slice from ``source``, on ``device`` in ``dtype``.

        Raises:
            ValueError: ``tp`` does not divide the model (`tp_errors`), a bad rank, or the
                source lacks a tensor / has one of another shape.
        """
        model = cls(config, rank, tp, vocab_parallel, group)
        state = _shard_state(config, source, rank, tp, model.vocab_parallel)
        state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
        if config.tie_embeddings and model.lm_head is None:
            missing = [k for k in missing if not k.startswith("lm_head.")]
        if missing or unexpected:
            raise ValueError(f"shard state mismatch: missing {missing}, unexpected {unexpected}")
        model.requires_grad_(False)
        model._cos = torch.empty(0, config.head_dim, device=device, dtype=dtype)
        model._sin = torch.empty(0, config.head_dim, device=device, dtype=dtype)
        return model.eval()

    @property
    def cache_kv_heads(self) -> int:
        return self.config.n_kv_heads // self.tp

    @property
    def comm_bytes(self) -> int:
        return self._reduce.bytes

    def head_weight(self) -> torch.Tensor | None:
        """This rank's LM head weight rows: the embedding shard when tied, else its head's
        weight, None where an untied rank holds no head."""
        if self.config.tie_embeddings:
            return self.embed_tokens.weight
        return None if self.lm_head is None else self.lm_head.weight

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        weight = self.head_weight()
        if not self.vocab_parallel:
            if self.rank != 0:
                return None
            return fast_linear(hidden, weight).float().contiguous()
        local = fast_linear(hidden, weight)  # [n, hi - lo]
        pad = self._vocab_pad - local.shape[1]
        if pad:
            local = F.pad(local, (0, pad))
        parts = self._reduce.gather0(local, self.rank)
        if parts is None:
            return None
        return torch.cat(parts, dim=1)[:, : self.config.vocab_size].float().contiguous()

    def forward_packed(
        self,
        segments: Sequence[tuple[Sequence[int] | torch.Tensor, int, KvCache]],
        last_logits_only: Sequence[bool] | None = None,
    ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """`Decoder.forward_packed` across the ranks: logits on rank 0 only (None elsewhere),
        results float32 on the CPU whatever the device and dtype the shard computes in."""
        device = self.embed_tokens.weight.device
        if device.type == "cpu" and self.dtype == torch.float32:
            return super().forward_packed(segments, last_logits_only)
        # The Decoder code creates its index/mask/RoPE tensors on the default device.
        with torch.device(device):
            out = super().forward_packed(segments, last_logits_only)
        return [(None if lg is None else lg.cpu(), hid.float().cpu()) for lg, hid in out]

    def new_cache(self, capacity: int | None = None) -> KvCache:
        """`Decoder.new_cache` on this shard's device and dtype, holding its KV heads only."""
        with torch.device(self.embed_tokens.weight.device):
            return super().new_cache(capacity)


def rank_parameter_counts(model: nn.Module) -> dict[str, int]:
    """Elements per parameter name of a (shard) model, tied parameters counted once."""
    return {name: p.numel() for name, p in model.named_parameters(remove_duplicate=True)}

