"""The service over gRPC (scheduler, target engine, drafter worker, Generation API) on a tiny
random model: batching never changes a request's output, bad input is refused, faults in the
drafter cost speed only, cancellation frees slots."""

from __future__ import annotations

import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from service_harness import LocalService, run_in_thread

from coordinator.front.grpc_api import sampling_from_proto
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd.v1 import generation_pb2
from specd_core.request import SpeculativeOptions


@pytest.fixture(scope="module")
def service():
    svc = LocalService().start()
    yield svc
    svc.stop()


def request(prompt, max_new=24, seed=None, max_draft_len=None, speculate=True, **sampling):
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new, ignore_eos=True)
    req.token_ids.ids.extend(prompt)
    for name, value in sampling.items():
        setattr(req.sampling, name, value)
    if seed is not None:
        req.seed = seed
    if max_draft_len is not None:
        req.speculation.max_draft_len = max_draft_len
    if not speculate:
        req.speculation.enabled = False
    return req


def solo(service, req) -> list[int]:
    """The same request run alone in-process with the core loop and the same drafts."""
    params = sampling_from_proto(req.sampling)
    k = service.drafter_impl.max_draft_len
    if req.speculation.HasField("max_draft_len"):
        k = min(k, req.speculation.max_draft_len)
    drafter = None
    if (not req.speculation.HasField("enabled") or req.speculation.enabled) and k > 0:
        drafter = PromptLookupSpeculator(service.drafter_impl.ngram_size, k)
    result = speculative_decode_with(
        service.decoder, list(req.token_ids.ids), service.decoder.new_cache(), drafter,
        SpeculativeOptions(max_new_tokens=req.max_new_tokens, sampling=params,
                           seed=req.seed if req.HasField("seed") else None),
    )
    return result.generated_tokens


def stream_tokens(service, req) -> tuple[list[int], generation_pb2.GenerateResponse]:
    channel, stub = service.stub()
    with channel:
        tokens, last = [], None
        for chunk in stub.Generate(req, timeout=60):
            tokens.extend(chunk.token_ids)
            last = chunk
    return tokens, last


REPEATING = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
MIXED = [
    request(REPEATING),                                                  # greedy, lookup hits
    request([11, 3, 40, 22, 17, 9, 31]),                                 # greedy, few hits
    request(REPEATING, max_draft_len=2),                                 # short drafts
    request(REPEATING, speculate=False),                                 # no speculation
    request(REPEATING, seed=7, temperature=1.0),                         # seeded sampling
    request([2, 4, 2, 4, 2, 4], seed=3, temperature=0.8, top_k=10, top_p=0.9),
    request([1, 2, 3, 1, 2, 3], repetition_penalty=1.3, frequency_penalty=0.5),
    request([9, 9, 9, 9], seed=11, temperature=1.2, min_p=0.05, max_draft_len=3),
]


def test_concurrent_mixed_requests_each_equal_their_solo_run(service):
    expected = [solo(service, r) for r in MIXED]
    for order_seed in (0, 1):
        order = list(range(len(MIXED)))
        random.Random(order_seed).shuffle(order)
        futures = {i: run_in_thread(stream_tokens, service, MIXED[i]) for i in order}
        for i, future in futures.items():
            tokens, final = future.result(timeout=120)
            assert tokens == expected[i], f"request {i} changed when batched"
            assert final.finish_reason == "length"
            assert final.usage.completion_tokens == len(tokens)
    # The lookup-friendly greedy request really was speculated.
    tokens, final = stream_tokens(service, MIXED[0])
    assert final.speculation.accepted_tokens > 0
    assert final.speculation.forward_calls < len(tokens)


def test_same_seed_same_tokens_alone_or_batched_and_unseeded_requests_differ(service):
    seeded = request(REPEATING, seed=42, temperature=1.0, max_new=16)
    alone, _ = stream_tokens(service, seeded)
    noise = [run_in_thread(stream_tokens, service, request([3, 1, 4, 1, 5], seed=s,
                                                           temperature=1.0, max_new=30))
             for s in range(4)]
    batched = run_in_thread(stream_tokens, service, seeded)
    assert batched.result(timeout=120)[0] == alone
    for f in noise:
        f.result(timeout=120)
    unseeded = {tuple(stream_tokens(service, request(REPEATING, temperature=1.0,
                                                     max_new=16))[0]) for _ in range(4)}
    assert len(unseeded) > 1


