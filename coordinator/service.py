"""The distributed service: Ray actors for the targets, the drafter workers and the
coordinator.

``Service(config).start()`` joins a Ray cluster (``config.address``) or starts an embedded
local one bound to loopback, then starts the coordinator actor (pinned to this node so the API
listens where ``specd serve`` runs), which starts:

- ``target_replicas`` target replicas of ``tp`` ranks each (`target_worker.tp`: the model and
  its KV-cache slots), one `coordinator.router.ReplicaScheduler` loop per replica,
- ``drafters`` drafter actors serving the ``specd.v1.Drafter`` gRPC API (unless
  ``drafter == "none"``), shared through a `coordinator.drafter_pool.DrafterPool`,
- the ``specd.v1.Generation`` gRPC server over the `coordinator.router.Router`; its Scale RPC
  (and `Service.scale`) adds and removes replicas and drafters while serving.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from drafter_worker.registry import DEFAULT_NGRAM_SIZE, LOOKUP_DRAFT_LEN, check_drafter
from target_worker.engine import DEFAULT_PREFIX_CACHE_TOKENS

from .step_plan import DEFAULT_MAX_BATCHED_TOKENS, ChunkPolicy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``specd serve`` configures.

    Attributes:
        model: a ``.gguf`` path, a Hugging Face model directory, ``None`` for the default
            SmolLM2, or ``tiny-random[:...]`` (a random test model).
        dtype: the target's weights/compute dtype, ``"auto"`` (float32 on CPU, bfloat16 on
            GPU), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        host, port: where the Generation API listens (port 0 picks a free one).
        address: a Ray address to join (``"auto"`` or ``HOST:PORT``); None embeds a local Ray.
        drafter: ``"prompt-lookup"``, ``"eagle"``, ``"eagle+lookup"`` or ``"none"``.
        drafter_path: the EAGLE head file (None: the head shipped for SmolLM2).
        suffix_cache_requests: ``--drafter suffix`` / ``suffix+lookup``: previous outputs
            each drafter worker's global cache keeps (None: 10,000); every finished output
            goes to every drafter worker.
        max_active: requests decoding at once per target replica; the rest wait.
        adaptive: choose each request's draft length per step (`Scheduler` ``adaptive``).
        tp: ranks (tensor-parallel degree) of each target replica.
        target_replicas: target replicas (data parallel) at start, >= 1.
        drafters: drafter workers at start, >= 0 (ignored with ``drafter="none"``).
        target_threads: torch threads per target rank; None divides this machine's cores
            less one among all ranks (`default_target_threads`). Prompt chunks run on them
            too: the coordinator and drafters run beside every step.
        drafter_timeout_s: deadline of one Propose call; a miss decodes the step undrafted.
        target_timeout_s: the most one target call (allocate, prefill, verify, free) may
            take, seconds; a replica that misses its call's deadline is treated as stalled:
            its requests fail with UNAVAILABLE and it is re-created. Each call's deadline is
            scaled by the replica's measured step cost (`coordinator.router.StallWatchdog`:
            10x the predicted time, at least 10 s) and capped by this, which is generous by
            default: a CPU prefill of a full batch of long prompts takes minutes. A replica
            whose process dies is detected at once whatever this is.
        tls_cert, tls_key: PEM file paths for TLS on the API.
        auth_token: bearer token required by the API (health checks exempt).
        metrics_port: serve Prometheus ``/metrics`` on ``host:metrics_port`` (0 picks a
            port; None: off). Needs prometheus_client.
        max_prompt_bytes: refuse prompts over this many UTF-8 bytes before tokenizing; None
            derives it so the context stays reachable (`server.default_max_prompt_bytes`).
        pipeline: draft the next block while the target verifies this one
            (`coordinator.scheduler`); False keeps the serial step (``--no-pipeline``).
        drafter_threads: torch threads of each drafter worker (EAGLE's head); None: 1,
            so a drafter beside the target never oversubscribes the cores.
        max_batched_tokens: tokens one replica step feeds at most: verify blocks first, then
            prompt chunks (chunked prefill, `coordinator.step_plan`); None: whole prompts.
        max_partial_prefills: prompts a replica may hold partly computed at once.
        prefix_caching: reuse a finished request's warm KV slot for a prompt that starts
            with its tokens (`TargetEngine.allocate_prefix`); False: off, nothing kept warm.
        http_port: serve the OpenAI-compatible HTTP API (`coordinator.http_api`) on
            ``host:http_port`` (0 picks a port; None: off), same token and TLS as gRPC. It
            listens from the start of the coordinator, answering 503 until the replicas serve.
        target_resource: a Ray custom resource every target rank needs 1 of
            (`create_target_replica` ``resource``), or None: Ray's GPU/CPU accounting
            places them.
        drafter_resource: a Ray custom resource each drafter worker needs 1 of, or None.
        channel_tls: TLS on the per-step channels (replica sockets, drafter gRPC), each
            worker with a key pair of its own whose certificate the coordinator pins
            (`target_worker.tls`): ``"auto"`` (on a
            cluster, ``address`` given; off for the embedded loopback-only service),
            ``"on"`` or ``"off"``. The channels' own authentication applies either way.
    """

    model: str | None = None
    dtype: str = "auto"
    host: str = "127.0.0.1"
    port: int = 50051
    address: str | None = None
    drafter: str = "prompt-lookup"
    ngram_size: int = DEFAULT_NGRAM_SIZE
    max_draft_len: int | None = LOOKUP_DRAFT_LEN
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
    auth_token: str | None = None
    metrics_port: int | None = None
    max_prompt_bytes: int | None = None
    pipeline: bool = True
    drafter_threads: int | None = None
    http_port: int | None = None
    max_batched_tokens: int | None = DEFAULT_MAX_BATCHED_TOKENS
    max_partial_prefills: int = 1
    prefix_caching: bool = True
    target_resource: str | None = None
    drafter_resource: str | None = None
    channel_tls: str = "auto"

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


