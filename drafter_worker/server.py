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
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd_core.draft import DraftBlock, Drafter
from specd_core.sampling import DraftSamplingParams

from . import wire
from .eagle import NeedsResync
from .prompt_lookup import PromptLookupSpeculator

log = logging.getLogger(__name__)

#: gRPC's default 4 MB limit is too small for a prompt's hidden rows
#: (e.g. 2k positions x 4096 x float32 = 32 MB).
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

#: The fully qualified gRPC service name.
SERVICE_NAME: str = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


#: gRPC metadata key of the shared secret the coordinator sends on every drafter call.
SECRET_METADATA_KEY = "x-specd-drafter-secret"

#: Environment variable `python -m drafter_worker` reads its secret from.
SECRET_ENV = "SPECD_DRAFTER_SECRET"


class ProposeRefused(ValueError):
    """A Propose call the worker refuses as a whole (``INVALID_ARGUMENT``); the message names
    the field. Nothing in the call was applied."""


@dataclass(frozen=True)
class SessionLimits:
    """Bounds on what a drafter worker holds for its callers.

    Attributes:
        max_history: the most tokens one request's history may reach (the service passes the
            model's context length; the default is SmolLM2's); a Propose item beyond it
            refuses the whole call.
        max_sessions: the most request ids held; past it the least recently used id is
            forgotten (its next call resyncs, which costs a resend, never an output).
        idle_timeout_s: seconds after its last Propose an id is forgotten (checked on every
            call; memory is bounded by the other two limits meanwhile).

    Raises:
        ValueError: a limit that is not positive.
    """

    max_history: int = 8192
    max_sessions: int = 1024
    idle_timeout_s: float = 600.0

    def __post_init__(self):
        for name in ("max_history", "max_sessions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s!r}")


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


