"""An in-process service for tests: target engine, drafter gRPC server, scheduler and the
Generation gRPC server on loopback, driven by an asyncio loop in a background thread (no Ray:
the Ray wiring has its own, fewer, tests); and `serve_process`, a real ``specd serve``
subprocess for the tests that need one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future

import grpc

from coordinator.cluster.router import Router
from coordinator.front.grpc_api import GenerationServicer, start_generation_server
from coordinator.step.targets import LocalTarget
from drafter_worker.client import DrafterClient
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.server import start_drafter_server
from specd.v1 import generation_pb2_grpc
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"


class LocalService:
    """Starts everything on a private event loop; ``address`` is the Generation API.

    The production front end (`Router`): ``replicas`` target engines (each its own slots over
    one shared decoder) and ``drafters`` drafter gRPC servers, all scalable with ``scale``.
    """

    def __init__(self, ngram_size: int = 2, max_draft_len: int = 6, max_active: int = 16,
                 auth_token: str | None = None, drafter_timeout_s: float = 2.0,
                 replicas: int = 1, drafters: int = 1, adaptive: bool = False,
                 cost_model=None, target_timeout_s: float | None = None,
                 restart_delay_s: float = 1.0, model: str = MODEL, pipeline: bool = False,
                 http: bool = False, drafter_impl=None, hidden_dtype: str = "float32",
                 dtype: str | None = None):
        # Fixed draft lengths by default: adaptive choices depend on measured time, and
        # tests asserting that drafts were verified need them not to. Adaptive has its own
        # tests (test_adaptive_service.py).
        self.model = model
        self.decoder, self.tokenizer = load_model(model, dtype)
        # Served by every drafter server (``drafter_impl``: another `Drafter`, e.g. a suffix
        # drafter with its cross-request cache).
        self.drafter_impl = drafter_impl or PromptLookupSpeculator(ngram_size, max_draft_len)
        self.max_active = max_active
        self.auth_token = auth_token
        self.drafter_timeout_s = drafter_timeout_s
        self.initial = (replicas, drafters)
        self.engines: dict[str, TargetEngine] = {}  # live replicas' engines by name
        self.destroyed: dict[str, int] = {}  # destroyed replica -> slots it still held
        self.drafter_servers: dict[str, grpc.aio.Server] = {}
        self.adaptive = adaptive
        self.cost_model = cost_model
        self.target_timeout_s = target_timeout_s
        self.restart_delay_s = restart_delay_s
        self.pipeline = pipeline
        self.http = http  # also the OpenAI HTTP API (``http_address``)
        self.hidden_dtype = hidden_dtype  # the drafter clients' wire dtype of hidden rows
        self.http_server = None
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def call(self, coro):
        """Runs a coroutine on the service loop and waits for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    async def _start_replica(self, name: str):
        engine = self.engines[name] = TargetEngine(self.decoder, max_slots=self.max_active)

        async def stop() -> None:
            self.destroyed[name] = engine.used_slots  # slots still held when destroyed
            del self.engines[name]

        return LocalTarget(engine), stop, {"vocab_size": self.decoder.config.vocab_size,
                                           "max_seq_len": self.decoder.config.max_seq_len,
                                           "n_layers": self.decoder.config.n_layers}

    async def _start_drafter(self, name: str):
        server, port = await start_drafter_server(self.drafter_impl)
        self.drafter_servers[name] = server

        async def stop() -> None:
            await self.drafter_servers.pop(name).stop(None)

        return DrafterClient(f"127.0.0.1:{port}", timeout_s=self.drafter_timeout_s,
                             hidden_dtype=self.hidden_dtype), stop

    async def _start(self) -> None:
        self.router = Router(self._start_replica, self._start_drafter,
                             max_active=self.max_active, adaptive=self.adaptive,
                             cost_model=self.cost_model, target_timeout_s=self.target_timeout_s,
                             restart_delay_s=self.restart_delay_s, pipeline=self.pipeline)
        replicas, drafters = self.initial
        await self.router.scale(target_replicas=replicas, drafters=drafters)
        servicer = self.servicer = GenerationServicer(
            self.router, self.tokenizer, vocab_size=self.decoder.config.vocab_size,
            max_seq_len=self.decoder.config.max_seq_len, drafter_name="prompt-lookup",
            model_name=self.model)
        self.server, port = await start_generation_server(
            servicer, "127.0.0.1", 0, auth_token=self.auth_token)
        self.address = f"127.0.0.1:{port}"
        if self.http:
            from coordinator.cluster.metrics import router_registry
            from coordinator.front.http_api import OpenAIApi
            from coordinator.front.http_server import start_http_server

            self.http_api = OpenAIApi(servicer, auth_token=self.auth_token,
                                      registry=router_registry(self.router, self.loop,
                                                               servicer.tenant_stats))
            self.http_server, http_port = await start_http_server(self.http_api)
            self.http_address = f"127.0.0.1:{http_port}"

    def start(self) -> LocalService:
        self.thread.start()
        self.call(self._start())
        return self

    @property
    def scheduler(self) -> Router:
        return self.router

    @property
    def engine(self) -> TargetEngine:
        """The first live replica's engine."""
        return next(iter(self.engines.values()))

    @property
    def drafter_address(self) -> str:
        return self.router.pool.serving()[0].client.address

    def stop_drafter(self) -> None:
        """Kills every drafter worker (no grace): later Propose calls fail."""
        for server in self.drafter_servers.values():
            self.call(server.stop(None))

    async def _stop(self) -> None:
        if self.http_server is not None:
            await self.http_server.stop()
        await self.server.stop(None)
        await self.router.close()

    def stop(self) -> None:
        self.call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def stub(self) -> tuple[grpc.Channel, generation_pb2_grpc.GenerationStub]:
        channel = grpc.insecure_channel(self.address)
        return channel, generation_pb2_grpc.GenerationStub(channel)


