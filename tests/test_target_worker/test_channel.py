"""The replica's step channel: calls reach the engine and come back (exceptions as raised),
only a client holding the secret is served, and it stands up to a peer on the network: a
replayed opening fails, a pickle never runs, a huge length header before authentication is
refused unread, and idle strangers are capped and timed out."""

from __future__ import annotations

import asyncio
import os
import pickle
import socket
import threading
import time

import pytest
from polling import wait_until

from coordinator.cluster.failures import is_replica_death
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem
from target_worker.actor import TargetActor
from target_worker.channel import (
    _LENGTH,
    _TO_CLIENT,
    _TO_SERVER,
    CLIENT_HELLO_BYTES,
    SERVER_HELLO_BYTES,
    ChannelClosed,
    ChannelServer,
    ChannelTarget,
    _frame,
    _Session,
    client_answer,
)
from target_worker.engine import SlotsExhausted, TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_frame(sock: socket.socket) -> bytes:
    (n,) = _LENGTH.unpack(recv_exact(sock, _LENGTH.size))
    return recv_exact(sock, n)


def closed_by_peer(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """True when the peer closes (EOF or reset) within ``timeout_s``, discarding any data."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def raw_session(port: int, secret: str) -> tuple[socket.socket, _Session]:
    """A hand-made client connection through the real handshake (an attacker who holds the
    secret, at worst)."""
    sock = socket.create_connection(("127.0.0.1", port))
    answer, proof, key = client_answer(secret, read_frame(sock))
    sock.sendall(_frame(answer))
    assert read_frame(sock) == proof
    return sock, _Session(key, send_dir=_TO_SERVER, recv_dir=_TO_CLIENT)


@pytest.fixture(scope="module")
def actor():
    return TargetActor(MODEL, max_slots=1, num_threads=1)


def test_steps_over_the_channel_equal_the_engines_own(actor):
    address = actor.open_channel("127.0.0.1", "s3cret")
    assert actor.open_channel("127.0.0.1", "s3cret") == address  # idempotent
    reference = TargetEngine(load_model(MODEL)[0], max_slots=1)

    async def steps(target):
        slot = await target.allocate()
        first = await target.prefill([PrefillItem(slot=slot, tokens=[5, 6, 7, 8],
                                                  sampling=SamplingParams(), want_hidden=True)])
        out = await target.verify([VerifyItem(slot=slot, start_pos=4, tokens=[9, 5, 6],
                                              sampling=SamplingParams())])
        sampled = await target.verify([VerifyItem(slot=slot, start_pos=5, tokens=[7, 8],
                                                  sampling=SamplingParams(temperature=0.8))])
        with pytest.raises(SlotsExhausted):  # the engine's own exception type comes back
            await target.allocate()
        with pytest.raises(ValueError, match="slot"):  # so does a refused item
            await target.verify([VerifyItem(slot=slot + 7, start_pos=0, tokens=[1],
                                            sampling=SamplingParams())])
        await target.free(slot)
        return (first[0].rows.argmax, first[0].hidden, out[0].rows.argmax,
                sampled[0].rows.to_dense() if hasattr(sampled[0].rows, "to_dense")
                else sampled[0].rows.probs)

    from coordinator.step.targets import LocalTarget

    async def both():
        channel = ChannelTarget(address, "s3cret")
        try:
            return await steps(channel), await steps(LocalTarget(reference))
        finally:
            await channel.close()

    over_channel, local = asyncio.run(both())
    assert over_channel[0] == local[0] and over_channel[2] == local[2]
    assert over_channel[1].equal(local[1]) and over_channel[3].equal(local[3])


def test_allocate_prefix_over_the_channel_looks_up_its_partition_only(actor):
    address = actor.open_channel("127.0.0.1", "s3cret")
    prompt = [11, 12, 13, 14, 15, 16]

    async def go():
        channel = ChannelTarget(address, "s3cret")
        try:
            slot, reused = await channel.allocate_prefix(prompt, "tenant-a")
            assert reused == 0
            await channel.prefill([PrefillItem(slot=slot, tokens=prompt,
                                               sampling=SamplingParams())])
            await channel.free(slot)  # warm in "tenant-a"
            seen = []
            for partition in ("tenant-b", "", "tenant-a"):
                slot, reused = await channel.allocate_prefix(prompt + [17], partition)
                seen.append(reused)
                await channel.free(slot)
            return seen
        finally:
            await channel.close()

    assert asyncio.run(go()) == [0, 0, len(prompt)]
    stats = actor.status()["stats"]
    assert stats["warm_positions"] >= len(prompt) and stats["warm_bytes"] > 0


def test_a_client_without_the_secret_is_closed_unread():
    calls = []
    server = ChannelServer(lambda m, a: calls.append(m) or 0, ["allocate"], "right")
    try:
        async def go(secret):
            target = ChannelTarget(f"127.0.0.1:{server.port}", secret)
            try:
                return await target.allocate()
            finally:
                await target.close()

        with pytest.raises(ChannelClosed) as info:
            asyncio.run(go("wrong"))
        assert is_replica_death(info.value)
        assert calls == [] and server.stats["refused_handshake"] == 1
        assert asyncio.run(go("right")) == 0 and calls == ["allocate"]
    finally:
        server.close()


def test_a_client_refuses_a_server_without_the_secret():
    impostor = ChannelServer(lambda m, a: 0, ["allocate"], "not-the-secret")
    try:
        async def go():
            target = ChannelTarget(f"127.0.0.1:{impostor.port}", "the-secret")
            await target.allocate()

        with pytest.raises(ChannelClosed):
            asyncio.run(go())
    finally:
        impostor.close()


class RecordingProxy:
    """A TCP relay to ``port`` that records what clients send (a sniffer on the path)."""

    def __init__(self, port: int):
        self.sent = bytearray()
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port = self._listen.getsockname()[1]
        self._target = port
        threading.Thread(target=self._run, daemon=True).start()

    def _pump(self, src, dst, record):
        try:
            while chunk := src.recv(1 << 16):
                if record:
                    self.sent += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            dst.close()

    def _run(self):
        client, _ = self._listen.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target))
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()
        self._pump(client, upstream, True)

    def close(self):
        self._listen.close()


def test_a_replayed_connection_opening_fails():
    calls = []
    server = ChannelServer(lambda m, a: calls.append(m) or 7, ["allocate"], "k" * 32)
    proxy = RecordingProxy(server.port)
    try:
        async def legit():
            target = ChannelTarget(f"127.0.0.1:{proxy.port}", "k" * 32)
            try:
                return await target.allocate()
            finally:
                await target.close()

        assert asyncio.run(legit()) == 7 and calls == ["allocate"]
        captured = bytes(wait_until(lambda: len(proxy.sent) > _LENGTH.size + CLIENT_HELLO_BYTES
                                    and proxy.sent, timeout_s=10.0,
                                    what="the captured opening"))
        assert captured[:_LENGTH.size] == _LENGTH.pack(CLIENT_HELLO_BYTES)
        # Replayed on a new connection: the server's fresh nonce makes the proof stale.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            hello = read_frame(raw)
            assert len(hello) == SERVER_HELLO_BYTES
            raw.sendall(captured)
            assert closed_by_peer(raw)
        assert calls == ["allocate"]  # the replayed call never ran
        wait_until(lambda: server.stats["refused_handshake"] == 1, timeout_s=10.0,
                   what="the refusal")
        assert server.stats["authenticated"] == 1
    finally:
        proxy.close()
        server.close()


class RunsACommand:
    """Unpickling this runs ``touch PATH``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_a_pickle_that_would_run_a_command_is_refused(tmp_path):
    marker = tmp_path / "ran"
    evil = pickle.dumps(("allocate", (RunsACommand(marker),)))
    calls = []
    server = ChannelServer(lambda m, a: calls.append(m) or 3, ["allocate"], "secret")
    try:
        # Before authentication: as the opening (any size, or padded to the handshake's).
        for opening in (evil, evil.ljust(CLIENT_HELLO_BYTES)[:CLIENT_HELLO_BYTES]):
            with socket.create_connection(("127.0.0.1", server.port)) as raw:
                read_frame(raw)
                raw.sendall(_frame(opening))
                assert closed_by_peer(raw)
        # After authentication, with a valid tag (a peer holding the secret): still data only.
        sock, session = raw_session(server.port, "secret")
        with sock:
            sock.sendall(b"".join(session.seal([evil])))
            reply = session.open(read_frame(sock))
            from target_worker.step_codec import decode_reply

            with pytest.raises(ValueError, match="malformed target call"):
                decode_reply("allocate", reply)
            # The connection still serves well-formed calls.
            from target_worker.step_codec import encode_call

            sock.sendall(b"".join(session.seal(encode_call("allocate", ()))))
            assert decode_reply("allocate", session.open(read_frame(sock))) == 3
        assert not marker.exists() and calls == ["allocate"]
        assert server.stats["bad_calls"] == 1
    finally:
        server.close()


def test_a_replica_answering_with_a_pickle_is_dropped_and_nothing_runs(tmp_path):
    """The client side too: a reply is decoded as data, never unpickled."""
    marker = tmp_path / "ran"
    listener = socket.create_server(("127.0.0.1", 0))

    def evil_replica():
        import hmac as _hmac

        from target_worker.channel import _CLIENT_LABEL, _SERVER_LABEL, _SESSION_LABEL, MAGIC

        conn, _ = listener.accept()
        with conn:
            nonce = os.urandom(32)
            conn.sendall(_frame(MAGIC + nonce))
            answer = read_frame(conn)
            cnonce = answer[len(MAGIC):len(MAGIC) + 32]
            mac = lambda label: _hmac.digest(b"s", label + nonce + cnonce, "sha256")  # noqa
            assert answer[len(MAGIC) + 32:] == mac(_CLIENT_LABEL)
            conn.sendall(_frame(mac(_SERVER_LABEL)))
            session = _Session(mac(_SESSION_LABEL), send_dir=_TO_CLIENT, recv_dir=_TO_SERVER)
            session.open(read_frame(conn))
            conn.sendall(b"".join(session.seal([pickle.dumps((True, RunsACommand(marker)))])))
            conn.recv(1)

    thread = threading.Thread(target=evil_replica, daemon=True)
    thread.start()

    async def go():
        target = ChannelTarget(f"127.0.0.1:{listener.getsockname()[1]}", "s")
        try:
            await target.allocate()
        finally:
            await target.close()

    with pytest.raises(ChannelClosed, match="format"):
        asyncio.run(go())
    thread.join(5)
    listener.close()
    assert not marker.exists()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_1gib_length_header_before_auth_is_refused_without_buffering():
    server = ChannelServer(lambda m, a: 0, ["allocate"], "secret")
    try:
        before = _rss_bytes()
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            read_frame(raw)
            raw.sendall(_LENGTH.pack(1 << 30))
            wait_until(lambda: server.stats["refused_handshake"] == 1, timeout_s=10.0,
                   what="the refusal")
            # The server closed without reading on: the bytes that follow are refused.
            with pytest.raises((BrokenPipeError, ConnectionResetError)):
                for _ in range(64):  # up to 64 MiB
                    raw.sendall(b"\0" * (1 << 20))
        assert _rss_bytes() - before < 16 << 20
        assert server.stats["authenticated"] == 0
    finally:
        server.close()


def test_an_oversized_frame_after_auth_closes_the_connection():
    server = ChannelServer(lambda m, a: 0, ["allocate"], "secret", max_frame_bytes=1 << 16)
    try:
        sock, _ = raw_session(server.port, "secret")
        with sock:
            sock.sendall(_LENGTH.pack(1 << 30))
            assert closed_by_peer(sock)
        assert server.stats["bad_frames"] == 1
    finally:
        server.close()


def test_a_tampered_frame_closes_the_connection():
    calls = []
    server = ChannelServer(lambda m, a: calls.append(m) or 0, ["allocate"], "secret")
    try:
        from target_worker.step_codec import encode_call

        sock, session = raw_session(server.port, "secret")
        with sock:
            frame = bytearray(b"".join(session.seal(encode_call("allocate", ()))))
            frame[_LENGTH.size + 2] ^= 1  # a flipped bit in the message
            sock.sendall(frame)
            assert closed_by_peer(sock)
        assert calls == [] and server.stats["bad_frames"] == 1
    finally:
        server.close()


def test_idle_unauthenticated_connections_are_capped_and_timed_out():
    server = ChannelServer(lambda m, a: 0, ["allocate"], "secret", handshake_timeout_s=1.0,
                           max_unauthenticated=4)
    threads_before = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(10)]
    try:
        wait_until(lambda: server.stats["accepted"] == 10, timeout_s=10.0, what="10 accepts")
        assert server.stats["refused_busy"] == 6
        assert threading.active_count() <= threads_before + 4
        began = time.monotonic()
        hellos = 0
        for s in socks:
            s.settimeout(5)
            data = b""
            try:
                while chunk := s.recv(1 << 16):
                    data += chunk
            except ConnectionResetError:
                pass
            hellos += len(data) == _LENGTH.size + SERVER_HELLO_BYTES
        # 4 got a hello and were closed at the handshake deadline, 6 were closed at accept.
        assert hellos == 4 and time.monotonic() - began < 4.0
        wait_until(lambda: server.stats["handshake_timeouts"] == 4, timeout_s=10.0,
                   what="4 timeouts")

        async def legit():  # capacity is back
            target = ChannelTarget(f"127.0.0.1:{server.port}", "secret")
            try:
                return await target.allocate()
            finally:
                await target.close()

        assert asyncio.run(legit()) == 0
    finally:
        for s in socks:
            s.close()
        server.close()


