"""A request as the step loop holds it (`ServiceRequest`: its decode state plus scheduling
state, its pipelined run-ahead proposal `RunAhead`) and the loop's counters
(`SchedulerStats`): the bookkeeping `coordinator.step.scheduler.Scheduler` and its drafting
policy (`coordinator.step.drafting`) share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from specd_core.draft import DraftBlock
from specd_core.request import DecodeRequest

from .adaptive import AdaptiveDraftLength


@dataclass(eq=False)
class RunAhead:
    """A run-ahead proposal in flight or done, stamped with what it assumed.

    Attributes:
        base_len: ``len(history)`` when it was launched (the history then ended in the
            anchor of the block being verified).
        assumed: that block's draft tokens.
        task: the batched drafter call; its result is one `DraftBlock` per job.
        index: this request's job in that call.
    """

    base_len: int
    assumed: tuple[int, ...]
    task: asyncio.Future
    index: int

    def block(self) -> DraftBlock:
        """The proposal (empty when the call failed); only once ``task`` is done."""
        if self.task.cancelled() or self.task.exception() is not None:
            return DraftBlock.empty()
        return self.task.result()[self.index]

    def matches(self, history: Sequence[int]) -> bool | None:
        """Whether ``history`` is what it assumed plus its guess: True / False once that
        can be told (False without waiting when the assumed block was not committed whole;
        otherwise once the call is done), None while it depends on the guess still in
        flight."""
        tail = history[self.base_len:]
        if len(tail) != len(self.assumed) + 1 or tuple(tail[:-1]) != self.assumed:
            return False
        if not self.task.done():
            return None
        block = self.block()
        return bool(len(block)) and block.tokens[0] == tail[-1]


@dataclass(eq=False)
class ServiceRequest:
    """One request inside the service: its core decode state plus scheduling state.

    ``events`` receives ``list[int]`` token batches in order, then the final
    `SpeculativeDecodeResult` (or an Exception if the service failed it)."""

    id: str
    decode: DecodeRequest
    speculate: bool
    max_draft_len: int | None
    #: Cross-request state partition (tenant and cache_salt; "" shared): warm prefixes and the
    #: drafter's cache are looked up only within it.
    partition: str = ""
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    slot: int | None = None
    cancelled: bool = False
    #: The tenant it was submitted for (`coordinator.front.tenants`; "" without tokens).
    tenant: str = ""
    drafter_failures: int = 0
    emitted: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    #: This request's draft-length policy when the scheduler is adaptive (made lazily).
    adaptive: AdaptiveDraftLength | None = None
    #: What failed it, when the scheduler failed it (``events`` gets a `RequestError`).
    cause: BaseException | None = None
    #: Pipelined scheduling: this request's run-ahead call, until it is used or dropped
    #: (no second call for its id starts while one is in flight).
    ahead: RunAhead | None = None
    #: Pipelined: the adaptive choice for this request's next step was not to draft.
    chose_no_draft: bool = False
    #: Prompt tokens its slot holds (reused from a warm prefix, or computed by chunks).
    prefilled: int = 0
    #: Prompt tokens reused from a warm prefix when its slot was allocated (the usage's
    #: ``cached_tokens``).
    cached_tokens: int = 0
    #: Hidden rows of the prompt chunks computed so far (drafters that want them).
    prompt_hidden: list = field(default_factory=list)
    #: `time.monotonic` when its first prompt chunk was sent, its first and its latest
    #: token streamed (None until then): the latency metrics.
    prefill_started_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    def push_new_tokens(self) -> int:
        """Puts the tokens committed since the last push on ``events``; returns how many."""
        generated = self.decode.generated
        new = len(generated) - self.emitted
        if new > 0:
            self.events.put_nowait(list(generated[self.emitted:]))
            self.emitted = len(generated)
        return max(new, 0)


@dataclass
class SchedulerStats:
    steps: int = 0
    #: Tokens streamed to clients, as they stream: cancelled and failed requests' included.
    tokens_generated: int = 0
    forward_calls: int = 0
    drafter_failures: int = 0
    completed: int = 0
    cancelled: int = 0
    #: Requests failed alone (their own fault, or their target call's).
    failed: int = 0
    #: Seconds the loop waited for drafts before a verify could start (the serial step's
    #: whole Propose; pipelined, a late run-ahead or a fresh draft after a miss).
    draft_wait_seconds: float = 0.0
    #: Pipelined: steps of a request that used its run-ahead block / found it unusable
    #: (stale, wrong guess, late or failed).
    runahead_hits: int = 0
    runahead_misses: int = 0
    #: Verification steps run pipelined / serial / with no drafter call (their sum is
    #: ``steps``), and switches between them (``pipeline="auto"``).
    pipelined_steps: int = 0
    serial_steps: int = 0
    undrafted_steps: int = 0
    schedule_switches: int = 0
    #: Seconds a step or a prefill was in progress (the target busy fraction's
    #: denominator: the replica's compute seconds over this).
    active_seconds: float = 0.0
    #: Constrained requests: draft positions the grammar forced (always accepted) and
    #: drafter tokens the grammar refused (rejected), as verified.
    forced_tokens: int = 0
    grammar_rejected_tokens: int = 0
