"""EAGLE-3 drafter: one decoder layer over three of the target's layers.

EAGLE-3 (Li et al. 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models
via Training-Time Test", arXiv 2503.01840) as implemented by SafeAILab/EAGLE
(``eagle/model/cnets.py``, ``eagle/traineagle3/cnets.py``), vLLM (``llama_eagle3.py``) and
SGLang (``llama_eagle3.py``):

- **Inputs.** For every committed position ``t`` the target's residual stream entering three
  layers (capture-before-layer convention, ``aux_layers``, default ``(2, N // 2, N - 3)`` for
  an N-layer target), concatenated in ascending order: a ``[3 * Ht]`` row, exactly what
  `target_worker.model.Decoder.set_capture_layers` returns. ``fc`` ``[3Ht -> H]`` (no bias)
  fuses it once; later draft steps feed back the head's own **pre-norm** output (H wide, fc
  skipped).
- **The layer** (``midlayer``): ``x = cat(input_layernorm(embed(x_{t+1})),
  hidden_norm(h))`` (2H, embedding first) -> q/k/v, grouped-query attention with RoPE at the
  target's absolute position ``t`` (the head's own ``rope_theta``), o_proj, plus the residual
  ``h`` (un-normed; the normed ``hidden_norm(h)`` with ``norm_before_residual``, as vLLM's
  ``llama_eagle3`` and speculators do), then ``post_attention_layernorm`` -> SwiGLU MLP ->
  plus residual. That sum is the pre-norm output fed back.
- **The head**: ``lm_head(norm(h))`` over a draft vocabulary of ``Vd`` target tokens; draft
  id ``i`` is target id ``i + d2t[i]`` (``d2t``: int64 offsets; ``t2d``: bool ``[V]``
  membership mask). Embeddings: the head's own ``embed_tokens`` if the checkpoint has one,
  else the target's (frozen, shared).

**Layer ids.** One convention inside: capture-before (HF ``hidden_states[i]``: ``i`` is the
input of decoder layer ``i``, ``N`` the last layer's output before the final norm), the
convention of EAGLE's reference code, of vLLM, and of speculators' ids as vLLM reads them
(verbatim). EAGLE and SpecForge configs normally carry no ids: the default for the target's
layer count applies. Ids a SpecForge config carries (``eagle_config.
eagle_aux_hidden_state_layer_ids``) are SGLang's "output of layer X" and are converted to
``X + 1`` on load (SGLang adds the 1 itself). Ids must be strictly ascending: the target
returns its captured layers in ascending order and ``fc``'s columns follow the ids' order.

Checkpoint layouts loaded (`load_eagle3`): (a) EAGLE repository checkpoints (an HF
LlamaConfig-style ``config.json`` with ``draft_vocab_size``; tensors ``midlayer.*``, ``fc``,
``norm``, ``lm_head``, ``d2t``, ``t2d``, optional ``embed_tokens``), (b) Red Hat
speculators (``speculators_config``, ``transformer_layer_config``, tensors ``layers.0.*``;
``norm_before_fc``'s ``input_norm`` supported, ``fc_norm`` and ``norm_output`` refused), (c)
SpecForge exports (``LlamaForCausalLMEagle3``, no embeddings). Weights: ``model.safetensors``
(or a sharded index) or ``pytorch_model.bin`` read with ``torch.load(weights_only=True)``:
a checkpoint never runs code. `Eagle3Head.save` writes the speculators layout, so a head
specd ships loads by the same loader.

Drafting (`Eagle3Session`) mirrors `drafter_worker.eagle.EagleSession`: a KV cache over the
committed positions, rolled back after every proposal; drafts are the head's argmax at every
temperature, reported as point masses (vLLM drafts EAGLE's argmax too), so the rule couples
each position to plain sampling and a seeded request's tokens are the same drafted or not
(`specd_core.rule`); dynamic draft length by the head's own confidence (EAGLE-2); stop
tokens end a block.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specd_core.draft import DraftBlock, DraftDist, DrafterCapabilities, propose_ahead
from specd_core.sampling import DraftSamplingParams
from target_worker.config import RopeScaling
from target_worker.model import RMSNorm, apply_rope, rope_tables

from .eagle import HEADS_DIR, NeedsResync, rows_continue

__all__ = [
    "DEFAULT_EAGLE3_HEAD",
    "Eagle3Config",
    "Eagle3Drafter",
    "Eagle3Head",
    "Eagle3Session",
    "SuffixThenEagle3",
    "check_fits",
    "default_aux_layers",
    "inspect_eagle3",
    "load_eagle3",
    "resolve_head_dir",
]

#: The EAGLE-3 head shipped for the default target (SmolLM2-135M-Instruct): a directory in
#: the speculators layout (`Eagle3Head.save`).
DEFAULT_EAGLE3_HEAD = HEADS_DIR / "smollm2-135m-instruct-eagle3"

#: Files of a head directory.
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
#: The training recipe beside a head `Eagle3Head.save` writes (not part of the layout).
RECIPE_FILE = "specd_recipe.json"

#: Context bound of a head's KV cache (it grows on demand; the target's context is the limit).
HEAD_MAX_SEQ_LEN = 1 << 20

#: transformers' ``LlamaConfig`` defaults: speculators writes its ``transformer_layer_config``
#: as a diff against them, so an absent key means this value.
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_act": "silu"}

#: Architectures named in a config.json, per layout.
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layers for an ``n_layers`` target: ``(2, N // 2, N - 3)``
    (capture-before; EAGLE ``modeling_llama_kv.py``, vLLM ``get_eagle3_aux_hidden_state_layers``,
    SGLang and speculators agree).

    Raises:
        ValueError: a target with fewer than 7 layers, where two of them coincide.
    """
    n = int(n_layers)
    layers = (2, n // 2, n - 3)
    if n < 7:
        raise ValueError(f"aux_layers: a {n}-layer target has no distinct default (2, N // 2, "
                         f"N - 3) = {layers}; give the layer ids explicitly")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head.

    Attributes:
        hidden_size: the head's width H (its embeddings, layer and ``lm_head`` input).
        vocab_size: the target's vocabulary size V (``t2d`` and embedding rows).
        draft_vocab_size: rows Vd of ``lm_head`` (<= V).
        n_heads, n_kv_heads, head_dim: the layer's grouped-query attention.
        ffn_dim: the SwiGLU width.
        target_hidden_size: the target's width Ht (None: H); ``fc`` reads ``3 * Ht``.
        rope_theta: the head's own RoPE base (what it was trained with).
        rope_scaling: Llama 3.x scaling (`target_worker.config.RopeScaling`) or None.
        rms_norm_eps: epsilon of every RMSNorm of the head.
        aux_layers: the three target layers read, capture-before, strictly ascending; None
            until resolved for a target (`resolved`: the default `default_aux_layers`).
        norm_before_residual: the layer's residual is ``hidden_norm(h)`` instead of ``h``
            (vLLM ``llama_eagle3``, speculators).
        norm_before_fc: an RMSNorm ``input_norm`` ``[3 * Ht]`` before ``fc`` (speculators'
            gpt-oss variant).

    Raises:
        ValueError: naming the field: a non-positive size, heads not divisible by KV heads,
            an odd head_dim, Vd > V, or aux_layers that are not 3 distinct ascending ids >= 0.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    target_hidden_size: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    aux_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "n_heads", "n_kv_heads",
                     "head_dim", "ffn_dim", "target_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Eagle3Config.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Eagle3Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Eagle3Config.n_heads {self.n_heads} is not divisible by "
                             f"n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Eagle3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size {self.draft_vocab_size} > "
                             f"vocab_size {self.vocab_size}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"Eagle3Config.rope_scaling must be a RopeScaling or None, got "
                             f"{type(self.rope_scaling).__name__}")
        if self.aux_layers is not None:
            layers = tuple(self.aux_layers)
            if (len(layers) != 3 or any(isinstance(i, bool) or not isinstance(i, int)
                                        for i in layers)):
                raise ValueError(f"Eagle3Config.aux_layers must be 3 ints, got "
                                 f"{list(layers)}")
            if layers[0] < 0 or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
                raise ValueError(f"Eagle3Config.aux_layers must be distinct, ascending and "
                                 f">= 0 (the target returns its captured layers in ascending "
                                 f"order), got {list(layers)}")
            object.__setattr__(self, "aux_layers", layers)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, ffn_dim: int | None = None,
                   **fields) -> Eagle3Config:
        """A head shaped like one layer of ``target_config`` (a `target_worker.ModelConfig`),
        reading the default layers (`default_aux_layers`) unless ``aux_layers`` is given;
        ``fields`` override any other field."""
        c = target_config
        values = dict(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                      draft_vocab_size=min(draft_vocab_size, c.vocab_size), n_heads=c.n_heads,
                      n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                      ffn_dim=ffn_dim or c.ffn_dim, target_hidden_size=c.hidden_size,
                      rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                      rms_norm_eps=c.rms_norm_eps)
        values.update(fields)
        if values.get("aux_layers") is None:
            values["aux_layers"] = default_aux_layers(c.n_layers)
        return cls(**values)

    def resolved(self, n_layers: int) -> Eagle3Config:
        """This config with ``aux_layers`` set: its own, or the default for an ``n_layers``
        target. Raises ValueError as `default_aux_layers`."""
        if self.aux_layers is not None:
            return self
        return replace(self, aux_layers=default_aux_layers(n_layers))

    def expected_shapes(self, embedding: bool = False) -> dict[str, tuple[int, ...]]:
        """Every tensor of the head under its EAGLE name (``midlayer.*``) with its shape;
        ``embed_tokens.weight`` only when ``embedding``."""
        h, ht, nh, nkv, d = (self.hidden_size, self.target_hidden_size, self.n_heads,
                             self.n_kv_heads, self.head_dim)
        shapes = {
            "fc.weight": (h, 3 * ht),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, nh * d),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (self.ffn_dim, h),
            "midlayer.mlp.up_proj.weight": (self.ffn_dim, h),
            "midlayer.mlp.down_proj.weight": (h, self.ffn_dim),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.vocab_size,),
        }
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (3 * ht,)
        if embedding:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        return shapes


