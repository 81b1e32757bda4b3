"""A failure stays with its request: sampling never raises on legal parameters, one request's
fault (admission, prefill, verify, the rule) fails that request alone and frees its slot and
drafter state, big prompts are refused before tokenizing and tokenized off the event loop,
and malformed request bytes are INVALID_ARGUMENT."""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.rule import target_rows
from coordinator.sampling import Sampler, SamplingParams, greedy_tokens, sampling_distributions
from drafter_worker import DraftDist

# ---- sampling: no legal input raises ----

GREEDY_TEMPERATURE = 1e-5  # coordinator.sampling.GREEDY_TEMPERATURE (vLLM's _SAMPLING_EPS)

TEMPERATURES = [0.0, 1e-45, 1e-40, 1e-20, 1e-6, 9.99e-6, GREEDY_TEMPERATURE, 1e-3, 0.7, 1.0,
                50.0, 1e30, 1.7e308]
REPETITION = [0.01, 0.5, 1.0, 1.3, 100.0]
PENALTIES = [-2.0, 0.0, 2.0]
TOP_K = [0, 1, 2, 63, 64, 10**9]
TOP_P = [5e-324, 1e-6, 0.5, 1.0]
MIN_P = [0.0, 5e-324, 0.5, 1.0]
LOGIT_SCALES = [0.0, 1e-30, 1.0, 30.0, 1e4, 1e8]


def _check_rows(probs: torch.Tensor, vocab: int) -> None:
    assert probs.shape[-1] == vocab
    assert bool(torch.isfinite(probs).all()), "a row has a non-finite probability"
    assert bool((probs >= 0).all()), "a row has a negative probability"
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(probs.shape[0],
                                                                  dtype=torch.float64))


def test_extreme_legal_parameters_always_give_valid_distributions_and_samples():
    """Seeded random combinations of the extremes of every legal range, over logits from all
    zeros (ties everywhere) to huge: every row is a distribution and every sampling path (the
    bonus draw, the rule against a point-mass and a spread draft) returns a token."""
    vocab, rng = 64, random.Random(1234)
    for case in range(400):
        params = SamplingParams(
            temperature=rng.choice(TEMPERATURES), top_k=rng.choice(TOP_K),
            top_p=rng.choice(TOP_P), min_p=rng.choice(MIN_P),
            repetition_penalty=rng.choice(REPETITION),
            presence_penalty=rng.choice(PENALTIES), frequency_penalty=rng.choice(PENALTIES))
        gen = torch.Generator().manual_seed(case)
        n = rng.randint(1, 5)
        logits = torch.randn(n, vocab, generator=gen) * rng.choice(LOGIT_SCALES)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        prompt = rng.randint(0, len(history))
        block = [rng.randrange(vocab) for _ in range(n - 1)]
        where = f"case {case}: {params}, logit scale {logits.abs().max():.3g}"
        probs = sampling_distributions(logits, params, history, prompt, block)
        try:
            _check_rows(probs, vocab)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        if params.greedy:
            assert greedy_tokens(logits, params, history, prompt, block) == \
                probs.argmax(-1).tolist(), where
        rows = target_rows(logits, params, history, prompt, block)
        sampler = Sampler(case)
        spread = DraftDist.from_dense(torch.softmax(torch.randn(vocab, generator=gen), 0))
        for i in range(n):
            for token in (rows.sample(i, sampler),
                          rows.judge(i, 3, DraftDist.deterministic(3), sampler),
                          rows.judge(i, 5, spread, sampler)):
                assert token is None or 0 <= token < vocab, where
                if token is not None:
                    assert probs[i, token] > 0, f"{where}: drew a zero-probability token"


def test_temperature_below_the_epsilon_is_greedy_everywhere():
    for t in (1e-45, 1e-40, 9.99e-6):
        params = SamplingParams(temperature=t, top_k=3, top_p=0.5)
        assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.mark.parametrize("value", [1e-45, 1e-3, 0.0099, 100.01, 1e45])
def test_a_repetition_penalty_that_would_overflow_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"repetition_penalty=.*must be in \[0.01, 100\]"):
        SamplingParams(temperature=1.0, repetition_penalty=value)
