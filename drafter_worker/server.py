"""The drafter worker's gRPC service: batched proposals from any `Drafter`.

The service keeps, per request id, the drafter's view of the committed history, so each
step ships only the new tokens. The view is append-only; whenever a caller's ``known``
count disagrees with it the service answers ``resync`` and forgets the id, and the caller
resends the whole history. A proposal therefore always equals ``drafter.propose`` on the
full committed history, computed from scratch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.v1 import drafter_pb2, drafter_pb2_grpc

from . import wire
from .draft import DraftBlock, Drafter
from .prompt_lookup import PromptLookupSpeculator

log = logging.getLogger(__name__)

#: gRPC's default 4 MB limit is too small for a prompt's hidden rows
#: (e.g. 2k positions x 4096 x float32 = 32 MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: The fully qualified gRPC service name.
SERVICE_NAME: str = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def grpc_options() -> list[tuple[str, int]]:
    """Channel/server options shared by the server and `DrafterClient`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Serves ``specd.v1.Drafter`` from one `Drafter`, with per-request history state.

    Every drafter call and every state change runs on one dedicated worker thread, in
    arrival order: the event loop stays free for health checks while a drafter computes,
    drafters need not be thread-safe, and a GPU drafter always sees the same thread (CUDA
    streams are per thread). The synchronous `propose_batch` / `release_ids` are the same
    logic without gRPC; call them only from one thread at a time.
    """

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        # request id -> the committed history the drafter has seen (prompt first).
        self._histories: dict[str, list[int]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")

    # --- gRPC handlers ---------------------------------------------------------------------

    async def Propose(self, request, context):  # noqa: N802 (gRPC method name)
        return await self._run(self.propose_batch, request)

    async def Release(self, request, context):  # noqa: N802
        await self._run(self.release_ids, list(request.request_ids))
        return drafter_pb2.ReleaseResponse()

    async def Info(self, request, context):  # noqa: N802
        return drafter_pb2.InfoResponse(
            name=type(self.drafter).__name__,
            wants_hidden=bool(getattr(self.drafter, "wants_hidden", True)),
            max_draft_len=int(getattr(self.drafter, "max_draft_len", 0)),
        )

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- the logic, synchronous ------------------------------------------------------------

    def propose_batch(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        """One result per item, in order; items are applied in order (a repeated id sees the
        earlier item's state). Never raises for an item-level problem: that item gets an
        empty block, the others are unaffected."""
        response = drafter_pb2.ProposeResponse()
        for item in request.items:
            result = response.results.add()
            try:
                resync, block = self._propose_item(item)
            except Exception:
                log.exception("propose for request %r failed", item.request_id)
                resync, block = False, DraftBlock.empty()
            result.resync = resync
            try:
                result.block.CopyFrom(wire.block_to_proto(block))
            except ValueError:
                log.exception("request %r: the drafter's block cannot be encoded",
                              item.request_id)
                result.block.Clear()
        return response

    def _propose_item(self, item: drafter_pb2.ProposeItem) -> tuple[bool, DraftBlock]:
        rid = item.request_id
        stored = self._histories.get(rid)
        if item.known == 0:
            base: list[int] = []  # a fresh history: replaces any state of a reused id
        elif stored is None or len(stored) != item.known:
            self._histories.pop(rid, None)
            return True, DraftBlock.empty()
        else:
            base = stored
        try:
            hidden = wire.tensor_from_proto(item.hidden) if item.HasField("hidden") else None
        except ValueError:
            # The drafter never sees this step, so the id's view is dropped; the caller's
            # next `known` then mismatches and it resyncs.
            log.exception("request %r: bad hidden tensor", rid)
            self._histories.pop(rid, None)
            return False, DraftBlock.empty()
        history = base + list(item.append)  # a new list: `stored` may be shared
        if not history:
            self._histories.pop(rid, None)
            log.warning("request %r: empty history, nothing to draft from", rid)
            return False, DraftBlock.empty()
        # Committed before drafting: a drafter failure does not change what was committed.
        self._histories[rid] = history
        max_len = int(item.max_len)
        try:
            block = self.drafter.propose(history, hidden, max_len)
        except Exception:
            log.exception("drafter %s failed for request %r", type(self.drafter).__name__, rid)
            return False, DraftBlock.empty()
        if not isinstance(block, DraftBlock):
            log.error("drafter returned %s, not a DraftBlock", type(block).__name__)
            return False, DraftBlock.empty()
        if len(block) > max_len:
            # A new block: truncating in place would alter an object the drafter may keep.
            block = DraftBlock(block.tokens[:max_len], block.dists[:max_len])
        return False, block

    def release_ids(self, request_ids: list[str]) -> None:
        """Forgets the given ids; unknown ids are ignored."""
        for rid in request_ids:
            self._histories.pop(rid, None)

    def history(self, request_id: str) -> list[int] | None:
        """A copy of the drafter's view of ``request_id``, or None if it holds none."""
        stored = self._histories.get(request_id)
        return None if stored is None else list(stored)

    def __len__(self) -> int:
        """Number of request ids with state."""
        return len(self._histories)


async def start_drafter_server(
    drafter: Drafter, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.aio.Server, int]:
    """Starts a grpc.aio server for ``drafter`` on the running event loop.

    Serves ``specd.v1.Drafter``, standard health checking (``""`` and the Drafter service
    both SERVING) and server reflection. Messages up to `MAX_MESSAGE_BYTES` are accepted.

    Args:
        drafter: any `Drafter`; its calls run on a dedicated thread (see `DrafterServicer`).
        host: the interface to bind ("0.0.0.0" for all).
        port: the TCP port; 0 picks a free one.

    Returns:
        ``(server, bound_port)``. Stop it with ``await server.stop(grace_seconds)``.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(options=grpc_options())
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(drafter), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    # IPv6 literals need brackets in a gRPC target.
    target_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    try:
        bound = server.add_insecure_port(f"{target_host}:{port}")
    except RuntimeError as e:
        raise RuntimeError(f"drafter server cannot bind {host}:{port}: {e}") from e
    if bound == 0:  # older grpc versions report a failed bind as port 0
        raise RuntimeError(f"drafter server cannot bind {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


#: Drafter names accepted by `build_drafter`.
DRAFTERS: tuple[str, ...] = ("prompt-lookup",)


def build_drafter(name: str, ngram_size: int = 3, max_draft_len: int = 10) -> Drafter:
    """Builds a drafter by name.

    Args:
        name: one of `DRAFTERS` ("prompt-lookup": `PromptLookupSpeculator`).
        ngram_size: the n-gram length prompt lookup matches.
        max_draft_len: the most tokens one proposal drafts.

    Raises:
        ValueError: an unknown name (the message lists the choices), or sizes the drafter
            rejects.
    """
    if name == "prompt-lookup":
        return PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)
    raise ValueError(f"unknown drafter {name!r}; choices: {', '.join(DRAFTERS)}")
