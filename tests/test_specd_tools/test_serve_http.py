"""A live ``specd serve --http-port`` (its own embedded Ray, the tiny random model): the
OpenAI API answers through the Ray service with the gRPC API's tokens, and ``specd status``
shows the service as a table and as JSON."""

from __future__ import annotations

import json
import re

import grpc
import openai
import pytest
from service_harness import MODEL, serve_process

from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_tools import cli

try:  # the HTTP library the installed openai client uses
    import httpx2 as httpx
except ImportError:  # openai < 3
    import httpx


@pytest.fixture(scope="module")
def served():
    """``(grpc address, http address)`` of one ``specd serve`` for the module."""
    with serve_process("--model", MODEL, "--target-threads", "1", "--http-port", "0") as (
            proc, address, _tmp):
        http = None
        for line in proc.stdout:
            if "OpenAI API on" in line:
                http = line.rsplit("://", 1)[1].split("/")[0]
                break
        assert http, "the HTTP API was not announced"
        yield address, http, proc.startup_output


def test_start_up_reports_each_phase_with_its_time(served):
    lines = [line.strip() for line in served[2]]
    # The adaptive drafting's forward-cost calibration is start-up work, not the first
    # request's.
    # Each long phase is said as it starts, and again with its time when done; a replica
    # says which forward it runs.
    for phase in (r"starting Ray \(embedded, on loopback\)\.\.\.", r"Ray up \(\d+\.\d s\)",
                  r"starting 1 target replica\(s\) and 1 drafter\(s\): .*\.\.\.",
                  r"replica-0: model loaded, \S+ \S+ forward .* \(\d+\.\d s\)",
                  r"replica-0: forward cost calibrated \(\d+\.\d s\)",
                  r"drafter-0: drafter ready \(\d+\.\d s\)", r"ready in \d+\.\d s"):
        assert any(re.fullmatch(r"\[specd\] " + phase, line) for line in lines), (phase, lines)


def test_the_openai_api_serves_the_grpc_apis_tokens_through_ray(served):
    address, http, _ = served
    assert httpx.get(f"http://{http}/health").status_code == 200
    req = generation_pb2.GenerateRequest(text="abab", max_new_tokens=16, ignore_eos=True,
                                         seed=5)
    req.sampling.temperature = 0.8
    with grpc.insecure_channel(address) as channel:
        grpc_text = generation_pb2_grpc.GenerationStub(channel).GenerateUnary(
            req, timeout=60).text
    with openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0) as client:
        out = client.completions.create(model=MODEL, prompt="abab", max_tokens=16,
                                        temperature=0.8, seed=5,
                                        extra_body={"ignore_eos": True})
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="abab", max_tokens=16, temperature=0.8, seed=5, stream=True,
            extra_body={"ignore_eos": True}))
    assert out.choices[0].text == grpc_text == streamed
    assert out.usage.completion_tokens == 16


