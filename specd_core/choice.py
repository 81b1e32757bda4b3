"""Choosing among interchangeable ways of doing the same work by their measured cost.

`MeasuredChoice` keeps an exponential moving average of each option's cost (seconds per unit
of work: a token, a step, a window of steps) over the runs that used it, uses the cheapest,
and keeps trying the others now and then, less and less often while they keep losing, so a
machine that got busier or quieter is followed. Every option must give the same result (a
thread count, a lossless step schedule): only speed depends on the choice.

Two users: `target_worker.engine.ThreadChooser` (torch threads per kind of forward, one
choice per step) and `coordinator.step.schedule.ScheduleChooser` (the pipelined or the serial
step, one choice per window of steps, one `MeasuredChoice` per active-request bucket).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

__all__ = ["MeasuredChoice"]


class MeasuredChoice:
    """Picks among ``options`` by their measured cost per unit of work (`record`'s
    ``tokens``), exploring the others on a backed-off timer.

    Each `pick` is one run of the choice (a step, a window). An option not measured yet is
    picked first, in order (each until its first booked run). Then the cheapest is used, and
    every ``explore_every``-th pick tries another, so a change in costs is found. Each
    exploration that leaves the best option as it was doubles the picks to the next one, up
    to ``max_explore_every``; a new best starts again at ``explore_every``. Trying the worse
    option every ``n``-th pick costs ``1/n`` of the difference: backing off keeps that small
    where the difference is large and lasting.

    An option's first ``warmup`` runs are not booked (one-off costs of a first use).

    Hysteresis: another option replaces the preferred one only while it measures ``margin``
    (a fraction) cheaper. The preferred one is the first option, or with ``sticky`` the
    current best (so a switch either way needs the margin, and two options within noise of
    each other do not alternate). With ``retry_above`` (not ``sticky``), once every option is
    measured the others are tried again only while the first costs ``retry_above`` more than
    the least it has cost (the machine may have got busy) or while another is in use.

    Args:
        options: the choices (hashable, distinct after de-duplication), preferred first.
        explore_every: picks between explorations at first, >= 1.
        alpha: the EMA weight of a new measurement, in (0, 1].
        warmup: runs per option not booked, >= 0.
        margin: how much cheaper (a fraction in [0, 1)) another option must measure than the
            preferred one.
        retry_above: see above; None: always explore.
        max_explore_every: the most picks between explorations (None: ``explore_every``, no
            back-off).
        sticky: the margin favours the current best instead of the first option.

    Raises:
        ValueError: no options, or an argument out of range.
    """

    def __init__(self, options: Sequence[Hashable], explore_every: int = 12,
                 alpha: float = 0.3, warmup: int = 1, margin: float = 0.0,
                 retry_above: float | None = None,
                 max_explore_every: int | None = None, sticky: bool = False) -> None:
        self.options = tuple(dict.fromkeys(options))
        if not self.options:
            raise ValueError("options must hold at least one choice")
        if explore_every < 1 or warmup < 0 or not 0.0 < alpha <= 1.0 or not 0.0 <= margin < 1.0:
            raise ValueError(f"need explore_every >= 1, warmup >= 0, alpha in (0, 1] and "
                             f"margin in [0, 1), got {explore_every}, {warmup}, {alpha}, "
                             f"{margin}")
        self.explore_every = explore_every
        self.alpha = alpha
        self.margin = margin
        self.retry_above = retry_above
        self.sticky = sticky
        self.max_explore_every = max(explore_every, max_explore_every or explore_every)
        self._interval = explore_every
        self._next_explore = explore_every
        self._best: Hashable | None = None
        #: The least EMA cost the first option has had.
        self._floor: float | None = None
        #: Cost per unit of work by option (EMA), for the options measured so far.
        self.cost: dict[Hashable, float] = {}
        #: Picks so far, and how many of them explored an option other than the best.
        self.picks = 0
        self.explorations = 0
        self._unbooked = dict.fromkeys(self.options, warmup)

    @property
    def best(self) -> Hashable | None:
        """The option the last `pick` held best once every option was measured (None
        before)."""
        return self._best

    def pick(self) -> Hashable:
        """The option for the next run: an unmeasured option first (until its warm-up runs
        are done and one is booked), else the cheapest (with the margin's hysteresis), else
        (when an exploration is due) the next other option in turn."""
        self.picks += 1
        for option in self.options:
            if option not in self.cost:
                return option
        first = self.options[0]
        preferred = self._best if self.sticky and self._best is not None else first
        best = min(self.options, key=lambda o: self.cost[o] / (
            1.0 if o == preferred else 1.0 - self.margin))
        if best != self._best:  # a new best: explore at the base rate again
            self._best, self._interval = best, self.explore_every
            self._next_explore = self.picks + self.explore_every
        settled = (self.retry_above is not None and not self.sticky and best == first
                   and self.cost[first] <= self._floor * (1.0 + self.retry_above))
        if len(self.options) > 1 and not settled and self.picks >= self._next_explore:
            others = [o for o in self.options if o != best]
            self._next_explore = self.picks + self._interval
            self._interval = min(2 * self._interval, self.max_explore_every)
            self.explorations += 1
            # Each other option in turn (with three or more, every one is re-measured).
            return others[(self.explorations - 1) % len(others)]
        return best

    def record(self, option: Hashable, seconds: float, tokens: float) -> None:
        """Books a run of ``option`` that did ``tokens`` units of work (counted as at least
        1) in ``seconds``."""
        if self._unbooked.get(option, 0) > 0:
            self._unbooked[option] -= 1
            return
        rate = seconds / max(tokens, 1)
        old = self.cost.get(option)
        self.cost[option] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
        if option == self.options[0]:
            self._floor = min(self.cost[option], self._floor or math.inf)
