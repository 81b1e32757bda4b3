"""The docs (README.md, docs/*.md, mkdocs.yml) against the code: links resolve, every page is in
the nav, the README's test commands are the ones CI runs, and every command block or snippet a
user is told to paste is a recipe this file runs.

A ``bash`` or ``python`` block must follow a marker comment (docs/contributing.md, "The docs"):

- ``<!-- recipe: cheap -->``: run as written (shell blocks with ``bash -euo pipefail``).
- ``<!-- recipe: service [requires=TOOL] -->``: run against an in-process service on the tiny
  model, with the default addresses and the default model's name replaced by that service's
  (shell ones are marked ``slow``: a CLI process per command costs ~2 s).
- ``<!-- recipe: slow [file=NAME] -->`` (marked ``slow``): a page's slow blocks run in order in
  one temp directory (``file=NAME`` blocks are written to NAME); after each block every process
  it left behind (a server, a Ray head) is stopped through the block's own process group.
- ``<!-- recipe: cluster (why) -->``, ``<!-- recipe: not-run (why) -->``: not run here.

Shell recipes find ``specd`` as a shim running this checkout's CLI with this interpreter, and
``python`` / ``ray`` in this interpreter's bin directory.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from polling import wait_until
from service_harness import MODEL

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RUNNABLE = {"bash", "sh", "shell", "console", "python", "py"}
KINDS = {"cheap", "service", "slow", "cluster", "not-run"}
MARKER = re.compile(r"^<!--\s*recipe:\s*(?P<kind>[a-z-]+)(?P<rest>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")


@dataclass
class Recipe:
    page: Path
    line: int  # 1-based line of the opening fence
    kind: str
    lang: str
    body: str
    attrs: dict = field(default_factory=dict)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> tuple[list[Recipe], list[str]]:
    """The page's fenced blocks with a recipe marker, and a problem per runnable block without
    one (or with an unknown kind, or not-run/cluster without a reason)."""
    lines = page.read_text().splitlines()
    recipes, problems = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang, indent = i, m["lang"], m["indent"]
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        body = "\n".join(line[len(indent):] for line in lines[start + 1:j])
        i = j + 1
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        marker = MARKER.match(lines[prev].strip()) if prev >= 0 else None
        where = f"{page.relative_to(ROOT)}:{start + 1}"
        if marker is None:
            if lang in RUNNABLE:
                problems.append(f"{where}: a {lang} block with no recipe marker")
            continue
        kind, rest = marker["kind"], marker["rest"].strip()
        reason = ""
        if "(" in rest:
            rest, reason = rest.split("(", 1)
            reason = reason.rsplit(")", 1)[0].strip()
        attrs = dict(a.split("=", 1) for a in rest.split() if "=" in a)
        if kind not in KINDS:
            problems.append(f"{where}: unknown recipe kind {kind!r}")
        elif kind in ("cluster", "not-run") and not reason:
            problems.append(f"{where}: a {kind} recipe must say why in parentheses")
        elif lang not in RUNNABLE:
            problems.append(f"{where}: a recipe marker on a {lang or 'plain'} block")
        recipes.append(Recipe(page, start + 1, kind, lang, body, attrs, reason))
    return recipes, problems


ALL = [r for page in PAGES for r in parse(page)[0]]


def of_kind(kind: str) -> list:
    """Parameters for the recipes of one kind; a service recipe in the shell starts a CLI
    process per command (~2 s each: torch's import), so those count as slow."""
    return [pytest.param(r, id=r.id, marks=[pytest.mark.slow] if kind == "service"
                         and r.lang != "python" else []) for r in ALL if r.kind == kind]


# ------------------------------------------------------------------ structure and links


def test_every_runnable_block_is_a_marked_recipe():
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_nav_lists_every_page():
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def files(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from files(value) if isinstance(value, list) else [value]

    assert sorted(files(config["nav"])) == sorted(p.name for p in DOCS.glob("*.md"))


def slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading's text (what MkDocs links to)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found, in_fence = set(), False
    for line in page.read_text().splitlines():
        if FENCE.match(line) or line.strip() == "```":
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6} (.*)", line)):
            found.add(slug(m[1]))
    return found


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_internal_links_resolve(page):
    """Every relative link (and its #anchor) reaches a file and heading; mkdocs --strict (in
    .ci/run) checks the built site too, but never sees the README."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


def test_ci_runs_the_readme_test_commands():
    readme = (ROOT / "README.md").read_text().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    documented = [line.strip() for line in readme if "-m pytest" in line and
                  line.strip().startswith(".venv/bin/python")]
    run = [line.strip() for line in ci if "-m pytest" in line]
    assert documented and documented == run
    # The quick suite first, named so in the README; then the rest: together, every test.
    markers = [re.findall(r' -m ("[^"]+"|\S+)', line)[-1].strip('"') for line in run]
    assert markers == ["not slow and not cluster", "slow and not cluster", "cluster"]
    assert "**the quick suite**" in "\n".join(readme)
    assert all("--durations=25" in line for line in run[:2])


def test_ci_builds_the_docs_strictly():
    assert any("mkdocs build --strict" in line for line in (ROOT / ".ci" / "run").open())


# ------------------------------------------------------------------ running recipes


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory):
    """PATH with a ``specd`` shim for this checkout first, then this interpreter's bin."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "specd"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m specd_tools.cli "$@"\n')
    shim.chmod(0o755)
    ray_tmp = tempfile.mkdtemp(prefix="specd-dr-")  # Ray's socket paths stay short
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
               str(ROOT), os.environ.get("PYTHONPATH")])),
           "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent),
                                    os.environ.get("PATH", "")]),
           "RAY_TMPDIR": ray_tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    yield env
    shutil.rmtree(ray_tmp, ignore_errors=True)


