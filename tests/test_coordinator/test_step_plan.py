"""The step's scheduling decision alone (`coordinator.step.plan`): no Ray, no sockets, no
model. Verify blocks come first, prompt chunks share what is left of the token budget,
shortest remaining prompt first, with a cap on prompts left half-done."""

from __future__ import annotations

import pytest

from coordinator.step.plan import IDLE_BUDGET_FACTOR, ChunkPolicy, plan_prefill_chunks


def test_without_a_budget_every_prompt_is_computed_whole():
    assert plan_prefill_chunks([300, 5, 7000], [False, True, False], 40, ChunkPolicy()) == [
        300, 5, 7000]


def test_verify_blocks_come_first_and_chunks_fill_the_rest_of_the_budget():
    policy = ChunkPolicy(max_batched_tokens=64, max_partial_prefills=4)
    chunks = plan_prefill_chunks([100, 100], [False, False], verify_tokens=24, policy=policy)
    assert sum(chunks) == 64 - 24
    assert chunks == [40, 0]  # one partial chunk holds the whole rest; the other waits


def test_short_prompts_finish_before_a_long_one_takes_the_rest():
    policy = ChunkPolicy(max_batched_tokens=100, max_partial_prefills=1)
    # The long prompt was admitted first and is half-done; two short ones arrive while one
    # request decodes (a 1-token verify block).
    chunks = plan_prefill_chunks([5000, 10, 30], [True, False, False], 1, policy)
    assert chunks == [59, 10, 30]


def test_no_more_prompts_are_left_half_done_than_the_cap():
    policy = ChunkPolicy(max_batched_tokens=256, max_partial_prefills=1)
    # A half-done prompt holds the one partial place: a new long one waits, whole-fitting
    # ones still go.
    assert plan_prefill_chunks([4000, 3000], [True, False], 6, policy) == [250, 0]
    assert plan_prefill_chunks([4000, 100], [True, False], 6, policy) == [150, 100]
    # Once it finishes within the step, its place frees for the next.
    assert plan_prefill_chunks([50, 3000], [True, False], 6, policy) == [50, 200]
    two = ChunkPolicy(max_batched_tokens=256, max_partial_prefills=2)
    assert plan_prefill_chunks([4000, 3000], [True, False], 6, two) == [0, 250]


def test_prefill_always_gets_a_quarter_of_the_budget_so_admission_never_starves():
    policy = ChunkPolicy(max_batched_tokens=64)
    assert plan_prefill_chunks([100], [False], verify_tokens=500, policy=policy) == [16]
    assert ChunkPolicy(max_batched_tokens=2).prefill_budget(10) == 1


def test_ties_keep_admission_order():
    policy = ChunkPolicy(max_batched_tokens=11, max_partial_prefills=1)
    assert plan_prefill_chunks([8, 8, 8], [False, False, False], 1, policy) == [8, 2, 0]


def test_a_step_that_verifies_nothing_takes_bigger_chunks():
    policy = ChunkPolicy(max_batched_tokens=256)
    assert plan_prefill_chunks([5000], [True], 0, policy) == [IDLE_BUDGET_FACTOR * 256]
    assert plan_prefill_chunks([5000], [True], 1, policy) == [255]


@pytest.mark.parametrize("field,value", [("max_batched_tokens", 0),
                                         ("max_partial_prefills", 0),
                                         ("max_batched_tokens", True),
                                         ("max_partial_prefills", 1.5)])
def test_a_bad_policy_names_its_field(field, value):
    with pytest.raises(ValueError, match=field):
        ChunkPolicy(**{field: value})


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="entries"):
        plan_prefill_chunks([1, 2], [False], 0, ChunkPolicy(8))
    with pytest.raises(ValueError, match=">= 1"):
        plan_prefill_chunks([0], [False], 0, ChunkPolicy(8))
