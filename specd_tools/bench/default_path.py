"""``specd bench --default-path``: the default user path against transformers, in one run.

The forward timing and the thread check first (this process, before any service runs); then
the embedded service ``specd generate`` starts, with every prompt sent as ``specd generate``
sends it (`specd_tools.generate`), beside transformers' ``generate`` plain and with prompt
lookup. See `run_default_path_bench`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from drafter_worker.registry import LOOKUP_DRAFT_LEN

from ..workloads import Prompt, Workload, load_workloads

__all__ = ["SPECD_GENERATE", "SPECD_GENERATE_PLAIN", "DefaultPathConfig", "generate_args",
           "run_default_path_bench"]

SPECD_GENERATE = "specd-generate"
SPECD_GENERATE_PLAIN = "specd-generate-drafter-none"


@dataclass(frozen=True)
class DefaultPathConfig:
    """What ``specd bench --default-path`` runs.

    Attributes:
        model: as for ``specd generate --model`` (None: the default SmolLM2).
        workloads: names (default code_edit and open_question, the issue's two cases).
        max_new_tokens: the same token budget for every system, >= 1.
        repeats: timed passes over every prompt, >= 1.
        prompt_lookup: transformers' ``prompt_lookup_num_tokens`` for hf-prompt-lookup.
        target_threads: ``specd generate --target-threads`` (None: its default).
        forward_ks, forward_cache_lens, forward_repeats: the forward timing run first
            (`specd_tools.bench.forward.forward_timing`; empty ``forward_ks``: none).
        thread_check: time specd's forward at 1 and 2 threads, quiet and beside a busy
            process (`specd_tools.bench.forward.thread_timing`).

    Raises:
        ValueError: a bad size.
    """

    model: str | None = None
    workloads: tuple[str, ...] | None = ("code_edit", "open_question")
    max_new_tokens: int = 160
    repeats: int = 3
    prompt_lookup: int = LOOKUP_DRAFT_LEN
    target_threads: int | None = None
    forward_ks: tuple[int, ...] = (1, 2, 4, 8, 32)
    forward_cache_lens: tuple[int, ...] = (300, 2000)
    forward_repeats: int = 15
    thread_check: bool = True

    def __post_init__(self) -> None:
        from .forward import check_forward_sizes

        check_forward_sizes(self.forward_ks, self.forward_cache_lens)
        for name in ("max_new_tokens", "repeats", "prompt_lookup", "forward_repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an int >= 1, got {value!r}")
        if self.target_threads is not None and (
                isinstance(self.target_threads, bool) or self.target_threads < 1):
            raise ValueError(f"target-threads must be >= 1, got {self.target_threads!r}")


def generate_args(config: DefaultPathConfig, drafter: str | None = None):
    """The `specd_tools.generate.GenerateOptions` of ``specd generate`` as a user gives them:
    only the token budget (and ``--model``, ``--target-threads``, ``--drafter`` when set);
    every other field its default."""
    from ..generate import GenerateOptions

    given = {"max_new_tokens": config.max_new_tokens}
    if config.model is not None:
        given["model"] = config.model
    if config.target_threads is not None:
        given["target_threads"] = config.target_threads
    if drafter is not None:
        given["drafter"] = drafter
    return GenerateOptions("PROMPT", **given)


def _user_request(options, prompt: Prompt):
    """The request ``specd generate`` sends for ``options`` with ``prompt``'s chat turns (one
    user turn for the shipped code_edit and open_question prompts: exactly what
    ``specd generate "TEXT"`` sends)."""
    from ..generate import generate_request

    request = generate_request(options, options.sampling())
    del request.chat.messages[:]
    for m in prompt.messages:
        request.chat.messages.add(role=m["role"], content=m["content"])
    return request


class UserPathSystem:
    """One ``specd generate`` request through the embedded service, timed as the CLI times
    it: from sending the request to the final chunk (prefill included)."""

    kind = "service"

    def __init__(self, name: str, address: str, options):
        self.name = name
        self.address = address
        self.options = options

    def generate(self, prompt: Prompt, max_new_tokens: int):
        from ..client import stream_generate
        from .systems import RunRecord

        request = _user_request(self.options, prompt)
        request.max_new_tokens = max_new_tokens
        tokens: list[int] = []
        first = None
        final = None
        start = time.perf_counter()
        for chunk in stream_generate(self.address, request):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - start
            tokens.extend(chunk.token_ids)
            if chunk.finish_reason:
                final = chunk
        seconds = time.perf_counter() - start
        if final is None:
            raise RuntimeError(f"{self.name}: the stream ended without a final chunk")
        spec = final.speculation
        return RunRecord(
            system=self.name, workload="", prompt_id="", repeat=-1,
            prompt_tokens=final.usage.prompt_tokens, tokens=tokens, seconds=seconds,
            first_token_seconds=first if first is not None else seconds,
            forward_calls=spec.forward_calls, verification_steps=spec.verification_steps,
            drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
            evaluated_at_position=list(spec.evaluated_at_position),
            accepted_at_position=list(spec.accepted_at_position))


class _HFPromptSystem:
    """A `specd_tools.bench.systems.HFSystem` fed the prompt's token ids through the chat
    template."""

    kind = "hf"

    def __init__(self, system, tokenizer):
        self.system = system
        self.name = system.name
        self.tokenizer = tokenizer

    def generate(self, prompt: Prompt, max_new_tokens: int):
        from ..workloads import encode_workload_prompt

        return self.system.generate(encode_workload_prompt(self.tokenizer, prompt), max_new_tokens)


def _start_embedded(service_config):
    from coordinator.cluster.service import Service

    service = Service(service_config)
    return service.start(), service.stop


def run_default_path_bench(config: DefaultPathConfig, progress=print,
                           workloads: list[Workload] | None = None,
                           start_service=None) -> dict:
    """The default user path against transformers, in one run.

    First the forward timing (specd's forward against transformers' per k, this process,
    before any service runs) and the thread check. Then the embedded service that
    ``specd generate`` starts (`specd_tools.generate.embedded_service_config` of the parsed
    default arguments: prompt lookup, adaptive draft length, the default target threads) is
    started ONCE, and every
    prompt is sent to it as ``specd generate`` sends it, timed end to end from the request
    to the final chunk (prefill, gRPC and Ray included; the one-off service start and
    model load excluded, as the CLI's ``tok/s`` excludes them). A subprocess per request
    would time Ray's start and the model load (~10 s) instead of generation. Systems,
    interleaved per prompt and repeat in rotated order:

    - ``specd-generate``: the default request (speculation on);
    - ``specd-generate-drafter-none``: the request ``specd generate --drafter none`` sends
      (speculation off), to the same service;
    - ``hf-plain`` and ``hf-prompt-lookup-k<N>``: transformers ``generate`` in this process,
      greedy, same token budget and EOS, torch's default threads.

    Args:
        workloads: instead of ``config.workloads`` (short prompts for a tiny model).
        start_service: ``f(ServiceConfig) -> (address, stop)`` (tests: an in-process
            service); default starts `coordinator.cluster.service.Service`.

    Returns:
        The JSON-ready report: ``mode`` ("default-path"), ``config``, ``environment``,
        ``service`` (its configuration), ``forward``, ``threads`` (`thread_timing`),
        ``systems``, ``summary``
        (`specd_tools.bench.core.aggregate` with ``ratio_to_plain`` against hf-plain),
        ``identity`` (against hf-plain's first run of each prompt), ``prompt_tokens``
        (whether the service saw the same prompt length as transformers), ``runs``.

    Raises:
        ValueError: a bad configuration, or a model transformers cannot load.
    """
    from dataclasses import asdict as as_dict

    from coordinator.cluster.config import target_thread_counts
    from target_worker.loader import load_model

    from ..generate import embedded_service_config
    from ..workloads import encode_workload_prompt
    from .core import aggregate, check_identity, environment
    from .forward import reported_forward_timing, thread_timing
    from .hf import load_hf_model
    from .systems import HF_PLAIN, HFSystem

    if workloads is None:
        workloads = load_workloads(list(config.workloads) if config.workloads else None)
    progress(f"loading {config.model or 'the default model (SmolLM2-135M-Instruct)'} "
             "and its transformers twin")
    decoder, tokenizer = load_model(config.model)
    hf_model = load_hf_model(config.model, decoder)
    if hf_model is None:
        raise ValueError(f"transformers cannot load {config.model!r}: --default-path compares "
                         "against it")
    eos = tokenizer.eos_token_id
    forward = None
    if config.forward_ks:
        forward = reported_forward_timing(decoder, hf_model, config, progress)
    threads_rows = None
    if config.thread_check:
        progress("timing specd's forward at 1 and 2 threads, quiet and beside a busy process")
        threads_rows = thread_timing(decoder, on_row=lambda row: progress(
            f"busy={row['busy']} k={row['k']} threads={row['threads']}: "
            f"{row['median_ms']:.1f} ms (max {row['max_ms']:.0f})"))
    del decoder  # the service loads its own

    options = generate_args(config)
    service_config = embedded_service_config(options)
    threads = service_config.target_threads or target_thread_counts(
        service_config.target_replicas, service_config.tp)[0]
    progress(f"starting the embedded service `specd generate` starts (target threads "
             f"{threads})")
    address, stop = (start_service or _start_embedded)(service_config)
    runs = []
    try:
        systems = [
            UserPathSystem(SPECD_GENERATE, address, options),
            UserPathSystem(SPECD_GENERATE_PLAIN, address, generate_args(config, "none")),
            _HFPromptSystem(HFSystem(HF_PLAIN, hf_model, eos), tokenizer),
            _HFPromptSystem(HFSystem(f"hf-prompt-lookup-k{config.prompt_lookup}", hf_model,
                                     eos, prompt_lookup=config.prompt_lookup), tokenizer),
        ]
        first = workloads[0].prompts[0]
        for system in systems:  # warm-up, untimed
            system.generate(first, min(4, config.max_new_tokens))
        prompts = [(w, p) for w in workloads for p in w.prompts]
        total = config.repeats * len(prompts) * len(systems)
        start = time.perf_counter()
        for repeat in range(config.repeats):
            for index, (w, p) in enumerate(prompts):
                shift = (repeat + index) % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    record = system.generate(p, config.max_new_tokens)
                    record.workload, record.prompt_id, record.repeat = w.name, p.id, repeat
                    runs.append(record)
                    progress(f"[{len(runs)}/{total} {time.perf_counter() - start:.0f}s] "
                             f"{w.name}/{p.id} r{repeat} {system.name}: "
                             f"{len(record.tokens)} tokens, "
                             f"{len(record.tokens) / record.seconds:.1f} tok/s, "
                             f"{record.forward_calls} forwards")
    finally:
        stop()
    names = [s.name for s in systems]
    lengths = {(w.name, p.id): len(encode_workload_prompt(tokenizer, p))
               for w in workloads for p in w.prompts}
    differ = sorted({f"{r.workload}/{r.prompt_id}" for r in runs
                     if r.prompt_tokens != lengths[(r.workload, r.prompt_id)]})
    return {
        "mode": "default-path",
        "config": as_dict(config),
        "environment": {**environment(), "target_threads": threads},
        "service": as_dict(service_config),
        "forward": forward,
        "threads": threads_rows,
        "workloads": [{"workload": w, "prompt_id": pid, "prompt_tokens": n}
                      for (w, pid), n in lengths.items()],
        "systems": [{"name": s.name, "kind": s.kind} for s in systems],
        "summary": aggregate(runs, names, [w.name for w in workloads], baseline=HF_PLAIN),
        "identity": check_identity(runs, reference_system=HF_PLAIN),
        "prompt_tokens": {"identical": not differ, "differ": differ},
        "runs": [as_dict(r) for r in runs],
    }