def run_shell(body: str, env: dict, cwd: Path, timeout_s: float) -> str:
    """Runs a shell recipe in its own session; afterwards stops whatever it left running (by
    its process group, then SIGKILL) and fails on a non-zero exit. Returns its output (read
    from a file: a server it leaves running would hold a pipe open)."""
    log = cwd / f".recipe-{os.getpid()}-{id(body)}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body], env=env, cwd=cwd,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the recipe ran past {timeout_s} s:\n{log.read_text()[-4000:]}")
    finally:
        stop_group(proc.pid)
    text = log.read_text()
    log.unlink()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{text[-4000:]}"
    return text


def group_members(pgid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def stop_group(pgid: int, grace_s: float = 60) -> None:
    """SIGTERM to the recipe's own process group (a server drains, a `ray start --block` head
    shuts down), SIGKILL to what is left after ``grace_s``."""
    if not group_members(pgid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        wait_until(lambda: not group_members(pgid), grace_s, "the recipe's processes exiting")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.parametrize("recipe", of_kind("cheap"))
def test_cheap_recipe(recipe, shell_env, tmp_path):
    if recipe.lang == "python":
        subprocess.run([sys.executable, "-c", recipe.body], env=shell_env, cwd=tmp_path,
                       check=True, timeout=120)
    else:
        run_shell(recipe.body, shell_env, tmp_path, 120)


@pytest.fixture(scope="module")
def tiny_service():
    """The in-process Generation service with the HTTP API, on the tiny model (no Ray)."""
    from service_harness import LocalService

    service = LocalService(http=True).start()
    yield service
    service.stop()


def for_service(body: str, service) -> str:
    return (body.replace("127.0.0.1:50051", service.address)
            .replace("127.0.0.1:8000", service.http_address)
            .replace("SmolLM2-135M-Instruct", MODEL))


@pytest.mark.parametrize("recipe", of_kind("service"))
def test_service_recipe(recipe, tiny_service, shell_env, tmp_path, capsys):
    if "requires" in recipe.attrs and shutil.which(recipe.attrs["requires"]) is None:
        pytest.skip(f"{recipe.attrs['requires']} is not installed")
    body = for_service(recipe.body, tiny_service)
    if recipe.lang == "python":
        exec(compile(body, recipe.id, "exec"), {"__name__": "__recipe__"})  # noqa: S102
        assert capsys.readouterr().out.strip(), "the snippet printed nothing"
    else:
        out = run_shell(body, shell_env, tmp_path, 120)
        assert '"error"' not in out and "error:" not in out, out


SLOW_PAGES = sorted({r.page for r in ALL if r.kind == "slow"})
# The `ray start --head` flags whose ports default to fixed numbers (GCS 6379, job API 8265,
# dashboard agent 52365, client server 10001): another Ray on the machine may hold any of them.
FIXED_PORT_FLAGS = ("--port", "--dashboard-port", "--dashboard-agent-listen-port",
                    "--ray-client-server-port")


def ray_heads(body: str) -> list[str]:
    """The ``ray start --head`` commands of a shell recipe, continuation lines joined."""
    joined = body.replace("\\\n", " ")
    return [line for line in joined.splitlines() if re.search(r"\bray start\b.*--head", line)]


def test_every_ray_head_in_the_docs_takes_free_ports():
    """A recipe that starts a Ray head names each port that would default to a fixed number,
    and as a variable (a free port picked first), never a number: as written, the recipe works
    beside another Ray on the machine."""
    heads = [(r.id, h) for r in ALL if r.lang not in ("python", "py") for h in ray_heads(r.body)]
    assert heads, "no recipe starts a Ray head: the check found nothing to check"
    for where, head in heads:
        for flag in FIXED_PORT_FLAGS:
            m = re.search(rf"{flag}[ =](\S+)", head)
            assert m, f"{where}: {flag} not given: Ray's fixed default may be taken\n{head}"
            assert m[1].startswith("$"), f"{where}: {flag} {m[1]} is a fixed port\n{head}"


@pytest.mark.slow
@pytest.mark.parametrize("page", SLOW_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_slow_recipes(page, shell_env, tmp_path):
    """The page's slow recipes in order, in one directory (the real model, an embedded Ray,
    a local Ray head), as written: each must finish without error, and what it started is
    stopped."""
    for recipe in (r for r in ALL if r.page == page and r.kind == "slow"):
        body = recipe.body
        if "file" in recipe.attrs:
            (tmp_path / recipe.attrs["file"]).write_text(body + "\n")
        elif recipe.lang == "python":
            subprocess.run([sys.executable, "-c", body], env=shell_env, cwd=tmp_path,
                           check=True, timeout=600)
        else:
            run_shell(body, shell_env, tmp_path, 600)


def head_recipe() -> str:
    """docs/cluster.md's local-head recipe up to the head answering (its ``until ray job
    list`` line): the head is started exactly as the page says."""
    (recipe,) = [r for r in ALL if r.page == DOCS / "cluster.md" and "ray start --head" in
                 r.body and "--node-ip-address 127.0.0.1" in r.body]
    lines = recipe.body.splitlines()
    (ready,) = [i for i, line in enumerate(lines) if line.startswith("until ray job list")]
    return "\n".join(lines[:ready + 1])


@pytest.mark.slow
def test_the_local_head_recipe_listens_on_loopback_only(shell_env, tmp_path):
    import ipaddress

    import psutil

    body = head_recipe()
    env = dict(shell_env)
    if "RAY_AUTH_TOKEN" not in env and not (Path.home() / ".ray" / "auth_token").exists():
        import secrets

        env["RAY_AUTH_TOKEN"] = secrets.token_hex(16)  # the token the head and `ray` share
    log = tmp_path / "head.log"
    with log.open("w") as out:  # `wait`: the shell stays while its head runs
        shell = subprocess.Popen(["bash", "-euo", "pipefail", "-c", body + "\necho READY\nwait"],
                                 env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    tree: list = []
    try:
        wait_until(lambda: "READY" in log.read_text() or shell.poll() is not None, 240,
                   "the head's job API answering")
        assert shell.poll() is None, log.read_text()[-3000:]
        root = psutil.Process(shell.pid)
        tree = [root, *root.children(recursive=True)]
        rows = []
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                name = " ".join(proc.cmdline())[:60]
                rows += [(c.laddr.ip, c.laddr.port, name) for c in proc.net_connections("inet")
                         if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM]

        def loopback(ip: str) -> bool:
            address = ipaddress.ip_address(ip)
            if address.version == 6 and address.ipv4_mapped is not None:
                address = address.ipv4_mapped
            return address.is_loopback

        # The GCS, raylet, dashboard, job agent at least.
        assert len(rows) >= 4, rows
        exposed = [row for row in rows if not loopback(row[0])]
        assert not exposed, f"the head listens beyond loopback: {exposed}"
    finally:
        # As the recipe ends (`kill $HEAD`): SIGTERM to `ray start --block` alone, which shuts
        # its head down in seconds. SIGTERM to the whole group at once makes its drain wait
        # ~60 s for a GCS that is itself stopping.
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if "--block" in proc.cmdline():
                    proc.terminate()
        with contextlib.suppress(pytest.fail.Exception):
            wait_until(lambda: not group_members(shell.pid), 60, "the head shutting down")
        stop_group(shell.pid)  # what is left, if anything: SIGTERM, then SIGKILL
        for proc in tree:  # anything of it that left the group: this test's own PIDs
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
