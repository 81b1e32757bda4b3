"""The step schedule chosen by measurement (``pipeline="auto"``, `coordinator.step.schedule`): the
chooser's logic on injected costs, a scheduler that ends serial beside a run-ahead that
slows the step and pipelined beside a free one (costs injected through its clock, never
wall time), the same tokens (greedy and seeded) with auto, on, off and forced switches
mid-request, and the schedule in Status, ``specd status`` and Prometheus."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from drafters import plain_decode
from test_service import REPEATING

from coordinator.step.adaptive import ForwardCostModel
from coordinator.step.schedule import PIPELINED, SERIAL, UNDRAFTED, ScheduleChooser, active_bucket
from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.choice import MeasuredChoice
from specd_core.draft import DraftBlock, DrafterCapabilities
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

P, S, U = PIPELINED, SERIAL, UNDRAFTED
MODEL = "tiny-random:vocab=64,seed=0,layers=2"
#: A frozen cost curve (the run-ahead wait and adaptive choices then do not depend on timing).
FLAT = ForwardCostModel({1: 0.002, 2: 0.0021, 8: 0.0022, 32: 0.003}, alpha=0)


def two_schedules(**kwargs) -> ScheduleChooser:
    """A chooser between the two drafting schedules only (the tests of their choice); the
    third, no drafting, has tests of its own below."""
    return ScheduleChooser(options=(P, S), **kwargs)


def windows(chooser: ScheduleChooser, cost, count: int, active: int = 1) -> list[str]:
    """Runs ``count`` windows of steps through ``chooser``; ``cost[schedule]`` is a step's
    (seconds, tokens). Returns each window's schedule."""
    out = []
    for _ in range(count):
        before = chooser.current
        out.append(chooser.schedule(active))
        settling = chooser.settle if out[-1] != before else 0
        for _ in range(chooser.window + settling):
            assert chooser.schedule(active) == out[-1]  # no switch inside a window
            chooser.record(*cost[out[-1]], active)
    return out


# ---- the chooser ----


def test_active_buckets_span_at_most_a_quarter_more_requests():
    assert [active_bucket(n) for n in range(1, 8)] == list(range(1, 8))
    assert [active_bucket(n) for n in (8, 9, 10, 11, 12, 15, 16, 19, 20, 33)] == \
        [8, 8, 10, 10, 12, 14, 16, 16, 20, 32]
    for n in range(1, 300):
        b = active_bucket(n)
        assert b <= n and n < b * 1.25 + 1


def test_the_chooser_measures_both_then_keeps_the_cheaper_per_committed_token():
    chooser = two_schedules(window=4, settle=0, explore_every=4, max_explore_every=4,
                              alpha=1.0)
    cost = {P: (1.0, 2), S: (0.8, 2)}  # seconds per step, tokens per step: serial cheaper
    # Pipelined first, then serial, then serial kept, pipelined re-measured every 4th window.
    assert windows(chooser, cost, 12) == [P, S, S, S, S, S, P, S, S, S, P, S]
    assert chooser.buckets[1].cost == pytest.approx({P: 0.5, S: 0.4})
    assert chooser.buckets[1].best == S
    assert chooser.switches == 5


def test_the_chooser_switches_only_beyond_its_margin_either_way():
    chooser = two_schedules(window=2, settle=0, explore_every=2, max_explore_every=2,
                              margin=0.05, alpha=1.0)
    cost = {P: (0.50, 1), S: (0.48, 1)}  # serial 4% cheaper: within the margin
    assert set(windows(chooser, cost, 10)[2:]) == {P, S}  # explorations only
    assert chooser.buckets[1].best == P
    cost[S] = (0.40, 1)  # 20% cheaper: taken once measured again
    windows(chooser, cost, 6)
    assert chooser.buckets[1].best == S
    cost[P] = (0.39, 1)  # pipelined now 2.5% cheaper than the best: not enough to go back
    windows(chooser, cost, 8)
    assert chooser.buckets[1].best == S
    cost[P] = (0.30, 1)  # 25% cheaper: back at its next try
    windows(chooser, cost, 4)
    assert chooser.buckets[1].best == P


