"""Pipelined drafting (`Scheduler(pipeline=True)`): the same tokens as the serial step and as
plain decoding, exact marginals at T=1, seeded identity alone and batched, run-ahead blocks
used only on an exact hit, the drafter's view never holding uncommitted tokens, and a drafter
that stalls or dies costing only drafts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from drafters import exact_marginals, plain_decode, tiny_decoder, tv_tolerance
from service_harness import LocalService
from test_service import MIXED, REPEATING, stream_tokens

from coordinator.step.adaptive import ForwardCostModel
from coordinator.step.scheduler import Scheduler
from coordinator.step.speculative import speculative_decode_with
from coordinator.step.targets import LocalTarget
from drafter_worker.client import DrafterUnavailable
from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock, DraftDist, DrafterCapabilities, propose_ahead
from specd_core.request import SpeculativeOptions
from specd_core.sampling import Sampler, SamplingParams
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

#: A frozen cost curve on which drafting pays (adaptive choices then do not depend on timing).
FLAT = ForwardCostModel({1: 0.002, 2: 0.0021, 8: 0.0022, 32: 0.003}, alpha=0)


class SlowTarget(LocalTarget):
    """An in-process target whose verify yields to the loop first, as a remote one does, so
    a run-ahead drafter call really runs while the step is verified."""

    async def verify(self, items):
        await asyncio.sleep(0)
        return self.engine.verify(items)


def run(decoder, drafter, prompts, options, pipeline=True, adaptive=False, max_active=8,
        cost_model=None):
    """Decodes ``prompts`` (one `SpeculativeOptions` each, or one for all) through one
    scheduler; returns (results, scheduler)."""
    if isinstance(options, SpeculativeOptions):
        options = [options] * len(prompts)

    async def go():
        local = drafter if drafter is None or hasattr(drafter, "info") else LocalDrafter(drafter)
        sched = Scheduler(SlowTarget(TargetEngine(decoder, max_slots=max_active)), local,
                          max_active=max_active, adaptive=adaptive,
                          cost_model=cost_model if cost_model is not None else FLAT,
                          pipeline=pipeline, hidden_dtype=torch.float32,
                          wants_hidden=local is not None and getattr(
                              getattr(local, "capabilities", None), "wants_hidden", False))
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        await asyncio.sleep(0)
        return [r.decode.result for r in reqs], sched

    return asyncio.run(go())


# ---- token identity ----


@pytest.mark.parametrize("model", ["tiny-random:vocab=64,seed=0,layers=2",
                                   "tiny-random:vocab=64,seed=1,layers=2,dense=1"],
                         ids=["moe", "dense"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_pipelined_greedy_tokens_equal_serial_in_process_and_plain(model, adaptive):
    decoder = load_model(model)[0]
    prompts = [REPEATING, [11, 3, 40, 22, 17, 9, 31], [2, 4, 2, 4, 2, 4, 2], [7] * 5]
    opts = SpeculativeOptions(max_new_tokens=40)
    lookup = PromptLookupSpeculator(2, 6)
    piped, sched = run(decoder, lookup, prompts, opts, pipeline=True, adaptive=adaptive)
    serial, _ = run(decoder, lookup, prompts, opts, pipeline=False, adaptive=adaptive)
    for prompt, a, b in zip(prompts, piped, serial, strict=True):
        expected = plain_decode(decoder, prompt, 40)
        assert a.generated_tokens == b.generated_tokens == expected
        in_process = speculative_decode_with(decoder, prompt, decoder.new_cache(), lookup,
                                             opts, pipeline=True)
        assert in_process.generated_tokens == expected
    assert sched.stats.runahead_hits > 0  # the run-ahead blocks were really verified
    assert sum(r.accepted_tokens for r in piped) > 0


def pipelined_marginals(decoder, prompt, drafter_for, params, seeds, max_new, batch=250):
    """Per-position output marginals ``[max_new, vocab]`` of ``seeds`` seeded requests through
    the pipelined scheduler, ``batch`` per scheduler (``drafter_for(start)`` makes each one's
    drafter), and the run-ahead hits summed over them."""
    counts = np.zeros((max_new, decoder.config.vocab_size))
    hits = 0
    for start in range(0, seeds, batch):
        opts = [SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=s)
                for s in range(start, start + batch)]
        results, sched = run(decoder, drafter_for(start), [prompt] * batch, opts,
                             max_active=batch)
        hits += sched.stats.runahead_hits
        for r in results:
            for i, token in enumerate(r.generated_tokens):
                counts[i, token] += 1
    return counts / seeds, hits


def assert_marginals_exact(got, exact, seeds):
    for i in range(len(exact)):
        tv = np.abs(got[i] - exact[i]).sum() / 2
        assert tv < tv_tolerance(exact[i], seeds), (i, tv)


def test_pipelined_marginals_at_t1_are_exact_with_a_point_mass_drafter():
    # The core's statistical test, through the pipelined scheduler: per-position marginals
    # of the output against the target's exactly enumerated ones.
    decoder = tiny_decoder(6, seed=1)
    prompt, params, seeds, max_new = [1, 2, 3, 1, 2], SamplingParams(temperature=1.0), 3000, 5
    got, hits = pipelined_marginals(decoder, prompt, lambda _: PromptLookupSpeculator(1, 3),
                                    params, seeds, max_new)
    assert_marginals_exact(got, exact_marginals(decoder, prompt, params, max_new), seeds)
    assert hits > 0


class SamplingLookahead:
    """A sampling drafter that never needs hidden rows (so it runs ahead): output position
    ``i`` drawn from ``tables[i]`` (close to the target's own marginal there, so its guesses
    often hit), reported honestly as ``q``; one token per call, so every block leaves budget
    for a run-ahead. Its draws come from its own generator, never the request's."""

    capabilities = DrafterCapabilities(wants_hidden=False, max_draft_len=1, samples=True)

    def __init__(self, prompt_len: int, tables: np.ndarray, seed: int):
        self.prompt_len, self.tables = prompt_len, tables
        self.rng = Sampler(seed)

    def propose(self, history, target_hidden, max_len):
        if max_len < 1:
            return DraftBlock.empty()
        q = self.tables[min(len(history) - self.prompt_len, len(self.tables) - 1)]
        return DraftBlock([self.rng.sample_from(q)], [DraftDist.from_dense(q)])


