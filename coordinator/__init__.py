"""The coordinator: sampling transforms, the lossless accept/reject rule, per-request decode
state and the speculative decoding loop (pure core; the Ray/gRPC service wraps it)."""

from .rule import GreedyRows, ProbRows, TargetRows, accept_or_resample, target_rows
from .sampling import Sampler, SamplingParams, sampling_distribution, sampling_distributions
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