def test_the_chooser_backs_off_exploring_while_the_other_stays_worse_and_follows_a_change():
    chooser = two_schedules(window=2, settle=0, explore_every=2, max_explore_every=8,
                              alpha=1.0)
    cost = {P: (3.0, 1), S: (1.0, 1)}  # a run-ahead that slows the step 3x
    picked = windows(chooser, cost, 40)
    tried = [i for i, s in enumerate(picked) if s == P][1:]  # after its first measurement
    assert tried[0] == 4  # windows P, S, then S twice before the first try
    assert [b - a for a, b in itertools.pairwise(tried)] == [2, 4, 8, 8, 8]
    cost[P] = (0.5, 1)  # the machine got quiet: pipelining now pays
    later = windows(chooser, cost, 12)
    first = later.index(P)  # taken at its next try, and kept
    assert first <= 8 and later[first:first + 3] == [P, P, P]
    assert chooser.buckets[1].best == P


def test_the_chooser_books_no_prefill_step_no_settling_step_and_no_empty_step():
    chooser = two_schedules(window=2, settle=1, explore_every=100, alpha=1.0)
    assert chooser.schedule(1) == P
    for _ in range(3):  # prompt chunks shared these forwards: not booked, nor counted
        chooser.record(50.0, 1, 1, prefill=True)
    chooser.record(9.0, 0, 1)  # committed nothing (its requests failed): not booked
    chooser.record(1.0, 2, 1)
    chooser.record(1.0, 2, 1)
    assert chooser.schedule(1) == S  # the window closed after its 2 booked steps
    chooser.record(40.0, 2, 1)  # the first serial step waits for run-aheads: settling
    chooser.record(0.6, 2, 1)
    chooser.record(0.6, 2, 1)
    assert chooser.schedule(1) == S
    assert chooser.buckets[1].cost == pytest.approx({P: 0.5, S: 0.3})


def test_a_window_of_only_prefill_steps_ends_without_measuring_anything():
    chooser = two_schedules(window=2, settle=0, max_window_steps=6)
    assert chooser.schedule(1) == P
    for _ in range(6):
        chooser.record(1.0, 1, 1, prefill=True)
    assert chooser.schedule(1) == P  # a new window; pipelined still unmeasured
    assert chooser.windows == 1 and chooser.buckets[1].cost == {}


@pytest.mark.parametrize("cheap", [P, S])
def test_per_token_costs_price_a_schedule_that_does_no_drafter_work(cheap):
    # The other schedule drafts nothing (a dry drafter, adaptive drafting off): its steps
    # are cheaper but commit one token each. Per step it would win; per token it loses.
    drafting, plain = (1.5, 3), (1.0, 1)
    cost = {cheap: drafting, ({P, S} - {cheap}).pop(): plain}
    chooser = two_schedules(window=3, settle=0, alpha=1.0)
    windows(chooser, cost, 4)
    assert chooser.buckets[1].best == cheap
    # Both drafting nothing (a service with no speculating request): equal costs, no
    # switching back and forth beyond the explorations.
    same = two_schedules(window=3, settle=0, explore_every=4, max_explore_every=4)
    picked = windows(same, {P: plain, S: plain}, 14)
    assert same.buckets[1].best == P and picked.count(S) == 1 + 2  # measured, explored


def test_costs_are_compared_within_a_bucket_of_active_requests_only():
    chooser = two_schedules(window=2, settle=0, explore_every=50, alpha=1.0)
    # 8 requests share a step: cheap per token whatever the schedule; alone, serial wins.
    eight = {P: (1.6, 16), S: (1.8, 16)}  # pipelined 0.10, serial 0.1125 per token
    one = {P: (1.6, 4), S: (1.2, 4)}  # pipelined 0.40, serial 0.30 per token
    windows(chooser, eight, 1, active=8)  # pipelined measured at 8 only
    picked = windows(chooser, one, 4, active=1)
    # Alone, pipelined is measured again (its 8-request cost says nothing here), then serial.
    assert picked[:2] == [P, S] and picked[2:] == [S, S]
    windows(chooser, eight, 4, active=8)
    assert chooser.buckets[1].best == S and chooser.buckets[8].best == P
    assert chooser.buckets[8].cost == pytest.approx({P: 0.1, S: 0.1125})


