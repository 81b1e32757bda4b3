"""The verification loop: losslessness, stops, cache bookkeeping, drafter plumbing and
counters (the seed's tests, ported by behaviour, plus the issue's additions)."""

import numpy as np
import pytest
import torch
from drafters import (
    FixedDrafter,
    OracleDrafter,
    TopKSamplingDrafter,
    exact_marginals,
    plain_decode,
    tiny_decoder,
    tv_tolerance,
)

from coordinator.step.speculative import speculative_decode, speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from specd_core.sampling import SamplingParams

# ---- losslessness ----


def test_speculative_decode_matches_greedy_token_for_token():
    prompt = [1, 2, 3, 4, 1, 2]
    decoder = tiny_decoder(8)
    result = speculative_decode(decoder, prompt, 6, decoder.new_cache(),
                                PromptLookupSpeculator(2, 3))
    # A separately constructed, identically seeded decoder, decoded token by token.
    assert result.generated_tokens == plain_decode(tiny_decoder(8), prompt, 6)


@pytest.mark.parametrize("drafter_seed", range(4))
def test_greedy_identity_holds_for_arbitrary_drafts(drafter_seed):
    # Drafts that are sometimes right and sometimes wrong, at varying lengths.
    decoder = tiny_decoder(8, seed=3)
    prompt = [4, 1, 7, 1, 4, 1]
    rng = np.random.default_rng(drafter_seed)
    blocks = [DraftBlock.deterministic(rng.integers(0, 8, size=int(k)).tolist())
              for k in rng.integers(0, 6, size=40)]

    class RandomDrafter:
        calls = 0

        def propose(self, history, target_hidden, max_len):
            self.calls += 1
            return blocks[self.calls % len(blocks)]

    out = speculative_decode(decoder, prompt, 30, decoder.new_cache(), RandomDrafter())
    assert out.generated_tokens == plain_decode(decoder, prompt, 30)


def _marginals_of(decoder, prompt, drafter_factory, params, max_new, seeds):
    counts = np.zeros((max_new, decoder.config.vocab_size))
    for seed in range(seeds):
        out = speculative_decode_with(
            decoder, prompt, decoder.new_cache(), drafter_factory(seed),
            SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=seed),
        )
        for i, token in enumerate(out.generated_tokens):
            counts[i, token] += 1
    return counts / seeds


