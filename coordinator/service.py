"""The distributed service: Ray actors for the target, the drafter worker and the coordinator.

``Service(config).start()`` joins a Ray cluster (``config.address``) or starts an embedded
local one bound to loopback, then starts:

- a target actor (`target_worker.actor.TargetActor`: the model and its KV-cache slots),
- a drafter actor serving the ``specd.v1.Drafter`` gRPC API (unless ``drafter == "none"``),
- the coordinator actor: the `Scheduler` loop plus the ``specd.v1.Generation`` gRPC server,
  pinned to this node so the API listens where ``specd serve`` runs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``specd serve`` configures.

    Attributes:
        model: a ``.gguf`` path, ``None`` for the default SmolLM2, or ``tiny-random[:...]``
            (a random test model).
        host, port: where the Generation API listens (port 0 picks a free one).
        address: a Ray address to join (``"auto"`` or ``HOST:PORT``); None embeds a local Ray.
        drafter: ``"prompt-lookup"``, ``"eagle"``, ``"eagle+lookup"`` or ``"none"``.
        drafter_path: the EAGLE head file (None: the head shipped for SmolLM2).
        max_active: requests decoding at once; the rest wait.
        target_threads: torch threads of the target actor.
        drafter_timeout_s: deadline of one Propose call; a miss decodes the step undrafted.
        tls_cert, tls_key: PEM file paths for TLS on the API.
        auth_token: bearer token required by the API (health checks exempt).
    """

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    address: str | None = None
    drafter: str = "prompt-lookup"
    ngram_size: int = 3
    max_draft_len: int | None = 10
    drafter_path: str | None = None
    max_active: int = 32
    target_threads: int = 2
    drafter_timeout_s: float = 1.0
    tls_cert: str | None = None
    tls_key: str | None = None
    auth_token: str | None = None


def load_tokenizer_for(model: str | None):
    """The tokenizer of ``model`` without loading its weights (the coordinator needs only it)."""
    from target_worker.loader import load_tokenizer, model_path
    from target_worker.testing import is_tiny_random_spec, load_tiny_random

    if is_tiny_random_spec(model):
        return load_tiny_random(model)[1]  # a test double
    return load_tokenizer(model_path(model))


class CoordinatorActor:
    """Runs the scheduler and the Generation gRPC server in one async Ray actor."""

    def __init__(self, config: ServiceConfig, target, drafter_address: str | None):
        self.config = config
        self.target = target
        self.drafter_address = drafter_address
        self.server = None
        self.scheduler = None
        self.drafter = None

    async def start(self) -> int:
        """Starts serving; returns the bound API port."""
        from drafter_worker.client import DrafterClient

        from .scheduler import RayTarget, Scheduler
        from .server import GenerationServicer, start_generation_server

        cfg = self.config
        tokenizer = load_tokenizer_for(cfg.model)
        info = await self.target.model_info.remote()
        wants_hidden = False
        if self.drafter_address is not None:
            # float16 hidden rows on the wire: half the bytes, ample for a drafter's input.
            self.drafter = DrafterClient(self.drafter_address, timeout_s=cfg.drafter_timeout_s,
                                         hidden_dtype="float16")
            wants_hidden = (await self.drafter.info()).wants_hidden
        self.scheduler = Scheduler(RayTarget(self.target), self.drafter,
                                   max_active=cfg.max_active, wants_hidden=wants_hidden)
        self.scheduler.start()
        servicer = GenerationServicer(
            self.scheduler, tokenizer, vocab_size=info["vocab_size"],
            max_seq_len=info["max_seq_len"], drafter_name=cfg.drafter,
            model_name=cfg.model or "SmolLM2-135M-Instruct")
        cert = Path(cfg.tls_cert).read_bytes() if cfg.tls_cert else None
        key = Path(cfg.tls_key).read_bytes() if cfg.tls_key else None
        self.server, port = await start_generation_server(
            servicer, cfg.host, cfg.port, cert, key, cfg.auth_token)
        return port

    async def status(self) -> dict:
        status = self.scheduler.status() if self.scheduler else {}
        if self.drafter is not None:
            status["drafter"] = dict(self.drafter.stats)
        return status

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.scheduler is not None:
            await self.scheduler.close()
        if self.drafter is not None:
            await self.drafter.close()


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
        ValueError: an invalid configuration (unknown drafter, TLS half configured).
    """

    def __init__(self, config: ServiceConfig):
        from drafter_worker.server import check_drafter

        if (config.tls_cert is None) != (config.tls_key is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if config.drafter != "none":
            check_drafter(config.drafter, config.ngram_size, config.max_draft_len,
                          config.drafter_path)
        self.config = config
        self.port: int | None = None
        self._actors: list = []
        self._owns_ray = False
        self.target_actor = None
        self.drafter_actor = None
        self.coordinator = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self) -> str:
        """Starts everything; returns the API address ``host:port``."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from drafter_worker.actor import DrafterActor
        from target_worker.actor import TargetActor

        cfg = self.config
        if cfg.port != 0:
            _check_port_free(cfg.host, cfg.port)
        if cfg.model is None:
            # Fetch the default model here, once, with the progress bar in this terminal (the
            # actors' output is not forwarded), rather than racing in two actors.
            from target_worker import default_model_path

            default_model_path()
        if not ray.is_initialized():
            if cfg.address is None:
                # Embedded: no dashboard; this setting keeps most of Ray's ports on loopback.
                os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
                ray.init(include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            else:
                ray.init(address=cfg.address, log_to_driver=False)
            self._owns_ray = True
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        try:
            target = self.target_actor = ray.remote(num_cpus=0)(TargetActor).remote(
                cfg.model, max_slots=cfg.max_active, num_threads=cfg.target_threads)
            self._actors.append(target)
            drafter_address = None
            if cfg.drafter != "none":
                drafter = self.drafter_actor = DrafterActor.options(num_cpus=0).remote(
                    cfg.drafter, cfg.ngram_size, cfg.max_draft_len, cfg.model, cfg.drafter_path)
                self._actors.append(drafter)
                # Embedded: loopback only. On a cluster the actor may land on another node;
                # it binds there and answers with its own node's address.
                host = "127.0.0.1" if cfg.address is None else "0.0.0.0"
                drafter_address = ray.get(drafter.start.remote(host, 0))
            self.coordinator = ray.remote(num_cpus=0)(CoordinatorActor).options(
                scheduling_strategy=here).remote(cfg, target, drafter_address)
            self._actors.append(self.coordinator)
            self.port = ray.get(self.coordinator.start.remote())
        except BaseException:
            self.stop()
            raise
        return self.address

    def status(self) -> dict:
        import ray

        return ray.get(self.coordinator.status.remote())

    def stop(self) -> None:
        """Stops the API, kills the actors, and shuts Ray down if this service started it."""
        import ray

        if not ray.is_initialized():
            return
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.stop.remote(), timeout=10)
            except Exception:
                log.exception("coordinator stop failed")
        for actor in reversed(self._actors):
            ray.kill(actor)
        self._actors.clear()
        self.coordinator = self.target_actor = self.drafter_actor = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
