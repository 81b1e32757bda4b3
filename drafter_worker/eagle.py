"""EAGLE-1 drafter: one decoder layer on the target's own hidden states.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", arXiv 2401.15077) drafts at the feature level. For every committed position
``t`` the head takes the target's final-norm hidden state ``h_t`` (the input of the target's
LM head) and the embedding of the next token ``x_{t+1}`` (the target's frozen embedding
table), fuses them with a linear layer on the concatenation ``[2H -> H]``, runs one Llama
decoder layer (the target's own `Block`, over its own one-layer `KvCache`) and predicts
``h_{t+1}``; the target's frozen LM head turns the prediction into next-token logits.
Drafting k tokens feeds the head its own predicted features autoregressively.

The LM head is restricted to a draft vocabulary (the most frequent tokens of the training
data, as in FR-Spec, arXiv 2502.14856, and EAGLE-3): on a 2-core CPU the full
49152-row head per drafted token would cost ~20% of a target forward. A token outside the
draft vocabulary can never be drafted; ``q`` is honest over the subset.

Dynamic draft length (EAGLE-2, arXiv 2406.16858): with ``min_confidence`` > 0 a block stops
before the position where the product of the head's top probabilities (its own estimate that
the whole block so far is accepted) falls below the threshold, so unlikely drafts are not
verified. The decision uses only the distribution at that position, never the drawn token.

Honest ``q`` (what the rejection rule needs to stay lossless): at temperature 0 the draft is
the argmax, reported as a point mass; at temperature > 0 each token is sampled from the
head's softmax after the request's temperature / top-k / top-p (and an own top-`SAMPLE_CAP`
cut), and exactly that renormalised distribution is reported.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specd_core.draft import DraftBlock, DraftDist, DrafterCapabilities, propose_ahead
from specd_core.sampling import DraftSamplingParams
from target_worker.config import ModelConfig
from target_worker.model import (
    Block,
    KvCache,
    Linear,
    Rows,
    Segment,
    apply_rope,
    fast_linear,
    query_chunks,
    rope_tables,
)

#: Most support entries one sampled draft position reports (an own top-k applied before
#: sampling, so ``q`` stays exact while blocks stay small on the wire).
SAMPLE_CAP = 64

#: Directory of the heads shipped with the package.
HEADS_DIR = Path(__file__).resolve().parent / "heads"

#: The head shipped for the default target (SmolLM2-135M-Instruct).
DEFAULT_HEAD = HEADS_DIR / "smollm2-135m-instruct.safetensors"


class NeedsResync(ValueError):
    """The hidden rows given do not continue what the session holds: the caller must resend
    the whole history with every hidden row (the gRPC service answers ``resync``)."""


def rows_continue(held: Sequence[int], history: Sequence[int], rows: int) -> bool:
    """Whether ``rows`` hidden rows for ``history`` continue a session that holds the pairs of
    ``held`` (the committed rows since its previous call: True), or are every row of the
    history but the pending anchor's (``len(history) - 1``: False, start over).

    Raises:
        NeedsResync: neither (rows were lost, or the history is another one).
    """
    n = len(history)
    if held and len(held) <= n and rows == n - len(held) and list(history[: len(held)]) == \
            list(held):
        return True
    if rows != n - 1:
        raise NeedsResync(f"{rows} hidden rows neither continue the {len(held)} committed "
                          f"tokens nor cover the {n}-token history")
    return False


@dataclass(frozen=True)
class EagleConfig:
    """Shape of an EAGLE head.

    Attributes:
        hidden_size: the target's hidden width H (features and embeddings).
        vocab_size: the target's vocabulary size (embedding / LM-head rows).
        n_heads, n_kv_heads, head_dim: the decoder layer's attention (grouped-query).
        ffn_dim: the decoder layer's SwiGLU width.
        rope_theta, rms_norm_eps: as in the target.
        draft_vocab_size: rows of the restricted LM head (<= vocab_size).

    Raises:
        ValueError: naming a non-positive size or an inconsistent head layout.
    """

    hidden_size: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    draft_vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim", "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"EagleConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} not divisible by n_kv_heads "
                             f"{self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} > vocab_size "
                             f"{self.vocab_size}")

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, ffn_dim: int | None = None
                   ) -> EagleConfig:
        """A head shaped like one layer of ``target_config`` (a `target_worker.ModelConfig`)."""
        c = target_config
        return cls(hidden_size=c.hidden_size, vocab_size=c.vocab_size, n_heads=c.n_heads,
                   n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                   ffn_dim=ffn_dim or c.ffn_dim, draft_vocab_size=min(draft_vocab_size,
                                                                      c.vocab_size),
                   rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps)


#: Context bound of a head's KV cache (it grows on demand up to this; the target's own
#: context is the real limit).
HEAD_MAX_SEQ_LEN = 1 << 20

#: Head module names (the target's `Block` inside) -> names in head files (the flat names the
#: shipped heads were written with; the file format is unchanged).
_FILE_NAMES = {
    "layer.attn_norm.weight": "attn_norm.weight",
    "layer.attn.wqkv.weight": "wqkv.weight",
    "layer.attn.wo.weight": "wo.weight",
    "layer.ffn_norm.weight": "ffn_norm.weight",
    "layer.ffn.w_gate_up.weight": "w_gate_up.weight",
    "layer.ffn.w_down.weight": "w_down.weight",
}
_MODULE_NAMES = {v: k for k, v in _FILE_NAMES.items()}


class EagleHead(nn.Module):
    """The trainable EAGLE-1 head (fc on ``[feature, embedding]`` + one decoder layer).

    The target's embedding table and LM head are not parameters of the head: they are passed
    in (frozen, shared with the target) and only ``draft_vocab`` (int64 ``[V']``, the token
    ids of the restricted LM head's rows) is stored with it.

    The decoder layer *is* a `target_worker.model.Block` (the target's RMSNorm, RoPE,
    grouped-query attention over a `KvCache`, SwiGLU FFN), so drafting runs the target's own
    layer code; `fc` is a `target_worker.model.Linear` ``[2H -> H]`` with bias.
    """

    def __init__(self, config: EagleConfig):
        super().__init__()
        c = self.config = config
        h = c.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = Block(self.layer_config)
        self.register_buffer("draft_vocab", torch.arange(c.draft_vocab_size, dtype=torch.long))
        self._cos = torch.empty(0, 1, c.head_dim)
        self._sin = torch.empty(0, 1, c.head_dim)

    @property
    def layer_config(self) -> ModelConfig:
        """The one-layer `ModelConfig` of the head's `Block`."""
        c = self.config
        return ModelConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, n_layers=1,
                           n_heads=c.n_heads, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                           ffn_dim=c.ffn_dim, max_seq_len=HEAD_MAX_SEQ_LEN,
                           rope_theta=c.rope_theta, rms_norm_eps=c.rms_norm_eps)

    def new_cache(self, capacity: int = 256) -> KvCache:
        """An empty float32 KV cache for the head (a one-layer `KvCache`, grows on demand)."""
        c = self.config
        return KvCache(1, c.n_kv_heads, c.head_dim, capacity, HEAD_MAX_SEQ_LEN)

    # ---- construction / persistence ----

    @classmethod
    def random(cls, config: EagleConfig, seed: int = 0,
               draft_vocab: torch.Tensor | None = None) -> EagleHead:
        """A head with small random weights (``torch.Generator(seed)``): fc starts as the
        identity on the feature half, so an untrained head predicts "same feature again".

        Raises:
            ValueError: ``draft_vocab`` of the wrong length, duplicated, or out of range.
        """
        head = cls(config)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in head.named_parameters():
                if "norm" in name:
                    continue
                if name.endswith("bias"):
                    p.zero_()
                    continue
                std = 1.0 / math.sqrt(p.shape[1])
                if name.endswith(("wo.weight", "w_down.weight")):
                    std *= 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
            h = config.hidden_size
            head.fc.weight[:, :h] += torch.eye(h)
        if draft_vocab is not None:
            head.set_draft_vocab(draft_vocab)
        return head

    def set_draft_vocab(self, ids: torch.Tensor | Sequence[int]) -> None:
        """Sets the restricted LM head's token ids (int64 ``[draft_vocab_size]``).

        Raises:
            ValueError: wrong length, duplicates, or an id outside the target vocabulary.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        c = self.config
        if ids.numel() != c.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {ids.numel()} ids, config says "
                             f"{c.draft_vocab_size}")
        if ids.unique().numel() != ids.numel():
            raise ValueError("draft vocabulary has duplicate token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"draft vocabulary ids must be in [0, {c.vocab_size})")
        self.draft_vocab = ids.clone()

    def save(self, path: str | os.PathLike, metadata: dict | None = None) -> None:
        """Writes the head as float16 safetensors with its config (and ``metadata``, e.g. the
        training recipe) in the file's metadata; the draft vocabulary stays int64."""
        from safetensors.torch import save_file

        state = {_FILE_NAMES.get(k, k): (v.half() if v.is_floating_point() else v).contiguous()
                 for k, v in self.state_dict().items()}
        meta = {"eagle_config": json.dumps(asdict(self.config))}
        if metadata:
            meta["recipe"] = json.dumps(metadata)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(state, str(path), metadata=meta)

    @classmethod
    def load(cls, path: str | os.PathLike) -> EagleHead:
        """Loads a head written by `save` (weights upcast to float32).

        Raises:
            FileNotFoundError: no such file. ValueError: not an EAGLE head file.
        """
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"EAGLE head not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "eagle_config" not in meta:
            raise ValueError(f"{path} is not an EAGLE head (no eagle_config metadata)")
        head = cls(EagleConfig(**json.loads(meta["eagle_config"])))
        state = {_MODULE_NAMES.get(k, k): (v.float() if v.is_floating_point() else v)
                 for k, v in load_file(str(path)).items()}
        head.load_state_dict(state)
        return head.eval()

    # ---- math shared by training and drafting ----

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin ``[end - start, 1, head_dim]`` (`target_worker.model.rope_tables`)."""
        if end > self._cos.shape[0]:
            size = max(end, 2 * self._cos.shape[0], 256)
            cos, sin = rope_tables(self.config.head_dim, self.config.rope_theta, size)
            self._cos, self._sin = cos[:, None, :], sin[:, None, :]
        return self._cos[start:end], self._sin[start:end]

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """Training forward over whole sequences (causal, positions from 0).

        Args:
            features: float32 ``[B, T, H]`` target hidden states ``h_t``.
            next_embeds: float32 ``[B, T, H]`` embeddings of ``x_{t+1}``.

        Returns:
            float32 ``[B, T, H]``: the predicted ``h_{t+1}`` for every ``t``.
        """
        return self.forward_unrolled(features, next_embeds, 1)[0]

    def forward_unrolled(self, features: torch.Tensor, next_embeds: torch.Tensor,
                         steps: int) -> list[torch.Tensor]:
        """Training forward that also replays drafting's later steps ("training-time test",
        EAGLE-3, arXiv 2503.01840, section 3.3).

        Pass 0 is `forward`. Pass ``j`` feeds, at position ``p``, the previous pass's
        prediction for ``h_p`` (made at ``p - 1``, detached) instead of the true ``h_p``,
        and attends exactly as draft step ``j + 1`` from anchor ``p - j`` does: to pass 0's
        keys at positions ``<= p - j`` (the committed prefix) and to pass ``i``'s key at
        ``p - j + i`` for ``1 <= i <= j`` (the earlier drafted positions).

        Args:
            features, next_embeds: as in `forward`.
            steps: passes (>= 1).

        Returns:
            ``steps`` float32 ``[B, T, H]`` predictions of ``h_{p+1}``; in pass ``j`` only
            positions ``p >= j`` are meaningful.
        """
        c = self.config
        b, t, h = features.shape
        cos, sin = self._rope(0, t)
        group = c.n_heads // c.n_kv_heads
        pos = torch.arange(t)
        layer = self.layer
        keys, values, outs = [], [], []
        inputs = features
        for j in range(steps):
            # The Block's own weights and pieces; attention is spelled out here because
            # training has no cache and pass j > 0 needs its own mask.
            x = self.fc(torch.cat((inputs, next_embeds), -1))
            qkv = layer.attn.wqkv(layer.attn_norm(x)).view(b, t, c.n_heads + 2 * c.n_kv_heads,
                                                           c.head_dim)
            q = apply_rope(qkv[:, :, : c.n_heads], cos, sin).transpose(1, 2)
            k = apply_rope(qkv[:, :, c.n_heads: c.n_heads + c.n_kv_heads], cos,
                           sin).transpose(1, 2)
            v = qkv[:, :, c.n_heads + c.n_kv_heads:].transpose(1, 2)
            keys.append(k.repeat_interleave(group, dim=1))
            values.append(v.repeat_interleave(group, dim=1))
            if j == 0:
                o = F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
            else:
                blocks = [pos[None, :] <= (pos - j)[:, None]]
                blocks += [pos[None, :] == (pos - j + i)[:, None] for i in range(1, j + 1)]
                o = F.scaled_dot_product_attention(q, torch.cat(keys, 2),
                                                   torch.cat(values, 2),
                                                   attn_mask=torch.cat(blocks, 1))
            x = x + layer.attn.wo(o.transpose(1, 2).reshape(b, t, c.n_heads * c.head_dim))
            out = x + layer.ffn(layer.ffn_norm(x))
            outs.append(out)
            # Next pass: position p gets this pass's prediction made at p - 1.
            inputs = torch.cat((out.new_zeros(b, 1, h), out[:, :-1].detach()), 1)
        return outs

    @torch.inference_mode()
    def step(self, features: torch.Tensor, next_embeds: torch.Tensor,
             cache: KvCache) -> torch.Tensor:
        """Drafting forward: ``n`` new positions appended at ``cache.seq_len``, through the
        target's `Block` (one layer over the head's `new_cache`).

        Args:
            features: float32 ``[n, H]``; next_embeds: float32 ``[n, H]``.
            cache: written at positions ``[seq_len, seq_len + n)``; ``seq_len`` grows by n.

        Returns:
            float32 ``[n, H]`` predicted next features.
        """
        n = features.shape[0]
        start, end = cache.seq_len, cache.seq_len + n
        cache.reserve(end)
        x = self.fc(torch.cat((features, next_embeds), -1))
        cos, sin = self._rope(start, end)
        c = self.config
        cache.zero_tail(end)
        chunks = query_chunks(0, n, start, c.n_heads // c.n_kv_heads, None)
        out = self.layer(x, 0, Rows(cos, sin, [Segment(0, n, start, cache, chunks)]))
        cache.advance(n)
        return out


def draft_distribution(logits: torch.Tensor, sampling: DraftSamplingParams
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution a sampled draft position is drawn from.

    Args:
        logits: float32 ``[V']`` over the draft vocabulary.

    Returns:
        ``(indices int64 [s], probs float64 [s])``: the support (indices into ``logits``)
        after temperature, top-k (capped at `SAMPLE_CAP`) and top-p, renormalised; sorted
        by decreasing probability.
    """
    k = min(sampling.top_k or SAMPLE_CAP, SAMPLE_CAP, logits.numel())
    values, idx = torch.topk(logits.double() / sampling.temperature, k)
    probs = torch.softmax(values, 0)
    if sampling.top_p < 1.0:
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = torch.cumsum(probs, 0) - probs
        keep = before < sampling.top_p
        probs, idx = probs[keep], idx[keep]
        probs = probs / probs.sum()
    return idx, probs


