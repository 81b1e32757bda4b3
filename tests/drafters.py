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


class LayeredRecorder:
    """A hidden-conditioned drafter reading the residual streams of ``hidden_layers`` (``()``:
    the final-norm rows), as EAGLE-3 declares itself: one session per request, each keeping
    the rows it was sent, aligned to history positions the way a stateful drafter must
    (rows continuing its tokens extend them; ``len(history) - 1`` rows start over; anything
    else asks for a resync). It drafts what prompt lookup drafts (a point mass, so greedy
    output cannot depend on it) and runs ahead the same way.

    ``sessions``: every session made, in order (a released request's stays here for the
    test to read); ``seen``: ``(history, rows)`` of every call that carried rows.
    """

    def __init__(self, hidden_layers=(1, 2, 4), max_draft_len: int = 4):
        from drafter_worker.prompt_lookup import PromptLookupSpeculator
        from specd_core.draft import DrafterCapabilities

        self.lookup = PromptLookupSpeculator(2, max_draft_len)
        self.capabilities = DrafterCapabilities(
            wants_hidden=True, hidden_layers=tuple(hidden_layers),
            max_draft_len=max_draft_len, sessions=True, samples=False)
        self.sessions: list[LayeredSession] = []

    def session(self, sampling=None, seed: int = 0) -> LayeredSession:
        made = LayeredSession(self)
        self.sessions.append(made)
        return made

    def propose(self, history, target_hidden, max_len):  # sessions only
        raise AssertionError("a session drafter is driven through its sessions")


class LayeredSession:
    """One request's `LayeredRecorder` state: ``tokens`` (the history its rows follow) and
    ``rows`` (float32 ``[len(tokens) - 1, width]``, row i for history position i)."""

    def __init__(self, parent: LayeredRecorder):
        self.parent = parent
        self.tokens: list[int] = []
        self.rows: torch.Tensor | None = None
        self.seen: list[tuple[list[int], torch.Tensor]] = []

    def _ingest(self, history, rows) -> None:
        from drafter_worker.eagle import NeedsResync

        n = len(history)
        self.seen.append((list(history), rows.clone()))
        if self.tokens and rows.shape[0] == n - len(self.tokens) and \
                list(history[:len(self.tokens)]) == self.tokens:
            self.rows = torch.cat([self.rows, rows])
        elif rows.shape[0] == n - 1:
            self.rows = rows.clone()
        else:
            held, self.tokens, self.rows = len(self.tokens), [], None
            raise NeedsResync(f"{rows.shape[0]} rows for a {n}-token history after "
                              f"{held} tokens")
        self.tokens = list(history)

    def propose(self, history, target_hidden, max_len):
        return self.propose_ahead(history, target_hidden, (), max_len)

    def propose_ahead(self, history, target_hidden, assumed, max_len):
        from specd_core.draft import propose_ahead

        if target_hidden is not None:
            self._ingest(history, target_hidden)
        if assumed:
            return propose_ahead(self.parent.lookup, history, None, assumed, max_len)
        return self.parent.lookup.propose(history, None, max_len)


def captured_rows(decoder: Decoder, tokens: Sequence[int], layers=()) -> torch.Tensor:
    """float32 ``[len(tokens), width]``: ``decoder``'s hidden rows for ``tokens`` from
    position 0 by one plain forward (`Decoder.set_capture_layers` with ``layers``; ``()``
    the final-norm rows), the setting restored after."""
    before = decoder.capture_layers
    decoder.set_capture_layers(layers)
    try:
        return decoder.forward_batch_with_hidden(list(tokens), 0, decoder.new_cache())[1]
    finally:
        decoder.capture_layers = before
