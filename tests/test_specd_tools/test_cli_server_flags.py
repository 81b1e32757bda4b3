"""What the client commands do with flags a running server cannot take, refused credentials
and counters: ``generate --server`` refuses service flags and sends only what the request
carries, ``serve`` refuses drafter workers for no drafter, UNAUTHENTICATED / 401 say how to
pass the token, ``status --json`` gives numbers, and ``--top-k -1`` is off as over HTTP."""

from __future__ import annotations

import json

import grpc
import pytest

from specd.v1 import generation_pb2
from specd_tools import cli

TINY = "tiny-random:vocab=64,seed=0,layers=2"


class _Refused(grpc.RpcError):
    """The error a gRPC call raises when the service refuses its token."""

    def code(self):
        return grpc.StatusCode.UNAUTHENTICATED

    def details(self):
        return "missing or invalid bearer token"


class _Capture:
    """`specd_tools.client.stream_generate` that records the request and answers with one
    final chunk (or raises ``error``)."""

    def __init__(self, error: Exception | None = None):
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.error = error

    def __call__(self, address, request, auth_token=None, tls_ca=None, timeout_s=None):
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        final = generation_pb2.GenerateResponse(token_ids=[5], text="x", finish_reason="length")
        final.usage.prompt_tokens, final.usage.completion_tokens = 3, 1
        return _Call([final])


class _Call(list):
    def cancel(self) -> None:
        pass


@pytest.fixture
def capture(monkeypatch):
    from specd_tools import client

    fake = _Capture()
    monkeypatch.setattr(client, "stream_generate", fake)
    return fake


@pytest.mark.parametrize("flags, named", [
    (["--model", TINY], "--model"),
    (["--dtype", "auto"], "--dtype"),  # given, even at the default's value
    (["--no-pipeline"], "--no-pipeline"),
    (["--pipeline", "on"], "--pipeline"),
    (["--no-adaptive"], "--no-adaptive"),
    (["--threads", "1"], "--threads"),
    (["--suffix-cache-requests", "4"], "--suffix-cache-requests"),
    (["--model", TINY, "--no-pipeline"], "--model, --no-pipeline configure a service"),
])
def test_generate_server_refuses_the_flags_that_configure_a_service(capsys, capture, flags,
                                                                    named):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--server", "127.0.0.1:1", *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"specd: error: {named}") and "not a request" in err, err
    assert capture.requests == []  # refused before any call


def test_generate_server_sends_the_drafter_and_cap_only_when_given(capsys, capture):
    assert cli.main(["generate", "hi", "--server", "127.0.0.1:1"]) == 0
    plain = capture.requests[-1].speculation
    assert plain.enabled and plain.drafter == "" and not plain.HasField("max_draft_len")
    assert cli.main(["generate", "hi", "--server", "127.0.0.1:1", "--drafter", "suffix",
                     "--max-draft-len", "4"]) == 0
    asked = capture.requests[-1].speculation
    assert asked.drafter == "suffix" and asked.max_draft_len == 4
    assert cli.main(["generate", "hi", "--server", "127.0.0.1:1", "--drafter", "none"]) == 0
    assert not capture.requests[-1].speculation.enabled
    capsys.readouterr()


def test_serve_refuses_drafter_workers_for_no_drafter(monkeypatch, capsys):
    from coordinator.cluster import service

    monkeypatch.setattr(service.Service, "start",
                        lambda *_a, **_k: pytest.fail("the service started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--drafter", "none", "--drafters", "2", "--model", TINY])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "specd: error: --drafters: drafter 'none' runs no drafter workers, got 2" in err


def test_unauthenticated_says_to_pass_the_token(monkeypatch, capsys, capture):
    from specd_tools import client

    capture.error = _Refused()
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--server", "127.0.0.1:1"])
    assert info.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("specd: error: UNAUTHENTICATED: missing or invalid bearer token;")
    assert "--auth-token" in line and "$SPECD_AUTH_TOKEN" in line

    def refused(*_a, **_k):
        raise _Refused()

    monkeypatch.setattr(client, "get_status", refused)
    with pytest.raises(SystemExit):
        cli.main(["status", "--server", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert "UNAUTHENTICATED" in err and "--auth-token" in err, err


def test_bench_serve_says_to_pass_the_key_on_401():
    import asyncio

    import openai
    try:
        import httpx2 as httpx  # what this openai release is built on
    except ImportError:
        import httpx

    from specd_tools.bench.serve import first_model

    class Client:
        class models:  # noqa: N801 - the openai client's attribute
            @staticmethod
            async def list():
                response = httpx.Response(401, request=httpx.Request("GET", "http://h/v1/models"))
                raise openai.AuthenticationError("missing or invalid bearer token",
                                                 response=response, body=None)

    with pytest.raises(RuntimeError, match="--api-key or \\$OPENAI_API_KEY"):
        asyncio.run(first_model(Client(), "http://h/v1"))


def test_status_json_gives_counters_as_numbers(monkeypatch, capsys):
    from specd_tools import client

    status = generation_pb2.StatusResponse(model="m", steps=42, tokens_generated=2**40)
    status.replicas.add(name="replica-0", steps=7, restarts=1, tokens_per_second=1.5)
    status.drafters.add(name="drafter-0", calls=9, cache_bytes=123)
    monkeypatch.setattr(client, "get_status", lambda *_a, **_k: status)
    assert cli.main(["status", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 42 and out["tokens_generated"] == 2**40 and out["failed"] == 0
    assert out["replicas"][0]["steps"] == 7 and out["replicas"][0]["restarts"] == 1
    assert out["drafters"][0]["calls"] == 9 and out["drafters"][0]["cache_bytes"] == 123
    assert out["replicas"][0]["tokens_per_second"] == 1.5


def test_top_k_minus_one_is_off_as_over_http(capsys):
    def tokens(top_k: str) -> list[int]:
        assert cli.main(["generate", "abcabc", "--model", TINY, "--in-process", "--json",
                         "--temperature", "1", "--seed", "3", "--top-k", top_k,
                         "--max-new-tokens", "8"]) == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert tokens("-1") == tokens("0")
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "x", "--model", TINY, "--in-process", "--top-k", "-2"])
    assert info.value.code == 2 and "--top-k" in capsys.readouterr().err


def test_in_process_says_when_it_checks_this_machines_kernels(monkeypatch, tmp_path, capsys):
    import target_worker.invariant as inv

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))  # no verdicts stored yet
    monkeypatch.setattr(inv, "_VERDICTS", {})
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())
    argv = ["generate", "abcabc", "--model", TINY, "--in-process", "--max-new-tokens", "2"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "[specd] checking this machine's matmul kernels for batch invariance" in err
    assert str(tmp_path / "batch_invariance.json") in err
    monkeypatch.setattr(inv, "_VERDICTS", {})  # a later start: every verdict is stored
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())
    assert cli.main(argv) == 0
    assert "checking this machine's" not in capsys.readouterr().err
