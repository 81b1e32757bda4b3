"""Adaptive draft length: the chooser's trade-off, the tracker, the cost model, and that the
decode loop stays lossless with it on."""

import numpy as np
import pytest
from drafters import FixedDrafter, exact_marginals, plain_decode, tiny_decoder, tv_tolerance

from coordinator.step.adaptive import (
    AcceptanceTracker,
    AdaptiveDraftLength,
    ForwardCostModel,
    calibrate,
    choose_draft_len,
    expected_tokens,
)
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams

# The measured CPU curve from the issue: 1 token 57 ms, 2-8 tokens ~97 ms, then slow growth.
CPU = {1: 0.057, 2: 0.097, 8: 0.097, 16: 0.114, 32: 0.143}


def linear(per_token: float, base: float = 1.0) -> ForwardCostModel:
    """A synthetic cost ``base + per_token * (n - 1)``, frozen (measured steps leave it)."""
    return ForwardCostModel({1: base, 64: base + per_token * 63}, alpha=0.0)


# ---- the chooser ----


def test_expected_tokens_matches_the_closed_form_for_a_constant_rate():
    a, k = 0.7, 5
    assert expected_tokens([a] * k, k) == pytest.approx((1 - a ** (k + 1)) / (1 - a))
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1 + 0.9)  # stops at a 0


def test_zero_acceptance_chooses_plain_decoding():
    for model in (linear(0.0), linear(0.01), ForwardCostModel(CPU)):
        assert choose_draft_len([0.0] * 16, model, 16) == 0


def test_perfect_acceptance_on_a_slowly_growing_cost_chooses_the_maximum():
    assert choose_draft_len([1.0] * 12, linear(0.02), 12) == 12
    assert choose_draft_len([1.0] * 30, ForwardCostModel(CPU), 30) == 30


def test_intermediate_acceptance_chooses_an_intermediate_length():
    # Per-token cost 0.05: k drafts at rate 0.8 pay off until the geometric tail thins out.
    model = linear(0.05)
    k = choose_draft_len([0.8] * 16, model, 16)
    assert 0 < k < 16
    # It is the argmax of expected tokens per second, checked by brute force.
    scores = [expected_tokens([0.8] * 16, j) / model.cost(j + 1) for j in range(17)]
    assert k == int(np.argmax(scores))


def test_a_steeper_cost_curve_lowers_the_length():
    rates = [0.8] * 16
    ks = [choose_draft_len(rates, linear(slope), 16) for slope in (0.01, 0.05, 0.2, 1.0)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]
    assert ks[-1] == 0  # a second token costing as much as the first never pays at 0.8


def test_the_cpu_curve_needs_a_high_rate_for_one_draft_but_not_for_many():
    # cost(2) / cost(1) = 1.7: one draft pays only above 0.7 acceptance, but 2..8 tokens
    # cost the same, so a longer block amortises the step at a lower rate.
    model = ForwardCostModel(CPU)
    assert choose_draft_len([0.6], model, 1) == 0
    assert choose_draft_len([0.75], model, 1) == 1
    assert choose_draft_len([0.6] * 7, model, 7) == 7


def test_the_drafter_call_the_step_waits_for_prices_drafting_in():
    """A forward of 3.7 ms and a drafter call of 1.5 ms (the native q8 target and a served
    suffix drafter): one draft accepted a third of the time pays for its row but not for
    the call; accepted 90% of the time it pays for both; the call's cost never changes
    what the score of not drafting is."""
    model = ForwardCostModel({1: 0.0037, 2: 0.0040, 4: 0.0045, 8: 0.0058}, alpha=0.0)
    assert choose_draft_len([0.33] * 3, model, 3) > 0
    assert choose_draft_len([0.33] * 3, model, 3, call_cost=0.0015) == 0
    assert choose_draft_len([0.9] * 3, model, 3, call_cost=0.0015) == 3
    k = choose_draft_len([0.7] * 8, model, 8, call_cost=0.0015)
    scores = [1 / model.cost(1)] + [expected_tokens([0.7] * 8, j) / (model.cost(j + 1) + 0.0015)
                                    for j in range(1, 9)]
    assert k == int(np.argmax(scores))
    with pytest.raises(ValueError, match="call_cost"):
        choose_draft_len([0.5], model, 1, call_cost=-1.0)


