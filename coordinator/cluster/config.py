"""What ``specd serve`` configures (`ServiceConfig`, one validated dataclass) and the defaults
derived from the machine (`default_target_threads`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from drafter_worker.registry import (
    DEFAULT_DRAFTER,
    DEFAULT_NGRAM_SIZE,
    check_drafter,
    default_draft_len,
)

from ..step.plan import DEFAULT_MAX_BATCHED_TOKENS, ChunkPolicy
from ..step.schedule import check_pipeline

#: Upper bound on a replica or drafter count (at start or in one `Router.scale` call): a typo
#: guard, not a design limit.
MAX_COUNT = 64


def check_count(name: str, value, minimum: int) -> None:
    """Raises ValueError naming ``name`` unless ``value`` is None or an int in
    [minimum, `MAX_COUNT`]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= MAX_COUNT:
        raise ValueError(f"{name}: must be an integer in [{minimum}, {MAX_COUNT}], got {value!r}")



@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``specd serve`` configures, checked when made (before Ray or any actor
    starts).

    Attributes:
        model: a ``.gguf`` path, a Hugging Face model directory, ``None`` for the default
            SmolLM2, or ``tiny-random[:...]`` (a random test model).
        dtype: the target's weights/compute dtype, ``"auto"`` (bfloat16 on GPU and on CPUs
            where it measured faster, `target_worker.loader.cpu_prefers_bf16`; else float32:
            `target_worker.loader.resolve_dtype`), ``"float32"``, ``"bfloat16"`` or
            ``"float16"``.
        host, port: where the Generation API listens (port 0 picks a free one).
        address: a Ray address to join (``"auto"`` or ``HOST:PORT``); None embeds a local Ray.
        drafter: a `drafter_worker.registry.DRAFTERS` name (default `DEFAULT_DRAFTER`,
            ``"suffix+lookup"``), or ``"none"``.
        max_draft_len: the most drafts per step; None: the drafter's default
            (`drafter_worker.registry.default_draft_len`, its adaptive cap with ``adaptive``).
        drafter_path: the EAGLE head file (None: the head shipped for SmolLM2).
        suffix_cache_requests: ``--drafter suffix`` / ``suffix+lookup``: previous outputs
            each drafter worker's global cache keeps, over all partitions (tenant and
            ``cache_salt``) and in each (None: 10,000; 0: none, suffix drafting within each
            request only); every finished output goes to every drafter worker.
        max_active: requests decoding at once per target replica; the rest wait.
        adaptive: choose each request's draft length per step (`Scheduler` ``adaptive``).
        tp: ranks (tensor-parallel degree) of each target replica.
        target_replicas: target replicas (data parallel) at start, >= 1.
        drafters: drafter workers at start, >= 0; with ``drafter="none"`` none start, and
            more than 1 is refused (`ValueError`: a count that cannot mean anything).
        target_threads: torch threads per target rank, every step; None: this machine's
            cores divided among all ranks, each step falling back to the cores less one so
            divided (`default_target_threads`) where that measures cheaper
            (`target_worker.engine.TargetEngine`'s ``fallback_threads``): the coordinator and
            drafters run beside every step, and more threads than free cores collapse.
        drafter_timeout_s: deadline of one Propose call, plus 1 ms per hidden row it
            carries (`drafter_worker.client.ROW_DEADLINE_S`); a miss decodes the step
            undrafted.
        target_timeout_s: the most one target call (allocate, prefill, verify, free) may
            take, seconds; a replica that misses its call's deadline is treated as stalled:
            its requests fail with UNAVAILABLE and it is re-created. Each call's deadline is
            scaled by the replica's measured step cost
            (`coordinator.cluster.failures.StallWatchdog`: 10x the predicted time, at least 10 s)
            and capped by this, which is generous by default: a CPU prefill of a full batch of long
            prompts takes minutes. A replica whose process dies is detected at once whatever this
        is. tls_cert, tls_key: PEM file paths for TLS on the API.
        auth_token: bearer token(s) one of which the API requires (health checks exempt):
            a string or a tuple of them, each a tenant (`coordinator.front.tenants.Tenants`).
        admin_token: the admin's token (Status, Scale, ``/metrics``); None: the only
            ``auth_token`` when there is one, else only the tokens file's admins.
        auth_tokens_file: a file of ``<tenant> <token> [admin]`` lines, re-read when it
            changes (`coordinator.front.tenants`).
        metrics_port: serve Prometheus ``/metrics`` on ``host:metrics_port`` (0 picks a
            port; None: off). Needs prometheus_client.
        max_prompt_bytes: refuse prompts over this many UTF-8 bytes before tokenizing; None
            derives it so the context stays reachable (`gateway.default_max_prompt_bytes`).
        tool_call_parser: the format of the model's tool calls for ``tool_choice: "auto"``
            (``hermes``, ``llama3_json``, ``mistral``); None: the one the chat template
            names, else ``hermes`` (`coordinator.front.tool_calls.ChatTools`).
        pipeline: the step schedule (`coordinator.step.scheduler`): ``"auto"`` (the default,
            ``--pipeline auto``) measures the pipelined and the serial step on each replica
            as it runs and keeps the faster (`coordinator.step.schedule.ScheduleChooser`); True
            (``--pipeline on``) always drafts the next block while the target verifies this
            one; False (``--pipeline off``, ``--no-pipeline``) always the serial step
            (propose, then verify). The tokens are the same either way.
        drafter_threads: torch threads of each drafter worker (EAGLE's head); None: 1,
            so a drafter beside the target never oversubscribes the cores.
        max_batched_tokens: tokens one replica step feeds at most: verify blocks first, then
            prompt chunks (chunked prefill, `coordinator.step.plan`); None: whole prompts.
        max_partial_prefills: prompts a replica may hold partly computed at once.
        prefix_caching: reuse a finished request's warm KV slot for a prompt that starts
            with its tokens (`TargetEngine.allocate_prefix`); False: off, nothing kept warm.
        http_port: serve the OpenAI-compatible HTTP API (`coordinator.front.http_api`) on
            ``host:http_port`` (0 picks a port; None: off), same token and TLS as gRPC. It
            listens from the start of the coordinator, answering 503 until the replicas serve.
        http_max_connections_per_peer: HTTP connections one client IP may hold at once
            (`coordinator.front.http_server.HttpLimits.max_connections_per_peer`); one more is
            answered 429 and closed. 0: no per-peer cap (behind a proxy that is every
            client's address). Below the total cap, so one peer cannot hold all of it.
        target_resource: a Ray custom resource every target rank needs 1 of
            (`create_target_replica` ``resource``), or None: Ray's GPU/CPU accounting
            places them.
        drafter_resource: a Ray custom resource each drafter worker needs 1 of, or None.
        channel_tls: TLS on the per-step channels (replica sockets, drafter gRPC), each
            worker with a key pair of its own whose certificate the coordinator pins
            (`target_worker.tls`): ``"auto"`` (on a
            cluster, ``address`` given; off for the embedded loopback-only service),
            ``"on"`` or ``"off"``. The channels' own authentication applies either way.

    Raises:
        ValueError: an invalid setting, named (unknown drafter, TLS half configured, bad
            counts, threads, timeout, dtype, pipeline, prefill budget, prompt cap, per-peer
            connection cap or resource name, or
            two of ``port``, ``http_port`` and ``metrics_port`` the same fixed port).
    """

    model: str | None = None
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 50051
    address: str | None = None
    drafter: str = DEFAULT_DRAFTER
    ngram_size: int = DEFAULT_NGRAM_SIZE
    max_draft_len: int | None = None
    drafter_path: str | None = None
    suffix_cache_requests: int | None = None
    max_active: int = 32
    adaptive: bool = True
    tp: int = 1
    target_replicas: int = 1
    drafters: int = 1
    target_threads: int | None = None
    drafter_timeout_s: float = 1.0
    target_timeout_s: float = 600.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | tuple[str, ...] | None = None
    admin_token: str | None = None
    auth_tokens_file: str | None = None
    metrics_port: int | None = None
    max_prompt_bytes: int | None = None
    tool_call_parser: str | None = None
    pipeline: bool | str = "auto"
    drafter_threads: int | None = None
    http_port: int | None = None
    http_max_connections_per_peer: int = 64
    max_batched_tokens: int | None = DEFAULT_MAX_BATCHED_TOKENS
    max_partial_prefills: int = 1
    prefix_caching: bool = True
    target_resource: str | None = None
    drafter_resource: str | None = None
    channel_tls: str = "auto"

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: {path} is not a file")
        if isinstance(self.auth_token, list):  # frozen: normalise once, here
            object.__setattr__(self, "auth_token", tuple(self.auth_token))
        if self.auth_tokens_file is not None and not os.path.isfile(self.auth_tokens_file):
            raise ValueError(f"--auth-tokens-file: {self.auth_tokens_file} is not a file")
        self.tenants()  # names a bad token or tokens file before anything starts
        if self.channel_tls not in ("auto", "on", "off"):
            raise ValueError(f"channel_tls must be auto, on or off, got {self.channel_tls!r}")
        for name in ("target_resource", "drafter_resource"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty resource name, got {value!r}")
        check_pipeline(self.pipeline)
        check_drafter(self.drafter, self.ngram_size, self.max_draft_len, self.drafter_path,
                      self.suffix_cache_requests)
        if self.max_draft_len is None:  # frozen: set the resolved default once, here
            object.__setattr__(self, "max_draft_len",
                               default_draft_len(self.drafter, adaptive=self.adaptive))
        check_count("target_replicas", self.target_replicas, 1)
        check_count("drafters", self.drafters, 0)
        if self.drafter == "none" and self.drafters is not None and self.drafters > 1:
            raise ValueError(f"drafters: drafter 'none' runs no drafter workers, got "
                             f"{self.drafters} (drop --drafters, or name a --drafter)")
        if isinstance(self.target_timeout_s, bool) or not isinstance(
                self.target_timeout_s, int | float) or not self.target_timeout_s > 0:
            raise ValueError(
                f"target_timeout_s must be a positive number, got {self.target_timeout_s!r}")
        from target_worker.loader import resolve_dtype

        resolve_dtype(self.dtype)  # names a bad --dtype before anything starts
        for name in ("tp", "max_active"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("drafter_threads", "target_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ChunkPolicy(self.max_batched_tokens, self.max_partial_prefills)  # names a bad one
        value = self.max_prompt_bytes
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"max_prompt_bytes must be a positive integer, got {value!r}")
        if self.tool_call_parser is not None:
            from specd_core.tool_calls import tool_format

            tool_format(self.tool_call_parser)  # names an unknown one
        value = self.http_max_connections_per_peer
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"http_max_connections_per_peer must be an integer >= 0 "
                             f"(0: no per-peer cap), got {value!r}")
        # Every API listens on `host`: two on one port would fail only once Ray is up.
        for name, other in (("http_port", "port"), ("metrics_port", "port"),
                            ("metrics_port", "http_port")):
            value = getattr(self, name)
            if value and value == getattr(self, other):  # 0 and None: none fixed
                raise ValueError(f"{name} must differ from {other}={value}")

    def tenants(self):
        """The API's token table (`coordinator.front.tenants.Tenants`) from `auth_token`,
        `admin_token` and `auth_tokens_file`, or None when none is set (an open API).

        Raises:
            ValueError: an empty or repeated token, or a tokens file that does not parse.
        """
        from ..front.tenants import Tenants

        tokens = self.auth_token
        tokens = () if not tokens else (tokens,) if isinstance(tokens, str) else tokens
        if not tokens and self.admin_token is None and self.auth_tokens_file is None:
            return None
        return Tenants(tokens, self.admin_token, self.auth_tokens_file)

    @property
    def chunking(self) -> ChunkPolicy:
        """Every replica loop's chunked-prefill policy (`max_batched_tokens`,
        `max_partial_prefills`)."""
        return ChunkPolicy(self.max_batched_tokens, self.max_partial_prefills)

    @property
    def tls_channels(self) -> bool:
        """Whether the per-step channels run inside TLS (`channel_tls`)."""
        return self.channel_tls == "on" or (self.channel_tls == "auto" and
                                            self.address is not None)



def default_target_threads(replicas: int, tp: int = 1, cpus: int | None = None) -> int:
    """Torch threads per target rank when not given: this process's usable cores less one
    (left to the coordinator, the drafter workers, gRPC and Ray, which all run beside the
    target on every step), divided evenly among the ``replicas * tp`` ranks, at least 1.

    Why one core off: torch's OpenMP threads spin-wait for each other at every op, so a
    forward with a thread sharing a core with any busy process runs at that thread's pace.
    Measured on 2 cores (SmolLM2-135M, k=1 forward over 300 cached tokens): quiet, 2 threads
    17 ms vs 1 thread 28 ms; beside one busy process, 2 threads 36 ms (worst 134 ms) vs 1
    thread 29 ms (worst 38 ms). On 2 cores: 1 thread; 16 cores, 1 replica: 15.

    Args:
        cpus: cores to share (default: ``os.sched_getaffinity``, else ``os.cpu_count``).
    """
    if cpus is None:
        cpus = usable_cpus()
    return max(1, (cpus - 1) // max(1, replicas * tp))


def target_thread_counts(replicas: int, tp: int = 1, cpus: int | None = None
                         ) -> tuple[int, int | None]:
    """``(threads, fallback)`` per target rank when --threads is not given: this process's
    usable cores divided among the ``replicas * tp`` ranks (at least 1), and the fewer
    threads a step falls back to where they measure cheaper (`default_target_threads`: the
    cores less one so divided), None when that is no fewer.

    On 2 cores, 1 replica: ``(2, 1)``; 2 replicas: ``(1, None)``; 16 cores, 1 replica:
    ``(16, 15)``. Measured why: docs/benchmarks.md, "Target threads".
    """
    if cpus is None:
        cpus = usable_cpus()
    threads = max(1, cpus // max(1, replicas * tp))
    fallback = default_target_threads(replicas, tp, cpus)
    return threads, (fallback if fallback < threads else None)


def usable_cpus() -> int:
    """Cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1



__all__ = ["MAX_COUNT", "ServiceConfig", "check_count", "default_target_threads",
           "target_thread_counts", "usable_cpus"]
