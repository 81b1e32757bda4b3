"""A persistent socket for a target replica's per-step calls, beside its Ray actor.

A Ray actor call costs ~1 ms round trip on a 2-core machine (measured: 935-977 us for a
method returning its 50-int argument, sync or async actor), more than a tiny model's whole
forward; a round trip over an open TCP connection costs ~80 us. So the coordinator keeps Ray
for what it is good at (placement, lifecycle, death reports) and sends each step's
``allocate`` / ``allocate_prefix`` / ``free`` / ``prefill`` / ``verify`` over one connection
per replica.

Built to face a shared network (an attacker who can see, replay and inject packets):

- **Framing.** Every frame is an 8-byte little-endian length, then that many bytes.
- **Handshake** (mutual, challenge-response; the secret never crosses the wire): on connect
  the server sends ``MAGIC || server_nonce`` (32 fresh random bytes per connection); the
  client answers ``MAGIC || client_nonce || HMAC-SHA256(secret, "specd-channel-v1 client" ||
  server_nonce || client_nonce)``; the server checks it in constant time and proves itself
  with ``HMAC-SHA256(secret, "specd-channel-v1 server" || server_nonce || client_nonce)``,
  which the client checks. A captured opening replayed on a new connection answers a nonce
  that connection never sent, so it fails. Before authentication the server reads only frames
  of exactly the handshake's size (any other length header closes the connection unread),
  within `HANDSHAKE_TIMEOUT_S` overall, and holds at most `MAX_UNAUTHENTICATED` connections in
  the handshake at once (further ones are closed at accept).
- **Frames after it** carry a message of `target_worker.step_codec` (msgpack with raw tensor
  buffers beside it: no pickle, only the step types, checked field by field) and a 32-byte tag
  ``HMAC-SHA256(session_key, direction || sequence number || message)`` with ``session_key =
  HMAC-SHA256(secret, "specd-channel-v1 session" || server_nonce || client_nonce)``: a frame
  injected, altered, replayed or reordered inside a session fails its tag and closes the
  connection. Frames are capped at ``max_frame_bytes`` (`MAX_FRAME_BYTES`).
- **TLS** (optional, ``tls=`` on both ends): the same protocol inside TLS, for
  confidentiality of token ids and rows between nodes (`target_worker.tls`).

Calls are answered in order, one at a time, on one thread per connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import step_codec
from .step_codec import WireError
from .tls import CHANNEL_HOSTNAME

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
_SEQ = struct.Struct("<Q")
#: The most bytes one frame may carry after authentication, so only a peer holding the secret
#: can make the other end allocate this much (an unchunked prefill's float32 hidden rows of
#: a large model fit: 32768 positions x 8192 = 1 GiB).
MAX_FRAME_BYTES = 1 << 30
#: Seconds a connection has to complete the handshake (TLS included) from accept.
HANDSHAKE_TIMEOUT_S = 10.0
#: Connections that may be in the handshake at once; more are closed at accept.
MAX_UNAUTHENTICATED = 16
#: Protocol name and version, first bytes of both handshake messages.
MAGIC = b"SPECDCH1"
NONCE_BYTES = 32
TAG_BYTES = 32
#: The server's hello, the client's answer and the server's proof: exact frame sizes.
SERVER_HELLO_BYTES = len(MAGIC) + NONCE_BYTES
CLIENT_HELLO_BYTES = len(MAGIC) + NONCE_BYTES + TAG_BYTES
SERVER_PROOF_BYTES = TAG_BYTES

_CLIENT_LABEL = b"specd-channel-v1 client"
_SERVER_LABEL = b"specd-channel-v1 server"
_SESSION_LABEL = b"specd-channel-v1 session"
_TO_SERVER, _TO_CLIENT = b"c", b"s"


class ChannelClosed(ConnectionError):
    """The replica's channel closed or broke (its process is gone, the connection was refused
    or reset, or a peer failed the handshake or a frame's tag): the replica cannot serve."""


def _mac(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, label + server_nonce + client_nonce, "sha256")


