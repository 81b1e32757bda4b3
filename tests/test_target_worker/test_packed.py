"""Packed batched forward (many sequences, each over its own cache, in one forward) and the
compact sparse target rows that keep what crosses the process boundary small."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from drafter_worker import DraftDist
from specd_core.rule import GreedyRows, ProbRows, SparseProbRows, compact_rows, target_rows
from specd_core.sampling import Sampler, SamplingParams, sampling_distributions
from target_worker import Decoder, ModelConfig

VOCAB = 11

CONFIGS = {
    "moe": lambda: ModelConfig.tiny_test(VOCAB),
    "dense": lambda: dataclasses.replace(ModelConfig.tiny_test(VOCAB), moe=None),
    "dense_untied_bias": lambda: dataclasses.replace(
        ModelConfig.tiny_test(VOCAB), moe=None, tie_embeddings=False, qkv_bias=True
    ),
}


@pytest.fixture(params=sorted(CONFIGS))
def model(request) -> Decoder:
    return Decoder.random(CONFIGS[request.param](), seed=5)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def warm_cache(model: Decoder, length: int, seed: int):
    """A cache holding ``length`` random tokens (0 gives an empty cache)."""
    cache = model.new_cache(capacity=8)  # small: packed feeds must grow it too
    if length:
        model.forward_batch(tokens(length, seed), 0, cache)
    return cache


# (warm cache length, tokens fed): different lengths and start positions, incl. 1-token rows
# and a fresh prompt at position 0.
LAYOUT = [(7, 1), (0, 9), (23, 5), (3, 1), (12, 3)]


def _separate_and_packed(model, layout, last_only):
    separate, packed_segments = [], []
    for s, (warm, n) in enumerate(layout):
        feed = tokens(n, 100 + s)
        a, b = warm_cache(model, warm, s), warm_cache(model, warm, s)
        separate.append((model.forward_batch_with_hidden(feed, warm, a, last_only[s]), a))
        packed_segments.append((feed, warm, b))
    packed = model.forward_packed(packed_segments, last_only)
    return separate, packed, [c for _, _, c in packed_segments]


@pytest.mark.parametrize("last_only", [(False,) * 5, (True, False, True, False, True)])
def test_packed_logits_and_hidden_equal_separate_forwards(model, last_only):
    separate, packed, _ = _separate_and_packed(model, LAYOUT, list(last_only))
    assert len(packed) == len(LAYOUT)
    for ((want_logits, want_hidden), _), (logits, hidden), (_, n), last in zip(
        separate, packed, LAYOUT, last_only, strict=True
    ):
        assert logits.shape == (1 if last else n, VOCAB)
        assert hidden.shape == (n, model.config.hidden_size)
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=0)
        assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))


def test_packed_caches_end_in_the_state_of_separate_forwards(model):
    separate, _, packed_caches = _separate_and_packed(model, LAYOUT, [False] * len(LAYOUT))
    for (_, want), got in zip(separate, packed_caches, strict=True):
        assert got.seq_len == want.seq_len
        end = want.seq_len
        torch.testing.assert_close(got.k[:, :, :end], want.k[:, :, :end], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.v[:, :, :end], want.v[:, :, :end], atol=1e-5, rtol=0)


def test_packed_decoding_continues_like_separate_decoding(model):
    # Several greedy steps where each step is one packed forward over all sequences: the
    # argmax continuation of every sequence equals decoding it alone.
    prompts = [tokens(5, 1), tokens(2, 2), tokens(8, 3)]
    alone = []
    for p in prompts:
        cache = model.new_cache()
        nxt = int(model.forward_batch(p, 0, cache)[-1].argmax())
        out = [nxt]
        for _ in range(6):
            nxt = int(model.forward_token(nxt, cache.seq_len, cache).argmax())
            out.append(nxt)
        alone.append(out)
    caches = [model.new_cache() for _ in prompts]
    results = model.forward_packed(
        [(p, 0, c) for p, c in zip(prompts, caches, strict=True)], [True] * len(prompts)
    )
    outs = [[int(logits[-1].argmax())] for logits, _ in results]
    for _ in range(6):
        results = model.forward_packed(
            [([o[-1]], c.seq_len, c) for o, c in zip(outs, caches, strict=True)]
        )
        for o, (logits, _) in zip(outs, results, strict=True):
            o.append(int(logits[-1].argmax()))
    assert outs == alone


def test_a_single_segment_is_exactly_forward_batch_with_hidden(model):
    a, b = warm_cache(model, 6, 0), warm_cache(model, 6, 0)
    feed = tokens(4, 9)
    want_logits, want_hidden = model.forward_batch_with_hidden(feed, 6, a)
    ((logits, hidden),) = model.forward_packed([(feed, 6, b)])
    assert torch.equal(logits, want_logits) and torch.equal(hidden, want_hidden)


def test_a_bad_segment_is_rejected_before_any_cache_is_written(model):
    good, bad = warm_cache(model, 4, 0), warm_cache(model, 4, 1)
    k_before = good.k[:, :, :4].clone()
    with pytest.raises(ValueError, match="segment 1: start_pos must be the cache's current"):
        model.forward_packed([([1, 2], 4, good), ([3], 2, bad)])
    with pytest.raises(ValueError, match=f"segment 1: token id {VOCAB}"):
        model.forward_packed([([1, 2], 4, good), ([VOCAB], 4, bad)])
    with pytest.raises(ValueError, match="segment 0: tokens must contain at least one"):
        model.forward_packed([([], 4, good), ([3], 4, bad)])
    assert (good.seq_len, bad.seq_len) == (4, 4)
    assert torch.equal(good.k[:, :, :4], k_before)


def test_packed_argument_errors(model):
    cache = warm_cache(model, 2, 0)
    with pytest.raises(ValueError, match="at least one segment"):
        model.forward_packed([])
    with pytest.raises(ValueError, match="already appears"):
        model.forward_packed([([1], 2, cache), ([2], 2, cache)])
    with pytest.raises(ValueError, match="last_logits_only has 2 entries for 1 segments"):
        model.forward_packed([([1], 2, cache)], [True, False])
    assert cache.seq_len == 2



# --- compact target rows --------------------------------------------------------------------

FILTERS = [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.5, top_k=9, top_p=0.9, repetition_penalty=1.3),
    SamplingParams(temperature=1.0),  # full support: stays dense, still must agree
]


def _draft_dists(rng: np.random.Generator, vocab: int, support: np.ndarray) -> list[DraftDist]:
    """Deterministic and spread drafts over tokens in and out of the target's support,
    beyond the vocabulary, and with zero-probability entries."""
    outside = np.setdiff1d(np.arange(vocab), support)
    picks = [int(rng.choice(support)), vocab + 3]
    if outside.size:
        picks.append(int(rng.choice(outside)))
    dists = [DraftDist.deterministic(t) for t in picks]
    for _ in range(4):
        size = int(rng.integers(2, 6))
        tokens = rng.choice(vocab + 2, size=size, replace=False)  # may exceed the vocabulary
        q = rng.dirichlet(np.full(size, 0.5))
        q[rng.integers(size)] = 0.0  # a zero-probability entry in the support
        q /= q.sum()
        dists.append(DraftDist.from_support(zip(tokens.tolist(), q.tolist(), strict=True)))
    return dists


@pytest.mark.parametrize("case", range(40))
def test_sparse_rows_decide_and_sample_bit_identically_to_dense_rows(case):
    # Same decisions, same replacement tokens and same RNG consumption for the same stream,
    # over random rows, sampling filters and drafts (honest draws and arbitrary tokens).
    rng = np.random.default_rng(case)
    vocab = int(rng.integers(5, 80))
    n = int(rng.integers(1, 6))
    logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(n, vocab)).astype(np.float32))
    params = FILTERS[case % len(FILTERS)]
    history = rng.integers(0, vocab, size=6).tolist()
    probs = sampling_distributions(logits, params, history, 3, rng.integers(0, vocab, n).tolist())
    dense, sparse = ProbRows(probs), SparseProbRows.from_dense(probs)
    assert len(sparse) == len(dense) == n
    assert torch.equal(sparse.to_dense(), probs)
    a, b = Sampler(case), Sampler(case)
    rejected = 0
    for i in range(n):
        support = np.flatnonzero(probs[i].numpy())
        for dist in _draft_dists(rng, vocab, support):
            tokens, qs = dist.arrays()
            drawn = int(tokens[rng.choice(len(tokens), p=qs / qs.sum())])
            for token in {drawn, *support[:3].tolist(), vocab + 1}:
                for _ in range(3):
                    got = sparse.judge(i, token, dist, b)
                    assert got == dense.judge(i, token, dist, a)
                    rejected += got is not None
        for _ in range(20):
            assert sparse.sample(i, b) == dense.sample(i, a)
        assert a.uniform() == b.uniform()  # the streams advanced in lockstep
    assert rejected > 0  # the residual resample was exercised, not only acceptance


def test_compact_rows_picks_the_smaller_exact_form():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    topk = target_rows(logits, SamplingParams(temperature=1.0, top_k=5), [1, 2], 2, [3, 4])
    compact = compact_rows(topk)
    assert isinstance(compact, SparseProbRows)
    assert compact.nbytes() < topk.probs.numel() * 4
    assert torch.equal(compact.to_dense(), topk.probs)
    assert compact.token_ids.dtype == np.int32 and compact.probs.dtype == np.float32
    full = target_rows(logits, SamplingParams(temperature=1.0), [1, 2], 2, [3, 4])
    assert compact_rows(full) is full  # every entry nonzero: dense is smaller
    greedy = target_rows(logits, SamplingParams(), [1, 2], 2, [3, 4])
    assert isinstance(greedy, GreedyRows) and compact_rows(greedy) is greedy
    as_float64 = ProbRows(topk.probs.double())
    assert compact_rows(as_float64) is as_float64  # would not round-trip bit-exactly
