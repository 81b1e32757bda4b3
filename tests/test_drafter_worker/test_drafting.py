"""Draft blocks, draft distributions and prompt lookup (ported from the seed's tests)."""

import numpy as np
import pytest
import torch

from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock, DraftDist, Drafter


def test_proposes_the_continuation_after_a_real_repeat():
    spec = PromptLookupSpeculator(2, 4)
    # Earlier "1 2" at indices 0-1; the 4 tokens after it are "3 4 5 9".
    history = [1, 2, 3, 4, 5, 9, 9, 9, 1, 2]
    assert spec.propose_tokens(history) == [3, 4, 5, 9]
    assert spec.propose(history, None, 8) == DraftBlock.deterministic([3, 4, 5, 9])


def test_respects_max_draft_len():
    spec = PromptLookupSpeculator(2, 2)
    assert spec.propose_tokens([1, 2, 3, 4, 5, 6, 7, 1, 2]) == [3, 4]


def test_returns_empty_when_no_earlier_match_exists():
    assert PromptLookupSpeculator(2, 4).propose_tokens([1, 2, 3, 4, 5]) == []


def test_returns_empty_when_history_too_short():
    assert PromptLookupSpeculator(3, 4).propose_tokens([1, 2, 3]) == []
    assert PromptLookupSpeculator(1, 4).propose_tokens([]) == []


def test_finds_the_most_recent_match_when_several_exist():
    spec = PromptLookupSpeculator(1, 3)
    # needle [9]: earlier at 0 (-> 8 7 6) and 4 (-> 5 4 9); the most recent wins.
    assert spec.propose_tokens([9, 8, 7, 6, 9, 5, 4, 9]) == [5, 4, 9]


def test_never_matches_the_needles_own_occurrence():
    spec = PromptLookupSpeculator(2, 4)
    # The needle [7, 8] occurs only at the end: no proposal.
    assert spec.propose_tokens([1, 2, 3, 7, 8]) == []
    # Overlapping earlier occurrence is fine: [9, 9] at 0 is followed by one 9.
    assert spec.propose_tokens([9, 9, 9]) == [9]


def test_the_drafter_caps_a_block_at_the_callers_budget():
    spec = PromptLookupSpeculator(2, 4)
    block = spec.propose([1, 2, 3, 4, 5, 9, 9, 9, 1, 2], None, 2)
    assert block.tokens == (3, 4)
    assert len(block.dists) == 2
    assert spec.propose([1, 2, 3, 4, 5, 9, 9, 9, 1, 2], None, 0).is_empty()


@pytest.mark.parametrize("ngram,k", [(0, 4), (2, 0), (-1, 1)])
def test_invalid_sizes_are_refused(ngram, k):
    with pytest.raises(ValueError, match="ngram_size|max_draft_len"):
        PromptLookupSpeculator(ngram, k)


def test_lookup_matches_a_naive_scan_on_random_histories():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n = int(rng.integers(1, 4))
        history = rng.integers(0, 4, size=int(rng.integers(0, 40))).tolist()
        expected = []
        if len(history) >= n + 1:
            needle = history[-n:]
            for start in range(len(history) - n - 1, -1, -1):
                if history[start:start + n] == needle:
                    expected = history[start + n:start + n + 5]
                    break
        assert PromptLookupSpeculator(n, 5).propose_tokens(history) == expected, (trial, history)


def test_lookup_on_a_long_history_finds_the_only_match_at_the_start():
    history = list(range(8000)) + [0, 1, 2]
    assert PromptLookupSpeculator(3, 8).propose_tokens(history) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert PromptLookupSpeculator(3, 8).propose_tokens(np.asarray(history)) == [3, 4, 5, 6, 7,
                                                                                 8, 9, 10]


def test_prompt_lookup_is_a_drafter():
    assert isinstance(PromptLookupSpeculator(2, 3), Drafter)


def test_draft_block_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="one draft distribution per drafted token"):
        DraftBlock([1, 2], [DraftDist.deterministic(1)])


def test_draft_block_refuses_a_token_outside_its_own_distribution():
    with pytest.raises(ValueError, match="probability 0"):
        DraftBlock([3], [DraftDist.deterministic(1)])


def test_draft_block_truncate_keeps_tokens_and_dists_in_step():
    block = DraftBlock.deterministic([5, 6, 7])
    block.truncate(2)
    assert block.tokens == (5, 6) and len(block.dists) == 2 and block.len() == 2
    block.truncate(10)
    assert len(block) == 2
    with pytest.raises(ValueError):
        block.truncate(-1)
    assert DraftBlock.empty().is_empty() and len(DraftBlock.empty()) == 0


def test_draft_dist_constructors_and_prob():
    dense = DraftDist.from_dense([0.0, 0.25, 0.0, 0.75])
    assert dense.support() == ((1, 0.25), (3, 0.75))
    assert dense.prob(3) == 0.75 and dense.prob(0) == 0.0 and dense.prob(99) == 0.0
    assert DraftDist.from_dense(torch.tensor([0.5, 0.5])).prob(1) == pytest.approx(0.5)
    assert DraftDist.deterministic(4).support() == ((4, 1.0),)
    assert DraftDist.from_support([(0, 0.5), (5, 0.5)]).prob(5) == 0.5


@pytest.mark.parametrize(
    "support,match",
    [([(0, 0.5), (0, 0.5)], "twice"), ([(0, -0.1), (1, 1.1)], "invalid"),
     ([(0, 0.3)], "sum"), ([(-1, 1.0)], "negative")],
)
def test_draft_dist_refuses_a_dishonest_support(support, match):
    with pytest.raises(ValueError, match=match):
        DraftDist.from_support(support)
