"""The target worker as a Ray actor body: a plain class the service wraps with ``ray.remote``.

Kept free of Ray imports so it is importable (and testable) anywhere; every method is a thin
call into `TargetEngine`. The per-step calls travel over the replica's channel
(`target_worker.channel`, `target_worker.step_codec`), so they stay small: greedy rows are
ints, sampling rows sparse when that is smaller, hidden rows only when an item asks for them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from specd_core.step import PrefillItem, StepOutput, VerifyItem

from .engine import DEFAULT_PREFIX_CACHE_TOKENS, TargetEngine
from .loader import load_decoder
from .model import describe_forward

__all__ = ["ComputeThread", "TargetActor", "on_compute_thread"]

T = TypeVar("T")


class ComputeThread:
    """The one thread that runs every torch call of a target actor: its model load, weight
    packing and every step, whichever thread asks (Ray runs ``__init__`` and its methods on
    the actor's main thread, `target_worker.channel` runs steps on a connection thread).

    Why: torch's OpenMP runtime (libgomp) ran a forward ~1.4x slower on a thread other than
    the one that had first run parallel work in the process, even with the thread count set
    there (SmolLM2-135M, 2 threads, one new token after 300: 75 ms against 54 ms on the
    loading thread; ``python scripts/forward_thread.py``). One thread for all of it keeps
    every forward at the loading thread's speed; a hand-over costs ~0.1 ms.
    """

    def __init__(self, name: str = "target-compute") -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._ident = self._executor.submit(threading.get_ident).result()

    def run(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the compute thread (directly when called from it); its result,
        or its exception raised here."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._executor.submit(fn, *args).result()


def on_compute_thread(method: Callable[..., T]) -> Callable[..., T]:
    """Runs a `TargetActor` method on the actor's `ComputeThread` (``self._compute``)."""

    @functools.wraps(method)
    def wrapper(self, *args):
        return self._compute.run(method, self, *args)

    return wrapper


class TargetActor:
    """Holds the target model and its slots in one (actor) process.

    Args:
        model: a `load_decoder` source: None for the default SmolLM2, a ``.gguf`` path, or a
            ``"tiny-random[:...]"`` test spec. The tokenizer is not kept: the coordinator
            tokenizes.
        max_slots: the most requests held at once.
        num_threads: torch intra-op threads for this process (Ray starts actors with
            ``OMP_NUM_THREADS=1``, which would otherwise leave torch on one thread).
        prefix_cache_tokens: positions freed slots keep warm for prefix reuse (0: none;
            `TargetEngine`).
        fallback_threads: torch threads a step runs on instead of ``num_threads`` where
            they measure cheaper (`TargetEngine`; None: always ``num_threads``).

    Raises:
        ValueError: a bad ``model`` source, ``max_slots`` or ``num_threads``.
    """

    #: What `open_channel` serves: the per-step calls.
    CHANNEL_METHODS = ("allocate", "allocate_prefix", "free", "prefill", "verify")

    def __init__(self, model: str | None = None, max_slots: int = 64, num_threads: int = 2,
                 prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
                 fallback_threads: int | None = None):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        self._compute = ComputeThread()
        self.model = model
        self._compute.run(self._load, model, max_slots, num_threads, prefix_cache_tokens,
                          fallback_threads)

    def _load(self, model, max_slots, num_threads, prefix_cache_tokens, fallback_threads
              ) -> None:
        torch.set_num_threads(num_threads)
        self.engine = TargetEngine(load_decoder(model), max_slots=max_slots,
                                   prefix_cache_tokens=prefix_cache_tokens,
                                   fallback_threads=fallback_threads)

    def open_channel(self, host: str = "127.0.0.1", secret: str = "", tls: bool = False
                     ) -> str:
        """Starts serving `CHANNEL_METHODS` on a `target_worker.channel.ChannelServer`
        (idempotent: a second call returns the first address); returns ``"host:port"``
        (for a wildcard ``host``, this node's IP). Calls through it and through Ray run on
        different threads: only the channel may then drive the engine.

        Args:
            host: the interface to bind ("0.0.0.0": every interface of this node).
            secret: the channel's shared key (`target_worker.channel` handshake).
            tls: serve inside TLS with a key pair generated here (the private key never
                leaves this process); `channel_certificate` gives the certificate to trust.

        Raises:
            ValueError: an empty ``secret``.
        """
        from .channel import ChannelServer

        if not secret:
            raise ValueError("open_channel needs a secret")
        if getattr(self, "_channel", None) is None:  # TPRank sets up its own state
            context = None
            self._channel_cert = None
            if tls:
                from .tls import generate_certificate, server_context

                self._channel_cert, key = generate_certificate()
                context = server_context(self._channel_cert, key)
            self._channel = ChannelServer(lambda method, args: getattr(self, method)(*args),
                                          self.CHANNEL_METHODS, secret, host, tls=context)
        advertised = host
        if host in ("0.0.0.0", "::", ""):
            import ray

            advertised = ray.util.get_node_ip_address()
        return f"{advertised}:{self._channel.port}"

    def channel_certificate(self) -> bytes | None:
        """The PEM certificate of the channel's TLS (`open_channel` with ``tls``), or None."""
        return getattr(self, "_channel_cert", None)

    def node_ip(self) -> str:
        """The IP address of the Ray node this replica runs on."""
        import ray

        return ray.util.get_node_ip_address()

    @on_compute_thread
    def allocate(self) -> int:
        """A free slot id. Raises RuntimeError when every slot is in use."""
        return self.engine.allocate()

    @on_compute_thread
    def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        """``(slot, reused positions)``, looked up in ``partition``; see
        `TargetEngine.allocate_prefix`."""
        return self.engine.allocate_prefix(tokens, partition)

    @on_compute_thread
    def free(self, slot: int) -> None:
        """Releases ``slot``. Raises ValueError for an unknown slot."""
        self.engine.free(slot)

    @on_compute_thread
    def prefill(self, items: Sequence[PrefillItem]) -> list[StepOutput]:
        """See `TargetEngine.prefill`."""
        return self.engine.prefill(items)

    @on_compute_thread
    def verify(self, items: Sequence[VerifyItem]) -> list[StepOutput]:
        """See `TargetEngine.verify`."""
        return self.engine.verify(items)

    @on_compute_thread
    def rollback(self, slot: int, length: int) -> None:
        """See `TargetEngine.rollback`."""
        self.engine.rollback(slot, length)

    def status(self) -> dict:
        """``{"used_slots": int, "max_slots": int, "stats": dict}`` (`TargetEngine.stats`)."""
        return {
            "used_slots": self.engine.used_slots,
            "max_slots": self.engine.max_slots,
            "stats": dict(self.engine.stats),
        }

    def model_info(self) -> dict:
        """``{"model": source or None, "vocab_size", "hidden_size", "max_seq_len",
        "n_layers", "forward"}`` (ints; ``n_layers`` bounds the layers a drafter may read,
        `specd_core.draft.DrafterCapabilities.hidden_layers`; ``forward`` says which forward
        and arithmetic the target runs, `target_worker.model.describe_forward`)."""
        c = self.engine.config
        return {
            "model": self.model,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "max_seq_len": c.max_seq_len,
            "n_layers": c.n_layers,
            "forward": describe_forward(self.engine.decoder, self.engine.invariance),
        }
