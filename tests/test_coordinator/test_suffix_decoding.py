"""Suffix decoding through the scheduler and the service: greedy output identical to plain
decoding (serial, pipelined, adaptive), exact per-position marginals at T=1 with the global
cache in use, seeded and greedy identity through the service with 1 and 2 drafter workers,
and every finished output reaching every worker's cache (the multi-worker choice)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from drafters import exact_marginals, plain_decode, tiny_decoder
from service_harness import LocalService
from test_pipeline import FLAT, SlowTarget, assert_marginals_exact
from test_service import MIXED, REPEATING, request, stream_tokens

from coordinator.step.adaptive import AdaptiveDraftLength, ForwardCostModel
from coordinator.step.drafting import REMEMBER_PROMPT_TAIL, remembered_tokens
from coordinator.step.scheduler import Scheduler
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.client import DrafterClient
from drafter_worker.local import LocalDrafter
from drafter_worker.server import start_drafter_server
from drafter_worker.suffix import SuffixDrafter
from specd_core.draft import DraftBlock, DrafterCapabilities
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

PROMPTS = [REPEATING, [11, 3, 40, 22, 17, 9, 31], [2, 4, 2, 4, 2, 4, 2], [7] * 5]


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive"])
def test_greedy_tokens_equal_plain_decoding_with_the_global_cache_in_use(pipeline, adaptive):
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    drafter = SuffixDrafter(max_draft_len=8)
    opts = SpeculativeOptions(max_new_tokens=40)
    accepted = 0
    # Every prompt twice: the second time the global cache holds the first one's output.
    for prompt in PROMPTS + PROMPTS:
        policy = AdaptiveDraftLength(FLAT) if adaptive else None
        result = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter, opts,
                                         adaptive=policy, pipeline=pipeline)
        assert result.generated_tokens == plain_decode(decoder, prompt, 40)
        accepted += result.accepted_tokens
    assert len(drafter.cache) == 2 * len(PROMPTS)  # every output reached the cache
    assert drafter.stats()["global_wins"] > 0 and accepted > 0


def run_shared(decoder, drafter, prompts, options, max_active):
    """``prompts`` through one pipelined scheduler whose drafter keeps a global cache (every
    finished output is remembered); returns (results, scheduler)."""

    async def go():
        sched = Scheduler(SlowTarget(TargetEngine(decoder, max_slots=max_active)),
                          LocalDrafter(drafter), max_active=max_active, adaptive=False,
                          cost_model=FLAT, pipeline=True, hidden_dtype=torch.float32)
        sched.remember_outputs = True
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        await sched.settle_drafter()
        return [r.decode.result for r in reqs], sched

    return asyncio.run(go())


def test_marginals_at_t1_are_exact_with_suffix_drafts_from_previous_outputs():
    # Drafts now depend on other requests' sampled outputs (the global cache) and on the
    # request's own history, never on its own verification draws: point masses judged
    # with the coupled rule stay exact.
    decoder = tiny_decoder(6, seed=1)
    prompt, params, seeds, max_new, batch = [1, 2, 3, 1, 2], SamplingParams(temperature=1.0), \
        3000, 5, 100
    drafter = SuffixDrafter(max_draft_len=4, min_token_prob=0.05)
    counts = np.zeros((max_new, decoder.config.vocab_size))
    hits = 0
    for start in range(0, seeds, batch):
        opts = [SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=s)
                for s in range(start, start + batch)]
        results, sched = run_shared(decoder, drafter, [prompt] * batch, opts, batch)
        hits += sched.stats.runahead_hits
        for r in results:
            for i, token in enumerate(r.generated_tokens):
                counts[i, token] += 1
    assert_marginals_exact(counts / seeds, exact_marginals(decoder, prompt, params, max_new),
                           seeds)
    assert hits > 0 and drafter.stats()["global_wins"] > 0


class RecordingSuffixDrafter(SuffixDrafter):
    """A `SuffixDrafter` that also keeps every sequence `remember` was given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.remembered: list[list[int]] = []

    def remember(self, outputs, partitions=None):
        outputs = [list(o) for o in outputs]
        self.remembered.extend(outputs)
        super().remember(outputs, partitions)


def test_the_cache_gets_each_outputs_prompt_tail_before_it_so_answers_first_tokens_draft():
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    long_prompt = [(7 * i + 3) % 64 for i in range(REMEMBER_PROMPT_TAIL + 9)]
    short_prompt = [5, 9, 5]
    drafter = RecordingSuffixDrafter(max_draft_len=4)
    opts = SpeculativeOptions(max_new_tokens=12)
    results, _ = run_shared(decoder, drafter, [long_prompt, short_prompt], [opts, opts], 2)
    expected = [long_prompt[-REMEMBER_PROMPT_TAIL:] + results[0].generated_tokens,
                short_prompt + results[1].generated_tokens]
    assert sorted(drafter.remembered) == sorted(expected)
    # The next request with the long prompt's ending drafts its answer's first tokens from
    # the cache: the first proposal, right after the prompt, already matches the output.
    block = drafter.session().propose(long_prompt, None, 4)
    assert block.tokens and list(block.tokens) == results[0].generated_tokens[:len(block.tokens)]


