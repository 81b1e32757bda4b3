"""The real failure on an embedded Ray: SIGKILL of the target replica's actor process while a
stream runs. The stream ends fast with UNAVAILABLE and a message free of Ray internals, health
goes NOT_SERVING then SERVING as the coordinator re-creates the replica, and the same request
afterwards gives the same tokens as before the kill."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_harness import MODEL, run_in_thread

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from coordinator.front.grpc_api import GENERATION_SERVICE
from specd.v1 import generation_pb2, generation_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def plain_request(prompt, max_new):
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new, ignore_eos=True)
    req.token_ids.ids.extend(prompt)
    req.speculation.enabled = False  # one token per step: the stream lasts long enough
    return req


def watch_health(address: str) -> list[int]:
    """Health statuses of the Generation service as they change, until it is SERVING again
    after having been NOT_SERVING (or the 120 s deadline)."""
    seen = []
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE),
                           timeout=120)
        for reply in watch:
            seen.append(reply.status)
            if reply.status == SERVING and NOT_SERVING in seen:
                watch.cancel()
                break
    return seen


def test_sigkill_of_the_target_actor_mid_stream_fails_fast_and_the_replica_comes_back():
    import ray

    cfg = ServiceConfig(model=MODEL, port=0, drafter="none", target_threads=1, adaptive=False)
    with Service(cfg) as svc:
        prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
        with grpc.insecure_channel(svc.address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            before = list(stub.GenerateUnary(plain_request(prompt, 200), timeout=120).token_ids)
            handle = ray.get(svc.coordinator.replica_handles.remote())["replica-0"]
            pid = ray.get(handle.__ray_call__.remote(lambda actor: os.getpid()))
            internals = [str(pid), handle._actor_id.hex(), ray.util.get_node_ip_address()]
            watcher = run_in_thread(watch_health, svc.address)
            call = stub.Generate(plain_request(prompt, 200), timeout=120)
            got = list(next(call).token_ids)
            os.kill(pid, signal.SIGKILL)  # the replica's process, started by this test
            with pytest.raises(grpc.RpcError) as err:
                for chunk in call:
                    got.extend(chunk.token_ids)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            for secret in internals:
                assert secret not in err.value.details(), err.value.details()
            assert len(got) < len(before)
            seen = watcher.result(timeout=120)
            assert seen[0] == SERVING and seen[-1] == SERVING and NOT_SERVING in seen
            after = list(stub.GenerateUnary(plain_request(prompt, 200), timeout=120).token_ids)
            assert after == before
        (replica,) = svc.status()["replicas"]
        assert replica["state"] == "serving" and replica["restarts"] == 1
