"""The embedded service's exposure and shutdown, on a real embedded Ray with the tiny model: every
port it and Ray open is on loopback, its drafter refuses callers without the secret, and SIGTERM
on ``specd serve`` drains in-flight streams."""

from __future__ import annotations

import ipaddress
import os
import signal
import threading
import time

import grpc
import psutil
import pytest
from service_harness import MODEL, serve_process

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from specd.v1 import drafter_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc


def listening_sockets(root: psutil.Process) -> list[tuple[str, int, int, str]]:
    """``(ip, port, pid, name)`` of every listening TCP socket of ``root`` and its
    descendants (only the processes this test started: nobody else's Ray)."""
    rows = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline()[:2])[-60:]
            for conn in proc.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    rows.append((conn.laddr.ip, conn.laddr.port, proc.pid, name))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass  # ended meanwhile
    return rows


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if address.version == 6 and address.ipv4_mapped is not None:  # ::ffff:127.0.0.1
        address = address.ipv4_mapped
    return address.is_loopback


@pytest.fixture(scope="module")
def embedded():
    import ray

    if ray.is_initialized():  # the processes to inspect must be this test's own
        pytest.skip("Ray already runs in this process: the embedded start would join it")
    svc = Service(ServiceConfig(model=MODEL, port=0, ngram_size=2, max_draft_len=4,
                                target_threads=1, drafter_timeout_s=5.0))
    svc.start()
    yield svc
    svc.stop()


def test_embedded_service_listens_on_loopback_only(embedded):
    with grpc.insecure_channel(embedded.address) as channel:  # everything is up and serving
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(max_new_tokens=4, ignore_eos=True)
        request.token_ids.ids.extend([1, 2, 3, 1, 2])
        assert len(stub.GenerateUnary(request, timeout=120).token_ids) == 4
    rows = listening_sockets(psutil.Process())
    # The API, the drafter, Ray's GCS and raylet at least.
    assert len({pid for _, _, pid, _ in rows}) >= 4, rows
    exposed = [row for row in rows if not is_loopback(row[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_embedded_drafter_refuses_calls_without_the_secret(embedded):
    (drafter,) = embedded.status()["drafters"]
    with grpc.insecure_channel(drafter["address"]) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for call, request in ((stub.Info, drafter_pb2.InfoRequest()),
                              (stub.Propose, drafter_pb2.ProposeRequest(items=[
                                  drafter_pb2.ProposeItem(request_id="x", append=[1] * 10**6,
                                                          max_len=4)])),
                              (stub.Release, drafter_pb2.ReleaseRequest(request_ids=["x"]))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # ... while the coordinator, which holds it, drafts: drafts were verified and accepted.
    with grpc.insecure_channel(embedded.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = generation_pb2.GenerateRequest(max_new_tokens=24, ignore_eos=True)
        request.token_ids.ids.extend([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])
        stub.GenerateUnary(request, timeout=120)
    (drafter,) = embedded.status()["drafters"]
    assert drafter["calls"] > 0 and drafter["errors"] == 0


def test_sigterm_drains_in_flight_streams_and_refuses_new_calls():
    # Its own `specd serve` and Ray. A deeper tiny model keeps the stream going for seconds.
    with serve_process("--drafter", "none", "--model", "tiny-random:vocab=64,seed=0,layers=24",
                       "--target-threads", "1", "--shutdown-grace", "120") as (proc, address, _):
        request = generation_pb2.GenerateRequest(max_new_tokens=250, ignore_eos=True)
        request.token_ids.ids.extend([1, 2, 3])
        started, chunks, outcome = threading.Event(), [], {}

        def stream():
            with grpc.insecure_channel(address) as channel:
                try:
                    for chunk in generation_pb2_grpc.GenerationStub(channel).Generate(
                            request, timeout=300):
                        chunks.append(chunk)
                        started.set()
                    outcome["ok"] = True
                except grpc.RpcError as exc:
                    outcome["error"] = exc.code()
                finally:
                    started.set()

        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        assert started.wait(120)
        proc.send_signal(signal.SIGTERM)
        # New calls are refused while the stream drains.
        probe = generation_pb2.GenerateRequest(max_new_tokens=1, ignore_eos=True)
        probe.token_ids.ids.extend([1])
        refused = None
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            while refused is None and time.monotonic() < deadline:
                try:
                    stub.GenerateUnary(probe, timeout=30)
                except grpc.RpcError as exc:
                    refused = (exc.code(), reader.is_alive())
        assert refused == (grpc.StatusCode.UNAVAILABLE, True), refused
        reader.join(timeout=300)
        assert outcome == {"ok": True}, outcome
        assert sum(len(c.token_ids) for c in chunks) == 250
        assert chunks[-1].finish_reason == "length"
        assert proc.wait(timeout=120) == 0


def test_serve_exits_nonzero_when_its_coordinator_dies():
    # The coordinator is not replicated: `specd serve` must not keep serving a dead address,
    # so a process supervisor can restart it. Its own serve and Ray, as above.
    with serve_process("--drafter", "none", "--model", MODEL, "--target-threads", "1",
                       "--shutdown-grace", "0") as (proc, address, _):
        port = int(address.rsplit(":", 1)[1])
        # The coordinator actor is the process of this serve's tree listening on the API port.
        owners = {pid for ip, p, pid, _ in listening_sockets(psutil.Process(proc.pid))
                  if p == port}
        assert len(owners) == 1, owners
        os.kill(owners.pop(), signal.SIGKILL)
        output = proc.communicate(timeout=120)[0]
        assert proc.returncode == 1, output[-2000:]
        assert "the coordinator actor died" in output
