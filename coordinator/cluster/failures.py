"""How a target replica's failure is recognised: its death (`is_replica_death`, told in one
line by `death_summary`) and its stall (`StallWatchdog`: a call past a deadline scaled by the
replica's measured step cost). What follows a failure is `coordinator.cluster.supervisor`'s."""

from __future__ import annotations

import sys

from target_worker.channel import ChannelClosed

from ..step.errors import ReplicaFailed


def is_replica_death(exc: BaseException | None) -> bool:
    """Whether ``exc`` says a replica's process is gone: `ReplicaFailed`, a Ray actor error
    (``ray.exceptions.RayActorError``: ActorDiedError, ActorUnavailableError), also as the
    cause of a task error (a tensor-parallel rank that died under rank 0), or its step
    channel closing (`target_worker.channel.ChannelClosed`)."""
    ray_errors = sys.modules.get("ray.exceptions")  # a Ray error implies Ray is imported
    for _ in range(8):  # a short cause chain; never loops on a cycle
        if exc is None:
            return False
        if isinstance(exc, ReplicaFailed | ChannelClosed):
            return True
        if ray_errors is not None and isinstance(exc, ray_errors.RayActorError):
            return True
        exc = getattr(exc, "cause", None) or exc.__cause__
    return False


def death_summary(exc: BaseException) -> str:
    """A short, readable why for a replica death ``exc`` (`is_replica_death`), for its
    one-line log: ``"its Ray actor died (ActorDiedError)"``, a closed channel's or a
    `ReplicaFailed` 's own text; never Ray's raw multi-line report (pid, actor id, node
    address, worker id), which callers log at DEBUG."""
    ray_errors = sys.modules.get("ray.exceptions")
    seen = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, ReplicaFailed | ChannelClosed):
            return str(seen).splitlines()[0][:200] if str(seen) else type(seen).__name__
        if ray_errors is not None and isinstance(seen, ray_errors.RayActorError):
            return f"its Ray actor died ({type(seen).__name__})"
        seen = getattr(seen, "cause", None) or seen.__cause__
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


#: A target call may take this many times its predicted cost before the replica is taken for
#: stalled (`StallWatchdog`), but never less than `STALL_FLOOR_S` seconds.
STALL_FACTOR = 10.0
STALL_FLOOR_S = 10.0


class StallWatchdog:
    """The deadline of one target call, scaled by what this replica's calls have cost, so a
    frozen replica (SIGSTOP, a wedged device, a hung collective) is found within ~``factor``
    steps rather than after one fixed timeout sized for the worst prefill.

    A call feeding ``tokens`` is predicted to take ``max(step, per_token * tokens)``, where
    ``step`` is the moving average of a call's wall time and ``per_token`` the average
    seconds per token fed (ratio of the averages: small calls' fixed cost makes it an
    overestimate for big ones, which errs towards waiting). Its deadline is ``factor`` times
    that, at least ``floor_s`` and at most ``cap_s``; ``cap_s`` alone until a call was
    measured (the first prefill may be a long prompt).

    Args:
        cap_s: the most one call may take, seconds (``target_timeout_s``).
        factor: how many times its predicted cost a call may take (> 1).
        floor_s: the least deadline, seconds: covers a GC pause, a loaded machine, a
            transport hiccup, and the calls too small to measure (allocate, free).
        alpha: weight of the newest call in the moving averages.

    Raises:
        ValueError: ``cap_s`` or ``floor_s`` not > 0, or ``factor`` not > 1.
    """

    def __init__(self, cap_s: float, factor: float = STALL_FACTOR,
                 floor_s: float = STALL_FLOOR_S, alpha: float = 0.2):
        if not cap_s > 0 or not floor_s > 0 or not factor > 1:
            raise ValueError(f"StallWatchdog needs cap_s > 0, floor_s > 0 and factor > 1, "
                             f"got {cap_s!r}, {floor_s!r}, {factor!r}")
        self.cap_s, self.factor, self.floor_s, self.alpha = cap_s, factor, floor_s, alpha
        self._seconds: float | None = None  # moving average of a call's seconds
        self._tokens = 0.0  # moving average of a call's tokens fed

    def observe(self, tokens: int, seconds: float) -> None:
        """Records a prefill or verify call that fed ``tokens`` and took ``seconds``."""
        if self._seconds is None:
            self._seconds, self._tokens = seconds, float(tokens)
            return
        a = self.alpha
        self._seconds += a * (seconds - self._seconds)
        self._tokens += a * (tokens - self._tokens)

    def predicted_s(self, tokens: int) -> float | None:
        """Expected seconds of a call feeding ``tokens``; None before any measurement."""
        if self._seconds is None:
            return None
        per_token = self._seconds / self._tokens if self._tokens > 0 else 0.0
        return max(self._seconds, per_token * tokens)

    def deadline_s(self, tokens: int = 0) -> float:
        """Seconds a call feeding ``tokens`` may take before the replica counts as stalled."""
        predicted = self.predicted_s(tokens)
        if predicted is None:
            return self.cap_s
        return min(self.cap_s, max(self.floor_s, self.factor * predicted))