@pytest.mark.slow  # ~35 s, 4000 decodes one by one; in the quick suite the same model, prompt,
# drafter and temperature are checked against the same exact marginals over 3000 seeds, batched:
# test_chunked_prefill.py::test_chunked_marginals_at_t1_are_exact.
def test_speculative_decode_at_temperature_matches_plain_sampling():
    # Compared against the target's exactly enumerated marginals, not a second noisy
    # estimate. The old argmax accept test passes every greedy test and fails this one.
    decoder = tiny_decoder(6, seed=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    seeds, max_new = 4000, 3
    exact = exact_marginals(decoder, prompt, params, max_new)
    got = _marginals_of(decoder, prompt, lambda s: PromptLookupSpeculator(2, 3), params,
                        max_new, seeds)
    for i in range(max_new):
        tv = np.abs(got[i] - exact[i]).sum() / 2
        assert tv < tv_tolerance(exact[i], seeds), (i, tv, got[i], exact[i])


def test_a_top_k_sampling_drafter_reports_its_truncated_q_and_stays_lossless():
    decoder = tiny_decoder(6, seed=1)
    draft_model = tiny_decoder(6, seed=9, n_layers=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    seeds, max_new = 1500, 3
    drafters = []

    def factory(seed):
        drafters.append(TopKSamplingDrafter(draft_model, k=2, top_k=3, seed=10_000 + seed))
        return drafters[-1]

    got = _marginals_of(decoder, prompt, factory, params, max_new, seeds)
    reported = [d for drafter in drafters for d in drafter.reported]
    assert reported and all(len(d.support()) == 3 for d in reported)
    assert all(abs(sum(p for _, p in d.support()) - 1) < 1e-6 for d in reported)
    exact = exact_marginals(decoder, prompt, params, max_new)
    for i in range(max_new):
        tv = np.abs(got[i] - exact[i]).sum() / 2
        assert tv < tv_tolerance(exact[i], seeds), (i, tv, got[i], exact[i])


def test_penalties_see_tokens_accepted_earlier_in_the_same_block():
    # Model and prompt chosen so that a block whose rows ignored earlier drafts diverges.
    decoder = tiny_decoder(16, seed=2)
    prompt = [1, 2, 3, 1, 2, 3]
    params = SamplingParams(repetition_penalty=1.3)
    reference = plain_decode(decoder, prompt, 24, params)
    assert reference != plain_decode(decoder, prompt, 24), "the penalty must matter here"
    # The oracle drafts the true penalised continuation: each accepted draft must change the
    # penalty of the rows after it, or a later row would reject and diverge.
    oracle = OracleDrafter(len(prompt), reference, k=5)
    out = speculative_decode_with(decoder, prompt, decoder.new_cache(), oracle,
                                  SpeculativeOptions(max_new_tokens=24, sampling=params))
    assert out.generated_tokens == reference
    assert out.accepted_tokens > 10
    lookup = speculative_decode_with(decoder, prompt, decoder.new_cache(),
                                     PromptLookupSpeculator(1, 4),
                                     SpeculativeOptions(max_new_tokens=24, sampling=params))
    assert lookup.generated_tokens == reference


def test_same_seed_same_tokens_and_different_seeds_differ():
    decoder = tiny_decoder(8)
    prompt = [1, 2, 3, 1, 2]

    def run(seed):
        return speculative_decode_with(
            decoder, prompt, decoder.new_cache(), PromptLookupSpeculator(2, 3),
            SpeculativeOptions(max_new_tokens=20, sampling=SamplingParams(temperature=1.0),
                               seed=seed),
        ).generated_tokens

    assert run(5) == run(5)
    assert len({tuple(run(s)) for s in range(6)}) > 1


# ---- stops and budgets ----

PROMPT = [3, 1, 4, 1, 5]
# Greedy, with penalties strong enough that a random model's output never repeats a token,
# so every stop below has one place to land.
DISTINCT = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=2.0)


@pytest.fixture(scope="module")
def wide():
    decoder = tiny_decoder(64, seed=4)
    return decoder, plain_decode(decoder, PROMPT, 16, DISTINCT)


@pytest.mark.parametrize("stop_index", range(7))
def test_a_stop_token_ends_the_output_wherever_it_lands(wide, stop_index):
    # Oracle drafts of 4: index 0 is the prefill's token, 1-4 are draft positions 0-3 of the
    # first block, 5 is its bonus token, 6 the next block's first draft.
    decoder, greedy = wide
    stop = greedy[stop_index]
    assert greedy.index(stop) == stop_index, "fixture: the stop token must be new there"
    cache = decoder.new_cache()
    out = speculative_decode_with(
        decoder, PROMPT, cache, OracleDrafter(len(PROMPT), greedy, k=4),
        SpeculativeOptions(max_new_tokens=16, stop_token_ids=(stop,), sampling=DISTINCT),
    )
    assert out.generated_tokens == greedy[:stop_index + 1]
    assert out.finish_reason == "stop"
    assert out.tokens_generated == stop_index + 1
    # Every counted draft was emitted: anchors are index 0 and each bonus (5, 10, ...).
    anchors = len([i for i in range(stop_index + 1) if i % 5 == 0])
    assert out.accepted_tokens == out.drafted_tokens == stop_index + 1 - anchors
    assert sum(out.evaluated_at_position) == out.drafted_tokens
    # The cache holds the prompt and every emitted token but the last.
    assert cache.seq_len == len(PROMPT) + stop_index


def test_max_new_tokens_is_exact_when_a_full_block_would_cross_it(wide):
    decoder, greedy = wide
    oracle = OracleDrafter(len(PROMPT), greedy, k=4)
    cache = decoder.new_cache()
    out = speculative_decode_with(decoder, PROMPT, cache, oracle,
                                  SpeculativeOptions(max_new_tokens=4, sampling=DISTINCT))
    assert out.generated_tokens == greedy[:4]
    assert out.finish_reason == "length"
    assert oracle.seen_max_len == [2]  # one anchor emitted, one kept for the last anchor
    assert cache.seq_len == len(PROMPT) + 3


@pytest.mark.parametrize("stop_index", [2, 3])
def test_a_stop_in_a_block_that_reaches_the_budget_finishes_as_stop(wide, stop_index):
    decoder, greedy = wide
    out = speculative_decode_with(
        decoder, PROMPT, decoder.new_cache(), OracleDrafter(len(PROMPT), greedy, k=4),
        SpeculativeOptions(max_new_tokens=4, stop_token_ids=(greedy[stop_index],),
                           sampling=DISTINCT),
    )
    assert out.generated_tokens == greedy[:stop_index + 1]
    assert out.finish_reason == "stop"


class _CharDetok:
    """Each token id decodes to one letter, so text positions equal token positions."""

    def __call__(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


@pytest.mark.parametrize("stop_index", [1, 3, 5, 6])
def test_a_stop_string_ends_the_output_at_the_token_completing_it(wide, stop_index):
    # A two-character stop string ending at stop_index spans the previous block/anchor and
    # the new one for several indices.
    decoder, greedy = wide
    detok = _CharDetok()
    text = detok(greedy)
    stop = text[stop_index - 1:stop_index + 1]
    first_end = text.index(stop) + len(stop) - 1
    out = speculative_decode_with(
        decoder, PROMPT, decoder.new_cache(), OracleDrafter(len(PROMPT), greedy, k=4),
        SpeculativeOptions(max_new_tokens=16, stop_strings=(stop,), detokenize=detok,
                           sampling=DISTINCT),
    )
    assert out.generated_tokens == greedy[:first_end + 1]
    assert out.finish_reason == "stop"


def test_stop_strings_need_a_detokenizer():
    with pytest.raises(ValueError, match="detokenize"):
        SpeculativeOptions(max_new_tokens=4, stop_strings=("x",))


def test_a_drafter_that_is_always_wrong_still_commits_a_token_per_step(wide):
    decoder, greedy = wide
    wrong = next(t for t in range(64) if t not in greedy)
    drafter = FixedDrafter(DraftBlock.deterministic([wrong] * 4))
    out = speculative_decode_with(decoder, PROMPT, decoder.new_cache(), drafter,
                                  SpeculativeOptions(max_new_tokens=16, sampling=DISTINCT))
    assert out.generated_tokens == greedy
    assert out.accepted_tokens == 0
    assert out.verification_steps == 15  # one token per step after the prefill's
    assert out.finish_reason == "length"


# ---- seed: savings ----


def test_speculative_decode_saves_real_calls_when_drafts_hit():
    decoder = tiny_decoder(8)
    result = speculative_decode(decoder, [1, 2, 3, 1, 2], 8, decoder.new_cache(),
                                PromptLookupSpeculator(2, 4))
    assert result.tokens_generated == 8
    # Plain decoding needs exactly 8 calls (prefill + one per token but the last).
    assert result.forward_calls <= 8


def test_with_no_repeats_it_falls_back_to_one_token_per_call():
    decoder = tiny_decoder(8)
    result = speculative_decode(decoder, [1, 2, 3], 5, decoder.new_cache(),
                                PromptLookupSpeculator(10, 4))
    assert result.tokens_generated == 5
    assert result.forward_calls == 1 + 5 - 1
    assert result.drafted_tokens == 0
    assert result.accept_rate() is None


# ---- seed: drafter plumbing ----


def test_the_drafter_is_asked_to_continue_the_anchor_token():
    decoder = tiny_decoder(8)
    prompt = [1, 2, 3]
    drafter = FixedDrafter(DraftBlock.deterministic([5, 6]))
    result = speculative_decode(decoder, prompt, 6, decoder.new_cache(), drafter)
    assert drafter.seen_history, "the drafter must be consulted"
    for history in drafter.seen_history:
        # The committed prefix, ending with the pending anchor the block will follow.
        generated = history[len(prompt):]
        assert history[:len(prompt)] == prompt
        assert generated and generated == result.generated_tokens[:len(generated)]
    assert drafter.seen_history[0][len(prompt)] == result.generated_tokens[0]


def test_the_drafter_receives_full_width_hidden_rows_for_every_committed_position():
    decoder = tiny_decoder(8)
    prompt = [1, 2, 3]
    drafter = FixedDrafter(DraftBlock.deterministic([5, 6]))
    speculative_decode(decoder, prompt, 6, decoder.new_cache(), drafter)
    hidden_size = decoder.config.hidden_size
    assert drafter.seen_hidden and all(h is not None for h in drafter.seen_hidden)
    assert all(h.shape[-1] == hidden_size for h in drafter.seen_hidden)
    # First call: one row per prompt position; then one per position committed since.
    assert drafter.seen_hidden[0].shape[0] == len(prompt)
    for before, after, hidden in zip(drafter.seen_history, drafter.seen_history[1:],
                                     drafter.seen_hidden[1:], strict=False):
        assert hidden.shape[0] == len(after) - len(before)
    # And they are the target's real final-norm states for those positions.
    rows = torch.cat(drafter.seen_hidden)
    last = drafter.seen_history[-1]
    _, reference = decoder.forward_batch_with_hidden(last[:-1], 0, decoder.new_cache())
    torch.testing.assert_close(rows, reference, atol=1e-5, rtol=1e-4)


# ---- seed: cache resume and rollback ----


def test_resuming_a_warm_cache_gives_the_same_tokens_as_one_fresh_run():
    decoder = tiny_decoder(8)
    speculator = PromptLookupSpeculator(2, 3)
    full = [1, 2, 3, 4, 1, 2]
    cold = speculative_decode(decoder, full, 6, decoder.new_cache(), speculator)
    warm = decoder.new_cache()
    decoder.forward_batch(full[:4], 0, warm)
    resumed = speculative_decode_with(decoder, full[4:], warm, speculator,
                                      SpeculativeOptions(max_new_tokens=6, start_pos=4))
    assert resumed.generated_tokens == cold.generated_tokens


def test_rolls_back_to_absolute_positions_on_a_warm_cache():
    decoder = tiny_decoder(8)
    context, prompt, max_new = [1, 2, 3, 4], [5, 6], 6
    cache = decoder.new_cache()
    decoder.forward_batch(context, 0, cache)
    drafter = FixedDrafter(DraftBlock.deterministic([7, 7, 7]))
    result = speculative_decode_with(decoder, prompt, cache, drafter,
                                     SpeculativeOptions(max_new_tokens=max_new,
                                                        start_pos=len(context)))
    assert result.tokens_generated == max_new
    assert result.drafted_tokens > result.accepted_tokens, "rollback must have run"
    assert cache.seq_len == len(context) + len(prompt) + max_new - 1
    # The surviving KV is exactly that of the committed tokens: continuing from it gives the
    # logits a fresh cache computes for the same sequence.
    committed = context + prompt + result.generated_tokens
    after = decoder.forward_batch([committed[-1]], cache.seq_len, cache)
    fresh = decoder.forward_batch(committed, 0, decoder.new_cache())[-1:]
    torch.testing.assert_close(after, fresh, atol=1e-5, rtol=1e-4)


def test_a_resumed_run_continues_a_previous_one():
    decoder = tiny_decoder(8)
    speculator = PromptLookupSpeculator(2, 3)
    prompt = [1, 2, 3, 4, 1, 2]
    long = speculative_decode(decoder, prompt, 8, decoder.new_cache(), speculator)
    cache = decoder.new_cache()
    first = speculative_decode(decoder, prompt, 4, cache, speculator)
    # The last token's KV is not cached yet: it is the continuation's prompt.
    second = speculative_decode_with(
        decoder, first.generated_tokens[-1:], cache, speculator,
        SpeculativeOptions(max_new_tokens=5, start_pos=len(prompt) + 4 - 1),
    )
    assert (first.generated_tokens[:-1] + second.generated_tokens)[:8] == long.generated_tokens


def test_a_mismatched_start_pos_is_refused_rather_than_silently_wrong():
    decoder = tiny_decoder(8)
    cache = decoder.new_cache()
    decoder.forward_batch([1, 2, 3], 0, cache)
    with pytest.raises(ValueError, match="start_pos must be the cache's current length"):
        speculative_decode(decoder, [4, 5], 2, cache, PromptLookupSpeculator(2, 2))


def test_bad_requests_are_refused_before_any_forward():
    decoder = tiny_decoder(8)
    cache = decoder.new_cache()
    with pytest.raises(ValueError, match="prompt must not be empty"):
        speculative_decode(decoder, [], 2, cache)
    with pytest.raises(ValueError, match="context"):
        speculative_decode(decoder, [1, 2], decoder.config.max_seq_len, cache)
    with pytest.raises(ValueError, match="max_new_tokens"):
        SpeculativeOptions(max_new_tokens=-1)
    assert cache.seq_len == 0


def test_zero_new_tokens_is_an_empty_run():
    decoder = tiny_decoder(8)
    out = speculative_decode(decoder, [1, 2], 0, decoder.new_cache())
    assert out.generated_tokens == [] and out.forward_calls == 0


# ---- seed: acceptance metrics ----


def test_per_position_accept_rates_expose_suffix_decay():
    result = SpeculativeDecodeResult()
    for _ in range(100):
        result.record_position(0, True)
        result.record_position(1, False)
    result.verification_steps = 100
    result.tokens_generated = 200
    assert result.accept_rate() == 0.5
    assert result.accept_rate_per_position() == [1.0, 0.0]
    assert result.acceptance_length() == 2.0


def test_positions_after_a_rejection_are_not_counted_as_drafted():
    decoder = tiny_decoder(8)
    drafter = FixedDrafter(DraftBlock.deterministic([7, 7, 7, 7]))
    result = speculative_decode(decoder, [1, 2, 3], 6, decoder.new_cache(), drafter)
    evaluated, accepted = result.evaluated_at_position, result.accepted_at_position
    assert result.drafted_tokens > result.accepted_tokens, "something must be rejected"
    for i in range(1, len(evaluated)):
        # Position i is reached only when position i-1 was accepted.
        assert evaluated[i] <= accepted[i - 1], (evaluated, accepted)
    assert result.drafted_tokens == sum(evaluated)
    assert result.accepted_tokens == sum(accepted)


def test_acceptance_length_is_reported_per_verification_step_not_per_call():
    decoder = tiny_decoder(8)
    result = speculative_decode(decoder, [1, 2, 3, 1, 2], 6, decoder.new_cache(),
                                PromptLookupSpeculator(2, 3))
    assert result.verification_steps == result.forward_calls - 1
    assert result.acceptance_length() >= 1.0
    assert result.acceptance_length() > result.tokens_per_call()


def test_an_empty_run_reports_no_acceptance_length_rather_than_zero():
    result = SpeculativeDecodeResult()
    assert result.acceptance_length() is None
    assert result.accept_rate() is None
    assert result.tokens_per_call() == 0.0