class _HeadCache:
    """The head's KV cache for one sequence: float32 keys/values ``[n_kv_heads, capacity,
    head_dim]``; positions ``[0, seq_len)`` are committed; `truncate` rolls back in O(1)."""

    def __init__(self, n_kv_heads: int, head_dim: int, capacity: int = 256):
        self.k = torch.empty(n_kv_heads, capacity, head_dim)
        self.v = torch.empty(n_kv_heads, capacity, head_dim)
        self.seq_len = 0

    def reserve(self, needed: int) -> None:
        if needed > HEAD_MAX_SEQ_LEN:
            raise ValueError(f"sequence of {needed} positions exceeds the head's "
                             f"{HEAD_MAX_SEQ_LEN}")
        cap = self.k.shape[1]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], cap, old.shape[2])
            new[:, : self.seq_len] = old[:, : self.seq_len]
            setattr(self, name, new)

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.seq_len:
            raise ValueError(f"truncate length must be in [0, {self.seq_len}], got {n}")
        self.seq_len = n


class _Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight may be stored in another dtype than the
    activations (`Eagle3Head.set_weight_dtype`): the input is cast to the weight's dtype and
    the output back to the input's, so activations, norms, the KV cache and the logits'
    softmax stay float32 while the matmuls read bfloat16 weights (half the bytes).

    A bfloat16 weight is also kept in oneDNN's reordered layout (`pack`) for drafting, which
    runs under inference mode: at one row (Zen 4 with AVX512-BF16, 1 thread, a busy machine,
    weights not in cache) oneDNN's bfloat16 inner product took 93-376 us on the layer's and a
    4k-row lm_head's shapes where ATen's bfloat16 took 147-792 us and float32 185-1063 us
    (`default_head_dtype`: the whole head).
    The packed copy is used only while the weight is unchanged (same storage and version) and
    never with autograd on, so training reads the plain weight."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self._packed: tuple[object, tuple[int, int]] | None = None

    def pack(self) -> None:
        """Keeps a oneDNN-reordered copy of a bfloat16 weight (nothing for another dtype, or
        where oneDNN is unavailable or refuses it: the plain weight serves)."""
        w = self.weight
        self._packed = None
        if (w.dtype != torch.bfloat16 or w.device.type != "cpu"
                or not torch.backends.mkldnn.is_available()):
            return
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)
        except (RuntimeError, AttributeError, NotImplementedError):  # no oneDNN kernel here
            return
        self._packed = (packed, (w.data_ptr(), w._version))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype:  # float32 weights (and training's autocast): plain
            return F.linear(x, w)
        packed = self._packed
        if (packed is not None and x.dim() == 2 and not torch.is_grad_enabled()
                and packed[1] == (w.data_ptr(), w._version)):
            out = torch.ops.mkldnn._linear_pointwise(x.to(w.dtype), packed[0], None, "none",
                                                     [], "")
            return out.to(x.dtype)
        return F.linear(x.to(w.dtype), w).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h, nh, nkv, d = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim
        self.q_proj = _Linear(2 * h, nh * d)
        self.k_proj = _Linear(2 * h, nkv * d)
        self.v_proj = _Linear(2 * h, nkv * d)
        self.o_proj = _Linear(nh * d, h)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = _Linear(c.hidden_size, c.ffn_dim)
        self.up_proj = _Linear(c.hidden_size, c.ffn_dim)
        self.down_proj = _Linear(c.ffn_dim, c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    """EAGLE-3's one decoder layer (EAGLE ``LlamaDecoderLayeremb``); module names are the
    checkpoints' (``midlayer.*``)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


class Eagle3Head(nn.Module):
    """The EAGLE-3 head (see the module docstring); plain float32 torch (the matmul weights
    may be stored in bfloat16 for drafting: `set_weight_dtype`).

    Tensor names are the EAGLE checkpoints' (``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
    buffers ``d2t`` int64 ``[Vd]`` and ``t2d`` bool ``[V]``; ``embed_tokens`` only when the
    head owns its embeddings, ``input_norm`` only with ``norm_before_fc``). A head without
    embeddings reads the target's (`set_target_embedding`: frozen, shared, never saved).

    Args:
        config: the shape.
        own_embedding: give the head its own (frozen) ``embed_tokens`` ``[V, H]``.
    """

    def __init__(self, config: Eagle3Config, own_embedding: bool = False):
        super().__init__()
        c = self.config = config
        h, ht = c.hidden_size, c.target_hidden_size
        self.input_norm = RMSNorm(3 * ht, c.rms_norm_eps) if c.norm_before_fc else None
        self.fc = _Linear(3 * ht, h)
        self.midlayer = _MidLayer(c)
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = _Linear(h, c.draft_vocab_size)
        self.embed_tokens: nn.Embedding | None = None
        if own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, h)
            self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[: c.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self._target_embed: torch.Tensor | None = None
        self._cos = torch.empty(0, c.head_dim)
        self._sin = torch.empty(0, c.head_dim)

    # ---- construction ----

    @classmethod
    def random(cls, config: Eagle3Config, seed: int = 0,
               draft_vocab: torch.Tensor | Sequence[int] | None = None,
               own_embedding: bool = False) -> Eagle3Head:
        """A head with random weights, a pure function of its arguments
        (``torch.Generator(seed)``): projections N(0, 1/fan_in) (output projections halved),
        norms 1, embeddings (``own_embedding``) N(0, 1).

        Args:
            draft_vocab: the draft vocabulary's target ids (``Vd`` distinct ids in ``[0, V)``,
                any order: stored sorted, as EAGLE and speculators build it); None: the
                first Vd ids (``d2t`` all zero).

        Raises:
            ValueError: as `set_draft_vocab`.
        """
        head = cls(config, own_embedding=own_embedding)
        gen = torch.Generator().manual_seed(int(seed))
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                    continue
                if name == "embed_tokens.weight":
                    p.copy_(torch.randn(p.shape, generator=gen))
                    continue
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    std *= 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
        if draft_vocab is not None:
            head.set_draft_vocab(draft_vocab)
        return head

    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Sets ``d2t``/``t2d`` from the draft vocabulary's target ids (sorted first: draft
        id ``i`` is the i-th smallest).

        Raises:
            ValueError: naming the problem: wrong count, a repeated id, an id outside [0, V).
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        c = self.config
        if ids.numel() != c.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, draft_vocab_size is "
                             f"{c.draft_vocab_size}")
        ids = ids.sort().values
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary has a repeated token id")
        if int(ids[0]) < 0 or int(ids[-1]) >= c.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {c.vocab_size})")
        self.d2t = ids - torch.arange(c.draft_vocab_size)
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d = t2d

    def set_target_embedding(self, weight: torch.Tensor) -> None:
        """Shares the target's embedding table (float32 ``[V, H]``, frozen; not saved) for a
        head without its own.

        Raises:
            ValueError: a table of another shape.
        """
        c = self.config
        if tuple(weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embed_tokens: the target's embedding is "
                             f"{list(weight.shape)}, the head needs [{c.vocab_size}, "
                             f"{c.hidden_size}] (vocab_size, hidden_size)")
        self._target_embed = weight.detach()

    @property
    def has_own_embedding(self) -> bool:
        """Whether the head carries its own ``embed_tokens`` (else it reads the target's)."""
        return self.embed_tokens is not None

    @property
    def vocab_ids(self) -> torch.Tensor:
        """int64 ``[Vd]``: the target id of each draft id (``arange(Vd) + d2t``)."""
        return torch.arange(self.config.draft_vocab_size) + self.d2t

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype of the head's matmul weights (`set_weight_dtype`; float32 as built)."""
        return self.lm_head.weight.dtype

    def set_weight_dtype(self, dtype: torch.dtype) -> Eagle3Head:
        """Stores the matmul weights (``fc``, the layer's projections, ``lm_head``) in
        ``dtype`` (bfloat16: half the bytes each drafted token reads); norms, embeddings,
        the KV cache and all activations stay float32, and `draft_logits` returns float32
        logits (the bfloat16 products, widened). Returns the head.

        Raises:
            ValueError: a dtype other than float32, bfloat16 or float16.
        """
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype: the head's weights must be float32, bfloat16 or "
                             f"float16, got {dtype}")
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, _Linear):
                    module.weight.data = module.weight.data.to(dtype)
                    module.pack()
        return self

    def resolve_aux_layers(self, n_layers: int) -> None:
        """Sets ``config.aux_layers`` to the default for an ``n_layers`` target when the
        checkpoint named none (`Eagle3Config.resolved`)."""
        self.config = self.config.resolved(n_layers)

    # ---- checks ----

    def check(self) -> None:
        """The head's own consistency: every tensor's shape against the config, and ``d2t``
        / ``t2d`` (mapped ids in ``[0, V)`` and strictly increasing, ``t2d.sum() == Vd``,
        ``t2d`` True at every mapped id).

        Raises:
            ValueError: naming the tensor and both values.
        """
        c = self.config
        state = self.state_dict()
        for name, shape in c.expected_shapes(self.has_own_embedding).items():
            got = tuple(state[name].shape)
            if got != shape:
                raise ValueError(f"{name}: shape {list(got)}, the config needs {list(shape)}")
        _check_vocab_map(self.d2t, self.t2d, c.vocab_size)

    def validate_against(self, target_config) -> None:
        """Refuses, before serving, a head that does not fit ``target_config`` (a
        `target_worker.ModelConfig`): everything `check_fits` checks, then everything
        `check` checks.

        Raises:
            ValueError: naming the field or tensor and both values.
        """
        check_fits(self.config, target_config, self.has_own_embedding)
        self.check()

    # ---- math shared by training and drafting ----

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., H]`` embeddings of int64 ``tokens`` (own table, else the target's;
        never trained).

        Raises:
            ValueError: a head with neither.
        """
        if self.embed_tokens is not None:
            weight = self.embed_tokens.weight
        elif self._target_embed is not None:
            weight = self._target_embed
        else:
            raise ValueError("embed_tokens: the head has none and no target embedding was "
                             "given (set_target_embedding)")
        return F.embedding(tokens, weight.detach()).float()

    def encode_target(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` (after ``input_norm`` with ``norm_before_fc``) of target rows
        ``[..., 3 * Ht]``: ``[..., H]``."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head(norm(hidden))``: float32 ``[..., Vd]`` over the draft vocabulary for
        float32 pre-norm outputs ``[..., H]`` (draft id ``i`` is target id ``vocab_ids[i]``;
        with bfloat16 weights, the bfloat16 products widened to float32)."""
        return self.lm_head(self.norm(hidden))

    def _rope(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[>= end, head_dim]`` (`target_worker.model.rope_tables`)."""
        if end > self._cos.shape[0]:
            c = self.config
            size = max(end, 2 * self._cos.shape[0], 256)
            # Normal tensors even when drafting (inference mode) grows them: training reuses
            # them under autograd.
            with torch.inference_mode(False):
                self._cos, self._sin = rope_tables(c.head_dim, c.rope_theta, size,
                                                   c.rope_scaling)
        return self._cos, self._sin

    def _qkv(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor):
        """The layer up to attention for rows ``[..., T, H]``: (q ``[..., T, nh, d]``, k, v
        ``[..., T, nkv, d]``, residual ``[..., T, H]``), RoPE applied."""
        c, layer = self.config, self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if c.norm_before_residual else hidden
        x = torch.cat((layer.input_layernorm(embeds), normed), -1)  # embedding first
        shape = x.shape[:-1]
        attn = layer.self_attn
        q = attn.q_proj(x).view(*shape, c.n_heads, c.head_dim)
        k = attn.k_proj(x).view(*shape, c.n_kv_heads, c.head_dim)
        v = attn.v_proj(x).view(*shape, c.n_kv_heads, c.head_dim)
        cos, sin = cos[..., None, :], sin[..., None, :]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def _finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """o_proj + residual, then the MLP block: the pre-norm output ``[..., H]``."""
        layer = self.midlayer
        x = residual + layer.self_attn.o_proj(attn_out)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    # ---- drafting ----

    def new_cache(self) -> _HeadCache:
        """An empty KV cache for drafting (grows on demand)."""
        return _HeadCache(self.config.n_kv_heads, self.config.head_dim)

    @torch.inference_mode()
    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: _HeadCache
             ) -> torch.Tensor:
        """Drafting forward: ``n`` pairs appended at positions ``[cache.seq_len, +n)``.

        Args:
            hidden: float32 ``[n, H]``: `encode_target` of target rows, or the head's own
                pre-norm outputs.
            tokens: int64 ``[n]``: the token after each position (``x_{t+1}``).
            cache: written at those positions; ``seq_len`` grows by ``n``.

        Returns:
            float32 ``[n, H]`` pre-norm outputs (``draft_logits`` of row i predicts the token
            after ``tokens[i]``).
        """
        c = self.config
        n = hidden.shape[0]
        start, end = cache.seq_len, cache.seq_len + n
        cache.reserve(end)
        cos, sin = self._rope(end)
        q, k, v, residual = self._qkv(hidden, self.embed(tokens), cos[start:end],
                                      sin[start:end])
        cache.k[:, start:end] = k.transpose(0, 1)
        cache.v[:, start:end] = v.transpose(0, 1)
        group = c.n_heads // c.n_kv_heads
        keys = cache.k[:, :end].repeat_interleave(group, 0)  # [nh, end, d]
        values = cache.v[:, :end].repeat_interleave(group, 0)
        # One query (every drafting step) sees every key, and a whole history from position
        # 0 (a prompt's ingest) is plain causal: neither needs a mask, which with 4-D
        # inputs lets SDPA take its fused kernel on the CPU (3-D inputs always ran the math
        # path: a 4400-row ingest 1.95 s of attention against 0.32 s fused, a one-query
        # step over 4400 keys 2.7 ms against 1.1 ms).
        causal = n > 1 and start == 0
        visible = None if n == 1 or causal else (
            torch.arange(end)[None, :] <= torch.arange(start, end)[:, None])
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                           attn_mask=visible, is_causal=causal)[0]
        cache.seq_len = end
        return self._finish(o.transpose(0, 1).reshape(n, c.n_heads * c.head_dim), residual)

    # ---- training ----

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training forward: ``forward_unrolled(aux, next_ids, 1)[0]``."""
        return self.forward_unrolled(aux, next_ids, 1)[0]

    def forward_unrolled(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int,
                         detach_feedback: bool = False) -> list[torch.Tensor]:
        """Training forward with EAGLE-3's training-time test (arXiv 2503.01840, section
        3.3; EAGLE ``traineagle3/cnets.py``), causal over whole sequences, positions from 0.

        Step 0 is teacher forcing: ``fc(aux)`` with the true next tokens. Step ``j`` feeds at
        position ``p`` step ``j - 1``'s pre-norm output made at ``p - 1`` (zeros at ``p = 0``)
        with the ground-truth token ``next_ids[p]``, at RoPE position ``p``, attending exactly
        as drafting step ``j + 1`` from anchor ``p - j`` does: to step 0's keys at positions
        ``<= p - j`` (the committed prefix) and to step ``i``'s key at ``p - j + i`` for
        ``1 <= i <= j`` (the earlier drafted positions). Gradients flow through the feedback
        (as in EAGLE's trainer) unless ``detach_feedback``.

        Args:
            aux: float32 ``[B, T, 3 * Ht]``: the target's captured rows of positions 0..T-1.
            next_ids: int64 ``[B, T]``: token ``t + 1`` at position ``t``; a negative id is a
                pad (embedded as id 0; mask those positions out of the loss).
            steps: unrolled steps (>= 1).

        Returns:
            ``steps`` float32 ``[B, T, H]`` pre-norm outputs (`draft_logits` turns them into
            logits); step ``j`` at position ``p`` predicts token ``p + 2`` (the token after
            ``next_ids[p]``), as draft ``j + 1`` from anchor ``p - j``; meaningful for
            ``p >= j``.

        Raises:
            ValueError: shapes that do not fit, or steps < 1.
        """
        c = self.config
        if aux.dim() != 3 or aux.shape[-1] != 3 * c.target_hidden_size:
            raise ValueError(f"aux must be [B, T, {3 * c.target_hidden_size}], got "
                             f"{list(aux.shape)}")
        if tuple(next_ids.shape) != tuple(aux.shape[:2]):
            raise ValueError(f"next_ids must be {list(aux.shape[:2])}, got "
                             f"{list(next_ids.shape)}")
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        b, t = next_ids.shape
        cos, sin = self._rope(t)
        cos, sin = cos[:t], sin[:t]
        if aux.is_inference():  # rows a target computed in inference mode
            aux = aux.clone()
        embeds = self.embed(next_ids.clamp(min=0))
        group = c.n_heads // c.n_kv_heads
        pos = torch.arange(t)
        hidden = self.encode_target(aux.float())
        keys, values, outs = [], [], []
        for j in range(steps):
            q, k, v, residual = self._qkv(hidden, embeds, cos, sin)
            q = q.transpose(1, 2)  # [B, nh, T, d]
            keys.append(k.transpose(1, 2).repeat_interleave(group, 1))
            values.append(v.transpose(1, 2).repeat_interleave(group, 1))
            if j == 0:
                o = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
            else:
                blocks = [pos[None, :] <= (pos - j)[:, None]]
                blocks += [pos[None, :] == (pos - j + i)[:, None] for i in range(1, j + 1)]
                o = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2),
                                                   attn_mask=torch.cat(blocks, 1))
            out = self._finish(o.transpose(1, 2).reshape(b, t, c.n_heads * c.head_dim),
                               residual)
            outs.append(out)
            fed = out.detach() if detach_feedback else out
            # Next step: position p gets this step's output made at p - 1.
            hidden = torch.cat((fed.new_zeros(b, 1, c.hidden_size), fed[:, :-1]), 1)
        return outs

    # ---- persistence ----

    def save(self, directory: str | os.PathLike, metadata: dict | None = None, *,
             dtype: torch.dtype = torch.float16, verifier: str | None = None,
             speculative_tokens: int = 3) -> Path:
        """Writes the head in the speculators layout: ``config.json`` (``speculators_config``,
        ``transformer_layer_config``, ``eagle_aux_hidden_state_layer_ids``, ...) and
        ``model.safetensors`` (weights in ``dtype``, ``d2t`` int64, ``t2d`` bool, no
        ``embed_tokens`` unless the head owns them), plus ``metadata`` (the training recipe)
        in `RECIPE_FILE`. `load_eagle3` reads it back with no special case.

        Args:
            directory: created if missing; its head files are overwritten.
            dtype: float16 or bfloat16 (float32 allowed).
            verifier: the target's name or path, recorded for speculators/vLLM.
            speculative_tokens: the proposal length recorded for speculators/vLLM.

        Returns:
            The directory.

        Raises:
            ValueError: unresolved ``aux_layers`` (`resolve_aux_layers` first) or a dtype
                that is not floating point.
        """
        from safetensors.torch import save_file

        c = self.config
        if c.aux_layers is None:
            raise ValueError("aux_layers: unresolved; call resolve_aux_layers(n_layers) "
                             "before save")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be floating point, got {dtype}")
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = {}
        for name, value in self.state_dict().items():
            if name.startswith("midlayer."):
                name = "layers.0." + name[len("midlayer."):]
            if name == "d2t":
                value = value.to(torch.long)
            elif name == "t2d":
                value = value.to(torch.bool)
            else:
                value = value.to(dtype)
            state[name] = value.contiguous()
        save_file(state, str(out / SAFETENSORS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(
            _speculators_config(c, str(dtype).split(".")[-1], verifier, speculative_tokens),
            indent=2) + "\n")
        if metadata is not None:
            (out / RECIPE_FILE).write_text(json.dumps(metadata, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike, target_config=None) -> Eagle3Head:
        """`load_eagle3` without the info."""
        return load_eagle3(path, target_config)[0]


def check_fits(config: Eagle3Config, target_config, own_embedding: bool | None) -> None:
    """Refuses a head shape (``config``) that does not fit ``target_config`` (a
    `target_worker.ModelConfig`), from the config alone (no weights read): the rows' width
    (``target_hidden_size`` vs the target's ``hidden_size``), ``vocab_size``, aux layer ids
    outside ``[0, n_layers]`` (or no distinct default), and, for a head without its own
    embeddings (``own_embedding`` False; None: not known, not checked), the target's
    embedding width against the head's ``hidden_size``.

    Raises:
        ValueError: naming the field and both values.
    """
    c, t = config, target_config
    if c.target_hidden_size != t.hidden_size:
        raise ValueError(f"target_hidden_size: the head reads rows of 3 x "
                         f"{c.target_hidden_size}, the target's hidden_size is "
                         f"{t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        raise ValueError(f"vocab_size: the head's is {c.vocab_size}, the target's is "
                         f"{t.vocab_size}")
    layers = c.aux_layers if c.aux_layers is not None else default_aux_layers(t.n_layers)
    bad = [i for i in layers if not 0 <= i <= t.n_layers]
    if bad:
        raise ValueError(f"aux_layers: layer {bad[0]} of {list(layers)} is outside [0, "
                         f"{t.n_layers}] (the target has {t.n_layers} layers)")
    if own_embedding is False and c.hidden_size != t.hidden_size:
        raise ValueError(f"embed_tokens: the head has none and the target's embedding is "
                         f"{t.hidden_size} wide, the head's hidden_size is "
                         f"{c.hidden_size}")


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Raises ValueError unless ``d2t`` maps draft ids to strictly increasing target ids in
    ``[0, V)`` and ``t2d`` marks exactly those."""
    if d2t.dtype != torch.long:
        raise ValueError(f"d2t: dtype {d2t.dtype}, must be int64 offsets")
    if t2d.dtype != torch.bool:
        raise ValueError(f"t2d: dtype {t2d.dtype}, must be bool")
    mapped = torch.arange(d2t.numel()) + d2t
    if mapped.numel():
        lo, hi = int(mapped.min()), int(mapped.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            i = int((mapped == bad).nonzero()[0])
            raise ValueError(f"d2t: draft id {i} maps to target id {bad}, outside [0, "
                             f"{vocab_size})")
        steps = mapped[1:] - mapped[:-1]
        if bool((steps <= 0).any()):
            i = int((steps <= 0).nonzero()[0]) + 1
            raise ValueError(f"d2t: target ids must be strictly increasing, draft id {i} maps "
                             f"to {int(mapped[i])} after {int(mapped[i - 1])}")
    total = int(t2d.sum())
    if total != d2t.numel():
        raise ValueError(f"t2d: marks {total} target ids, draft_vocab_size is {d2t.numel()}")
    if mapped.numel() and not bool(t2d[mapped].all()):
        i = int((~t2d[mapped]).nonzero()[0])
        raise ValueError(f"t2d: False at target id {int(mapped[i])}, which d2t maps draft id "
                         f"{i} to")


def _speculators_config(c: Eagle3Config, dtype: str, verifier: str | None,
                        speculative_tokens: int) -> dict:
    """The speculators ``config.json`` of ``c`` (speculators ``Eagle3SpeculatorConfig``;
    the keys vLLM's speculators adapter reads)."""
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
             "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
             "intermediate_size": c.ffn_dim, "num_hidden_layers": 1,
             "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
             "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "attention_bias": False, "mlp_bias": False,
             "tie_word_embeddings": False, "torch_dtype": dtype}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        layer["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "specd",
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers or ()),
        "torch_dtype": dtype,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }


# ---- loading ----


def resolve_head_dir(path: str | os.PathLike | None) -> Path:
    """The head directory of ``path``: a directory, or a ``config.json`` / weights file inside
    one; None: `DEFAULT_EAGLE3_HEAD`.

    Raises:
        FileNotFoundError: no such directory or file, or no ``config.json`` in it.
    """
    given = Path(DEFAULT_EAGLE3_HEAD if path is None else path)
    p = given.parent if given.is_file() else given
    if not p.is_dir():
        hint = " (the default head; give --drafter-path DIR)" if path is None else ""
        raise FileNotFoundError(f"EAGLE-3 head not found: {p}{hint}")
    if not (p / CONFIG_FILE).is_file():
        # Name what was given: a stray file's directory (often ".") says nothing.
        where = given if given == p else f"{given} (a file: its directory {p.resolve()})"
        raise FileNotFoundError(f"EAGLE-3 head {where}: no {CONFIG_FILE} in it")
    return p


def _weight_files(directory: Path) -> tuple[str, list[Path]]:
    """(kind "safetensors" | "bin", files) of a head directory; safetensors preferred.

    Raises:
        FileNotFoundError: none of model.safetensors, its index, pytorch_model.bin or its
            index. ValueError: an index that is not JSON with a ``weight_map``.
    """
    for kind, single, index in (("safetensors", SAFETENSORS_FILE, SAFETENSORS_INDEX),
                                ("bin", BIN_FILE, BIN_INDEX)):
        if (directory / single).is_file():
            return kind, [directory / single]
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{directory / index}: not a weight index ({exc})") from None
            files = [directory / n for n in names]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{directory / index}: shard {missing[0].name} is "
                                        "missing")
            return kind, files
    raise FileNotFoundError(f"EAGLE-3 head {directory}: no weights ({SAFETENSORS_FILE}, "
                            f"{SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX})")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``'s tensors, unpickled with ``weights_only=True`` (plain tensors
    and containers only: a checkpoint never runs code).

    Raises:
        ValueError: anything else in the file (named), or not a name -> tensor mapping.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses, named
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: refused: not a plain tensor checkpoint (read with "
                         f"weights_only=True, nothing in it runs): {first}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: refused: not a mapping of tensor names to tensors")
    return state


