"""The embedded service's Ray (`coordinator.cluster.service.init_embedded_ray`) is always its own:
neither a stale ``ray_current_cluster`` file (left by a ``ray start`` head stopped by PID)
nor a live ``ray start`` head on the same machine makes it attach elsewhere.

Each case runs the embedded start in a subprocess whose Ray temp dir (``RAY_TMPDIR``, where
Ray looks for ``ray/ray_current_cluster``) is a directory this test owns, so the real
``/tmp/ray`` is never read or written; the head this test starts is stopped by its own PIDs.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Starts the embedded Ray, prints the GCS address it runs, shuts it down.
EMBEDDED = """
import ray
from coordinator.cluster.service import init_embedded_ray
init_embedded_ray()
print("GCS", ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


@pytest.fixture
def ray_tmp():
    """A short private Ray temp dir (Ray's socket paths must stay under 107 bytes)."""
    tmp = tempfile.mkdtemp(prefix="specd-rt-")
    yield Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _env(ray_tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=f"{ROOT}{os.pathsep}"
               f"{env.get('PYTHONPATH', '')}", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_USAGE_STATS_ENABLED="0")
    return env


def _embedded_gcs(ray_tmp: Path) -> str:
    """Runs the embedded start; returns the GCS address it ran (fails the test if it could
    not start)."""
    proc = subprocess.run([sys.executable, "-c", EMBEDDED], env=_env(ray_tmp), cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("GCS ")]
    assert proc.returncode == 0 and lines, proc.stdout + proc.stderr
    return lines[0].split()[1]


def test_a_stale_cluster_file_is_ignored(ray_tmp):
    cluster_file = ray_tmp / "ray" / "ray_current_cluster"
    cluster_file.parent.mkdir()
    cluster_file.write_text("127.0.0.1:9")  # a head that is gone (discard port: nobody)
    gcs = _embedded_gcs(ray_tmp)
    assert gcs.startswith("127.0.0.1:") and gcs != "127.0.0.1:9"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_live_ray_start_head_is_not_joined(ray_tmp):
    port = _free_port()
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
         "--port", str(port), "--node-ip-address", "127.0.0.1", "--num-cpus", "1",
         "--include-dashboard", "false", "--disable-usage-stats"],
        env=_env(ray_tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster_file = ray_tmp / "ray" / "ray_current_cluster"
    family: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not cluster_file.exists() and head.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster_file.exists(), "the ray start head did not come up"
        family = psutil.Process(head.pid).children(recursive=True)
        head_address = cluster_file.read_text().strip()
        assert head_address.endswith(f":{port}")
        gcs = _embedded_gcs(ray_tmp)
        assert gcs != head_address and not gcs.endswith(f":{port}")
        assert head.poll() is None  # the head was running throughout
    finally:
        # Stopped by its own PIDs: Ray's own stop command would stop every Ray on the machine.
        family += _children(head.pid)
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
            try:
                head.wait(timeout=20)
            except subprocess.TimeoutExpired:
                head.kill()
                head.wait()
        _, alive = psutil.wait_procs(family, timeout=10)
        for p in alive:
            p.kill()
        psutil.wait_procs(alive, timeout=10)


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
