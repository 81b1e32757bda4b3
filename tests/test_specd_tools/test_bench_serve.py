"""`specd bench serve`: the statistics (vLLM's names and definitions), the datasets, the load
generator against a fake OpenAI server on loopback (known texts, token counts and chunking),
``--compare``'s server processes, and one run against a real ``specd serve --http-port``."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_openai import MODEL_ID, make_app

from specd_tools import cli
from specd_tools.bench import cli as bench_cli
from specd_tools.bench.serve import (
    WARMUP_PROMPTS,
    RequestOutcome,
    arrival_offsets,
    category_metrics,
    chunk_timing,
    compute_metrics,
)
from specd_tools.bench.serve_cli import parse_goodput, parse_rates
from specd_tools.bench.serve_compare import ServerProcess, server_argv
from specd_tools.bench.serve_data import (
    FALLBACK_WORDS,
    load_custom,
    load_mt_bench,
    random_prompts,
    sample_prompts,
    structured_prompts,
)
from target_worker.testing import TinyTokenizer

FAKE = str(Path(__file__).with_name("fake_openai.py"))
# How much later than sent a chunk may reach the client on a loaded loopback.
JITTER_S = 0.005


def outcome(ttft=0.1, latency=1.0, output_len=10, itl=(), prompt_len=5, category=None,
            success=True) -> RequestOutcome:
    return RequestOutcome(success=success, error="" if success else "boom", ttft=ttft,
                          latency=latency, output_len=output_len, itl=list(itl),
                          prompt_len=prompt_len, category=category)


# ------------------------------------------------------------------------- statistics


def test_latency_stats_are_vllms_mean_median_std_and_interpolated_percentiles():
    runs = [outcome(ttft=t) for t in (0.1, 0.2, 0.3, 0.4)]
    m = compute_metrics(runs, duration=2.0)
    assert m["mean_ttft_ms"] == pytest.approx(250)
    assert m["median_ttft_ms"] == pytest.approx(250)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(12500))  # population std
    assert m["p90_ttft_ms"] == pytest.approx(370)  # linear: 300 + 0.7 * 100
    assert m["p99_ttft_ms"] == pytest.approx(397)
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert {f"{s}_{name}_ms" for s in ("mean", "median", "std", "p90", "p99")} <= set(m)


def test_counts_and_throughputs_cover_completed_requests_only():
    runs = [outcome(output_len=10, prompt_len=3), outcome(output_len=30, prompt_len=7),
            outcome(output_len=99, prompt_len=99, ttft=9, latency=9, success=False)]
    m = compute_metrics(runs, duration=4.0)
    assert (m["completed"], m["failed"], m["duration"]) == (2, 1, 4.0)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (10, 40)
    assert m["request_throughput"] == 0.5
    assert m["output_throughput"] == 10.0
    assert m["total_token_throughput"] == 12.5
    assert m["median_e2el_ms"] == pytest.approx(1000)  # the failed 9 s is not in it
    assert "request_goodput" not in m
    assert list(m)[:9] == ["completed", "failed", "duration", "total_input_tokens",
                           "total_output_tokens", "request_throughput", "output_throughput",
                           "total_token_throughput", "mean_ttft_ms"]


def test_tpot_excludes_the_first_token_and_itl_is_per_chunk():
    # Sent at 10.0; content chunks at 10.5, 10.7, 10.9 (3 tokens each); stream ends at 11.0.
    ttft, itl, latency = chunk_timing(10.0, [10.5, 10.7, 10.9], 11.0)
    assert ttft == pytest.approx(0.5) and latency == pytest.approx(1.0)
    assert itl == pytest.approx([0.2, 0.2])
    o = outcome(ttft=ttft, latency=latency, itl=itl, output_len=9)
    assert o.tpot == pytest.approx(0.5 / 8)  # (e2el - ttft) / (n - 1)
    assert outcome(output_len=1).tpot is None
    m = compute_metrics([o, outcome(ttft=0.1, latency=0.2, output_len=1, itl=[])], 1.0)
    assert m["median_itl_ms"] == pytest.approx(200)  # per chunk: 3 tokens apart
    assert m["median_tpot_ms"] == pytest.approx(62.5)  # only the 9-token request has one
    assert chunk_timing(1.0, [], 3.0) == (2.0, [], 2.0)  # no content: TTFT is the latency


def test_itl_pools_every_gap_of_every_request():
    m = compute_metrics([outcome(itl=[0.01, 0.03]), outcome(itl=[0.02])], 1.0)
    assert m["mean_itl_ms"] == pytest.approx(20) and m["median_itl_ms"] == pytest.approx(20)


def test_goodput_counts_requests_meeting_every_slo():
    runs = [outcome(ttft=0.1, latency=1.0, output_len=11),   # tpot 90 ms: good
            outcome(ttft=0.4, latency=1.0, output_len=11),   # ttft 400 ms: bad
            outcome(ttft=0.1, latency=2.1, output_len=11),   # tpot 200 ms: bad
            outcome(ttft=0.1, latency=0.1, output_len=1),    # no tpot: counts as 0, good
            outcome(ttft=0.0, latency=0.0, success=False)]   # failed: never good
    slos = parse_goodput(["ttft:300", "tpot:100"])
    assert slos == {"ttft": 300.0, "tpot": 100.0}
    assert compute_metrics(runs, 2.0, slos)["request_goodput"] == 1.0  # 2 good / 2 s
    assert compute_metrics(runs, 2.0, {"e2el": 1000})["request_goodput"] == 1.5  # 3 good
    assert list(compute_metrics(runs, 2.0, slos))[6] == "request_goodput"


@pytest.mark.parametrize("items, text", [
    (["ttft"], "KEY:MS"), (["latency:5"], "KEY:MS"), (["ttft:abc"], "ttft"),
    (["tpot:-1"], "tpot")])
def test_bad_goodput_names_the_flag(items, text):
    with pytest.raises(ValueError, match="--goodput") as info:
        parse_goodput(items)
    assert text in str(info.value)


def test_per_category_metrics_split_the_requests():
    runs = [outcome(category="a", output_len=4), outcome(category="b", output_len=6),
            outcome(category="a", output_len=2)]
    cats = category_metrics(runs, 2.0)
    assert list(cats) == ["a", "b"]
    assert cats["a"]["completed"] == 2 and cats["a"]["total_output_tokens"] == 6
    assert cats["a"]["output_throughput"] == 3.0  # the category's share of the run
    assert category_metrics([outcome()], 1.0) == {}


def test_rates_parse_and_arrivals_follow_the_gamma_law():
    assert parse_rates("inf") == (math.inf,)
    assert parse_rates("1, 2.5,inf") == (1.0, 2.5, math.inf)
    for bad in ("0", "-1", "x", "nan", ""):
        with pytest.raises(Exception, match="rate|> 0|got"):
            parse_rates(bad)
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(20001, 4.0, 1.0, seed=1)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == arrival_offsets(20001, 4.0, 1.0, seed=1)  # seeded
    gaps = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)  # mean 1 / rate
    assert statistics.pstdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    bursty = arrival_offsets(20001, 4.0, 0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.1)  # sd = mean / sqrt(shape)


# ------------------------------------------------------------------------- datasets


def test_custom_jsonl_loads_prompts_and_categories(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello there", "category": "chat"}\n\n{"prompt": "x"}\n')
    prompts = load_custom(f)
    assert [(p.prompt, p.category) for p in prompts] == [("hello there", "chat"), ("x", None)]


@pytest.mark.parametrize("text, where", [
    ('{"prompt": "a"}\nnot json\n', "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"text": "b"}\n', 'line 2: field "prompt" must be a non-empty string '
                                         "(missing)"),
    ('{"prompt": ""}\n', 'line 1: field "prompt"'),
    ('{"prompt": 3}\n', 'line 1: field "prompt"'),
    ('{"prompt": "a", "category": 7}\n', 'line 1: field "category" must be a string'),
    ('["a"]\n', "line 1: expected a JSON object"),
    ("\n\n", "no prompts"),
])
def test_custom_jsonl_errors_name_the_line_and_field(tmp_path, text, where):
    f = tmp_path / "p.jsonl"
    f.write_text(text)
    with pytest.raises(ValueError) as info:
        load_custom(f)
    assert str(info.value).startswith(f"--dataset-path {f}") and where in str(info.value)


def test_custom_jsonl_missing_file_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--dataset-path .*cannot read"):
        load_custom(tmp_path / "nope.jsonl")


def test_mt_bench_is_80_questions_in_8_categories():
    prompts = load_mt_bench()
    assert len(prompts) == 80
    counts = {c: sum(p.category == c for p in prompts) for c in {p.category for p in prompts}}
    assert counts == dict.fromkeys(("writing", "roleplay", "reasoning", "math", "coding",
                                    "extraction", "stem", "humanities"), 10)
    assert prompts[0].prompt.startswith("Compose an engaging travel blog post")


def test_random_prompts_have_the_input_length():
    tok = TinyTokenizer(64)
    prompts = random_prompts(5, 37, seed=3, tokenizer=tok)
    assert len(prompts) == 5 and len({p.prompt for p in prompts}) == 5
    for p in prompts:
        assert p.prompt_len == 37 == len(tok.encode(p.prompt, add_special_tokens=False))
    assert [p.prompt for p in random_prompts(5, 37, 3, tok)] == [p.prompt for p in prompts]
    words = random_prompts(2, 11, seed=0)  # no tokenizer: common words
    assert all(len(p.prompt.split()) == 11 and p.prompt_len is None for p in words)
    assert set(words[0].prompt.split()) <= set(FALLBACK_WORDS)
    with pytest.raises(ValueError, match="--input-len"):
        random_prompts(1, 0, 0)


def test_structured_prompts_cycle_their_kinds_in_order_and_are_seeded():
    prompts = structured_prompts(9, seed=4)
    assert [p.category for p in prompts] == ["json", "sql", "function", "tool"] * 2 + ["json"]
    assert prompts == structured_prompts(9, 4) != structured_prompts(9, 5)
    assert len({p.prompt for p in prompts}) == 9  # the fields differ, the form does not
    assert all(p.prompt.startswith("Write one SQL query") for p in prompts[1::4])


def test_sampling_prompts_is_seeded_balances_categories_and_cycles():
    prompts = load_mt_bench()
    assert sample_prompts(prompts, None, 0) == prompts
    sixteen = sample_prompts(prompts, 16, seed=2)
    assert sixteen == sample_prompts(prompts, 16, seed=2) != sample_prompts(prompts, 16, 3)
    assert sorted(p.category for p in sixteen) == sorted(
        2 * ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
             "humanities"])
    three = [p.__class__(p.prompt) for p in prompts[:3]]  # no categories: a shuffle
    seven = sample_prompts(three, 7, seed=2)
    assert seven[:3] == seven[3:6] and sorted(p.prompt for p in seven[:3]) == sorted(
        p.prompt for p in three)


# ------------------------------------------------------------------------- against a fake server


class FakeServer:
    """`fake_openai.make_app` under uvicorn on a loopback port in a thread."""

    def __init__(self, **kw):
        import uvicorn

        self.app = make_app(**kw)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            assert self.thread.is_alive(), "the fake server thread died"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/v1"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _dataset(tmp_path, rows) -> str:
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(f)


def _run(capsys, argv) -> tuple[int, str, str]:
    code = cli.main(["bench", "serve", "--disable-tqdm", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_extra_body_reaches_every_request_and_the_record(tmp_path, capsys):
    rows = [{"prompt": f"w{i} one two"} for i in range(2)]
    result = tmp_path / "r.json"
    off = {"speculation": {"enabled": False}}
    with FakeServer(tokens_per_chunk=4) as fake:
        code, _out, _err = _run(capsys, [
            "--base-url", fake.url, "--dataset-name", "custom", "--output-len", "4",
            "--dataset-path", _dataset(tmp_path, rows), "--ignore-eos",
            "--extra-body", json.dumps(off), "--result-json", str(result)])
        bodies = fake.app.state.bodies
    assert code == 0 and len(bodies) == 3  # the warm-up too
    for body in bodies:
        assert body["speculation"] == off["speculation"] and body["ignore_eos"] is True
    assert json.loads(result.read_text())["extra_body"] == off
    for bad, why in (("{nope", "not JSON"), ("[1]", "JSON object")):
        with pytest.raises(SystemExit):
            _run(capsys, ["--base-url", "http://127.0.0.1:9/v1", "--extra-body", bad])
        assert why in capsys.readouterr().err


def test_a_run_against_a_fake_server_reports_known_counts_and_timing(tmp_path, capsys):
    rows = [{"prompt": f"w{i} one two", "category": "ab"[i % 2]} for i in range(4)]
    result = tmp_path / "r.json"
    with FakeServer(tokens_per_chunk=4, first_delay=0.05, gap=0.04) as fake:
        code, out, _err = _run(capsys, [
            "--base-url", fake.url, "--dataset-name", "custom",
            "--dataset-path", _dataset(tmp_path, rows), "--output-len", "12", "--ignore-eos",
            "--goodput", "ttft:60000", "--result-json", str(result)])
        bodies = fake.app.state.bodies
    assert code == 0
    r = json.loads(result.read_text())
    assert r["model_id"] == MODEL_ID and r["request_rate"] == "inf"
    assert (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 48 and r["total_input_tokens"] == 12
    assert r["token_sources"] == ["usage"] * 4
    # specd's counters from the finish chunks, summed: 12 tokens in 3 steps per request.
    assert (r["forward_calls"], r["drafted_tokens"], r["accepted_tokens"]) == (16, 36, 36)
    assert r["acceptance_length"] == pytest.approx(4.0)
    assert "Acceptance length (specd):" in out and "acc len" in out
    assert r["request_goodput"] == pytest.approx(4 / r["duration"])
    for i, text in enumerate(r["generated_texts"]):
        assert text == "".join(f"w{i}{k} " for k in range(12))
    # 12 tokens in chunks of 4: 3 content chunks, so 2 gaps per request, each the server's
    # 40 ms sleep less at most the delivery jitter of its first chunk (a chunk that reaches the
    # client late shortens the gap after it: 39.85 ms was seen), far above 0 and below the
    # 4-token TPOT's gap; the first token >= 50 ms; TPOT spreads the 2 gaps over 11 tokens.
    assert [len(g) for g in r["itls"]] == [2] * 4
    assert min(g for gaps in r["itls"] for g in gaps) >= 0.04 - JITTER_S
    assert min(r["ttfts"]) >= 0.05
    for t, tpot, e in zip(r["ttfts"], r["tpots"], r["e2els"], strict=True):
        assert tpot == pytest.approx((e - t) / 11)
    assert r["median_tpot_ms"] < r["median_itl_ms"]
    assert set(r["per_category"]) == {"a", "b"} and r["per_category"]["a"]["completed"] == 2
    # What was sent: streamed chat, usage asked for, the extra field, greedy, max_tokens.
    assert len(bodies) == 5  # the warm-up, then 4
    # The warm-up's prompt is none of the measured ones (a server caching across requests
    # would otherwise have that prompt's answer before it is measured).
    sent = [b["messages"][-1]["content"] for b in bodies]
    assert sent[0] == WARMUP_PROMPTS[0] and sent[0] not in sent[1:]
    assert sorted(sent[1:]) == sorted(row["prompt"] for row in rows)
    for body in bodies:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 12 and body["temperature"] == 0 and body["ignore_eos"]
        assert body["model"] == MODEL_ID
    assert "Successful requests:" in out and "Median TPOT (ms):" in out
    assert "per category" in out


def test_a_busy_machine_is_named_beside_the_numbers(tmp_path, capsys, monkeypatch):
    from specd_tools.bench import load

    monkeypatch.setattr(load, "load_average", lambda: 99.0)
    with FakeServer() as fake:
        code, out, _err = _run(capsys, [
            "--base-url", fake.url, "--dataset-name", "custom",
            "--dataset-path", _dataset(tmp_path, [{"prompt": "a b"}]), "--output-len", "4"])
    assert code == 0 and "Successful requests:" in out
    assert out.rstrip().splitlines()[-1] == (
        f"warning: machine busy: load 99.0 on {load.usable_cpus()} cores; read ratios, not "
        f"absolute numbers")


def test_without_usage_tokens_are_counted_by_the_tokenizer_or_by_chunks(tmp_path, capsys):
    rows = [{"prompt": "abc def"}, {"prompt": "ghi"}]
    data = _dataset(tmp_path, rows)
    with FakeServer(usage=False, tokens_per_chunk=3) as fake:
        base = ["--base-url", fake.url, "--dataset-name", "custom", "--dataset-path", data,
                "--output-len", "6", "--warmup", "0"]
        assert _run(capsys, [*base, "--tokenizer", "tiny-random:vocab=64",
                             "--result-json", str(tmp_path / "t.json")])[0] == 0
        assert _run(capsys, [*base, "--result-json", str(tmp_path / "c.json")])[0] == 0
    by_tok = json.loads((tmp_path / "t.json").read_text())
    assert by_tok["token_sources"] == ["tokenizer"] * 2
    # The tiny tokenizer is one token per character.
    assert by_tok["output_lens"] == [len(t) for t in by_tok["generated_texts"]]
    assert by_tok["input_lens"] == [7, 3]
    by_chunks = json.loads((tmp_path / "c.json").read_text())
    assert by_chunks["token_sources"] == ["chunks"] * 2 and by_chunks["output_lens"] == [2, 2]


def test_failed_requests_are_counted_and_a_concurrency_cap_holds(tmp_path, capsys):
    rows = [{"prompt": "ok 1"}, {"prompt": "FAIL now"}, {"prompt": "ok 2"}, {"prompt": "ok 3"}]
    result = tmp_path / "r.json"
    with FakeServer(tokens_per_chunk=1, first_delay=0.02) as fake:
        code, _out, _err = _run(capsys, [
            "--base-url", fake.url, "--dataset-name", "custom",
            "--dataset-path", _dataset(tmp_path, rows), "--output-len", "3",
            "--max-concurrency", "1", "--request-rate", "50,inf", "--result-json", str(result)])
    assert code == 0
    runs = json.loads(result.read_text())
    assert [r["request_rate"] for r in runs] == [50.0, "inf"]
    for r in runs:
        assert (r["completed"], r["failed"]) == (3, 1) and r["max_concurrency"] == 1
        assert "500" in r["errors"][1] and r["total_output_tokens"] == 9
        # One in flight: each request is sent once the one before it has ended.
        ends = [s + e for s, e in zip(r["start_times"], r["e2els"], strict=True)]
        assert all(b >= a for a, b in zip(ends, r["start_times"][1:], strict=False))


def test_the_warm_up_failing_stops_the_run_with_the_servers_error(tmp_path, capsys,
                                                                  monkeypatch):
    import specd_tools.bench.serve as serve

    monkeypatch.setattr(serve, "WARMUP_PROMPTS", ("FAIL on the warm-up",))  # the fake's 500
    with FakeServer() as fake, pytest.raises(SystemExit) as info:
        _run(capsys, ["--base-url", fake.url, "--dataset-name", "custom",
                      "--dataset-path", _dataset(tmp_path, [{"prompt": "hello"}])])
    assert info.value.code == 1
    assert "warm-up request" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    ([], "--base-url"),
    (["--base-url", "http://127.0.0.1:1/v1", "--request-rate", "fast"], "--request-rate"),
    (["--base-url", "http://127.0.0.1:1/v1", "--request-rate", "0"], "--request-rate"),
    (["--base-url", "http://127.0.0.1:1/v1", "--num-prompts", "0"], "--num-prompts"),
    (["--base-url", "http://127.0.0.1:1/v1", "--max-concurrency", "x"], "--max-concurrency"),
    (["--base-url", "http://127.0.0.1:1/v1", "--max-concurrency", "2,0"], "--max-concurrency"),
    (["--base-url", "http://127.0.0.1:1/v1", "--burstiness", "0"], "--burstiness"),
    (["--base-url", "http://127.0.0.1:1/v1", "--goodput", "ttft"], "--goodput"),
    (["--base-url", "http://127.0.0.1:1/v1", "--dataset-name", "custom"], "--dataset-path"),
    (["--base-url", "http://127.0.0.1:1/v1", "--dataset-name", "sharegpt"], "--dataset-name"),
    (["--base-url", "http://127.0.0.1:1/v1", "--temperature", "-1"], "--temperature"),
    (["--base-url", "http://x/v1", "--compare", "/tmp"], "--compare"),
])
def test_bad_flags_give_an_error_naming_the_flag(capsys, argv, flag):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "serve", *argv])
    assert info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--max-concurrency", "2,0"],
                                  ["--output-len", "x"]])
def test_integer_flags_are_refused_as_specds_own_are(capsys, argv):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:1/v1", *argv])
    assert info.value.code == 2
    got = "'x'" if argv[1] == "x" else "0"
    assert f"argument {argv[0]}: must be an integer >= 1, got {got}" in capsys.readouterr().err


def test_an_unreachable_server_is_named(capsys):
    with pytest.raises(SystemExit) as info:
        _run(capsys, ["--base-url", "http://127.0.0.1:1/v1"])
    assert info.value.code == 1
    assert "--base-url http://127.0.0.1:1/v1" in capsys.readouterr().err


def test_plain_specd_bench_is_unchanged():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "--no-hf", "--repeats", "1"])
    assert args.func is bench_cli.cmd_bench and args.bench_mode is None and args.repeats == 1
    args = parser.parse_args(["bench", "serve", "--base-url", "http://h/v1"])
    assert args.func.__name__ == "cmd_bench_serve" and args.base_url == "http://h/v1"


def test_plots_are_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    with FakeServer() as fake:
        code, _out, _err = _run(capsys, [
            "--base-url", fake.url, "--dataset-name", "random", "--num-prompts", "3",
            "--input-len", "4", "--output-len", "4", "--request-rate", "100,inf",
            "--plot-dir", str(tmp_path / "plots")])
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["latency_cdf.png",
                                                                       "sweep.png"]


# ------------------------------------------------------------------------- --compare


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_compare_runs_each_server_in_turn_and_stops_it(tmp_path, capsys):
    rows = [{"prompt": "same a", "category": "x"}, {"prompt": "diff b", "category": "y"},
            {"prompt": "same c", "category": "x"}]
    result = tmp_path / "cmp.json"
    fake = f"{{python}} {FAKE} --port {{port}}"
    code, out, err = _run(capsys, [
        "--compare", str(tmp_path), "--specd-cmd", fake, "--peer-cmd", fake + " --suffix X",
        "--dataset-name", "custom", "--dataset-path", _dataset(tmp_path, rows),
        "--output-len", "4", "--rounds", "2", "--server-timeout", "60",
        "--max-concurrency", "1,2", "--result-json", str(result)])
    assert code == 0, err
    starts = [line.split("starting ")[1].split(":")[0] for line in err.splitlines()
              if ": starting " in line]
    assert starts == ["specd", "peer", "peer", "specd"]  # alternating, never both at once
    pids = [int(line.split("(pid ")[1].split(",")[0]) for line in err.splitlines()
            if " stopped (pid " in line]
    assert len(pids) == 4 and not any(_alive(p) for p in pids)
    r = json.loads(result.read_text())
    for name in ("specd", "peer"):
        s = r["servers"][name]
        assert len(s["startup_s"]) == 2 and all(t > 0 for t in s["startup_s"])
        assert [run["max_concurrency"] for run in s["runs"]] == [1, 2]  # every load point
        for run in s["runs"]:
            assert run["completed"] == 6 and run["total_output_tokens"] == 24
            assert run["rounds"] == 2
        assert [len(per_round) for per_round in s["round_metrics"]] == [2, 2]
    # "diff b" differs on the peer in both rounds, at both load points.
    assert (r["greedy_equal"], r["greedy_total"]) == (8, 12)
    assert len(r["ratios"]) == 2 and r["ratios"][0]["output_throughput"] > 0
    assert "greedy texts equal: 8 / 12" in out and "specd/peer" in out
    assert "rate inf, 1 in flight" in out and "rate inf, 2 in flight" in out
    assert "per category" in out and set(r["servers"]["peer"]["runs"][0]["per_category"]) == {
        "x", "y"}


def test_stopping_escalates_to_sigkill_for_a_server_ignoring_sigterm(tmp_path):
    ready = tmp_path / "ready"
    code = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(120)")
    server = ServerProcess("stubborn", [sys.executable, "-c", code], 1, tmp_path / "log")
    server.start()
    deadline = time.monotonic() + 30
    while not ready.exists():  # SIGTERM is ignored from here on
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.02)
    began = time.monotonic()
    assert server.stop(timeout=0.5) == -9
    assert time.monotonic() - began < 10 and not _alive(server.proc.pid)


def test_server_commands_fill_placeholders_and_find_the_program():
    argv = server_argv("{python} -m x --port {port} --model '{model}'", 8123, "/m dir")
    assert argv == [sys.executable, "-m", "x", "--port", "8123", "--model", "/m dir"]
    assert server_argv("python3 -V", 1, "m")[0].endswith("python3")
    with pytest.raises(ValueError, match="placeholder"):
        server_argv("x {nope}", 1, "m")
    with pytest.raises(ValueError, match="not found"):
        server_argv("no-such-program-here {port}", 1, "m")


# ------------------------------------------------------------------------- a real specd serve


def test_against_a_real_specd_serve(tmp_path, capsys):
    from service_harness import MODEL, serve_process

    with serve_process("--model", MODEL, "--target-threads", "1", "--http-port", "0") as (
            proc, _address, _tmp):
        http = next(line for line in proc.stdout if "OpenAI API on" in line)
        url = http.rsplit(" on ", 1)[1].strip()
        code, out, err = _run(capsys, [
            "--base-url", url, "--dataset-name", "random", "--num-prompts", "4",
            "--input-len", "8", "--output-len", "8", "--ignore-eos", "--max-concurrency", "2",
            "--result-json", str(tmp_path / "r.json")])
    assert code == 0, err
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["model_id"] == MODEL and r["tokenizer_id"] == MODEL  # the served model's
    assert (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 32 and r["token_sources"] == ["usage"] * 4
    # usage counts the chat template around the 8 random tokens.
    assert all(n > 8 for n in r["input_lens"])
    assert all(len(g) >= 1 for g in r["itls"]) and r["mean_e2el_ms"] > 0
    assert "Successful requests:" in out


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    """A random 2-layer Llama directory with a trained byte-level BPE tokenizer (the README's
    make_tiny.py)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny-llama")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["hello world", "def add(a, b): return a + b"], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                         "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64,
                                  intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=512, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)  # the same weights every run: greedy equality is checked on them
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_random_prompts_re_encode_to_the_input_length_with_a_byte_level_bpe(tiny_hf_dir):
    from specd_tools.bench.serve_data import load_bench_tokenizer

    tok = load_bench_tokenizer(str(tiny_hf_dir))
    prompts = random_prompts(30, 64, seed=0, tokenizer=tok)
    assert [len(tok.encode(p.prompt, add_special_tokens=False)) for p in prompts] == [64] * 30
    assert not any("\ufffd" in p.prompt for p in prompts)