def _read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    kind, files = _weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if kind == "safetensors":
            from safetensors.torch import load_file

            part = load_file(str(f))
        else:
            part = _read_bin(f)
        state.update(part)
    return state, files


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from safetensors headers (no tensor read); None for .bin."""
    kind, files = _weight_files(directory)
    if kind != "safetensors":
        return None
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                shapes[name] = tuple(h.get_slice(name).get_shape())
    return shapes


def _layout(raw: dict) -> str:
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return "speculators"
    archs = raw.get("architectures") or []
    if any(a in SPECFORGE_ARCHITECTURES for a in archs):
        return "specforge"
    return "eagle"


def _parse_config(raw: dict, where: str) -> tuple[Eagle3Config, dict]:
    """(config, info) of a head ``config.json`` in any layout; ``where`` names the file.

    Raises:
        ValueError: naming the file and field of anything not supported or inconsistent.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    layout = _layout(raw)
    notes: list[str] = []

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{where}: field {field!r}: {why}")

    if layout == "speculators":
        kind = raw.get("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise refuse("speculators_model_type", f"{kind!r} is not an EAGLE-3 head")
        algo = (raw.get("speculators_config") or {}).get("algorithm", "eagle3")
        if algo != "eagle3":
            raise refuse("speculators_config.algorithm", f"{algo!r} is not 'eagle3'")
        src = raw.get("transformer_layer_config")
        if not isinstance(src, dict):
            raise refuse("transformer_layer_config", "missing (speculators layout)")
        src = {**_LLAMA_DEFAULTS, **src}  # written as a diff against LlamaConfig's defaults
        prefix = "transformer_layer_config."
        for flag, meaning in (("fc_norm", "per-layer norms before fc"),
                              ("norm_output", "the post-norm output fed back")):
            if raw.get(flag):
                raise refuse(flag, f"true ({meaning}) is not supported")
        if "norm_before_residual" not in raw:
            notes.append("norm_before_residual absent: speculators' default false (vLLM's "
                         "speculators adapter would assume true)")
        norm_before_residual = bool(raw.get("norm_before_residual", False))
        norm_before_fc = bool(raw.get("norm_before_fc", False))
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        ids_source = "config (capture-before, verbatim as vLLM reads speculators ids)"
        draft_vocab = raw.get("draft_vocab_size") or src["vocab_size"]
        target_hidden = raw.get("target_hidden_size")
    else:
        src = {**_LLAMA_DEFAULTS, **raw}
        prefix = ""
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            if raw.get(flag):
                raise refuse(flag, f"true is not part of the {layout} layout")
        if layout == "specforge":
            if raw.get("norm_output") is False:
                raise refuse("norm_output", "false (lm_head without the final norm) is not "
                                            "supported")
            if raw.get("tie_word_embeddings"):
                raise refuse("tie_word_embeddings", "true (SGLang would use the embedding as "
                                                    "lm_head) is not supported")
        norm_before_residual = norm_before_fc = False
        eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) \
            else {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids",
                      eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and layout == "specforge":
            # SGLang reads explicit ids as "output of layer X" and captures before X + 1.
            try:
                ids = [int(i) + 1 for i in ids]
            except (TypeError, ValueError):
                raise refuse("eagle_aux_hidden_state_layer_ids",
                             f"not a list of ints: {ids!r}") from None
            ids_source = "config (SGLang's output-of-layer ids, converted to capture-before +1)"
        else:
            ids_source = "config (capture-before, verbatim as vLLM reads them)"
        draft_vocab = raw.get("draft_vocab_size") or src["vocab_size"]
        target_hidden = raw.get("target_hidden_size")
    if ids is None:
        ids_source = "default (2, N // 2, N - 3) for the target's N layers"

    model_type = src.get("model_type", "llama")
    if model_type != "llama":
        raise refuse(prefix + "model_type", f"{model_type!r} is not supported (only llama "
                                            "layers)")
    if int(src["num_hidden_layers"]) != 1:
        raise refuse(prefix + "num_hidden_layers", f"{src['num_hidden_layers']}: only "
                                                   "one-layer heads are supported")
    if src.get("hidden_act", "silu") != "silu":
        raise refuse(prefix + "hidden_act", f"{src['hidden_act']!r} is not supported (silu)")
    for flag in ("attention_bias", "bias", "mlp_bias"):
        if src.get(flag):
            raise refuse(prefix + flag, "true is not supported (no biases)")
    rope = src.get("rope_parameters") or src.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise refuse(prefix + "rope_scaling", f"not an object: {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise refuse(prefix + "rope_scaling", f"rope type {rope_type!r} is not supported "
                                              "(default, llama3)")
    try:
        h, nh = int(src["hidden_size"]), int(src["num_attention_heads"])
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        config = Eagle3Config(
            hidden_size=h, vocab_size=int(src["vocab_size"]),
            draft_vocab_size=int(draft_vocab), n_heads=nh,
            n_kv_heads=int(src.get("num_key_value_heads") or nh),
            head_dim=int(src.get("head_dim") or h // nh),
            ffn_dim=int(src["intermediate_size"]),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
            rope_theta=float(rope.get("rope_theta", src.get("rope_theta"))),
            rope_scaling=scaling, rms_norm_eps=float(src["rms_norm_eps"]),
            aux_layers=None if ids is None else tuple(int(i) for i in ids),
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc)
    except KeyError as exc:
        raise ValueError(f"{where}: field {prefix}rope_scaling.{exc.args[0]!r} is "
                         "missing") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    info = {"layout": layout, "aux_layers_source": ids_source, "notes": notes}
    return config, info


def _normalise_names(state: dict, where: str) -> dict:
    """Tensor names as the head's (``layers.0.`` -> ``midlayer.``).

    Raises:
        ValueError: a tensor of a second layer (``layers.1.*``).
    """
    out = {}
    for name, value in state.items():
        if name.startswith("layers."):
            index, _, rest = name[len("layers."):].partition(".")
            if index != "0":
                raise ValueError(f"{where}: tensor {name!r}: only one-layer heads are "
                                 "supported")
            name = "midlayer." + rest
        out[name] = value
    return out


def _check_tensor_names(shapes: dict[str, tuple[int, ...]], config: Eagle3Config,
                        where: str) -> None:
    """Refuses missing, unexpected and wrongly shaped tensors (``shapes`` by head name).

    Raises:
        ValueError: naming the tensor and both shapes.
    """
    expected = config.expected_shapes("embed_tokens.weight" in shapes)
    optional = {"d2t", "t2d"}
    for name in shapes:
        if name not in expected:
            raise ValueError(f"{where}: unexpected tensor {name!r}")
    for name, shape in expected.items():
        if name not in shapes:
            if name in optional:
                continue
            raise ValueError(f"{where}: tensor {name!r} is missing")
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(shapes[name])}, the "
                             f"config needs {list(shape)}")
    if "d2t" not in shapes and config.draft_vocab_size != config.vocab_size:
        raise ValueError(f"{where}: tensor 'd2t' is missing and draft_vocab_size "
                         f"{config.draft_vocab_size} < vocab_size {config.vocab_size}")


