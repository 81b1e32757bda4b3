"""The service on an embedded local Ray: the same code path `specd serve` runs (target actor,
drafter actor serving gRPC, coordinator actor fronting the Generation API)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time

import grpc
import pytest
from service_harness import MODEL, serve_process

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.registry import DEFAULT_DRAFTER
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.request import SpeculativeOptions
from target_worker.loader import load_model


@pytest.fixture(scope="module")
def ray_service():
    # adaptive=False: the assertions below need drafts verified, which a timed choice may skip.
    svc = Service(ServiceConfig(model=MODEL, port=0, ngram_size=2, max_draft_len=6,
                                target_threads=1, drafter_timeout_s=2.0, adaptive=False))
    svc.start()
    yield svc
    svc.stop()


def greedy_request(prompt, max_new):
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new, ignore_eos=True)
    req.token_ids.ids.extend(prompt)
    return req


def test_greedy_through_ray_and_grpc_equals_the_core(ray_service):
    decoder, _ = load_model(MODEL)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    expected = speculative_decode_with(decoder, prompt, decoder.new_cache(),
                                       PromptLookupSpeculator(2, 6),
                                       SpeculativeOptions(max_new_tokens=30)).generated_tokens
    with grpc.insecure_channel(ray_service.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens, final = [], None
        for chunk in stub.Generate(greedy_request(prompt, 30), timeout=120):
            tokens.extend(chunk.token_ids)
            final = chunk
        assert tokens == expected
        assert final.speculation.accepted_tokens > 0
        status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
        assert status.used_slots == 0 and status.drafter == DEFAULT_DRAFTER
        # Embedded: everything on this one loopback node, named in Status.
        assert [r.node for r in status.replicas] == ["127.0.0.1"]
        assert [d.node for d in status.drafters] == ["127.0.0.1"]


def test_killing_the_drafter_actor_mid_stream_keeps_the_tokens(ray_service):
    import ray

    decoder, _ = load_model(MODEL)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    expected = speculative_decode_with(decoder, prompt, decoder.new_cache(), None,
                                       SpeculativeOptions(max_new_tokens=40)).generated_tokens
    drafter = ray_service.drafter_actor
    with grpc.insecure_channel(ray_service.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(greedy_request(prompt, 40), timeout=120)
        tokens = list(next(call).token_ids)
        ray.kill(drafter)
        final = None
        for chunk in call:
            tokens.extend(chunk.token_ids)
            final = chunk
    assert tokens == expected
    assert final.finish_reason == "length"


@pytest.mark.slow  # its own `specd serve` and Ray (~14 s). In the quick suite: a SIGTERM'd serve
# drains and exits 0 (test_serve_http.py::test_a_sigterm_to_the_serve_process_group_still_drains)
# and nothing of serve's Ray outlives it however it ends, kill -9 included
# (test_serve_lifecycle.py::test_nothing_of_serve_outlives_its_kill_9).
def test_specd_serve_stops_cleanly_on_sigterm():
    # A separate process with its own embedded Ray: SIGTERM must leave no Ray processes of its
    # session behind.
    with serve_process("--model", MODEL, "--target-threads", "1") as (proc, address, tmp_path):
        with grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            reply = stub.GenerateUnary(greedy_request([1, 2, 3], 3), timeout=60)
            assert len(reply.token_ids) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    # Ray's processes of that session ran out of tmp_path; none may survive it.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        leftover = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True,
                                  text=True).stdout.split()
        if not leftover:
            break
        time.sleep(0.5)
    assert not leftover, f"stray Ray processes: {leftover}"
    shutil.rmtree(tmp_path, ignore_errors=True)