def refusing_handler(handler: grpc.RpcMethodHandler | None, details: str
                     ) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape (unary or streaming request and response; unary-unary
    when None) that aborts every call with UNAUTHENTICATED and ``details``: what an
    authenticating interceptor returns instead of the real handler (the drafter secret here,
    the Generation service's bearer token in `coordinator.server`)."""

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)
        yield  # pragma: no cover - makes this an async generator

    if handler is not None and handler.response_streaming:
        if handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(streaming)
        return grpc.unary_stream_rpc_method_handler(streaming)
    if handler is not None and handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary)
    return grpc.unary_unary_rpc_method_handler(unary)


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

    Args:
        drafter: the `Drafter` served.
        limits: what the worker holds at most (`SessionLimits`; default: its defaults).
        clock: seconds, monotonic (injectable for tests of idle expiry).
    """

    def __init__(self, drafter: Drafter, limits: SessionLimits | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.drafter = drafter
        self.limits = limits or SessionLimits()
        self._clock = clock
        # request id -> the committed history the drafter has seen (prompt first).
        self._histories: dict[str, list[int]] = {}
        # request id -> time of its last Propose, least recently used first.
        self._last_used: OrderedDict[str, float] = OrderedDict()
        # request id -> its own drafter, for drafters with per-request state (a KV cache):
        # those expose ``session(sampling, seed)`` (see `drafter_worker.eagle`).
        self._sessions: dict[str, Drafter] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")

    # --- gRPC handlers ---------------------------------------------------------------------

    async def Propose(self, request, context):  # noqa: N802 (gRPC method name)
        try:
            return await self._run(self.propose_batch, request)
        except ProposeRefused as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

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
        earlier item's state). A drafting problem with one item gives that item an empty
        block, the others are unaffected.

        Raises:
            ProposeRefused: an item whose history would exceed ``limits.max_history``
                (checked before anything is applied).
        """
        cap = self.limits.max_history
        for i, item in enumerate(request.items):
            total = item.known + len(item.append)
            if total > cap:
                raise ProposeRefused(
                    f"items[{i}].append: a history of {total} tokens (known {item.known} + "
                    f"{len(item.append)} appended) exceeds max_history {cap}")
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
        rid = item.request_id
        stored = self._histories.get(rid)
        if item.known == 0:
            base: list[int] = []  # a fresh history: replaces any state of a reused id
            self._sessions.pop(rid, None)
        elif stored is None or len(stored) != item.known:
            self._forget(rid)
            return True, DraftBlock.empty()
        else:
            base = stored
        try:
            hidden = wire.tensor_from_proto(item.hidden) if item.HasField("hidden") else None
        except ValueError:
            # The drafter never sees this step, so the id's view is dropped; the caller's
            # next `known` then mismatches and it resyncs.
            log.exception("request %r: bad hidden tensor", rid)
            self._forget(rid)
            return False, DraftBlock.empty()
        history = base + list(item.append)  # a new list: `stored` may be shared
        if not history:
            self._forget(rid)
            log.warning("request %r: empty history, nothing to draft from", rid)
            return False, DraftBlock.empty()
        # Committed before drafting: a drafter failure does not change what was committed.
        self._histories[rid] = history
        self._touch(rid)
        max_len = int(item.max_len)
        drafter = self._drafter_for(rid, item)
        try:
            block = drafter.propose(history, hidden, max_len)
        except NeedsResync as e:
            # The drafter's state and the rows sent do not line up (e.g. rows lost with a
            # failed call): start over with the whole history and every row.
            log.warning("request %r: %s; asking for a resync", rid, e)
            self._forget(rid)
            return True, DraftBlock.empty()
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

    def _drafter_for(self, rid: str, item: drafter_pb2.ProposeItem) -> Drafter:
        """The shared drafter, or the id's own session of it (created on first use with the
        item's sampling transforms and seed)."""
        make = getattr(self.drafter, "session", None)
        if make is None:
            return self.drafter
        session = self._sessions.get(rid)
        if session is None:
            sampling, seed = None, 0
            if item.HasField("sampling"):
                s = item.sampling
                sampling = DraftSamplingParams(temperature=max(0.0, s.temperature),
                                               top_k=max(0, s.top_k),
                                               top_p=s.top_p if 0 < s.top_p <= 1 else 1.0)
                seed = s.seed
            session = self._sessions[rid] = make(sampling, seed)
        return session

    def _forget(self, rid: str) -> None:
        self._histories.pop(rid, None)
        self._sessions.pop(rid, None)
        self._last_used.pop(rid, None)

    def _touch(self, rid: str) -> None:
        """Marks ``rid`` used now; forgets the least recently used ids past the session cap."""
        self._last_used[rid] = self._clock()
        self._last_used.move_to_end(rid)
        while len(self._last_used) > self.limits.max_sessions:
            oldest = next(iter(self._last_used))
            log.warning("holding %d request ids (max_sessions): forgetting %r, the least "
                        "recently used", len(self._last_used), oldest)
            self._forget(oldest)

    def expire_idle(self) -> list[str]:
        """Forgets every id whose last Propose is more than ``limits.idle_timeout_s`` ago;
        returns them (oldest first). Runs at the start of every Propose and Release."""
        deadline = self._clock() - self.limits.idle_timeout_s
        expired = []
        while self._last_used:
            rid, used = next(iter(self._last_used.items()))
            if used >= deadline:
                break
            expired.append(rid)
            self._forget(rid)
        if expired:
            log.info("forgot %d request ids idle for over %.0f s", len(expired),
                     self.limits.idle_timeout_s)
        return expired

    def release_ids(self, request_ids: list[str]) -> None:
        """Forgets the given ids; unknown ids are ignored."""
        self.expire_idle()
        for rid in request_ids:
            self._forget(rid)

    def history(self, request_id: str) -> list[int] | None:
        """A copy of the drafter's view of ``request_id``, or None if it holds none."""
        stored = self._histories.get(request_id)
        return None if stored is None else list(stored)

    def __len__(self) -> int:
        """Number of request ids with state."""
        return len(self._histories)