class EagleSession:
    """One request's EAGLE drafting state: the head's KV cache over committed positions.

    Implements `Drafter`. ``propose(history, target_hidden, max_len)`` accepts, for the same
    request, either the hidden rows committed since its previous call (``len(history) -
    len(previous history)`` rows: it extends its cache) or every row of the history
    (``len(history) - 1`` rows: it starts over). After drafting, the cache is rolled back to
    the committed positions, so the next call continues from exactly the state a fresh
    session would reach on the same committed prefix.

    Raises (from ``propose``):
        NeedsResync: rows that neither continue the session nor cover the whole history.
    """

    wants_hidden = True

    def __init__(self, drafter: EagleDrafter, sampling: DraftSamplingParams | None = None,
                 seed: int = 0):
        self.drafter = drafter
        self.sampling = sampling or DraftSamplingParams()
        self.generator = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
        self.max_draft_len = drafter.max_draft_len
        self.cache = drafter.head.new_cache()
        self.tokens: list[int] = []  # history whose pairs (h_t, x_{t+1}) are in the cache
        self._feature: torch.Tensor | None = None  # predicted feature after the last pair

    def reset(self) -> None:
        self.cache.truncate(0)
        self.tokens = []
        self._feature = None

    def _ingest(self, history: Sequence[int], rows: torch.Tensor) -> None:
        n = len(history)
        if rows.dim() != 2 or rows.shape[1] != self.drafter.head.config.hidden_size:
            raise ValueError(f"hidden rows must be [rows, {self.drafter.head.config.hidden_size}]"
                             f", got {tuple(rows.shape)}")
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
        out = self.drafter.head.step(rows.float(), self.drafter.embed(nxt), self.cache)
        self._feature = out[-1:]
        self.tokens = list(history)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """See the class docstring and `Drafter`. Empty block when there are no rows yet."""
        return self.propose_ahead(history, target_hidden, (), max_len)

    @torch.inference_mode()
    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: ingests the committed rows as `propose` does,
        then runs the head over ``assumed`` on its own predicted features (the target's rows
        for those positions do not exist yet) and drafts after them. The cache is rolled
        back to the committed positions afterwards, so the next call with the real rows
        continues exactly as without this one."""
        if target_hidden is not None:
            self._ingest(history, target_hidden)
        elif list(history) != self.tokens:
            self.reset()
            return DraftBlock.empty()
        return self._draft(max_len, assumed)

    def _draft(self, max_len: int, assumed: Sequence[int] = ()) -> DraftBlock:
        """Up to ``max_len`` drafts after the committed tokens (+ ``assumed``)."""
        k = min(max_len, self.max_draft_len)
        if k <= 0 or self._feature is None:
            return DraftBlock.empty()
        drafter = self.drafter
        committed = self.cache.seq_len
        feature = self._feature
        tokens, dists = [], []
        reach = 1.0  # the head's estimate that every draft so far is accepted
        try:
            for token in assumed:
                feature = drafter.head.step(
                    feature, drafter.embed(torch.tensor([int(token)])), self.cache)
            for i in range(k):
                logits = drafter.draft_logits(feature)[0]
                if self.sampling.temperature == 0.0:
                    j = int(torch.argmax(logits))
                    reach *= float(torch.softmax(logits, 0)[j])
                    if reach < drafter.min_confidence:
                        break
                    token = int(drafter.vocab_ids[j])
                    dist = DraftDist.deterministic(token)
                else:
                    idx, probs = draft_distribution(logits, self.sampling)
                    # Decided from the distribution before drawing (its largest mass), so
                    # whether position i is drafted depends only on earlier drafts and the
                    # reported q stays exactly what the token is drawn from.
                    reach *= float(probs[0])
                    if reach < drafter.min_confidence:
                        break
                    pick = int(torch.multinomial(probs, 1, generator=self.generator))
                    ids = drafter.vocab_ids[idx]
                    token = int(ids[pick])
                    dist = DraftDist.from_support(zip(ids.tolist(), probs.tolist(), strict=True))
                tokens.append(token)
                dists.append(dist)
                if token in drafter.stop_token_ids or i == k - 1:
                    break
                feature = drafter.head.step(
                    feature, drafter.embed(torch.tensor([token])), self.cache)
        finally:
            self.cache.truncate(committed)  # roll back to the committed prefix
        return DraftBlock(tokens, dists)


class EagleDrafter:
    """EAGLE-1 drafter over a frozen target embedding / LM head (see module docstring).

    As a `Drafter` it keeps one implicit greedy session (for in-process use with one request
    at a time); `session` makes an independent per-request one (what the gRPC service and
    `coordinator.speculative_decode_with` use).

    Args:
        head: a trained `EagleHead`.
        embed_weight: float32 ``[vocab, H]`` target embedding table (shared, not copied).
        lm_head_weight: float32 ``[vocab, H]`` target LM head (the embedding when tied).
        max_draft_len: most tokens one proposal drafts.
        stop_token_ids: a drafted stop token ends the block (nothing follows it).
        min_confidence: dynamic draft length (EAGLE-2, arXiv 2406.16858, section 4): a block
            stops before position i when the product of the head's top probabilities at
            positions 0..i (its estimate that the whole prefix is accepted) falls below this;
            0 drafts ``max_len`` every time. A block may be empty.

    Raises:
        ValueError: weights whose shape does not match the head, max_draft_len < 1, or
            min_confidence outside [0, 1].
    """

    wants_hidden = True

    def __init__(self, head: EagleHead, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor, max_draft_len: int = 6,
                 stop_token_ids: Sequence[int] = (), min_confidence: float = 0.0):
        c = head.config
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (c.vocab_size, c.hidden_size):
                raise ValueError(f"{name} has shape {tuple(w.shape)}, the head expects "
                                 f"{(c.vocab_size, c.hidden_size)}")
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = float(min_confidence)
        self.head = head.eval()
        self.embed_weight = embed_weight.detach()
        self.vocab_ids = head.draft_vocab.clone()
        # Restricted LM head: only the draft vocabulary's rows, contiguous for fast matmuls.
        self.lm_sub = lm_head_weight.detach()[self.vocab_ids].float().contiguous()
        self.max_draft_len = int(max_draft_len)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._default = EagleSession(self)

    @classmethod
    def for_model(cls, model: str | os.PathLike | None = None,
                  path: str | os.PathLike | None = None, max_draft_len: int = 6,
                  stop_token_ids: Sequence[int] = (), min_confidence: float = 0.0
                  ) -> EagleDrafter:
        """A drafter for the target ``model`` (a `target_worker.load_model` source), loading
        only its embedding table and LM head (`load_target_head_weights`).

        Raises:
            FileNotFoundError: no head or model file. ValueError: a head for another shape.
        """
        head = EagleHead.load(DEFAULT_HEAD if path is None else path)
        embed, lm_head = load_target_head_weights(model)
        return cls(head, embed, lm_head, max_draft_len=max_draft_len,
                   stop_token_ids=stop_token_ids, min_confidence=min_confidence)

    @classmethod
    def for_target(cls, decoder, path: str | os.PathLike | None = None,
                   max_draft_len: int = 6, stop_token_ids: Sequence[int] = (),
                   min_confidence: float = 0.0) -> EagleDrafter:
        """A drafter sharing ``decoder``'s (a `target_worker.Decoder`) embedding and LM head.

        Args:
            path: an EAGLE head file; None for the shipped head `DEFAULT_HEAD`.

        Raises:
            FileNotFoundError: no head file. ValueError: a head made for another target shape.
        """
        head = EagleHead.load(DEFAULT_HEAD if path is None else path)
        return cls(head, decoder.embed_tokens.weight, decoder.lm_head.weight,
                   max_draft_len=max_draft_len, stop_token_ids=stop_token_ids,
                   min_confidence=min_confidence)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, H]`` target embeddings of int64 ``tokens [n]``."""
        return self.embed_weight[tokens].float()

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, V']`` logits over the draft vocabulary for features ``[n, H]``."""
        return fast_linear(features, self.lm_sub)

    @property
    def capabilities(self) -> DrafterCapabilities:
        """Conditions on hidden rows, samples its drafts, one session per request."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len,
                                   sessions=True, samples=True)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0
                ) -> EagleSession:
        """A fresh per-request session (own KV cache, own seeded generator)."""
        return EagleSession(self, sampling, seed)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """`Drafter.propose` on the implicit greedy session."""
        return self._default.propose(history, target_hidden, max_len)


def load_target_head_weights(model: str | os.PathLike | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's float32 embedding table and LM head ``[vocab, H]`` each (the same tensor
    when tied), without keeping the rest of the model.

    Reads just those tensors from the target loader's safetensors cache when it holds the
    model (a drafter worker then needs ~113 MB for SmolLM2, not 538 MB); otherwise loads the
    whole decoder once (which also fills that cache) and keeps only them.

    Raises:
        As `target_worker.loader.load_decoder`.
    """
    from target_worker.disk_cache import weights_cache_path
    from target_worker.loader import load_decoder, model_path
    from target_worker.testing import is_tiny_random_spec

    if not is_tiny_random_spec(model):
        try:
            from safetensors import safe_open

            cached = weights_cache_path(model_path(model))
            if cached.is_file():
                with safe_open(str(cached), framework="pt") as f:
                    embed = f.get_tensor("embed_tokens.weight").float()
                    names = set(f.keys())
                    head = (f.get_tensor("lm_head.weight").float() if "lm_head.weight" in names
                            else embed)
                return embed, head
        except (AttributeError, KeyError, OSError):  # a changed cache layout: load it all
            pass
    # float32 as promised (and as the cache path reads): "auto" is bfloat16 on a CPU with
    # native bf16 dot products, which would round the tables.
    decoder = load_decoder(model, "float32")
    return decoder.embed_tokens.weight, decoder.lm_head.weight


