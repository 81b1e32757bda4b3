"""Sampling parameters and transforms (vLLM semantics)."""

import math

import pytest
import torch

from specd_core.sampling import (
    SamplingParams,
    greedy_tokens,
    penalize,
    sampling_distribution,
    sampling_distributions,
)


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -0.1), ("temperature", math.nan), ("top_k", -1), ("top_k", 1.5),
     ("top_p", 0.0), ("top_p", 1.01), ("min_p", -0.1), ("min_p", 1.5),
     ("repetition_penalty", 0.0), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
     ("temperature", "hot")],
)
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_defaults_are_greedy_without_penalties():
    params = SamplingParams()
    assert params.greedy and not params.has_penalties


def test_temperature_zero_is_a_one_hot_at_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    probs = sampling_distribution(logits, SamplingParams(), [])
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_scales_the_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = sampling_distribution(logits, SamplingParams(temperature=2.0), [])
    torch.testing.assert_close(probs, torch.softmax(logits / 2.0, 0))
    assert probs.dtype == torch.float32 and probs.sum().item() == pytest.approx(1.0)


def test_top_k_keeps_the_k_most_likely():
    logits = torch.tensor([1.0, 4.0, 3.0, 2.0])
    probs = sampling_distribution(logits, SamplingParams(temperature=1.0, top_k=2), [])
    assert (probs > 0).tolist() == [False, True, True, False]
    torch.testing.assert_close(probs[1:3], torch.softmax(logits[1:3], 0))


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = sampling_distribution(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.8), [])
    # 0.5 < 0.8, 0.5 + 0.3 >= 0.8: the first two survive.
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    tiny = sampling_distribution(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.01), [])
    assert tiny.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_min_p_drops_tokens_below_a_fraction_of_the_top():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = sampling_distribution(probs_in.log(), SamplingParams(temperature=1.0, min_p=0.4), [])
    # Threshold 0.4 * 0.5 = 0.2: tokens 2 and 3 go.
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_repetition_penalty_covers_prompt_and_output():
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0, 1.0])
    params = SamplingParams(repetition_penalty=2.0)
    # Token 0 in the prompt, token 1 in the output; 2 and 3 unseen.
    out = penalize(logits, params, [0, 1], num_prompt_tokens=1)
    assert out.tolist() == [1.0, -4.0, 2.0, -2.0, 1.0]


def test_presence_and_frequency_penalties_cover_only_the_output():
    logits = torch.zeros(4)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # Token 3 appears in the prompt only: untouched. Token 1 twice, token 2 once in output.
    out = penalize(logits, params, [3, 1, 2, 1], num_prompt_tokens=1)
    assert out.tolist() == [0.0, -1.0, -0.75, 0.0]


def test_block_rows_see_the_tokens_drafted_before_them():
    # Row i of a verified block must be penalised as if block[:i] had been accepted.
    torch.manual_seed(0)
    logits = torch.randn(4, 10)
    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.3, top_k=6, top_p=0.9)
    history, block = [1, 2, 3, 2], [5, 2, 7]
    rows = sampling_distributions(logits, params, history, 2, block)
    for i in range(4):
        single = sampling_distribution(logits[i], params, history + block[:i], 2)
        torch.testing.assert_close(rows[i], single)
    greedy = greedy_tokens(logits, SamplingParams(repetition_penalty=1.3), history, 2, block)
    for i in range(4):
        one_hot = sampling_distribution(logits[i], SamplingParams(repetition_penalty=1.3),
                                        history + block[:i], 2)
        assert greedy[i] == int(one_hot.argmax())


def test_the_argmax_always_survives_filtering():
    logits = torch.tensor([5.0, 0.0, 0.0])
    probs = sampling_distribution(
        logits, SamplingParams(temperature=0.1, top_k=1, top_p=0.01, min_p=1.0), []
    )
    assert probs.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("top_p,scale", [(0.9, 3.0), (0.5, 1.0), (0.99, 0.05), (0.3, 8.0)])
def test_top_p_over_a_large_vocab_equals_the_full_sort_definition(top_p, scale):
    # Peaked rows take the top-candidates path, flat rows (scale 0.05) the full sort.
    torch.manual_seed(1)
    logits = torch.randn(3, 5000) * scale
    got = sampling_distributions(logits, SamplingParams(temperature=1.0, top_p=top_p), [])
    probs = torch.softmax(logits, -1)
    for row, expected_row in zip(got, probs, strict=True):
        sorted_probs, order = torch.sort(expected_row, descending=True)
        cutoff = int((torch.cumsum(sorted_probs, 0) - sorted_probs < top_p).sum())
        keep = torch.zeros(5000, dtype=torch.bool)
        keep[order[:max(cutoff, 1)]] = True
        expected = torch.where(keep, expected_row, torch.zeros_like(expected_row))
        torch.testing.assert_close(row, expected / expected.sum())
