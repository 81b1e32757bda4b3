"""Batch invariance of the torch forward (GPUs, TP shards, MoE, float16, no compiler): a row's
logits, hidden state and KV entries are bitwise the same whatever else its forward computes
(one token, a verify block, a prompt chunk of any size, other sequences, a prefix another
step wrote, the thread count), in float32 and bfloat16; the start-up check behind it refuses
kernels that are not, and falls back to ones that are. Every test here runs the torch forward
(``SPECD_NATIVE=0``); the native forward has its own tests (test_native.py)."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import target_worker.invariant as inv
from specd_core.logprobs import commit_candidates
from specd_core.rule import GreedyRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem
from target_worker.engine import TargetEngine
from target_worker.loader import load_model
from target_worker.model import KEY_BLOCK, Decoder

SPECS = {"moe": "tiny-random:vocab=64,seed=5,layers=2",
         "dense": "tiny-random:vocab=64,seed=6,layers=2,dense=1"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch, tmp_path):
    """Every test checks kernels itself (no verdicts from disk or an earlier test), on the
    torch forward."""
    monkeypatch.setenv("SPECD_NATIVE", "0")
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.setattr(inv, "_VERDICTS", {})
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())


def _decoder(spec: str, dtype: torch.dtype, threads=(1, 2), context: int | None = None):
    """The tiny test model (``context``: with a longer one, for sequences of several key
    blocks), batch invariant in ``dtype`` for ``threads``."""
    decoder, _ = load_model(SPECS[spec], dtype="float32")
    if context is not None:
        longer = Decoder(dataclasses.replace(decoder.config, max_seq_len=context))
        longer.load_state_dict(decoder.state_dict())
        decoder = longer
    decoder = decoder.to(dtype)
    decoder.make_batch_invariant(threads)
    return decoder


def _alone(decoder, tokens):
    """Every position fed on its own: logits ``[n, V]`` and the cache."""
    cache = decoder.new_cache()
    return torch.cat([decoder.forward_batch([t], i, cache) for i, t in enumerate(tokens)]), cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", SPECS)
def test_rows_inside_random_mixes_of_chunks_blocks_and_requests_equal_rows_fed_alone(spec,
                                                                                     dtype):
    decoder = _decoder(spec, DTYPES[dtype], context=4 * KEY_BLOCK)
    rng = random.Random(f"{spec}{dtype}")
    tokens = [rng.randrange(64) for _ in range(2 * KEY_BLOCK + 100)]  # three key blocks
    ref, ref_cache = _alone(decoder, tokens)
    # The same sequence in steps of random sizes (prompt chunks up to 200 tokens, which
    # attend in several query chunks, verify blocks, single tokens), each packed with 0-2
    # other sequences of random sizes, and every few steps a rejected tail rolled back and
    # fed again.
    cache, others = decoder.new_cache(), [decoder.new_cache(), decoder.new_cache()]
    got, pos = [None] * len(tokens), 0
    while pos < len(tokens):
        n = min(rng.choice([1, 1, 2, 3, 5, 8, 9, 17, 33, 64, 90, 200]), len(tokens) - pos)
        segments = [(tokens[pos:pos + n], pos, cache)]
        for other in others[:rng.randrange(3)]:
            if other.seq_len > 150:
                other.truncate(0)
            k = rng.choice([1, 4, 9, 40])
            segments.append(([rng.randrange(64) for _ in range(k)], other.seq_len, other))
        logits = decoder.forward_packed(segments)[0][0]
        for i in range(n):
            got[pos + i] = logits[i : i + 1].clone()
        back = rng.randrange(n + 1) if rng.random() < 0.3 else 0
        cache.truncate(pos + n - back)
        pos += n - back
    got = torch.cat(got)
    assert torch.equal(got, ref)
    assert torch.equal(cache.keys(), ref_cache.keys())
    assert torch.equal(cache.values(), ref_cache.values())
    assert ref.abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_rows_and_logits_only_last_match_the_full_forward(dtype):
    decoder = _decoder("dense", DTYPES[dtype])
    tokens = list(range(3, 60))
    logits, hidden = decoder.forward_batch_with_hidden(tokens, 0, decoder.new_cache())
    last, hidden_last = decoder.forward_batch_with_hidden(tokens, 0, decoder.new_cache(),
                                                          last_logits_only=True)
    assert torch.equal(last, logits[-1:]) and torch.equal(hidden_last, hidden)
    cache = decoder.new_cache()
    rows = [decoder.forward_batch_with_hidden([t], i, cache)[1] for i, t in enumerate(tokens)]
    assert torch.equal(torch.cat(rows), hidden)


def test_rows_agree_across_the_thread_counts_the_plans_were_checked_for():
    decoder = _decoder("dense", torch.float32, threads=(1, 2))
    tokens = [(7 * i + 3) % 64 for i in range(120)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_cache = _alone(decoder, tokens)
        torch.set_num_threads(2)
        two = decoder.forward_batch(tokens, 0, cache := decoder.new_cache())
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)
    assert torch.equal(one_cache.keys(), cache.keys())


def test_a_reused_prefix_written_by_decode_steps_continues_as_a_fresh_prefill_does():
    decoder = _decoder("moe", torch.float32)
    prompt, answer = list(range(1, 40)), [5, 9, 2, 7, 7, 1, 30, 31]
    warm = decoder.new_cache()
    decoder.forward_batch(prompt, 0, warm)
    for i, t in enumerate(answer):  # the first turn's answer, decoded token by token
        decoder.forward_batch([t], len(prompt) + i, warm)
    follow = [11, 12, 13, 14]
    reused = decoder.forward_batch(follow, warm.seq_len, warm)
    fresh = decoder.forward_batch(prompt + answer + follow, 0, decoder.new_cache())
    assert torch.equal(reused, fresh[-len(follow):])


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8),
                                      SamplingParams(temperature=1.0, top_p=0.9, top_k=20)],
                         ids=["greedy", "t0.8", "top-p"])
def test_engine_rows_and_logprobs_of_a_verify_block_equal_those_of_single_token_steps(sampling):
    """What the rule and the logprobs get (probability rows: softmax, top-k/top-p and their
    sums; log-softmax) is bitwise the same for a block's rows as for one-token steps, here
    with two threads, where a one-row sum over the vocabulary is split across threads."""
    decoder, _ = load_model("tiny-random:vocab=40000,seed=7,layers=2,dense=1")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = TargetEngine(decoder, max_slots=3, prefix_cache_tokens=0)
        prompt, block = [3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9]
        a, b = engine.allocate(), engine.allocate()
        engine.step([PrefillItem(slot=a, tokens=prompt, sampling=sampling)])
        engine.step([PrefillItem(slot=b, tokens=prompt[:3], sampling=sampling)])
        blocked = engine.step([
            VerifyItem(slot=a, start_pos=len(prompt) - 1, tokens=[prompt[-1], *block],
                       sampling=sampling, logprobs=3),
            VerifyItem(slot=b, start_pos=2, tokens=[prompt[2], 7, 7], sampling=sampling)])[0]
        singles = []
        for i, token in enumerate([prompt[-1], *block]):
            singles.append(engine.step([VerifyItem(slot=a, start_pos=len(prompt) - 1 + i,
                                                   tokens=[token], sampling=sampling,
                                                   logprobs=3)])[0])
    finally:
        torch.set_num_threads(before)
    for i, single in enumerate(singles):
        if isinstance(blocked.rows, GreedyRows):
            assert blocked.rows.argmax[i] == single.rows.argmax[0]
        else:
            dense = blocked.rows.to_dense() if hasattr(blocked.rows, "to_dense") else \
                blocked.rows.probs
            one = single.rows.to_dense() if hasattr(single.rows, "to_dense") else \
                single.rows.probs
            assert torch.equal(dense[i], one[0])
        lp_block, lp_one = blocked.logprobs, single.logprobs
        assert np.array_equal(lp_block.top_logprobs[i], lp_one.top_logprobs[0])
        assert np.array_equal(lp_block.top_ids[i], lp_one.top_ids[0])
        if lp_one.full is not None:
            assert np.array_equal(lp_block.full[i], lp_one.full[0])
    candidates, _ = commit_candidates(blocked.rows, block)
    assert len(candidates) == len(block) + 1


# --- the check ------------------------------------------------------------------------------


def _shape_dependent_kernel(name: str, below: int | None = None) -> inv._Kernel:
    """A linear whose rows pick up a row-count-dependent rounding: what MKL's GEMM does, made
    deterministic here (``below``: only calls of fewer rows than that). Built on one call
    per row, so nothing but that rounding depends on the call."""

    def run(x, _prepared, weight, bias):
        y = inv._rows_run(x, None, weight, bias)
        if below is None or x.shape[0] < below:
            y = y + x.shape[0] * 1e-6
        return y

    return inv._Kernel(name, lambda w: None, run)


def test_the_check_refuses_a_kernel_whose_rows_depend_on_the_call_and_passes_honest_ones():
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
    top = inv.CALL_ROWS[-1]
    bad = _shape_dependent_kernel("bad")
    proven, _ = inv.check_linear(bad, weight, None, 1, (1,))
    assert proven < inv.MIN_PROVEN_ROWS  # only a call of one row gives the row alone's bits
    for kernel in inv.LINEAR_KERNELS:
        if kernel.name == "onednn" and not torch.backends.mkldnn.is_available():
            continue
        # A padded floor only hides differences the kernel has below it, so every honest
        # kernel must pass at some floor (up to where it changes its order, at least
        # MIN_PROVEN_ROWS: oneDNN's bfloat16 on AMX); per-row always passes at 1.
        assert any(inv.check_linear(kernel, weight, None, m, (1,))[0] >= inv.MIN_PROVEN_ROWS
                   for m in inv._MIN_ROWS), kernel.name
    # Padding to a floor fixes a kernel that only misbehaves on few rows.
    few = _shape_dependent_kernel("few", below=4)
    assert inv.check_linear(few, weight, None, 1, (1,))[0] < inv.MIN_PROVEN_ROWS
    assert inv.check_linear(few, weight, None, 4, (1,)) == (top, True)


def _rare_above(name: str, above: int) -> inv._Kernel:
    """F.linear that, in calls of more than ``above`` rows, gives one output of one row other
    bits (one ulp): what oneDNN's bfloat16 GEMM does on an AMX CPU past 32 rows, about one
    output in 10^4."""

    def run(x, _prepared, weight, bias):
        y = inv._rows_run(x, None, weight, bias)  # invariant but for what follows
        if x.shape[0] > above:
            y[x.shape[0] // 3, 5] = torch.nextafter(y[x.shape[0] // 3, 5],
                                                    torch.tensor(float("inf")))
        return y

    return inv._Kernel(name, lambda w: None, run)


def test_a_kernel_that_changes_one_output_past_some_size_is_used_only_below_it(monkeypatch):
    """Every row of every checked call is compared (a few probe rows would miss one output
    in 10^4), and the plan splits larger calls into the largest size proven."""
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(7))
    rare = _rare_above("rare", 32)
    assert inv.check_linear(rare, weight, None, 1, (1,)) == (32, True)
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (rare,))
    monkeypatch.setattr(inv, "_KERNELS", {"rare": rare})
    plan = inv.plan_linear(weight, None, (1,))
    assert (plan.kernel, plan.min_rows, plan.max_rows) == ("rare", 1, 32)
    inv.prepare_linear(weight, plan)
    x = torch.randn(100, 16, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([F.linear(x[i:i + 1], weight) for i in range(100)])
    assert torch.equal(inv.invariant_linear(x, weight), alone)
    below = _rare_above("below", 8)  # changes its order too soon: not used
    assert inv.check_linear(below, weight, None, 1, (1,))[0] == 8 < inv.MIN_PROVEN_ROWS


def test_the_plan_falls_back_to_the_next_kernel_and_at_last_to_one_row_per_call(monkeypatch):
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(1))
    rows = next(k for k in inv.LINEAR_KERNELS if k.name == "rows")
    noise = torch.Generator().manual_seed(9)

    def noisy_run(x, _prepared, weight, bias):  # other bits at every call: never proven
        return inv._rows_run(x, None, weight, bias) + torch.rand(1, generator=noise) * 1e-6

    noisy = inv._Kernel("noisy", lambda w: None, noisy_run)
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (noisy, rows))
    monkeypatch.setattr(inv, "_KERNELS", {"noisy": noisy, "rows": rows})
    plan = inv.plan_linear(weight, None, (1,))
    assert plan.kernel == "rows" and plan.min_rows == 1
    # A kernel whose rows depend on the call's size is still invariant run at one size:
    # padded to MIN_PROVEN_ROWS rows and split into calls of as many.
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (_shape_dependent_kernel("bad"), rows))
    plan = inv.plan_linear(torch.randn(40, 40, generator=noise), None, (1,))
    assert (plan.kernel, plan.min_rows, plan.max_rows) == ("bad", 16, 16)
    few = _shape_dependent_kernel("few", below=4)
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (few, rows))
    weight2 = torch.randn(40, 48, generator=torch.Generator().manual_seed(2))
    plan = inv.plan_linear(weight2, None, (1,))
    assert (plan.kernel, plan.min_rows) == ("few", 4)


def test_few_rows_run_on_one_thread_when_only_many_agree_across_thread_counts(monkeypatch):
    """A kernel whose small calls give other bits on two threads (as MKL's bmm splits a few
    rows across threads) keeps every thread only from the size that agrees."""

    def run(x, _prepared, weight, bias):
        y = inv._rows_run(x, None, weight, bias)  # invariant on its own: one row per call
        if torch.get_num_threads() > 1 and x.shape[0] < 16:
            y = y + 1e-3
        return y

    split = inv._Kernel("split", lambda w: None, run)
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (split,))
    monkeypatch.setattr(inv, "_KERNELS", {"split": split})
    weight = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))
    plan = inv.plan_linear(weight, None, (2,))
    assert (plan.min_rows, plan.threaded_rows) == (1, 16)
    inv.prepare_linear(weight, plan)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (1, 3, 15, 16, 40):
            assert torch.equal(inv.invariant_linear(x[:n], weight)[:1],
                               F.linear(x[:1], weight)), n  # as alone on one thread
    finally:
        torch.set_num_threads(before)


def test_verdicts_are_kept_on_disk_and_reused(tmp_path, monkeypatch):
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(5))
    plan = inv.plan_linear(weight, None, (1,))
    stored = (tmp_path / "batch_invariance.json").read_text()
    assert plan.kernel in stored
    monkeypatch.setattr(inv, "_VERDICTS", {})
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())
    calls = []
    monkeypatch.setattr(inv, "check_linear",
                        lambda *a: calls.append(a) or (a[-1] or inv.CALL_ROWS[-1], True))
    assert inv.plan_linear(weight, None, (1,)) == plan
    # Read back and spot-checked once (the quick sizes, up to its largest), not decided again.
    assert len(calls) == 1 and calls[0][-2] is True and calls[0][-1] == plan.max_rows
    assert inv.plan_linear(weight, None, (1,)) == plan and len(calls) == 1


@pytest.mark.parametrize("edit", [
    {"kernel": "bad", "min_rows": 1, "threaded_rows": 1},       # a call-dependent kernel
    {"kernel": "bad", "min_rows": 16, "threaded_rows": 1, "max_rows": 256},  # beyond proof
    {"kernel": "renamed", "min_rows": 1, "threaded_rows": 1},   # unknown to this build
    {"kernel": "rows", "min_rows": 0, "threaded_rows": -3},     # row counts never proven
    {"kernel": "rows", "min_rows": "x", "threaded_rows": None},
])
def test_a_stored_verdict_that_fails_its_spot_check_is_decided_again(tmp_path, monkeypatch,
                                                                     edit):
    """A verdict file from another build, or edited, never makes a target non-exact."""
    import json

    rows = next(k for k in inv.LINEAR_KERNELS if k.name == "rows")
    bad = _shape_dependent_kernel("bad")
    monkeypatch.setattr(inv, "LINEAR_KERNELS", (bad, rows))
    monkeypatch.setattr(inv, "_KERNELS", {"bad": bad, "rows": rows})
    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(6))
    decided = inv.plan_linear(weight, None, (1,))
    # "bad" proven only at one size: run at exactly that size (padded and split), exact.
    assert (decided.kernel, decided.min_rows, decided.max_rows) == ("bad", 16, 16)
    path = tmp_path / "batch_invariance.json"
    stored = json.loads(path.read_text())
    (key,) = stored
    path.write_text(json.dumps({key: edit}))
    monkeypatch.setattr(inv, "_VERDICTS", {})
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())
    assert inv.plan_linear(weight, None, (1,)) == decided
    assert inv.InvariancePlan(**json.loads(path.read_text())[key]) == decided  # corrected


def test_a_planned_weight_changed_in_place_or_moved_is_multiplied_as_it_is_now():
    decoder = _decoder("dense", torch.float32)
    tokens = [1, 2, 3, 4, 5]
    before = decoder.forward_batch(tokens, 0, decoder.new_cache())
    with torch.no_grad():
        decoder.layers[0].ffn.w_down.weight.mul_(-1.0)  # in place: its version moves on
    flipped = decoder.forward_batch(tokens, 0, decoder.new_cache())
    # Unplanned: F.linear on the weights as they are.
    plain, _ = load_model(SPECS["dense"], dtype="float32")
    with torch.no_grad():
        plain.layers[0].ffn.w_down.weight.mul_(-1.0)
    assert not torch.allclose(before, flipped, atol=1e-3)
    assert torch.allclose(flipped, plain.forward_batch(tokens, 0, plain.new_cache()),
                          atol=1e-5, rtol=0)
    moved = decoder.to(torch.bfloat16)  # Module.to plans the new tensors again
    assert moved.batch_invariant
    weight = moved.layers[0].attn.wqkv.weight
    assert weight.dtype == torch.bfloat16 and inv.planned(weight) is not None


def test_an_engine_plans_every_weight_its_decoder_multiplies():
    decoder, _ = load_model(SPECS["moe"])
    engine = TargetEngine(decoder, max_slots=1)
    assert engine.invariance is not None
    weights = [m.weight for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    weights += [w for m in decoder.modules() if hasattr(m, "expert_weights")
                for pair in m.expert_weights() for w in pair]
    assert all(inv.planned(w) is not None for w in [*weights, decoder.head_weight()])
    assert TargetEngine(load_model(SPECS["moe"])[0], max_slots=1,
                        batch_invariant=False).invariance is None


def test_pointwise_gives_a_row_the_same_bits_whatever_the_rows_around_it():
    """exp over tensors big enough to be split across threads, at sizes whose split falls
    mid-vector: each row equals the row computed alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(6)
        x = torch.randn(300, 200, generator=gen) * 20
        alone = torch.cat([inv.pointwise(torch.exp, x[i : i + 1]) for i in range(300)])
        for n in (1, 165, 166, 299, 300):
            assert torch.equal(inv.pointwise(torch.exp, x[:n]), alone[:n]), n
    finally:
        torch.set_num_threads(before)


def test_announce_checks_calls_back_once_before_a_full_check_never_for_stored_verdicts(
        monkeypatch):
    """What lets ``specd generate --in-process`` say why its first start on a machine is
    slow, and stay quiet on the others."""
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(32, 16, generator=gen), torch.randn(48, 16, generator=gen)]
    calls = []
    with inv.announce_checks(lambda: calls.append("checking")):
        plans = [inv.plan_linear(w, None, (1,)) for w in weights]
    assert calls == ["checking"]  # once, though two shapes were checked
    inv.plan_linear(torch.randn(24, 16, generator=gen), None, (1,))
    assert calls == ["checking"]  # not after the block
    monkeypatch.setattr(inv, "_VERDICTS", {})  # a new process: the verdicts are on disk
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())
    with inv.announce_checks(lambda: calls.append("again")):
        assert [inv.plan_linear(w, None, (1,)) for w in weights] == plans
    assert calls == ["checking"]