def test_batch_tokens_price_the_drafts_at_the_margin_of_the_shared_forward():
    # Cost is flat up to 8 tokens, then grows fast. Alone, 7 drafts fit under the knee;
    # with 6 tokens of other requests in the step, only 1 does.
    model = ForwardCostModel({1: 1.0, 8: 1.0, 9: 3.0})
    rates = [0.9] * 12
    alone = choose_draft_len(rates, model, 12)
    shared = choose_draft_len(rates, model, 12, batch_tokens=6)
    assert alone == 7 and shared == 1
    # And the opposite: a cost that is steep at first and flat later makes drafting cheap
    # at the margin of a busy step, while alone a single draft already doubles the cost.
    model = ForwardCostModel({1: 1.0, 2: 2.0, 64: 2.2})
    assert choose_draft_len([0.5] * 4, model, 4) == 0
    assert choose_draft_len([0.5] * 4, model, 4, batch_tokens=8) == 4


def test_chooser_rejects_bad_arguments():
    model = linear(0.1)
    with pytest.raises(ValueError):
        choose_draft_len([0.5] * 3, model, 4)  # too few rates
    with pytest.raises(ValueError):
        choose_draft_len([1.5], model, 1)
    with pytest.raises(ValueError):
        choose_draft_len([0.5], model, 1, batch_tokens=-1)
    assert choose_draft_len([], model, 0) == 0


# ---- the acceptance tracker ----


def test_tracker_starts_at_its_prior_and_unreached_positions_stay_there():
    tracker = AcceptanceTracker(prior=[0.9, 0.6], prior_weight=2.0, decay=1.0)
    assert tracker.rates(3) == [0.9, 0.6, 0.6]
    tracker.record(4, 1)  # position 0 accepted, 1 rejected, 2-3 never reached
    assert tracker.rates(4) == pytest.approx([(1 + 1.8) / 3, (0 + 1.2) / 3, 0.6, 0.6])


def test_tracker_weighs_recent_steps_more():
    # The same evidence in opposite orders: the one ending in acceptances reads higher.
    late_good, late_bad = AcceptanceTracker(decay=0.8), AcceptanceTracker(decay=0.8)
    for _ in range(5):
        late_good.record(1, 0)
        late_bad.record(1, 1)
    for _ in range(5):
        late_good.record(1, 1)
        late_bad.record(1, 0)
    assert late_good.rates(1)[0] > 0.5 > late_bad.rates(1)[0]
    # Without decay the order does not matter.
    a, b = AcceptanceTracker(decay=1.0), AcceptanceTracker(decay=1.0)
    for ok in [0] * 5 + [1] * 5:
        a.record(1, ok)
    for ok in [1] * 5 + [0] * 5:
        b.record(1, ok)
    assert a.rates(1) == pytest.approx(b.rates(1))


def test_tracker_converges_to_the_observed_rate_and_fades_back_to_the_prior():
    tracker = AcceptanceTracker(prior=0.5, prior_weight=1.0, decay=0.95)
    for _ in range(200):
        tracker.record(1, 0)
    assert tracker.rates(1)[0] < 0.05
    for _ in range(200):  # steps that draft nothing only age the evidence
        tracker.record(0, 0)
    assert tracker.rates(1)[0] == pytest.approx(0.5, abs=1e-3)


def test_a_chained_tracker_carries_evidence_to_positions_not_yet_reached():
    chained = AcceptanceTracker(prior=0.5, prior_weight=1.0, decay=1.0, chain=True)
    unchained = AcceptanceTracker(prior=0.5, prior_weight=1.0, decay=1.0)
    for tracker in (chained, unchained):
        tracker.record(2, 2)  # both drafts accepted
    assert unchained.rates(4) == pytest.approx([0.75, 0.75, 0.5, 0.5])
    assert chained.rates(4) == pytest.approx([0.75, 0.875, 0.875, 0.875])
    miss = AcceptanceTracker(prior=0.5, prior_weight=1.0, decay=1.0, chain=True)
    miss.record(3, 0)  # an early miss reads low everywhere
    assert miss.rates(3) == pytest.approx([0.25, 0.25, 0.25])