def test_remembered_tokens_is_empty_without_output_and_cuts_only_the_prompt():
    history = list(range(40))
    assert remembered_tokens(history, 30, []) == []
    assert remembered_tokens(history, 30, [1, 2]) == history[30 - REMEMBER_PROMPT_TAIL:30] + [1, 2]
    assert remembered_tokens(history[:3], 3, [9]) == history[:3] + [9]


class SuffixService(LocalService):
    """`LocalService` whose drafter workers each serve their own `SuffixDrafter` (each
    worker's global cache is its own, as in separate processes)."""

    def __init__(self, **kwargs):
        super().__init__(max_draft_len=6, **kwargs)
        self.suffix_drafters: list[SuffixDrafter] = []

    async def _start_drafter(self, name: str):
        drafter = SuffixDrafter(max_draft_len=6)
        self.suffix_drafters.append(drafter)
        server, port = await start_drafter_server(drafter)
        self.drafter_servers[name] = server

        async def stop() -> None:
            await self.drafter_servers.pop(name).stop(None)

        return DrafterClient(f"127.0.0.1:{port}", timeout_s=self.drafter_timeout_s), stop


@pytest.mark.parametrize("drafters", [1, 2])
def test_the_service_gives_plain_decodings_tokens_and_every_worker_caches_every_output(drafters):
    svc = SuffixService(drafters=drafters, pipeline=True).start()
    try:
        assert svc.router.remember_outputs
        finished = 0
        for _ in range(2):  # the second round drafts from the first round's outputs
            for req in MIXED:
                tokens, _ = stream_tokens(svc, req)
                plain = request(list(req.token_ids.ids), max_new=req.max_new_tokens,
                                speculate=False)
                plain.sampling.CopyFrom(req.sampling)
                if req.HasField("seed"):
                    plain.seed = req.seed
                assert tokens == stream_tokens(svc, plain)[0], req
                finished += 1
        # Releases (and the outputs they send) run after each answer: wait for them.
        svc.call(_settle(svc))
        assert len(svc.suffix_drafters) == drafters
        for drafter in svc.suffix_drafters:
            # Every speculated request's output reached every worker (the plain ones too:
            # they are outputs all the same).
            assert len(drafter.cache) == 2 * finished
        assert sum(d.stats()["global_wins"] for d in svc.suffix_drafters) > 0
    finally:
        svc.stop()


async def _settle(svc) -> None:
    for replica in svc.router.replicas.values():
        await replica.scheduler.settle_drafter()


def test_a_cost_curve_where_drafts_cost_too_much_stops_suffix_drafting():
    # Drafting pays only where the cost model says so: on a steep curve (every extra token
    # costs a whole forward) the adaptive choice drafts nothing after the first misses.
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    steep = ForwardCostModel({1: 0.001, 2: 0.002, 4: 0.004, 8: 0.008}, alpha=0)
    drafter = SuffixDrafter(max_draft_len=8)
    policy = AdaptiveDraftLength(steep)
    result = speculative_decode_with(decoder, PROMPTS[1], decoder.new_cache(), drafter,
                                     SpeculativeOptions(max_new_tokens=40), adaptive=policy)
    assert result.generated_tokens == plain_decode(decoder, PROMPTS[1], 40)
    assert sum(policy.chosen) == 0


# ---- drafting that does not pay stops ----


class DryDrafter:
    """A point-mass drafter that never has anything to propose (prompt lookup on an open
    question); counts the calls."""

    capabilities = DrafterCapabilities(wants_hidden=False, samples=False)

    def __init__(self):
        self.calls = 0

    def propose(self, history, target_hidden, max_len):
        self.calls += 1
        return DraftBlock.empty()


def test_dry_drafter_calls_back_off_one_two_four_up_to_eight_steps():
    policy = AdaptiveDraftLength(FLAT)
    policy.record_call(False, call_share=0.001)  # a call that costs next to nothing
    assert not policy.resting()
    rests = []
    for _ in range(6):
        policy.record_call(False, call_share=0.05)
        n = 0
        while policy.resting():
            policy.tick()
            n += 1
        rests.append(n)
    assert rests == [1, 2, 4, 8, 8, 8]
    policy.record_call(False, call_share=0.05)
    policy.record_call(True)  # any proposal ends the back-off
    assert not policy.resting() and policy.dry_calls == 0


