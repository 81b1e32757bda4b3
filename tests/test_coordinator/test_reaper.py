"""The embedded Ray's reaper (`coordinator.cluster.service._Reaper`) without Ray: the process groups
it owns die with their owner, ``kill -9`` included, and at `release`; nothing else does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
from polling import wait_until

ROOT = Path(__file__).resolve().parents[2]

#: An owner: a reaper, one group of its own (a shell and its child, as a raylet and its
#: agents), then a line with the PIDs; it then sleeps until killed.
OWNER = """
import subprocess, sys, time
from coordinator.cluster.service import _Reaper
reaper = _Reaper()
group = subprocess.Popen(["sh", "-c", "sleep 600 & wait"], process_group=0)
reaper.own(group.pid)
import psutil
shell, deadline = psutil.Process(group.pid), time.monotonic() + 30
while not shell.children() and time.monotonic() < deadline:  # its child, polled with a deadline
    time.sleep(0.01)
print(reaper.proc.pid, *[p.pid for p in [shell, *shell.children()]], flush=True)
time.sleep(600)
"""


def running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_the_groups_a_reaper_owns_die_with_their_owners_kill_9():
    bystander = subprocess.Popen(["sleep", "600"], process_group=0)  # not given to it
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)},
                             start_new_session=True)
    pids = []
    try:
        reaper, *pids = map(int, owner.stdout.readline().split())
        pids.append(reaper)
        assert len(running(pids)) == 3  # the reaper, the shell, its sleeping child
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        wait_until(lambda: not running(pids), 10, "the owned group and the reaper exiting")
        assert bystander.poll() is None
    finally:
        for pid in running(pids):
            os.kill(pid, signal.SIGKILL)
        bystander.kill()
        bystander.wait()
        owner.stdout.close()


def test_release_ends_what_is_left_of_the_owned_groups():
    from coordinator.cluster.service import _Reaper

    reaper = _Reaper()
    group = subprocess.Popen(["sleep", "600"], process_group=0)
    try:
        reaper.own(group.pid)
        reaper.release()
        assert reaper.proc.returncode == 0
        assert group.wait(timeout=10) == -signal.SIGKILL
    finally:
        group.kill()
        group.wait()