def test_pipelined_marginals_are_exact_with_a_sampling_drafter():
    # T=0.5: peaked enough that guesses hit and run-ahead blocks (with their q) are verified
    # often; a q paired with the wrong token then shows as a TV beyond the tolerance.
    decoder = tiny_decoder(6, seed=1)
    prompt, params, seeds, max_new = [1, 2, 3, 1, 2], SamplingParams(temperature=0.5), 4000, 6
    exact = exact_marginals(decoder, prompt, params, max_new)
    # Near the target (guesses hit) but tilted towards a different token at each position
    # (so a q taken from the wrong position would bias the output), full support.
    tables = 0.5 * exact + 0.4 * np.eye(6)[[(2 * i) % 6 for i in range(max_new)]] + 0.1 / 6
    got, hits = pipelined_marginals(
        decoder, prompt, lambda start: SamplingLookahead(len(prompt), tables, start),
        params, seeds, max_new)
    assert_marginals_exact(got, exact, seeds)
    assert hits > seeds // 10  # a real share of requests verified a run-ahead block


def test_seeded_t1_tokens_are_the_same_alone_batched_pipelined_and_serial():
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    params = SamplingParams(temperature=1.0, top_k=20)
    prompt = REPEATING
    lookup = PromptLookupSpeculator(2, 6)
    opts = SpeculativeOptions(max_new_tokens=40, sampling=params, seed=11)
    alone, _ = run(decoder, lookup, [prompt], opts)
    others = [SpeculativeOptions(max_new_tokens=40, sampling=params, seed=s) for s in range(7)]
    batched, _ = run(decoder, lookup, [REPEATING, *[[3, 1, 4, 1, 5, 9, 2]] * 7],
                     [opts, *others])
    serial, _ = run(decoder, lookup, [prompt], opts, pipeline=False)
    assert alone[0].generated_tokens == batched[0].generated_tokens == \
        serial[0].generated_tokens
    # Plain seeded decoding through the same loop (no drafter) gives them too: point-mass
    # drafts consume the request's generator exactly as plain sampling does.
    plain, _ = run(decoder, None, [prompt], opts, pipeline=False)
    assert alone[0].generated_tokens == plain[0].generated_tokens


# ---- stamps ----


class WrongGuess:
    """Proposes the true greedy continuation except that a run-ahead's first token (its
    guess of the bonus token) is always wrong: no run-ahead block may then be used."""

    capabilities = DrafterCapabilities(wants_hidden=False, max_draft_len=8, samples=False)

    def __init__(self, prompt_len: int, continuation: list[int], vocab: int):
        self.prompt_len, self.continuation, self.vocab = prompt_len, continuation, vocab

    def propose(self, history, target_hidden, max_len):
        done = len(history) - self.prompt_len
        return DraftBlock.deterministic(self.continuation[done:done + min(max_len, 4)])

    def propose_ahead(self, history, target_hidden, assumed, max_len):
        done = len(history) + len(assumed) - self.prompt_len
        truth = self.continuation[done:done + max_len]
        if not truth:
            return DraftBlock.empty()
        return DraftBlock.deterministic([(truth[0] + 1) % self.vocab, *truth[1:]])


