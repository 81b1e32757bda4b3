"""Test drafters and references shared by the losslessness tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specd_core.draft import DraftBlock, DraftDist
from specd_core.sampling import Sampler, SamplingParams, sampling_distribution
from target_worker.config import ModelConfig
from target_worker.model import Decoder


def tiny_decoder(vocab: int = 8, seed: int = 0, n_layers: int = 2) -> Decoder:
    return Decoder.random(ModelConfig.tiny_test(vocab, n_layers=n_layers), seed=seed)


class FixedDrafter:
    """Always proposes the same block; records what it was asked."""

    def __init__(self, block: DraftBlock):
        self.block = block
        self.seen_history: list[list[int]] = []
        self.seen_hidden: list[torch.Tensor | None] = []
        self.seen_max_len: list[int] = []

    def propose(self, history, target_hidden, max_len):
        self.seen_history.append(list(history))
        self.seen_hidden.append(None if target_hidden is None else target_hidden.clone())
        self.seen_max_len.append(max_len)
        return DraftBlock(self.block.tokens[:max_len], self.block.dists[:max_len])


class OracleDrafter:
    """Proposes the true continuation (from a known output) so every draft is accepted."""

    def __init__(self, prompt_len: int, continuation: Sequence[int], k: int):
        self.prompt_len = prompt_len
        self.continuation = list(continuation)
        self.k = k
        self.seen_max_len: list[int] = []

    def propose(self, history, target_hidden, max_len):
        self.seen_max_len.append(max_len)
        done = len(history) - self.prompt_len
        return DraftBlock.deterministic(self.continuation[done:done + self.k])


class TopKSamplingDrafter:
    """A model-like drafter: samples each token from a top-k truncated softmax of another
    random model and reports exactly that truncated, renormalised distribution."""

    def __init__(self, draft_model: Decoder, k: int, top_k: int, seed: int):
        self.model = draft_model
        self.k = k
        self.top_k = top_k
        self.rng = Sampler(seed)
        self.reported: list[DraftDist] = []

    def propose(self, history, target_hidden, max_len):
        cache = self.model.new_cache()
        logits = self.model.forward_batch(list(history), 0, cache)[-1]
        tokens, dists = [], []
        for _ in range(min(self.k, max_len)):
            probs = torch.softmax(logits, 0)
            top = torch.topk(probs, self.top_k)
            q = top.values / top.values.sum()
            dist = DraftDist.from_support(zip(top.indices.tolist(), q.tolist(), strict=True))
            token = top.indices[self.rng.sample_from(q)].item()
            tokens.append(token)
            dists.append(dist)
            self.reported.append(dist)
            logits = self.model.forward_token(token, cache.seq_len, cache)
        return DraftBlock(tokens, dists)


def plain_decode(
    decoder: Decoder, prompt: Sequence[int], max_new: int, params: SamplingParams | None = None
) -> list[int]:
    """Token-at-a-time greedy decode with ``forward_token`` (the reference loop)."""
    params = params or SamplingParams()
    cache = decoder.new_cache()
    logits = decoder.forward_batch(list(prompt), 0, cache)[-1]
    history = list(prompt)
    out = []
    for _ in range(max_new):
        token = int(sampling_distribution(logits, params, history, len(prompt)).argmax())
        out.append(token)
        history.append(token)
        logits = decoder.forward_token(token, cache.seq_len, cache)
    return out


def exact_marginals(
    decoder: Decoder, prompt: Sequence[int], params: SamplingParams, depth: int
) -> np.ndarray:
    """Exact per-position marginals ``[depth, vocab]`` of plain sampling, by enumerating every
    prefix (tractable only for a tiny vocabulary and horizon)."""
    vocab = decoder.config.vocab_size
    marginals = np.zeros((depth, vocab))
    base = decoder.new_cache()
    logits = decoder.forward_batch(list(prompt), 0, base)[-1]

    def walk(cache, logits, history, weight, level):
        probs = sampling_distribution(logits, params, history, len(prompt)).double().numpy()
        for token, p in enumerate(probs):
            if p <= 0:
                continue
            marginals[level, token] += weight * p
            if level + 1 < depth:
                branch = cache.clone()
                nxt = decoder.forward_token(token, branch.seq_len, branch)
                walk(branch, nxt, [*history, token], weight * p, level + 1)

    walk(base, logits, list(prompt), 1.0, 0)
    return marginals


def tv_tolerance(exact: np.ndarray, n: int, factor: float = 2.5) -> float:
    """Tolerance on the total variation between ``n`` draws and the exact distribution
    ``exact``: ``factor`` times the expected TV of an honest sampler, which is
    ``1/2 * sum_i sqrt(2/pi) * sqrt(p_i (1 - p_i) / n)`` (mean absolute error of each
    binomial frequency). TV concentrates around that mean, so 2.5x is several sigma."""
    p = np.asarray(exact, dtype=np.float64)
    return factor * 0.5 * float(np.sqrt(2 / np.pi) * np.sqrt(p * (1 - p) / n).sum())
