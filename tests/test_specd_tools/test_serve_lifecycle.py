"""`specd serve` as a process supervisor sees it, on a real embedded Ray with the tiny model:
a restart on the same ports right after a stop serves (the old server's TIME_WAIT
connections do not block it), ``kill -9`` leaves none of its processes running, and a port
taken between the start-up check and the bind is one error line naming the flag."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import grpc
import psutil
import pytest
from service_harness import MODEL, serve_process
from time_wait import closed_by_the_server, http_closed_by_the_server, time_wait_on

from specd.v1 import generation_pb2, generation_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = ("--model", MODEL, "--target-threads", "1", "--drafter", "none")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def generate(address: str) -> int:
    request = generation_pb2.GenerateRequest(max_new_tokens=3, ignore_eos=True)
    request.token_ids.ids.extend([1, 2, 3])
    with grpc.insecure_channel(address) as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).GenerateUnary(request, timeout=60)
    return len(reply.token_ids)


def alive(procs: list[psutil.Process]) -> list[str]:
    """Those of ``procs`` still running (not zombies), as ``pid name``."""
    left = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:60]}")
        except psutil.NoSuchProcess:
            pass
    return left


def test_a_restart_on_the_same_ports_right_after_a_stop_serves():
    grpc_port, http_port = free_ports(2)
    ports = ("--port", str(grpc_port), "--http-port", str(http_port))
    with serve_process(*SERVE, *ports) as (proc, address, _):
        assert generate(address) == 3
        # Connections the server closes first: TIME_WAIT on its ports once it has stopped.
        closed_by_the_server("127.0.0.1", grpc_port)
        assert http_closed_by_the_server("127.0.0.1", http_port) == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    assert time_wait_on(grpc_port) + time_wait_on(http_port) > 0  # what failed the restart
    with serve_process(*SERVE, *ports) as (proc, address, _):  # at once, on the same ports
        assert address.endswith(f":{grpc_port}")
        assert generate(address) == 3
        assert http_closed_by_the_server("127.0.0.1", http_port) == 200


def test_nothing_of_serve_outlives_its_kill_9():
    with serve_process(*SERVE, new_session=True) as (proc, address, _):
        assert generate(address) == 3
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        # The raylet's agents are what outlived it before; they must be in the tree.
        assert "DashboardAgent" in names and "RuntimeEnvAgent" in names, names
        try:
            proc.kill()
            proc.wait()
            deadline = time.monotonic() + 10
            while (left := alive(tree)) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the process table with a deadline
            assert not left, f"{len(left)} of {len(tree)} processes outlived kill -9: {left}"
        finally:
            for p in tree:  # this test's own processes, by PID (psutil checks it is the same)
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass


#: `specd serve` whose start-up port check passes whatever the port: the port is then found
#: taken only when the coordinator actor binds it, inside Ray.
LATE_BIND = """
import sys
import coordinator.cluster.service
coordinator.cluster.service.check_port_free = lambda *args, **kwargs: None
from specd_tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("flag", ["--port", "--http-port"])
def test_a_port_taken_after_the_check_is_one_error_line_naming_the_flag(flag):
    ray_tmp = tempfile.mkdtemp(prefix="specd-lb-")  # Ray's socket paths stay short
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        other = ["--http-port", "0"] if flag == "--port" else ["--port", "0"]
        run = subprocess.run(
            [sys.executable, "-c", LATE_BIND, "serve", *SERVE, *other, flag, str(port)],
            capture_output=True, text=True, timeout=600, cwd=ROOT,
            env={**os.environ, "RAY_TMPDIR": ray_tmp}, start_new_session=True)
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"specd: error: {flag}: cannot listen on 127.0.0.1:{port}"), \
        run.stderr[-3000:]
    assert "Traceback" not in run.stderr and "RayTaskError" not in run.stderr, \
        run.stderr[-3000:]
