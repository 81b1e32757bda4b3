"""Tenant isolation through both APIs, timing-free: a request's speculation counters and its
``cached_tokens`` depend only on its own (tenant, ``cache_salt``) partition's history (the
suffix drafter's previous outputs and warm KV prefixes are partitioned), while a tenant still
gains from its own. Greedy, fixed draft lengths, no pipelining: the counters are then a
function of the partition's state alone, so "equal to a fresh server's" is exact."""

from __future__ import annotations

import grpc
import pytest
from service_harness import LocalService

from coordinator.front.tenants import Tenants
from drafter_worker.suffix import SuffixDrafter
from specd.v1 import generation_pb2

try:  # the openai client's HTTP library (renamed httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

TOKENS = {"a": "tok-a", "b": "tok-b", "admin": "tok-admin"}
#: A prompt long enough that a warm prefix and a remembered output both show.
PROMPT = [5, 9, 2, 33, 17, 8, 41, 3, 27, 12, 50, 6, 19, 44, 1, 30, 22, 7, 38, 15]
COUNTERS = ("forward_calls", "verification_steps", "drafted_tokens", "accepted_tokens",
            "evaluated_at_position", "accepted_at_position")


def _service() -> LocalService:
    return LocalService(auth_token=Tenants((TOKENS["a"], TOKENS["b"]),
                                           admin_token=TOKENS["admin"]),
                        drafter_impl=SuffixDrafter(max_draft_len=8), http=True).start()


@pytest.fixture
def services():
    shared, fresh = _service(), _service()
    yield shared, fresh
    shared.stop()
    fresh.stop()


def _grpc(service, who: str, prompt: list[int], salt: str | None = None) -> dict:
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt),
                                         max_new_tokens=40, ignore_eos=True)
    if salt is not None:
        req.cache_salt = salt
    channel, stub = service.stub()
    with channel:
        out = stub.GenerateUnary(req, metadata=[("authorization", f"Bearer {TOKENS[who]}")],
                                 timeout=60)
    counters = {k: getattr(out.speculation, k) for k in COUNTERS}
    counters = {k: list(v) if not isinstance(v, int) else v for k, v in counters.items()}
    return {"tokens": list(out.token_ids), "cached_tokens": out.usage.cached_tokens, **counters}


def _http(service, who: str, prompt: list[int], salt: str | None = None) -> dict:
    body = {"model": service.model, "prompt": prompt, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"http://{service.http_address}/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {TOKENS[who]}"})
    assert r.status_code == 200, r.text
    out = r.json()
    return {"text": out["choices"][0]["text"],
            "cached_tokens": out["usage"]["prompt_tokens_details"]["cached_tokens"],
            **{k: out["speculation"][k] for k in COUNTERS}}


@pytest.mark.parametrize("call", [_grpc, _http], ids=["grpc", "http"])
def test_another_tenant_sees_a_fresh_servers_counters_and_the_same_tenant_gains(services, call):
    shared, fresh = services
    reference = call(fresh, "b", PROMPT)  # a server that never saw the prompt
    assert reference["cached_tokens"] == 0
    first = call(shared, "a", PROMPT)
    assert first == reference  # nothing was cached for anyone yet
    theirs = call(shared, "b", PROMPT)  # B sends A's very request
    assert theirs == reference
    again = call(shared, "a", PROMPT)  # A again: its own warm prefix and previous output
    assert {k: v for k, v in again.items() if k not in COUNTERS and k != "cached_tokens"} == {
        k: v for k, v in reference.items() if k not in COUNTERS and k != "cached_tokens"}
    assert again["cached_tokens"] > 0
    assert again["forward_calls"] < reference["forward_calls"]
    assert again["accepted_tokens"] > reference["accepted_tokens"]


@pytest.mark.parametrize("call", [_grpc, _http], ids=["grpc", "http"])
def test_a_cache_salt_partitions_within_a_tenant(services, call):
    shared, fresh = services
    reference = call(fresh, "a", PROMPT, salt="s1")
    assert call(shared, "a", PROMPT, salt="s1") == reference
    assert call(shared, "a", PROMPT, salt="s2") == reference  # another salt: fresh
    assert call(shared, "a", PROMPT) == reference  # no salt: the tenant's own partition
    again = call(shared, "a", PROMPT, salt="s1")
    assert again["cached_tokens"] > 0 and again["forward_calls"] < reference["forward_calls"]


def test_a_shared_cache_without_tenants_is_what_the_partitions_prevent():
    """The control: on a server without tokens one client's request does change another's
    counters (so the isolation tests above would fail on a shared cache)."""
    shared = LocalService(drafter_impl=SuffixDrafter(max_draft_len=8)).start()
    try:
        channel, stub = shared.stub()
        req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                             max_new_tokens=40, ignore_eos=True)
        with channel:
            first = stub.GenerateUnary(req, timeout=60)
            second = stub.GenerateUnary(req, timeout=60)
        assert second.usage.cached_tokens > 0 == first.usage.cached_tokens
        assert second.speculation.forward_calls < first.speculation.forward_calls
    finally:
        shared.stop()


def test_an_unknown_token_learns_nothing(services):
    shared, _ = services
    channel, stub = shared.stub()
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=PROMPT),
                                         max_new_tokens=4)
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(req, metadata=[("authorization", "Bearer tok-c")], timeout=60)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
