"""``specd bench`` end to end on the tiny random model (no timing asserts): the shipped
workloads, the interleaved runs, the identity check, the report files, and ``--service``
against the in-process service harness."""

from __future__ import annotations

import json

import pytest
from service_harness import LocalService

from specd_tools.bench.core import BenchConfig, check_identity, run_bench
from specd_tools.bench.report import check_targets, markdown, service_markdown, write_report
from specd_tools.bench.service import ServiceBenchConfig, run_service_bench
from specd_tools.bench.systems import RunRecord
from specd_tools.cli import main
from specd_tools.workloads import WORKLOADS, Prompt, Workload, load_workload, load_workloads

TINY = "tiny-random:vocab=64,seed=0,layers=1"
PNG = b"\x89PNG\r\n\x1a\n"


def test_every_workload_ships_chat_prompts():
    assert WORKLOADS == ("code_edit", "summarise", "chat", "open_question")
    for name in WORKLOADS:
        w = load_workload(name)
        assert w.name == name and w.description
        assert len(w.prompts) >= 2
        assert len({p.id for p in w.prompts}) == len(w.prompts)
        for p in w.prompts:
            assert p.messages[-1]["role"] == "user"
            assert all(m["role"] in ("user", "assistant") and m["content"] for m in p.messages)
    # Code edits carry a whole function to copy; the chat prompts an earlier answer.
    assert all(len(p.messages[0]["content"]) > 1200 for p in load_workload("code_edit").prompts)
    assert all(len(p.messages) >= 3 for p in load_workload("chat").prompts)
    assert [w.name for w in load_workloads("chat, open_question")] == ["chat", "open_question"]
    for bad in ("nope", ["chat", "chat"], ""):
        with pytest.raises(ValueError):
            load_workloads(bad)


@pytest.fixture(scope="module")
def tiny_report():
    config = BenchConfig(model=TINY, workloads=("code_edit", "open_question"),
                         max_new_tokens=8, repeats=2, hf=False, threads=1)
    return run_bench(config, progress=lambda line: None)


def test_bench_runs_every_system_on_every_prompt_and_outputs_agree(tiny_report):
    report = tiny_report
    systems = [s["name"] for s in report["systems"]]
    assert systems == ["bare-forward", "specd-plain", "specd-prompt-lookup-k10",
                       "specd-prompt-lookup-adaptive"]
    prompts = len(load_workload("code_edit").prompts) + len(load_workload("open_question").prompts)
    assert len(report["runs"]) == 2 * prompts * len(systems)
    assert report["identity"] == {"identical": True, "compared_runs": len(report["runs"]),
                                  "mismatches": []}
    rows = {(r["workload"], r["system"]): r for r in report["summary"]}
    assert set(rows) == {(w, s) for w in ("code_edit", "open_question") for s in systems}
    for (_, system), row in rows.items():
        assert row["tok_s"] > 0 and row["ms_per_token"] > 0 and row["repeats"] == 2
        if system == "specd-plain":
            assert row["ratio_to_plain"] == 1.0
            assert row["accept_rate_per_position"] == []
    # Plain decoding: one forward per token, prefill included.
    plain = rows[("code_edit", "specd-plain")]
    assert plain["forward_calls"] == plain["new_tokens"]
    assert report["overhead"]["bare_ms_per_token"] > 0
    assert report["cost_model"]["calibrated_ms"]