def inspect_eagle3(path: str | os.PathLike | None, target_config=None
                   ) -> tuple[Eagle3Config, dict]:
    """Checks a head without loading its weights: the config (any layout), for safetensors
    every tensor's name and shape from the file headers, and with ``target_config`` (a
    `target_worker.ModelConfig`) that it fits that target (`check_fits`; what a service
    checks before any worker starts).

    Returns:
        ``(config, info)`` as `load_eagle3` (``aux_layers`` None when the config names none;
        ``embedding`` "own", "target", or None for a ``.bin`` head, whose tensors are not
        read here).

    Raises:
        FileNotFoundError: as `resolve_head_dir`, or no weights file.
        ValueError: naming the file and field or tensor (and both values for a misfit).
    """
    directory = resolve_head_dir(path)
    where = str(directory / CONFIG_FILE)
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: not readable JSON ({exc})") from None
    config, info = _parse_config(raw, where)
    shapes = _weight_shapes(directory)
    own = None
    if shapes is not None:
        shapes = _normalise_names(shapes, str(directory))
        _check_tensor_names(shapes, config, str(directory))
        own = "embed_tokens.weight" in shapes
    info["directory"] = str(directory)
    info["embedding"] = None if own is None else "own" if own else "target"
    if target_config is not None:
        try:
            check_fits(config, target_config, own)
        except ValueError as exc:
            raise ValueError(f"{directory}: {exc}") from None
    return config, info


