"""A Ray actor hosting the drafter gRPC server in its own event loop.

Usage::

    secret = secrets.token_urlsafe(32)
    actor = DrafterActor.remote("prompt-lookup", ngram_size=3, max_draft_len=10)
    address = ray.get(actor.start.remote(host="0.0.0.0", secret=secret))   # "node-ip:port"
    client = DrafterClient(address, secret=secret)
"""

from __future__ import annotations

import grpc
import ray

from .registry import DEFAULT_DRAFTER, DEFAULT_NGRAM_SIZE, build_drafter
from .server import start_drafter_server
from .sessions import SessionLimits

#: Hosts that bind every interface: the actor then advertises its node's IP.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "")


class _DrafterActor:
    """The actor's logic as a plain class (what `DrafterActor` wraps); async methods, so Ray
    runs it as an async actor whose event loop hosts the grpc.aio server.

    ``num_threads``: torch intra-op threads of the drafter's process (default 1).

    Raises:
        ValueError: from `build_drafter` (unknown name or bad sizes), at construction.
    """

    def __init__(self, drafter: str = DEFAULT_DRAFTER, ngram_size: int = DEFAULT_NGRAM_SIZE,
                 max_draft_len: int | None = None, model: str | None = None,
                 drafter_path: str | None = None, num_threads: int = 1,
                 suffix_cache_requests: int | None = None):
        # Its own torch threads (EAGLE's head): beside a target on every step, more would
        # oversubscribe the cores (torch's OpenMP threads spin-wait on a shared core).
        import torch

        torch.set_num_threads(num_threads)
        # model / drafter_path: for the EAGLE drafters (the target's embeddings, the head).
        self.drafter = build_drafter(drafter, ngram_size=ngram_size, max_draft_len=max_draft_len,
                                     model=model, drafter_path=drafter_path,
                                     suffix_cache_requests=suffix_cache_requests)
        self._server: grpc.aio.Server | None = None
        self._address: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                    max_history: int | None = None, tls: bool = False) -> str:
        """Starts serving (idempotent: a second call returns the first address).

        Args:
            host, port: where to listen (port 0 picks one).
            secret: the shared secret every call must carry (see `start_drafter_server`;
                required unless ``host`` is loopback).
            max_history: `SessionLimits.max_history` (the model's context length), or None
                for the default.
            tls: serve TLS with a key pair generated here (the private key never leaves
                this process); `certificate` gives the certificate to trust.

        Returns:
            ``"host:port"`` to connect to; for a wildcard ``host`` the node's IP address.

        Raises:
            ValueError: a non-loopback ``host`` without a secret, or a bad ``max_history``.
            RuntimeError: the address could not be bound.
        """
        if self._server is None:
            limits = SessionLimits() if max_history is None else SessionLimits(
                max_history=max_history)
            pair = None
            if tls:
                from target_worker.tls import generate_certificate

                pair = generate_certificate()
                self._certificate = pair[0]
            server, bound = await start_drafter_server(self.drafter, host, port, secret=secret,
                                                       limits=limits, tls=pair)
            advertised = ray.util.get_node_ip_address() if host in _WILDCARD_HOSTS else host
            self._server, self._address = server, f"{advertised}:{bound}"
        return self._address

    async def stop(self, grace_s: float = 1.0) -> None:
        """Stops serving, letting in-flight calls finish for up to ``grace_s`` seconds."""
        server, self._server, self._address = self._server, None, None
        if server is not None:
            await server.stop(grace_s)

    def certificate(self) -> bytes | None:
        """The PEM certificate its TLS serves (`start` with ``tls``), or None."""
        return getattr(self, "_certificate", None)

    def node_ip(self) -> str:
        """The IP address of the Ray node this worker runs on."""
        return ray.util.get_node_ip_address()

    def address(self) -> str | None:
        """The served ``"host:port"``, or None when stopped."""
        return self._address


#: No CPU reservation: prompt lookup costs microseconds per call and must not block
#: scheduling on small clusters; model drafters should be created with ``.options(...)``.
DrafterActor = ray.remote(num_cpus=0)(_DrafterActor)
