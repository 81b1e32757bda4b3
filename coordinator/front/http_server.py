"""The HTTP server under `coordinator.front.http_api`: uvicorn on a socket bound here, with what one
client may hold of it bounded (`HttpLimits`): connections, header and body sizes and times
(`Guard`, the ASGI app in front of FastAPI, and h11 protocol limits), the bearer token checked
before a body is read; refusals in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from dataclasses import dataclass
from typing import Any, Protocol

from .openai_errors import ApiError, unavailable
from .tenants import TENANT_SCOPE_KEY, Tenant

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the server (README, "The OpenAI-compatible HTTP API").

    Attributes:
        max_body_bytes: the largest request body, bytes; a larger one is refused with 413
            before it is read (from its ``Content-Length``) or as soon as a chunked body
            passes it. 8 MiB holds the largest prompt the default cap admits (~1.3 MB of
            SmolLM2 text) even with every character JSON-escaped (6 bytes each).
        body_timeout_s: the whole body must arrive within this many seconds of the
            headers, else 408 (a client trickling its body holds a connection).
        header_timeout_s: a connection must complete a request's headers within this many
            seconds of opening (or of its previous response), else it is closed (slowloris).
        max_connections: HTTP connections held at once. One more first closes an idle one
            (of the peer holding the most, the longest idle), and is answered 503 and closed
            at once only when all are busy (idle connections count: each holds a file
            descriptor in the process that also serves gRPC).
        max_connections_per_peer: HTTP connections one client IP address may hold at once
            (0: no per-peer cap); one more is answered 429 and closed at once, so one peer's
            idle connections cannot take the whole ``max_connections`` from everyone else.
            Behind a reverse proxy every client has the proxy's address: raise it or use 0.
        keep_alive_s: an idle keep-alive connection is closed after this many seconds
            (uvicorn's ``timeout_keep_alive``).
        max_header_bytes: the request line and headers, bytes: over it is a 431 (or, while
            they are still arriving, h11's ``max_incomplete_event_size``: a 400).
    """

    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_connections: int = 256
    max_connections_per_peer: int = 64
    keep_alive_s: int = 5
    max_header_bytes: int = 16 * 1024


class HttpApp(Protocol):
    """What the server needs of the API it serves (`coordinator.front.http_api.OpenAIApi`): its
    limits, its bearer-token check (raises `ApiError` 401) and its ASGI app (the `Guard`)."""

    limits: HttpLimits
    asgi: Any

    def check_auth(self, authorization: str) -> Tenant: ...