def load_eagle3(path: str | os.PathLike | None, target_config=None
                ) -> tuple[Eagle3Head, dict]:
    """Loads an EAGLE-3 head in any supported layout (module docstring), float32, eval.

    Args:
        path: the head directory, or a config/weights file inside it; None:
            `DEFAULT_EAGLE3_HEAD`.
        target_config: the target's `target_worker.ModelConfig`: resolves the default
            ``aux_layers`` and runs `Eagle3Head.validate_against` (None: neither).

    Returns:
        ``(head, info)``: info is a dict with ``layout`` ("eagle", "speculators",
        "specforge"), ``directory``, ``weights`` (file names), ``aux_layers_source``,
        ``embedding`` ("own" or "target") and ``notes`` (list of str).

    Raises:
        FileNotFoundError: no such head, config or weights file.
        ValueError: naming the file and the field or tensor, with both values, for anything
            not supported or not matching (module docstring; `Eagle3Head.validate_against`).
    """
    config, info = inspect_eagle3(path)
    directory = Path(info["directory"])
    raw, files = _read_weights(directory)
    where = str(directory)
    state = _normalise_names(raw, where)
    _check_tensor_names({k: tuple(v.shape) for k, v in state.items()}, config, where)
    own = "embed_tokens.weight" in state
    head = Eagle3Head(config, own_embedding=own)
    values = {}
    for name, value in state.items():
        if name == "d2t":
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ValueError(f"{where}: tensor 'd2t' has dtype {value.dtype}, must be "
                                 "integer offsets")
            value = value.to(torch.long)
        elif name == "t2d":
            if value.dtype.is_floating_point:
                raise ValueError(f"{where}: tensor 't2d' has dtype {value.dtype}, must be "
                                 "bool")
            if value.dtype != torch.bool and bool(((value != 0) & (value != 1)).any()):
                raise ValueError(f"{where}: tensor 't2d' holds values other than 0/1")
            value = value.to(torch.bool)
        elif value.dtype.is_floating_point:
            value = value.float()
        else:
            raise ValueError(f"{where}: tensor {name!r} has dtype {value.dtype}, must be "
                             "floating point")
        values[name] = value
    if "d2t" in values and "t2d" not in values:  # derived (vLLM reads no t2d either)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        mapped = torch.arange(config.draft_vocab_size) + values["d2t"]
        t2d[mapped.clamp(0, config.vocab_size - 1)] = True
        values["t2d"] = t2d
        info["notes"].append("t2d absent: derived from d2t")
    missing, unexpected = head.load_state_dict(values, strict=False)
    assert not unexpected, unexpected  # _check_tensor_names refused them
    try:
        head.check()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if target_config is not None:
        try:
            head.validate_against(target_config)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        head.resolve_aux_layers(target_config.n_layers)
    info.update(weights=[f.name for f in files], embedding="own" if own else "target")
    return head.eval(), info


