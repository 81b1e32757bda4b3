"""The accept/reject rule (ported from the seed) and the compact target rows."""

import numpy as np
import pytest
import torch

from specd_core.draft import DraftDist
from specd_core.rule import GreedyRows, ProbRows, accept_or_resample, target_rows
from specd_core.sampling import Sampler, SamplingParams, sampling_distributions


def test_a_draft_at_least_as_likely_under_the_target_is_always_accepted():
    target = torch.tensor([0.6, 0.3, 0.1])
    draft = DraftDist.from_dense([0.5, 0.4, 0.1])
    rng = Sampler(1)
    for _ in range(100):
        assert accept_or_resample(target, draft, 0, rng) is None


def test_a_draft_the_target_rules_out_is_always_rejected():
    target = torch.tensor([0.5, 0.5, 0.0])
    rng = Sampler(2)
    for _ in range(50):
        replacement = accept_or_resample(target, DraftDist.deterministic(2), 2, rng)
        assert replacement is not None and replacement < 2


def test_a_point_mass_draft_is_judged_by_the_draw_plain_sampling_would_make():
    # The coupled form of the rule: one uniform, the same inverse CDF as plain sampling;
    # accepted iff that draw is the draft, else the draw is the replacement. Dense and
    # sparse rows agree.
    from specd_core.rule import SparseProbRows

    gen = np.random.default_rng(0)
    accepted = 0
    for trial in range(300):
        p = torch.tensor(gen.dirichlet(np.full(6, 0.5)), dtype=torch.float32)
        p[int(gen.integers(6))] = 0.0  # sparse rows need exact zeros
        x = int(gen.integers(6))
        plain = Sampler(trial).sample_from(p)
        expected = None if plain == x else plain
        dist = DraftDist.deterministic(x)
        assert accept_or_resample(p, dist, x, Sampler(trial)) == expected
        assert SparseProbRows.from_dense(p[None]).judge(0, x, dist, Sampler(trial)) == expected
        accepted += expected is None
    assert 0 < accepted < 300


def test_a_token_outside_the_drafts_support_is_accepted_as_the_limit_of_p_over_q():
    # Breaks the DraftDist contract; the seed accepts it rather than biasing the output.
    target = torch.tensor([0.1, 0.9])
    assert accept_or_resample(target, DraftDist.deterministic(1), 0, Sampler(0)) is None


TARGET = [0.30, 0.25, 0.20, 0.15, 0.07, 0.03]
BAD_DRAFTS = {
    "wrong": DraftDist.from_dense([0.02, 0.03, 0.05, 0.10, 0.30, 0.50]),
    "deterministic": DraftDist.deterministic(3),
    "narrow": DraftDist.from_support([(0, 0.5), (5, 0.5)]),
    "perfect": DraftDist.from_dense(TARGET),
}


@pytest.mark.parametrize("name", list(BAD_DRAFTS))
def test_resampling_reproduces_the_target_distribution(name):
    # THE invariant: draft a token from q, run the rule, and the output is distributed as the
    # target however bad q is. The argmax rule fails this (it piles mass on token 0).
    # 200,000 draws over 6 tokens: the expected TV of the empirical distribution is about
    # sum_i sqrt(p_i (1 - p_i) / n) / 2 * sqrt(2/pi) ~ 0.002, so 0.01 is ~5 sigma.
    draft = BAD_DRAFTS[name]
    target = np.array(TARGET, dtype=np.float32)
    dense = np.zeros(len(TARGET))
    for t, p in draft.support():
        dense[t] = p
    rng = Sampler(0xA11CE + list(BAD_DRAFTS).index(name))
    draws = 200_000
    counts = np.zeros(len(TARGET))
    for _ in range(draws):
        x = rng.sample_from(dense)
        out = accept_or_resample(target, draft, x, rng)
        counts[x if out is None else out] += 1
    tv = np.abs(counts / draws - np.array(TARGET)).sum() / 2
    assert tv < 0.01, f"{name}: total variation {tv:.4f}, counts {counts}"


def test_sampler_is_reproducible_and_never_draws_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.8, 0.0])
    a, b = Sampler(3), Sampler(3)
    draws = [a.sample_from(probs) for _ in range(2000)]
    assert draws == [b.sample_from(probs) for _ in range(2000)]
    assert set(draws) == {1, 3}
    assert Sampler(None).uniform() != Sampler(None).uniform()
    with pytest.raises(ValueError, match="no positive mass"):
        Sampler(0).sample_from([0.0, 0.0])


def test_greedy_rows_are_the_rule_against_a_point_mass():
    # At temperature 0 the target distribution is one-hot; GreedyRows must decide exactly as
    # accept_or_resample does on that one-hot, for every draft token and draft shape.
    logits = torch.randn(3, 7, generator=torch.Generator().manual_seed(0))
    params = SamplingParams()
    greedy = target_rows(logits, params, [1, 2], 2, [4, 5])
    probs = ProbRows(sampling_distributions(logits, params, [1, 2], 2, [4, 5]))
    assert isinstance(greedy, GreedyRows) and len(greedy) == 3
    rng = Sampler(0)
    for i in range(3):
        for token in range(7):
            for dist in (DraftDist.deterministic(token),
                         DraftDist.from_dense(torch.softmax(torch.randn(7), 0))):
                assert greedy.judge(i, token, dist, rng) == probs.judge(i, token, dist, rng)
        assert greedy.sample(i, rng) == probs.sample(i, rng)


def test_sampling_requests_get_full_probability_rows():
    logits = torch.randn(2, 5)
    rows = target_rows(logits, SamplingParams(temperature=0.7), [1], 1, [3])
    assert isinstance(rows, ProbRows)
    assert rows.probs.shape == (2, 5)
    torch.testing.assert_close(rows.probs.sum(-1), torch.ones(2))
