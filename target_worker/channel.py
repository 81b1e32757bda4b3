"""A persistent socket for a target replica's per-step calls, beside its Ray actor.

A Ray actor call costs ~1 ms round trip on a 2-core machine (measured: 935-977 us for a
method returning its 50-int argument, sync or async actor), more than a tiny model's whole
forward; a round trip over an open TCP connection costs ~80 us. So the coordinator keeps Ray
for what it is good at (placement, lifecycle, death reports) and sends each step's
``allocate`` / ``allocate_prefix`` / ``free`` / ``prefill`` / ``verify`` over one connection
per replica.

Wire: each frame is an 8-byte little-endian length, then that many bytes. The client's first
frame is the replica's secret (compared in constant time; anything else closes the
connection unread); after it every frame is a pickled ``(method, args)`` and every answer a
pickled ``(ok, result_or_exception)``. Pickle runs only after authentication, so only the
coordinator that created the replica (and holds its secret, sent over Ray) can reach it;
it could run any code in the actor through Ray anyway. Calls are answered in order, one at a
time, on one thread per connection.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import pickle
import socket
import struct
import threading
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
#: The most bytes one frame may carry (a prefill of a full batch of long prompts fits).
MAX_FRAME_BYTES = 1 << 30


class ChannelClosed(ConnectionError):
    """The replica's channel closed or broke (its process is gone, or the connection was
    refused or reset): the replica cannot serve."""


def _read_exact(conn: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = conn.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ChannelClosed("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(conn: socket.socket) -> bytes:
    (n,) = _LENGTH.unpack(_read_exact(conn, _LENGTH.size))
    if n > MAX_FRAME_BYTES:
        raise ChannelClosed(f"frame of {n} bytes exceeds {MAX_FRAME_BYTES}")
    return _read_exact(conn, n)


def _frame(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


class ChannelServer:
    """Serves ``handler(method, args)`` for the methods named in ``methods`` on a TCP port,
    each connection on its own daemon thread (calls through one connection run in order).

    Args:
        handler: runs one call; its return value (or exception) is sent back pickled.
        methods: the method names a client may call; any other is answered with ValueError.
        secret: what a client must send first.
        host: where to listen (port picked by the OS).
        lock: held around every handled call (shared with the actor's own Ray methods, so
            the engine sees one caller at a time).

    Raises:
        OSError: the address could not be bound.
    """

    def __init__(self, handler: Callable[[str, tuple], object], methods: Iterable[str],
                 secret: str, host: str = "127.0.0.1", lock: threading.Lock | None = None):
        self.handler = handler
        self.methods = frozenset(methods)
        self._secret = secret.encode()
        self._lock = lock or threading.Lock()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self._sock.listen(8)
        self.port: int = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, name="target-channel", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name="target-channel-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                if not hmac.compare_digest(_read_frame(conn), self._secret):
                    log.warning("target channel: a client without the secret; closed")
                    return
                while True:
                    method, args = pickle.loads(_read_frame(conn))
                    conn.sendall(_frame(self._answer(method, args)))
            except (ChannelClosed, OSError):
                return

    def _answer(self, method: str, args: tuple) -> bytes:
        try:
            if method not in self.methods:
                raise ValueError(f"unknown target method {method!r}")
            with self._lock:
                reply = (True, self.handler(method, args))
        except Exception as exc:  # the caller gets the exception itself (ValueError etc.)
            reply = (False, exc)
        try:
            return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # a result or exception that does not pickle: its text
            what = exc if reply[0] else reply[1]
            return pickle.dumps((False, RuntimeError(f"{method} failed: {what!r}")))

    def close(self) -> None:
        self._sock.close()


class ChannelTarget:
    """The coordinator's end: a `coordinator.scheduler.Target` over a replica's channel
    (`TargetActor.open_channel`), one connection, calls one at a time in order.

    Args:
        address: ``host:port`` of the channel.
        secret: the replica's channel secret.
        handle: the replica's Ray actor handle (status and lifecycle stay on Ray).

    Raises (from every call):
        ChannelClosed: the connection could not be made or broke; the replica is taken
            for dead (`coordinator.router.is_replica_death`).
        Whatever the replica raised (ValueError for a refused item, SlotsExhausted, ...).
    """

    def __init__(self, address: str, secret: str, handle=None):
        self.address = address
        self.handle = handle
        self._secret = secret.encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._lock: asyncio.Lock | None = None
        self._broken: str | None = None
        #: Between calls, a read that ends when the replica closes the connection (the
        #: replica never sends unasked); `watch` arms it.
        self._idle_read: asyncio.Future | None = None
        self._on_closed: Callable[[str], None] | None = None

    async def _connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(_frame(self._secret))
        self._reader, self._writer = reader, writer

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
            if self._writer is None:
                try:
                    await self._connect()
                except OSError as exc:
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
        async with self._lock:
            if self._broken is not None:
                raise ChannelClosed(self._broken)
            await self._take_idle_read()
            try:
                if self._writer is None:
                    await self._connect()
                self._writer.write(_frame(pickle.dumps((method, args),
                                                       protocol=pickle.HIGHEST_PROTOCOL)))
                (n,) = _LENGTH.unpack(await self._reader.readexactly(_LENGTH.size))
                data = await self._reader.readexactly(n)
            except asyncio.CancelledError:
                # The answer may still arrive: the stream no longer lines up with calls.
                self._break("a call was cancelled mid-flight")
                raise
            except (OSError, EOFError, asyncio.IncompleteReadError) as exc:
                self._break(f"{method}: {exc!r}")
                raise ChannelClosed(f"target channel {self.address}: {self._broken}") from exc
            self._arm_idle_read()
        ok, value = pickle.loads(data)
        if not ok:
            raise value
        return value

    def _break(self, why: str) -> None:
        self._broken = why
        if self._writer is not None:
            self._writer.close()

    async def allocate(self) -> int:
        return await self.call("allocate")

    async def allocate_prefix(self, tokens: list[int]) -> tuple[int, int]:
        return tuple(await self.call("allocate_prefix", tokens))

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