# ---- drafting ----


def default_head_dtype() -> torch.dtype:
    """The dtype of a drafting head's matmul weights unless told: bfloat16 where the CPU
    computes bfloat16 dot products natively (`target_worker.loader.cpu_has_bf16_dot`; the
    head always drafts on the CPU), else float32.

    Why (``python scripts/eagle3_draft_cost.py``, SmolLM2-shaped heads, 1 thread, Zen 4 with
    AVX512-BF16 and no AMX, beside a busy training job, medians of 9 interleaved rounds,
    2026-12-03): a drafted token cost 1.8 / 2.4 / 3.5 / 5.0 ms in bfloat16 against 3.5 / 4.5
    / 7.2 / 11.2 ms in float32 for draft vocabularies of 4k / 8k / 16k / 32k (oneDNN's
    reordered bfloat16 weights, `_Linear`), and ingesting a step's 1-4 rows 2.2-3.3 against
    3.1-5.6 ms. Without native bfloat16 a bfloat16 matmul converts every weight first, so
    float32 there.
    """
    from target_worker.loader import cpu_has_bf16_dot

    return torch.bfloat16 if cpu_has_bf16_dot() else torch.float32


def resolve_head_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    """``dtype`` as a torch dtype: None or ``"auto"`` is `default_head_dtype`.

    Raises:
        ValueError: naming the value unless float32, bfloat16 or float16.
    """
    if dtype is None or dtype == "auto":
        return default_head_dtype()
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                 "float16": torch.float16}.get(dtype, dtype)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: the EAGLE-3 head's weights must be auto, float32, bfloat16 "
                         f"or float16, got {dtype!r}")
    return dtype


