"""Hidden-conditioned drafters that read chosen target layers (EAGLE-3's residual streams,
`DrafterCapabilities.hidden_layers`): every committed position's rows reach the drafter and
are the target's captured rows for that prefix, in process (float32) and through a drafter
worker over gRPC (float16 on the wire), across a drafter removed mid-request (a full resync);
a drafter declaring ``()`` still gets the final-norm rows; greedy output equals plain decoding;
a drafter wanting other layers than the service's drafters, or layers the target lacks, is
refused. The Ray replicas (TP, a killed replica) are in test_hidden_layers_ray.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from drafters import LayeredRecorder, captured_rows, plain_decode
from service_harness import LocalService
from test_scaling import Gate, collect, options, until

from coordinator.cluster.router import Router
from coordinator.step.speculative import speculative_decode_with
from coordinator.step.targets import LocalTarget
from drafter_worker.client import DrafterInfo
from specd_core.request import SpeculativeOptions
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

#: Five layers, so (1, 2, 4) are three distinct inner layers; float32: the rows are compared
#: with a plain forward's (the "auto" dtype is bfloat16 on this CPU).
MODEL = "tiny-random:vocab=64,seed=0,layers=5"
F32 = "float32"
LAYERS = (1, 2, 4)
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 3, 40, 22, 17, 9, 31],
           [2, 4, 2, 4, 2, 4], [1, 2, 3, 1, 2, 3, 1]]


def fresh_decoder():
    return load_model(MODEL, F32)[0]


def assert_rows_are_captured(sessions, layers, float16: bool) -> int:
    """Every session's rows, position by position, equal a fresh decoder's captured rows for
    the prefix it holds (within float16's rounding when they crossed the wire as float16);
    returns the rows checked."""
    reference = fresh_decoder()
    h = reference.config.hidden_size
    checked = 0
    for session in sessions:
        if session.rows is None:
            continue
        tokens = session.tokens
        assert session.rows.shape == (len(tokens) - 1, max(1, len(layers)) * h)
        want = captured_rows(reference, tokens[:-1], layers)
        if float16:
            # float16 on the wire: exactly representable, within its rounding of the truth.
            assert torch.equal(session.rows, session.rows.half().float())
            torch.testing.assert_close(session.rows, want, rtol=2.0 ** -10, atol=1e-5)
        else:
            torch.testing.assert_close(session.rows, want, rtol=1e-4, atol=1e-5)
        checked += session.rows.shape[0]
    return checked


@pytest.mark.parametrize("layers", [LAYERS, ()], ids=["layers-1-2-4", "final-norm"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_in_process_the_drafter_gets_the_captured_rows_of_every_committed_position(
        layers, pipeline):
    decoder = fresh_decoder()
    for prompt in PROMPTS[:2]:
        drafter = LayeredRecorder(layers)
        result = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                         SpeculativeOptions(max_new_tokens=24),
                                         pipeline=pipeline)
        assert result.generated_tokens == plain_decode(fresh_decoder(), prompt, 24)
        (session,) = drafter.sessions
        # The whole committed history but the last step's anchor, each row a call's worth.
        assert len(session.tokens) >= len(prompt) + 1 and session.seen
        assert sum(rows.shape[0] for _, rows in session.seen) == len(session.tokens) - 1
        assert assert_rows_are_captured(drafter.sessions, layers, float16=False) > 20
    # The engine captured for its steps only: the caller's decoder is as it was.
    assert decoder.capture_layers == ()
    repeating = LayeredRecorder(layers)
    result = speculative_decode_with(decoder, PROMPTS[0], decoder.new_cache(), repeating,
                                     SpeculativeOptions(max_new_tokens=24))
    assert result.accepted_tokens > 0  # drafts were verified, not only rows shipped


def test_through_a_drafter_worker_rows_arrive_in_float16_also_after_a_mid_request_move():
    """The production front end (`Router`) with drafter workers over gRPC, as the service
    sends them (float16): two drafters, one removed while its requests are mid-stream, so
    they resend their whole history (every row) to the other."""
    drafter = LayeredRecorder(LAYERS)
    svc = LocalService(model=MODEL, dtype=F32, replicas=1, drafters=2, drafter_impl=drafter,
                       hidden_dtype="float16").start()
    try:
        assert svc.router.wants_hidden and svc.router.hidden_layers == LAYERS
        replica = next(iter(svc.router.replicas.values()))
        assert replica.scheduler.hidden_layers == LAYERS
        expected = [plain_decode(fresh_decoder(), p, 40) for p in PROMPTS]
        gate = Gate(replica.target.inner)
        replica.target.inner = gate
        pool = svc.router.pool

        async def scenario():
            reqs = [svc.router.submit(p, options(40)) for p in PROMPTS]
            await until(lambda: sum(len(m.assigned) for m in pool.members.values()) == 4)
            moved = set(pool.members["drafter-0"].assigned)
            assert moved and moved != {r.id for r in reqs}
            await svc.router.scale(drafters=1)
            gate.open.set()
            return reqs, [await collect(r) for r in reqs]

        reqs, outs = svc.call(scenario())
        for (tokens, _), want in zip(outs, expected, strict=True):
            assert tokens == want
        assert all(r.drafter_failures == 0 for r in reqs)
        assert any(res.accepted_tokens > 0 for _, res in outs)
        # A moved request has a session on each drafter: the second started from all rows.
        assert len(drafter.sessions) > len(PROMPTS)
        resent = [s for s in drafter.sessions if s.seen and s.seen[0][1].shape[0] > 1
                  and len(s.seen[0][0]) > max(map(len, PROMPTS)) + 1]
        assert resent, "no session started from a mid-request resync"
        assert assert_rows_are_captured(drafter.sessions, LAYERS, float16=True) > 100
        # Another drafter worker (a scale-up) serves the same layers.
        svc.call(svc.router.scale(drafters=2))
        tokens, _ = svc.call(collect(svc.router.submit(PROMPTS[2], options(20))))
        assert tokens == plain_decode(fresh_decoder(), PROMPTS[2], 20)
        assert assert_rows_are_captured(drafter.sessions[-1:], LAYERS, float16=True) > 0
    finally:
        svc.stop()


# ---- refusals ----


class InfoClient:
    """A drafter client that answers Info only (and records its close)."""

    def __init__(self, info: DrafterInfo):
        self._info = info
        self.closed = False
        self.stats = {"calls": 0, "errors": 0, "latency_s": 0.0}

    async def info(self) -> DrafterInfo:
        return self._info

    async def close(self) -> None:
        self.closed = True


def router_for(infos: list[DrafterInfo], n_layers: int = 5):
    """A Router over an in-process tiny engine whose drafters answer ``infos`` in turn;
    returns (router, the clients made, the names stopped)."""
    decoder = load_model(MODEL, F32)[0]
    made, stopped = [], []

    async def replica(name):
        return LocalTarget(TargetEngine(decoder, max_slots=2)), None, {"n_layers": n_layers}

    async def drafter(name):
        client = InfoClient(infos[len(made) % len(infos)])
        made.append(client)

        async def stop():
            stopped.append(name)

        return client, stop

    return Router(replica, drafter, adaptive=False, probe_interval_s=None), made, stopped


def info(layers, wants=True):
    return DrafterInfo("Layered", wants, 4, False, tuple(layers))


def test_a_drafter_wanting_other_layers_is_refused_with_both_named():
    async def main():
        router, made, stopped = router_for([info(LAYERS), info((1, 2))])
        try:
            await router.scale(target_replicas=1, drafters=1)
            assert router.hidden_layers == LAYERS
            with pytest.raises(RuntimeError, match=r"hidden_layers \[1, 2\].*hidden_layers "
                                                   r"\[1, 2, 4\].*same drafter"):
                await router.scale(drafters=2)
            assert list(router.pool.members) == ["drafter-0"] and stopped == ["drafter-1"]
            assert made[1].closed
            # A replacement is checked the same way: refused, so it is retried.
            router.restart_delay_s = 0.0
            with pytest.raises(ValueError, match="final-norm hidden rows"):
                router.drafter_factory = lambda name: _client(info(()))
                await router._start_drafter("drafter-0")
            # The service's setting is unchanged, and its loops use it.
            assert router.hidden_layers == LAYERS
            assert all(r.scheduler.hidden_layers == LAYERS for r in router.replicas.values())
        finally:
            await router.close()

    asyncio.run(main())


async def _client(answer: DrafterInfo):
    async def stop():
        return None

    return InfoClient(answer), stop


def test_layers_the_target_does_not_have_are_refused_at_scale():
    async def main():
        router, _, _ = router_for([info((2, 6))], n_layers=5)
        try:
            with pytest.raises(RuntimeError, match=r"hidden_layers \[2, 6\].*5 layers"):
                await router.scale(target_replicas=1, drafters=1)
        finally:
            await router.close()

    asyncio.run(main())


def test_a_step_asking_layers_the_engine_lacks_fails_its_request_with_a_clear_error():
    engine = TargetEngine(fresh_decoder(), max_slots=2)
    from specd_core.sampling import SamplingParams
    from specd_core.step import PrefillItem

    slot = engine.allocate()
    with pytest.raises(ValueError, match=r"hidden_layers \[1, 9\]: layer 9 is outside \[0, 5\]"):
        engine.step([PrefillItem(slot, [1, 2], SamplingParams(), want_hidden=True,
                                 hidden_layers=(1, 9))])
    assert engine.slot_length(slot) == 0  # nothing changed
