"""The distributed service: Ray actors for the targets, the drafter workers and the
coordinator.

``Service(config).start()`` joins a Ray cluster (``config.address``) or starts an embedded
local one bound to loopback, then starts the coordinator actor (pinned to this node so the API
listens where ``specd serve`` runs), which starts:

- ``target_replicas`` target replicas of ``tp`` ranks each (`target_worker.tp`: the model and
  its KV-cache slots), one `coordinator.cluster.replica.ReplicaScheduler` loop per replica,
- ``drafters`` drafter actors serving the ``specd.v1.Drafter`` gRPC API (unless
  ``drafter == "none"``), shared through a `coordinator.cluster.drafter_pool.DrafterPool`,
- the ``specd.v1.Generation`` gRPC server over the `coordinator.cluster.router.Router`; its Scale
  RPC (and `Service.scale`) adds and removes replicas and drafters while serving.

The configuration is `coordinator.cluster.config.ServiceConfig` (checked when made); the actor is
`coordinator.cluster.actor.CoordinatorActor`; this module holds the embedded Ray and the driver's
handle, `Service`.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable

from .actor import CoordinatorActor
from .config import ServiceConfig

log = logging.getLogger(__name__)


def init_embedded_ray(attempts: int = 2) -> None:
    """Starts the embedded single-machine Ray with every port on loopback, no dashboard and no
    Ray metrics exporter, never attaching to another Ray, with Ray's processes outside this
    process's process group.

    ``address="local"``: a plain `ray.init` joins the Ray named by ``RAY_ADDRESS`` or by the
    ``ray_current_cluster`` file that ``ray start`` leaves in Ray's temp dir (and never
    removes when its head is stopped by PID), then fails with "When connecting to an existing
    cluster, _system_config must not be provided" or joins someone else's cluster.

    Process groups: each process Ray starts here (GCS, raylet, agents, the log monitor; the
    workers are the raylet's children) leads its own process group, so a signal to this
    process's group (``kill -TERM -- -PGID``, a terminal's job control) reaches only this
    process, which drains and then stops Ray itself. Ray still ends them if this process
    dies (Linux parent-death signal). Done by wrapping Ray's private ``ConsolePopen`` for
    this call; without it (another Ray version) they share the group, with a warning.

    A loopback node IP makes Ray 2.60's GCS, raylet, object manager, core workers, agents and
    its two internal Prometheus servers (dashboard head, autoscaler monitor) bind 127.0.0.1
    instead of every interface. `ray.init` turns a loopback ``_node_ip_address`` into the
    machine's address unless Ray's ``ENABLE_RAY_CLUSTER`` constant (read from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when ray is first imported, so setting the variable
    later does nothing) is off; it is switched off for this call only.
    ``enable_metrics_collection=False`` makes the raylet start its agent with
    ``--disable-metrics-collection``: no metrics-export HTTP port (specd's own
    ``--metrics-port`` is separate). Ray still starts its API-server process
    (``dashboard.py --disable-frontend``) even with ``include_dashboard=False``; it binds
    loopback too (README, "Ports"). Ray's usage-stats report (an hourly upload from that
    process) is off unless ``RAY_USAGE_STATS_ENABLED`` says otherwise.

    Nothing of it outlives this process, ``kill -9`` included: Ray's parent-death signal
    ends the GCS and raylet, but not the raylet's agents (``ray::DashboardAgent``,
    ``ray::RuntimeEnvAgent``, ~200 MB), which would run on. So each Ray process started here
    leads a process group owned by a reaper (`_Reaper`: a tiny child in a session of its own,
    holding a pipe whose other end only this process holds), which SIGKILLs what is left of
    those groups (the agents are in the raylet's) once the pipe closes: when this process
    exits or dies, or at `shutdown_embedded_ray`. It forgets a group as soon as it sees it
    empty, so a reused group ID is never signalled; a marker in the Ray processes'
    environment also catches any that left its group.

    A start that fails (Ray raises a bare ``Exception`` "The current node timed out during
    startup" when its raylet has not registered within 30 s, seen on a 2-core machine under
    load) leaves Ray's GCS, monitor and API server running: `ray.init` does not stop what it
    started. Those processes are killed here by their process groups (each was started by this
    call), and a startup timeout is retried, up to ``attempts`` starts in all; any other error,
    or the last timeout, is raised.

    Raises:
        ValueError: ``attempts`` < 1.
    """
    import ray
    from ray._private import ray_constants, services

    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    global _reaper
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # inherited by Ray's processes
    for attempt in range(1, attempts + 1):
        started: list = []
        saved = ray_constants.ENABLE_RAY_CLUSTER
        saved_popen = getattr(services, "ConsolePopen", None)
        ray_constants.ENABLE_RAY_CLUSTER = False  # read by services.get_node_ip_address
        if saved_popen is not None:
            if _reaper is None:
                _reaper = _Reaper()
            services.ConsolePopen = _own_process_group(saved_popen, started, _reaper)
        else:
            log.warning("Ray's processes share this process group (ray._private.services has "
                        "no ConsolePopen): a signal to the group reaches them too")
        try:
            ray.init(address="local", include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _node_ip_address="127.0.0.1",
                     _system_config={"enable_metrics_collection": False})
            return
        except Exception as e:
            _kill_process_groups(started)
            try:
                ray.shutdown()  # whatever global state the failed init left
            except Exception:  # noqa: BLE001 - nothing more to clean; the first error is raised
                pass
            if attempt == attempts or "timed out during startup" not in str(e):
                raise
            log.warning("embedded Ray did not start (attempt %d of %d: %s); its %d processes "
                        "were stopped, starting again", attempt, attempts, e, len(started))
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = saved
            if saved_popen is not None:
                services.ConsolePopen = saved_popen


def _own_process_group(popen_cls: type, started: list, reaper: _Reaper) -> type:
    """``popen_cls`` whose children each start a process group of their own, owned by
    ``reaper``, with its marker set in their environment; each one started is appended to
    ``started``."""

    class Popen(popen_cls):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)  # setpgid(0, 0) in the child (Python 3.11+)
            env = kwargs.get("env")
            name, value = reaper.marker
            kwargs["env"] = {**(os.environ if env is None else env), name: value}
            super().__init__(*args, **kwargs)
            started.append(self)
            reaper.own(self.pid)

    return Popen


#: The reaper's program (``python -S -c``; argv[1] is ``NAME=VALUE``). stdin brings process
#: group IDs, one a line; a group seen empty is forgotten at once (checked at each line and
#: every second: its ID may be reused later, by anyone). At EOF it SIGKILLs the groups still
#: alive and every process whose environment holds the entry, until none is left. The
#: environment alone is not enough: Ray's agents set their process title over it.
_REAPER_CODE = """
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
mark = sys.argv[1].encode()
groups, pending = set(), b""
def prune():
    for group in list(groups):
        try:
            os.killpg(group, 0)
        except OSError:
            groups.discard(group)
while True:
    if select.select([0], [], [], 1.0)[0]:
        data = os.read(0, 4096)
        if not data:
            break
        *lines, pending = (pending + data).split(b"\\n")
        groups.update(int(line) for line in lines if line.strip())
    prune()
def marked():
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/" + name + "/environ", "rb") as f:
                    if mark in f.read().split(b"\\0"):
                        yield int(name)
            except OSError:
                pass
for _ in range(20):
    prune()
    pids = list(marked())
    if not groups and not pids:
        break
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""

#: The reaper of this process's embedded Ray (`init_embedded_ray`), None when none runs.
_reaper: _Reaper | None = None


class _Reaper:
    """A child process that SIGKILLs the process groups it was given (`own`) that are still
    alive, and every process carrying ``marker`` in its environment, once its stdin pipe
    closes: at `release`, or when this process exits or dies (the kernel closes the pipe's
    write end, which only this process holds: Python's descriptors are not inherited by
    other children). It runs in a session of its own and ignores SIGINT and SIGHUP, so a
    Ctrl-C or a closed terminal that ends this process does not end it first.
    """

    def __init__(self):
        import secrets
        import subprocess
        import sys

        self.marker = ("SPECD_EMBEDDED_RAY", f"{os.getpid()}-{secrets.token_hex(8)}")
        self.proc = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER_CODE, "=".join(self.marker)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def own(self, pgid: int) -> None:
        """Adds a process group (one this process started) to those ended at the close."""
        try:
            self.proc.stdin.write(f"{pgid}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):  # the reaper is gone or released
            log.warning("the embedded Ray's reaper is gone: process group %d is not "
                        "watched", pgid)

    def release(self, timeout_s: float = 30.0) -> None:
        """Closes the pipe and waits (up to ``timeout_s``) until the reaper has killed what
        is left of the marked processes and exited."""
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - it still runs: it ends on its own once done
            log.warning("the embedded Ray's reaper (pid %d) is still running", self.proc.pid)


def shutdown_embedded_ray() -> None:
    """`ray.shutdown`, then ends whatever of the embedded Ray (`init_embedded_ray`) is still
    running (its reaper kills the marked processes left and exits)."""
    import ray

    global _reaper
    ray.shutdown()
    if _reaper is not None:
        reaper, _reaper = _reaper, None
        reaper.release()


def _kill_process_groups(procs: list) -> None:
    """SIGKILLs the process group each of ``procs`` leads (each was started by this process in
    a group of its own, so its children, e.g. a raylet's agents, go too) and reaps it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except Exception:  # noqa: BLE001 - a process that will not be reaped is left to init
            log.warning("Ray process %d did not exit after SIGKILL", p.pid)


def check_port_free(host: str, port: int, name: str = "port") -> None:
    """Fails fast, before Ray and the model start, when an API port is taken.

    The probe binds with ``SO_REUSEADDR``, as the servers themselves do (gRPC sets it, and
    `coordinator.front.http_server`, prometheus_client's server): a stopped server's connections
    in TIME_WAIT (~60 s after it closed them) do not block a restart, while a live listener
    on the port still fails it (Linux refuses a bind beside a listening socket even with
    ``SO_REUSEADDR``, and over a TIME_WAIT one unless both sockets set it).

    Raises:
        ValueError: ``"{name}: cannot listen on host:port: <reason>"`` (``name``: the
            setting, e.g. ``http_port``, which the CLI shows as its flag).
    """
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ValueError(f"{name}: cannot listen on {host}:{port}: {exc.strerror}") \
                from exc


class Service:
    """Starts and stops the service's actors from a driver process (``specd serve``, a batch
    job, a test). Usable as a context manager.

    Raises:
        ValueError: from `start`, a model, a TP degree the model cannot be split into, or a
            drafter head that does not fit the model (checked before any actor starts; the
            rest of the configuration is checked by `ServiceConfig` itself), or an API port
            that cannot be bound, the message starting with its setting (``port:``,
            ``http_port:``, ``metrics_port:``), whether found taken before Ray starts or only
            when the coordinator binds it.
    """

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.port: int | None = None
        self._owns_ray = False
        self._embedded = False  # the Ray this service started is the embedded one
        self.coordinator = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self, progress: Callable[[str, int, int], None] | None = None) -> str:
        """Starts everything; returns the API address ``host:port``.

        ``progress(message, done, total)`` is called after each start-up phase (Ray up, each
        replica's model loaded, each drafter ready), ``message`` naming it with its time;
        ``done`` / ``total`` count the workers (replicas + drafters) started so far. It is
        also called once before the start when the model's first load converts it
        (`target_worker.loader.needs_conversion`: tens of seconds, once).
        """
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from drafter_worker.registry import check_drafter
        from target_worker.loader import needs_conversion, validate_model
        from target_worker.tp import validate_tp

        cfg = self.config
        for name in ("port", "http_port", "metrics_port"):
            if getattr(cfg, name):  # 0 picks a free port; None: off
                check_port_free(cfg.host, getattr(cfg, name), name)
        if cfg.model is None:
            # Fetch the default model here, once, with the progress bar in this terminal (the
            # actors' output is not forwarded), rather than racing in several actors.
            from target_worker.fetch import default_model_path

            default_model_path()
        workers = cfg.target_replicas + (cfg.drafters if cfg.drafter != "none" else 0)
        if progress is not None and needs_conversion(cfg.model):
            progress("first load of this model: it is converted to specd's weights and "
                     "tokenizer caches (once; tens of seconds)", 0, workers)
        # Config, weights' shapes, tokenizer: before any actor starts.
        target_config = validate_model(cfg.model)
        validate_tp(cfg.model, cfg.tp)
        # A drafter head that does not fit the target (EAGLE-3: width, vocabulary, layer ids)
        # is refused here, by name, not by a drafter actor failing after Ray is up.
        check_drafter(cfg.drafter, cfg.ngram_size, cfg.max_draft_len, cfg.drafter_path,
                      cfg.suffix_cache_requests, target_config=target_config)
        began = time.monotonic()
        if not ray.is_initialized():
            if progress is not None:
                progress("starting Ray" + (" (embedded, on loopback)" if cfg.address is None
                                           else f" (joining {cfg.address})") + "...", 0,
                         workers)
            if cfg.address is None:
                init_embedded_ray()
                self._embedded = True
            else:
                ray.init(address=cfg.address, log_to_driver=False)
            self._owns_ray = True
            if progress is not None:
                progress(f"Ray up ({time.monotonic() - began:.1f} s)", 0, workers)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                              soft=False)
        try:
            # The coordinator is pinned to this node so the API listens where `serve` runs;
            # it starts the replicas and drafter workers itself.
            self.coordinator = ray.remote(num_cpus=0)(CoordinatorActor).options(
                scheduling_strategy=here).remote(cfg)
            starting = self.coordinator.start.remote()
            if progress is not None:
                self._report_startup(starting, progress, workers)
            self.port = ray.get(starting)
        except ray.exceptions.RayTaskError as exc:
            self.stop()
            if isinstance(exc.cause, ValueError):  # e.g. a port taken since the check
                raise ValueError(str(exc.cause)) from None  # its message, not Ray's trace
            raise
        except BaseException:
            self.stop()
            raise
        return self.address

    def _report_startup(self, starting, progress, workers: int) -> None:
        """Relays the coordinator's start-up phases to ``progress`` until ``starting`` (its
        `CoordinatorActor.start`) is done or failed (``ray.get`` then raises its error)."""
        import ray

        seen = done_count = 0
        while True:
            done, _ = ray.wait([starting], timeout=0.5)
            try:
                events = ray.get(self.coordinator.startup_events.remote(seen), timeout=30)
            except Exception:  # a dead coordinator: the caller's ray.get says why
                return
            for message, seconds in events:
                if seconds is None:  # a phase starting: said now, counted when done
                    progress(f"{message}...", done_count, workers)
                    continue
                done_count += 1
                progress(f"{message} ({seconds:.1f} s)", done_count, workers)
            seen += len(events)
            if done:
                return

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` serving Prometheus ``/metrics``, or None when off."""
        import ray

        return ray.get(self.coordinator.metrics_address.remote())

    @property
    def http_address(self) -> str | None:
        """``host:port`` of the OpenAI HTTP API, or None when off."""
        import ray

        return ray.get(self.coordinator.http_address.remote())

    def status(self) -> dict:
        """See `CoordinatorActor.status`."""
        import ray

        return ray.get(self.coordinator.status.remote())

    def scale(self, target_replicas: int | None = None, drafters: int | None = None) -> dict:
        """Scales while serving (`coordinator.cluster.router.Router.scale`); blocks until done.

        Raises:
            ValueError: bad counts (nothing changes).
        """
        import ray

        try:
            return ray.get(self.coordinator.scale.remote(target_replicas, drafters))
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, ValueError):
                raise ValueError(str(exc.cause)) from None
            raise

    @property
    def drafter_actors(self) -> dict:
        """The drafter worker actors by pool name."""
        import ray

        return ray.get(self.coordinator.drafter_actors.remote())

    @property
    def drafter_actor(self):
        """The first drafter worker actor, or None."""
        return next(iter(self.drafter_actors.values()), None)

    def coordinator_alive(self, timeout_s: float = 30.0) -> bool:
        """False once the coordinator actor has died (a busy one that answers late counts as
        alive: only Ray's own death report decides)."""
        import ray

        if self.coordinator is None:
            return False
        try:
            ray.get(self.coordinator.metrics_address.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return False
        except ray.exceptions.GetTimeoutError:
            pass
        return True

    def stop(self, grace_s: float = 1.0) -> None:
        """Stops the API (in-flight streams get up to ``grace_s`` seconds to finish, new calls
        are refused with UNAVAILABLE meanwhile), destroys replicas and drafters, kills the
        coordinator, and shuts Ray down if this service started it. A coordinator that has
        already died is only cleaned up after (no error, no traceback)."""
        import ray

        if not ray.is_initialized():
            return
        if self.coordinator is not None:
            try:
                ray.get(self.coordinator.stop.remote(grace_s), timeout=grace_s + 30)
            except ray.exceptions.RayActorError:
                log.info("the coordinator had already died: nothing to stop gracefully")
            except Exception:
                log.exception("coordinator stop failed")
            ray.kill(self.coordinator)  # its child actors die with it
        self.coordinator = None
        if self._owns_ray:
            if self._embedded:
                shutdown_embedded_ray()
            else:
                ray.shutdown()
            self._owns_ray = self._embedded = False

    def __enter__(self) -> Service:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