async def start_drafter_server(
    drafter: Drafter, host: str = "127.0.0.1", port: int = 0, *, secret: str | None = None,
    limits: SessionLimits | None = None,
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
DRAFTERS: tuple[str, ...] = ("prompt-lookup", "eagle", "eagle+lookup")

#: Default draft length of the EAGLE drafters (each drafted token costs a head forward).
EAGLE_MAX_DRAFT_LEN = 3

#: Default `EagleDrafter` ``min_confidence``: a drafted position is verified only while the
#: head's own estimate that the whole block so far is accepted stays above this. Its value is
#: the break-even of one more verified token on the 2-core CPU (a verify over 2 tokens costs
#: ~1.1x one over 1 token, and a head step ~3% of a target forward); see README (EAGLE).
EAGLE_MIN_CONFIDENCE = 0.15


def check_drafter(name: str, ngram_size: int = 3, max_draft_len: int | None = None,
                  drafter_path: str | None = None) -> None:
    """Validates `build_drafter`'s arguments without loading any weights (what a service
    checks before starting workers).

    Raises:
        ValueError: an unknown name, invalid sizes, or a head path for a drafter that has no
            head. FileNotFoundError: a missing head file.
    """
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; choices: {', '.join(DRAFTERS)}")
    if drafter_path is not None and not name.startswith("eagle"):
        raise ValueError(f"drafter_path={drafter_path!r} is for the EAGLE drafters; "
                         f"drafter {name!r} has no head")
    PromptLookupSpeculator(ngram_size=ngram_size,
                           max_draft_len=10 if max_draft_len is None else max_draft_len)
    if name.startswith("eagle"):
        from .eagle import DEFAULT_HEAD

        path = DEFAULT_HEAD if drafter_path is None else drafter_path
        if not os.path.isfile(path):
            raise FileNotFoundError(f"EAGLE head not found: {path}")


def build_drafter(name: str, ngram_size: int = 3, max_draft_len: int | None = None, *,
                  model: str | None = None, target=None, drafter_path: str | None = None,
                  stop_token_ids=(), min_confidence: float | None = None) -> Drafter:
    """Builds a drafter by name.

    Args:
        name: one of `DRAFTERS`: "prompt-lookup" (`PromptLookupSpeculator`), "eagle"
            (`drafter_worker.eagle.EagleDrafter`) or "eagle+lookup" (prompt lookup when
            it matches, EAGLE otherwise: `drafter_worker.eagle.LookupThenEagle`).
        ngram_size: the n-gram length prompt lookup matches.
        max_draft_len: the most tokens one proposal drafts (default 10 for prompt lookup,
            `EAGLE_MAX_DRAFT_LEN` for the EAGLE head).
        model: the target the EAGLE head drafts for (a ``.gguf`` path or None for the
            default model); only its embedding table and LM head are used.
        target: an already loaded `target_worker.Decoder` to share those weights with
            (instead of loading ``model``).
        drafter_path: an EAGLE head file (default: the head shipped for SmolLM2).
        stop_token_ids: a drafted stop token ends an EAGLE block.
        min_confidence: EAGLE's dynamic draft length threshold (`EagleDrafter`; default
            `EAGLE_MIN_CONFIDENCE`, 0 turns it off).

    Raises:
        ValueError: an unknown name (the message lists the choices), or sizes the drafter
            rejects, or a head that does not fit the target.
        FileNotFoundError: a missing head or model file.
    """
    if name == "prompt-lookup":
        return PromptLookupSpeculator(ngram_size=ngram_size,
                                      max_draft_len=10 if max_draft_len is None
                                      else max_draft_len)
    if name in ("eagle", "eagle+lookup"):
        from .eagle import EagleDrafter, LookupThenEagle

        k = EAGLE_MAX_DRAFT_LEN if max_draft_len is None else max_draft_len
        conf = EAGLE_MIN_CONFIDENCE if min_confidence is None else min_confidence
        if target is None:
            eagle = EagleDrafter.for_model(model, drafter_path, max_draft_len=k,
                                           stop_token_ids=stop_token_ids, min_confidence=conf)
        else:
            eagle = EagleDrafter.for_target(target, drafter_path, max_draft_len=k,
                                            stop_token_ids=stop_token_ids, min_confidence=conf)
        if name == "eagle":
            return eagle
        lookup_len = 10 if max_draft_len is None else max_draft_len
        return LookupThenEagle(PromptLookupSpeculator(ngram_size, lookup_len), eagle)
    raise ValueError(f"unknown drafter {name!r}; choices: {', '.join(DRAFTERS)}")
