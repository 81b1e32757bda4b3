"""Least exposure: the drafter API takes only callers holding the service's secret, bounds what
it holds (history length, ids, idle time), and the embedded service listens on loopback only."""

from __future__ import annotations

import asyncio
import os
import re
import select
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_worker.client import DrafterClient, DrafterUnavailable, ProposeJob
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.server import (
    SECRET_ENV,
    SECRET_METADATA_KEY,
    DrafterServicer,
    start_drafter_server,
)
from drafter_worker.sessions import ProposeRefused, SessionLimits
from specd.v1 import drafter_pb2, drafter_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-random:vocab=64,seed=0,layers=2"
SECRET = "correct horse battery staple"
_SAFETY_S = 60  # guards against a hung call; never reached by a passing test


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, _SAFETY_S))


def lookup() -> PromptLookupSpeculator:
    return PromptLookupSpeculator(ngram_size=2, max_draft_len=4)


def item(rid: str, append: list[int], known: int = 0) -> drafter_pb2.ProposeItem:
    return drafter_pb2.ProposeItem(request_id=rid, known=known, append=append, max_len=4)


# --- the shared secret ------------------------------------------------------------------------


def test_drafter_with_a_secret_refuses_callers_without_it():
    history = [1, 2, 3, 1, 2, 3, 1]

    async def main():
        server, port = await start_drafter_server(lookup(), secret=SECRET)
        address = f"127.0.0.1:{port}"
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = drafter_pb2_grpc.DrafterStub(channel)
                calls = {
                    "Propose": lambda md: stub.Propose(
                        drafter_pb2.ProposeRequest(items=[item("r", history)]), metadata=md),
                    "Release": lambda md: stub.Release(
                        drafter_pb2.ReleaseRequest(request_ids=["r"]), metadata=md),
                    "Info": lambda md: stub.Info(drafter_pb2.InfoRequest(), metadata=md),
                }
                for name, call in calls.items():
                    for metadata in (None, ((SECRET_METADATA_KEY, "wrong"),),
                                     (("authorization", f"Bearer {SECRET}"),)):
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await call(metadata)
                        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                # Health stays open to probes.
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest())
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            async with DrafterClient(address, timeout_s=5) as anonymous:
                with pytest.raises(DrafterUnavailable, match="UNAUTHENTICATED"):
                    await anonymous.propose([ProposeJob("r", history, 4)])
            async with DrafterClient(address, timeout_s=5, secret=SECRET) as client:
                (block,) = await client.propose([ProposeJob("r", history, 4)])
                assert block == lookup().propose(history, None, 4) and len(block) > 0
                assert (await client.info()).max_draft_len == 4
                await client.release(["r"])
        finally:
            await server.stop(None)

    run(main())


def test_drafter_without_a_secret_binds_loopback_only():
    async def main():
        with pytest.raises(ValueError, match="only with a secret"):
            await start_drafter_server(lookup(), host="0.0.0.0")
        server, _ = await start_drafter_server(lookup(), host="0.0.0.0", secret=SECRET)
        await server.stop(None)

    run(main())


def test_module_entry_point_takes_its_secret_from_the_environment():
    proc = subprocess.Popen(
        [sys.executable, "-m", "drafter_worker", "--port", "0"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, SECRET_ENV: SECRET},
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], _SAFETY_S)
        assert ready, "no listening line"
        match = re.fullmatch(r"drafter listening on 127\.0\.0\.1:(\d+)\n", proc.stdout.readline())
        assert match

        async def ask(secret):
            async with DrafterClient(f"127.0.0.1:{match.group(1)}", timeout_s=10,
                                     secret=secret) as client:
                return await client.info()

        assert run(ask(SECRET)).name == "SuffixDrafter"  # the default, suffix+lookup
        with pytest.raises(DrafterUnavailable, match="UNAUTHENTICATED"):
            run(ask(None))
    finally:
        proc.terminate()
        proc.wait(timeout=_SAFETY_S)
        proc.stdout.close()
        proc.stderr.close()
    # Without a secret a non-loopback host is refused before anything listens.
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    done = subprocess.run([sys.executable, "-m", "drafter_worker", "--port", "0", "--host",
                           "0.0.0.0"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=_SAFETY_S)
    assert done.returncode == 1 and SECRET_ENV in done.stderr


# --- bounded state ----------------------------------------------------------------------------


def test_history_longer_than_max_history_is_refused_naming_the_field():
    servicer = DrafterServicer(lookup(), SessionLimits(max_history=16))
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("a", [1, 2, 3] * 3)]))
    assert servicer.history("a") == [1, 2, 3] * 3
    # The second item would grow "a" to 17 tokens: the whole call is refused, nothing applied.
    refused = drafter_pb2.ProposeRequest(items=[item("b", [4, 5]), item("a", [1] * 8, known=9)])
    with pytest.raises(ProposeRefused, match=r"items\[1\]\.append.*17 tokens.*max_history 16"):
        servicer.propose_batch(refused)
    assert servicer.history("a") == [1, 2, 3] * 3 and servicer.history("b") is None
    # Exactly at the cap is fine.
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("a", [1] * 7, known=9)]))
    assert len(servicer.history("a")) == 16

    async def main():  # over gRPC: INVALID_ARGUMENT with the same message
        server, port = await start_drafter_server(lookup(), secret=SECRET,
                                                  limits=SessionLimits(max_history=16))
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await drafter_pb2_grpc.DrafterStub(channel).Propose(
                        drafter_pb2.ProposeRequest(items=[item("x", [7] * 17)]),
                        metadata=((SECRET_METADATA_KEY, SECRET),))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "items[0].append" in err.value.details()
        finally:
            await server.stop(None)

    run(main())


