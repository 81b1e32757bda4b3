"""The scheduler's drafting policy: which request drafts how much this step, and when.

`DraftingPolicy` is the part of `coordinator.step.scheduler.Scheduler` that decides drafts (a mixin:
it reads the scheduler's drafter, cost model, adaptive flag, stats and per-request state, and
the loop calls it once per step): the serial step's fresh proposals (`_propose`), the
pipelined step's run-ahead proposals stamped with what they assumed (`RunAhead`,
`_run_ahead`, `_pipelined_drafts`), the fresh-or-undrafted choice for requests whose
run-ahead missed (`_fresh_pays`, from `coordinator.step.adaptive`'s cost model), and each
request's adaptive draft length (`_policy`). Drafting never touches a request's own
generator, so every choice here changes speed, never tokens.

Pipelining follows PEARL's post-verify (Liu et al., ICLR 2025) and SGLang's decoupled
speculation (sgl-project/sglang#22520): see `coordinator.step.scheduler`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from specd_core.draft import DraftBlock

from .adaptive import AdaptiveDraftLength, expected_tokens
from .requests import RunAhead, ServiceRequest

#: Prompt tokens sent before each finished output to a drafter's cross-request cache
#: (`remembered_tokens`), so the cache knows how earlier prompts ended and can draft an
#: answer's first tokens, not only its middle. 16: the repeated-structure workload's greedy
#: outputs replayed through `SuffixDrafter` with the paper's settings
#: (`scripts/suffix_replay.py`) drafted 1.53 tokens per forward with no prompt tokens, 1.90
#: with 8, 2.4 with 16 and no more with 23 (the trees' depth bounds what a match can use).
REMEMBER_PROMPT_TAIL = 16


def remembered_tokens(history: Sequence[int], num_prompt_tokens: int,
                      generated: Sequence[int]) -> list[int]:
    """What a finished request gives a cross-request cache: the last `REMEMBER_PROMPT_TAIL`
    of its ``num_prompt_tokens`` prompt tokens (the head of ``history``), then its
    ``generated`` tokens; ``[]`` when nothing was generated."""
    if not generated:
        return []
    prompt = history[:num_prompt_tokens]
    return [int(t) for t in prompt[-REMEMBER_PROMPT_TAIL:]] + [int(t) for t in generated]

__all__ = ["DraftingPolicy"]

# The loop's logger: drafting's warnings are the step's, filtered in one place.
log = logging.getLogger("coordinator.step.scheduler")


class DraftingPolicy:
    """The drafting half of `coordinator.step.scheduler.Scheduler` (see the module docstring).

    Reads, from the scheduler it is mixed into: ``drafter`` (a `DrafterClient`-like batched
    proposer, or None), ``cost_model``, ``adaptive``, ``pipeline``, ``wants_hidden``,
    ``drafter_max_len``, ``stats`` (`SchedulerStats`), ``_drafting`` (drafter calls in
    flight); keeps ``drafter_latency_s`` and ``runahead_hit_rate`` current.
    """

    drafter_latency_s: float | None
    runahead_hit_rate: float

    async def _propose(self, requests: list[ServiceRequest], step_tokens: int | None = None
                       ) -> list[DraftBlock]:
        """A fresh draft per request (empty where it drafts nothing), from one batched
        drafter call. ``step_tokens``: tokens already in this step's forward (default: one
        anchor per request)."""
        drafts = [DraftBlock.empty() for _ in requests]
        if self.drafter is None:
            return drafts
        from drafter_worker.client import ProposeJob

        jobs, where = [], []
        # Tokens already in this step's forward: every request's anchor, plus the drafts
        # chosen so far (the adaptive choice prices drafts at the margin of the whole step).
        if step_tokens is None:
            step_tokens = len(requests)
        for i, req in enumerate(requests):
            try:
                # The step waits for the drafter once: the first request that drafts pays.
                call = 0.0 if jobs else (self.drafter_latency_s or 0.0)
                job = self._propose_job(req, step_tokens, ProposeJob, call)
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
        blocks = await self._call_drafter([requests[i] for i in where], jobs)
        for i, job, block in zip(where, jobs, blocks, strict=True):
            drafts[i] = block.truncate(job.max_len)
            self._record_call(requests[i], len(block) > 0)
        return drafts

    def _record_call(self, req: ServiceRequest, proposed: bool) -> None:
        """Tells ``req``'s adaptive policy whether a synchronous drafter call (the serial
        step's, or a fresh one after a run-ahead miss: on the critical path, unlike a
        run-ahead) proposed anything, and what a call costs: the drafter's mean call time
        over a step's modelled cost (dry calls back off where that share is not negligible:
        `AdaptiveDraftLength.record_call`)."""
        if req.adaptive is None:
            return
        share = 0.0
        if self.drafter_latency_s is not None and self.cost_model is not None:
            share = self.drafter_latency_s / self.cost_model.cost(max(1, len(self.active)))
        req.adaptive.record_call(proposed, share)

    async def _call_drafter(self, requests: list[ServiceRequest], jobs: list,
                            after: set[asyncio.Future] | None = None) -> list[DraftBlock]:
        """One batched drafter call for ``jobs`` (``requests[i]``'s job is ``jobs[i]``),
        once the calls in ``after`` are done: one block per job, empty where drafting
        failed. Never raises: an unavailable drafter costs these jobs their drafts; a job
        the drafter refuses (ValueError before anything was sent) stops drafting for its
        request alone."""
        from drafter_worker.client import DrafterUnavailable

        if after:
            await asyncio.wait(after)
        began = time.perf_counter()
        try:
            blocks = list(await self.drafter.propose(jobs))
        except DrafterUnavailable as exc:
            log.warning("drafter unavailable, decoding this step without drafts: %s", exc)
            self.stats.drafter_failures += 1
            for req in requests:
                req.drafter_failures += 1
            return [DraftBlock.empty() for _ in jobs]
        except ValueError as exc:  # a job refused before anything was sent: find which
            log.warning("drafter refused a batch of %d jobs (%r); proposing one at a time",
                        len(jobs), exc)
            blocks = []
            for req, job in zip(requests, jobs, strict=True):
                try:
                    blocks.extend(await self.drafter.propose([job]))
                except ValueError as one:
                    self._stop_drafting(req, one)
                    blocks.append(DraftBlock.empty())
                except DrafterUnavailable:
                    req.drafter_failures += 1
                    blocks.append(DraftBlock.empty())
        seconds = time.perf_counter() - began
        self.drafter_latency_s = seconds if self.drafter_latency_s is None else (
            0.8 * self.drafter_latency_s + 0.2 * seconds)
        return blocks

    # ---- pipelined drafting ----

    def _policy(self, req: ServiceRequest) -> AdaptiveDraftLength | None:
        """``req``'s adaptive policy (made on first use), or None when not adaptive."""
        if not (self.adaptive and self.cost_model is not None):
            return None
        if req.adaptive is None:
            req.adaptive = AdaptiveDraftLength(self.cost_model)
        return req.adaptive

    def _usable(self, req: ServiceRequest, block: DraftBlock) -> DraftBlock:
        """``block`` cut to what ``req`` may verify now."""
        limit = self._usable_len(req)
        return DraftBlock(block.tokens[:limit], block.dists[:limit])

    async def _pipelined_drafts(self, active: list[ServiceRequest]) -> list[DraftBlock]:
        """This step's draft per request: its run-ahead block where verification committed
        what it assumed plus its guess; for the others a fresh draft or none, whichever the
        cost model expects to commit more tokens per second. Time spent here is draft wait.
        """
        began = time.perf_counter()
        await asyncio.sleep(0)  # lets drafter calls that have answered finish
        # Wait for run-ahead calls still in flight, for at most a step's cost times the
        # run-ahead hit rate (what waiting is expected to buy; a drafter slower than a step
        # is stalled, not late): one whose assumed block was committed whole may hit, and a
        # stale one must finish before its request's next call.
        late = {r.ahead.task for r in active
                if r.ahead is not None and not r.ahead.task.done()}
        if late:
            budget = None if self.cost_model is None else (
                self.cost_model.cost(len(active)) * self.runahead_hit_rate)
            await asyncio.wait(late, timeout=budget)
        drafts = [DraftBlock.empty() for _ in active]
        misses = []
        for i, req in enumerate(active):
            ahead = req.ahead
            if ahead is None:
                if req.speculate and not req.chose_no_draft:
                    misses.append(i)
                continue
            if ahead.matches(req.decode.history):
                block = ahead.block()
                drafts[i] = self._usable(req, DraftBlock(block.tokens[1:], block.dists[1:]))
                req.ahead = None
                self.stats.runahead_hits += 1
                self.runahead_hit_rate += 0.05 * (1.0 - self.runahead_hit_rate)
                continue
            self.stats.runahead_misses += 1
            self.runahead_hit_rate -= 0.05 * self.runahead_hit_rate
            if ahead.task.done():
                req.ahead = None
                # A run-ahead that proposed nothing (adaptive): verified undrafted now, with
                # no synchronous fresh call (its next run-ahead is on its way). Asking again
                # at once, on the critical path, is what made prompt lookup slower than plain
                # decoding on open questions (issue 23).
                dry = req.adaptive is not None and not len(ahead.block())
                if req.speculate and not dry:
                    misses.append(i)
            # else still in flight: this step goes undrafted; the next call for its id
            # waits for it (`_run_ahead`).
        if misses and self._fresh_pays(active, drafts, misses):
            fed = sum(len(d) + 1 for d in drafts)
            fresh = await self._propose([active[i] for i in misses], step_tokens=fed)
            for i, block in zip(misses, fresh, strict=True):
                drafts[i] = block
        self.stats.draft_wait_seconds += time.perf_counter() - began
        return drafts

    def _fresh_pays(self, active: list[ServiceRequest], drafts: list[DraftBlock],
                    misses: list[int]) -> bool:
        """Whether waiting for fresh drafts for ``misses`` commits more tokens per second
        than verifying them undrafted now: expected tokens (`expected_tokens` over each
        request's acceptance) over the step's cost (`ForwardCostModel`) plus the drafter's
        mean latency. Without a cost model: always (the serial step's choice)."""
        if self.cost_model is None or not self.adaptive or self.drafter_latency_s is None:
            return True
        fed = sum(len(d) + 1 for d in drafts)
        now = 0.0
        for req, draft in zip(active, drafts, strict=True):
            policy = self._policy(req)
            now += 1.0 if policy is None or not len(draft) else expected_tokens(
                policy.tracker.rates(len(draft)), len(draft))
        gain, extra = 0.0, 0
        for i in misses:
            req, policy = active[i], self._policy(active[i])
            budget = self._usable_len(req)
            k = policy.choose(budget, self.drafter_max_len, fed + extra - 1) if budget else 0
            if k:
                gain += expected_tokens(policy.tracker.rates(k), k) - 1.0
                extra += k
        if gain <= 0:
            return False
        cost = self.cost_model.cost
        return (now + gain) / (cost(fed + extra) + self.drafter_latency_s) > now / cost(fed)

    def _usable_len(self, req: ServiceRequest) -> int:
        """The most drafts ``req`` may verify now (budget, its own cap; 0 undrafted)."""
        limit = req.decode.draft_budget()
        if req.max_draft_len is not None:
            limit = min(limit, req.max_draft_len)
        return max(0, limit) if req.speculate else 0

    def _run_ahead(self, batch: list[tuple[ServiceRequest, DraftBlock]]) -> None:
        """Launches one batched run-ahead drafter call for this step's requests (each
        assuming its block is committed whole), to run while the target verifies."""
        from drafter_worker.client import ProposeJob

        fed = sum(len(d) + 1 for _, d in batch)
        jobs, owners = [], []
        for req, draft in batch:
            if not req.speculate:
                continue
            # The budget once this block and its bonus token are committed.
            budget = req.decode.options.max_new_tokens - len(req.decode.generated) \
                - len(draft) - 2
            if req.max_draft_len is not None:
                budget = min(budget, req.max_draft_len)
            if self.drafter_max_len is not None:
                budget = min(budget, self.drafter_max_len)
            policy = self._policy(req)
            k = budget if policy is None or budget <= 0 else policy.choose(
                budget, None, batch_tokens=fed - 1)
            if k <= 0:
                req.chose_no_draft = policy is not None and budget > 0
                continue
            try:
                # A snapshot: the rule appends to the history before this job is sent.
                jobs.append(self._job(ProposeJob, req, list(req.decode.history), k + 1,
                                      ahead=True, assumed=tuple(draft.tokens)))
            except Exception as exc:
                self._stop_drafting(req, exc)
                continue
            owners.append(req)
        if not jobs:
            return
        # A request's previous call still in flight (late, now superseded) must finish first:
        # one call per request id at a time.
        after = {r.ahead.task for r in owners if r.ahead is not None and not r.ahead.task.done()}
        task = asyncio.get_running_loop().create_task(self._call_drafter(owners, jobs, after))
        self._drafting.add(task)
        task.add_done_callback(self._drafting.discard)
        for index, (req, job) in enumerate(zip(owners, jobs, strict=True)):
            req.ahead = RunAhead(len(job.history), job.assumed, task, index)

    def _propose_job(self, req: ServiceRequest, step_tokens: int, job_type,
                     call_cost: float = 0.0):
        """``req``'s `ProposeJob` for this step, or None when it drafts nothing now.
        ``step_tokens``: tokens already in this step's forward, ``call_cost``: seconds the
        step would wait for the drafter if ``req`` drafts (both for the adaptive choice)."""
        budget = self._usable_len(req)
        if budget <= 0:
            return None
        policy = self._policy(req)
        if policy is not None and policy.resting():
            return None
        if policy is not None:
            budget = policy.next_len(budget, self.drafter_max_len, batch_tokens=step_tokens - 1,
                                     call_cost=call_cost)
            if budget <= 0:
                return None
        return self._job(job_type, req, req.decode.history, budget)

    def _job(self, job_type, req: ServiceRequest, history, max_len: int, **extra):
        """A `ProposeJob` (``job_type``) for ``req`` over ``history``: its hidden rows when
        the drafter wants them, its sampling and seed, its partition (a drafter's
        cross-request cache drafts only from that partition's outputs); ``extra``: the
        run-ahead fields."""
        return job_type(
            request_id=req.id, history=history, max_len=max_len, partition=req.partition,
            hidden_log=req.decode.hidden_log() if self.wants_hidden else None,
            sampling=req.decode.sampling,
            seed=0 if req.decode.options.seed is None else req.decode.options.seed, **extra)

    def _stop_drafting(self, req: ServiceRequest, exc: BaseException) -> None:
        """Drafting for ``req`` failed on its own (not the drafter's fault): it decodes
        undrafted from now on, which is lossless; the others keep drafting."""
        log.error("request %s: drafting failed (%r); it decodes without drafts", req.id, exc,
                  exc_info=exc)
        req.speculate = False
