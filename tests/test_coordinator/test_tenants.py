"""Tenants: tokens and their owners, admin-only RPCs and paths, ``cache_salt``, and the
partition each request's cross-request state is looked up in (`coordinator.front.tenants`)."""

from __future__ import annotations

import os

import grpc
import pytest
from service_harness import LocalService

from coordinator.front.tenants import (
    MAX_CACHE_SALT_CHARS,
    Tenant,
    Tenants,
    parse_tokens_file,
    partition_of,
)
from specd.v1 import generation_pb2
from specd_tools.client import status_table

try:  # the openai client's HTTP library (renamed httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


def test_a_tokens_file_names_tenants_and_admins_and_refuses_bad_lines():
    table = parse_tokens_file("# team tokens\nalice tok-a\nbob tok-b admin  # ops\n\n"
                              "carol Xy7#k2LmQ9pZ\n\tdave d\t#rotated\n")
    assert table == {"tok-a": Tenant("alice"), "tok-b": Tenant("bob", admin=True),
                     "Xy7#k2LmQ9pZ": Tenant("carol"),  # a '#' inside a token is the token's
                     "d": Tenant("dave")}
    for text, why in (("alice", "line 1: expected"), ("alice tok extra", "third word"),
                      ("al/ice tok", "tenant name"), ("a t\nb t", "line 2: this token is "
                                                                 "already given"),
                      ("# nothing\n", "no tokens")):
        with pytest.raises(ValueError, match=why):
            parse_tokens_file(text)


def test_the_only_token_is_the_admin_and_several_need_an_admin_token():
    assert Tenants(("one",)).lookup("one") == Tenant("key1", admin=True)
    several = Tenants(("a", "b"))
    assert several.lookup("a") == Tenant("key1") and several.lookup("b") == Tenant("key2")
    assert several.lookup("c") is None and several.lookup("") is None
    with_admin = Tenants(("a",), admin_token="root")
    assert with_admin.lookup("a") == Tenant("key1")  # not the admin once one is named
    assert with_admin.lookup("root") == Tenant("admin", admin=True)
    assert with_admin.from_authorization("bearer root") == Tenant("admin", admin=True)
    assert with_admin.from_authorization("Basic root") is None
    for bad in (("a", "a"), ("",), (" a",)):
        with pytest.raises(ValueError, match="--auth-token"):
            Tenants(bad)


def test_the_tokens_file_is_reloaded_when_it_changes_and_a_bad_edit_keeps_the_old(tmp_path):
    path = tmp_path / "tokens"
    path.write_text("alice tok-a\n")
    tenants = Tenants(tokens_file=str(path))
    assert tenants.lookup("tok-a") == Tenant("alice")
    assert tenants.lookup("tok-b") is None
    path.write_text("alice tok-a2\nbob tok-b admin\n")
    stamp = os.stat(path)
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 10**9))  # surely a new stamp
    assert tenants.reload_if_changed(now=1e9)
    assert tenants.lookup("tok-a") is None  # revoked
    assert tenants.lookup("tok-b") == Tenant("bob", admin=True)
    path.write_text("not a valid line at all\n")
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 2 * 10**9))
    assert not tenants.reload_if_changed(now=2e9)
    assert tenants.lookup("tok-b") == Tenant("bob", admin=True)  # still in force