#: Drafting pays (the FLAT shape) but a step is 0.1 ms (frozen): any real drafter call costs
#: more than `AdaptiveDraftLength.DRY_CALL_SHARE` of it.
FAST = ForwardCostModel({1: 1e-4, 2: 1.05e-4, 8: 1.1e-4, 32: 1.5e-4}, alpha=0)
#: The same shape with one-second steps: a call costs next to nothing.
SLOW = ForwardCostModel({1: 1.0, 2: 1.05, 8: 1.1, 32: 1.5}, alpha=0)


def _dry_calls(pipeline: bool, cost) -> int:
    decoder = load_model("tiny-random:vocab=64,seed=0,layers=2")[0]
    prompt, n = PROMPTS[1], 60
    dry = DryDrafter()
    result = speculative_decode_with(
        decoder, prompt, decoder.new_cache(), dry, SpeculativeOptions(max_new_tokens=n),
        adaptive=None if cost is None else AdaptiveDraftLength(cost), pipeline=pipeline)
    assert result.generated_tokens == plain_decode(decoder, prompt, n)
    return dry.calls


def test_serial_dry_calls_back_off_where_calls_cost():
    # 59 verification steps: a synchronous call that costs a share of a step backs off
    # (1, 2, 4, 8 steps); one that costs nothing next to the step, or a fixed length, asks
    # every step.
    assert _dry_calls(False, FAST) <= 12
    assert _dry_calls(False, SLOW) >= 50 and _dry_calls(False, None) >= 50


def test_pipelined_dry_run_aheads_get_no_synchronous_second_call():
    # A run-ahead overlaps the forward; a dry one used to be followed by a fresh call on the
    # critical path every step (two calls a step). Adaptive: one run-ahead a step at most.
    adaptive = _dry_calls(True, FAST)
    assert adaptive <= 61, adaptive
    assert _dry_calls(True, None) >= 100


@pytest.mark.slow  # its own embedded Ray (~20 s). In the quick suite: two suffix workers give
# plain decoding's tokens and draft from every earlier output
# (test_the_service_gives_plain_decodings_tokens_and_every_worker_caches_every_output[2], in
# process), and suffix drafter actors are built by registry name on Ray (test_eagle3_service.py,
# eagle3+suffix).
def test_specd_serve_path_with_two_suffix_drafter_actors():
    # The `specd serve --drafter suffix --drafters 2 --suffix-cache-requests N` path on an
    # embedded Ray: drafter actors built with the flag, outputs sent to both.
    import grpc
    from service_harness import MODEL

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service
    from specd.v1 import generation_pb2_grpc

    svc = Service(ServiceConfig(model=MODEL, port=0, drafter="suffix", drafters=2,
                                suffix_cache_requests=50, max_draft_len=6, target_threads=1,
                                drafter_timeout_s=2.0, adaptive=False))
    svc.start()
    try:
        decoder = load_model(MODEL)[0]
        prompt = PROMPTS[1]
        expected = plain_decode(decoder, prompt, 30)
        with grpc.insecure_channel(svc.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            finals = []
            for _ in range(3):
                req = request(prompt, max_new=30)
                tokens, final = [], None
                for chunk in stub.Generate(req, timeout=120):
                    tokens.extend(chunk.token_ids)
                    final = chunk
                assert tokens == expected
                finals.append(final)
        # The last run drafts the earlier runs' output from the global cache (that both
        # workers hold every output is checked in-process above).
        assert finals[-1].speculation.accepted_tokens >= 20
    finally:
        svc.stop()


def test_the_pool_sends_finished_outputs_to_every_serving_worker():
    from coordinator.cluster.drafter_pool import DrafterPool

    class Fake:
        def __init__(self, fail=False):
            self.got, self.fail, self.stats = [], fail, {}

        async def remember(self, outputs, partitions):
            if self.fail:
                raise RuntimeError("down")
            self.got.extend(zip(map(tuple, outputs), partitions, strict=True))

    async def go():
        pool = DrafterPool()
        a, b, c, broken = Fake(), Fake(), Fake(), Fake(fail=True)
        for name, client in (("a", a), ("b", b), ("c", c), ("broken", broken)):
            pool.add(name, client)
        pool.members["c"].state = "unhealthy"
        await pool.remember([[1, 2, 3]])  # a failing member costs nothing to the others
        await pool.remember([])
        await pool.remember([[4], [5, 6]], ["tenant-a", ""])  # each with its partition
        return a, b, c

    a, b, c = asyncio.run(go())
    assert a.got == b.got == [((1, 2, 3), ""), ((4,), "tenant-a"), ((5, 6), "")]
    assert c.got == []
