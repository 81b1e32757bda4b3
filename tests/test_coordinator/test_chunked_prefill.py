"""Chunked prefill and prefix reuse through the scheduler that serves: greedy tokens equal to
unchunked and plain decoding at several budgets (dense and MoE), exact marginals at T=1 with
chunks, a request cancelled mid-prefill leaving no stale KV, hidden rows arriving chunk by
chunk as whole, and a reused prefix giving the same tokens (greedy and seeded)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from drafters import FixedDrafter, exact_marginals, plain_decode, tiny_decoder, tv_tolerance
from test_service import REPEATING

from coordinator.step.adaptive import ForwardCostModel
from coordinator.step.plan import ChunkPolicy
from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

FLAT = ForwardCostModel({1: 0.002, 2: 0.0021, 8: 0.0022, 32: 0.003}, alpha=0)
MODELS = ["tiny-random:vocab=64,seed=0,layers=2", "tiny-random:vocab=64,seed=1,layers=2,dense=1"]
LONG = [(7 * i + 3) % 61 + 1 for i in range(90)]  # 90 tokens: many chunks at small budgets


class RecordingTarget(LocalTarget):
    """An in-process target that records every call's items (and yields to the loop first,
    as a remote one does)."""

    def __init__(self, engine, on_call=None):
        super().__init__(engine)
        self.calls: list[list] = []
        self.on_call = on_call

    async def verify(self, items):
        await asyncio.sleep(0)
        self.calls.append(list(items))
        if self.on_call is not None:
            self.on_call(items)
        return self.engine.verify(items)

    async def prefill(self, items):
        return await self.verify(items)


def run(decoder, drafter, prompts, options, chunking=None, prefix_caching=True, pipeline=True,
        max_active=8, engine=None, target_factory=RecordingTarget):
    """Decodes ``prompts`` through one scheduler; returns (results, scheduler, target)."""
    if isinstance(options, SpeculativeOptions):
        options = [options] * len(prompts)

    async def go():
        local = None if drafter is None else LocalDrafter(drafter)
        target = target_factory(engine or TargetEngine(decoder, max_slots=max_active))
        sched = Scheduler(target, local, max_active=max_active, adaptive=False, cost_model=FLAT,
                          pipeline=pipeline, hidden_dtype=torch.float32,
                          wants_hidden=local is not None and local.capabilities.wants_hidden,
                          chunking=chunking, prefix_caching=prefix_caching)
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        await asyncio.sleep(0)
        return [r.decode.result for r in reqs], sched, target

    return asyncio.run(go())


@pytest.mark.parametrize("model", MODELS, ids=["moe", "dense"])
@pytest.mark.parametrize("budget", [1, 7, 16, 64, None])
def test_chunked_greedy_tokens_equal_unchunked_and_plain(model, budget):
    decoder = load_model(model)[0]
    # More prompt tokens than an idle step's budget at 64 (IDLE_BUDGET_FACTOR x 64).
    prompts = [LONG, REPEATING, [11, 3, 40, 22, 17, 9, 31], LONG[:33] + REPEATING,
               [(5 * i + 1) % 61 + 2 for i in range(120)]]
    opts = SpeculativeOptions(max_new_tokens=24)
    lookup = PromptLookupSpeculator(2, 6)
    chunked, _, target = run(decoder, lookup, prompts, opts,
                             ChunkPolicy(budget, max_partial_prefills=2))
    whole, _, _ = run(decoder, lookup, prompts, opts)
    for prompt, a, b in zip(prompts, chunked, whole, strict=True):
        assert a.generated_tokens == b.generated_tokens == plain_decode(decoder, prompt, 24)
    chunks = [item for call in target.calls for item in call if isinstance(item, PrefillItem)]
    if budget is not None and budget < len(LONG):
        assert any(not c.last for c in chunks), "no prompt was split"
        # Prompt chunks shared steps with other requests' verify blocks.
        assert any(len(call) > 1 and not all(isinstance(i, PrefillItem) for i in call)
                   for call in target.calls if any(isinstance(i, PrefillItem) for i in call))
    per_step = [sum(len(i.tokens) for i in call if isinstance(i, PrefillItem))
                for call in target.calls]
    if budget is not None:
        verify = [sum(len(i.tokens) for i in call if not isinstance(i, PrefillItem))
                  for call in target.calls]
        assert all(p <= ChunkPolicy(budget).prefill_budget(v)
                   for p, v in zip(per_step, verify, strict=True))


def test_chunked_marginals_at_t1_are_exact():
    decoder = tiny_decoder(6, seed=1)
    prompt, params, seeds, max_new, batch = [1, 2, 3, 1, 2], SamplingParams(temperature=1.0), \
        3000, 4, 500
    counts = np.zeros((max_new, 6))
    split = 0
    for start in range(0, seeds, batch):
        opts = [SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=s)
                for s in range(start, start + batch)]
        results, _, target = run(decoder, PromptLookupSpeculator(1, 3), [prompt] * batch, opts,
                                 ChunkPolicy(64, max_partial_prefills=3), max_active=batch)
        split += sum(1 for call in target.calls for i in call
                     if isinstance(i, PrefillItem) and not i.last)
        for r in results:
            for i, token in enumerate(r.generated_tokens):
                counts[i, token] += 1
    exact = exact_marginals(decoder, prompt, params, max_new)
    for i in range(max_new):
        tv = np.abs(counts[i] / seeds - exact[i]).sum() / 2
        assert tv < tv_tolerance(exact[i], seeds), (i, tv)
    assert split > 0  # prompts really were split across steps


def test_a_request_cancelled_mid_prefill_frees_its_slot_and_leaves_no_stale_kv():
    decoder = load_model(MODELS[1])[0]
    engine = TargetEngine(decoder, max_slots=1)
    opts = SpeculativeOptions(max_new_tokens=16)
    seen: dict = {}

    async def go():
        def after_first_chunk(items):
            if "victim" in seen and not seen.get("cancelled"):
                seen["cancelled"] = True
                sched.cancel(seen["victim"])

        target = RecordingTarget(engine, on_call=after_first_chunk)
        sched = Scheduler(target, None, max_active=1, adaptive=False,
                          chunking=ChunkPolicy(8))
        seen["victim"] = victim = sched.submit(LONG, opts)
        await sched.run_until_idle()
        assert victim.cancelled and victim.decode.generated == []
        assert engine.used_slots == 0
        assert 0 < target.calls[0][0].tokens.__len__() < len(LONG)
        # The next user of the slot: one prompt sharing the victim's computed prefix (reused
        # from its warm cache), one not.
        results = []
        for prompt in (LONG[:8] + [5, 6, 7], [9, 8, 7, 6, 5]):
            req = sched.submit(prompt, opts)
            await sched.run_until_idle()
            results.append(req.decode.result.generated_tokens)
        return results

    shared, other = asyncio.run(go())
    assert shared == plain_decode(decoder, LONG[:8] + [5, 6, 7], 16)
    assert other == plain_decode(decoder, [9, 8, 7, 6, 5], 16)
    assert engine.stats["prefix_hits"] >= 1


class HiddenRecorder(FixedDrafter):
    """Declares nothing, so it gets hidden rows (as EAGLE does)."""


def test_hidden_rows_arrive_chunk_by_chunk_as_whole():
    decoder = load_model(MODELS[1])[0]
    block = DraftBlock.deterministic([4, 5])
    opts = SpeculativeOptions(max_new_tokens=6)
    seen = {}
    for budget in (None, 16):
        drafter = HiddenRecorder(block)
        results, _, target = run(decoder, drafter, [LONG], opts, ChunkPolicy(budget),
                                 pipeline=False)
        seen[budget] = (drafter.seen_hidden[0], results[0].generated_tokens)
        if budget:
            assert sum(isinstance(i, PrefillItem) for c in target.calls for i in c) > 1
    (whole, tokens), (chunked, chunked_tokens) = seen[None], seen[16]
    assert chunked.shape == whole.shape == (len(LONG), decoder.config.hidden_size)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    assert tokens == chunked_tokens


@pytest.mark.parametrize("sampling,seed", [({}, None), ({"temperature": 1.0}, 11)],
                         ids=["greedy", "seeded"])
def test_a_reused_prefix_gives_the_same_tokens(sampling, seed):
    decoder = load_model(MODELS[0])[0]
    opts = SpeculativeOptions(max_new_tokens=20, sampling=SamplingParams(**sampling), seed=seed)
    first = LONG[:40]
    outputs = {}
    for reuse in (True, False):
        engine = TargetEngine(decoder, max_slots=2)

        async def turns(engine=engine, reuse=reuse):
            sched = Scheduler(LocalTarget(engine), LocalDrafter(PromptLookupSpeculator(2, 4)),
                              max_active=2, adaptive=False, chunking=ChunkPolicy(16),
                              prefix_caching=reuse)
            one = sched.submit(first, opts)
            await sched.run_until_idle()
            # The second turn resends the whole conversation plus a new question.
            second = first + one.decode.generated + [3, 1, 4, 1, 5]
            two = sched.submit(second, opts)
            await sched.run_until_idle()
            return one.decode.generated, two.decode.generated, second

        outputs[reuse] = asyncio.run(turns())
        if reuse:
            assert engine.stats["prefix_hits"] == 1
            # Everything the first turn's cache held (prompt + all but its last token).
            assert engine.stats["prefix_hit_tokens"] == len(first) + 20 - 1
        else:
            assert engine.stats["prefix_hits"] == 0
    assert outputs[True] == outputs[False]
    if not sampling:
        _, two, second = outputs[True]
        assert two == plain_decode(decoder, second, 20)


def test_engine_keeps_warm_slots_within_its_bound_and_never_a_callers_cache():
    decoder = tiny_decoder(16)
    engine = TargetEngine(decoder, max_slots=4, prefix_cache_tokens=20)
    greedy = SamplingParams()
    for prompt in ([1, 2, 3, 4, 5, 6, 7, 8], [2] * 9, [3] * 10):
        slot, reused = engine.allocate_prefix(prompt)
        assert reused == 0
        engine.step([PrefillItem(slot=slot, tokens=prompt, sampling=greedy)])
        engine.free(slot)
        assert engine.warm_positions <= 20
    assert engine.warm_positions == 19  # the oldest (8 positions) was evicted
    # A prompt equal to a warm one reuses all but its last position.
    slot, reused = engine.allocate_prefix([3] * 10)
    assert reused == 9 and engine.slot_length(slot) == 9
    with pytest.raises(ValueError, match="does not continue"):
        engine.step([PrefillItem(slot=slot, tokens=[3], sampling=greedy, offset=5)])
    assert engine.slot_length(slot) == 9  # refused before anything changed
    engine.free(slot)
    cache = decoder.new_cache()
    adopted = engine.adopt(cache)
    engine.step([PrefillItem(slot=adopted, tokens=[5, 5, 5], sampling=greedy)])
    before = engine.warm_positions
    engine.free(adopted)
    assert engine.warm_positions == before  # a caller's cache is never kept
    off = TargetEngine(decoder, max_slots=1, prefix_cache_tokens=0)
    slot, _ = off.allocate_prefix([1, 2, 3])
    off.step([PrefillItem(slot=slot, tokens=[1, 2, 3], sampling=greedy)])
    off.free(slot)
    assert off.allocate_prefix([1, 2, 3])[1] == 0 and off.warm_positions == 0


def test_prompt_and_smaller_steps_each_measure_both_thread_counts_and_restore_the_callers():
    from target_worker.engine import PREFILL_THREADS_MIN_TOKENS

    decoder = load_model(MODELS[1])[0]
    seen = []
    forward = decoder.forward_packed

    def spy(segments, last):
        seen.append(torch.get_num_threads())
        return forward(segments, last)

    decoder.forward_packed = spy
    try:
        before = torch.get_num_threads()
        assert before == 1  # the suite's setting (conftest)
        engine = TargetEngine(decoder, max_slots=5, fallback_threads=2)
        a = engine.allocate()
        n = PREFILL_THREADS_MIN_TOKENS
        for offset in range(0, 40, 10):
            engine.step([PrefillItem(a, [3] * 10, SamplingParams(), offset=offset, last=False)])
        for _ in range(4):  # prompts of n tokens (the tiny model's context is 256)
            engine.step([PrefillItem(engine.allocate(), [4] * n, SamplingParams())])
        # Each kind's first steps try each option in turn, the process's first (a warm-up
        # step, then a booked one), whatever the other kind measured; the caller's count is
        # back after each.
        assert seen == [1, 1, 2, 2] * 2 and torch.get_num_threads() == before
        assert sorted(engine.thread_choosers) == [False, True]
        assert all(set(c.cost) == {1, 2} for c in engine.thread_choosers.values())
    finally:
        del decoder.forward_packed
    with pytest.raises(ValueError, match="fallback_threads"):
        TargetEngine(decoder, fallback_threads=0)
    # Without fallback_threads every step keeps the caller's count and nothing is measured.
    plain = TargetEngine(decoder, max_slots=1)
    plain.step([PrefillItem(plain.allocate(), [3] * n, SamplingParams())])
    assert plain.thread_choosers == {} and torch.get_num_threads() == before


def test_the_thread_chooser_follows_the_cheaper_option_and_keeps_checking_the_other():
    from target_worker.engine import ThreadChooser

    chooser = ThreadChooser((2, 1), explore_every=4, alpha=1.0, warmup=0)
    cost = {2: 1.0, 1: 2.0}  # seconds per token: a quiet machine, 2 threads cheaper

    def run(steps):
        picks = []
        for _ in range(steps):
            t = chooser.pick()
            picks.append(t)
            chooser.record(t, cost[t] * 100, 100)
        return picks

    assert run(2) == [2, 1]  # each measured once
    # The cheaper from step 3 on, the other every 4th step after that (steps 7, 11, ...).
    assert run(8) == [2, 2, 2, 2, 1, 2, 2, 2]
    cost.update({2: 4.0})  # the machine got busy: 2 threads now cost more
    # Step 11 explores 1, step 12 measures 2's new cost; from step 13 1 is kept, but for
    # every 4th step after it became the best (step 17).
    assert run(8) == [1, 2, 1, 1, 1, 1, 2, 1]


def test_the_thread_chooser_backs_off_exploring_while_the_other_option_stays_worse():
    from target_worker.engine import ThreadChooser

    chooser = ThreadChooser((2, 1), explore_every=4, alpha=1.0, warmup=0,
                            max_explore_every=16)
    cost = {2: 10.0, 1: 1.0}  # a busy machine: the full count collapsed
    picks = []
    for _ in range(72):
        t = chooser.pick()
        picks.append(t)
        chooser.record(t, cost[t], 1)
    tried = [i for i, t in enumerate(picks) if t == 2][1:]  # after its first measurement
    # The gaps between tries of the worse option double up to max_explore_every.
    assert [b - a for a, b in zip(tried, tried[1:], strict=False)] == [4, 8, 16, 16, 16]
    # Once the other option turns cheaper, it is taken at its next try and kept.
    cost[2] = 0.5
    later = []
    for _ in range(24):
        t = chooser.pick()
        later.append(t)
        chooser.record(t, cost[t], 1)
    first = later.index(2)
    assert first <= 16 and set(later[first:first + 4]) == {2}


def test_the_thread_chooser_does_not_book_an_options_first_slow_steps():
    from target_worker.engine import ThreadChooser

    chooser = ThreadChooser((2, 1), explore_every=100, alpha=0.3, warmup=1)
    first = {2: True, 1: True}
    picks = []
    for _ in range(8):
        t = chooser.pick()
        picks.append(t)
        # Warm, 2 threads cost 1.0 s per token and 1 thread 1.5; a first call costs 4x.
        seconds = (1.0 if t == 2 else 1.5) * (4 if first[t] else 1)
        first[t] = False
        chooser.record(t, seconds, 1)
    # Each option runs its warm-up step unbooked and then one booked step; from then on
    # the cheaper one. Booking the first steps would have kept 1 thread (4.0 > 1.5).
    assert picks == [2, 2, 1, 1, 2, 2, 2, 2]
    assert chooser.cost == {2: 1.0, 1: 1.5}
