"""The pipelined, the serial or the undrafted step, chosen per replica by measurement as it
runs.

`coordinator.step.scheduler.Scheduler` has two step schedules (its module docstring): pipelined
(the drafter drafts block t+1 while the target verifies block t, after PEARL) and serial
(draft, then verify). Which is faster depends on the machine and its load: on a 2-core CPU
the drafter, the coordinator and the target share the cores, so the run-ahead slows the
target's forward and its misses cost work; on the tiny model the pipelined step measured
from 1.22x the serial one's throughput down to 0.72x on one machine, depending on what else
ran (docs/benchmarks.md, "The pipelined step"); with spare cores, or a drafter on another
node, pipelining wins. Both are lossless and commit the same tokens, seeded ones included, so
the loop may change schedule at any step boundary: `ScheduleChooser` measures both and keeps
the faster (``specd serve --pipeline auto``, the default). A third option, no drafting at
all (`UNDRAFTED`), is measured the same way: where drafts are accepted too rarely to pay for
the drafter's call and the rows they add (a target forward of a few ms beside a drafter call
of one or two), it wins and the replica decodes plainly, trying the other two again now and
then.

What is compared: wall time per committed token, the inverse of what a client sees, over
the steps that verify without prompt chunks (a chunk's cost depends on the prompt, not the
schedule), separately for each bucket of active-request counts (`active_bucket`): a step's
cost per token falls steeply with the batch (tiny model: 1.26 ms for ~2.8 tokens at 1
stream, 2.56 ms for ~22 at 8), so only steps of similar batches are comparable. Per token,
not per step: a pipelined step that missed its run-ahead commits fewer tokens, and a
schedule that drafts nothing (adaptive drafting turned off, a dry drafter) has cheap steps
of one token each; per-token costs price both fairly.

How: the schedule changes only between windows of ``window`` booked steps (a window's
first ``settle`` steps after a switch are not booked: the first pipelined step has no
run-ahead yet, the first serial one waits for run-aheads still in flight). At each window's
end its per-bucket sums (seconds over tokens, a bucket's share booked only with at least
``min_steps`` steps) go to that bucket's `specd_core.choice.MeasuredChoice` (the pattern of
`target_worker.engine.ThreadChooser`, one pick per window), and the bucket of the next step
picks the next window's schedule: each unmeasured schedule first (pipelined, then serial),
then the cheaper, the other replacing the current best only while ``margin`` cheaper, with
one window of the other every ``explore_every`` windows, backing off to one in
``max_explore_every`` while it keeps losing. A step stalled by another process counts at
most `coordinator.step.adaptive.ForwardCostModel.OUTLIER_FACTOR` times its bucket's cost, as in
the forward cost model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from specd_core.choice import MeasuredChoice

from .adaptive import ForwardCostModel

__all__ = ["OPTIONS", "PIPELINED", "SERIAL", "ScheduleChooser", "UNDRAFTED", "active_bucket",
           "check_pipeline"]

PIPELINED = "pipelined"
SERIAL = "serial"
#: No drafter call at all: plain decoding, one token per request per step.
UNDRAFTED = "undrafted"
#: The schedules `ScheduleChooser` chooses among by default. Preferred first: the one that
#: wins wherever the drafter has cores of its own; last, no drafting, which wins where drafts
#: are accepted too rarely to pay for the drafter's call and the rows they add (so
#: speculation never costs throughput for long).
OPTIONS = (PIPELINED, SERIAL, UNDRAFTED)


def check_pipeline(value) -> bool | str:
    """``value`` when it is a valid ``pipeline`` setting: True (pipelined), False (serial)
    or ``"auto"`` (`ScheduleChooser`).

    Raises:
        ValueError: anything else, naming ``pipeline``.
    """
    if value is True or value is False or value == "auto":
        return value
    raise ValueError(f"pipeline must be True (on), False (off) or 'auto', got {value!r}")


def active_bucket(active: int) -> int:
    """The bucket of a step with ``active`` decoding requests (>= 1): the count itself up to
    7, then the count with all but its three leading bits cleared (8-9, 10-11, 12-13, 14-15,
    16-19, 20-23, ...), so a bucket spans at most 1.25x in batch size. Returns the bucket's
    least count."""
    active = max(1, int(active))
    shift = max(0, active.bit_length() - 3)
    return (active >> shift) << shift


class ScheduleChooser:
    """Chooses each step's schedule, `PIPELINED`, `SERIAL` or `UNDRAFTED`, for one scheduler
    (one replica)
    from its measured wall time per committed token (see the module docstring).

    The scheduler calls `schedule` at each step boundary (it may switch there) and `record`
    after the step with what the step cost; ``clock`` is what it times steps with (a test
    injects its own costs through it).

    Args:
        window: booked steps per window, >= 1.
        explore_every: windows between explorations of the other schedule at first, >= 1.
        max_explore_every: the most windows between explorations while the other keeps
            losing.
        margin: how much cheaper (a fraction) the other schedule must measure to replace the
            current best.
        alpha: EMA weight of a window's cost in a bucket's estimate, in (0, 1].
        settle: steps after a switch not booked, >= 0.
        min_steps: a window's steps in a bucket below which the window books nothing for
            it (default: a quarter of ``window``, at least 1).
        max_window_steps: a window also ends after this many steps, booked or not (steps
            with prompt chunks are not booked; default: 4 windows' worth).
        clock: seconds, monotonic (default `time.perf_counter`).
        options: the schedules chosen among, the first one it starts with (default
            `OPTIONS`: all three).

    Raises:
        ValueError: an argument out of range.
    """

    #: The schedules chosen among (``options``).
    OPTIONS = OPTIONS

    def __init__(self, window: int = 16, explore_every: int = 4, max_explore_every: int = 32,
                 margin: float = 0.05, alpha: float = 0.5, settle: int = 1,
                 min_steps: int | None = None, max_window_steps: int | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 options: tuple[str, ...] = OPTIONS):
        if window < 1 or settle < 0 or (min_steps is not None and min_steps < 1):
            raise ValueError(f"need window >= 1, settle >= 0 and min_steps >= 1, got "
                             f"{window}, {settle}, {min_steps}")
        if not options or options[0] not in OPTIONS or not set(options) <= set(OPTIONS):
            raise ValueError(f"options must be schedules of {OPTIONS}, the first one it "
                             f"starts with, got {options!r}")
        self.OPTIONS = tuple(dict.fromkeys(options))
        self.window = window
        self.settle = settle
        self.min_steps = min_steps if min_steps is not None else max(1, window // 4)
        self.max_window_steps = max(window, max_window_steps or 4 * window)
        self.clock = clock
        self._chooser_args = dict(explore_every=explore_every, alpha=alpha, warmup=0,
                                  margin=margin, max_explore_every=max_explore_every,
                                  sticky=True)
        MeasuredChoice(self.OPTIONS, **self._chooser_args)  # names a bad argument now
        #: The schedule now.
        self.current = self.OPTIONS[0]
        #: One choice per active-request bucket (`active_bucket`), made on first use.
        self.buckets: dict[int, MeasuredChoice] = {}
        #: Windows closed, and switches between schedules.
        self.windows = 0
        self.switches = 0
        self._open = False
        self._booked = 0
        self._steps = 0
        self._settling = 0
        #: This window's [seconds, tokens, steps] by bucket.
        self._sums: dict[int, list] = {}

    def _bucket(self, bucket: int) -> MeasuredChoice:
        choice = self.buckets.get(bucket)
        if choice is None:
            choice = self.buckets[bucket] = MeasuredChoice(self.OPTIONS, **self._chooser_args)
        return choice

    def schedule(self, active: int) -> str:
        """The schedule of the next step, which decodes ``active`` requests (>= 1): the
        current one, unless this step starts a new window (the first step, or the last
        window is full), whose schedule the bucket of ``active`` picks."""
        if (not self._open or self._booked >= self.window
                or self._steps >= self.max_window_steps):
            if self._open:
                self._close_window()
            choice = self._bucket(active_bucket(active)).pick()
            if choice != self.current:
                self.current = choice
                self._settling = self.settle
                self.switches += 1
            self._open, self._booked, self._steps, self._sums = True, 0, 0, {}
        return self.current

    def record(self, seconds: float, tokens: int, active: int, prefill: bool = False) -> None:
        """Books the step just run on the current schedule: ``seconds`` of wall time,
        ``tokens`` committed by verification, ``active`` requests verified; ``prefill``:
        prompt chunks shared its forward (then it is not booked, nor is a settling step or
        one that committed nothing)."""
        self._steps += 1
        if self._settling > 0:
            self._settling -= 1
            return
        if prefill or tokens <= 0 or not seconds >= 0:
            return
        bucket = active_bucket(active)
        cost = self._bucket(bucket).cost.get(self.current)
        if cost is not None:  # a stall beside another process: capped, as the cost model does
            seconds = min(seconds, ForwardCostModel.OUTLIER_FACTOR * cost * tokens)
        sums = self._sums.setdefault(bucket, [0.0, 0, 0])
        sums[0] += seconds
        sums[1] += tokens
        sums[2] += 1
        self._booked += 1

    def _close_window(self) -> None:
        for bucket, (seconds, tokens, steps) in self._sums.items():
            if steps >= self.min_steps:
                self._bucket(bucket).record(self.current, seconds, tokens)
        self.windows += 1

    def status(self) -> dict:
        """``schedule`` (the current one), ``switches``, ``windows``, and ``costs``: per
        bucket measured, ``active`` (its least count), ``pipelined`` / ``serial`` /
        ``undrafted`` (seconds per committed token, 0 while unmeasured) and ``best`` (``""``
        until every one is)."""
        return {
            "schedule": self.current, "switches": self.switches, "windows": self.windows,
            "costs": [{"active": b, **{o: c.cost.get(o, 0.0) for o in self.OPTIONS},
                       "best": c.best or ""}
                      for b, c in sorted(self.buckets.items()) if c.cost],
        }