class Eagle3Session:
    """One request's EAGLE-3 drafting state: the head's KV cache over committed positions.

    Implements `Drafter` as `drafter_worker.eagle.EagleSession` does: ``propose(history,
    target_hidden, max_len)`` takes the target's rows (``[rows, 3 * Ht]``, the layers of
    `hidden_layers` side by side in ascending order) committed since its previous call
    (extending its cache) or every row of the history (``len(history) - 1`` rows: it starts
    over); after drafting the cache is rolled back to the committed positions.

    Raises (from ``propose``):
        NeedsResync: rows that neither continue the session nor cover the whole history.
        ValueError: rows of another width (the target is not capturing `hidden_layers`).
    """

    wants_hidden = True

    def __init__(self, drafter: Eagle3Drafter, sampling: DraftSamplingParams | None = None,
                 seed: int = 0):
        self.drafter = drafter
        # Drafts are the head's argmax whatever the sampling (see `_draft`): the request's
        # sampling and seed are taken for the `Drafter` session interface and not used.
        del sampling, seed
        self.max_draft_len = drafter.max_draft_len
        self.cache = drafter.head.new_cache()
        self.tokens: list[int] = []  # history whose pairs (row t, x_{t+1}) are in the cache
        self._hidden: torch.Tensor | None = None  # pre-norm output at the last pair, [1, H]

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers whose rows this session reads (capture-before, ascending)."""
        return self.drafter.hidden_layers

    @property
    def capabilities(self) -> DrafterCapabilities:
        return self.drafter.capabilities

    def reset(self) -> None:
        self.cache.truncate(0)
        self.tokens = []
        self._hidden = None

    def _ingest(self, history: Sequence[int], rows: torch.Tensor) -> None:
        head = self.drafter.head
        n = len(history)
        width = 3 * head.config.target_hidden_size
        if rows.dim() != 2 or rows.shape[1] != width:
            raise ValueError(f"hidden rows must be [rows, {width}] (target layers "
                             f"{list(self.hidden_layers)} side by side: "
                             f"Decoder.set_capture_layers), got {tuple(rows.shape)}")
        try:
            if not rows_continue(self.tokens, history, rows.shape[0]):
                self.reset()  # every row of the history: start over
        except NeedsResync:
            self.reset()
            raise
        if rows.shape[0] == 0:
            return
        start = self.cache.seq_len  # == len(self.tokens) - 1, or 0 when fresh
        nxt = torch.as_tensor(list(history[start + 1: n]), dtype=torch.long)
        with torch.inference_mode():
            out = head.step(head.encode_target(rows.float()), nxt, self.cache)
        self._hidden = out[-1:]
        self.tokens = list(history)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """See the class docstring and `Drafter`. Empty block when there are no rows yet."""
        return self.propose_ahead(history, target_hidden, (), max_len)

    @torch.inference_mode()
    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: ingests the committed rows as `propose` does,
        then runs the head over ``assumed`` on its own outputs and drafts after them; the
        cache is rolled back to the committed positions afterwards."""
        if target_hidden is not None:
            self._ingest(history, target_hidden)
        elif list(history) != self.tokens:
            self.reset()
            return DraftBlock.empty()
        return self._draft(max_len, assumed)

    def _draft(self, max_len: int, assumed: Sequence[int] = ()) -> DraftBlock:
        """Up to ``max_len`` drafts after the committed tokens (+ ``assumed``)."""
        k = min(max_len, self.max_draft_len)
        if k <= 0 or self._hidden is None:
            return DraftBlock.empty()
        drafter, head = self.drafter, self.drafter.head
        vocab_ids = drafter.vocab_ids
        committed = self.cache.seq_len
        hidden = self._hidden
        tokens, dists = [], []
        reach = 1.0  # the head's estimate that every draft so far is accepted
        try:
            for token in assumed:
                hidden = head.step(hidden, torch.tensor([int(token)]), self.cache)
            for i in range(k):
                # The head's argmax at every temperature, reported as a point mass: the rule
                # then draws each position as plain sampling would (one uniform, inverse
                # CDF) and accepts iff the draw is the draft, so a seeded request's tokens
                # never depend on whether, how far or how late it drafted
                # (`specd_core.rule`); accepted with probability p(draft).
                logits = head.draft_logits(hidden)[0]
                j = int(torch.argmax(logits))
                reach *= float(torch.softmax(logits.float(), 0)[j])
                if reach < drafter.min_confidence:
                    break
                token = int(vocab_ids[j])
                dist = DraftDist.deterministic(token)
                tokens.append(token)
                dists.append(dist)
                if token in drafter.stop_token_ids or i == k - 1:
                    break
                hidden = head.step(hidden, torch.tensor([token]), self.cache)
        finally:
            self.cache.truncate(committed)  # roll back to the committed prefix
        return DraftBlock(tokens, dists)


