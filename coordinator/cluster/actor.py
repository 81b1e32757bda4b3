"""The coordinator Ray actor (`CoordinatorActor`): the router, its replicas and drafter
workers, and the API servers, in one async actor on the node where ``specd serve`` runs
(`coordinator.cluster.service.Service` starts it)."""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

from target_worker.engine import DEFAULT_PREFIX_CACHE_TOKENS

from .config import ServiceConfig, target_thread_counts

log = logging.getLogger(__name__)


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
        #: Start-up phases, in order: (message, seconds it took) when one is done, (message,
        #: None) when a long one starts; for `startup_events`.
        self._events: list[tuple[str, float]] = []
        #: Unless --threads fixed the count, a step falls back to the cores less one where
        #: that measures cheaper (`TargetEngine`'s `ThreadChooser`): on 2 cores 2 threads
        #: served 1.2-1.3x faster than 1 on a quiet machine, but collapse beside a busy
        #: process (docs/benchmarks.md, "Target threads").
        self._threads, self._fallback_threads = (
            (config.target_threads, None) if config.target_threads
            else target_thread_counts(config.target_replicas, config.tp))

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
            fallback_threads=self._fallback_threads,
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
        forward = f", {info['forward']}" if info.get("forward") else ""
        self._events.append((f"{name}: model loaded{forward}", time.monotonic() - began))
        info.update(tp=cfg.tp, num_threads=self._threads)

        async def stop() -> None:
            self._replica_handles.pop(name, None)
            await loop.run_in_executor(None, destroy_target_replica, handle)

        from ..step.adaptive import calibrate_target

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
        """Starts the drafters, the replicas, then the API; returns the bound API port.

        Raises:
            ValueError: an API port cannot be bound (taken since `Service.start` checked
                it), the message starting with its setting: ``port:``, ``http_port:`` or
                ``metrics_port:``.
        """
        import asyncio

        from ..front.grpc_api import GenerationServicer, start_generation_server
        from .router import Router

        cfg = self.config
        if cfg.http_port is not None:
            await self._start_http()
        with_drafter = cfg.drafter != "none"
        self.router = Router(self._start_replica,
                             self._start_drafter if with_drafter else None,
                             max_active=cfg.max_active, adaptive=cfg.adaptive,
                             target_timeout_s=cfg.target_timeout_s, pipeline=cfg.pipeline,
                             chunking=cfg.chunking,
                             prefix_caching=cfg.prefix_caching)
        workers = cfg.target_replicas * cfg.tp + (cfg.drafters if with_drafter else 0)
        self._events.append((f"starting {cfg.target_replicas} target replica(s) and "
                             f"{cfg.drafters if with_drafter else 0} drafter(s): {workers} "
                             "worker processes (their imports and the model load take a few "
                             "seconds)", None))
        # The workers start while this actor loads its tokenizer (transformers' import is
        # ~1.5 s of it): both are on the way to ready.
        scaling = asyncio.ensure_future(self.router.scale(
            target_replicas=cfg.target_replicas, drafters=cfg.drafters if with_drafter else 0))
        try:
            tokenizer = await asyncio.get_running_loop().run_in_executor(
                None, load_tokenizer_for, cfg.model)
        except BaseException:
            scaling.cancel()
            raise
        await scaling
        info = self.router.model_info()
        servicer = self.servicer = GenerationServicer(
            self.router, tokenizer, vocab_size=info["vocab_size"],
            max_seq_len=info["max_seq_len"], drafter_name=cfg.drafter,
            model_name=cfg.model or "SmolLM2-135M-Instruct",
            max_prompt_bytes=cfg.max_prompt_bytes, tool_call_parser=cfg.tool_call_parser)
        cert = Path(cfg.tls_cert).read_bytes() if cfg.tls_cert else None
        key = Path(cfg.tls_key).read_bytes() if cfg.tls_key else None
        try:
            self.server, port = await start_generation_server(
                servicer, cfg.host, cfg.port, cert, key, self._tenants())
        except ValueError as exc:  # taken since `Service.start` checked it: name the setting
            raise ValueError(f"port: {exc}") from None
        registry = None
        if cfg.metrics_port is not None or cfg.http_port is not None:
            import asyncio

            from .metrics import router_registry

            try:
                registry = router_registry(self.router, asyncio.get_running_loop(),
                                           tenant_stats=servicer.tenant_stats)
            except ImportError:
                if cfg.metrics_port is not None:
                    raise
        if cfg.metrics_port is not None:
            from .metrics import start_exporter

            try:
                self.metrics_server, self.metrics_port = start_exporter(
                    self.router, asyncio.get_running_loop(), cfg.host, cfg.metrics_port,
                    registry)
            except OSError as exc:
                raise ValueError(f"metrics_port: cannot listen on {cfg.host}:"
                                 f"{cfg.metrics_port}: {exc.strerror}") from None
        if self.http_api is not None:
            self.http_api.registry = registry
            self.http_api.servicer = servicer  # /health and /v1 answer from now on
        return port

    async def _start_http(self) -> None:
        """Starts the OpenAI HTTP API before the replicas: 503 until they serve."""
        from ..front.http_api import OpenAIApi
        from ..front.http_server import HttpLimits, start_http_server

        cfg = self.config
        self.http_api = OpenAIApi(auth_token=self._tenants(), limits=HttpLimits(
            max_connections_per_peer=cfg.http_max_connections_per_peer))
        try:
            self.http_server, self.http_port = await start_http_server(
                self.http_api, cfg.host, cfg.http_port, cfg.tls_cert, cfg.tls_key)
        except ValueError as exc:  # taken since `Service.start` checked it: name the setting
            raise ValueError(f"http_port: {exc}") from None

    def _tenants(self):
        """The one token table both APIs share (made on first use)."""
        if not hasattr(self, "_tenant_table"):
            self._tenant_table = self.config.tenants()
        return self._tenant_table

    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI HTTP API, or None when off."""
        if self.http_port is None:
            return None
        return f"{self.config.host}:{self.http_port}"

    def startup_events(self, since: int = 0) -> list[tuple[str, float | None]]:
        """Start-up phases so far from index ``since``: ``(message, seconds)`` for one done,
        ``(message, None)`` for one just started."""
        return self._events[since:]

    def metrics_address(self) -> str | None:
        """``host:port`` of the Prometheus endpoint, or None when off."""
        if self.metrics_port is None:
            return None
        return f"{self.config.host}:{self.metrics_port}"

    async def scale(self, target_replicas: int | None = None, drafters: int | None = None
                    ) -> dict:
        """See `coordinator.cluster.router.Router.scale`."""
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


__all__ = ["CoordinatorActor", "load_tokenizer_for"]