def test_ids_past_max_sessions_forget_the_least_recently_used():
    servicer = DrafterServicer(lookup(), SessionLimits(max_sessions=3))
    for rid in ("a", "b", "c"):
        servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item(rid, [1, 2, 1])]))
    # "a" is used again, so "b" is now the least recently used.
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("a", [2], known=3)]))
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("d", [3, 3])]))
    assert len(servicer) == 3
    assert servicer.history("b") is None
    assert servicer.history("a") == [1, 2, 1, 2]
    # The forgotten id's caller resyncs (its `known` no longer matches) and carries on.
    reply = servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("b", [2], known=3)]))
    assert reply.results[0].resync


def test_idle_ids_expire_after_idle_timeout():
    now = [1000.0]
    servicer = DrafterServicer(lookup(), SessionLimits(idle_timeout_s=60.0),
                               clock=lambda: now[0])
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("old", [1, 2, 1])]))
    now[0] += 45
    servicer.propose_batch(drafter_pb2.ProposeRequest(items=[item("new", [1, 2, 1])]))
    now[0] += 15  # "old" idle exactly 60 s: kept
    assert servicer.expire_idle() == [] and len(servicer) == 2
    now[0] += 1
    assert servicer.expire_idle() == ["old"]
    assert servicer.history("old") is None and servicer.history("new") == [1, 2, 1]
    # Any call sweeps: a Release of an unrelated id expires "new" once it is idle too.
    now[0] += 60
    servicer.release_ids(["unknown"])
    assert len(servicer) == 0


def test_session_limits_are_validated():
    for bad in ({"max_history": 0}, {"max_sessions": -1}, {"idle_timeout_s": 0.0},
                {"max_history": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SessionLimits(**bad)


def test_an_unauthenticated_message_is_refused_before_it_is_received():
    """A 60 MB Propose without the secret is refused without the drafter receiving or
    parsing it: the worker's peak resident memory barely moves (before: +~180 MB, gRPC read
    and deserialized the whole message, then the interceptor's handler refused it)."""

    def peak_mb(pid: int) -> float:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024

    proc = subprocess.Popen([sys.executable, "-m", "drafter_worker", "--port", "0"],
                            env={**os.environ, SECRET_ENV: SECRET}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], _SAFETY_S)
        assert ready, "the drafter did not start"
        address = proc.stdout.readline().rsplit(" ", 1)[1].strip()
        before = peak_mb(proc.pid)
        big = drafter_pb2.ProposeRequest(items=[drafter_pb2.ProposeItem(
            request_id="x" * (60 * 2**20))])
        with grpc.insecure_channel(address, options=[
                ("grpc.max_send_message_length", 100 * 2**20)]) as channel:
            with pytest.raises(grpc.RpcError) as err:
                drafter_pb2_grpc.DrafterStub(channel).Propose(big, timeout=_SAFETY_S)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert peak_mb(proc.pid) - before < 30
    finally:
        proc.kill()
        proc.wait()


def test_drafter_over_tls_serves_a_client_trusting_its_certificate_only():
    pytest.importorskip("cryptography")
    from target_worker.tls import CHANNEL_HOSTNAME, generate_certificate

    cert, key = generate_certificate()
    other, _ = generate_certificate()
    history = [1, 2, 3, 1, 2, 3, 1]

    async def main():
        server, port = await start_drafter_server(lookup(), host="127.0.0.1", secret=SECRET,
                                                  tls=(cert, key))
        address = f"127.0.0.1:{port}"
        try:
            trusted = grpc.ssl_channel_credentials(root_certificates=cert)
            async with DrafterClient(address, timeout_s=5, secret=SECRET,
                                     channel_credentials=trusted,
                                     tls_server_name=CHANNEL_HOSTNAME) as client:
                (block,) = await client.propose([ProposeJob("r", history, 4)])
                assert block == lookup().propose(history, None, 4) and len(block) > 0
            for credentials in (grpc.ssl_channel_credentials(root_certificates=other), None):
                async with DrafterClient(address, timeout_s=5, secret=SECRET,
                                         channel_credentials=credentials,
                                         tls_server_name=CHANNEL_HOSTNAME) as client:
                    with pytest.raises(DrafterUnavailable):  # wrong certificate / plaintext
                        await client.propose([ProposeJob("r", history, 4)])
        finally:
            await server.stop(None)

    run(main())
