"""The service's scheduling loop: continuous batching of speculative decoding requests.

Each step, for every active request: one batched ``Propose`` call to the drafter worker, one
batched verify call to the target (one packed forward), then the rejection rule per request
with the request's own generator (`DecodeRequest.on_verify`, the same code the in-process loop
runs), streaming of the newly committed tokens, and freeing of finished requests' slots.
Requests join (prefill) and leave between steps, never inside one.

A drafter that fails or misses its deadline costs that step its drafts only: the step is
verified with empty drafts, which is still lossless.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from drafter_worker import DraftBlock

from .adaptive import AdaptiveDraftLength, ForwardCostModel, calibrate_target
from .errors import ServiceStopping
from .speculative import DecodeRequest, SpeculativeOptions

log = logging.getLogger(__name__)


class Target(Protocol):
    """What the scheduler needs from a target replica (a Ray actor handle wrapped by
    `RayTarget`, or a `target_worker.engine.TargetEngine` wrapped by `LocalTarget`)."""

    async def allocate(self) -> int: ...
    async def free(self, slot: int) -> None: ...
    async def prefill(self, items: list) -> list: ...
    async def verify(self, items: list) -> list: ...


class LocalTarget:
    """An in-process `TargetEngine` behind the async `Target` interface."""

    def __init__(self, engine):
        self.engine = engine

    async def allocate(self) -> int:
        return self.engine.allocate()

    async def free(self, slot: int) -> None:
        self.engine.free(slot)

    async def prefill(self, items: list) -> list:
        return self.engine.prefill(items)

    async def verify(self, items: list) -> list:
        return self.engine.verify(items)


class RayTarget:
    """A `target_worker.actor.TargetActor` Ray actor handle behind the `Target` interface."""

    def __init__(self, handle):
        self.handle = handle

    async def allocate(self) -> int:
        return await self.handle.allocate.remote()

    async def free(self, slot: int) -> None:
        await self.handle.free.remote(slot)

    async def prefill(self, items: list) -> list:
        return await self.handle.prefill.remote(items)

    async def verify(self, items: list) -> list:
        return await self.handle.verify.remote(items)


@dataclass(eq=False)
class ServiceRequest:
    """One request inside the service: its core decode state plus scheduling state.

    ``events`` receives ``list[int]`` token batches in order, then the final
    `SpeculativeDecodeResult` (or an Exception if the service failed it)."""

    id: str
    decode: DecodeRequest
    speculate: bool
    max_draft_len: int | None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    cancelled: bool = False
    drafter_failures: int = 0
    emitted: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    #: This request's draft-length policy when the scheduler is adaptive (made lazily).
    adaptive: AdaptiveDraftLength | None = None

    def push_new_tokens(self) -> None:
        generated = self.decode.generated
        if len(generated) > self.emitted:
            self.events.put_nowait(list(generated[self.emitted:]))
            self.emitted = len(generated)


@dataclass
class SchedulerStats:
    steps: int = 0
    tokens_generated: int = 0
    forward_calls: int = 0
    drafter_failures: int = 0
    completed: int = 0
    cancelled: int = 0


class Scheduler:
    """Continuous-batching loop over one target and an optional drafter client.

    Args:
        target: a `Target`.
        drafter: a `drafter_worker.client.DrafterClient`, or None (no speculation).
        max_active: most requests decoding at once (the rest wait, FIFO).
        wants_hidden: whether the drafter conditions on target hidden states (then the target
            returns them and they travel with each proposal).
        adaptive: choose each request's draft length per step (0 included) from the step's
            measured cost and the request's running acceptance (`coordinator.adaptive`);
            False drafts the full budget every step. Output is the same either way.
        cost_model: the target's forward cost by tokens per step; None measures it through
            the target before the first admission (`calibrate_target`). Every verify step
            then updates it with its own wall time (the whole step, all requests' tokens).
    """

    def __init__(self, target: Target, drafter=None, max_active: int = 32,
                 wants_hidden: bool = False, adaptive: bool = True,
                 cost_model: ForwardCostModel | None = None):
        self.target = target
        self.drafter = drafter
        self.max_active = max_active
        self.wants_hidden = wants_hidden and drafter is not None
        self.adaptive = adaptive and drafter is not None
        self.cost_model = cost_model
        self.waiting: deque[ServiceRequest] = deque()
        self.active: list[ServiceRequest] = []
        self.stats = SchedulerStats()
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False

    # ---- public ----

    def start(self) -> None:
        """Starts the loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closed = True
        self._wakeup.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for req in [*self.waiting, *self.active]:
            req.events.put_nowait(ServiceStopping("the service is shutting down"))

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None) -> ServiceRequest:
        """Queues a request; its tokens arrive on ``request.events``.

        Raises:
            ValueError: an empty prompt or invalid options (from `DecodeRequest`).
        """
        # Hidden rows are kept whole (float16, what the wire carries) for resends.
        decode = DecodeRequest(prompt_tokens, options, hidden_dtype=torch.float16)
        req = ServiceRequest(id=f"req-{next(self._ids)}", decode=decode, speculate=speculate,
                             max_draft_len=max_draft_len)
        self.waiting.append(req)
        self._wakeup.set()
        return req

    def cancel(self, req: ServiceRequest) -> None:
        """Stops a request at the next step boundary and frees its slot."""
        if not req.decode.finished:
            req.cancelled = True
            self._wakeup.set()

    def status(self) -> dict:
        return {
            "active_requests": len(self.active),
            "waiting_requests": len(self.waiting),
            "used_slots": sum(1 for r in self.active if r.slot is not None),
            "total_slots": self.max_active,
            **vars(self.stats),
        }

    # ---- the loop ----

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._admit()
                if not self.active:
                    self._wakeup.clear()
                    if not self.waiting:
                        await self._wakeup.wait()
                    continue
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the target failed: fail what is in flight, keep serving
                log.exception("scheduler step failed")
                await self._on_target_failure(exc, self.active)
                self.active = []

    async def _on_target_failure(self, exc: Exception, requests: list[ServiceRequest]) -> None:
        """A target call raised ``exc``: fails ``requests`` (those in flight) with it and
        frees their slots. `coordinator.router.ReplicaScheduler` overrides it to take a dead
        replica out of service."""
        for req in requests:
            req.events.put_nowait(exc)
            await self._release(req, count=False)

    async def _admit(self) -> None:
        if self.adaptive and self.cost_model is None:
            self.cost_model = await calibrate_target(self.target)
        self._drop_cancelled()
        admitted = []
        while self.waiting and len(self.active) + len(admitted) < self.max_active:
            req = self.waiting.popleft()
            if req.cancelled:
                self._finish_cancelled(req)
                continue
            req.slot = await self.target.allocate()
            admitted.append(req)
        if not admitted:
            return
        from target_worker.engine import PrefillItem

        items = [PrefillItem(slot=r.slot, tokens=r.decode.prefill_tokens(),
                             sampling=r.decode.sampling, want_hidden=self._hidden_for(r))
                 for r in admitted]
        try:
            outputs = await self.target.prefill(items)
        except Exception:
            self.active.extend(admitted)  # released by _run's failure path
            raise
        self.stats.forward_calls += 1
        for req, out in zip(admitted, outputs, strict=True):
            req.decode.on_prefill(out.rows, out.hidden)
            await self._after_step(req)
            if not req.decode.finished:
                self.active.append(req)

    async def _step(self) -> None:
        from target_worker.engine import VerifyItem

        self._drop_cancelled()
        if not self.active:
            return
        drafts = await self._propose(self.active)
        items = [
            VerifyItem(slot=r.slot, start_pos=r.decode.cache_len,
                       tokens=r.decode.verify_tokens(d), sampling=r.decode.sampling,
                       want_hidden=self._hidden_for(r))
            for r, d in zip(self.active, drafts, strict=True)
        ]
        began = time.perf_counter()
        outputs = await self.target.verify(items)
        if self.cost_model is not None:
            self.cost_model.observe(sum(len(item.tokens) for item in items),
                                    time.perf_counter() - began)
        self.stats.steps += 1
        self.stats.forward_calls += 1
        still = []
        for req, draft, out in zip(self.active, drafts, outputs, strict=True):
            accepted_before = req.decode.result.accepted_tokens
            req.decode.on_verify(draft, out.rows, out.hidden)
            if req.adaptive is not None and req.adaptive.awaiting_update:
                req.adaptive.update(len(draft), req.decode.result.accepted_tokens
                                    - accepted_before)
            await self._after_step(req)
            if not req.decode.finished:
                still.append(req)
        self.active = still

    async def _propose(self, requests: list[ServiceRequest]) -> list[DraftBlock]:
        drafts = [DraftBlock.empty() for _ in requests]
        if self.drafter is None:
            return drafts
        from drafter_worker.client import DrafterUnavailable, ProposeJob

        jobs, where = [], []
        # Tokens already in this step's forward: every request's anchor, plus the drafts
        # chosen so far (the adaptive choice prices drafts at the margin of the whole step).
        step_tokens = len(requests)
        for i, req in enumerate(requests):
            budget = req.decode.draft_budget()
            if req.max_draft_len is not None:
                budget = min(budget, req.max_draft_len)
            if not req.speculate or budget <= 0:
                continue
            if self.adaptive and self.cost_model is not None:
                if req.adaptive is None:
                    req.adaptive = AdaptiveDraftLength(self.cost_model)
                budget = req.adaptive.next_len(budget, batch_tokens=step_tokens - 1)
                step_tokens += budget
                if budget <= 0:
                    continue
            jobs.append(ProposeJob(
                request_id=req.id, history=req.decode.history, max_len=budget,
                hidden_log=req.decode.hidden_log() if self.wants_hidden else None,
                sampling=req.decode.sampling,
                seed=0 if req.decode.options.seed is None else req.decode.options.seed,
            ))
            where.append(i)
        if not jobs:
            return drafts
        try:
            blocks = await self.drafter.propose(jobs)
        except DrafterUnavailable as exc:
            log.warning("drafter unavailable, decoding this step without drafts: %s", exc)
            self.stats.drafter_failures += 1
            for i in where:
                requests[i].drafter_failures += 1
            return drafts
        for i, job, block in zip(where, jobs, blocks, strict=True):
            drafts[i] = block.truncate(job.max_len)
        return drafts

    def _hidden_for(self, req: ServiceRequest) -> bool:
        return self.wants_hidden and req.speculate

    async def _after_step(self, req: ServiceRequest) -> None:
        req.push_new_tokens()
        if req.decode.finished:
            self.stats.tokens_generated += len(req.decode.generated)
            req.events.put_nowait(req.decode.result)
            await self._release(req)

    async def _release(self, req: ServiceRequest, count: bool = True) -> None:
        if req.slot is not None:
            slot, req.slot = req.slot, None
            try:
                await self.target.free(slot)
            except Exception:
                log.exception("freeing slot %s failed", slot)
        if count:
            self.stats.completed += 1
        if self.drafter is not None:
            asyncio.get_running_loop().create_task(self.drafter.release([req.id]))

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.active if r.cancelled]:
            self.active.remove(req)
            self._finish_cancelled(req)

    def _finish_cancelled(self, req: ServiceRequest) -> None:
        self.stats.cancelled += 1
        req.events.put_nowait(asyncio.CancelledError("cancelled by the client"))
        asyncio.get_running_loop().create_task(self._release(req, count=False))