class Guard:
    """The ASGI app uvicorn runs, in front of FastAPI: the bearer token is checked before
    anything is read (401), then the body is read within `HttpLimits` (413 over
    ``max_body_bytes``, refused from ``Content-Length`` before reading; 408 past
    ``body_timeout_s``) and replayed to the app. Errors are OpenAI-shaped."""

    def __init__(self, api: HttpApp, app):
        self.api = api
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            # h11 bounds only headers still arriving (max_incomplete_event_size); headers
            # that arrived in one read are bounded here.
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.api.limits.max_header_bytes:
                raise ApiError(431, f"the request line and headers are over "
                                    f"{self.api.limits.max_header_bytes} bytes",
                               code="request_header_fields_too_large")
            # Before routing and body parsing: a caller without the token learns nothing
            # about the request it sent (a malformed body is 401, not 400).
            if scope["path"] != "/health":
                scope[TENANT_SCOPE_KEY] = self.api.check_auth(headers.get("authorization", ""))
            body = await self._read_body(headers, receive)
        except ApiError as exc:
            # A refused body is left unread: the connection closes after the answer.
            await _send_error(send, exc, close=exc.status in (408, 413, 431))
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, headers: dict, receive) -> bytes | None:
        limits = self.api.limits
        too_large = ApiError(413, f"the request body is over {limits.max_body_bytes} bytes",
                             code="request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > limits.max_body_bytes:
                        raise too_large
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{limits.body_timeout_s:g} s", code="request_timeout") from None


async def _send_error(send, exc: ApiError, close: bool = False) -> None:
    data = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _protocol_class(limits: HttpLimits):
    """uvicorn's h11 protocol with the connection caps (in all and per client IP), the
    header timeout and OpenAI-shaped answers to malformed HTTP (uvicorn's own are plain
    text). Each call makes a class with its own per-peer counts: one per server."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def raw_response(status: int, reason: bytes, exc: ApiError) -> list:
        data = json.dumps(exc.body()).encode()
        return [h11.Response(status_code=status, reason=reason, headers=[
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(data)).encode())]),
                h11.Data(data=data), h11.EndOfMessage()]

    per_peer: dict[str, int] = {}  # open connections by client IP, this server's
    evicted: set = set()  # idle connections closed for room, until connection_lost

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _peer: str | None = None
        _idle_since: float = 0.0

        @property
        def busy(self) -> bool:
            """Whether a request is in progress (its headers are in, its response is not
            complete): a connection that is not busy is idle, and may be closed for room."""
            return self.cycle is not None and not self.cycle.response_complete

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            # Counted from here to connection_lost (asyncio calls it once for each).
            self._peer = peer[0] if isinstance(peer, tuple) and peer else "?"
            self._idle_since = self.loop.time()
            per_peer[self._peer] = per_peer.get(self._peer, 0) + 1
            if len(self.connections) - len(evicted) > limits.max_connections and (
                    not self._evict_idle()):
                self._refuse(503, b"Service Unavailable", unavailable(
                    f"too many connections (at most {limits.max_connections}, all busy)"))
                return
            cap = limits.max_connections_per_peer
            if cap and per_peer[self._peer] > cap:
                self._refuse(429, b"Too Many Requests", ApiError(
                    429, f"too many connections from {self._peer} (at most {cap} per client "
                         f"address)", "rate_limit_error", code="too_many_connections"))
                return
            self._arm_header_timer()

        def _evict_idle(self) -> bool:
            """Closes one idle connection to make room for this one: of the peer holding the
            most connections, the one idle longest. False when every other one is busy.

            So idle keep-alive sockets never lock a new client out: however few addresses
            hold them, a connection is refused 503 only when ``max_connections`` others are
            serving requests (docs/http-api.md)."""
            idle = [c for c in self.connections
                    if c is not self and c not in evicted and not c.busy
                    and not c.transport.is_closing()]
            if not idle:
                return False
            victim = min(idle, key=lambda c: (-per_peer.get(c._peer, 0), c._idle_since))
            evicted.add(victim)
            victim.transport.close()
            return True

        def _refuse(self, status: int, reason: bytes, exc: ApiError) -> None:
            # Answered before any request: the client reads it when it sends one.
            for event in raw_response(status, reason, exc):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s,
                                                      self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and (
                    not self.transport.is_closing()):
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()  # a request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._idle_since = self.loop.time()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            evicted.discard(self)
            if self._peer is not None:
                left = per_peer.pop(self._peer) - 1
                if left:
                    per_peer[self._peer] = left
                self._peer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            exc = ApiError(400, f"invalid HTTP request: {msg}", code="bad_request")
            for event in raw_response(400, b"Bad Request", exc):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return GuardedH11Protocol


class _Server:
    """A uvicorn server on a socket bound up front (so a busy port fails at once, and port 0
    reports the port it got), run as a task on the current event loop."""

    def __init__(self, api: HttpApp, sock: socket.socket, tls_cert: str | None,
                 tls_key: str | None):
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the process owner (Ray, specd serve) keeps them
                return contextlib.nullcontext()

        limits = api.limits
        # uvicorn's limit_concurrency stays off: it answers plain text and counts idle
        # connections with busy ones; `max_connections` caps connections instead.
        config = uvicorn.Config(api.asgi, lifespan="off", log_level="warning",
                                access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                timeout_graceful_shutdown=1, http=_protocol_class(limits),
                                timeout_keep_alive=limits.keep_alive_s,
                                h11_max_incomplete_event_size=limits.max_header_bytes)
        self.server = Server(config)
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    def busy_connections(self) -> int:
        """Connections serving a request now (the rest are idle keep-alive ones)."""
        return sum(1 for c in self.server.server_state.connections if getattr(c, "busy", 0))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task
        self.sock.close()


async def start_http_server(api: HttpApp, host: str = "127.0.0.1", port: int = 0,
                            tls_cert: str | None = None, tls_key: str | None = None
                            ) -> tuple[_Server, int]:
    """Serves ``api`` on ``host:port`` (0 picks a free port), TLS when given the PEM paths.

    Returns:
        ``(server, bound port)``; stop with ``await server.stop()``.

    Raises:
        ValueError: the address cannot be bound (another listener holds it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # A stopped server's TIME_WAIT connections must not block a restart on its port; Linux
    # allows it only when both the old and the new socket set this (a live listener on the
    # port still refuses the bind).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(128)
    sock.setblocking(False)
    server = _Server(api, sock, tls_cert, tls_key)
    await server.start()
    return server, server.port


__all__ = ["Guard", "HttpLimits", "start_http_server"]
