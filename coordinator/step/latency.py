"""Request latency histograms: time to first token, inter-token latency, prefill time.

Named and bucketed as vLLM exports them (``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:request_prefill_time_seconds``), so dashboards
built for vLLM read specd's (`coordinator.cluster.metrics`, prefix ``specd_``, one series per
replica). Pure Python: each scheduler keeps its own.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Histogram", "LatencyHistograms"]

#: Upper bounds in seconds (vLLM's, v0.11).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


#: Latest observations each histogram keeps for exact quantiles (`Histogram.quantile`).
RECENT = 1024


@dataclass
class Histogram:
    """Observations in seconds counted per bucket (``counts[i]``: values <= ``bounds[i]``
    and above the bound before; the last count is above every bound), with their sum, and
    the latest `RECENT` of them."""

    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds
        self.recent.append(seconds)

    def quantile(self, q: float) -> float:
        """Quantile ``q`` in (0, 1) of the latest `RECENT` observations, seconds (0.0 when
        there are none; linear interpolation between order statistics)."""
        if not self.recent:
            return 0.0
        if len(self.recent) == 1:
            return self.recent[0]
        return statistics.quantiles(self.recent, n=100, method="inclusive")[round(q * 100) - 1]

    def snapshot(self) -> dict:
        """``{"bounds": [...], "counts": [...], "sum": float}`` (plain, for the Prometheus
        export; quantiles come from `quantile`)."""
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


class LatencyHistograms:
    """One scheduler's ``ttft`` (submission to first token streamed), ``itl`` (gap between
    two streamed chunks of one request: a speculative step streams several tokens at once)
    and ``prefill`` (first prompt chunk sent to first token sampled) histograms."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.prefill = Histogram(REQUEST_BUCKETS)

    def snapshot(self) -> dict[str, dict]:
        return {"ttft": self.ttft.snapshot(), "itl": self.itl.snapshot(),
                "prefill": self.prefill.snapshot()}

