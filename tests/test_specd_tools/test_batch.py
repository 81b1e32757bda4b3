"""The batch job: JSONL in, JSONL out, resumable; and as a `ray job submit` entry point on a
local `ray start --head` cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from service_harness import MODEL, LocalService

from specd_tools.batch import finished_ids, read_jobs, run_batch


def write_jobs(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}",
                                        "max_new_tokens": 5}) + "\n" for i in range(n)))


def test_bad_input_lines_are_refused_with_their_line_number(tmp_path):
    for content, match in [("{not json}\n", ":1: not JSON"), ('{"prompt": "x"}\n', "'id'"),
                           ('{"id": 1}\n', "prompt"),
                           ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "duplicate")]:
        path = tmp_path / "in.jsonl"
        path.write_text(content)
        with pytest.raises(ValueError, match=match):
            read_jobs(path)


def test_a_rerun_skips_finished_ids(tmp_path):
    jobs_path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_jobs(jobs_path, 6)
    jobs = read_jobs(jobs_path)
    svc = LocalService().start()
    try:
        # A previous run that finished two prompts and crashed mid-line.
        out.write_text(json.dumps({"id": "p0"}) + "\n" + json.dumps({"id": "p3"}) + "\n{\"id\"")
        assert run_batch(svc.address, jobs, out, concurrency=3) == 4
        assert finished_ids(out) == {f"p{i}" for i in range(6)}
        assert run_batch(svc.address, jobs, out, concurrency=3) == 0
    finally:
        svc.stop()
    records = [json.loads(line) for line in out.read_text().splitlines()[3:]]
    assert all(len(r["token_ids"]) <= 5 and r["finish_reason"] for r in records)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, deadline_s: float) -> None:
    """Returns once 127.0.0.1:``port`` accepts connections; fails if ``proc`` exits first or
    the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"ray start exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)  # polling a port with a deadline, not waiting out a race
    raise AssertionError(f"the head's dashboard port {port} did not open in {deadline_s} s")


def _stop_group(proc: subprocess.Popen) -> None:
    """Stops the head started as ``proc`` and its process group (ours alone): SIGTERM lets
    `ray start --block` shut its processes down; SIGKILL ends what is left."""
    pgid = os.getpgid(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.slow
def test_the_batch_job_runs_under_ray_job_submit_on_a_local_head(tmp_path):
    ray_bin = Path(sys.executable).with_name("ray")
    temp = tempfile.mkdtemp(prefix="specd-head-")  # short: Ray's socket paths have a limit
    dashboard = _free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    # `--block` keeps the head's own `ray start` process alive; in a new session (process
    # group) of its own, so the head and everything it spawns can be stopped through that
    # group alone (Ray's own stop command would stop every Ray on the machine).
    head = subprocess.Popen(
        [str(ray_bin), "start", "--head", "--block", f"--port={_free_port()}",
         "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dashboard}", f"--temp-dir={temp}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(dashboard, head, deadline_s=120)
        jobs_path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        write_jobs(jobs_path, 4)
        # The dashboard answers before the head's job agent registers (seconds later on a busy
        # machine): the job server then refuses, submitting nothing. Retried until a deadline.
        deadline = time.monotonic() + 120
        while True:
            submit = subprocess.run(
                [str(ray_bin), "job", "submit", f"--address=http://127.0.0.1:{dashboard}",
                 "--", sys.executable, "-m", "specd_tools.batch", "--input", str(jobs_path),
                 "--output", str(out), "--model", MODEL],
                env=env, capture_output=True, text=True, timeout=300,
            )
            if "No available agent" not in submit.stdout + submit.stderr or \
                    time.monotonic() > deadline:
                break
            time.sleep(1)  # polling the job server with a deadline, not waiting out a race
        assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
        assert finished_ids(out) == {"p0", "p1", "p2", "p3"}
    finally:
        _stop_group(head)
        shutil.rmtree(temp, ignore_errors=True)