def _key(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise ValueError("the channel secret must be non-empty")
    return key


@dataclass
class _Session:
    """One authenticated connection's frame keys and sequence numbers."""

    key: bytes
    send_dir: bytes
    recv_dir: bytes
    sent: int = 0
    received: int = 0

    def tag(self, direction: bytes, seq: int, chunks: Iterable) -> bytes:
        h = hmac.new(self.key, direction + _SEQ.pack(seq), hashlib.sha256)
        for chunk in chunks:
            h.update(chunk)
        return h.digest()

    def seal(self, chunks: list) -> list:
        """``chunks`` as one frame: length header, the chunks, their tag."""
        size = sum(memoryview(c).nbytes for c in chunks) + TAG_BYTES
        tag = self.tag(self.send_dir, self.sent, chunks)
        self.sent += 1
        return [_LENGTH.pack(size), *chunks, tag]

    def open(self, frame: bytes | bytearray) -> memoryview:
        """The message of a received frame body (message || tag).

        Raises:
            ChannelClosed: a wrong tag (altered, injected, replayed or reordered).
        """
        view = memoryview(frame)
        if view.nbytes < TAG_BYTES:
            raise ChannelClosed("frame shorter than its tag")
        body = view[:-TAG_BYTES]
        want = self.tag(self.recv_dir, self.received, (body,))
        if not hmac.compare_digest(want, view[-TAG_BYTES:]):
            raise ChannelClosed("a frame failed its tag")
        self.received += 1
        return body


def client_answer(secret: str | bytes, hello: bytes, client_nonce: bytes | None = None
                  ) -> tuple[bytes, bytes, bytes]:
    """The client's handshake step: from the server's hello (frame body), ``(answer frame
    body, the server proof to expect, session key)``.

    Raises:
        ChannelClosed: a hello that is not this protocol's.
    """
    key = _key(secret)
    if len(hello) != SERVER_HELLO_BYTES or not hello.startswith(MAGIC):
        raise ChannelClosed("the peer is not a specd replica channel (bad hello)")
    server_nonce = bytes(hello[len(MAGIC):])
    client_nonce = client_nonce or os.urandom(NONCE_BYTES)
    answer = MAGIC + client_nonce + _mac(key, _CLIENT_LABEL, server_nonce, client_nonce)
    return (answer, _mac(key, _SERVER_LABEL, server_nonce, client_nonce),
            _mac(key, _SESSION_LABEL, server_nonce, client_nonce))


class _Refused(Exception):
    """A connection that failed the handshake (its reason for the log and stats)."""


def _read_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes from ``conn``, reading at most 1 MiB at a time (memory grows only as bytes
    arrive) and, with a ``deadline`` (`time.monotonic`), no later than it.

    Raises:
        ChannelClosed: the peer closed. TimeoutError: the deadline passed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake deadline passed")
            conn.settimeout(left)
        k = conn.recv_into(view[got:], min(n - got, 1 << 20))
        if not k:
            raise ChannelClosed("connection closed")
        got += k
    return buf


def _read_length(conn: socket.socket, deadline: float | None = None) -> int:
    return _LENGTH.unpack(_read_exact(conn, _LENGTH.size, deadline))[0]


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


class ChannelServer:
    """Serves ``handler(method, args)`` for the methods named in ``methods`` on a TCP port,
    each authenticated connection on its own daemon thread (calls through one connection run
    in order).

    Args:
        handler: runs one call; its return value (or exception) is sent back encoded by
            `target_worker.step_codec` (a value it cannot encode becomes a RuntimeError).
        methods: the method names a client may call (of `step_codec.METHODS`); any other is
            answered with ValueError.
        secret: the shared key of the handshake (str or bytes, non-empty).
        host: where to listen (port picked by the OS).
        lock: held around every handled call (shared with the actor's own Ray methods, so
            the engine sees one caller at a time).
        handshake_timeout_s: seconds a connection has to authenticate from accept.
        max_unauthenticated: connections allowed in the handshake at once.
        max_frame_bytes: the largest frame accepted after authentication.
        tls: an `ssl.SSLContext` (server side) to wrap every connection in, or None.

    Attributes:
        stats: counters (ints): ``accepted``, ``authenticated``, ``refused_busy`` (closed at
            accept: too many in the handshake), ``refused_handshake`` (wrong size, magic or
            proof, or closed early), ``handshake_timeouts``, ``bad_frames`` (an oversized
            length or a failed tag after authentication), ``bad_calls`` (not this format).

    Raises:
        OSError: the address could not be bound. ValueError: an empty secret.
    """

    def __init__(self, handler: Callable[[str, tuple], object], methods: Iterable[str],
                 secret: str | bytes, host: str = "127.0.0.1",
                 lock: threading.Lock | None = None, *,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_unauthenticated: int = MAX_UNAUTHENTICATED,
                 max_frame_bytes: int = MAX_FRAME_BYTES, tls: ssl.SSLContext | None = None):
        self.handler = handler
        self.methods = frozenset(methods)
        self._key = _key(secret)
        self._lock = lock or threading.Lock()
        self.handshake_timeout_s = handshake_timeout_s
        self.max_unauthenticated = max_unauthenticated
        self.max_frame_bytes = max_frame_bytes
        self._tls = tls
        self._pending = 0
        self._counts = threading.Lock()
        self.stats = dict.fromkeys(("accepted", "authenticated", "refused_busy",
                                    "refused_handshake", "handshake_timeouts", "bad_frames",
                                    "bad_calls"), 0)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="target-channel", daemon=True).start()

    def _count(self, key: str) -> None:
        with self._counts:
            self.stats[key] += 1

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with self._counts:
                self.stats["accepted"] += 1
                busy = self._pending >= self.max_unauthenticated
                if busy:
                    self.stats["refused_busy"] += 1
                else:
                    self._pending += 1
            if busy:
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="target-channel-conn",
                             daemon=True).start()

    def _handshake(self, conn: socket.socket) -> tuple[socket.socket, _Session]:
        """Authenticates ``conn`` (TLS first when configured) before its deadline.

        Raises:
            _Refused, TimeoutError, ChannelClosed, OSError.
        """
        deadline = time.monotonic() + self.handshake_timeout_s
        if self._tls is not None:
            conn.settimeout(self.handshake_timeout_s)
            conn = self._tls.wrap_socket(conn, server_side=True)
        server_nonce = os.urandom(NONCE_BYTES)
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        conn.sendall(_frame(MAGIC + server_nonce))
        n = _read_length(conn, deadline)
        if n != CLIENT_HELLO_BYTES:  # never read on: no buffering of what a stranger sends
            raise _Refused(f"a first frame of {n} bytes (the handshake's is "
                           f"{CLIENT_HELLO_BYTES})")
        answer = bytes(_read_exact(conn, n, deadline))
        if not answer.startswith(MAGIC):
            raise _Refused("not this protocol")
        client_nonce = answer[len(MAGIC):len(MAGIC) + NONCE_BYTES]
        want = _mac(self._key, _CLIENT_LABEL, server_nonce, client_nonce)
        if not hmac.compare_digest(want, answer[len(MAGIC) + NONCE_BYTES:]):
            raise _Refused("a wrong proof (no secret, or a replayed opening)")
        conn.sendall(_frame(_mac(self._key, _SERVER_LABEL, server_nonce, client_nonce)))
        conn.settimeout(None)
        session_key = _mac(self._key, _SESSION_LABEL, server_nonce, client_nonce)
        return conn, _Session(session_key, send_dir=_TO_CLIENT, recv_dir=_TO_SERVER)

    def _serve(self, conn: socket.socket) -> None:
        try:
            try:
                conn, session = self._handshake(conn)
            except _Refused as exc:
                self._count("refused_handshake")
                log.warning("target channel: handshake refused (%s); closed", exc)
                return
            except TimeoutError:
                self._count("handshake_timeouts")
                return
            except (ChannelClosed, OSError, ssl.SSLError):
                self._count("refused_handshake")
                return
            finally:
                with self._counts:
                    self._pending -= 1
            self._count("authenticated")
            while True:
                n = _read_length(conn)
                if not TAG_BYTES < n <= self.max_frame_bytes:
                    self._count("bad_frames")
                    log.warning("target channel: a frame of %d bytes (limit %d); closed", n,
                                self.max_frame_bytes)
                    return
                try:
                    body = session.open(_read_exact(conn, n))
                except ChannelClosed:
                    self._count("bad_frames")
                    log.warning("target channel: a frame failed its tag; closed")
                    return
                conn.sendall(b"".join(session.seal(self._answer(body))))
        except (ChannelClosed, OSError):
            return
        finally:
            conn.close()

    def _answer(self, body: memoryview) -> list:
        method = "?"
        try:
            try:
                method, args = step_codec.decode_call(body)
            except WireError as exc:
                self._count("bad_calls")
                raise ValueError(f"malformed target call: {exc}") from None
            if method not in self.methods:
                raise ValueError(f"unknown target method {method!r}")
            with self._lock:
                value = self.handler(method, args)
        except Exception as exc:  # the caller gets the exception's type (if known) and text
            return step_codec.encode_error(exc)
        try:
            return step_codec.encode_result(method, value)
        except Exception as exc:  # a result this format does not carry
            return step_codec.encode_error(RuntimeError(f"{method} failed: {exc!r}"))

    def close(self) -> None:
        self._sock.close()