def test_tracker_rejects_impossible_counts():
    tracker = AcceptanceTracker()
    for drafted, accepted in [(-1, 0), (2, 3), (2, -1)]:
        with pytest.raises(ValueError):
            tracker.record(drafted, accepted)
    with pytest.raises(ValueError):
        AcceptanceTracker(prior=1.2)
    with pytest.raises(ValueError):
        AcceptanceTracker(decay=0.0)


# ---- the cost model ----


def test_cost_model_interpolates_and_extrapolates_between_points():
    model = ForwardCostModel(CPU)
    assert model.cost(1) == 0.057 and model.cost(8) == 0.097
    assert model.cost(4) == pytest.approx(0.097)  # flat 2..8
    assert model.cost(12) == pytest.approx((0.097 + 0.114) / 2)
    assert model.cost(64) == pytest.approx(0.143 + (0.143 - 0.114) / 16 * 32)
    assert ForwardCostModel({4: 0.5}).cost(1) == 0.5 == ForwardCostModel({4: 0.5}).cost(9)
    # A last segment that falls is not extended downwards.
    assert ForwardCostModel({1: 2.0, 2: 1.0}).cost(10) == 1.0
    with pytest.raises(ValueError):
        model.cost(0)
    with pytest.raises(ValueError):
        ForwardCostModel({})
    with pytest.raises(ValueError):
        ForwardCostModel({0: 1.0})
    with pytest.raises(ValueError):
        ForwardCostModel({1: -1.0})


def test_cost_model_observations_move_their_bucket_by_the_ema_weight():
    model = ForwardCostModel({1: 1.0, 9: 2.0}, alpha=0.25)
    model.observe(9, 4.0)
    assert model.cost(9) == pytest.approx(2.5)
    assert model.cost(5) == pytest.approx(1.75)  # the segment follows its endpoint
    # A new size becomes a bucket seeded with the prediction, then moved the same way.
    model.observe(5, 3.75)
    assert model.points()[5] == pytest.approx(1.75 + 0.25 * 2.0)
    assert model.cost(3) == pytest.approx((1.0 + 2.25) / 2)
    for _ in range(100):
        model.observe(1, 0.5)
    assert model.cost(1) == pytest.approx(0.5)


def test_calibrate_measures_every_size_on_a_real_decoder():
    decoder = tiny_decoder(8)
    model = calibrate(decoder, cache_len=32, sizes=(1, 4), repeats=1)
    assert sorted(model.points()) == [1, 4]
    assert all(s > 0 for s in model.points().values())
    with pytest.raises(ValueError):
        calibrate(decoder, cache_len=250, sizes=(16,))  # past the 256-token context


# ---- the policy ----


def test_policy_stops_drafting_for_a_drafter_that_never_hits():
    policy = AdaptiveDraftLength(ForwardCostModel(CPU))
    # At the prior (0.5) 7 drafts pay: 8 tokens cost what 2 do; a 9th token costs more.
    assert policy.next_len(10, 8) == 7
    for _ in range(3):
        policy.update(8, 0)
    assert policy.next_len(10, 8) == 0
    assert policy.next_len(0, 8) == 0 and policy.next_len(10, None) == 0
    assert policy.chosen == [7, 0, 0, 0]


def test_a_step_the_drafter_left_empty_neither_counts_nor_ages_the_evidence():
    policy = AdaptiveDraftLength(linear(0.0), AcceptanceTracker(decay=0.5, chain=True))
    assert policy.next_len(10) > 0
    policy.update(4, 1)
    after_miss = policy.tracker.rates(3)
    assert policy.next_len(10) > 0
    policy.update(0, 0)  # asked for drafts, the drafter had none: no information
    assert policy.tracker.rates(3) == after_miss
    assert policy.next_len(0) == 0
    policy.update(0, 0)  # chose not to draft: the evidence fades towards the prior
    assert policy.tracker.rates(3) != after_miss
    assert not policy.awaiting_update


def test_a_frozen_cost_model_ignores_measurements():
    model = ForwardCostModel({1: 1.0, 8: 2.0}, alpha=0.0)
    model.observe(8, 100.0)
    model.observe(4, 100.0)
    assert model.points() == {1: 1.0, 8: 2.0}
    with pytest.raises(ValueError):
        ForwardCostModel({1: 1.0}, alpha=1.5)