def test_report_files_are_written(tiny_report, tmp_path):
    paths = write_report(tiny_report, tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == ["accept_per_position.png", "bench.json", "bench.md", "tok_s.png"]
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["identity"]["identical"] is True
    assert [t["target"] for t in data["targets"]][-1].startswith("plain-decode overhead")
    text = (tmp_path / "out" / "bench.md").read_text()
    assert "Greedy outputs: identical across all systems" in text
    assert "| code_edit | specd-prompt-lookup-adaptive |" in text
    for png in ("tok_s.png", "accept_per_position.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG


def _run(system, tokens, repeat=0):
    return RunRecord(system=system, workload="w", prompt_id="p", repeat=repeat,
                     prompt_tokens=3, tokens=tokens, seconds=1.0, first_token_seconds=0.1,
                     forward_calls=len(tokens), verification_steps=len(tokens) - 1)


def test_identity_check_names_the_run_that_differs():
    runs = [_run("specd-plain", [1, 2, 3, 4]), _run("hf-plain", [1, 2, 3, 4]),
            _run("specd-x", [1, 2, 9, 4], repeat=1), _run("specd-y", [1, 2])]
    ident = check_identity(runs)
    assert not ident["identical"]
    assert [(m["system"], m["repeat"], m["first_diff"]) for m in ident["mismatches"]] == [
        ("specd-x", 1, 2), ("specd-y", 0, 2)]
    report = {"config": {"model": None, "max_new_tokens": 4, "repeats": 1},
              "environment": {"time_utc": "t", "torch": "x", "torch_threads": 1, "cpus": 1},
              "summary": [], "identity": ident, "overhead": None}
    text = markdown(report)
    assert "2 of 4 runs differ" in text and "specd-x repeat 1: first difference at token 2" in text
    assert all(t["met"] is None for t in check_targets(report))


def test_bench_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(["bench", "--model", TINY, "--no-hf", "--workloads", "chat",
                 "--max-new-tokens", "4", "--repeats", "1", "--threads", "1", "--no-plots",
                 "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    assert "| chat | specd-plain |" in capsys.readouterr().out


def test_a_busy_machine_is_named_beside_the_numbers(tmp_path, capsys, monkeypatch):
    from specd_tools.bench import load

    argv = ["bench", "--model", TINY, "--no-hf", "--workloads", "chat", "--max-new-tokens",
            "2", "--repeats", "1", "--threads", "1", "--no-plots"]
    monkeypatch.setattr(load, "load_average", lambda: 0.0)
    assert main([*argv, "--out", str(tmp_path / "quiet")]) == 0
    assert "machine busy" not in capsys.readouterr().out
    monkeypatch.setattr(load, "load_average", lambda: 99.0)
    assert main([*argv, "--out", str(tmp_path / "busy")]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == (
        f"warning: machine busy: load 99.0 on {load.usable_cpus()} cores; read ratios, not "
        f"absolute numbers")


def test_busy_warning_only_over_the_usable_cores():
    from specd_tools.bench.load import busy_warning

    assert busy_warning(1.9, 2.0, cpus=2) is None
    assert busy_warning(None, None, cpus=2) is None
    assert busy_warning(0.5, None, 2.5, cpus=2) == (
        "machine busy: load 2.5 on 2 cores; read ratios, not absolute numbers")


def test_bench_config_rejects_bad_sizes():
    for bad in ({"max_new_tokens": 0}, {"repeats": 0}, {"draft_len": 0}, {"threads": 0},
                {"drafters": ()}):
        with pytest.raises(ValueError):
            BenchConfig(**bad)
    with pytest.raises(SystemExit):
        main(["bench", "--model", TINY, "--no-hf", "--workloads", "nope", "--out", "/tmp/x"])


def test_service_bench_runs_levels_and_checks_identity():
    short = Workload("short", "test prompts", (
        Prompt("a", ({"role": "user", "content": "abcabcabcabc"},)),
        Prompt("b", ({"role": "user", "content": "xyzzyxyzzy"},)),
    ))
    service = LocalService(pipeline=True).start()
    try:
        report = run_service_bench(
            ServiceBenchConfig(service=service.address, max_new_tokens=6, concurrency=(1, 3)),
            progress=lambda line: None, workloads=[short])
    finally:
        service.stop()
    # The pipelining metrics per level, from the service's Status.
    drafted = [r for r in report["levels"] if r["speculation"]]
    assert all(r["draft_wait_ms_per_step"] is not None for r in report["levels"])
    assert sum(r["runahead_hits"] + r["runahead_misses"] for r in drafted) > 0
    assert all(r["runahead_hits"] == r["runahead_misses"] == 0 for r in report["levels"]
               if not r["speculation"])
    assert "run-ahead hits / misses" in service_markdown(report)
    levels = {(r["speculation"], r["streams"]) for r in report["levels"]}
    assert levels == {(True, 1), (False, 1), (True, 3), (False, 3)}
    assert all(r["tok_s"] > 0 for r in report["levels"])
    assert report["identity"]["identical"] is True
    assert report["identity"]["compared_runs"] == 2 * (1 + 3)
    assert all(len(s["tokens"]) == 6 for s in report["streams"])