def test_a_run_ahead_block_is_used_only_when_its_assumed_prefix_and_guess_were_committed():
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    prompt = [11, 3, 40, 22, 17, 9, 31]
    truth = plain_decode(decoder, prompt, 40)
    opts = SpeculativeOptions(max_new_tokens=40)
    wrong, sched = run(decoder, WrongGuess(len(prompt), truth, 64), [prompt], opts)
    assert wrong[0].generated_tokens == truth
    assert sched.stats.runahead_hits == 0 and sched.stats.runahead_misses > 0
    # The same drafter with right guesses: its blocks are used (the check is not just "never").

    class RightGuess(WrongGuess):
        def propose_ahead(self, history, target_hidden, assumed, max_len):
            done = len(history) + len(assumed) - self.prompt_len
            return DraftBlock.deterministic(self.continuation[done:done + max_len])

    right, sched = run(decoder, RightGuess(len(prompt), truth, 64), [prompt], opts)
    assert right[0].generated_tokens == truth
    assert sched.stats.runahead_hits > 0
    assert right[0].verification_steps < wrong[0].verification_steps


def test_the_drafters_view_never_holds_uncommitted_tokens():
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    prompt = REPEATING
    local = LocalDrafter(PromptLookupSpeculator(2, 6))
    seen = []

    async def go():
        sched = Scheduler(SlowTarget(TargetEngine(decoder, max_slots=2)), local,
                          adaptive=False, pipeline=True, cost_model=FLAT)
        req = sched.submit(prompt, SpeculativeOptions(max_new_tokens=40))

        def check():
            view = local.sessions.history(req.id)
            if view is not None:
                seen.append(len(view))
                assert view == req.decode.history[:len(view)]

        await sched.run_until_idle(after_step=check)
        return sched

    sched = asyncio.run(go())
    assert seen and sched.stats.runahead_hits > 0


def test_propose_ahead_guesses_then_proposes_after_the_guess():
    lookup = PromptLookupSpeculator(2, 4)
    history, assumed = [1, 2, 3, 4, 5, 6, 1, 2], [3]
    block = propose_ahead(lookup, history, None, assumed, 4)
    guess = lookup.propose(history + assumed, None, 1).tokens[0]
    rest = lookup.propose(history + assumed + [guess], None, 3)
    assert block.tokens == (guess, *rest.tokens) == (4, 5, 6, 1)
    # A drafter that needs hidden rows and cannot run ahead proposes nothing.

    class NeedsRows:
        capabilities = DrafterCapabilities(wants_hidden=True)

        def propose(self, history, target_hidden, max_len):
            raise AssertionError("must not be asked without rows")

    assert propose_ahead(NeedsRows(), history, None, assumed, 4).is_empty()


# ---- failing drafters ----


class Stalling:
    """A drafter client whose calls from ``stall_from`` on never answer (until cancelled),
    or (``die``) raise `DrafterUnavailable`."""

    def __init__(self, stall_from: int, die: bool = False):
        self.inner = LocalDrafter(PromptLookupSpeculator(2, 6))
        self.capabilities = self.inner.capabilities
        self.calls, self.stall_from, self.die = 0, stall_from, die

    async def info(self):
        return await self.inner.info()

    async def propose(self, jobs):
        self.calls += 1
        if self.calls >= self.stall_from:
            if self.die:
                raise DrafterUnavailable("gone")
            await asyncio.Event().wait()
        return await self.inner.propose(jobs)

    async def release(self, ids):
        await self.inner.release(ids)


@pytest.mark.parametrize("die", [False, True], ids=["stalls", "dies"])
def test_a_drafter_that_stalls_or_dies_mid_run_costs_only_drafts(die):
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    prompts = [REPEATING, [2, 4, 2, 4, 2, 4, 2]]
    opts = SpeculativeOptions(max_new_tokens=40)
    drafter = Stalling(stall_from=4, die=die)

    async def go():
        sched = Scheduler(SlowTarget(TargetEngine(decoder, max_slots=4)), drafter,
                          adaptive=False, pipeline=True, cost_model=FLAT)
        reqs = [sched.submit(p, opts) for p in prompts]
        await asyncio.wait_for(sched.run_until_idle(), timeout=60)
        await sched.close()  # cancels the stalled calls
        return [r.decode.result for r in reqs]

    results = asyncio.run(go())
    for prompt, result in zip(prompts, results, strict=True):
        assert result.generated_tokens == plain_decode(decoder, prompt, 40)
    assert drafter.calls >= 4


# ---- through the service front end (gRPC drafter, router) ----


@pytest.fixture(scope="module")
def services():
    piped = LocalService(pipeline=True).start()
    serial = LocalService(pipeline=False).start()
    yield piped, serial
    piped.stop()
    serial.stop()


def test_the_service_gives_the_same_tokens_pipelined_and_serial(services):
    piped, serial = services
    for req in MIXED:
        a, _ = stream_tokens(piped, req)
        b, _ = stream_tokens(serial, req)
        assert a == b, req
    piped.call(piped.router.refresh())
    status = piped.scheduler.status()
    assert status["runahead_hits"] > 0
    assert serial.scheduler.status()["runahead_hits"] == 0
    replica = status["replicas"][0]
    assert replica["pipeline"] is True
    assert 0.0 < replica["target_busy_fraction"] <= 1.0