@pytest.mark.parametrize(
    "mutate,field",
    [
        (lambda r: r.ClearField("token_ids"), "prompt"),
        (lambda r: setattr(r, "text", ""), "prompt"),
        (lambda r: r.token_ids.ids.append(64), "token_ids"),
        (lambda r: r.token_ids.ids.append(-1), "token_ids"),
        (lambda r: setattr(r.sampling, "temperature", -0.5), "temperature"),
        (lambda r: setattr(r.sampling, "top_p", 0.0), "top_p"),
        (lambda r: setattr(r.sampling, "top_p", 1.5), "top_p"),
        (lambda r: setattr(r.sampling, "top_k", -2), "top_k"),
        # HTTP's rules (`coordinator.front.generation_request`): a chat role, a draft cap >= 1.
        (lambda r: r.chat.messages.add(role="bogus", content="hi"), "chat.messages[0].role"),
        (lambda r: r.chat.messages.extend([generation_pb2.ChatMessage(role="user", content="a"),
                                           generation_pb2.ChatMessage(role="", content="b")]),
         "chat.messages[1].role"),
        (lambda r: setattr(r.speculation, "max_draft_len", 0), "speculation.max_draft_len"),
        (lambda r: setattr(r, "max_new_tokens", 0), "max_new_tokens"),
        (lambda r: setattr(r, "max_new_tokens", 100_000), "max_new_tokens"),
        (lambda r: setattr(r.speculation, "drafter", "medusa"), "drafter"),
        (lambda r: r.token_ids.ids.extend([1] * 300), "prompt"),
    ],
)
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(service, mutate, field):
    bad = request([1, 2, 3], max_new=4)
    mutate(bad)
    channel, stub = service.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(bad, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(("prompt", "token_ids", "chat", "sampling.",
                                               "max_new_tokens", "speculation."))
        assert field in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(bad, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        good = stub.GenerateUnary(request([1, 2, 3], max_new=4), timeout=30)
        assert len(good.token_ids) == 4


def test_a_second_server_on_a_busy_port_is_refused(service):
    from coordinator.front.grpc_api import GenerationServicer, start_generation_server

    port = int(service.address.rsplit(":", 1)[1])
    servicer = GenerationServicer(service.scheduler, service.tokenizer, 64, 256,
                                  "prompt-lookup", "tiny")
    with pytest.raises(ValueError, match="cannot listen"):
        service.call(start_generation_server(servicer, "127.0.0.1", port))


def test_top_k_minus_one_is_off_over_grpc_as_over_http(service):
    # vLLM's "off" (-1) is 0 over either API
    # (`coordinator.front.generation_request.sampling_params`).
    assert sampling_from_proto(generation_pb2.SamplingParams(top_k=-1)).top_k == 0
    minus_one = stream_tokens(service, request(REPEATING, seed=5, temperature=1.0, top_k=-1,
                                               max_new=12))[0]
    assert minus_one == stream_tokens(service, request(REPEATING, seed=5, temperature=1.0,
                                                       top_k=0, max_new=12))[0]


def test_unary_equals_streaming(service):
    req = request(REPEATING, seed=5, temperature=0.9)
    channel, stub = service.stub()
    with channel:
        unary = stub.GenerateUnary(req, timeout=60)
    tokens, final = stream_tokens(service, req)
    assert list(unary.token_ids) == tokens
    assert unary.finish_reason == final.finish_reason


def test_cancelling_a_stream_frees_its_slot(service):
    channel, stub = service.stub()
    with channel:
        call = stub.Generate(request(REPEATING, max_new=200), timeout=60)
        first = next(call)
        assert first.token_ids
        call.cancel()
        # The scheduler notices at its next step boundary; Status reports it. Wait on the
        # condition (bounded), not on a sleep.
        for _ in range(500):
            status = stub.Status(generation_pb2.StatusRequest(), timeout=10)
            if status.used_slots == 0 and status.active_requests == 0:
                break
            service.call(_yield_loop())
        assert status.used_slots == 0 and status.active_requests == 0
        assert service.engine.used_slots == 0


async def _yield_loop():
    import asyncio

    await asyncio.sleep(0)


def test_health_and_reflection(service):
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "specd.v1.Generation"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"specd.v1.Generation", "grpc.health.v1.Health"} <= names
    with grpc.insecure_channel(service.drafter_address) as channel:
        refl = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        assert "specd.v1.Drafter" in {s.name for r in replies
                                       for s in r.list_services_response.service}


def test_a_killed_drafter_costs_speed_not_tokens():
    svc = LocalService(drafter_timeout_s=0.5).start()
    try:
        req = request(REPEATING, max_new=40)
        expected = solo(svc, req)
        channel, stub = svc.stub()
        with channel:
            call = stub.Generate(req, timeout=120)
            tokens = list(next(call).token_ids)
            svc.stop_drafter()
            final = None
            for chunk in call:
                tokens.extend(chunk.token_ids)
                final = chunk
        assert tokens == expected
        assert final.finish_reason == "length"
        assert final.speculation.drafter_failures > 0
    finally:
        svc.stop()


def test_the_bearer_token_is_required_except_for_health():
    svc = LocalService(auth_token="s3cret").start()
    try:
        req = request([1, 2, 3], max_new=3)
        with grpc.insecure_channel(svc.address) as channel:
            from specd.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            for metadata in (None, [("authorization", "Bearer wrong")]):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GenerateUnary(req, metadata=metadata, timeout=30)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(req, metadata=metadata, timeout=30))
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 6750)
                ok = stub.GenerateUnary(req, metadata=[("authorization", f"{scheme} s3cret")],
                                        timeout=30)
                assert len(ok.token_ids) == 3
            health = health_pb2_grpc.HealthStub(channel)
            reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        svc.stop()


def test_tls_with_a_bearer_token(tmp_path):
    import shutil
    import subprocess

    from coordinator.front.grpc_api import GenerationServicer, start_generation_server
    from specd.v1 import generation_pb2_grpc

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost"], check=True, capture_output=True)
    svc = LocalService().start()
    try:
        servicer = GenerationServicer(svc.scheduler, svc.tokenizer, 64, 256, "prompt-lookup",
                                      "tiny")
        server, port = svc.call(start_generation_server(
            servicer, "127.0.0.1", 0, cert.read_bytes(), key.read_bytes(), "tok"))
        creds = grpc.ssl_channel_credentials(cert.read_bytes())
        req = request([1, 2, 3], max_new=3)
        with grpc.secure_channel(f"localhost:{port}", creds) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            reply = stub.GenerateUnary(req, metadata=[("authorization", "Bearer tok")],
                                       timeout=30)
            assert len(reply.token_ids) == 3
            with pytest.raises(grpc.RpcError) as err:
                stub.GenerateUnary(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:  # plaintext is refused
            with pytest.raises(grpc.RpcError) as err:
                generation_pb2_grpc.GenerationStub(channel).GenerateUnary(
                    req, metadata=[("authorization", "Bearer tok")], timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        svc.call(server.stop(None))
    finally:
        svc.stop()