def test_a_partition_is_shared_only_by_the_same_tenant_and_salt():
    assert partition_of("", None) == ""  # no tokens, no salt: the one shared partition
    keys = {partition_of(t, s) for t in ("", "alice", "bob") for s in (None, "x", "y")}
    assert len(keys) == 9  # every (tenant, salt) pair its own
    assert partition_of("alice", "x") == partition_of("alice", "x")
    assert "x" not in partition_of("alice", "x")  # the salt never travels as itself
    for bad in ("", "s" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(ValueError, match="cache_salt"):
            partition_of("alice", bad)


@pytest.fixture(scope="module")
def service():
    svc = LocalService(auth_token=Tenants(("tok-a", "tok-b"), admin_token="tok-admin"),
                       http=True).start()
    seen: list[str] = []
    submit = svc.router.submit

    def spy(*args, partition: str = "", **kwargs):
        seen.append(partition)
        return submit(*args, partition=partition, **kwargs)

    svc.router.submit = spy
    svc.partitions = seen
    yield svc
    svc.stop()


def _request(salt: str | None = None) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]),
                                         max_new_tokens=2, seed=1)
    if salt is not None:
        req.cache_salt = salt
    return req


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_grpc_requests_land_in_their_tenant_and_salt_partition(service):
    channel, stub = service.stub()
    with channel:
        for token, salt in (("tok-a", None), ("tok-a", None), ("tok-b", None),
                            ("tok-a", "s1"), ("tok-a", "s2")):
            stub.GenerateUnary(_request(salt), metadata=_bearer(token), timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(_request(""), metadata=_bearer("tok-a"), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("cache_salt:")
    a, a_again, b, a1, a2 = service.partitions[-5:]
    assert a == a_again == partition_of("key1", None)
    assert len({a, b, a1, a2}) == 4 and "" not in {a, b, a1, a2}


def test_status_and_scale_need_the_admin_token(service):
    channel, stub = service.stub()
    with channel:
        for call, message in ((stub.Status, generation_pb2.StatusRequest()),
                              (stub.Scale, generation_pb2.ScaleRequest(drafters=1))):
            with pytest.raises(grpc.RpcError) as err:
                call(message, metadata=_bearer("tok-a"), timeout=30)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "admin token" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:
                call(message, metadata=_bearer("nope"), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GenerateUnary(_request(), metadata=_bearer("tok-b"), timeout=60)
        status = stub.Status(generation_pb2.StatusRequest(), metadata=_bearer("tok-admin"),
                             timeout=30)
    assert status.total_slots > 0
    rows = {t.name: t for t in status.tenants}
    stats = service.call(_tenant_stats(service))
    assert set(rows) == set(stats) and "key2" in rows
    assert rows["key2"].requests == stats["key2"]["requests"]
    assert rows["key2"].prompt_tokens == stats["key2"]["prompt_tokens"]
    table = status_table(status)
    assert "tenant" in table and "key2" in table


def test_http_metrics_need_the_admin_token_and_count_per_tenant(service):
    base = f"http://{service.http_address}"
    body = {"model": service.model, "prompt": [1, 2, 3], "max_tokens": 2, "seed": 3}
    before = service.call(_tenant_stats(service))
    with httpx.Client(base_url=base, timeout=60) as http:
        for token in ("tok-a", "tok-b", "tok-b"):
            r = http.post("/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200, r.text
        r = http.get("/metrics", headers={"Authorization": "Bearer tok-a"})
        assert r.status_code == 403
        assert "admin token" in r.json()["error"]["message"]
        r = http.get("/metrics", headers={"Authorization": "Bearer tok-admin"})
        assert r.status_code == 200
        lines = r.text.splitlines()
        stats = service.call(_tenant_stats(service))
        for tenant in ("key1", "key2"):
            want = stats[tenant]["requests"]
            assert f'specd_tenant_requests_total{{tenant="{tenant}"}} {float(want)}' in lines
        old = {t: before.get(t, {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0})
               for t in ("key1", "key2")}
        for tenant, n in (("key1", 1), ("key2", 2)):  # what this test sent for each
            assert stats[tenant]["requests"] - old[tenant]["requests"] == n
            assert stats[tenant]["prompt_tokens"] - old[tenant]["prompt_tokens"] == 3 * n
            assert stats[tenant]["generation_tokens"] - old[tenant]["generation_tokens"] == 2 * n
        assert "admin" not in stats  # the admin sent nothing
        for salt in ("", 7, "s" * (MAX_CACHE_SALT_CHARS + 1)):
            r = http.post("/v1/completions", json={**body, "cache_salt": salt},
                          headers={"Authorization": "Bearer tok-a"})
            assert r.status_code == 400, (salt, r.text)
            assert r.json()["error"]["param"] == "cache_salt"
        before = len(service.partitions)
        r = http.post("/v1/completions", json={**body, "cache_salt": "team-1"},
                      headers={"Authorization": "Bearer tok-a"})
        assert r.status_code == 200
        assert service.partitions[before:] == [partition_of("key1", "team-1")]


async def _tenant_stats(service) -> dict:
    return {k: dict(v) for k, v in service.servicer.tenant_stats.items()}


def test_status_and_scale_send_the_admin_token_from_the_environment(monkeypatch):
    from specd_tools import cli

    monkeypatch.setenv("SPECD_AUTH_TOKEN", "tenant")
    monkeypatch.setenv("SPECD_ADMIN_TOKEN", "root")
    for command in (["status"], ["scale", "--drafters", "1"]):
        assert cli.build_parser().parse_args(command).auth_token == "root"
    monkeypatch.delenv("SPECD_ADMIN_TOKEN")
    assert cli.build_parser().parse_args(["status"]).auth_token == "tenant"


def test_serve_flags_make_the_service_token_table(tmp_path, monkeypatch):
    from coordinator.cluster.config import ServiceConfig
    from specd_tools import cli, commands

    monkeypatch.setenv("SPECD_AUTH_TOKEN", "from-env")
    args = cli.build_parser().parse_args(["serve", "--auth-token", "a", "--auth-token", "b",
                                          "--admin-token", "root"])
    assert commands._serve_tokens(args) == ("a", "b")  # the flags replace the environment's
    tenants = ServiceConfig(auth_token=commands._serve_tokens(args),
                            admin_token=args.admin_token).tenants()
    assert [tenants.lookup(t) for t in ("a", "b", "root", "from-env")] == [
        Tenant("key1"), Tenant("key2"), Tenant("admin", admin=True), None]
    assert commands._serve_tokens(cli.build_parser().parse_args(["serve"])) == ("from-env",)
    assert ServiceConfig().tenants() is None  # no token: an open API
    with pytest.raises(ValueError, match="--auth-tokens-file"):
        ServiceConfig(auth_tokens_file=str(tmp_path / "missing"))
    bad = tmp_path / "tokens"
    bad.write_text("alice\n")
    with pytest.raises(ValueError, match="line 1"):
        ServiceConfig(auth_tokens_file=str(bad))
    with pytest.raises(ValueError, match="already given"):
        ServiceConfig(auth_token=("a", "a"))