class ChannelTarget:
    """The coordinator's end: a `coordinator.step.targets.Target` over a replica's channel
    (`TargetActor.open_channel`), one connection, calls one at a time in order.

    Args:
        address: ``host:port`` of the channel.
        secret: the replica's channel secret (str or bytes, non-empty).
        handle: the replica's Ray actor handle (status and lifecycle stay on Ray).
        tls: an `ssl.SSLContext` (client side, verifying the replica's certificate), or None.
        server_hostname: the name to check the replica's certificate against (TLS only;
            default `target_worker.tls.CHANNEL_HOSTNAME`).
        handshake_timeout_s: seconds to connect and authenticate.
        max_frame_bytes: the largest reply accepted.

    Raises (from every call):
        ChannelClosed: the connection could not be made, broke or failed the handshake (the
            replica did not prove it holds the secret); the replica is taken for dead
            (`coordinator.cluster.failures.is_replica_death`).
        Whatever the replica raised, as `step_codec.ERRORS` carries it (ValueError for a
            refused item, SlotsExhausted, ...).
    """

    def __init__(self, address: str, secret: str | bytes, handle=None, *,
                 tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.address = address
        self.handle = handle
        self._key = _key(secret)
        self._tls = tls
        self._server_hostname = server_hostname
        self.handshake_timeout_s = handshake_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._session: _Session | None = None
        self._lock: asyncio.Lock | None = None
        self._broken: str | None = None
        #: Between calls, a read that ends when the replica closes the connection (the
        #: replica never sends unasked); `watch` arms it.
        self._idle_read: asyncio.Future | None = None
        self._on_closed: Callable[[str], None] | None = None

    async def _read_frame(self, limit: int) -> bytes:
        (n,) = _LENGTH.unpack(await self._reader.readexactly(_LENGTH.size))
        if n > limit:
            raise ChannelClosed(f"a frame of {n} bytes (limit {limit})")
        return await self._reader.readexactly(n)

    async def _connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")
        kwargs = {}
        if self._tls is not None:
            kwargs = {"ssl": self._tls,
                      "server_hostname": self._server_hostname or CHANNEL_HOSTNAME}
        reader, writer = await asyncio.open_connection(host, int(port), **kwargs)
        self._reader, self._writer = reader, writer
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        hello = await self._read_frame(SERVER_HELLO_BYTES)
        answer, proof, session_key = client_answer(self._key, hello)
        writer.write(_frame(answer))
        if not hmac.compare_digest(await self._read_frame(SERVER_PROOF_BYTES), proof):
            raise ChannelClosed("the replica did not prove it holds the secret")
        self._session = _Session(session_key, send_dir=_TO_SERVER, recv_dir=_TO_CLIENT)

    async def watch(self, on_closed: Callable[[str], None]) -> None:
        """Connects now and, from then on, calls ``on_closed(why)`` (once, on this event
        loop) as soon as the connection is found closed between calls: the replica's process
        is gone (its kernel closed the socket), found without waiting for the next call or
        probe. A call in flight reports it itself (`ChannelClosed`).

        Raises:
            ChannelClosed: the connection could not be made.
        """
        self._on_closed = on_closed
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._broken is not None:
                raise ChannelClosed(self._broken)
            if self._session is None:
                try:
                    await asyncio.wait_for(self._connect(), self.handshake_timeout_s)
                except (OSError, EOFError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
                    self._break(f"connect: {exc!r}")
                    raise ChannelClosed(f"target channel {self.address}: {self._broken}") \
                        from exc
            self._arm_idle_read()

    def _arm_idle_read(self) -> None:
        if self._on_closed is None or self._reader is None or self._broken is not None:
            return
        self._idle_read = asyncio.ensure_future(self._reader.read(1))
        self._idle_read.add_done_callback(self._idle_read_done)

    def _idle_read_done(self, read: asyncio.Future) -> None:
        if read.cancelled() or read is not self._idle_read:
            return  # a call took the connection over
        self._idle_read = None
        exc = read.exception()
        # EOF (b""), a reset, or bytes nobody asked for: the stream is unusable either way.
        self._break(f"closed while idle: {exc!r}" if exc is not None else
                    "closed while idle" if not read.result() else "unasked bytes while idle")
        if self._on_closed is not None:
            self._on_closed(self._broken)

    async def _take_idle_read(self) -> None:
        """Stops the idle read before a call uses the connection; raises `ChannelClosed`
        when it found the connection closed."""
        read, self._idle_read = self._idle_read, None
        if read is None:
            return
        if not read.done():
            read.cancel()  # nothing read: cancelling a pending read consumes no bytes
            await asyncio.gather(read, return_exceptions=True)
            if not read.cancelled() and (read.exception() is not None or read.result()):
                self._break("the connection broke while idle")
            elif not read.cancelled():
                self._break("closed while idle")
        if self._broken is not None:
            raise ChannelClosed(f"target channel {self.address}: {self._broken}")

    async def call(self, method: str, *args):
        """Runs ``method(*args)`` on the replica and returns its result."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        message = step_codec.encode_call(method, args)  # TypeError/ValueError: ours, raised
        async with self._lock:
            if self._broken is not None:
                raise ChannelClosed(self._broken)
            await self._take_idle_read()
            try:
                if self._session is None:
                    await asyncio.wait_for(self._connect(), self.handshake_timeout_s)
                self._writer.writelines(self._session.seal(message))
                body = self._session.open(await self._read_frame(self.max_frame_bytes))
            except asyncio.CancelledError:
                # The answer may still arrive: the stream no longer lines up with calls.
                self._break("a call was cancelled mid-flight")
                raise
            except (OSError, EOFError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
                # ChannelClosed and TimeoutError are OSErrors too.
                self._break(f"{method}: {exc!r}")
                raise ChannelClosed(f"target channel {self.address}: {self._broken}") from exc
            self._arm_idle_read()
        try:
            return step_codec.decode_reply(method, body)
        except WireError as exc:
            self._break(f"{method}: a reply not in the channel's format: {exc}")
            raise ChannelClosed(f"target channel {self.address}: {self._broken}") from exc

    def _break(self, why: str) -> None:
        self._broken = why
        if self._writer is not None:
            self._writer.close()

    async def allocate(self) -> int:
        return await self.call("allocate")

    async def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        return tuple(await self.call("allocate_prefix", tokens, partition))

    async def free(self, slot: int) -> None:
        await self.call("free", slot)

    async def prefill(self, items: list) -> list:
        return await self.call("prefill", items)

    async def verify(self, items: list) -> list:
        return await self.call("verify", items)

    async def close(self) -> None:
        self._on_closed = None  # closing it ourselves is not a death
        if self._idle_read is not None:
            self._idle_read.cancel()
        if self._writer is not None:
            self._writer.close()
        self._broken = self._broken or "closed"
