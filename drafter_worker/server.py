"""The drafter worker's gRPC service: batched proposals from any `Drafter`.

The service keeps, per request id, the drafter's view of the committed history, so each
step ships only the new tokens. The view is append-only; whenever a caller's ``known``
count disagrees with it the service answers ``resync`` and forgets the id, and the caller
resends the whole history. A proposal therefore always equals ``drafter.propose`` on the
full committed history, computed from scratch.

Least exposure: with a secret every call but health checks must carry it
(`SECRET_METADATA_KEY`; else ``UNAUTHENTICATED``); without one the server binds loopback only.
A request's history is capped (`SessionLimits.max_history`, the model's context length in the
service), and so is the number of ids held (least recently used ones are forgotten first) and
their idle time.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd_core.draft import DraftBlock, Drafter
from specd_core.sampling import DraftSamplingParams

from . import wire
from .sessions import DrafterSessions, ProposeRefused, SessionLimits

log = logging.getLogger(__name__)

#: gRPC's default 4 MB limit is too small for a prompt's hidden rows (e.g. 2k positions x
#: 4096 x float32 = 32 MB; SmolLM2's 8192 positions x 3 layers x 576 x float16 = 28 MB). The
#: coordinator's client keeps each request under half of this and splits a larger resend
#: (`drafter_worker.client.PROPOSE_MESSAGE_BYTES`).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: The fully qualified gRPC service name.
SERVICE_NAME: str = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


#: gRPC metadata key of the shared secret the coordinator sends on every drafter call.
SECRET_METADATA_KEY = "x-specd-drafter-secret"

#: Environment variable `python -m drafter_worker` reads its secret from.
SECRET_ENV = "SPECD_DRAFTER_SECRET"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback interface only ("localhost", 127.0.0.0/8, ::1)."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class CredentialInterceptor(grpc.aio.ServerInterceptor):
    """Base of the metadata-credential interceptors: every RPC but health checks must present
    (`presented`, from its metadata) the expected credential, compared in constant time;
    others get ``UNAUTHENTICATED`` with ``REFUSAL`` (`refusing_handler`).

    Raises:
        ValueError: an empty credential (``EMPTY`` says which).
    """

    EXEMPT = ("/grpc.health.v1.Health/",)
    EMPTY = "the credential must be non-empty"
    REFUSAL = "missing or invalid credential"

    def __init__(self, credential: str):
        if not credential:
            raise ValueError(self.EMPTY)
        self._expected = credential.encode()

    def presented(self, metadata: Sequence[tuple[str, str | bytes]]) -> str:
        """The credential an RPC's metadata presents ("" for none)."""
        raise NotImplementedError

    async def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(self.EXEMPT):
            return await continuation(handler_call_details)
        given = self.presented(handler_call_details.invocation_metadata or ())
        if given and hmac.compare_digest(given.encode(), self._expected):
            return await continuation(handler_call_details)
        return refusing_handler(await continuation(handler_call_details), self.REFUSAL)


class SharedSecretInterceptor(CredentialInterceptor):
    """Requires `SECRET_METADATA_KEY` metadata equal to the secret (compared in constant time)
    on every RPC but health checks; others get ``UNAUTHENTICATED``.

    Raises:
        ValueError: an empty secret.
    """

    EMPTY = "the drafter secret must be non-empty"
    REFUSAL = "missing or invalid drafter secret"

    def presented(self, metadata: Sequence[tuple[str, str | bytes]]) -> str:
        given = ""
        for key, value in metadata:
            if key == SECRET_METADATA_KEY:
                given = value if isinstance(value, str) else ""
        return given


