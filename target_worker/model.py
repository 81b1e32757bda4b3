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

import logging
import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from .attention import (  # noqa: F401 (re-exported: the forward's public names live here too)
    Attention,
    AttentionPlans,
    QueryChunk,
    Rows,
    Segment,
    _round_up,
    _tree_sum,
    apply_rope,
    query_chunks,
    rope_tables,
)
from .config import ModelConfig
from .invariant import (
    one_thread,
    plan_bmm,
    plan_linear,
    planned,
    prepare_linear,
)
from .kv_cache import DEFAULT_CACHE_CAPACITY, KEY_BLOCK, KvCache
from .layers import (  # noqa: F401 (re-exported)
    FAST_LINEAR_MIN_ROWS,
    Linear,
    RMSNorm,
    SwiGLU,
    _linear,
    fast_linear,
    swiglu,
)

__all__ = ["Decoder", "KvCache", "KEY_BLOCK", "describe_forward"]


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
        token_of = torch.arange(n, device=x.device).repeat_interleave(self.top_k)
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

    #: `target_worker.native` runs this class's forward (read from the class's own
    #: ``__dict__``, so subclasses such as TP shards, whose forward differs, do not inherit it).
    NATIVE_FORWARD = True

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
                       dtype=self.kv_dtype, device=self.device)

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
            why the native forward is not used. On a CUDA device (planned over CPU thread
            count 1 only) also ``"cublas"`` (`target_worker.cuda.configure_cublas`, applied
            first) and ``"decode_verify"``, the mismatches of
            `target_worker.cuda.decode_verify_mismatches` (empty: none; any is logged).
        """
        threads = tuple(dict.fromkeys(threads or (torch.get_num_threads(),)))
        from . import native

        on_cuda = self.device.type == "cuda"
        if on_cuda:  # CPU threads do not change a CUDA kernel: prove each shape once
            from .cuda import configure_cublas

            threads, cublas = (1,), configure_cublas()

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
        if on_cuda:
            from .cuda import decode_verify_mismatches

            report["cublas"] = cublas
            report["decode_verify"] = decode_verify_mismatches(self)
            if report["decode_verify"]:
                logging.getLogger(__name__).warning(
                    "batch invariance on %s: decode and verify rows differ: %s",
                    self.device, "; ".join(report["decode_verify"]))
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
    def device(self) -> torch.device:
        """The device the weights, KV caches and every forward's tensors are on (the CPU, or
        a CUDA device after ``Decoder.to("cuda")``). Logits and hidden rows come back on it."""
        return self.norm.weight.device

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
        # Checked where the ids are (a list's on the host: no device sync), then moved.
        lo, hi = int(idx.min()), int(idx.max())
        vocab = self.config.vocab_size
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        device = self.device
        return idx if idx.device == device else idx.to(device, non_blocking=True)

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[end - start, 1, head_dim]`` for positions ``[start, end)``."""
        if end > self._cos.shape[0] or self._cos.device != self.device:  # grow geometrically
            size = min(max(end, 2 * self._cos.shape[0], 256), self.config.max_seq_len)
            c = self.config
            # A whole number of 256-position rows on one thread: a position's sin/cos are
            # computed by the same (vector) code whatever the table's size.
            with one_thread():
                cos, sin = rope_tables(c.head_dim, c.rope_theta, _round_up(size, 256),
                                       c.rope_scaling)
            self._cos = cos.to(device=self.device, dtype=self.dtype)
            self._sin = sin.to(device=self.device, dtype=self.dtype)
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
                torch.arange(seg.hi - 1, seg.hi, device=device) if last
                else torch.arange(seg.lo, seg.hi, device=device)
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
