"""Refused constraints count against the client that sent them (`RefusalBudget`): compiling
a constraint, and the admission probe that refuses one generation cannot meet, take real
CPU (tens of milliseconds for a heavy regex), so a client sending one bad constraint after
another could keep a core busy and slow every other tenant's streams. Each tenant has a
token bucket of refusals (16, refilled at one a second: a heavy constraint's ~50 ms of
compiling then holds at most ~5% of a core per tenant); a refusal answered from the compile
cache costs nothing. Once it is empty, that tenant's constrained requests are answered
`coordinator.step.errors.RateLimited` (HTTP 429, gRPC ``RESOURCE_EXHAUSTED``) without compiling,
until it refills. Requests without a constraint, and other tenants, are never affected.
"""

from __future__ import annotations

import threading
import time

from ..step.errors import RateLimited

__all__ = ["RefusalBudget"]


class RefusalBudget:
    """A token bucket of refused constraints per tenant.

    Args:
        burst: refusals a tenant may have in a row (the bucket's size).
        per_second: the rate the bucket refills at, refusals per second.
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: ``burst`` < 1 or ``per_second`` <= 0.
    """

    def __init__(self, burst: int = 16, per_second: float = 1.0, clock=time.monotonic):
        if burst < 1 or not per_second > 0:
            raise ValueError(f"burst must be >= 1 and per_second > 0, got {burst}, "
                             f"{per_second}")
        self.burst, self.per_second, self.clock = burst, per_second, clock
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)
        self._lock = threading.Lock()

    def _level(self, tenant: str, now: float) -> float:
        tokens, at = self._buckets.get(tenant, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.per_second)

    def check(self, tenant: str, field: str) -> None:
        """Raises `RateLimited` (naming ``field``) when ``tenant`` has no refusal left."""
        with self._lock:
            now = self.clock()
            level = self._level(tenant, now)
            if level < 1.0:
                wait = (1.0 - level) / self.per_second
                raise RateLimited(f"{field}: too many refused constraints from this client; "
                                  f"retry in {wait:.1f} s", retry_after_s=wait)

    def charge(self, tenant: str) -> None:
        """Counts one refused constraint against ``tenant``."""
        with self._lock:
            now = self.clock()
            self._buckets[tenant] = (max(0.0, self._level(tenant, now) - 1.0), now)
            if len(self._buckets) > 4096:  # forget full buckets (tenants long quiet)
                for name in [t for t in self._buckets if self._level(t, now) >= self.burst]:
                    del self._buckets[name]