def refusing_handler(handler: grpc.RpcMethodHandler | None, details: str,
                     code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
                     ) -> grpc.RpcMethodHandler:
    """A handler that aborts every call with ``code`` and ``details`` without reading
    its request: what an authenticating interceptor returns instead of the real handler (the
    drafter secret here, the Generation service's bearer token in `coordinator.front.grpc_api`).

    It takes a request stream whatever the method's shape (the client cannot tell), so gRPC
    never receives the request message whole nor parses it: a unary handler makes gRPC read
    and deserialize the message first, up to the 64 MB receive limit, before the refusal
    (measured: a 60 MB unauthenticated Propose raised the drafter's peak RSS by ~180 MB).
    The response shape follows ``handler``'s (unary when None)."""

    async def unary(request_iterator, context):
        await context.abort(code, details)

    async def streaming(request_iterator, context):
        await context.abort(code, details)
        yield  # pragma: no cover - makes this an async generator

    if handler is not None and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming)
    return grpc.stream_unary_rpc_method_handler(unary)


def grpc_options() -> list[tuple[str, int]]:
    """Channel/server options shared by the server and `DrafterClient`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    """Serves ``specd.v1.Drafter`` from one `Drafter`, with per-request history state
    (`drafter_worker.sessions.DrafterSessions`, the same bookkeeping the in-process adapter
    uses).

    Every drafter call and every state change runs on one dedicated worker thread, in
    arrival order: the event loop stays free for health checks while a drafter computes,
    drafters need not be thread-safe, and a GPU drafter always sees the same thread (CUDA
    streams are per thread). The synchronous `propose_batch` / `release_ids` are the same
    logic without gRPC; call them only from one thread at a time.

    Args:
        drafter: the `Drafter` served.
        limits: what the worker holds at most (`SessionLimits`; default: its defaults).
        clock: seconds, monotonic (injectable for tests of idle expiry).
    """

    def __init__(self, drafter: Drafter, limits: SessionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.drafter = drafter
        self.sessions = DrafterSessions(drafter, limits, clock)
        self.limits = self.sessions.limits
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")

    # --- gRPC handlers ---------------------------------------------------------------------

    async def Propose(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            return await self._run(self.propose_batch, request)
        except ProposeRefused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def ProposeStream(self, request_iterator, context):  # noqa: N802
        async for request in request_iterator:
            try:
                response = await self._run(self.propose_batch, request)
            except ProposeRefused as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            yield response

    async def Release(self, request, context):  # noqa: N802
        await self._run(self.release_ids, list(request.request_ids))
        if request.outputs:
            await self._run(self.sessions.remember, [list(o.tokens) for o in request.outputs],
                            [o.partition for o in request.outputs])
        return drafter_pb2.ReleaseResponse()

    async def Info(self, request, context):  # noqa: N802
        caps = self.sessions.capabilities
        return drafter_pb2.InfoResponse(
            name=type(self.drafter).__name__,
            wants_hidden=caps.wants_hidden,
            max_draft_len=caps.max_draft_len or 0,
            remembers_outputs=caps.remembers,
            hidden_layers=caps.hidden_layers,
        )

    async def Stats(self, request, context):  # noqa: N802
        # Off the drafter thread: Status must not wait behind a proposal (see `stats`).
        return await asyncio.to_thread(self.stats)

    async def _run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- the logic, synchronous ------------------------------------------------------------

    def propose_batch(self, request: drafter_pb2.ProposeRequest) -> drafter_pb2.ProposeResponse:
        """One result per item, in order; items are applied in order (a repeated id sees the
        earlier item's state). A drafting problem with one item gives that item an empty
        block, the others are unaffected.

        Raises:
            ProposeRefused: an item whose history would exceed ``limits.max_history``, or
                whose partition is longer than `sessions.MAX_PARTITION_CHARS` (checked
                before anything is applied).
        """
        for i, item in enumerate(request.items):
            self.sessions.check_length(i, item.known, len(item.append) + len(item.assumed))
            self.sessions.check_partition(i, item.partition)
        self.expire_idle()
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
        sampling, seed = None, 0
        if item.HasField("sampling"):
            s = item.sampling
            sampling = DraftSamplingParams(temperature=max(0.0, s.temperature),
                                           top_k=max(0, s.top_k),
                                           top_p=s.top_p if 0 < s.top_p <= 1 else 1.0)
            seed = s.seed

        def load_hidden():
            return wire.tensor_from_proto(item.hidden) if item.HasField("hidden") else None

        return self.sessions.propose(item.request_id, item.known, item.append, item.max_len,
                                     load_hidden, sampling, seed, item.assumed,
                                     item.ahead, item.partition)

    def stats(self) -> drafter_pb2.StatsResponse:
        """The drafter's counters (`DrafterSessions.stats`) as a ``StatsResponse``. Called
        on a thread other than the drafter's, so a drafter's ``stats()`` must be safe to call
        concurrently with its other methods (`SuffixDrafter`'s takes the cache's lock and
        reads plain ints)."""
        return drafter_pb2.StatsResponse(**self.sessions.stats())

    def expire_idle(self) -> list[str]:
        """Forgets every id whose last Propose is more than ``limits.idle_timeout_s`` ago;
        returns them (oldest first). Runs at the start of every Propose and Release."""
        return self.sessions.expire_idle()

    def release_ids(self, request_ids: list[str]) -> None:
        """Forgets the given ids; unknown ids are ignored."""
        self.sessions.release(request_ids)

    def history(self, request_id: str) -> list[int] | None:
        """A copy of the drafter's view of ``request_id``, or None if it holds none."""
        return self.sessions.history(request_id)

    def __len__(self) -> int:
        """Number of request ids with state."""
        return len(self.sessions)


async def start_drafter_server(
    drafter: Drafter, host: str = "127.0.0.1", port: int = 0, *, secret: str | None = None,
    limits: SessionLimits | None = None, tls: tuple[bytes, bytes] | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Starts a grpc.aio server for ``drafter`` on the running event loop.

    Serves ``specd.v1.Drafter``, standard health checking (``""`` and the Drafter service
    both SERVING) and server reflection. Messages up to `MAX_MESSAGE_BYTES` are accepted.

    Args:
        drafter: any `Drafter`; its calls run on a dedicated thread (see `DrafterServicer`).
        host: the interface to bind ("0.0.0.0" for all: needs ``secret``).
        port: the TCP port; 0 picks a free one.
        secret: when given, every call but health checks must carry it as
            `SECRET_METADATA_KEY` metadata (`SharedSecretInterceptor`). Without one any local
            process may call, so only a loopback ``host`` is allowed (and a warning logged).
        limits: `SessionLimits` for the servicer (default: its defaults).
        tls: ``(certificate PEM, private key PEM)`` to serve TLS with (between nodes:
            `target_worker.tls`), or None for plaintext.

    Returns:
        ``(server, bound_port)``. Stop it with ``await server.stop(grace_seconds)``.

    Raises:
        ValueError: a non-loopback ``host`` without a ``secret``, or an empty ``secret``.
        RuntimeError: the address could not be bound.
    """
    if secret is None:
        if not is_loopback(host):
            raise ValueError(f"the drafter may listen on {host!r} only with a secret "
                             f"(${SECRET_ENV}); without one it binds loopback only")
        log.warning("drafter on %s without a secret: any local process may call it", host)
    interceptors = [] if secret is None else [SharedSecretInterceptor(secret)]
    server = grpc.aio.server(interceptors=interceptors, options=grpc_options())
    drafter_pb2_grpc.add_DrafterServicer_to_server(DrafterServicer(drafter, limits), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    # IPv6 literals need brackets in a gRPC target.
    target_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    try:
        if tls is None:
            bound = server.add_insecure_port(f"{target_host}:{port}")
        else:
            cert, key = tls
            bound = server.add_secure_port(f"{target_host}:{port}",
                                           grpc.ssl_server_credentials([(key, cert)]))
    except RuntimeError as e:
        raise RuntimeError(f"drafter server cannot bind {host}:{port}: {e}") from e
    if bound == 0:  # older grpc versions report a failed bind as port 0
        raise RuntimeError(f"drafter server cannot bind {host}:{port}")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound
