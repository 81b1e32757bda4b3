"""The command line a user sees: defaults in every --help, no markup, --json keys that say
what they hold, errors naming the user's flag, --threads, printed text that never ends
inside a UTF-8 character, and `specd status`'s drafter table."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from service_harness import SplitCharTokenizer

from coordinator.cluster.config import target_thread_counts
from specd.v1 import generation_pb2
from specd_tools import cli, commands
from specd_tools.client import status_table
from target_worker.testing import load_tiny_random

TINY = "tiny-random:vocab=64,seed=0,layers=2"


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"": parser, **sub.choices}


@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_help_names_defaults_and_has_no_markup(command):
    parser = _subparsers()[command]
    text = parser.format_help()
    assert "`" not in text and "``" not in text
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        default = action.default
        if default is None or default is False or default == [] or default == argparse.SUPPRESS:
            continue
        if action.dest in ("auth_token",):  # from the environment: never printed
            continue
        assert "default" in (action.help or ""), (command, action.option_strings)


def test_the_auth_token_from_the_environment_is_not_shown(monkeypatch):
    monkeypatch.setenv("SPECD_AUTH_TOKEN", "do-not-print-me")
    for parser in _subparsers().values():
        assert "do-not-print-me" not in parser.format_help()


def test_json_keys_say_what_they_hold(capsys):
    assert cli.main(["generate", "abcabc", "--model", TINY, "--in-process", "--json",
                     "--max-new-tokens", "7"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == out["completion_tokens"] == 7
    assert "generated_tokens" not in out and "tokens_generated" not in out


def test_json_prints_the_object_instead_of_the_metrics_line(capsys):
    """``--json``: one object on stdout and no ``[specd]`` metrics line on stderr (the object
    holds its counters); without it the text streams and the metrics line follows."""
    base = ["generate", "abcabc", "--model", TINY, "--in-process", "--max-new-tokens", "5",
            "--no-adaptive"]  # no forward timing: the printing is under test
    assert cli.main([*base, "--json"]) == 0
    printed = capsys.readouterr()
    out = json.loads(printed.out)
    assert "[specd] new_tokens=" not in printed.err, printed.err
    assert {"forward_calls", "acceptance_length", "finish_reason"} <= out.keys()
    assert cli.main(base) == 0
    assert "[specd] new_tokens=" in capsys.readouterr().err


def test_generate_constrains_the_answer_to_a_json_schema_or_a_regex(capsys, tmp_path):
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    ascii_model = "tiny-random:vocab=128,seed=0,layers=2,ascii=1"
    assert cli.main(["generate", "hi", "--model", ascii_model, "--in-process", "--json",
                     "--json-schema", str(path), "--max-new-tokens", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert json.loads(out["text"]) in ({"ok": True}, {"ok": False})
    assert out["finish_reason"] == "stop" and out["forced_tokens"] > 0
    assert cli.main(["generate", "hi", "--model", ascii_model, "--in-process", "--json",
                     "--regex", "[a-c]{3}x", "--max-new-tokens", "10"]) == 0
    assert re.fullmatch("[a-c]{3}x", json.loads(capsys.readouterr().out)["text"])
    # Through a server: the gRPC request carries the constraint.
    from specd_core.sampling import SamplingParams
    from specd_tools.generate import GenerateOptions, generate_request

    req = generate_request(GenerateOptions("x", json_schema=str(path)), SamplingParams())
    assert json.loads(req.constraint.json_schema) == schema
    assert generate_request(GenerateOptions("x", regex="ab"), SamplingParams()
                            ).constraint.regex == "ab"
    with pytest.raises(SystemExit):
        cli.main(["generate", "hi", "--in-process", "--json-schema", str(path),
                  "--regex", "a"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--model", ascii_model, "--in-process",
                  "--json-schema", str(tmp_path / "missing.json")])
    assert info.value.code == 2
    assert "error: --json-schema: cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "x", "--in-process", "--top-p", "2"], "--top-p"),
    (["generate", "x", "--in-process", "--repetition-penalty", "0"], "--repetition-penalty"),
    (["serve", "--target-replicas", "0"], "--target-replicas"),
    (["serve", "--drafters", "-1"], "--drafters"),
    (["serve", "--max-batched-tokens", "-5"], "--max-batched-tokens"),
    (["serve", "--max-partial-prefills", "0"], "--max-partial-prefills"),
    (["serve", "--http-max-connections-per-peer", "-1"], "--http-max-connections-per-peer"),
    (["generate", "x", "--max-batched-tokens", "-1"], "--max-batched-tokens"),
    (["generate", "x", "--in-process", "--seed", "-1"], "--seed"),
])
def test_errors_name_the_users_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        cli.main([*argv, "--model", TINY])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {flag}" in err and "SamplingParams" not in err, err
    assert "---" not in err, err  # a message naming the flag itself is not rewritten


@pytest.mark.parametrize("argv, flag", [
    (["--max-prompt-bytes", "0"], "--max-prompt-bytes"),
    (["--http-port", "50051"], "--http-port"),
    (["--port", "7000", "--metrics-port", "7000"], "--metrics-port"),
])
def test_serve_refuses_bad_settings_before_ray_starts(monkeypatch, capsys, argv, flag):
    from coordinator.cluster import service

    monkeypatch.setattr(service.Service, "start",
                        lambda *_a, **_k: pytest.fail("the service started"))
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", *argv, "--model", TINY])
    assert info.value.code == 2
    err = capsys.readouterr().err
    want = "must differ from --" if flag.endswith("port") else "must be a positive integer"
    assert f"specd: error: {flag} {want}" in err, err


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_a_port_out_of_range_is_refused_by_the_parser(capsys, flag):
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", flag, "99999", "--model", TINY])
    assert info.value.code == 2
    assert f"argument {flag}: must be a port in [0, 65535], got 99999" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "hi", "--server", "127.0.0.1:1"],
                                  ["scale", "--server", "127.0.0.1:1", "--drafters", "1"],
                                  ["status", "--server", "127.0.0.1:1"]])
def test_a_closed_port_is_one_clear_line(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("specd: error: no specd server at 127.0.0.1:1 "
                           "(UNAVAILABLE: connection refused); start one"), line


class _DeadCoordinatorService:
    """`coordinator.cluster.service.Service` whose coordinator dies once serving (``when``: found by
    the liveness check, or while `serve` asks for the HTTP API's address)."""

    when = "check"
    stopped: list[float] = []

    def __init__(self, config):
        self.config = config

    def start(self, progress=None) -> str:
        return "127.0.0.1:1"

    @property
    def http_address(self) -> str:
        from ray.exceptions import RayActorError

        if self.when == "address":
            raise RayActorError()
        return "127.0.0.1:2"

    def coordinator_alive(self) -> bool:
        return False

    def stop(self, grace_s: float = 1.0) -> None:
        self.stopped.append(grace_s)


@pytest.mark.parametrize("when", ["check", "address"])
def test_a_dead_coordinator_ends_serve_with_one_error_line(monkeypatch, capsys, when):
    import signal

    from coordinator.cluster import service

    monkeypatch.setattr(service, "Service", _DeadCoordinatorService)
    monkeypatch.setattr(_DeadCoordinatorService, "when", when)
    monkeypatch.setattr(_DeadCoordinatorService, "stopped", [])
    monkeypatch.setattr(commands, "COORDINATOR_CHECK_S", 0.01)
    monkeypatch.setattr(signal, "signal", lambda *_args: None)  # keep pytest's handlers
    assert cli.main(["serve", "--model", TINY, "--port", "0", "--http-port", "0"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "shutting down" not in err, err
    assert [line for line in err.splitlines() if "error" in line] == [
        "[specd] error: the coordinator actor died; the service has stopped"]
    assert _DeadCoordinatorService.stopped == [0.0]  # cleaned up, nothing to drain


def test_a_dead_coordinators_stop_logs_no_traceback(monkeypatch, caplog):
    import ray

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service

    class DeadActor:
        class stop:  # an actor method handle
            @staticmethod
            def remote(_grace_s):
                return "ref"

    def get(_ref, timeout=None):
        raise ray.exceptions.RayActorError()

    killed = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", killed.append)
    svc = Service(ServiceConfig(model=TINY))
    svc.coordinator = actor = DeadActor()
    with caplog.at_level("INFO", logger="coordinator.cluster.service"):
        svc.stop()
    assert killed == [actor] and svc.coordinator is None
    assert not [r for r in caplog.records if r.exc_info or r.levelname == "ERROR"]


def test_in_process_says_it_loads_the_model(capsys):
    assert cli.main(["generate", "ab", "--model", TINY, "--in-process",
                     "--max-new-tokens", "1"]) == 0
    assert f"[specd] loading {TINY}...\n" in capsys.readouterr().err


def test_more_threads_than_cores_are_warned_about_and_still_run(monkeypatch, capsys):
    import coordinator.cluster.config

    threads = torch.get_num_threads()
    monkeypatch.setattr(coordinator.cluster.config, "usable_cpus", lambda: 1)
    try:
        assert cli.main(["generate", "ab", "--model", TINY, "--in-process",
                         "--max-new-tokens", "1", "--threads", "2"]) == 0
        assert "--threads 2 is more than this machine's 1 usable cores" in capsys.readouterr().err
        assert cli.main(["generate", "ab", "--model", TINY, "--in-process",
                         "--max-new-tokens", "1", "--threads", "1"]) == 0
        assert "warning" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_in_process_threads_default_to_every_core_with_a_fallback_and_threads_fixes_them(
        monkeypatch):
    import contextlib

    from target_worker import invariant

    threads = torch.get_num_threads()
    try:
        seen = []
        real = torch.set_num_threads

        @contextlib.contextmanager
        def unrecorded(count):  # batch-invariant one-thread sections are not step counts
            before = torch.get_num_threads()
            real(count)
            try:
                yield
            finally:
                real(before)

        monkeypatch.setattr(invariant, "torch_threads", unrecorded)
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
        assert cli.main(["generate", "ab", "--model", TINY, "--in-process",
                         "--max-new-tokens", "2"]) == 0
        full, fallback = target_thread_counts(1)
        # The process's count first; each forward then runs on it or on the fallback.
        assert seen[0] == full and set(seen) <= {full, fallback}
        seen.clear()
        assert cli.main(["generate", "ab", "--model", TINY, "--in-process",
                         "--max-new-tokens", "2", "--threads", "3"]) == 0
        assert seen[0] == 3 and set(seen) == {3}  # fixed: no fallback measured
    finally:
        torch.set_num_threads(threads)




def test_printed_text_never_ends_inside_a_character(monkeypatch, capsys):
    from target_worker import loader

    decoder, tokenizer = load_tiny_random(TINY)
    split = SplitCharTokenizer(tokenizer)
    monkeypatch.setattr(loader, "load_model", lambda _model, _dtype=None: (decoder, split))
    cut = 0
    for seed in range(6):
        base = ["generate", "hello", "--model", TINY, "--in-process", "--raw",
                "--temperature", "1", "--seed", str(seed), "--max-new-tokens", "5"]
        assert cli.main(base) == 0
        printed = capsys.readouterr().out
        assert cli.main([*base, "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        cut += split.decode(out["token_ids"]).endswith("\ufffd")
        assert not printed.rstrip("\n").endswith("\ufffd")
        assert not out["text"].endswith("\ufffd") and printed.rstrip("\n") == out["text"]
    assert cut, "no output ended inside a character: the case was not exercised"


def test_the_status_table_shows_prefix_hits_and_the_warm_cache_per_replica():
    s = generation_pb2.StatusResponse(replicas=[generation_pb2.ReplicaStatus(
        name="replica-0", state="serving", prefix_hits=3, prefix_queries=4,
        warm_positions=190, warm_bytes=8_740_000)])
    lines = status_table(s).splitlines()
    header = next(line for line in lines if line.startswith("replica "))
    row = next(line for line in lines if line.startswith("replica-0")).split()
    for multi in ("step ms", "ttft p50/p90 ms", "itl p50 ms", "prefix hits", "warm pos/MB"):
        header = header.replace(multi, multi.replace(" ", "_"))
    names = header.split()
    assert len(names) == len(row)
    assert row[names.index("prefix_hits")] == "3/4"
    assert row[names.index("warm_pos/MB")] == "190/8.7"


def test_the_status_table_shows_cache_size_and_hit_rate_for_drafters_with_a_cache():
    s = generation_pb2.StatusResponse(drafters=[
        generation_pb2.DrafterStatus(name="drafter-0", state="serving", has_cache=True,
                                     cache_outputs=1234, cache_bytes=2_500_000,
                                     proposals=200, global_hits=50),
        generation_pb2.DrafterStatus(name="drafter-1", state="serving")])
    lines = status_table(s).splitlines()
    header = next(line for line in lines if line.startswith("drafter "))
    assert header.split()[-7:] == ["cache", "outputs", "cache", "MB", "global", "hit", "rate"]
    row0 = next(line for line in lines if line.startswith("drafter-0"))
    row1 = next(line for line in lines if line.startswith("drafter-1"))
    assert row0.split()[-3:] == ["1234", "2.5", "25.0%"]
    assert row1.split()[-3:] == ["-", "-", "-"]
    # Without a cache anywhere, no cache columns.
    plain = status_table(generation_pb2.StatusResponse(drafters=[
        generation_pb2.DrafterStatus(name="drafter-0", state="serving")]))
    assert "cache" not in plain and "global hit" not in plain


class _FailingStartService(_DeadCoordinatorService):
    """A `Service` whose start fails as a missing model's does: nothing was ever served."""

    def start(self, progress=None) -> str:
        raise OSError("model file /nonexistent.gguf not found")


def test_a_failed_start_says_no_shutting_down_of_streams_that_never_were(monkeypatch, capsys):
    from coordinator.cluster import service

    monkeypatch.setattr(service, "Service", _FailingStartService)
    monkeypatch.setattr(_FailingStartService, "stopped", [])
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--model", TINY, "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "shutting down" not in err, err
    assert "specd: error: model file /nonexistent.gguf not found" in err
    assert len(_FailingStartService.stopped) == 1  # still cleaned up


def test_in_process_and_server_together_are_refused(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--in-process", "--server", "127.0.0.1:1"])
    assert info.value.code == 2
    assert "--in-process and --server exclude each other" in capsys.readouterr().err


def test_error_messages_name_flags_but_leave_paths_alone():
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--json"])
    # An internal name starting a clause becomes the flag the user typed ...
    assert cli.user_flags("seed: must be >= 0", parser, args) == "--seed: must be >= 0"
    # ... but the end of a path or file name is not a flag, even where one is spelled alike
    # (generate has --json; this read "HEAD/config.--json" before).
    message = "/tmp/h/config.json: not readable JSON (Expecting value)"
    assert cli.user_flags(message, parser, args) == message
    assert cli.user_flags("a/json: x", parser, args) == "a/json: x"
