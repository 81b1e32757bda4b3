"""End to end on an embedded Ray, what ``specd serve --target-replicas 2 --drafters 2`` runs:
concurrent requests over two target replica actors and two drafter actors, then ``specd
scale`` down while streams run. Greedy outputs must equal the in-process core's."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from service_harness import MODEL, run_in_thread

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.request import SpeculativeOptions
from specd_tools.cli import main as specd
from target_worker.loader import load_model

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [11, 3, 40, 22, 17, 9, 31],
           [2, 4, 2, 4, 2, 4], [1, 2, 3, 1, 2, 3, 1], [9, 9, 9, 9], [7, 1, 7, 1, 7, 1, 7, 1]]


def greedy(prompt, max_new):
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new, ignore_eos=True)
    req.token_ids.ids.extend(prompt)
    return req


def stream(address, req):
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        return [t for chunk in stub.Generate(req, timeout=300) for t in chunk.token_ids]


@pytest.mark.slow
def test_two_replicas_two_drafters_on_ray_then_scale_down_while_streaming(capsys):
    decoder, _ = load_model(MODEL)

    def solo(prompt, max_new):
        return speculative_decode_with(decoder, prompt, decoder.new_cache(),
                                       PromptLookupSpeculator(2, 6),
                                       SpeculativeOptions(max_new_tokens=max_new)
                                       ).generated_tokens

    cfg = ServiceConfig(model=MODEL, port=0, ngram_size=2, max_draft_len=6,
                        target_replicas=2, drafters=2, drafter_timeout_s=5.0,
                        metrics_port=0)
    with Service(cfg) as svc:
        jobs = [(PROMPTS[i % len(PROMPTS)], 20 + 3 * i) for i in range(12)]
        futures = [run_in_thread(stream, svc.address, greedy(p, n)) for p, n in jobs]
        for f, (p, n) in zip(futures, jobs, strict=True):
            assert f.result(timeout=300) == solo(p, n)
        status = svc.status()
        placed = {r["name"]: r["requests_placed"] for r in status["replicas"]}
        assert sorted(placed) == ["replica-0", "replica-1"] and min(placed.values()) > 0
        assert sum(placed.values()) == 12
        assert all(r["forward_seconds_per_call"] > 0 for r in status["replicas"])
        assert [d["name"] for d in status["drafters"]] == ["drafter-0", "drafter-1"]
        assert all(d["calls"] > 0 and d["errors"] == 0 for d in status["drafters"])

        with urllib.request.urlopen(f"http://{svc.metrics_address}/metrics", timeout=30) as r:
            text = r.read().decode()
        assert 'specd_replica_requests_placed_total{replica="replica-1"}' in text
        assert 'specd_drafter_calls_total{drafter="drafter-1"}' in text

        with pytest.raises(ValueError, match="target_replicas"):
            svc.scale(target_replicas=0)

        # Scale both down while long streams run: they finish unchanged.
        long_jobs = [(p, 150) for p in PROMPTS[:4]]
        running = [run_in_thread(stream, svc.address, greedy(p, n)) for p, n in long_jobs]
        assert specd(["scale", "--server", svc.address, "--drafters", "1",
                      "--target-replicas", "1"]) == 0
        assert "target_replicas=1 drafters=1" in capsys.readouterr().out
        for f, (p, n) in zip(running, long_jobs, strict=True):
            assert f.result(timeout=300) == solo(p, n)
        status = svc.status()
        assert len(status["replicas"]) == 1 and len(status["drafters"]) == 1
        assert len(svc.drafter_actors) == 1
        assert stream(svc.address, greedy(PROMPTS[0], 10)) == solo(PROMPTS[0], 10)