def test_an_unknown_method_is_refused_and_a_closed_replica_reads_as_dead():
    server = ChannelServer(lambda m, a: 5, ["allocate"], "k")

    async def go():
        target = ChannelTarget(f"127.0.0.1:{server.port}", "k")
        with pytest.raises(ValueError, match="unknown target method 'shutdown'"):
            await target.call("shutdown")
        with pytest.raises(ValueError, match="unknown target method 'free'"):
            await target.free(1)  # known to the format, not served by this server
        assert await target.allocate() == 5
        server.close()
        await target.close()
        with pytest.raises(ChannelClosed):
            await target.allocate()

    asyncio.run(go())
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]

    async def refused():
        await ChannelTarget(f"127.0.0.1:{free}", "k").allocate()

    with pytest.raises(ChannelClosed) as info:
        asyncio.run(refused())
    assert is_replica_death(info.value)


def test_tls_carries_the_same_calls_and_refuses_a_wrong_certificate():
    pytest.importorskip("cryptography")
    from target_worker.tls import client_context, generate_certificate, server_context

    cert, key = generate_certificate()
    other, _ = generate_certificate()
    server = ChannelServer(lambda m, a: 4, ["allocate"], "secret",
                           tls=server_context(cert, key))
    try:
        async def go(trusted):
            target = ChannelTarget(f"127.0.0.1:{server.port}", "secret",
                                   tls=client_context(trusted))
            try:
                return await target.allocate()
            finally:
                await target.close()

        assert asyncio.run(go(cert)) == 4
        with pytest.raises(ChannelClosed):
            asyncio.run(go(other))
        # A plaintext client gets nowhere either.
        with socket.create_connection(("127.0.0.1", server.port)) as raw:
            raw.sendall(_frame(b"x" * CLIENT_HELLO_BYTES))
            assert closed_by_peer(raw)
    finally:
        server.close()


def test_a_replica_serves_tls_with_a_key_of_its_own():
    pytest.importorskip("cryptography")
    from target_worker.tls import client_context

    replica = TargetActor(MODEL, max_slots=1, num_threads=1)
    address = replica.open_channel("127.0.0.1", "s3cret", tls=True)
    cert = replica.channel_certificate()
    assert cert.startswith(b"-----BEGIN CERTIFICATE-----") and b"PRIVATE" not in cert

    async def go():
        target = ChannelTarget(address, "s3cret", tls=client_context(cert))
        try:
            slot = await target.allocate()
            await target.free(slot)
            return slot
        finally:
            await target.close()

    assert asyncio.run(go()) == 0
    replica._channel.close()
