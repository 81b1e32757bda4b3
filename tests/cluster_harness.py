"""A real two-node Ray cluster on one machine: node A (the head) in the root network namespace
and node B in a network namespace of its own, joined by a veth pair on a private /24
(``10.231.N.1`` / ``10.231.N.2``). Needs root and ``ip netns``; `unavailable_reason` says why
not when it cannot run.

Everything it starts is its own: each ``ray start --block`` (and ``specd serve``) leads its
own process group, which teardown signals; node B's processes are found with ``ip netns pids``.
It never runs Ray's own stop command (which stops every Ray on the machine). Ray's files go
to a private temp dir (``RAY_TMPDIR``), token authentication uses a fresh token
(``RAY_AUTH_TOKEN``) and usage stats are off (nothing leaves the machine).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).parent / "ray")


def run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


def unavailable_reason() -> str | None:
    """Why this machine cannot host the namespace cluster, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if not Path(RAY).exists():
        return f"no `ray` command beside {sys.executable}"
    probe = f"specd-probe-{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    run("ip", "netns", "del", probe, check=False)
    return None


def _free_subnet() -> int:
    """A third octet N with no address of 10.231.N.0/24 on this machine (another test run's)."""
    used = run("ip", "-4", "-o", "addr", "show").stdout
    start = os.getpid() % 200 + 20
    for n in [*range(start, 250), *range(20, start)]:
        if f" 10.231.{n}." not in used:
            return n
    raise RuntimeError("no free 10.231.N.0/24 subnet")


def _group_kill(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM to ``proc``'s own process group, SIGKILL to what is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


class NamespaceCluster:
    """The two nodes; ``head_ip:gcs_port`` is the cluster address.

    Args:
        node_b_resources: Ray custom resources of node B (e.g. ``{"specd_target": 1}``).
        head_resources: those of the head.
    """

    def __init__(self, node_b_resources: dict, head_resources: dict | None = None,
                 dashboard: bool = False):
        tag = f"{os.getpid() % 100000}"
        self.netns = f"specd-b-{tag}"
        self.veth = (f"vsa{tag}", f"vsb{tag}")
        n = _free_subnet()
        self.head_ip, self.b_ip = f"10.231.{n}.1", f"10.231.{n}.2"
        self.tmp = tempfile.mkdtemp(prefix="sdc-")
        self.node_b_resources = node_b_resources
        self.head_resources = head_resources or {}
        self.env = {**os.environ, "RAY_TMPDIR": self.tmp, "RAY_USAGE_STATS_ENABLED": "0",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}
        self.env.pop("RAY_ADDRESS", None)
        self.head: subprocess.Popen | None = None
        self.node_b: subprocess.Popen | None = None
        self.gcs_port: int | None = None
        #: The head's dashboard port on 127.0.0.1 (the job server: ``ray job submit``), or
        #: None without one.
        self.dashboard_port: int | None = None
        self._dashboard = dashboard
        self._made_netns = False

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs_port}"

    def start(self) -> None:
        """Builds the namespace and link, then starts both nodes; waits until Ray lists two
        alive nodes. Raises RuntimeError (after cleaning up) when something fails."""
        try:
            run("ip", "netns", "add", self.netns)
            self._made_netns = True
            a, b = self.veth
            run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            run("ip", "link", "set", b, "netns", self.netns)
            run("ip", "addr", "add", f"{self.head_ip}/24", "dev", a)
            run("ip", "link", "set", a, "up")
            ns = ("ip", "netns", "exec", self.netns)
            run(*ns, "ip", "addr", "add", f"{self.b_ip}/24", "dev", b)
            run(*ns, "ip", "link", "set", b, "up")
            run(*ns, "ip", "link", "set", "lo", "up")
            with socket.socket() as probe:
                probe.bind((self.head_ip, 0))
                self.gcs_port = probe.getsockname()[1]
            dashboard = ["--include-dashboard=false"]
            if self._dashboard:
                with socket.socket() as probe, socket.socket() as agent:
                    probe.bind(("127.0.0.1", 0))
                    agent.bind((self.head_ip, 0))
                    self.dashboard_port = probe.getsockname()[1]
                    agent_port = agent.getsockname()[1]
                # The agent's own port too: its default (52365) may be another Ray's here.
                dashboard = ["--include-dashboard=true", "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(self.dashboard_port),
                             "--dashboard-agent-listen-port", str(agent_port)]
            self.head = self._ray_start(
                ["--head", "--node-ip-address", self.head_ip, "--port", str(self.gcs_port),
                 *dashboard], self.head_resources)
            self.wait_for_nodes(1, 90)
            self.start_node_b()
        except BaseException:
            self.stop()
            raise

    def _ray_start(self, args: list[str], resources: dict, prefix: tuple = ()
                   ) -> subprocess.Popen:
        import json

        cmd = [*prefix, RAY, "start", *args, "--num-cpus", "2", "--disable-usage-stats",
               "--object-store-memory", str(200 << 20),
               "--resources", json.dumps(resources), "--block"]
        return subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True,
                                cwd=self.tmp)

    def start_node_b(self, wait_s: float = 90) -> float:
        """(Re)starts node B in its namespace; returns seconds until Ray lists it alive."""
        began = time.monotonic()
        self.node_b = self._ray_start(
            ["--address", self.address, "--node-ip-address", self.b_ip],
            self.node_b_resources, prefix=("ip", "netns", "exec", self.netns))
        self.wait_for_nodes(2, wait_s)
        return time.monotonic() - began

    def alive_nodes(self) -> list[str]:
        """IPs of the nodes Ray lists alive (asked by a fresh driver process, so this
        process never joins the cluster)."""
        code = ("import ray, json, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
                "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() "
                "if n['Alive']]))")
        out = subprocess.run([sys.executable, "-c", code, self.address], env=self.env,
                             capture_output=True,
                             text=True, timeout=60, cwd=self.tmp)
        import json

        try:
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            return []

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for proc, name in ((self.head, "head"), (self.node_b, "node B")):
                if proc is not None and proc.poll() is not None:
                    raise RuntimeError(f"`ray start` of the {name} exited ({proc.returncode})")
            if len(self.alive_nodes()) >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{n} Ray nodes not alive within {timeout_s} s")

    def netns_pids(self) -> list[int]:
        out = run("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node_b(self) -> int:
        """SIGKILL to every process of node B's namespace (a node lost at once); returns how
        many there were."""
        pids = self.netns_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.node_b is not None:
            self.node_b.wait(10)
        return len(pids)

    def stop(self) -> None:
        """Stops what it started: node B's processes, the head's process group, then removes
        the namespace (and with it the veth pair) and the temp dir. Safe to call twice."""
        if self._made_netns:
            for _ in range(3):
                if not self.kill_node_b():
                    break
        if self.head is not None:
            _group_kill(self.head)
            self.head = None
        if self._made_netns:
            run("ip", "netns", "del", self.netns, check=False)
            self._made_netns = False
        run("ip", "link", "del", self.veth[0], check=False)  # gone with the namespace
        shutil.rmtree(self.tmp, ignore_errors=True)