def test_policy_respects_budget_and_drafter_limit():
    policy = AdaptiveDraftLength(linear(0.0), AcceptanceTracker(prior=1.0))
    assert policy.next_len(5, 9) == 5
    assert policy.next_len(20, 9) == 9
    assert policy.next_len(7, None) == 7


# ---- the decode loop ----


def _decode(decoder, prompt, drafter, adaptive, max_new, params=None, seed=0):
    return speculative_decode_with(
        decoder, prompt, decoder.new_cache(), drafter,
        SpeculativeOptions(max_new_tokens=max_new, sampling=params or SamplingParams(),
                           seed=seed),
        adaptive=adaptive,
    )


@pytest.mark.parametrize("prompt", [[1, 2, 3, 4, 1, 2], [4, 1, 7, 1, 4, 1], [5], [2, 2, 2]])
def test_greedy_output_is_identical_with_adaptive_on_and_off(prompt):
    decoder = tiny_decoder(8, seed=3)
    reference = plain_decode(decoder, prompt, 30)
    off = _decode(decoder, prompt, PromptLookupSpeculator(1, 6), None, 30)
    policy = AdaptiveDraftLength(ForwardCostModel(CPU))
    on = _decode(decoder, prompt, PromptLookupSpeculator(1, 6), policy, 30)
    assert on.generated_tokens == off.generated_tokens == reference
    # The policy was asked each drafting step, never beyond the lookup's 6, and capped
    # every draft the target evaluated.
    assert policy.chosen and max(policy.chosen) <= 6
    assert on.drafted_tokens <= sum(policy.chosen)


def test_a_zero_length_choice_skips_the_drafter_and_the_steps_still_commit():
    decoder = tiny_decoder(8)
    prompt = [1, 2, 3]
    reference = plain_decode(decoder, prompt, 12)
    # Drafts that are always wrong: after the first step the policy stops asking.
    wrong = [(t + 1) % 8 for t in reference]
    drafter = FixedDrafter(DraftBlock.deterministic(wrong[1:5]))
    policy = AdaptiveDraftLength(ForwardCostModel(CPU), AcceptanceTracker(decay=1.0))
    out = _decode(decoder, prompt, drafter, policy, 12)
    assert out.generated_tokens == reference
    assert 0 in policy.chosen
    assert len(drafter.seen_max_len) == sum(1 for k in policy.chosen if k > 0)
    assert out.verification_steps == 11  # one token per step, as in plain decoding


def test_default_keeps_the_fixed_budget():
    decoder = tiny_decoder(8)
    drafter = FixedDrafter(DraftBlock.deterministic([0, 1, 2]))
    _decode(decoder, [1, 2, 3], drafter, None, 6)
    assert drafter.seen_max_len[0] == 4  # the request's full budget (6 - 2), untouched


SAMPLED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(temperature=1.2, top_p=0.9, repetition_penalty=1.2),
]


@pytest.mark.parametrize("params", SAMPLED, ids=["t1", "topk", "topp-penalty"])
def test_seeded_sampled_output_is_identical_plain_fixed_and_adaptive(params):
    # Point-mass drafts are judged by the draw plain sampling makes (specd_core.rule), so
    # a seed fixes the output whatever the draft lengths.
    decoder = tiny_decoder(8, seed=3)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    accepted, schedules = 0, set()
    for seed in range(6):
        plain = _decode(decoder, prompt, None, None, 24, params, seed)
        fixed = _decode(decoder, prompt, PromptLookupSpeculator(1, 6), None, 24, params, seed)
        policy = AdaptiveDraftLength(linear(0.3), AcceptanceTracker(prior=0.6, chain=True))
        adaptive = _decode(decoder, prompt, PromptLookupSpeculator(1, 6), policy, 24, params,
                           seed)
        assert plain.generated_tokens == fixed.generated_tokens == adaptive.generated_tokens
        accepted += fixed.accepted_tokens + adaptive.accepted_tokens
        schedules.add(tuple(policy.chosen))
    assert accepted > 0 and len(schedules) > 1  # drafts landed; lengths varied by seed


