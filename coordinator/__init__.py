"""The service layer: the scheduler, router, drafter pool, supervision, the Ray service and the
gRPC front end. Re-exports the seed's core API (the rule, sampling, the decode loop) from
`specd_core` and `coordinator.speculative` so ``from coordinator import ...`` keeps working."""

from specd_core.rule import GreedyRows, ProbRows, TargetRows, accept_or_resample, target_rows
from specd_core.sampling import (
    Sampler,
    SamplingParams,
    sampling_distribution,
    sampling_distributions,
)

from .speculative import (
    DecodeRequest,
    SpeculativeDecodeResult,
    SpeculativeOptions,
    speculative_decode,
    speculative_decode_with,
)

__all__ = [
    "DecodeRequest",
    "GreedyRows",
    "ProbRows",
    "Sampler",
    "SamplingParams",
    "SpeculativeDecodeResult",
    "SpeculativeOptions",
    "TargetRows",
    "accept_or_resample",
    "sampling_distribution",
    "sampling_distributions",
    "speculative_decode",
    "speculative_decode_with",
    "target_rows",
]
