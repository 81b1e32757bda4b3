"""The EAGLE-3 head's modules: `Eagle3Head` (fc, one decoder layer, the draft-vocabulary
``lm_head``), its KV cache and layers, its forward for drafting and for training, and
`Eagle3Head.save` in the speculators layout."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from target_worker.model import RMSNorm, apply_rope, rope_tables

from .config import (
    CONFIG_FILE,
    HEAD_MAX_SEQ_LEN,
    RECIPE_FILE,
    SAFETENSORS_FILE,
    Eagle3Config,
    _check_vocab_map,
    _speculators_config,
    check_fits,
)


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
