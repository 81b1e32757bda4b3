"""``python -m drafter_worker --drafter eagle3 --drafter-path DIR`` as a standalone (remote)
worker: it reports the head's layers in Info, and a service whose drafter is that worker over
gRPC (the production `Router`, an in-process target capturing those layers, float16 rows on
the wire) gives plain decoding's greedy output with drafts accepted. A head that does not fit
the ``--model`` is refused before the worker listens, naming the field."""

from __future__ import annotations

import asyncio
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from drafters import plain_decode
from eagle3_heads import TINY, save_random_head, save_trained_head
from service_harness import LocalService

from drafter_worker.client import DrafterClient
from specd.v1 import generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
_SAFETY_S = 120  # guards a hung start; never reached by a passing test

PROMPTS = [[3, 9, 27, 17, 51, 26], [2, 4, 2, 4, 2, 4, 8]]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return save_trained_head(tmp_path_factory.mktemp("eagle3") / "head")


def start_worker(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "drafter_worker", "--port", "0",
                             "--model", TINY, *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listening_address(proc: subprocess.Popen) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], _SAFETY_S)
    assert ready, "the worker printed no listening line"
    line = proc.stdout.readline()
    match = re.fullmatch(r"drafter listening on (127\.0\.0\.1:\d+)\n", line)
    assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
    return match.group(1)


def stop_worker(proc: subprocess.Popen) -> int | None:
    """SIGTERM, then its exit status (killed, None, if it does not stop)."""
    code = None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=_SAFETY_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return code


class RemoteDrafterService(LocalService):
    """`LocalService` whose drafter is a worker someone else started, at ``drafter``."""

    def __init__(self, drafter: str, **kwargs):
        super().__init__(**kwargs)
        self.remote = drafter

    async def _start_drafter(self, name: str):
        return DrafterClient(self.remote, timeout_s=30.0, hidden_dtype="float16"), None


@pytest.mark.parametrize("name", ["eagle3", "eagle3+suffix"])
def test_a_standalone_eagle3_worker_reports_its_layers_and_drafts_for_a_service(name,
                                                                               head_dir):
    proc = start_worker("--drafter", name, "--drafter-path", str(head_dir))
    try:
        address = listening_address(proc)

        async def info():
            async with DrafterClient(address, timeout_s=30) as client:
                return await client.info()

        info = asyncio.run(info())
        assert info.wants_hidden and tuple(info.hidden_layers) == (2, 4, 5)
        assert info.name == {"eagle3": "Eagle3Drafter", "eagle3+suffix": "SuffixThenEagle3"}[name]
        service = RemoteDrafterService(address, model=TINY, dtype="float32").start()
        try:
            assert service.router.hidden_layers == (2, 4, 5)
            drafted = accepted = 0
            with grpc.insecure_channel(service.address) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for prompt in PROMPTS:
                    req = generation_pb2.GenerateRequest(max_new_tokens=40, ignore_eos=True)
                    req.token_ids.ids.extend(prompt)
                    reply = stub.GenerateUnary(req, timeout=_SAFETY_S)
                    assert list(reply.token_ids) == plain_decode(service.decoder, prompt, 40)
                    drafted += reply.speculation.drafted_tokens
                    accepted += reply.speculation.accepted_tokens
            assert drafted > 0 and accepted > 0
        finally:
            service.stop()
    finally:
        assert stop_worker(proc) == 0  # a clean SIGTERM stop


def test_a_head_that_does_not_fit_the_model_is_refused_before_listening(tmp_path):
    path = save_random_head(tmp_path / "head", vocab_size=96)
    proc = start_worker("--drafter", "eagle3", "--drafter-path", str(path))
    try:
        assert proc.wait(timeout=_SAFETY_S) == 1
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        stop_worker(proc)
    assert "listening" not in out
    assert err.strip().splitlines()[-1] == (
        f"drafter_worker: {path}: vocab_size: the head's is 96, the target's is 64")
