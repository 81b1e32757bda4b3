"""An in-process drafter behind the scheduler's drafter interface.

`LocalDrafter` serves a plain `Drafter` object the way a drafter worker does (the same
per-request `DrafterSessions`), minus gRPC: `propose(jobs)`, `release(ids)`, `info()` and
`drafter_stats()`, as `drafter_worker.client.DrafterClient` offers them. The in-process
decode path (`coordinator.step.speculative.speculative_decode_with`) drives the service's
scheduler through it.
"""

from __future__ import annotations

from collections.abc import Sequence

from specd_core.draft import DraftBlock, Drafter
from specd_core.sampling import draft_sampling

from .client import DrafterInfo, DrafterStats, ProposeJob, check_jobs
from .sessions import DrafterSessions, SessionLimits


class LocalDrafter:
    """A `Drafter` in this process, with per-request sessions keyed by job id.

    Hidden rows reach the drafter as they are kept (float32 in process: no wire rounding);
    a request's transforms reach a session drafter as `draft_sampling` of its sampling
    parameters. A drafting problem gives that job an empty block (logged), as in the worker.

    Args:
        drafter: any `Drafter`; its `DrafterCapabilities` decide hidden rows and sessions.
        limits: `SessionLimits` (default: no history cap beyond the request's own context).
    """

    def __init__(self, drafter: Drafter, limits: SessionLimits | None = None):
        self.sessions = DrafterSessions(drafter, limits)
        self.capabilities = self.sessions.capabilities

    async def info(self) -> DrafterInfo:
        caps = self.capabilities
        return DrafterInfo(type(self.sessions.drafter).__name__, caps.wants_hidden,
                           caps.max_draft_len or 0, caps.remembers, caps.hidden_layers)

    async def drafter_stats(self) -> DrafterStats:
        """The drafter's counters and cache size (`DrafterSessions.stats`)."""
        return DrafterStats(**self.sessions.stats())

    async def propose(self, jobs: Sequence[ProposeJob]) -> list[DraftBlock]:
        """One block per job, in order, each at most ``job.max_len`` long.

        Raises:
            ValueError: a repeated request id or a negative ``max_len`` (nothing applied).
        """
        check_jobs(jobs)
        blocks = []
        for job in jobs:
            known, append, rows = job.delta(self.sessions.known(job.request_id))
            sampling = None if job.sampling is None else draft_sampling(job.sampling)
            _, block = self.sessions.propose(
                job.request_id, known, append, job.max_len,
                lambda rows=rows: None if rows is None else rows.float(), sampling, job.seed,
                job.assumed, job.ahead, job.partition)
            blocks.append(block)  # a resync has forgotten the id: its next job resends all
        return blocks

    async def release(self, request_ids: Sequence[str]) -> None:
        self.sessions.release(list(request_ids))

    async def remember(self, outputs: Sequence[Sequence[int]],
                       partitions: Sequence[str] | None = None) -> None:
        """Finished outputs for a drafter with a cross-request cache (ignored otherwise),
        output ``i`` in partition ``partitions[i]`` (None: all shared, "").

        Raises:
            ValueError: ``partitions`` not one per output.
        """
        self.sessions.remember(list(outputs), None if partitions is None else list(partitions))