def usable_cpus() -> int:
    """Cores this process may run on (``os.sched_getaffinity``, else ``os.cpu_count``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def init_embedded_ray(attempts: int = 2) -> None:
    """Starts the embedded single-machine Ray with every port on loopback, no dashboard and no
    Ray metrics exporter, never attaching to another Ray, with Ray's processes outside this
    process's process group.

    ``address="local"``: a plain `ray.init` joins the Ray named by ``RAY_ADDRESS`` or by the
    ``ray_current_cluster`` file that ``ray start`` leaves in Ray's temp dir (and never
    removes when its head is stopped by PID), then fails with "When connecting to an existing
    cluster, _system_config must not be provided" or joins someone else's cluster.

    Process groups: each process Ray starts here (GCS, raylet, agents, the log monitor; the
    workers are the raylet's children) leads its own process group, so a signal to this
    process's group (``kill -TERM -- -PGID``, a terminal's job control) reaches only this
    process, which drains and then stops Ray itself. Ray still ends them if this process
    dies (Linux parent-death signal). Done by wrapping Ray's private ``ConsolePopen`` for
    this call; without it (another Ray version) they share the group, with a warning.

    A loopback node IP makes Ray 2.60's GCS, raylet, object manager, core workers, agents and
    its two internal Prometheus servers (dashboard head, autoscaler monitor) bind 127.0.0.1
    instead of every interface. `ray.init` turns a loopback ``_node_ip_address`` into the
    machine's address unless Ray's ``ENABLE_RAY_CLUSTER`` constant (read from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is first imported, so setting the variable
    later does nothing) is off; it is switched off for this call only.
    ``enable_metrics_collection=False`` makes the raylet start its agent with
    ``--disable-metrics-collection``: no metrics-export HTTP port (specd's own
    ``--metrics-port`` is separate). Ray still starts its API-server process
    (``dashboard.py --disable-frontend``) even with ``include_dashboard=False``; it binds
    loopback too (README, "Ports"). Ray's usage-stats report (an hourly upload from that
    process) is off unless ``RAY_USAGE_STATS_ENABLED`` says otherwise.

    A start that fails (Ray raises a bare ``Exception`` "The current node timed out during
    startup" when its raylet has not registered within 30 s, seen on a 2-core machine under
    load) leaves Ray's GCS, monitor and API server running: `ray.init` does not stop what it
    started. Those processes are killed here by their process groups (each was started by this
    call), and a startup timeout is retried, up to ``attempts`` starts in all; any other error,
    or the last timeout, is raised.

    Raises:
        ValueError: ``attempts`` < 1.
    """
    import ray
    from ray._private import ray_constants, services

    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # inherited by Ray's processes
    for attempt in range(1, attempts + 1):
        started: list = []
        saved = ray_constants.ENABLE_RAY_CLUSTER
        saved_popen = getattr(services, "ConsolePopen", None)
        ray_constants.ENABLE_RAY_CLUSTER = False  # read by services.get_node_ip_address
        if saved_popen is not None:
            services.ConsolePopen = _own_process_group(saved_popen, started)
        else:
            log.warning("Ray's processes share this process group (ray._private.services has "
                        "no ConsolePopen): a signal to the group reaches them too")
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _node_ip_address="127.0.0.1",
                     _system_config={"enable_metrics_collection": False})
            return
        except Exception as e:
            _kill_process_groups(started)
            try:
                ray.shutdown()  # whatever global state the failed init left
            except Exception:  # noqa: BLE001 - nothing more to clean; the first error is raised
                pass
            if attempt == attempts or "timed out during startup" not in str(e):
                raise
            log.warning("embedded Ray did not start (attempt %d of %d: %s); its %d processes "
                        "were stopped, starting again", attempt, attempts, e, len(started))
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved
            if saved_popen is not None:
                services.ConsolePopen = saved_popen


def _own_process_group(popen_cls: type, started: list) -> type:
    """``popen_cls`` whose children each start a process group of their own; each one started
    is appended to ``started``."""

    class Popen(popen_cls):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)  # setpgid(0, 0) in the child (Python 3.11+)
            super().__init__(*args, **kwargs)
            started.append(self)

    return Popen


def _kill_process_groups(procs: list) -> None:
    """SIGKILLs the process group each of ``procs`` leads (each was started by this process in
    a group of its own, so its children, e.g. a raylet's agents, go too) and reaps it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a process that will not be reaped is left to init
            log.warning("Ray process %d did not exit after SIGKILL", p.pid)


def load_tokenizer_for(model: str | None):
    """The tokenizer of ``model`` without loading its weights (the coordinator needs only it)."""
    from target_worker.loader import load_tokenizer, model_path
    from target_worker.testing import is_tiny_random_spec, load_tiny_random

    if is_tiny_random_spec(model):
        return load_tiny_random(model)[1]  # a test double
    return load_tokenizer(model_path(model))


class CoordinatorActor:
    """Runs the router (one scheduler per target replica, a drafter pool) and the Generation
    gRPC server in one async Ray actor. It creates the replicas and drafter workers itself,
    at start and on `scale`, so the Scale RPC can add and remove them while serving; they
    are its child actors (Ray also ends them if this actor dies)."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.server = None
        self.servicer = None
        self.router = None
        self.metrics_server = None
        self.metrics_port: int | None = None
        self.http_api = None
        self.http_server = None
        self.http_port: int | None = None
        self._drafter_actors: dict[str, object] = {}
        self._replica_handles: dict[str, object] = {}
        #: Start-up phases done, in order: (message, seconds it took), for `startup_events`.
        self._events: list[tuple[str, float]] = []
        self._threads = config.target_threads or default_target_threads(
            config.target_replicas, config.tp)

    async def _start_replica(self, name: str):
        import asyncio

        from target_worker.channel import ChannelTarget
        from target_worker.tp import create_target_replica, destroy_target_replica

        cfg = self.config
        loop = asyncio.get_running_loop()
        began = time.monotonic()
        # May block (placement groups): off the event loop, which keeps serving.
        creating = loop.run_in_executor(None, lambda: create_target_replica(
            cfg.model, tp=cfg.tp, max_slots=cfg.max_active, num_threads=self._threads,
            dtype=cfg.dtype,
            prefix_cache_tokens=DEFAULT_PREFIX_CACHE_TOKENS if cfg.prefix_caching else 0,
            resource=cfg.target_resource))
        try:
            handle = await asyncio.shield(creating)
        except asyncio.CancelledError:  # a cancelled restart: destroy it once it exists
            def destroy_when_made(made) -> None:
                if not made.cancelled() and made.exception() is None:
                    loop.run_in_executor(None, destroy_target_replica, made.result())

            creating.add_done_callback(destroy_when_made)
            raise
        try:
            info = dict(await handle.model_info.remote())  # waits for the model to load
        except BaseException:
            await loop.run_in_executor(None, destroy_target_replica, handle)
            raise
        # Per-step calls over the replica's own socket (a Ray call costs ~1 ms here: see
        # target_worker.channel); a fresh secret per replica, loopback when embedded, every
        # interface of its node (it may be another node) on a cluster, inside TLS there.
        secret = secrets.token_urlsafe(32)
        try:
            address = await handle.open_channel.remote(
                "127.0.0.1" if cfg.address is None else "0.0.0.0", secret, cfg.tls_channels)
            cert = await handle.channel_certificate.remote()
            info["node"] = await handle.node_ip.remote()
        except BaseException:
            await loop.run_in_executor(None, destroy_target_replica, handle)
            raise
        self._replica_handles[name] = handle
        self._events.append((f"{name}: model loaded", time.monotonic() - began))
        info.update(tp=cfg.tp, num_threads=self._threads)

        async def stop() -> None:
            self._replica_handles.pop(name, None)
            await loop.run_in_executor(None, destroy_target_replica, handle)

        from .adaptive import calibrate_target

        tls = None
        if cert is not None:  # the replica's own certificate, trusted alone
            from target_worker.tls import client_context

            tls = client_context(cert)
        target = ChannelTarget(address, secret, handle, tls=tls)
        if cfg.adaptive and cfg.drafter != "none":
            # Start-up work, not the first request's: its loop would calibrate at its first
            # admission, inside that request's time (seconds of forwards on a busy machine).
            began = time.monotonic()
            try:
                info["cost_model"] = await calibrate_target(target)
            except BaseException:
                await stop()
                raise
            self._events.append((f"{name}: forward cost calibrated", time.monotonic() - began))
        return target, stop, info

    async def _start_drafter(self, name: str):
        import ray

        from drafter_worker.actor import DrafterActor
        from drafter_worker.client import DrafterClient

        cfg = self.config
        began = time.monotonic()
        placement = {} if cfg.drafter_resource is None else {
            "resources": {cfg.drafter_resource: 1}}
        actor = DrafterActor.options(num_cpus=0, **placement).remote(
            cfg.drafter, cfg.ngram_size, cfg.max_draft_len, cfg.model, cfg.drafter_path,
            cfg.drafter_threads or 1, suffix_cache_requests=cfg.suffix_cache_requests)
        # Embedded: loopback only. On a cluster the actor may land on another node; it binds
        # there and answers with its own node's address.
        host = "127.0.0.1" if cfg.address is None else "0.0.0.0"
        # Only this coordinator may call it: a fresh secret per drafter; histories capped at
        # the model's context length.
        secret = secrets.token_urlsafe(32)
        try:
            address = await actor.start.remote(host, 0, secret, await self._context_length(),
                                               cfg.tls_channels)
            cert = await actor.certificate.remote()
            node = await actor.node_ip.remote()
        except BaseException:
            ray.kill(actor)
            raise
        self._drafter_actors[name] = actor
        self._events.append((f"{name}: drafter ready", time.monotonic() - began))

        async def stop() -> None:
            self._drafter_actors.pop(name, None)
            ray.kill(actor)

        credentials = server_name = None
        if cert is not None:  # the worker's own certificate, trusted alone
            import grpc

            from target_worker.tls import CHANNEL_HOSTNAME

            credentials = grpc.ssl_channel_credentials(root_certificates=cert)
            server_name = CHANNEL_HOSTNAME
        # float16 hidden rows on the wire: half the bytes, ample for a drafter's input.
        client = DrafterClient(address, timeout_s=cfg.drafter_timeout_s,
                               hidden_dtype="float16", secret=secret,
                               channel_credentials=credentials, tls_server_name=server_name)
        client.node = node  # for Status
        return client, stop

    async def _context_length(self) -> int:
        """The model's context length (read once, off the event loop: a GGUF takes ~3 s)."""
        if getattr(self, "_max_seq_len", None) is None:
            import asyncio

            from target_worker.loader import model_config

            config = await asyncio.get_running_loop().run_in_executor(
                None, model_config, self.config.model)
            self._max_seq_len = int(config.max_seq_len)
        return self._max_seq_len

    async def start(self) -> int:
        """Starts the drafters, the replicas, then the API; returns the bound API port."""
        from .grpc_api import GenerationServicer, start_generation_server
        from .router import Router

        cfg = self.config
        if cfg.http_port is not None:
            await self._start_http()
        tokenizer = load_tokenizer_for(cfg.model)
        with_drafter = cfg.drafter != "none"
        self.router = Router(self._start_replica,
                             self._start_drafter if with_drafter else None,
                             max_active=cfg.max_active, adaptive=cfg.adaptive,
                             target_timeout_s=cfg.target_timeout_s, pipeline=cfg.pipeline,
                             chunking=ChunkPolicy(cfg.max_batched_tokens,
                                                  cfg.max_partial_prefills),
                             prefix_caching=cfg.prefix_caching)
        await self.router.scale(target_replicas=cfg.target_replicas,
                                drafters=cfg.drafters if with_drafter else 0)
        info = self.router.model_info()
        servicer = self.servicer = GenerationServicer(
            self.router, tokenizer, vocab_size=info["vocab_size"],
            max_seq_len=info["max_seq_len"], drafter_name=cfg.drafter,
            model_name=cfg.model or "SmolLM2-135M-Instruct",
            max_prompt_bytes=cfg.max_prompt_bytes)
        cert = Path(cfg.tls_cert).read_bytes() if cfg.tls_cert else None
        key = Path(cfg.tls_key).read_bytes() if cfg.tls_key else None
        self.server, port = await start_generation_server(
            servicer, cfg.host, cfg.port, cert, key, cfg.auth_token)
        registry = None
        if cfg.metrics_port is not None or cfg.http_port is not None:
            import asyncio

            from .metrics import router_registry

            try:
                registry = router_registry(self.router, asyncio.get_running_loop())
            except ImportError:
                if cfg.metrics_port is not None:
                    raise
        if cfg.metrics_port is not None:
            from .metrics import start_exporter

            self.metrics_server, self.metrics_port = start_exporter(
                self.router, asyncio.get_running_loop(), cfg.host, cfg.metrics_port, registry)
        if self.http_api is not None:
            self.http_api.registry = registry
            self.http_api.servicer = servicer  # /health and /v1 answer from now on
        return port

    async def _start_http(self) -> None:
        """Starts the OpenAI HTTP API before the replicas: 503 until they serve."""
        from .http_api import OpenAIApi, start_http_server

        cfg = self.config
        self.http_api = OpenAIApi(auth_token=cfg.auth_token)
        self.http_server, self.http_port = await start_http_server(
            self.http_api, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)

    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI HTTP API, or None when off."""
        if self.http_port is None:
            return None
        return f"{self.config.host}:{self.http_port}"

    def startup_events(self, since: int = 0) -> list[tuple[str, float]]:
        """Start-up phases done so far from index ``since``: ``(message, seconds)``."""
        return self._events[since:]

    def metrics_address(self) -> str | None:
        """``host:port`` of the Prometheus endpoint, or None when off."""
        if self.metrics_port is None:
            return None
        return f"{self.config.host}:{self.metrics_port}"

    async def scale(self, target_replicas: int | None = None, drafters: int | None = None
                    ) -> dict:
        """See `coordinator.router.Router.scale`."""
        return await self.router.scale(target_replicas=target_replicas, drafters=drafters)

    async def status(self) -> dict:
        """`Router.status` after refreshing the replicas' own reports; ``drafter`` holds the
        summed drafter client counters."""
        if self.router is None:
            return {}
        await self.router.refresh()
        status = self.router.status()
        status["drafter"] = self.router.pool.stats
        return status

    def drafter_actors(self) -> dict:
        """Drafter worker actor handles by pool name (tests kill them)."""
        return dict(self._drafter_actors)

    def replica_handles(self) -> dict:
        """Target replica handles by name."""
        return dict(self._replica_handles)

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stops the API (new calls are refused with UNAVAILABLE; in-flight ones get up to
        ``grace_s`` seconds to finish, then are cancelled), then the router."""
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
        if self.server is not None:
            if self.servicer is not None:
                await self.servicer.drain(grace_s)
            if self.http_api is not None:
                # HTTP streams that outlived the grace end with an error event and [DONE]
                # (stopping uvicorn would cut them mid-stream).
                await self.http_api.close_streams()
            await self.server.stop(grace=0.5)  # what outlived the grace period is cancelled
        if self.http_server is not None:
            await self.http_server.stop()
        if self.router is not None:
            await self.router.close()


def _check_port_free(host: str, port: int) -> None:
    """Fails fast, before Ray and the model start, when the API port is taken.

    Raises:
        ValueError: naming the address.
    """
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


class Service:
    """Starts and stops the service's actors from a driver process (``specd serve``, a batch
    job, a test). Usable as a context manager.

    Raises:
        ValueError: an invalid configuration (unknown drafter, TLS half configured, bad
            counts, a TP degree the model cannot be split into — checked before any actor
            starts).
    """

    def __init__(self, config: ServiceConfig):
        if (config.tls_cert is None) != (config.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if config.channel_tls not in ("auto", "on", "off"):
            raise ValueError(f"channel_tls must be auto, on or off, got {config.channel_tls!r}")
        for name in ("target_resource", "drafter_resource"):
            value = getattr(config, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty resource name, got {value!r}")
        check_drafter(config.drafter, config.ngram_size, config.max_draft_len,
                      config.drafter_path, config.suffix_cache_requests)
        from .router import check_count

        check_count("target_replicas", config.target_replicas, 1)
        check_count("drafters", config.drafters, 0)
        if isinstance(config.target_timeout_s, bool) or not isinstance(
                config.target_timeout_s, int | float) or not config.target_timeout_s > 0:
            raise ValueError(
                f"target_timeout_s must be a positive number, got {config.target_timeout_s!r}")
        from target_worker.loader import resolve_dtype

        resolve_dtype(config.dtype)  # names a bad --dtype before anything starts
        for name in ("tp", "max_active"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if config.drafter_threads is not None and (
                isinstance(config.drafter_threads, bool) or
                not isinstance(config.drafter_threads, int) or config.drafter_threads < 1):
            raise ValueError(
                f"drafter_threads must be a positive integer, got {config.drafter_threads!r}")
        if config.target_threads is not None and (
                isinstance(config.target_threads, bool) or
                not isinstance(config.target_threads, int) or config.target_threads < 1):
            raise ValueError(
                f"target_threads must be a positive integer, got {config.target_threads!r}")
        ChunkPolicy(config.max_batched_tokens, config.max_partial_prefills)  # names a bad one
        self.config = config
        self.port: int | None = None
        self._owns_ray = False
        self.coordinator = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self, progress: Callable[[str, int, int], None] | None = None) -> str:
        """Starts everything; returns the API address ``host:port``.

        ``progress(message, done, total)`` is called after each start-up phase (Ray up, each
        replica's model loaded, each drafter ready), ``message`` naming it with its time;
        ``done`` / ``total`` count the workers (replicas + drafters) started so far.
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from target_worker.loader import validate_model
        from target_worker.tp import validate_tp

        cfg = self.config
        if cfg.port != 0:
            _check_port_free(cfg.host, cfg.port)
        if cfg.http_port:
            _check_port_free(cfg.host, cfg.http_port)
        if cfg.model is None:
            # Fetch the default model here, once, with the progress bar in this terminal (the
            # actors' output is not forwarded), rather than racing in several actors.
            from target_worker import default_model_path

            default_model_path()
        validate_model(cfg.model)  # config, weights' shapes, tokenizer: before any actor starts
        validate_tp(cfg.model, cfg.tp)
        began = time.monotonic()
        workers = cfg.target_replicas + (cfg.drafters if cfg.drafter != "none" else 0)
        if not ray.is_initialized():
            if cfg.address is None:
                init_embedded_ray()
            else:
                ray.init(address=cfg.address, log_to_driver=False)
            self._owns_ray = True
            if progress is not None:
                progress(f"Ray up ({time.monotonic() - began:.1f} s)", 0, workers)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        try:
            # The coordinator is pinned to this node so the API listens where `serve` runs;
            # it starts the replicas and drafter workers itself.
            self.coordinator = ray.remote(num_cpus=0)(CoordinatorActor).options(
                scheduling_strategy=here).remote(cfg)
            starting = self.coordinator.start.remote()
            if progress is not None:
                self._report_startup(starting, progress, workers)
            self.port = ray.get(starting)
        except BaseException:
            self.stop()
            raise
        return self.address

    def _report_startup(self, starting, progress, workers: int) -> None:
        """Relays the coordinator's start-up phases to ``progress`` until ``starting`` (its
        `CoordinatorActor.start`) is done or failed (``ray.get`` then raises its error)."""
        import ray

        seen = 0
        while True:
            done, _ = ray.wait([starting], timeout=0.5)
            try:
                events = ray.get(self.coordinator.startup_events.remote(seen), timeout=30)
            except Exception:  # a dead coordinator: the caller's ray.get says why
                return
            for message, seconds in events:
                seen += 1
                progress(f"{message} ({seconds:.1f} s)", seen, workers)
            if done:
                return

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` serving Prometheus ``/metrics``, or None when off."""
        import ray

        return ray.get(self.coordinator.metrics_address.remote())

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI HTTP API, or None when off."""
        import ray

        return ray.get(self.coordinator.http_address.remote())

    def status(self) -> dict:
        """See `CoordinatorActor.status`."""
        import ray

        return ray.get(self.coordinator.status.remote())

    def scale(self, target_replicas: int | None = None, drafters: int | None = None) -> dict:
        """Scales while serving (`coordinator.router.Router.scale`); blocks until done.

        Raises:
            ValueError: bad counts (nothing changes).
        """
        import ray

        try:
            return ray.get(self.coordinator.scale.remote(target_replicas, drafters))
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ValueError):
                raise ValueError(str(exc.cause)) from None
            raise

    @property
    def drafter_actors(self) -> dict:
        """The drafter worker actors by pool name."""
        import ray

        return ray.get(self.coordinator.drafter_actors.remote())

    @property
    def drafter_actor(self):
        """The first drafter worker actor, or None."""
        return next(iter(self.drafter_actors.values()), None)

    def coordinator_alive(self, timeout_s: float = 30.0) -> bool:
        """False once the coordinator actor has died (a busy one that answers late counts as
        alive: only Ray's own death report decides)."""
        import ray

        if self.coordinator is None:
            return False
        try:
            ray.get(self.coordinator.metrics_address.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return False
        except ray.exceptions.GetTimeoutError:
            pass
        return True

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops the API (in-flight streams get up to ``grace_s`` seconds to finish, new calls
        are refused with UNAVAILABLE meanwhile), destroys replicas and drafters, kills the
        coordinator, and shuts Ray down if this service started it."""
        import ray

        if not ray.is_initialized():
            return
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.stop.remote(grace_s), timeout=grace_s + 30)
            except Exception:
                log.exception("coordinator stop failed")
            ray.kill(self.coordinator)  # its child actors die with it
        self.coordinator = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