class Eagle3Drafter:
    """EAGLE-3 drafter (see the module docstring), with per-request `Eagle3Session` s.

    The target must return, as its hidden rows, the residual streams entering
    `hidden_layers` (`target_worker.model.Decoder.set_capture_layers(drafter.hidden_layers)`;
    `coordinator.speculative.speculative_decode_with` sets it in process).

    Args:
        head: a loaded `Eagle3Head` with resolved ``aux_layers``.
        embed_weight: the target's embedding ``[V, H]`` (shared, not copied), for a head
            without its own embeddings; a head whose own table equals it drops its copy and
            shares it too (so `Eagle3Head.save` then writes none).
        max_draft_len: most tokens one proposal drafts.
        stop_token_ids: a drafted stop token ends the block.
        min_confidence: dynamic draft length (EAGLE-2): a block stops before the position
            where the product of the head's top probabilities falls below it; 0: off.
        dtype: the head's matmul weights (`Eagle3Head.set_weight_dtype`, applied to
            ``head``): ``"float32"``, ``"bfloat16"`` (or a torch dtype), or None / ``"auto"``:
            `default_head_dtype`. Activations, norms and the softmax stay float32 either way.

    Raises:
        ValueError: unresolved ``aux_layers``, a head without embeddings and no
            ``embed_weight`` (or one of another shape), max_draft_len < 1, min_confidence
            outside [0, 1], an unknown dtype.
    """

    wants_hidden = True

    def __init__(self, head: Eagle3Head, embed_weight: torch.Tensor | None = None,
                 max_draft_len: int = 6, stop_token_ids: Sequence[int] = (),
                 min_confidence: float = 0.0, dtype: str | torch.dtype | None = None):
        if head.config.aux_layers is None:
            raise ValueError("aux_layers: unresolved; load the head with the target's config "
                             "(load_eagle3(path, target_config)) or resolve_aux_layers(n)")
        if (head.has_own_embedding and embed_weight is not None
                and tuple(embed_weight.shape) == tuple(head.embed_tokens.weight.shape)
                and torch.equal(head.embed_tokens.weight, embed_weight.detach().float())):
            head.embed_tokens = None  # a copy of the target's table (speculators saves one)
        if not head.has_own_embedding:
            if embed_weight is None:
                raise ValueError("embed_tokens: the head has none; pass the target's "
                                 "embedding (embed_weight)")
            head.set_target_embedding(embed_weight)
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.head = head.set_weight_dtype(resolve_head_dtype(dtype)).eval()
        self.vocab_ids = head.vocab_ids
        self.max_draft_len = int(max_draft_len)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.min_confidence = float(min_confidence)
        self._default = Eagle3Session(self)

    @classmethod
    def for_target(cls, decoder, path: str | os.PathLike | None = None, **kwargs
                   ) -> Eagle3Drafter:
        """A drafter for ``decoder`` (a `target_worker.Decoder`): the head at ``path``
        (None: `DEFAULT_EAGLE3_HEAD`) validated against its config, sharing its embedding
        when the head has none. ``kwargs``: as the constructor.

        Raises:
            FileNotFoundError, ValueError: as `load_eagle3` and the constructor.
        """
        head, _ = load_eagle3(path, decoder.config)
        return cls(head, decoder.embed_tokens.weight, **kwargs)

    @classmethod
    def for_model(cls, model: str | os.PathLike | None = None,
                  path: str | os.PathLike | None = None, **kwargs) -> Eagle3Drafter:
        """A drafter for the target ``model`` (a `target_worker.load_model` source) without
        loading it: its config (`target_worker.loader.model_config`) and, for a head without
        embeddings, its embedding table only (`drafter_worker.eagle.load_target_head_weights`).

        Raises:
            FileNotFoundError, ValueError: as `load_eagle3`, the model loader and the
                constructor.
        """
        from target_worker.loader import model_config

        from .eagle import load_target_head_weights

        head, _ = load_eagle3(path, model_config(model))
        embed = None if head.has_own_embedding else load_target_head_weights(model)[0]
        return cls(head, embed, **kwargs)

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target layers the head reads (capture-before, ascending): what the target's
        ``set_capture_layers`` must be given."""
        return tuple(self.head.config.aux_layers or ())

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Conditions on hidden rows, samples its drafts, one session per request."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len,
                                   sessions=True, samples=False,
                                   hidden_layers=self.hidden_layers)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0
                ) -> Eagle3Session:
        """A fresh per-request session (own KV cache, own seeded generator)."""
        return Eagle3Session(self, sampling, seed)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """`Drafter.propose` on the implicit greedy session."""
        return self._default.propose(history, target_hidden, max_len)


class SuffixThenEagle3:
    """Suffix decoding's draft when it has one, EAGLE-3's otherwise (``--drafter
    eagle3+suffix``), as `drafter_worker.eagle.LookupThenEagle` combines prompt lookup with
    EAGLE-1.

    The EAGLE-3 session ingests every hidden row either way, so its KV cache stays current;
    its draft loop runs only when the suffix trees propose nothing. Suffix drafts are point
    masses and so are EAGLE-3's, so mixing them per step stays lossless and coupled.
    Finished outputs go to the suffix drafter's cross-request cache (`remember`).
    """

    wants_hidden = True

    def __init__(self, suffix, eagle: Eagle3Drafter, _suffix=None, _eagle=None):
        self.suffix = suffix
        self.eagle = eagle
        self.max_draft_len = max(getattr(suffix, "max_draft_len", 0) or 0,
                                 getattr(eagle, "max_draft_len", 0) or 0)
        self._suffix = _suffix if _suffix is not None else suffix
        self._eagle = _eagle if _eagle is not None else eagle

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """EAGLE-3's target layers (`Eagle3Drafter.hidden_layers`)."""
        return self.eagle.hidden_layers

    @property
    def capabilities(self) -> DrafterCapabilities:
        """EAGLE-3's, with the longer cap and the suffix drafter's cross-request cache."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len or None,
                                   sessions=True, samples=False, hidden_layers=self.hidden_layers,
                                   remembers=self.suffix.capabilities.remembers)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0,
                partition: str = "") -> SuffixThenEagle3:
        """A per-request combined drafter: its own suffix session (``partition``'s cache)
        and EAGLE-3 session."""
        return SuffixThenEagle3(self.suffix, self.eagle,
                                _suffix=self.suffix.session(partition=partition),
                                _eagle=self.eagle.session(sampling, seed))

    def remember(self, outputs, partitions=None) -> None:
        """Finished outputs for the suffix drafter's cache (`SuffixDrafter.remember`)."""
        self.suffix.remember(outputs, partitions)

    def stats(self) -> dict:
        """The suffix drafter's counters (`SuffixDrafter.stats`)."""
        return self.suffix.stats()

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        block = self._suffix.propose(history, None, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return self._eagle.propose(history, target_hidden, max_len)

    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: the suffix drafter's run-ahead when it drafts,
        else EAGLE-3's (the EAGLE-3 session ingests the committed rows either way)."""
        block = propose_ahead(self._suffix, history, None, assumed, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return propose_ahead(self._eagle, history, target_hidden, assumed, max_len)
