"""`specd bench serve --compare MODEL`: ``specd serve --http-port`` against a peer server
(``transformers serve --continuous-batching``, or llama.cpp's ``llama-server`` with ``--peer
llama.cpp``, or any ``--peer-cmd``) on the same model, under the same workload.

The two servers never run at once: each round starts one, waits until it lists a model at
``/v1/models`` (its start-up time), runs the warm-up and the workload at every load point,
stops it, then does the same with the other; rounds alternate which goes first, so drift on a
shared machine hits both alike. Every server is started in its own session (``start_new_session``)
and stopped through that process group only: SIGTERM, then SIGKILL after ``--stop-timeout``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .serve import (
    ServeBenchConfig,
    bench_endpoint,
    compute_metrics,
    load_points,
    load_workload,
    outcomes_of,
    run_record,
)
from .serve_data import load_bench_tokenizer
from .serve_report import point_label

#: The peer `--compare` starts by default (transformers >= 5; needs typer, fastapi, uvicorn,
#: openai): paged-attention continuous batching, no speculation.
DEFAULT_PEER_CMD = ("transformers serve {model} --continuous-batching --host 127.0.0.1 "
                    "--port {port} --device cpu --dtype {dtype}")
#: llama.cpp's server on the same GGUF file (`scripts/build_llama_server.sh` builds the
#: pinned release): plain decoding, 8 slots, every core, its own chat template.
LLAMA_SERVER_CMD = ("{llama_server} -m {model} --host 127.0.0.1 --port {port} -t {threads} "
                    "-np 8 -c 32768 --jinja")
#: ``--peer`` presets.
PEERS = {"transformers": DEFAULT_PEER_CMD, "llama.cpp": LLAMA_SERVER_CMD}
#: Where `scripts/build_llama_server.sh` puts its build (under the cache root).
LLAMA_SERVER_BUILD = Path("peers") / "llama.cpp-11434" / "llama-server"
#: specd's side: the HTTP API on {port}, gRPC on any free port, a short drain on SIGTERM.
DEFAULT_SPECD_CMD = ("{python} -m specd_tools.cli serve --model {model} --host 127.0.0.1 "
                     "--port 0 --http-port {port} --shutdown-grace 5 --dtype {dtype}")
SERVERS = ("specd", "peer")
#: The metrics `format_compare` shows as specd / peer ratios.
RATIO_KEYS = ("request_throughput", "output_throughput", "total_token_throughput",
              "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
              "median_itl_ms", "median_e2el_ms", "p99_e2el_ms")


@dataclass
class CompareConfig:
    """``--compare``'s settings; timeouts in seconds."""

    model_dir: str
    peer_cmd: str = DEFAULT_PEER_CMD
    specd_cmd: str = DEFAULT_SPECD_CMD
    rounds: int = 2
    server_timeout: float = 600.0
    stop_timeout: float = 30.0
    log_dir: str | None = None
    #: ``--dtype``: a `target_worker.loader.DTYPES` name, given to specd as it is; the peer's
    #: ``{dtype}`` is the torch dtype it resolves to on this machine (`dtype_name`: "auto"
    #: and "q8" as specd's float weights), so a torch peer computes in the same precision.
    dtype: str = "auto"

    @property
    def dtype_name(self) -> str:
        """The peer's ``{dtype}``: a torch dtype name."""
        from target_worker.loader import resolve_dtype

        return str(resolve_dtype(self.dtype)).removeprefix("torch.")

    def dtype_for(self, name: str) -> str:
        """``{dtype}`` in server ``name``'s command: specd's ``--dtype`` as given, the
        peer's `dtype_name`."""
        return self.dtype if name == "specd" else self.dtype_name


