"""The speed benchmarks on tiny random models (no timing asserts): transformers twin of a
specd decoder, the per-k forward timing against transformers, ``--default-path`` (the
embedded-service request path beside transformers ``generate``), and the default thread
split of the service."""

from __future__ import annotations

import json

import pytest
import torch
from service_harness import LocalService

from coordinator.cluster.config import default_target_threads, target_thread_counts
from drafter_worker.registry import DEFAULT_DRAFTER
from specd_tools.bench.core import BenchConfig, run_bench
from specd_tools.bench.default_path import (
    SPECD_GENERATE,
    SPECD_GENERATE_PLAIN,
    DefaultPathConfig,
    generate_args,
    run_default_path_bench,
)
from specd_tools.bench.forward import forward_timing, thread_timing
from specd_tools.bench.hf import hf_twin, load_hf_model
from specd_tools.bench.report import check_targets, markdown, write_report
from specd_tools.cli import build_parser
from specd_tools.generate import embedded_service_config
from specd_tools.workloads import Prompt, Workload
from target_worker.loader import load_model

pytest.importorskip("transformers")

DENSE = "tiny-random:vocab=64,seed=3,layers=2,dense=1"


def test_hf_twin_holds_the_decoders_weights():
    # float32 both sides: the 1e-5 logits bound is a float32 one ("auto" may be bfloat16).
    decoder, _ = load_model(DENSE, dtype="float32")
    hf = hf_twin(decoder)
    ids = torch.tensor([5, 9, 1, 33, 7, 7, 2, 60, 12])
    with torch.inference_mode():
        ours = decoder.forward_batch(ids, 0, decoder.new_cache())
        theirs = hf(ids[None]).logits[0]
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    assert load_hf_model(DENSE, decoder) is not None
    moe, _ = load_model("tiny-random:vocab=64,seed=0,layers=1")
    assert load_hf_model("tiny-random:vocab=64,seed=0,layers=1", moe) is None
    with pytest.raises(ValueError, match="dense"):
        hf_twin(moe)


def test_hf_twin_of_a_bfloat16_decoder_holds_its_bfloat16_weights():
    decoder, _ = load_model(DENSE, dtype="bfloat16")
    hf = hf_twin(decoder)
    assert {p.dtype for p in hf.parameters()} == {torch.bfloat16}
    assert torch.equal(hf.model.embed_tokens.weight, decoder.embed_tokens.weight)
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight,
                       decoder.layers[1].ffn.w_down.weight)
    assert load_hf_model(DENSE, decoder).dtype == torch.bfloat16


def test_forward_timing_rows_per_k_and_cache_length():
    decoder, _ = load_model(DENSE, dtype="float32")  # the 1e-4 logits bound is float32's
    hf = hf_twin(decoder)
    reported = []
    rows = forward_timing(decoder, hf, ks=(1, 2, 8), cache_lens=(20, 250), repeats=3,
                          on_row=reported.append)
    assert reported == rows  # each row reported as it is measured, not silent to the end
    # Context 256: over 250 cached tokens only k <= 6 fits.
    assert [(r["cache_len"], r["k"]) for r in rows] == [(20, 1), (20, 2), (20, 8), (250, 1),
                                                         (250, 2)]
    for r in rows:
        assert r["bare_forward_ms"] > 0 and r["hf_plain_ms"] > 0 and r["ratio"] > 0
        assert r["max_logit_diff"] < 1e-4  # same weights, same block, same cache


def test_in_process_bench_reports_hf_forward_beside_bare_forward():
    config = BenchConfig(model=DENSE, workloads=("open_question",), max_new_tokens=4,
                         repeats=1, threads=1, adaptive=False, fixed=False,
                         forward_ks=(1, 4), forward_cache_lens=(40,), forward_repeats=2)
    report = run_bench(config, progress=lambda line: None)
    assert [s["name"] for s in report["systems"]] == [
        "bare-forward", "specd-plain", "hf-plain", "hf-prompt-lookup-k10"]
    assert [(r["cache_len"], r["k"]) for r in report["forward"]] == [(40, 1), (40, 4)]
    assert report["identity"]["identical"] is True  # specd and transformers, greedy
    targets = {t["target"]: t for t in check_targets(report)}
    assert targets["forward k=1 (300 cached): specd / transformers <= 1.0"]["met"] is None
    assert "| 40 | 4 |" in markdown(report)


def _short_workloads() -> list[Workload]:
    return [
        Workload("code_edit", "test", (
            Prompt("a", ({"role": "user", "content": "abcabcabcabcabc"},)),
            Prompt("b", ({"role": "user", "content": "xyzzyxyzzyxyzzy"},)))),
        Workload("open_question", "test", (
            Prompt("c", ({"role": "user", "content": "qwerty"},)),)),
    ]


