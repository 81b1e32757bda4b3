"""The service's scheduling loop: continuous batching of speculative decoding requests.

Each step decides, executes, then updates, as vLLM v1 and nano-vllm shape theirs:

1. decide: the drafts of every decoding request (`coordinator.step.drafting.DraftingPolicy`: one
   batched ``Propose`` call to the drafter worker, or run-ahead blocks) and the prompt chunks
   that fill the rest of the step's token budget (`coordinator.step.plan`, chunked prefill);
2. execute: one target call, one packed forward of every verify block and prompt chunk
   (`Scheduler._execute`, `target_worker.engine.TargetEngine.step`);
3. update: the rejection rule per verified request with the request's own generator
   (`DecodeRequest.on_verify`, the same code the in-process loop runs), a first token for
   each request whose last prompt chunk was computed (`DecodeRequest.on_prefill`), streaming
   of the newly committed tokens, and freeing of finished requests' slots.

Requests are admitted (a slot, from a warm prefix when the target holds one) and leave between
steps, never inside one.

A drafter that fails or misses its deadline costs that step its drafts only: the step is
verified with empty drafts, which is still lossless.

Pipelined (``pipeline=True``, the service's default; after PEARL's post-verify, Liu et al.,
ICLR 2025, and SGLang's decoupled speculation, sgl-project/sglang#22520; the policy lives in
`coordinator.step.drafting`): while the target
verifies block t of a request, the drafter proposes block t+1 assuming block t is committed
whole (`specd_core.draft.propose_ahead`): the proposal's first token is its guess of the bonus
token, the rest the next block. Each run-ahead is stamped with the committed length and the
tokens it assumed; the next step uses it only when verification committed exactly that prefix
plus the guess, so every draft is judged against the history it was drawn for, with the ``q``
it was drawn from. Otherwise (a rejection, a wrong guess, a late or failed drafter) the step
verifies that request with a fresh draft or with none, whichever `ForwardCostModel` says
commits more tokens per second; both are lossless. Drafting never touches a request's own
generator, so seeded output with a point-mass drafter (prompt lookup) is the same pipelined or
not.

Chosen by measurement (``pipeline="auto"``, the service's default: which is faster depends on
the machine and its load): `coordinator.step.schedule.ScheduleChooser` picks each step's
schedule from the measured wall time per committed token of each, per replica, as it runs.
Since both commit the same tokens, the loop may switch at any step boundary: a switch to
serial waits for the run-aheads still in flight (one drafter call per request id at a time)
and drops them unread, as a pipelined step drops stale ones; a switch to pipelined starts
with no run-ahead, so its first step drafts fresh.

A failure stays with its request: an exception while handling one request (slot allocation,
building its items, `DecodeRequest.on_prefill` / ``on_verify``, the rule, stop-string
detokenizing) fails that request alone with a `coordinator.step.errors.RequestError` on its queue,
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

import torch

from specd_core.draft import DraftBlock, check_hidden_layers
from specd_core.grammar import GrammarError
from specd_core.request import MAX_FORCED_DRAFT, DecodeRequest, SpeculativeOptions
from target_worker.engine import SlotsExhausted

from .adaptive import AdaptiveDraftLength, ForwardCostModel, calibrate_target
from .drafting import DraftingPolicy, remembered_tokens
from .errors import (
    REPLICA_FAILED,
    REQUEST_FAILED,
    ReplicaFailed,
    ReplicaUnavailable,
    RequestError,
    RequestFailed,
    RequestInvalid,
    ServiceStopping,
    literal,
)
from .latency import LatencyHistograms
from .plan import ChunkPolicy, plan_prefill_chunks
from .requests import SchedulerStats, ServiceRequest
from .schedule import OPTIONS, PIPELINED, SERIAL, UNDRAFTED, ScheduleChooser, check_pipeline
from .targets import Target

log = logging.getLogger(__name__)


class Scheduler(DraftingPolicy):
    """Continuous-batching loop over one target and an optional drafter client.

    Args:
        target: a `Target`.
        drafter: a `drafter_worker.client.DrafterClient`, or None (no speculation).
        max_active: most requests decoding at once (the rest wait, FIFO).
        wants_hidden: whether the drafter conditions on target hidden states (then the target
            returns them and they travel with each proposal).
        hidden_layers: which hidden rows (the drafter's
            `specd_core.draft.DrafterCapabilities.hidden_layers`, `DrafterInfo`): ``()`` the
            target's final-norm rows, else the residual streams entering these target
            layers, ``[rows, len(hidden_layers) * hidden_size]``. Sent with every item that
            wants rows (`specd_core.step.VerifyItem`): the target keeps no setting of its own.
        adaptive: choose each request's draft length per step (0 included) from the step's
            measured cost and the request's running acceptance (`coordinator.step.adaptive`);
            False drafts the full budget every step. Output is the same either way.
        cost_model: the target's forward cost by tokens per step; None measures it through
            the target before the first admission (`calibrate_target`). Every verify step
            then updates it with its own wall time (the whole step, all requests' tokens).
        drafter_max_len: the drafter's own cap on one proposal
            (`specd_core.draft.DrafterCapabilities.max_draft_len`, `DrafterInfo`), or None;
            the adaptive choice never asks for more.
        hidden_dtype: the dtype requests keep hidden rows in (float16: what the wire
            carries; the in-process path keeps float32, what the target computes).
        pipeline: True: draft the next block while the target verifies this one (see the
            module docstring); False: the serial step (propose, then verify); ``"auto"``:
            each step's schedule chosen by measurement (``schedule_chooser``). Output is the
            same. Without a drafter every step is serial.
        chunking: how a step shares its forward between verify blocks and prefill chunks
            (`coordinator.step.plan.ChunkPolicy`; default: whole prompts, no budget).
        prefix_caching: start a prompt from the target's warm slot sharing its longest prefix
            (`target_worker.engine.TargetEngine.allocate_prefix`); never for a request whose
            drafter wants hidden rows (a reused prefix has none) or that continues a
            context (``start_pos``). Output is the same either way. Looked up, and kept
            warm, in the request's ``partition`` only.
        schedule_chooser: the `ScheduleChooser` of ``pipeline="auto"`` (default: a new one
            with its defaults; tests inject one with their own clock).

    Raises:
        ValueError: ``pipeline`` not True, False or ``"auto"``.
    """

    def __init__(self, target: Target, drafter=None, max_active: int = 32,
                 wants_hidden: bool = False, adaptive: bool = True,
                 cost_model: ForwardCostModel | None = None,
                 drafter_max_len: int | None = None,
                 hidden_dtype: torch.dtype = torch.float16, pipeline: bool | str = False,
                 chunking: ChunkPolicy | None = None, prefix_caching: bool = True,
                 hidden_layers: Sequence[int] = (),
                 schedule_chooser: ScheduleChooser | None = None):
        #: The configured schedule: True, False or "auto".
        self.pipeline_mode = check_pipeline(pipeline)
        self.target = target
        self.chunking = chunking or ChunkPolicy()
        self.prefix_caching = prefix_caching
        self.latency = LatencyHistograms()
        #: Measures and picks the schedule (``pipeline="auto"`` with a drafter), else None;
        #: not drafting at all is among its options only when drafting is adaptive (fixed
        #: draft lengths are drafted every step, as asked).
        self.schedule_chooser = None if pipeline != "auto" or drafter is None else (
            schedule_chooser if schedule_chooser is not None else ScheduleChooser(
                options=OPTIONS if adaptive else (PIPELINED, SERIAL)))
        #: The current step calls no drafter (`ScheduleChooser` chose `UNDRAFTED`).
        self.undrafted = False
        #: The schedule of the current (or next) step: pipelined when True.
        self.pipeline = drafter is not None and (
            pipeline is True or (self.schedule_chooser is not None
                                 and self.schedule_chooser.current == PIPELINED))
        self.drafter = drafter
        self.max_active = max_active
        self.wants_hidden = wants_hidden and drafter is not None
        self.hidden_layers = check_hidden_layers(hidden_layers)
        self.drafter_max_len = drafter_max_len
        self.hidden_dtype = hidden_dtype
        self.adaptive = adaptive and drafter is not None
        self.cost_model = cost_model
        self.waiting: deque[ServiceRequest] = deque()
        self.active: list[ServiceRequest] = []
        #: Requests holding a slot whose prompt is not computed whole yet (FIFO).
        self._admitting: list[ServiceRequest] = []
        #: Slots allocated and not yet freed, whoever holds them (what Status reports).
        self._slots_held = 0
        self.stats = SchedulerStats()
        self._ids = itertools.count()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._closed = False
        #: Drafter calls in flight (cancelled on close).
        self._drafting: set[asyncio.Task] = set()
        #: Decoding requests whose new tokens wait to be streamed until the next target call
        #: is sent (`_flush`), so the streaming work overlaps the target's forward.
        self._unsent: list[ServiceRequest] = []
        #: Mean wall time of one drafter call, seconds (EMA; None until one finished).
        self.drafter_latency_s: float | None = None
        #: Share of run-aheads that were used (EMA over request-steps; pipelined).
        self.runahead_hit_rate = 0.5
        #: Send each finished request's output to the drafter's cross-request cache
        #: (``drafter.remember``; `DrafterInfo.remembers_outputs`, suffix decoding).
        self.remember_outputs = False
        #: Drafter releases in flight (`settle_drafter` waits for them).
        self._releasing: set[asyncio.Task] = set()
        #: The schedule just switched to serial: the next step drops run-aheads first.
        self._leaving_pipelined = False

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
        for task in list(self._drafting):
            task.cancel()
        self._flush()
        for req in [*self.waiting, *self._admitting, *self.active]:
            req.events.put_nowait(ServiceStopping("the service is shutting down"))

    def submit(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
               speculate: bool = True, max_draft_len: int | None = None,
               adaptive: AdaptiveDraftLength | None = None, partition: str = ""
               ) -> ServiceRequest:
        """Queues a request; its tokens arrive on ``request.events``.

        ``adaptive``: this request's own draft-length policy (an adaptive scheduler makes
        one over its cost model otherwise), e.g. to read the lengths it chose.
        ``partition``: the cross-request state it may share (`ServiceRequest.partition`).

        Raises:
            ValueError: an empty prompt or invalid options (from `DecodeRequest`).
        """
        # Hidden rows are kept whole for resends.
        decode = DecodeRequest(prompt_tokens, options, hidden_dtype=self.hidden_dtype)
        req = ServiceRequest(id=f"req-{next(self._ids)}", decode=decode, speculate=speculate,
                             max_draft_len=max_draft_len, adaptive=adaptive,
                             partition=partition)
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
            "prefilling_requests": len(self._admitting),
            "waiting_requests": len(self.waiting),
            "used_slots": self._slots_held,
            "total_slots": self.max_active,
            **vars(self.stats),
            "schedule": self.schedule_status(),
            "latency": self.latency.snapshot(),
        }

    def schedule_status(self) -> dict:
        """``mode`` (``"auto"``, ``"on"`` or ``"off"``; ``"off"`` without a drafter),
        ``schedule`` (``"pipelined"`` or ``"serial"``: the current step's), and with
        ``"auto"`` the chooser's ``switches``, ``windows`` and ``costs``
        (`ScheduleChooser.status`)."""
        mode = "off" if self.drafter is None else {True: "on", False: "off"}.get(
            self.pipeline_mode, "auto")
        out = {"mode": mode, "schedule": PIPELINED if self.pipeline else SERIAL,
               "switches": 0, "windows": 0, "costs": []}
        if self.schedule_chooser is not None:
            out.update(self.schedule_chooser.status())
        return out

    async def run_until_idle(self, after_step: Callable[[], None] | None = None) -> None:
        """Steps until no request is waiting or decoding, on the caller's task (the
        in-process path: no background loop), calling ``after_step()`` after each admission
        and each step (to hand on what they put on the requests' queues). Failures stay with
        their requests, as in the service's loop."""
        while self.waiting or self._admitting or self.active:
            await self._admit()
            self._flush()
            if after_step is not None:
                after_step()
            if self.active or self._admitting:
                await self._step()
                self._flush()
                if after_step is not None:
                    after_step()

    # ---- the loop ----

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._admit()
                if not self.active and not self._admitting:
                    self._flush()
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
                self._flush()
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
                req.decode.prefill_mask()  # a constraint that allows no first token fails here
            except Exception as exc:
                await self._fail(req, exc)
                continue
            try:
                slot, req.prefilled = await self._allocate(req)
                req.cached_tokens = req.prefilled
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
            # Anew: a request moved off a failed replica may have computed chunks there.
            req.prompt_hidden, req.prefill_started_at = [], None
            self._admitting.append(req)

    async def _allocate(self, req: ServiceRequest) -> tuple[int, int]:
        """A slot for ``req`` and the prompt positions it already holds (a warm prefix)."""
        options = req.decode.options
        # Not for a request scoring its prompt: a reused prefix has no logits.
        if (self.prefix_caching and options.start_pos == 0 and not self._hidden_for(req)
                and options.prompt_logprobs is None):
            allocate_prefix = getattr(self.target, "allocate_prefix", None)
            if allocate_prefix is not None:
                slot, reused = await allocate_prefix(req.decode.prefill_tokens(), req.partition)
                return slot, reused
        if req.partition and getattr(self.target, "allocate_prefix", None) is not None:
            # No lookup (no tokens), but the slot goes warm in the request's partition when
            # freed, never in the shared one.
            slot, _ = await self.target.allocate_prefix([], req.partition)
            return slot, 0
        return await self.target.allocate(), 0

    async def _step(self) -> None:
        await self._drop_cancelled()
        if not self.active and not self._admitting:
            return
        chooser = self.schedule_chooser
        if chooser is not None and self.active:  # a step boundary: the schedule may change
            schedule = chooser.schedule(len(self.active))
            self._set_pipeline(schedule == PIPELINED)
            self.undrafted = schedule == UNDRAFTED
        began = time.perf_counter()
        clock0 = chooser.clock() if chooser is not None else 0.0
        outcome = None
        try:
            active = list(self.active)
            if not active:
                drafts = []
            elif self.pipeline:
                drafts = await self._pipelined_drafts(active)
            else:
                if self._leaving_pipelined:
                    self._leaving_pipelined = False
                    await self._drop_run_aheads(active)
                drafts = ([DraftBlock.empty() for _ in active] if self.undrafted
                          else await self._propose(active))
                self.stats.draft_wait_seconds += time.perf_counter() - began
            outcome = await self._execute(active, drafts)
        finally:
            self.stats.active_seconds += time.perf_counter() - began
        if chooser is not None and outcome is not None:
            committed, verified, prefill = outcome
            chooser.record(chooser.clock() - clock0, committed, verified, prefill)

    def _set_pipeline(self, pipelined: bool) -> None:
        """Switches the schedule at a step boundary (a serial step then drops the run-aheads
        in flight: `_drop_run_aheads`)."""
        if pipelined != self.pipeline:
            self.pipeline = pipelined
            self._leaving_pipelined = not pipelined
            self.stats.schedule_switches += 1

    async def _drop_run_aheads(self, active: list[ServiceRequest]) -> None:
        """Before a serial step after pipelined ones: waits for the run-ahead calls of
        ``active`` still in flight (the drafter takes one call per request id at a time)
        and drops every run-ahead unread. Tokens are unaffected: a run-ahead never changes
        the drafter's view of a request (it only assumes), and is used only on an exact
        hit anyway."""
        pending = {r.ahead.task for r in active
                   if r.ahead is not None and not r.ahead.task.done()}
        for req in active:
            req.ahead = None
            req.chose_no_draft = False
            if req.adaptive is not None:  # pipelined steps never close it (serial ones do)
                req.adaptive.awaiting_update = False
        if pending:
            began = time.perf_counter()
            await asyncio.wait(pending)
            self.stats.draft_wait_seconds += time.perf_counter() - began

    def _prefill_items(self, verify_tokens: int) -> tuple[list[ServiceRequest], list]:
        """This step's prompt chunks (`plan_prefill_chunks` under the chunk policy): the
        requests and their `PrefillItem`s."""
        from target_worker.engine import PrefillItem

        waiting = list(self._admitting)
        if not waiting:
            return [], []
        prompts = [r.decode.prefill_tokens() for r in waiting]
        chunks = plan_prefill_chunks(
            [len(p) - r.prefilled for r, p in zip(waiting, prompts, strict=True)],
            [r.prefill_started_at is not None for r in waiting], verify_tokens, self.chunking)
        owners, items = [], []
        now = time.monotonic()
        for req, prompt, n in zip(waiting, prompts, chunks, strict=True):
            if not n:
                continue
            lo, options = req.prefilled, req.decode.options
            last = lo + n == len(prompt)
            score = options.prompt_logprobs is not None
            mask = req.decode.prefill_mask() if last else None  # checked at admission
            items.append(PrefillItem(slot=req.slot, tokens=prompt[lo:lo + n],
                                     sampling=req.decode.sampling,
                                     want_hidden=self._hidden_for(req),
                                     hidden_layers=self._layers_for(req),
                                     start_pos=options.start_pos, offset=lo, last=last,
                                     logprobs=options.logprobs,
                                     prompt_logprobs=options.prompt_logprobs,
                                     next_token=prompt[lo + n] if score and not last
                                     else None, mask=mask))
            owners.append(req)
            if req.prefill_started_at is None:
                req.prefill_started_at = now
        return owners, items

    async def _execute(self, active: list[ServiceRequest], drafts: list[DraftBlock]
                       ) -> tuple[int, int, bool] | None:
        """One target call for the step: a verify block per decoding request (``drafts``,
        one per request) and the prompt chunks the plan gives (`_prefill_items`), in one
        packed forward; then the rule per verified request and the chunks' bookkeeping.
        When pipelined, each request's run-ahead is launched while the forward runs.

        Returns (tokens the verify blocks committed, requests verified, whether prompt
        chunks shared the forward), or None when nothing was verified."""
        from target_worker.engine import VerifyItem

        batch, items = [], []
        for r, d in zip(active, drafts, strict=True):
            try:
                # A constrained request: the grammar's forced tokens chained into the block
                # (when it speculates, within the client's draft cap), the block ended at a
                # refused token, and the masks of its rows.
                cap = MAX_FORCED_DRAFT if r.max_draft_len is None else min(MAX_FORCED_DRAFT,
                                                                           r.max_draft_len)
                d, mask = r.decode.plan_block(
                    d, force=r.speculate and self.drafter is not None and cap > 0,
                    max_forced=cap)
                items.append(VerifyItem(slot=r.slot, start_pos=r.decode.cache_len,
                                        tokens=r.decode.verify_tokens(d),
                                        sampling=r.decode.sampling,
                                        want_hidden=self._hidden_for(r),
                                        hidden_layers=self._layers_for(r),
                                        logprobs=r.decode.options.logprobs, mask=mask))
                batch.append((r, d))
            except Exception as exc:
                await self._fail(r, exc)
        verify_tokens = sum(len(item.tokens) for item in items)
        prefilling, chunk_items = self._prefill_items(verify_tokens)
        if not batch and not prefilling:
            return None
        # Requests whose adaptive choice was to verify this step undrafted (recorded below,
        # so acceptance unknown there fades to the prior); `_run_ahead` sets the flag anew.
        chose_none = {r for r, d in batch if r.chose_no_draft and not len(d)}
        for r, _ in batch:
            r.chose_no_draft = False
        began = time.perf_counter()
        # Pipelined: the run-ahead is launched once the verify is on its way (so building it
        # does not delay the verify), to draft while the target computes.
        call = self.target.verify if batch else self.target.prefill
        outputs, whole = await self._target_call(
            call, [r for r, _ in batch] + prefilling, items + chunk_items,
            sent=(lambda: self._run_ahead(batch)) if self.pipeline and batch else None)
        # The cost model prices verify steps (what drafting adds to): a prompt chunk's
        # tokens would stretch it to sizes no draft reaches.
        if whole and batch and not prefilling and self.cost_model is not None:
            self.cost_model.observe(verify_tokens, time.perf_counter() - began)
        await self._prefilled(prefilling, chunk_items, outputs[len(batch):])
        if not batch:
            return None
        outputs = outputs[:len(batch)]
        self.stats.steps += 1
        if self.pipeline:
            self.stats.pipelined_steps += 1
        elif self.undrafted:
            self.stats.undrafted_steps += 1
        else:
            self.stats.serial_steps += 1
        committed = 0
        still = []
        for (req, draft), out in zip(batch, outputs, strict=True):
            if out is None:  # failed with its call
                continue
            try:
                result = req.decode.result
                generated_before = len(req.decode.generated)
                accepted_before = result.accepted_tokens
                forced, refused = result.forced_tokens, result.grammar_rejected_tokens
                req.decode.on_verify(draft, out.rows, out.hidden, out.logprobs)
                committed += len(req.decode.generated) - generated_before
                accepted = result.accepted_tokens - accepted_before
                self.stats.forced_tokens += result.forced_tokens - forced
                self.stats.grammar_rejected_tokens += result.grammar_rejected_tokens - refused
                if req.adaptive is not None:
                    req.adaptive.tick()
                if self.pipeline:
                    if req.adaptive is not None and (len(draft) or req in chose_none):
                        req.adaptive.tracker.record(len(draft), accepted)
                elif req.adaptive is not None and req.adaptive.awaiting_update:
                    req.adaptive.update(len(draft), accepted)
            except Exception as exc:
                await self._fail(req, exc)
                continue
            await self._after_step(req)
            if not req.decode.finished:
                still.append(req)
        # Requests whose last prompt chunk was in this step joined `active` in `_prefilled`:
        # they verify from the next step on.
        self.active = still + [r for r in self.active if r not in active]
        return committed, len(batch), bool(prefilling)

    async def _prefilled(self, requests: list[ServiceRequest], items: list,
                         outputs: list) -> None:
        """Books this step's prompt chunks: a request whose last chunk was computed samples
        its first token (`DecodeRequest.on_prefill`, with every chunk's hidden rows) and
        decodes from the next step on."""
        for req, item, out in zip(requests, items, outputs, strict=True):
            if out is None:  # failed with its call
                continue
            req.prefilled += len(item.tokens)
            if out.hidden is not None:
                req.prompt_hidden.append(out.hidden)
            if item.prompt_logprobs is not None:
                try:
                    if out.logprobs is None:
                        raise ValueError("the target scored no prompt tokens")
                    req.decode.on_prompt_logprobs(item.offset, out.logprobs)
                except Exception as exc:
                    await self._fail(req, exc)
                    continue
            if not item.last:
                continue
            hidden, req.prompt_hidden = req.prompt_hidden, []
            try:
                req.decode.on_prefill(
                    out.rows, None if not hidden else
                    hidden[0] if len(hidden) == 1 else torch.cat(hidden), out.logprobs)
            except Exception as exc:
                await self._fail(req, exc)
                continue
            if req.prefill_started_at is not None:
                self.latency.prefill.observe(time.monotonic() - req.prefill_started_at)
            self._admitting.remove(req)
            await self._after_step(req)
            if not req.decode.finished:
                self.active.append(req)

    async def _target_call(self, call, requests: list[ServiceRequest], items: list,
                           sent: Callable[[], None] | None = None) -> tuple[list, bool]:
        """``call(items)`` (the target's batched prefill or verify) for ``requests``, one item
        each. Returns (outputs, whether the batched call succeeded); an output is None for a
        request that failed (already answered and released).

        A ``ValueError`` (the engine refusing an item; nothing is changed then, and every
        item is fed at absolute positions after a rollback, so a retry is safe) retries the
        items one at a time: only the offending request fails. Any other exception is a
        failure of the target itself: `_on_target_failure` for the requests not yet answered.

        ``sent()`` runs once the call is on its way (its first step scheduled), before it is
        awaited; then the tokens of the previous step are streamed (`_flush`): work the
        loop does while the target computes.
        """
        if not items:
            return [], False
        task = asyncio.ensure_future(call(items))
        try:
            if sent is not None:
                sent()
            self._flush()
            outputs = list(await task)
            self.stats.forward_calls += 1
            return outputs, True
        except asyncio.CancelledError:
            task.cancel()
            raise
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
        if error is None and isinstance(exc, GrammarError):  # its message is for the client
            field = exc.field
            why = str(exc).removeprefix(f"{field}: ") if field else str(exc)
            error = (RequestInvalid("{field}: " + literal(why), field) if field
                     else RequestInvalid(literal(why)))
        if error is None:
            error = exc if isinstance(exc, RequestError) else RequestFailed(REQUEST_FAILED)
        if isinstance(exc, ReplicaFailed):
            # Its replica's death has its own one-line ERROR (`ReplicaScheduler`); the
            # traceback (with Ray's raw report as its cause) is for DEBUG.
            log.warning("request %s failed: %s", req.id, exc)
            log.debug("request %s failed", req.id, exc_info=exc)
        else:
            log.error("request %s failed: %r", req.id, exc, exc_info=exc)
        self._push(req)  # what it committed before failing still reaches its client
        req.cause = exc
        self.stats.failed += 1
        if req in self.active:
            self.active.remove(req)
        if req in self._admitting:
            self._admitting.remove(req)
        req.events.put_nowait(error)
        await self._release(req, count=False)

    def _hidden_for(self, req: ServiceRequest) -> bool:
        return self.wants_hidden and req.speculate

    def _layers_for(self, req: ServiceRequest) -> tuple[int, ...]:
        """The ``hidden_layers`` of ``req``'s items (``()`` when it wants no rows)."""
        return self.hidden_layers if self._hidden_for(req) else ()

    async def _after_step(self, req: ServiceRequest) -> None:
        if not req.decode.finished:
            self._unsent.append(req)  # streamed once the next target call is sent
            return
        self._push(req)
        req.events.put_nowait(req.decode.result)
        await self._release(req)

    def _push(self, req: ServiceRequest) -> None:
        n = req.push_new_tokens()
        if n:
            now = time.monotonic()
            if req.first_token_at is None:
                req.first_token_at = now
                self.latency.ttft.observe(now - req.submitted_at)
            else:
                self.latency.itl.observe(now - req.last_token_at)
            req.last_token_at = now
        self.stats.tokens_generated += n
        self._emitted(n)

    def _emitted(self, n: int) -> None:
        """Called with the count of tokens each push streamed (a hook for metering)."""

    def _flush(self) -> None:
        """Streams every decoding request's tokens not yet streamed."""
        unsent, self._unsent = self._unsent, []
        for req in unsent:
            self._push(req)

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
            pending = req.ahead.task if req.ahead is not None else None
            req.ahead = None
            output = remembered_tokens(req.decode.history, req.decode.num_prompt_tokens,
                                       req.decode.generated) if self.remember_outputs else None
            task = asyncio.get_running_loop().create_task(
                self._release_drafter(req.id, pending, output, req.partition))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)

    async def settle_drafter(self) -> None:
        """Waits until every drafter release in flight (and the output it sends to a
        cross-request cache) is done: the in-process path's end, so the next request's
        drafter sees this one's output."""
        if self._releasing:
            await asyncio.wait(set(self._releasing))

    async def _release_drafter(self, request_id: str, pending: asyncio.Future | None,
                               output: list[int] | None = None, partition: str = "") -> None:
        """Tells the drafter to forget ``request_id``, after its call in flight (a release
        that overtook it would leave state the call then re-creates); ``output``: the
        request's tokens for the drafter's cross-request cache (`remember_outputs`), kept
        in the request's ``partition`` only."""
        if pending is not None and not pending.done():
            await asyncio.wait({pending})
        await self.drafter.release([request_id])
        if output:
            await self.drafter.remember([output], [partition])

    async def _drop_cancelled(self) -> None:
        for req in [r for r in self.active if r.cancelled]:
            self.active.remove(req)
            await self._finish_cancelled(req)
        for req in [r for r in self._admitting if r.cancelled]:  # mid-prefill
            self._admitting.remove(req)
            await self._finish_cancelled(req)

    async def _finish_cancelled(self, req: ServiceRequest) -> None:
        self._push(req)
        self.stats.cancelled += 1
        req.events.put_nowait(asyncio.CancelledError("cancelled by the client"))
        # Awaited, not left to a task: the slot must be free before admission reuses it.
        await self._release(req, count=False)