def test_sampling_with_adaptive_lengths_matches_the_exact_marginals():
    # A draft costs half a forward and the prior (0.6) pays for one, so the policy drafts
    # first, then keeps or drops drafting per seed as drafts land or miss: the rule runs at
    # k chosen from earlier outcomes. Compared against enumerated marginals.
    decoder = tiny_decoder(6, seed=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    seeds, max_new = 1500, 4
    exact = exact_marginals(decoder, prompt, params, max_new)
    model = linear(0.5)
    counts = np.zeros((max_new, decoder.config.vocab_size))
    schedules = set()
    for seed in range(seeds):
        policy = AdaptiveDraftLength(model, AcceptanceTracker(prior=0.6))
        out = _decode(decoder, prompt, PromptLookupSpeculator(1, 3), policy, max_new, params,
                      seed)
        schedules.add(tuple(policy.chosen))
        for i, token in enumerate(out.generated_tokens):
            counts[i, token] += 1
    assert {(1, 1), (1, 0)} <= schedules, schedules  # k did depend on earlier outcomes
    got = counts / seeds
    for i in range(max_new):
        tv = np.abs(got[i] - exact[i]).sum() / 2
        assert tv < tv_tolerance(exact[i], seeds), (i, tv, got[i], exact[i])


def test_calibration_points_never_decrease_with_size():
    # A larger size reading cheaper is noise (a burst of load on a smaller size).
    from coordinator.step.adaptive import _monotone

    assert _monotone({1: [3.0, 2.0, 2.5], 4: [1.0], 8: [4.0], 16: []}) == {1: 2.5, 4: 2.5,
                                                                          8: 4.0}


def test_a_stalled_step_does_not_price_drafting_out_for_good():
    # SmolLM2-135M, one thread, 300 cached tokens: seconds per forward by tokens fed.
    points = {1: 0.027, 2: 0.028, 4: 0.031, 8: 0.062, 16: 0.09, 32: 0.133}
    model = ForwardCostModel(points)
    assert AdaptiveDraftLength(model).next_len(10, 10) > 0
    most = 1 + model.alpha * (ForwardCostModel.OUTLIER_FACTOR - 1)
    for n in (4, 2):  # the sizes a fresh request drafts, each stalled 2.6 s by another process
        model.observe(n, 2.6)
        assert model.points()[n] <= points[n] * most + 1e-12
        # Fresh requests still draft (sizes no longer chosen would never be re-measured).
        assert AdaptiveDraftLength(model).next_len(10, 10) > 0
    for _ in range(40):  # a lasting slowdown still comes through
        model.observe(1, 0.27)
    assert model.cost(1) == pytest.approx(0.27, rel=1e-3)


def test_a_restarted_replicas_slow_calibration_does_not_price_drafting_out_for_good():
    """After a restart the fresh process's calibration read larger sizes ~3x slow: alone it
    prices every draft out, and undrafted steps (one size) never correct the others; the
    lower of it and the previous incarnation's model drafts as before the restart."""
    from coordinator.step.adaptive import choose_draft_len, restarted_cost_model

    previous = ForwardCostModel({1: 0.030, 2: 0.032, 4: 0.035, 8: 0.040, 16: 0.050, 32: 0.070})
    slow = ForwardCostModel({1: 0.030, 2: 0.090, 4: 0.100, 8: 0.120, 16: 0.150, 32: 0.200})
    rates = [0.7] * 8
    before = choose_draft_len(rates, previous, 8)
    assert before > 0
    assert choose_draft_len(rates, slow, 8) == 0
    for _ in range(200):  # what follows alone: undrafted steps measure size 1 only
        slow.observe(1, 0.030)
    assert choose_draft_len(rates, slow, 8) == 0  # stuck: the bug
    merged = restarted_cost_model(slow, previous)
    assert choose_draft_len(rates, merged, 8) == before
    assert all(merged.cost(n) <= min(slow.cost(n), previous.cost(n)) + 1e-12
               for n in (1, 2, 4, 8, 16, 32))
    costs = [merged.cost(n) for n in range(1, 33)]
    assert costs == sorted(costs)  # still never cheaper for more tokens
    assert restarted_cost_model(slow, None) is slow  # a first start: its own calibration
    assert restarted_cost_model(None, previous) is previous