def test_default_path_runs_the_cli_request_beside_transformers(tmp_path):
    started = []

    def start(service_config):
        # The configuration `specd generate` embeds, served in process for the test.
        started.append(service_config)
        service = LocalService(model=DENSE).start()
        return service.address, service.stop

    config = DefaultPathConfig(model=DENSE, max_new_tokens=8, repeats=2, thread_check=False,
                               forward_ks=(1, 2), forward_cache_lens=(30,), forward_repeats=2)
    report = run_default_path_bench(config, progress=lambda line: None,
                                    workloads=_short_workloads(), start_service=start)
    assert len(started) == 1
    assert started[0] == embedded_service_config(generate_args(config))
    assert started[0].drafter == DEFAULT_DRAFTER and started[0].adaptive
    names = [s["name"] for s in report["systems"]]
    assert names == [SPECD_GENERATE, SPECD_GENERATE_PLAIN, "hf-plain", "hf-prompt-lookup-k10"]
    assert len(report["runs"]) == 2 * 3 * len(names)
    # The service's greedy outputs equal transformers' (and it saw the same prompt ids).
    assert report["identity"] == {"identical": True, "compared_runs": len(report["runs"]),
                                  "mismatches": []}
    assert report["prompt_tokens"] == {"identical": True, "differ": []}
    spec = [r for r in report["runs"] if r["system"] == SPECD_GENERATE]
    plain = [r for r in report["runs"] if r["system"] == SPECD_GENERATE_PLAIN]
    assert all(r["drafted_tokens"] == 0 for r in plain)
    assert all(r["forward_calls"] == len(r["tokens"]) for r in plain)
    assert any(r["drafted_tokens"] > 0 for r in spec)
    rows = {(r["workload"], r["system"]): r for r in report["summary"]}
    assert rows[("code_edit", "hf-plain")]["ratio_to_plain"] == 1.0
    assert rows[("open_question", SPECD_GENERATE)]["ratio_to_plain"] > 0
    targets = [t["target"] for t in check_targets(report)]
    assert targets[:2] == ["code editing: specd generate >= 1.3x transformers plain",
                           "open questions: specd generate >= 0.95x transformers plain"]
    assert "code_edit: specd generate --drafter none >= 0.9x transformers plain" in targets
    assert sum(t.startswith("forward k=") for t in targets) == 4
    paths = write_report(report, tmp_path / "out", plots=False)
    text = (tmp_path / "out" / "bench.md").read_text()
    assert "# specd bench --default-path" in text
    assert "| code_edit | specd-generate |" in text and "| 30 | 2 |" in text
    assert json.loads(paths[0].read_text())["mode"] == "default-path"


def test_thread_timing_covers_each_condition_and_restores_threads():
    decoder, _ = load_model(DENSE)
    torch.set_num_threads(1)
    reported = []
    rows = thread_timing(decoder, threads=(1, 2), ks=(1, 3), cache_len=20, repeats=2,
                         on_row=reported.append)
    assert reported == rows  # each row reported as it is measured, not silent to the end
    assert [(r["busy"], r["k"], r["threads"]) for r in rows] == [
        (busy, k, t) for busy in (False, True) for k in (1, 3) for t in (1, 2)]
    assert all(0 < r["median_ms"] <= r["max_ms"] for r in rows)
    assert torch.get_num_threads() == 1


def test_default_path_config_rejects_bad_sizes():
    for bad in ({"max_new_tokens": 0}, {"repeats": 0}, {"prompt_lookup": 0},
                {"target_threads": 0}, {"forward_ks": (0,)}, {"forward_cache_lens": ()}):
        with pytest.raises(ValueError):
            DefaultPathConfig(**bad)


def test_target_thread_counts_take_every_core_and_fall_back_to_one_fewer():
    assert target_thread_counts(1, cpus=2) == (2, 1)
    assert target_thread_counts(1, cpus=1) == (1, None)
    assert target_thread_counts(2, cpus=2) == (1, None)
    assert target_thread_counts(1, cpus=16) == (16, 15)
    assert target_thread_counts(1, tp=2, cpus=16) == (8, 7)
    assert target_thread_counts(2, cpus=4) == (2, 1)


def test_default_target_threads_leave_a_core_to_the_rest_of_the_service():
    assert default_target_threads(1, cpus=2) == 1
    assert default_target_threads(1, cpus=1) == 1
    assert default_target_threads(1, cpus=16) == 15
    assert default_target_threads(1, tp=2, cpus=16) == 7
    assert default_target_threads(2, cpus=4) == 1
    assert default_target_threads(1) >= 1


def test_generate_target_threads_reaches_the_embedded_service():
    parser = build_parser()
    assert embedded_service_config(parser.parse_args(["generate", "x"])).target_threads is None
    args = parser.parse_args(["generate", "x", "--target-threads", "3"])
    assert embedded_service_config(args).target_threads == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--target-threads", "0"])