def test_specd_status_prints_a_table_and_json(served, capsys):
    address, _http, _ = served
    assert cli.main(["status", "--server", address]) == 0
    table = capsys.readouterr().out
    assert f"model {MODEL}" in table
    header = next(line for line in table.splitlines() if line.startswith("replica"))
    assert header.split()[:4] == ["replica", "node", "state", "tp"]
    row = table.splitlines()[table.splitlines().index(header) + 1].split()
    assert row[1:3] == ["127.0.0.1", "serving"]  # embedded: everything on this node
    assert any(line.startswith("drafter ") and "calls" in line for line in table.splitlines())

    assert cli.main(["status", "--server", address, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == MODEL and len(data["replicas"]) == 1
    assert data["replicas"][0]["state"] == "serving" and "tokens_per_second" in data["replicas"][0]
    assert data["replicas"][0]["node"] == "127.0.0.1" == data["drafters"][0]["node"]
    assert {"active_requests", "waiting_requests", "drafters"} <= set(data)


def test_specd_status_without_a_server_names_the_address(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["status", "--server", "127.0.0.1:1", "--timeout", "5"])
    assert info.value.code == 1
    err = capsys.readouterr().err
    assert "127.0.0.1:1" in err and "UNAVAILABLE" in err


@pytest.mark.slow
def test_smollm2_over_the_openai_api_equals_the_grpc_api():
    """The real model through a real ``specd serve --http-port``: models list, chat and
    completion unary and streamed, greedy and seeded text equal to the gRPC API's."""
    with serve_process("--http-port", "0") as (proc, address, _tmp):
        http = next(line for line in proc.stdout if "OpenAI API on" in line)
        http = http.rsplit("://", 1)[1].split("/")[0]
        with openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0,
                           timeout=300) as client, grpc.insecure_channel(address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            (model,) = [m.id for m in client.models.list()]
            assert model == "SmolLM2-135M-Instruct"
            question = "Name three rivers in Europe."
            for sampling in ({"temperature": 0.0}, {"temperature": 0.8, "seed": 42}):
                req = generation_pb2.GenerateRequest(max_new_tokens=40)
                req.chat.messages.add(role="user", content=question)
                req.sampling.temperature = sampling["temperature"]
                if "seed" in sampling:
                    req.seed = sampling["seed"]
                grpc_text = stub.GenerateUnary(req, timeout=300).text
                kw = dict(model=model, messages=[{"role": "user", "content": question}],
                          max_tokens=40, **sampling)
                unary = client.chat.completions.create(**kw).choices[0].message.content
                streamed = "".join(c.choices[0].delta.content or ""
                                   for c in client.chat.completions.create(stream=True, **kw))
                assert unary == grpc_text == streamed and unary.strip()
            raw = generation_pb2.GenerateRequest(text="def fibonacci(n):", max_new_tokens=32)
            raw.sampling.temperature = 0.0
            completion = client.completions.create(model=model, prompt="def fibonacci(n):",
                                                   max_tokens=32, temperature=0)
            streamed = "".join(c.choices[0].text for c in client.completions.create(
                model=model, prompt="def fibonacci(n):", max_tokens=32, temperature=0,
                stream=True))
            assert completion.choices[0].text == stub.GenerateUnary(raw, timeout=300).text \
                == streamed


def test_a_sigterm_to_the_serve_process_group_still_drains():
    """``kill -TERM -- -PGID`` (a shell job's group; systemd's default KillMode signals the
    whole cgroup instead, see README) reaches only ``specd serve``: Ray's processes lead
    their own groups, so the coordinator lives on and an in-flight stream finishes in the
    grace. Before, Ray's GCS, raylet and workers shared the group (the group check fails);
    this short stream could still finish then, as Ray's worker outlived the signal for a few
    seconds, which a long SmolLM2 stream does not."""
    import contextlib
    import json
    import os
    import signal

    import psutil

    with serve_process("--model", MODEL, "--target-threads", "1", "--http-port", "0",
                       "--drafter", "none", "--shutdown-grace", "60",
                       new_session=True) as (proc, _address, _tmp):
        http = next(line for line in proc.stdout if "OpenAI API on" in line)
        http = http.rsplit("://", 1)[1].split("/")[0]
        pgid = os.getpgid(proc.pid)
        assert pgid == proc.pid
        family = {}  # pid -> (command line, process group) of serve's descendants
        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                family[p.pid] = (" ".join(p.cmdline()), os.getpgid(p.pid))
        assert any("raylet" in cmd for cmd, _ in family.values())
        assert [cmd for cmd, group in family.values() if group == pgid] == []
        body = {"model": MODEL, "prompt": "ab", "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", f"http://{http}/v1/completions", json=body,
                          timeout=120) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            events.append(json.loads(next(lines)[len("data: "):]))
            os.killpg(pgid, signal.SIGTERM)
            for line in lines:
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
        assert events[-1] == "[DONE]" and "error" not in events[-2], events[-2]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=120) == 0