def test_a_step_stalled_by_another_process_counts_at_most_a_few_times_its_cost():
    chooser = two_schedules(window=2, settle=0, alpha=1.0)
    windows(chooser, {P: (1.0, 1), S: (0.9, 1)}, 2)
    chooser.schedule(1)
    chooser.record(0.9, 1, 1)
    chooser.record(100.0, 1, 1)  # a stall: capped at OUTLIER_FACTOR x 0.9
    chooser.schedule(1)
    capped = ForwardCostModel.OUTLIER_FACTOR * 0.9
    assert chooser.buckets[1].cost[S] == pytest.approx((0.9 + capped) / 2)


def test_a_measured_choice_refuses_bad_arguments():
    with pytest.raises(ValueError, match="margin"):
        MeasuredChoice((1, 2), margin=1.0)
    with pytest.raises(ValueError, match="at least one"):
        MeasuredChoice(())
    with pytest.raises(ValueError, match="window"):
        two_schedules(window=0)


# ---- a scheduler in auto mode, costs injected through the chooser's clock ----


class FakeClock:
    """Seconds that pass only when a fake component says its work took them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ClockedTarget(LocalTarget):
    """A local target whose verify yields to the loop first (as a remote one does, so a
    run-ahead drafter call runs meanwhile) and costs ``cost`` fake seconds."""

    def __init__(self, engine, clock: FakeClock, cost: float = 1.0):
        super().__init__(engine)
        self.clock, self.cost = clock, cost

    async def verify(self, items):
        await asyncio.sleep(0)
        self.clock.now += self.cost
        return self.engine.verify(items)


class Truth:
    """Proposes each prompt's true greedy continuation, two tokens at a time (so every block
    is accepted whole and every run-ahead guess is right)."""

    capabilities = DrafterCapabilities(wants_hidden=False, max_draft_len=2, samples=False)

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def propose(self, history, target_hidden, max_len):
        for prompt, cont in self.continuations.items():
            if tuple(history[:len(prompt)]) == prompt:
                done = len(history) - len(prompt)
                return DraftBlock.deterministic(cont[done:done + min(max_len, 2)])
        return DraftBlock.empty()


class ClockedDrafter:
    """A drafter client over a `LocalDrafter` whose calls cost fake seconds: ``fresh`` for a
    call the step waits for, ``ahead`` for a run-ahead (0: it overlaps the forward for free;
    more: it slows the step, as on a machine whose cores it shares). A run-ahead may lag
    ``lag`` loop turns (still in flight when the next step starts). Counts calls that
    started while another call for one of their request ids was in flight (``overlaps``;
    the drafter takes one at a time)."""

    def __init__(self, drafter, clock: FakeClock | None = None, fresh: float = 0.0,
                 ahead: float = 0.0, lag: int = 0):
        self.inner = LocalDrafter(drafter)
        self.capabilities = self.inner.capabilities
        self.clock, self.fresh, self.ahead, self.lag = clock, fresh, ahead, lag
        self.in_flight: set[str] = set()
        self.calls = {True: 0, False: 0}
        self.overlaps = 0

    async def info(self):
        return await self.inner.info()

    async def propose(self, jobs):
        ids = {job.request_id for job in jobs}
        self.overlaps += bool(ids & self.in_flight)
        self.in_flight |= ids
        try:
            ahead = any(job.ahead for job in jobs)
            self.calls[ahead] += 1
            if ahead:
                for _ in range(self.lag):
                    await asyncio.sleep(0)
            if self.clock is not None:
                self.clock.now += self.ahead if ahead else self.fresh
            return await self.inner.propose(jobs)
        finally:
            self.in_flight -= ids

    async def release(self, ids):
        await self.inner.release(ids)

    async def remember(self, outputs, partitions=None):
        await self.inner.remember(outputs, partitions)


PROMPTS = [REPEATING, [11, 3, 40, 22, 17, 9, 31], [2, 4, 2, 4, 2, 4, 2], [7, 1, 7, 3, 7]]


def run(decoder, drafter, prompts, options, pipeline, chooser=None, clock=None,
        max_active=4):
    """Decodes ``prompts`` through one scheduler (``options``: one per prompt, or one for
    all); returns (results, scheduler)."""
    if isinstance(options, SpeculativeOptions):
        options = [options] * len(prompts)

    async def go():
        engine = TargetEngine(decoder, max_slots=max_active)
        target = ClockedTarget(engine, clock or FakeClock(), cost=1.0)
        sched = Scheduler(target, drafter, max_active=max_active, adaptive=False,
                          cost_model=FLAT, pipeline=pipeline, hidden_dtype=torch.float32,
                          schedule_chooser=chooser)
        if hasattr(chooser, "scheduler"):
            chooser.scheduler = sched
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        await sched.settle_drafter()
        return [r.decode.result for r in reqs], sched

    return asyncio.run(go())


@pytest.mark.parametrize("ahead, expected", [(3.0, S), (0.0, P)],
                         ids=["slow-run-ahead-ends-serial", "free-run-ahead-stays-pipelined"])
def test_an_auto_scheduler_keeps_the_schedule_that_costs_less_per_token(ahead, expected):
    decoder = load_model(MODEL)[0]
    max_new = 180
    truth = {tuple(p): plain_decode(decoder, p, max_new) for p in PROMPTS}
    clock = FakeClock()
    # Serial: a step waits 0.2 s for its drafts, then 1 s of verify. Pipelined: the verify
    # plus what the run-ahead costs the step (3 s: it competes for the cores; 0: free).
    drafter = ClockedDrafter(Truth(truth), clock, fresh=0.2, ahead=ahead)
    chooser = two_schedules(window=4, explore_every=4, max_explore_every=8, clock=clock)
    results, sched = run(decoder, drafter, PROMPTS, SpeculativeOptions(max_new_tokens=max_new),
                         "auto", chooser, clock)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.generated_tokens == truth[tuple(prompt)]
    assert chooser.buckets[4].best == expected  # all 4 decoding: bucket 4
    assert drafter.overlaps == 0
    stats = sched.stats
    assert stats.pipelined_steps + stats.serial_steps == stats.steps
    assert stats.schedule_switches == chooser.switches >= 1  # it measured both
    kept, other = ((stats.serial_steps, stats.pipelined_steps) if expected == S
                   else (stats.pipelined_steps, stats.serial_steps))
    assert kept > 2 * other
    assert sched.status()["schedule"]["mode"] == "auto"
    if expected == P:
        assert stats.runahead_hits > stats.runahead_misses


def test_the_three_way_chooser_measures_each_then_keeps_plain_decoding_where_it_is_cheapest():
    """With no drafting as an option (the default), drafts that never pay for themselves
    leave the replica decoding plainly, the drafting schedules re-measured now and then."""
    chooser = ScheduleChooser(window=2, settle=0, explore_every=2, max_explore_every=8,
                              alpha=1.0)
    assert chooser.OPTIONS == (P, S, U)
    cost = {P: (3.0, 1), S: (1.5, 1), U: (1.0, 1)}
    picked = windows(chooser, cost, 30)
    assert picked[:3] == [P, S, U]  # each measured once, in order
    assert chooser.buckets[1].best == U
    assert picked[3:].count(U) > 3 * (picked[3:].count(P) + picked[3:].count(S))
    assert P in picked[3:] and S in picked[3:]  # each drafting schedule tried again
    cost[S] = (0.8, 2)  # drafts start to be accepted: the serial step pays again
    later = windows(chooser, cost, 40)  # taken at one of its next tries (backed off to 8)
    assert chooser.buckets[1].best == S and later[-10:].count(S) >= 8  # kept, but for tries
    with pytest.raises(ValueError, match="options"):
        ScheduleChooser(options=(U, "sideways"))


def test_an_auto_scheduler_stops_drafting_where_drafts_do_not_pay():
    """Drafts that are always rejected, a drafter call that costs half a verify: the
    replica ends decoding plainly (no drafter call at all), with the same tokens."""
    decoder = load_model(MODEL)[0]
    max_new = 120
    truth = {tuple(p): plain_decode(decoder, p, max_new) for p in PROMPTS}
    wrong = {p: [(t + 1) % 64 for t in cont] for p, cont in truth.items()}
    clock = FakeClock()
    drafter = ClockedDrafter(Truth(wrong), clock, fresh=0.5, ahead=3.0)
    chooser = ScheduleChooser(window=4, explore_every=4, max_explore_every=8, clock=clock)
    results, sched = run(decoder, drafter, PROMPTS, SpeculativeOptions(max_new_tokens=max_new),
                         "auto", chooser, clock)
    for prompt, result in zip(PROMPTS, results, strict=True):
        assert result.generated_tokens == truth[tuple(prompt)]
    assert chooser.buckets[4].best == U
    stats = sched.stats
    assert stats.pipelined_steps + stats.serial_steps + stats.undrafted_steps == stats.steps
    assert stats.undrafted_steps > 2 * (stats.pipelined_steps + stats.serial_steps)
    assert drafter.calls[False] + drafter.calls[True] < stats.steps / 2


class Forced:
    """A schedule chooser double that switches on a fixed pattern (``P`` / ``S`` per step),
    and counts switches to serial that found a run-ahead still in flight."""

    def __init__(self, pattern: str):
        self.clock = FakeClock()
        self.pattern = itertools.cycle(pattern)
        self.current, self.scheduler, self.in_flight_at_switch = P, None, 0

    def schedule(self, active: int) -> str:
        nxt = P if next(self.pattern) == "P" else S
        if self.current == P and nxt == S and any(
                r.ahead is not None and not r.ahead.task.done() for r in self.scheduler.active):
            self.in_flight_at_switch += 1
        self.current = nxt
        return nxt

    def record(self, seconds, tokens, active, prefill=False):
        pass

    def status(self) -> dict:
        return {"schedule": self.current, "switches": 0, "windows": 0, "costs": []}


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, top_k=20)],
                         ids=["greedy", "seeded-t1"])
def test_the_tokens_are_the_same_on_off_auto_and_across_forced_switches(sampling):
    decoder = load_model(MODEL)[0]
    max_new = 60
    options = [SpeculativeOptions(max_new_tokens=max_new, sampling=sampling, seed=s)
               for s in range(len(PROMPTS))]

    def lookup(lag=0):  # a point-mass drafter: seeded tokens are the same however drafted
        return ClockedDrafter(PromptLookupSpeculator(2, 6), lag=lag)

    outputs = {}
    for name, pipeline, chooser in (
            ("off", False, None), ("on", True, None),
            ("auto", "auto", two_schedules(window=2, explore_every=1, max_explore_every=1)),
            ("forced", "auto", Forced("PPSPSSPPPSPS")),
            ("forced-late", "auto", Forced("PPS"))):
        drafter = lookup(lag=6 if name == "forced-late" else 0)
        results, sched = run(decoder, drafter, PROMPTS, options, pipeline, chooser)
        outputs[name] = [r.generated_tokens for r in results]
        if name.startswith("forced"):
            assert sched.stats.schedule_switches > 10
            assert sched.stats.pipelined_steps and sched.stats.serial_steps
        if name == "forced-late":  # switches to serial found run-aheads in flight
            assert chooser.in_flight_at_switch > 0
        assert drafter.overlaps == 0
    assert all(out == outputs["off"] for out in outputs.values()), outputs
    assert all(len(o) == max_new for o in outputs["off"])
    if sampling.temperature == 0:
        assert outputs["off"] == [plain_decode(decoder, p, max_new) for p in PROMPTS]
    else:  # plain seeded decoding through the same loop gives them too
        plain, _ = run(decoder, None, PROMPTS, options, False)
        assert outputs["off"] == [r.generated_tokens for r in plain]


def test_without_a_drafter_auto_is_serial_and_a_bad_setting_is_refused():
    decoder = load_model(MODEL)[0]
    target = LocalTarget(TargetEngine(decoder, max_slots=1))
    sched = Scheduler(target, None, pipeline="auto")
    assert sched.schedule_chooser is None and not sched.pipeline
    assert sched.schedule_status()["mode"] == "off"
    with pytest.raises(ValueError, match="pipeline must be"):
        Scheduler(target, None, pipeline="fast")
    with pytest.raises(ValueError, match="pipeline must be"):
        Scheduler(target, None, pipeline=1)


# ---- what the service reports ----


def test_the_schedule_and_its_measurements_show_in_status_specd_status_and_prometheus():
    from service_harness import LocalService
    from test_service import MIXED, stream_tokens

    from coordinator.cluster.metrics import RouterCollector
    from specd.v1 import generation_pb2
    from specd_tools.client import status_table

    svc = LocalService(pipeline="auto").start()
    try:
        (replica,) = svc.router.replicas.values()
        # Short windows, so a few requests measure both schedules (the default needs more).
        replica.scheduler.schedule_chooser = two_schedules(
            window=2, settle=0, explore_every=1, max_explore_every=1)
        for req in MIXED:
            stream_tokens(svc, req)
        channel, stub = svc.stub()
        with channel:
            status = stub.Status(generation_pb2.StatusRequest(), timeout=30)
        (r,) = status.replicas
        assert r.pipeline_mode == "auto" and r.schedule_switches >= 1
        assert r.pipelined_steps > 0 and r.serial_steps > 0
        assert r.pipelined_steps + r.serial_steps == r.steps
        alone = next(c for c in r.schedule_costs if c.active_requests == 1)
        assert alone.pipelined_seconds_per_token > 0 and alone.serial_seconds_per_token > 0
        assert alone.best in (P, S)
        now = P if r.pipeline else S
        assert now == replica.scheduler.schedule_chooser.current
        table = status_table(status)
        assert f"auto:{now}" in table.split() and f"schedule of {r.name}:" in table

        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in RouterCollector(svc.router, svc.loop).collect()
                   for s in family.samples}
        label = (("replica", r.name),)
        assert samples["specd_replica_pipelined", label] == float(r.pipeline)
        assert samples["specd_replica_pipelined_steps_total", label] == r.pipelined_steps
        assert samples["specd_replica_serial_steps_total", label] == r.serial_steps
        assert samples["specd_replica_schedule_switches_total", label] == r.schedule_switches
        for schedule, value in ((P, alone.pipelined_seconds_per_token),
                                (S, alone.serial_seconds_per_token)):
            key = ("specd_replica_schedule_seconds_per_token",
                   (("active_requests", "1"), ("replica", r.name), ("schedule", schedule)))
            assert samples[key] == pytest.approx(value)
    finally:
        svc.stop()


def test_a_forced_schedule_reports_its_mode_and_no_measurements():
    from specd.v1 import generation_pb2
    from specd_tools.client import status_table

    decoder = load_model(MODEL)[0]
    _, sched = run(decoder, ClockedDrafter(PromptLookupSpeculator(2, 6)), PROMPTS[:1],
                         SpeculativeOptions(max_new_tokens=20), True)
    status = sched.schedule_status()
    assert status["mode"] == "on" and status["schedule"] == P and status["costs"] == []
    assert sched.stats.pipelined_steps == sched.stats.steps > 0
    assert sched.stats.serial_steps == sched.stats.schedule_switches == 0
    table = status_table(generation_pb2.StatusResponse(replicas=[generation_pb2.ReplicaStatus(
        name="replica-0", pipeline=True, pipeline_mode="on")]))
    assert "pipelined" in table.split() and "schedule of" not in table