class LookupThenEagle:
    """Prompt lookup when it finds a match, EAGLE otherwise (``--drafter eagle+lookup``).

    Prompt lookup drafts long, cheap, exact blocks when the output copies its context (code
    edits); EAGLE covers open-ended text, where lookup finds nothing. The EAGLE session sees
    every hidden row either way, so its KV cache stays current; its draft loop runs only
    when lookup proposes nothing. Both report honest ``q`` (lookup: a point mass), so mixing
    them per step keeps verification lossless.
    """

    wants_hidden = True

    def __init__(self, lookup, eagle: EagleDrafter | EagleSession, _session=None):
        self.lookup = lookup
        self.eagle = eagle
        self.max_draft_len = max(getattr(lookup, "max_draft_len", 0) or 0,
                                 getattr(eagle, "max_draft_len", 0) or 0)
        self._eagle = _session if _session is not None else eagle

    @property
    def capabilities(self) -> DrafterCapabilities:
        """As EAGLE's, with the longer of the two caps."""
        return DrafterCapabilities(wants_hidden=True, max_draft_len=self.max_draft_len or None,
                                   sessions=True, samples=True)

    def session(self, sampling: DraftSamplingParams | None = None, seed: int = 0
                ) -> LookupThenEagle:
        """A per-request combined drafter with its own EAGLE session."""
        return LookupThenEagle(self.lookup, self.eagle,
                               _session=self.eagle.session(sampling, seed))

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        block = self.lookup.propose(history, None, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return self._eagle.propose(history, target_hidden, max_len)

    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: prompt lookup's run-ahead when it finds a
        match, else EAGLE's (the EAGLE session ingests the committed rows either way)."""
        block = propose_ahead(self.lookup, history, None, assumed, max_len)
        if len(block):
            self._eagle.propose(history, target_hidden, 0)  # ingest rows only
            return block
        return propose_ahead(self._eagle, history, target_hidden, assumed, max_len)