def run_scheduler(decoder, prompts, options, drafter: bool, batched: bool) -> list:
    """Serves ``prompts`` (each with its `SpeculativeOptions`) through the service's
    `Scheduler` in this process: the default drafter in process (``drafter``) or none, all
    at once (``batched``) or one at a time. Returns the finished requests, in order, each
    asserted to have ended without a failure."""
    from coordinator.step.scheduler import Scheduler
    from drafter_worker.local import LocalDrafter
    from drafter_worker.registry import DEFAULT_DRAFTER, build_drafter

    async def go():
        local = LocalDrafter(build_drafter(DEFAULT_DRAFTER)) if drafter else None
        engine = TargetEngine(decoder, max_slots=len(prompts))
        sched = Scheduler(LocalTarget(engine), local, max_active=len(prompts) if batched else 1)
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        assert all(r.cause is None for r in reqs), [r.cause for r in reqs]
        return reqs

    return asyncio.run(go())


def run_in_thread(fn, *args) -> Future:
    """Runs ``fn(*args)`` in a fresh thread; the returned future holds its result."""
    future: Future = Future()

    def target():
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting test
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return future


@contextlib.contextmanager
def serve_process(*args: str, new_session: bool = False):
    """Runs ``specd serve --port 0 ARGS`` as a subprocess with its own embedded Ray, whose
    files go to a short private temp dir (Ray's socket paths must stay under the 107-byte Unix
    limit). Yields ``(process, address, temp_dir)`` once it serves; afterwards kills it if it
    still runs (its own PID: the test's own process) and removes the temp dir.
    ``new_session``: it leads its own session and process group (as under a shell's job
    control or systemd), so the test can signal that group."""
    tmp = tempfile.mkdtemp(prefix="specd-sv-")
    proc = subprocess.Popen(
        [sys.executable, "-m", "specd_tools.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "RAY_TMPDIR": tmp}, start_new_session=new_session)
    try:
        line = ""
        proc.startup_output = []  # what it printed before serving (stderr included)
        for line in proc.stdout:
            proc.startup_output.append(line)
            if "serving specd.v1.Generation on" in line:
                break
        assert "serving" in line, "the server never came up:\n" + "".join(
            proc.startup_output)[-3000:]
        yield proc, line.rsplit(" on ", 1)[1].split()[0], tmp
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        shutil.rmtree(tmp, ignore_errors=True)


class SplitCharTokenizer:
    """The tiny tokenizer's encoding, but odd ids decode to the first two bytes of "€"
    (E2 82 AC) and even ids to "a": an output that ends on an odd id ends inside a character,
    as when the length limit splits an emoji's byte tokens."""

    def __init__(self, inner):
        self.inner = inner
        self.eos_token_id = inner.eos_token_id

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        raw = b"".join(b"\xe2\x82" if i % 2 else b"a" for i in ids
                       if not (skip_special_tokens and i == self.eos_token_id))
        return raw.decode("utf-8", errors="replace")
