"""The service's scheduling loop: continuous batching of speculative decoding requests.

Each step, for every active request: one batched ``Propose`` call to the drafter worker, one
batched verify call to the target (one packed forward), then the rejection rule per request
with the request's own generator (`DecodeRequest.on_verify`, the same code the in-process loop
runs), streaming of the newly committed tokens, and freeing of finished requests' slots.
Requests join (prefill) and leave between steps, never inside one.

A drafter that fails or misses its deadline costs that step its drafts only: the step is
verified with empty drafts, which is still lossless.

A failure stays with its request: an exception while handling one request (slot allocation,
building its items, `DecodeRequest.on_prefill` / ``on_verify``, the rule, stop-string
detokenizing) fails that request alone with a `coordinator.errors.RequestError` on its queue,
frees its slot and drafter state, and the step goes on for the others. A batched target call
that fails with a ``ValueError`` (the engine's per-item validation) is retried one item at a
time, so only the offending request fails (safe: every item is fed at absolute positions after
a rollback). Any other failure of a target call fails only the requests in that call, through
`Scheduler._on_target_failure`, which a supervised replica overrides.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from drafter_worker import DraftBlock
from specd_core.request import DecodeRequest, SpeculativeOptions
from target_worker.engine import SlotsExhausted

from .adaptive import AdaptiveDraftLength, ForwardCostModel, calibrate_target
from .errors import ReplicaUnavailable, RequestError, RequestFailed, ServiceStopping

log = logging.getLogger(__name__)

#: What a client sees when its request failed inside the service (the cause goes to the log).
REQUEST_FAILED = ("generation failed: internal error while serving this request (the server "
                  "log has the details)")
REPLICA_FAILED = "the target replica failed while serving this request; retry it"


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


class CacheTarget(LocalTarget):
    """A `TargetEngine` whose one request runs in a caller's `KvCache` (`TargetEngine.adopt`):
    the in-process path, where the cache may be warm (a prefill at its length continues it).
    Freeing the slot leaves the cache to its owner."""

    def __init__(self, engine, cache):
        super().__init__(engine)
        self.cache = cache

    async def allocate(self) -> int:
        return self.engine.adopt(self.cache)


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
    #: What failed it, when the scheduler failed it (``events`` gets a `RequestError`).
    cause: BaseException | None = None

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
    #: Requests failed alone (their own fault, or their target call's).
    failed: int = 0


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
        drafter_max_len: the drafter's own cap on one proposal
            (`specd_core.draft.DrafterCapabilities.max_draft_len`, `DrafterInfo`), or None;
            the adaptive choice never asks for more.
        hidden_dtype: the dtype requests keep hidden rows in (float16: what the wire
            carries; the in-process path keeps float32, what the target computes).
    """

    def __init__(self, target: Target, drafter=None, max_active: int = 32,
                 wants_hidden: bool = False, adaptive: bool = True,
                 cost_model: ForwardCostModel | None = None,
                 drafter_max_len: int | None = None,
                 hidden_dtype: torch.dtype = torch.float16):
        self.target = target
        self.drafter = drafter
        self.max_active = max_active
        self.wants_hidden = wants_hidden and drafter is not None
        self.drafter_max_len = drafter_max_len
        self.hidden_dtype = hidden_dtype
        self.adaptive = adaptive and drafter is not None
        self.cost_model = cost_model
        self.waiting: deque[ServiceRequest] = deque()
        self.active: list[ServiceRequest] = []
        #: Requests holding a slot whose prefill has not been consumed yet.
        self._admitting: list[ServiceRequest] = []
        #: Slots allocated and not yet freed, whoever holds them (what Status reports).
        self._slots_held = 0
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
        for req in [*self.waiting, *self._admitting, *self.active]:
            req.events.put_nowait(ServiceStopping("the service is shutting down"))

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None,
               adaptive: AdaptiveDraftLength | None = None) -> ServiceRequest:
        """Queues a request; its tokens arrive on ``request.events``.

        ``adaptive``: this request's own draft-length policy (an adaptive scheduler makes
        one over its cost model otherwise), e.g. to read the lengths it chose.

        Raises:
            ValueError: an empty prompt or invalid options (from `DecodeRequest`).
        """
        # Hidden rows are kept whole for resends.
        decode = DecodeRequest(prompt_tokens, options, hidden_dtype=self.hidden_dtype)
        req = ServiceRequest(id=f"req-{next(self._ids)}", decode=decode, speculate=speculate,
                             max_draft_len=max_draft_len, adaptive=adaptive)
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
            "used_slots": self._slots_held,
            "total_slots": self.max_active,
            **vars(self.stats),
        }

    async def run_until_idle(self, after_step: Callable[[], None] | None = None) -> None:
        """Steps until no request is waiting or decoding, on the caller's task (the
        in-process path: no background loop), calling ``after_step()`` after each admission
        and each step (to hand on what they put on the requests' queues). Failures stay with
        their requests, as in the service's loop."""
        while self.waiting or self._admitting or self.active:
            await self._admit()
            if after_step is not None:
                after_step()
            if self.active:
                await self._step()
                if after_step is not None:
                    after_step()

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
            except Exception as exc:
                # Last resort (a scheduler bug, or `_on_target_failure` raised): requests and
                # target calls fail alone inside the step. Fail what is in flight, keep serving.
                log.exception("scheduler step failed")
                for req in [*self._admitting, *self.active]:
                    await self._fail(req, exc)

    async def _admit(self) -> None:
        if self.adaptive and self.cost_model is None:
            try:
                self.cost_model = await calibrate_target(self.target)
            except Exception as exc:  # the target cannot serve: the waiting requests fail
                waiting = list(self.waiting)
                self.waiting.clear()
                await self._on_target_failure(exc, waiting)
                return
        await self._drop_cancelled()
        while self.waiting and len(self.active) + len(self._admitting) < self.max_active:
            req = self.waiting.popleft()
            if req.cancelled:
                await self._finish_cancelled(req)
                continue
            try:
                slot = await self.target.allocate()
            except SlotsExhausted as exc:
                if not (self.active or self._admitting):  # none will ever free: say so
                    await self._fail(req, exc)
                    continue
                # The target holds slots this loop does not count (a free still in flight):
                # the request waits for a later admission; nothing failed.
                log.warning("target has no free slot; request %s waits", req.id)
                self.waiting.appendleft(req)
                break
            except Exception as exc:
                await self._on_target_failure(exc, [req])
                continue
            req.slot = slot
            self._slots_held += 1
            self._admitting.append(req)
        if not self._admitting:
            return
        from target_worker.engine import PrefillItem

        admitted, items = [], []
        for r in list(self._admitting):
            try:
                items.append(PrefillItem(slot=r.slot, tokens=r.decode.prefill_tokens(),
                                         sampling=r.decode.sampling,
                                         want_hidden=self._hidden_for(r),
                                         start_pos=r.decode.options.start_pos))
                admitted.append(r)
            except Exception as exc:
                await self._fail(r, exc)
        outputs, _ = await self._target_call(self.target.prefill, admitted, items)
        for req, out in zip(admitted, outputs, strict=True):
            if out is None:  # failed with its call
                continue
            try:
                req.decode.on_prefill(out.rows, out.hidden)
            except Exception as exc:
                await self._fail(req, exc)
                continue
            self._admitting.remove(req)
            await self._after_step(req)
            if not req.decode.finished:
                self.active.append(req)

    async def _step(self) -> None:
        from target_worker.engine import VerifyItem

        await self._drop_cancelled()
        if not self.active:
            return
        active = list(self.active)
        drafts = await self._propose(active)
        batch, items = [], []
        for r, d in zip(active, drafts, strict=True):
            try:
                items.append(VerifyItem(slot=r.slot, start_pos=r.decode.cache_len,
                                        tokens=r.decode.verify_tokens(d),
                                        sampling=r.decode.sampling,
                                        want_hidden=self._hidden_for(r)))
                batch.append((r, d))
            except Exception as exc:
                await self._fail(r, exc)
        if not batch:
            return
        began = time.perf_counter()
        outputs, whole = await self._target_call(self.target.verify, [r for r, _ in batch],
                                                 items)
        if whole and self.cost_model is not None:
            self.cost_model.observe(sum(len(item.tokens) for item in items),
                                    time.perf_counter() - began)
        self.stats.steps += 1
        still = []
        for (req, draft), out in zip(batch, outputs, strict=True):
            if out is None:  # failed with its call
                continue
            try:
                accepted_before = req.decode.result.accepted_tokens
                req.decode.on_verify(draft, out.rows, out.hidden)
                if req.adaptive is not None and req.adaptive.awaiting_update:
                    req.adaptive.update(len(draft), req.decode.result.accepted_tokens
                                        - accepted_before)
            except Exception as exc:
                await self._fail(req, exc)
                continue
            await self._after_step(req)
            if not req.decode.finished:
                still.append(req)
        self.active = still

    async def _target_call(self, call, requests: list[ServiceRequest], items: list
                           ) -> tuple[list, bool]:
        """``call(items)`` (the target's batched prefill or verify) for ``requests``, one item
        each. Returns (outputs, whether the batched call succeeded); an output is None for a
        request that failed (already answered and released).

        A ``ValueError`` (the engine refusing an item; nothing is changed then, and every
        item is fed at absolute positions after a rollback, so a retry is safe) retries the
        items one at a time: only the offending request fails. Any other exception is a
        failure of the target itself: `_on_target_failure` for the requests not yet answered.
        """
        if not items:
            return [], False
        try:
            outputs = list(await call(items))
            self.stats.forward_calls += 1
            return outputs, True
        except Exception as exc:
            if not isinstance(exc, ValueError):
                await self._on_target_failure(exc, requests)
                return [None] * len(requests), False
            if len(items) == 1:
                await self._fail(requests[0], exc)
                return [None], False
            log.warning("target refused a batch of %d (%r); retrying one at a time",
                        len(items), exc)
        outputs: list = []
        for i, (req, item) in enumerate(zip(requests, items, strict=True)):
            try:
                outputs.extend(await call([item]))
                self.stats.forward_calls += 1
            except ValueError as exc:
                await self._fail(req, exc)
                outputs.append(None)
            except Exception as exc:
                await self._on_target_failure(exc, requests[i:])
                outputs.extend([None] * (len(requests) - i))
                break
        return outputs, False

    async def _on_target_failure(self, exc: BaseException,
                                 requests: list[ServiceRequest]) -> None:
        """A target call (allocate, calibrate, prefill or verify) failed as a whole, not
        for one item: fails ``requests`` (those in the call) with `ReplicaUnavailable` and
        frees their slots and drafter state; the loop then goes on.

        The hook for supervision: a replica-aware subclass may also mark the replica down
        or restart it (call this first so the requests are answered). An exception raised
        here fails every request in flight (the loop's last resort) and the loop goes on.
        """
        log.error("target call failed for %d request(s): %r", len(requests), exc)
        for req in requests:
            await self._fail(req, exc, ReplicaUnavailable(REPLICA_FAILED))

    async def _fail(self, req: ServiceRequest, exc: BaseException,
                    error: RequestError | None = None) -> None:
        """Fails one request alone: logs ``exc``, puts ``error`` (default: ``exc`` itself
        when it is a `RequestError`, else `RequestFailed` with a generic message) on its
        queue, takes it out of the loop and frees its slot and drafter state."""
        if error is None:
            error = exc if isinstance(exc, RequestError) else RequestFailed(REQUEST_FAILED)
        log.error("request %s failed: %r", req.id, exc, exc_info=exc)
        req.cause = exc
        self.stats.failed += 1
        if req in self.active:
            self.active.remove(req)
        if req in self._admitting:
            self._admitting.remove(req)
        req.events.put_nowait(error)
        await self._release(req, count=False)

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
            try:
                job = self._propose_job(req, step_tokens, ProposeJob)
            except Exception as exc:
                self._stop_drafting(req, exc)
                continue
            if job is None:
                continue
            step_tokens += job.max_len
            jobs.append(job)
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
        except ValueError as exc:  # a job refused before anything was sent: find which
            log.warning("drafter refused a batch of %d jobs (%r); proposing one at a time",
                        len(jobs), exc)
            blocks = []
            for i, job in zip(where, jobs, strict=True):
                try:
                    blocks.extend(await self.drafter.propose([job]))
                except ValueError as one:
                    self._stop_drafting(requests[i], one)
                    blocks.append(DraftBlock.empty())
                except DrafterUnavailable:
                    requests[i].drafter_failures += 1
                    blocks.append(DraftBlock.empty())
        for i, job, block in zip(where, jobs, blocks, strict=True):
            drafts[i] = block.truncate(job.max_len)
        return drafts

    def _propose_job(self, req: ServiceRequest, step_tokens: int, job_type):
        """``req``'s `ProposeJob` for this step, or None when it drafts nothing now.
        ``step_tokens``: tokens already in this step's forward (for the adaptive choice)."""
        budget = req.decode.draft_budget()
        if req.max_draft_len is not None:
            budget = min(budget, req.max_draft_len)
        if not req.speculate or budget <= 0:
            return None
        if self.adaptive and self.cost_model is not None:
            if req.adaptive is None:
                req.adaptive = AdaptiveDraftLength(self.cost_model)
            budget = req.adaptive.next_len(budget, self.drafter_max_len,
                                           batch_tokens=step_tokens - 1)
            if budget <= 0:
                return None
        return job_type(
            request_id=req.id, history=req.decode.history, max_len=budget,
            hidden_log=req.decode.hidden_log() if self.wants_hidden else None,
            sampling=req.decode.sampling,
            seed=0 if req.decode.options.seed is None else req.decode.options.seed,
        )

    def _stop_drafting(self, req: ServiceRequest, exc: BaseException) -> None:
        """Drafting for ``req`` failed on its own (not the drafter's fault): it decodes
        undrafted from now on, which is lossless; the others keep drafting."""
        log.error("request %s: drafting failed (%r); it decodes without drafts", req.id, exc,
                  exc_info=exc)
        req.speculate = False

    def _hidden_for(self, req: ServiceRequest) -> bool:
        return self.wants_hidden and req.speculate

    async def _after_step(self, req: ServiceRequest) -> None:
        req.push_new_tokens()
        if req.decode.finished:
            self.stats.tokens_generated += len(req.decode.generated)
            req.events.put_nowait(req.decode.result)
            await self._release(req)

    def _take_slot(self, req: ServiceRequest) -> int | None:
        """Takes ``req``'s slot off it and out of the held count; returns it (None: none)."""
        slot, req.slot = req.slot, None
        if slot is not None:
            self._slots_held -= 1
        return slot

    async def _release(self, req: ServiceRequest, count: bool = True) -> None:
        slot = self._take_slot(req)
        if slot is not None:
            try:
                await self.target.free(slot)
            except Exception:
                log.exception("freeing slot %s failed", slot)
        if count:
            self.stats.completed += 1
        if self.drafter is not None:
            asyncio.get_running_loop().create_task(self.drafter.release([req.id]))

    async def _drop_cancelled(self) -> None:
        for req in [r for r in self.active if r.cancelled]:
            self.active.remove(req)
            await self._finish_cancelled(req)

    async def _finish_cancelled(self, req: ServiceRequest) -> None:
        self.stats.cancelled += 1
        req.events.put_nowait(asyncio.CancelledError("cancelled by the client"))
        # Awaited, not left to a task: the slot must be free before admission reuses it.
        await self._release(req, count=False)