def free_port() -> int:
    """A TCP port free on loopback now (the OS's pick; another process may take it before the
    server binds it, which then fails to start and says so)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server() -> str:
    """The ``llama-server`` to run: ``$LLAMA_SERVER``, else `scripts/build_llama_server.sh`'s
    build under the cache root, else ``llama-server`` (looked up on ``PATH``)."""
    from target_worker.disk_cache import cache_dir

    if os.environ.get("LLAMA_SERVER"):
        return os.environ["LLAMA_SERVER"]
    built = cache_dir() / LLAMA_SERVER_BUILD
    return str(built) if built.is_file() else "llama-server"


def server_argv(template: str, port: int, model: str, dtype: str = "float32") -> list[str]:
    """``template`` split as a shell would, each word with ``{port}``, ``{model}``,
    ``{dtype}``, ``{python}`` (this interpreter), ``{threads}`` (this machine's cores) and
    ``{llama_server}`` (`llama_server`) filled in; a bare program name is looked up beside
    this interpreter first (the venv's ``transformers``), then on ``PATH``.

    Raises:
        ValueError: an unknown placeholder, or the program is not found (names the flag).
    """
    try:
        argv = [w.format(port=port, model=model, python=sys.executable, dtype=dtype,
                         threads=os.cpu_count() or 1,
                         llama_server=llama_server() if "{llama_server}" in w else "")
                for w in shlex.split(template)]
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"--peer-cmd/--specd-cmd {template!r}: bad placeholder ({exc}); use "
                         "{port}, {model}, {dtype}, {python}, {threads}, {llama_server}"
                         ) from None
    if not argv:
        raise ValueError("--peer-cmd/--specd-cmd: empty command")
    if os.sep not in argv[0]:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        found = shutil.which(argv[0], path=path)
        if found is None:
            hint = (" (build it with scripts/build_llama_server.sh, or set LLAMA_SERVER)"
                    if argv[0] == "llama-server" else "")
            raise ValueError(f"--peer-cmd/--specd-cmd: program {argv[0]!r} not found beside "
                             f"{sys.executable} or on PATH{hint}")
        argv[0] = found
    return argv


class ServerProcess:
    """One server start: the command in its own session, output to ``log_path``.

    Args:
        name: for messages. argv: the command. port: where it serves ``/v1/models``.
        log_path: its stdout and stderr. env: its environment. api_key: sent when polling.
    """

    def __init__(self, name: str, argv: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None, api_key: str | None = None):
        self.name, self.argv, self.port = name, argv, port
        self.log_path, self.env, self.api_key = log_path, env, api_key
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        """Starts the command (a new session: its process group is its PID)."""
        with open(self.log_path, "wb") as log:
            self.started = time.monotonic()
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout: float) -> tuple[float, list[str]]:
        """Polls ``GET /v1/models`` until it answers 200; returns the seconds since `start`
        and the model ids listed.

        Raises:
            RuntimeError: the process exited first, or ``timeout`` seconds passed (with the
                end of its output).
        """
        url = f"http://127.0.0.1:{self.port}/v1/models"
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} ({shlex.join(self.argv)}) exited with "
                                   f"{self.proc.returncode} before serving {url}; its output "
                                   f"ends:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                            timeout=5) as reply:
                    if reply.status == 200:
                        ids = [m["id"] for m in json.load(reply).get("data", [])]
                        return time.monotonic() - self.started, ids
            except (urllib.error.URLError, OSError, ValueError, KeyError):
                pass  # not listening yet, or not ready
            if time.monotonic() - self.started > timeout:
                raise RuntimeError(f"{self.name} did not serve {url} within {timeout:g} s "
                                   f"(--server-timeout); its output ends:\n{self.log_tail()}")
            time.sleep(0.25)  # the polling interval

    def stop(self, timeout: float) -> int | None:
        """Stops the server's process group: SIGTERM, then SIGKILL if the leader has not
        exited after ``timeout`` seconds; then SIGKILL to whatever of the group outlives the
        leader ``timeout`` seconds longer. Returns the leader's exit status (None if never
        started)."""
        if self.proc is None:
            return None
        group = self.proc.pid  # start_new_session: the group's id is the leader's PID
        if self.proc.poll() is None:
            _signal_group(group, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(group, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + timeout
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)  # the polling interval
        if _group_alive(group):
            _signal_group(group, signal.SIGKILL)
        return self.proc.returncode


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists but is not ours: cannot be our group
        return False
    return True


def run_compare(cfg: ServeBenchConfig, cmp: CompareConfig,
                progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Runs ``cfg``'s workload against specd and the peer, ``cmp.rounds`` rounds.

    Returns:
        ``{"model_dir", "rounds", "servers": {"specd"|"peer": {"command", "model_id",
        "startup_s": [per start: until /v1/models answered], "warmup_e2el_ms": [per warm-up
        request], "first_answer_s": [per start: start-up + the first warm-up request, None
        without one], "runs": [one `run_record`
        per load point, all rounds pooled: durations summed, requests concatenated],
        "round_metrics": [[`compute_metrics` per load point] per round]}},
        "ratios": [per load point, specd / peer of `RATIO_KEYS`], "greedy_equal",
        "greedy_total"}`` (the greedy counts None when ``cfg.temperature`` > 0).

    Raises:
        ValueError: a bad flag. RuntimeError: a server did not start or its warm-up failed
            (the log directory is kept and named).
    """
    model = Path(cmp.model_dir)
    if not model.exists():
        raise ValueError(f"--compare {cmp.model_dir}: no such model directory or file")
    if "{llama_server}" in cmp.peer_cmd and not model.is_file():
        raise ValueError(f"--compare {cmp.model_dir}: llama.cpp's server reads a GGUF file, "
                         "not a directory")
    tokenizer = None
    source = cfg.tokenizer or str(model)
    try:
        tokenizer = load_bench_tokenizer(source)
        cfg = replace(cfg, tokenizer=source)
    except ValueError as exc:
        if cfg.tokenizer:
            raise
        progress(f"no client-side tokenizer ({exc})")
    prompts = load_workload(cfg, tokenizer)
    templates = {"specd": cmp.specd_cmd, "peer": cmp.peer_cmd}
    for name in SERVERS:  # a bad command fails now, not after the first server's run
        server_argv(templates[name], 0, str(model), cmp.dtype_for(name))
    keep_logs = cmp.log_dir is not None
    log_dir = Path(cmp.log_dir) if keep_logs else Path(tempfile.mkdtemp(prefix="specd-bsc-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: dict[str, dict[str, Any]] = {
        n: {"command": templates[n], "model_id": None, "startup_s": [], "warmup_e2el_ms": [],
            "first_answer_s": [], "per_round": []} for n in SERVERS}
    try:
        for rnd in range(cmp.rounds):
            order = SERVERS if rnd % 2 == 0 else SERVERS[::-1]
            for name in order:
                result = _one_start(name, templates[name], model, cfg, cmp, prompts, tokenizer,
                                    log_dir / f"{name}-round{rnd + 1}.log",
                                    f"round {rnd + 1}/{cmp.rounds}", progress)
                s = servers[name]
                s["model_id"] = result["model"]
                s["startup_s"].append(result["startup_s"])
                s["warmup_e2el_ms"].extend(result["warmup_e2el_ms"])
                s["first_answer_s"].append(
                    result["startup_s"] + result["warmup_e2el_ms"][0] / 1000
                    if result["warmup_e2el_ms"] else None)
                s["per_round"].append(result["runs"])
    except BaseException:
        keep_logs = True
        progress(f"server logs kept in {log_dir}")
        raise
    finally:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
    return _summarise(cfg, cmp, servers)


def _one_start(name: str, template: str, model: Path, cfg: ServeBenchConfig,
               cmp: CompareConfig, prompts, tokenizer, log_path: Path, where: str,
               progress: Callable[[str], None]) -> dict[str, Any]:
    """Starts one server, benches it (`bench_endpoint`), stops it."""
    port = free_port()
    argv = server_argv(template, port, str(model), cmp.dtype_for(name))
    # A private, short RAY_TMPDIR: a Ray the server embeds neither joins another Ray on this
    # machine nor outgrows the 107-byte limit of its socket paths.
    ray_tmp = tempfile.mkdtemp(prefix="specd-bsr-")
    server = ServerProcess(name, argv, port, log_path, {**os.environ, "RAY_TMPDIR": ray_tmp},
                           cfg.api_key)
    progress(f"{where}: starting {name}: {shlex.join(argv)}")
    server.start()
    try:
        startup, ids = server.wait_ready(cmp.server_timeout)
        progress(f"{name} ready in {startup:.1f} s (pid {server.proc.pid})")
        sub = replace(cfg, base_url=f"http://127.0.0.1:{port}/v1",
                      model=cfg.model or (ids[0] if ids else str(model)))
        result = asyncio.run(bench_endpoint(sub, name, progress, prompts=prompts,
                                            tokenizer=tokenizer))
    finally:
        status = server.stop(cmp.stop_timeout)
        progress(f"{name} stopped (pid {server.proc.pid}, exit status {status})")
        shutil.rmtree(ray_tmp, ignore_errors=True)
    result["startup_s"] = startup
    return result


def _summarise(cfg: ServeBenchConfig, cmp: CompareConfig,
               servers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"model_dir": cmp.model_dir, "rounds": cmp.rounds,
                           "dtype": cmp.dtype, "peer_dtype": cmp.dtype_name, "servers": {}}
    for name, s in servers.items():
        runs = []
        round_metrics = [[compute_metrics(outcomes_of(r), r["duration"], cfg.goodput)
                          for r in per_rate] for per_rate in s["per_round"]]
        for i, (rate, concurrency) in enumerate(load_points(cfg)):
            recs = [per_rate[i] for per_rate in s["per_round"]]
            outcomes = [o for r in recs for o in outcomes_of(r)]
            record = run_record(name, rate, concurrency, replace(cfg, base_url=""),
                                s["model_id"], outcomes, sum(r["duration"] for r in recs))
            record["rounds"] = len(recs)
            runs.append(record)
        out["servers"][name] = {"command": s["command"], "model_id": s["model_id"],
                                "startup_s": s["startup_s"],
                                "warmup_e2el_ms": s["warmup_e2el_ms"],
                                "first_answer_s": s["first_answer_s"], "runs": runs,
                                "round_metrics": round_metrics}
    specd, peer = out["servers"]["specd"], out["servers"]["peer"]
    out["ratios"] = [{k: (a[k] / b[k] if b[k] else None) for k in RATIO_KEYS}
                     for a, b in zip(specd["runs"], peer["runs"], strict=True)]
    if cfg.temperature == 0:
        pairs = [(a, b) for ra, rb in zip(servers["specd"]["per_round"],
                                          servers["peer"]["per_round"], strict=True)
                 for x, y in zip(ra, rb, strict=True)
                 for a, b in zip(outcomes_of(x), outcomes_of(y), strict=True)
                 if a.success and b.success]
        out["greedy_equal"] = sum(a.text == b.text for a, b in pairs)
        out["greedy_total"] = len(pairs)
    else:
        out["greedy_equal"] = out["greedy_total"] = None
    return out


def _median(values) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def category_compare(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> str:
    """Per category: median TPOT and TTFT (ms) of specd and the peer, and specd / peer."""
    lines = [f"{'per category':<12}{'TPOT specd':>11}{'peer':>8}{'ratio':>7}"
             f"{'TTFT specd':>11}{'peer':>8}{'ratio':>7}"]
    for name in a:
        x, y = a[name], b.get(name)
        if y is None:
            continue
        cells = []
        for key in ("median_tpot_ms", "median_ttft_ms"):
            ratio = f"{x[key] / y[key]:.2f}" if y[key] else "-"
            cells.append(f"{x[key]:>11.1f}{y[key]:>8.1f}{ratio:>7}")
        lines.append(f"{name[:12]:<12}{''.join(cells)}")
    return "\n".join(lines)


def format_compare(result: dict[str, Any]) -> str:
    """The side-by-side table per load point (specd, peer, specd / peer), start-up times and the
    greedy check."""
    specd, peer = result["servers"]["specd"], result["servers"]["peer"]
    rows = (("completed", "{:d}"), ("failed", "{:d}"), ("duration", "{:.2f}"),
            ("total_input_tokens", "{:d}"), ("total_output_tokens", "{:d}"),
            *((k, "{:.2f}") for k in RATIO_KEYS))
    lines = [f"specd serve vs peer on {result['model_dir']} (--dtype "
             f"{result.get('dtype', '?')}, the peer's {{dtype}} "
             f"{result.get('peer_dtype', result.get('dtype', '?'))}), "
             f"{result['rounds']} round(s), rounds pooled",
             f"peer: {peer['command']}"]
    for a, b, ratio in zip(specd["runs"], peer["runs"], result["ratios"], strict=True):
        lines += ["", point_label(a),
                  f"{'metric':<26}{'specd':>12}{'peer':>12}{'specd/peer':>12}"]
        for key, fmt in rows:
            r = ratio.get(key)
            lines.append(f"{key:<26}{fmt.format(a[key]):>12}{fmt.format(b[key]):>12}"
                         f"{'' if r is None else f'{r:.2f}x':>12}")
        if "request_goodput" in a:
            lines.append(f"{'request_goodput':<26}{a['request_goodput']:>12.2f}"
                         f"{b['request_goodput']:>12.2f}")
        if a["per_category"]:
            lines.append(category_compare(a["per_category"], b["per_category"]))
    lines.append("")
    for label, key in (("start-up s", "startup_s"), ("+ 1st answer s", "first_answer_s")):
        a = _median(v for v in specd[key] if v is not None)
        b = _median(v for v in peer[key] if v is not None)
        ratio = f"{a / b:.2f}x" if b and not math.isnan(a / b) else ""
        lines.append(f"{label + ', median':<26}{a:>12.1f}{b:>12.1f}{ratio:>12}")
    if result["greedy_total"] is None:
        lines.append("greedy texts: not compared (temperature > 0)")
    else:
        lines.append(f"greedy texts equal: {result['greedy_equal']} / {result['greedy_total']}")
    return "\n".join(lines)