@pytest.mark.slow
def test_compare_specd_serve_with_transformers_serve(tiny_hf_dir, tmp_path, capsys):
    """The default --compare: a real specd serve and transformers serve on one tiny HF
    directory (~40 s here: the two start-ups and transformers' lazy first load)."""
    import importlib.util

    for module in ("typer", "fastapi", "uvicorn", "openai"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"transformers serve needs {module}")
    result = tmp_path / "cmp.json"
    code, out, err = _run(capsys, [
        "--compare", str(tiny_hf_dir), "--dataset-name", "random", "--num-prompts", "4",
        "--input-len", "8", "--output-len", "16", "--rounds", "1", "--max-concurrency", "2",
        # float32 for both: two implementations agree on greedy text there, not in bfloat16
        # (what "auto" is on an AMX CPU), where roundings differ.
        "--dtype", "float32",
        "--specd-cmd", "{python} -m specd_tools.cli serve --model {model} --host 127.0.0.1 "
                       "--port 0 --http-port {port} --shutdown-grace 5 --threads 1 "
                       "--dtype {dtype}",
        "--server-timeout", "300", "--result-json", str(result)])
    assert code == 0, err
    r = json.loads(result.read_text())
    for name in ("specd", "peer"):
        (run,) = r["servers"][name]["runs"]
        assert (run["completed"], run["failed"]) == (4, 0), run["errors"]
        assert run["total_output_tokens"] > 0
    assert r["servers"]["specd"]["model_id"] == str(tiny_hf_dir)
    assert r["greedy_total"] == 4 and r["greedy_equal"] == 4  # lossless: same greedy text
    pids = [int(line.split("(pid ")[1].split(",")[0]) for line in err.splitlines()
            if " stopped (pid " in line]
    assert len(pids) == 2 and not any(_alive(p) for p in pids)
    assert "greedy texts equal: 4 / 4" in out


def test_the_help_names_defaults_and_defines_the_metrics():
    parser = cli.build_parser()
    bench = next(a for a in parser._actions if hasattr(a, "choices") and a.choices
                 and "bench" in a.choices).choices["bench"]
    serve = next(a for a in bench._actions if hasattr(a, "choices") and a.choices
                 and "serve" in a.choices).choices["serve"]
    text = serve.format_help()
    assert "`" not in text
    for phrase in ("TTFT", "TPOT", "ITL", "E2EL", "verification step"):
        assert phrase in text
    for action in serve._actions:
        if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
            assert "default" in (action.help or ""), action.option_strings
