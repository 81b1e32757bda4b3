"""A ``specd generate`` request: what it asks (the prompt, its decoding, its speculation, the
model), how it is checked, and what it becomes (`SamplingParams`, the gRPC
``GenerateRequest``, the embedded service's `ServiceConfig`).

The CLI builds `GenerateOptions` from its flags (`GenerateOptions.from_args`); `specd bench
--default-path` builds them directly, with every field the user leaves out at its default, so
the bench sends exactly what ``specd generate`` sends. The flags' defaults are these fields'.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from coordinator.step.plan import DEFAULT_MAX_BATCHED_TOKENS
from drafter_worker.registry import DEFAULT_DRAFTER, DEFAULT_NGRAM_SIZE
from specd_core.sampling import SamplingParams

__all__ = [
    "SERVICE_FLAGS",
    "GenerateOptions",
    "constraint_spec",
    "embedded_service_config",
    "generate_request",
    "in_process_fallback_threads",
    "in_process_threads",
    "PIPELINE_CHOICES",
    "pipeline_setting",
    "prefill_config",
    "server_flags_refused",
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
        json_schema: the path of a JSON Schema file the output must match, or None.
        regex: a regex the whole output must match, or None (at most one of the two).
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
    pipeline: str = "auto"
    no_pipeline: bool = False
    max_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    max_partial_prefills: int = 1
    no_prefix_caching: bool = False
    drafter_path: str | None = None
    suffix_cache_requests: int | None = None
    target_threads: int | None = None
    json_schema: str | None = None
    regex: str | None = None

    @classmethod
    def from_args(cls, args) -> GenerateOptions:
        """The options of parsed ``specd generate`` flags (an ``argparse.Namespace``)."""
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        values["stop"] = tuple(values["stop"])
        return cls(**values)

    def sampling(self) -> SamplingParams:
        """The validated decoding fields.

        ``top_k`` -1 is 0 (off), as the HTTP and gRPC APIs take it.

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
            # -1 is vLLM's "off", as over HTTP and gRPC (`coordinator.front.generation_request`).
            temperature=self.temperature, top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
        )


def constraint_spec(options: GenerateOptions):
    """The structured-output constraint of ``--json-schema FILE`` / ``--regex`` (a
    `specd_core.grammar.GrammarSpec`), or None.

    Raises:
        ValueError: naming the flag: both given, a file that cannot be read or is not JSON.
    """
    import json

    from specd_core.grammar import GrammarError, GrammarSpec

    if options.json_schema is not None and options.regex is not None:
        raise ValueError("--json-schema and --regex: give at most one")
    try:
        if options.regex is not None:
            return GrammarSpec("regex", options.regex, field="--regex")
        if options.json_schema is None:
            return None
        try:
            with open(options.json_schema, encoding="utf-8") as f:
                schema = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--json-schema: cannot read {options.json_schema!r} as a JSON "
                             f"schema ({exc})") from None
        return GrammarSpec("json_schema", schema, field="--json-schema")
    except GrammarError as exc:
        raise ValueError(str(exc)) from None


#: ``specd generate`` flags (their destinations) that configure the service a request runs
#: on, not the request: refused with ``--server`` (`server_flags_refused`), whose service
#: has its own.
SERVICE_FLAGS = ("model", "dtype", "pipeline", "no_pipeline", "no_adaptive", "ngram_size",
                 "max_batched_tokens", "max_partial_prefills", "no_prefix_caching",
                 "drafter_path", "suffix_cache_requests", "target_threads")


def server_flags_refused(given: set[str], flag_of) -> None:
    """Raises for ``specd generate --server`` given service flags (`SERVICE_FLAGS`):
    ``given`` holds the destinations the user set, ``flag_of`` names each one's flag.

    Raises:
        ValueError: naming the flags, e.g. ``--model, --no-pipeline configure a service,
            not a request: ...``.
    """
    flags = [flag_of(dest) for dest in SERVICE_FLAGS if dest in given]
    if flags:
        raise ValueError(f"{', '.join(flags)} configure{'s' if len(flags) == 1 else ''} a "
                         "service, not a request: the one at --server has its own (set "
                         f"{'it' if len(flags) == 1 else 'them'} on its 'specd serve'); drop "
                         f"{'it' if len(flags) == 1 else 'them'}, or leave out --server to run an "
                         "embedded service (or --in-process) with "
                         f"{'it' if len(flags) == 1 else 'them'}")


def generate_request(options: GenerateOptions, sampling: SamplingParams,
                     drafter: str = ""):
    """The gRPC ``specd.v1.GenerateRequest`` of ``options`` with ``sampling`` (their
    validated `GenerateOptions.sampling`): one user turn, or the raw text with ``raw``.
    ``drafter``: the ``speculation.drafter`` to ask for (``""``: the service's; the server
    refuses one it does not run); ``options.drafter`` "none" turns speculation off.
    ``options.max_draft_len`` None leaves the cap unset (the drafter's own)."""
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
            enabled=options.drafter != "none", max_draft_len=options.max_draft_len,
            drafter=drafter),
    )
    if options.seed is not None:
        request.seed = options.seed
    spec = constraint_spec(options)
    if spec is not None and spec.kind == "regex":
        request.constraint.regex = spec.value
    elif spec is not None:
        import json

        request.constraint.json_schema = json.dumps(spec.value)
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
    from coordinator.cluster.config import ServiceConfig

    return ServiceConfig(
        model=options.model, dtype=options.dtype, port=0, drafter=options.drafter,
        ngram_size=options.ngram_size,
        max_draft_len=options.max_draft_len, adaptive=not options.no_adaptive,
        drafter_path=options.drafter_path, target_threads=options.target_threads,
        pipeline=pipeline_setting(options),
        suffix_cache_requests=getattr(options, "suffix_cache_requests", None),
        **prefill_config(options))


#: ``--pipeline``'s values: the `ServiceConfig` ``pipeline`` each stands for.
_PIPELINE = {"auto": "auto", "on": True, "off": False}
PIPELINE_CHOICES = tuple(_PIPELINE)


def pipeline_setting(options) -> bool | str:
    """The `ServiceConfig` ``pipeline`` of ``--pipeline {auto,on,off}`` and its alias
    ``--no-pipeline`` (off) in ``options`` (`GenerateOptions` or parsed flags): ``"auto"``,
    True or False.

    Raises:
        ValueError: a ``pipeline`` other than auto, on or off, naming ``--pipeline``.
    """
    if getattr(options, "no_pipeline", False):
        return False
    value = getattr(options, "pipeline", "auto")
    if value not in _PIPELINE:
        raise ValueError(f"--pipeline must be auto, on or off, got {value!r}")
    return _PIPELINE[value]


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
    core, as for the service's target (`coordinator.cluster.config.target_thread_counts`)."""
    from coordinator.cluster.config import target_thread_counts

    return target_thread_counts(1)[0]


def in_process_fallback_threads() -> int | None:
    """``generate --in-process``'s fewer torch threads a forward falls back to where they
    measure cheaper (`target_worker.engine.ThreadChooser`), when --threads is not given: the
    cores less one (`coordinator.cluster.config.target_thread_counts`); None on one core. Measured
    here (2 cores, SmolLM2): a 512-token prefill 415 tok/s on 1 thread, 920 on 2 on a quiet
    machine, but 2 threads 2x slower than 1 beside one busy process."""
    from coordinator.cluster.config import target_thread_counts

    return target_thread_counts(1)[1]
