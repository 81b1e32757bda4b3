"""A ``specd generate`` request: what it asks (the prompt, its decoding, its speculation, the
model), how it is checked, and what it becomes (`SamplingParams`, the gRPC
``GenerateRequest``, the embedded service's `ServiceConfig`).

The CLI builds `GenerateOptions` from its flags (`GenerateOptions.from_args`); `specd bench
--default-path` builds them directly, with every field the user leaves out at its default, so
the bench sends exactly what ``specd generate`` sends. The flags' defaults are these fields'.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from coordinator.step_plan import DEFAULT_MAX_BATCHED_TOKENS
from drafter_worker.registry import DEFAULT_DRAFTER, DEFAULT_NGRAM_SIZE
from specd_core.sampling import SamplingParams

__all__ = [
    "GenerateOptions",
    "embedded_service_config",
    "generate_request",
    "in_process_fallback_threads",
    "in_process_threads",
    "prefill_config",
]


@dataclass(frozen=True)
class GenerateOptions:
    """One ``specd generate`` request. Field names are the flags' destinations (``--no-adaptive``
    is ``no_adaptive``), so `embedded_service_config` and `prefill_config` take either these
    options or parsed flags (``specd serve``'s, for `prefill_config`).

    Nothing is checked on construction: `sampling` checks the decoding fields,
    `drafter_worker.registry.check_drafter` the drafter's, `prefill_config` the prefill ones,
    each where the CLI checked them, so the first error a user sees is unchanged.

    Attributes:
        prompt: the user's text (a single user turn through the chat template unless ``raw``).
        max_draft_len: None until the CLI resolves it
            (`drafter_worker.registry.default_draft_len`); left None (``specd bench
            --default-path``), `drafter_worker.registry.build_drafter` uses its default.
        target_threads: torch threads of the target (None: `in_process_threads` in process,
            the service's default otherwise).
    """

    prompt: str
    raw: bool = False
    max_new_tokens: int = 128
    # The sampling fields' defaults are `SamplingParams`' own (one source for both).
    temperature: float = SamplingParams.temperature
    top_k: int = SamplingParams.top_k
    top_p: float = SamplingParams.top_p
    min_p: float = SamplingParams.min_p
    repetition_penalty: float = SamplingParams.repetition_penalty
    presence_penalty: float = SamplingParams.presence_penalty
    frequency_penalty: float = SamplingParams.frequency_penalty
    seed: int | None = None
    stop: tuple[str, ...] = ()
    model: str | None = None
    dtype: str = "auto"
    drafter: str = DEFAULT_DRAFTER
    ngram_size: int = DEFAULT_NGRAM_SIZE
    max_draft_len: int | None = None
    no_adaptive: bool = False
    no_pipeline: bool = False
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    max_partial_prefills: int = 1
    no_prefix_caching: bool = False
    drafter_path: str | None = None
    suffix_cache_requests: int | None = None
    target_threads: int | None = None

    @classmethod
    def from_args(cls, args) -> GenerateOptions:
        """The options of parsed ``specd generate`` flags (an ``argparse.Namespace``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        values["stop"] = tuple(values["stop"])
        return cls(**values)

    def sampling(self) -> SamplingParams:
        """The validated decoding fields.

        Raises:
            ValueError: naming the bad flag (seed, max-new-tokens, prompt, or a sampling field).
        """
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"--seed must be in [0, 2**64), got {self.seed}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompt.strip():
            raise ValueError("the prompt must not be empty")
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


def generate_request(options: GenerateOptions, sampling: SamplingParams):
    """The gRPC ``specd.v1.GenerateRequest`` of ``options`` with ``sampling`` (their
    validated `GenerateOptions.sampling`): one user turn, or the raw text with ``raw``."""
    from specd.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        sampling=generation_pb2.SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=sampling.min_p, repetition_penalty=sampling.repetition_penalty,
            presence_penalty=sampling.presence_penalty,
            frequency_penalty=sampling.frequency_penalty),
        max_new_tokens=options.max_new_tokens,
        stop=options.stop,
        speculation=generation_pb2.SpeculationOptions(
            enabled=options.drafter != "none", max_draft_len=options.max_draft_len),
    )
    if options.seed is not None:
        request.seed = options.seed
    if options.raw:
        request.text = options.prompt
    else:
        request.chat.messages.add(role="user", content=options.prompt)
    return request


def embedded_service_config(options):
    """The `ServiceConfig` of the service ``specd generate`` embeds (no ``--server``): one
    replica and one drafter on this machine, API on a free loopback port. ``options``: the
    `GenerateOptions`, or the parsed ``specd generate`` flags.

    Raises:
        ValueError: as `prefill_config`.
    """
    from coordinator.config import ServiceConfig

    return ServiceConfig(
        model=options.model, dtype=options.dtype, port=0, drafter=options.drafter,
        ngram_size=options.ngram_size,
        max_draft_len=options.max_draft_len, adaptive=not options.no_adaptive,
        drafter_path=options.drafter_path, target_threads=options.target_threads,
        pipeline=not options.no_pipeline,
        suffix_cache_requests=getattr(options, "suffix_cache_requests", None),
        **prefill_config(options))


def prefill_config(options) -> dict:
    """`ServiceConfig` fields of the chunked-prefill and prefix-caching flags of ``specd
    generate`` or ``specd serve`` (their defaults where ``options`` has none of them, e.g.
    `specd bench`'s).

    Raises:
        ValueError: a negative ``--max-batched-tokens`` or ``--max-partial-prefills`` < 1.
    """
    budget = getattr(options, "max_batched_tokens", DEFAULT_MAX_BATCHED_TOKENS)
    partial = getattr(options, "max_partial_prefills", 1)
    if budget < 0:
        raise ValueError(f"--max-batched-tokens must be >= 0, got {budget}")
    if partial < 1:
        raise ValueError(f"--max-partial-prefills must be >= 1, got {partial}")
    return {"max_batched_tokens": budget or None, "max_partial_prefills": partial,
            "prefix_caching": not getattr(options, "no_prefix_caching", False)}


def in_process_threads() -> int:
    """``generate --in-process``'s torch threads when --threads is not given: every usable
    core, as for the service's target (`coordinator.config.target_thread_counts`)."""
    from coordinator.config import target_thread_counts

    return target_thread_counts(1)[0]


def in_process_fallback_threads() -> int | None:
    """``generate --in-process``'s fewer torch threads a forward falls back to where they
    measure cheaper (`target_worker.engine.ThreadChooser`), when --threads is not given: the
    cores less one (`coordinator.config.target_thread_counts`); None on one core. Measured
    here (2 cores, SmolLM2): a 512-token prefill 415 tok/s on 1 thread, 920 on 2 on a quiet
    machine, but 2 threads 2x slower than 1 beside one busy process."""
    from coordinator.config import target_thread_counts

    return target_thread_counts(1)[1]
