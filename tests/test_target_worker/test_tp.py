"""Tensor-parallel target, in processes joined by gloo (no Ray): TP=2 shards of the tiny random
models against the single-process decoder, and the refusal of a TP the config cannot split.
The Ray replicas and SmolLM2 are in test_tp_ray.py (slow)."""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch
from drafters import captured_rows
from tp_harness import engine_script, rows_of, run_tp

from target_worker.config import ModelConfig
from target_worker.model import Decoder
from target_worker.sharded import tp_errors, vocab_range
from target_worker.testing import load_tiny_random
from target_worker.tp import create_target_replica, validate_tp

MOE = "tiny-random:vocab=64,seed=1"
REPLICATED = ("norm.weight", "router.weight")  # name endings every rank holds whole
LOGIT_TOL = 1e-4
PROB_TOL = 1e-5


def untied_dense_file(tmp_path):
    """A dense, untied tiny model with a vocabulary (63) that 2 does not divide, saved as a
    specd float32 weights file (the layout the GGUF loader caches)."""
    from safetensors.torch import save_file

    config = replace(ModelConfig.tiny_test(63), moe=None, tie_embeddings=False)
    decoder = Decoder.random(config, seed=2)
    path = tmp_path / "dense.safetensors"
    state = {k: v.contiguous() for k, v in decoder.state_dict().items()}
    save_file(state, path, metadata={"specd_config": json.dumps(asdict(config))})
    return decoder, str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (reference decoder, [rank results])} for three TP=2 configurations."""
    tmp = tmp_path_factory.mktemp("tp")
    out = {}
    moe, _ = load_tiny_random(MOE)
    out["moe"] = (moe, run_tp(2, MOE, tmp / "moe"))
    out["moe-replicated-vocab"] = (moe, run_tp(2, MOE, tmp / "rep", vocab_parallel=False))
    dense, weights = untied_dense_file(tmp)
    out["dense-untied-from-file"] = (dense, run_tp(2, None, tmp / "dense", weights=weights))
    return out


CASES = ["moe", "moe-replicated-vocab", "dense-untied-from-file"]


@pytest.mark.parametrize("case", CASES)
def test_tp2_captures_the_layers_its_steps_ask_as_one_process_does(runs, case):
    """A TP=2 replica's hidden rows for items naming ``hidden_layers`` are the residual
    streams a plain single-process forward captures (`Decoder.set_capture_layers`)."""
    decoder, ranks = runs[case]
    got, layers = ranks[0], ranks[0]["capture_layers"]
    assert layers == (0, 1, decoder.config.n_layers)
    prefill, verify = got["captured"]
    assert all(o is None for o in ranks[1]["captured"][0])  # rank 0 answers
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = captured_rows(decoder, [*prompt, 1, 2], layers)
    h = decoder.config.hidden_size
    assert prefill[0].hidden.shape == (len(prompt), len(layers) * h)
    torch.testing.assert_close(prefill[0].hidden, want[:len(prompt)], rtol=1e-4, atol=LOGIT_TOL)
    torch.testing.assert_close(verify[0].hidden, want[len(prompt):], rtol=1e-4, atol=LOGIT_TOL)
    assert verify[1].hidden is None


@pytest.mark.parametrize("case", CASES)
def test_tp2_logits_and_hidden_match_one_process(runs, case):
    decoder, ranks = runs[case]
    ref = engine_script(decoder, decoder.config.vocab_size)
    got = ranks[0]
    assert len(got["logits"]) == len(ref["logits"]) == 4
    for a, b in zip(ref["logits"], got["logits"], strict=True):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() < LOGIT_TOL
    for a, b in zip(ref["hidden"], got["hidden"], strict=True):
        assert (a - b).abs().max().item() < LOGIT_TOL
    # Rank 1 computes its half but returns no logits (rank 0 answers for the replica).
    assert all(lg is None for lg in ranks[1]["logits"])


@pytest.mark.parametrize("case", CASES)
def test_tp2_greedy_tokens_through_prefill_verify_rollback_match(runs, case):
    decoder, ranks = runs[case]
    ref = engine_script(decoder, decoder.config.vocab_size)
    got = ranks[0]
    # Speculative greedy decoding with rollbacks: some drafts accepted, some rejected.
    assert ref["accepted"] > 0
    assert len(ref["greedy_tokens"]) > len(ref["verify"]) + ref["accepted"]
    assert got["greedy_tokens"] == ref["greedy_tokens"]
    assert got["accepted"] == ref["accepted"]
    steps_ref = [ref["prefill"], *ref["verify"]]
    steps_got = [got["prefill"], *got["verify"]]
    for outs_ref, outs_got in zip(steps_ref, steps_got, strict=True):
        greedy_ref, sampled_ref = outs_ref
        greedy_got, sampled_got = outs_got
        assert rows_of(greedy_got) == rows_of(greedy_ref)
        assert torch.allclose(rows_of(sampled_got), rows_of(sampled_ref), atol=PROB_TOL, rtol=0)
        assert (greedy_got.hidden is None) == (greedy_ref.hidden is None)
        if greedy_ref.hidden is not None:
            assert (greedy_got.hidden - greedy_ref.hidden).abs().max().item() < LOGIT_TOL
    # Ranks other than 0 return None per item.
    assert all(o is None for step in [ranks[1]["prefill"], *ranks[1]["verify"]] for o in step)


@pytest.mark.parametrize("case", CASES)
def test_tp2_ranks_chunk_a_prompt_and_reuse_a_prefix_alike(runs, case):
    decoder, ranks = runs[case]
    ref = engine_script(decoder, decoder.config.vocab_size)
    got = ranks[0]
    assert got["reused"] == ref["reused"] == 79 and ranks[1]["reused"] == 79
    first, second, again = ref["chunked"]
    assert first[0].rows is None and first[0].hidden.shape[0] == 70
    for outs_ref, outs_got in zip(ref["chunked"], got["chunked"], strict=True):
        for o_ref, o_got in zip(outs_ref, outs_got, strict=True):
            assert (o_got.rows is None) == (o_ref.rows is None)
            if o_ref.rows is not None:
                a, b = rows_of(o_ref), rows_of(o_got)
                assert a == b if isinstance(a, tuple) else torch.allclose(a, b, atol=PROB_TOL)
            if o_ref.hidden is not None:
                assert (o_got.hidden - o_ref.hidden).abs().max().item() < LOGIT_TOL
    # The reused prefix gives the prompt's last row as the chunked prefill did.
    assert rows_of(again[0]) == rows_of(second[0])
    assert all(o is None for step in ranks[1]["chunked"] for o in step)


@pytest.mark.parametrize("case", CASES)
def test_each_rank_holds_only_its_shard(runs, case):
    decoder, ranks = runs[case]
    config, tp = decoder.config, len(ranks)
    full = {n: p.numel() for n, p in decoder.named_parameters(remove_duplicate=True)}
    vocab_parallel = case != "moe-replicated-vocab"
    for rank, result in enumerate(ranks):
        counts = result["param_counts"]
        assert result["cache_kv_heads"] == config.n_kv_heads // tp
        for name, n in full.items():
            if name.endswith(REPLICATED):
                assert counts[name] == n, name
            elif name.startswith(("embed_tokens.", "lm_head.")):
                if not vocab_parallel:
                    # Replicated table: everyone has the embedding, rank 0 alone the head.
                    expect = n if name.startswith("embed") or rank == 0 else 0
                else:
                    lo, hi = vocab_range(config.vocab_size, rank, tp)
                    expect = (hi - lo) * config.hidden_size
                assert counts.get(name, 0) == expect, name
            else:  # attention, FFN and expert weights: exactly 1/tp each
                assert counts[name] * tp == n, name
        assert set(counts) <= set(full)
    if vocab_parallel:
        total = sum(full.values())
        replicated = sum(n for name, n in full.items() if name.endswith(REPLICATED))
        # Uneven vocabulary blocks: at most one extra row per table over an exact 1/tp.
        bound = (total - replicated) / tp + replicated + 2 * config.hidden_size
        for result in ranks:
            assert sum(result["param_counts"].values()) <= bound


def test_collectives_move_bytes_on_every_rank(runs):
    _, ranks = runs["moe"]
    assert all(r["comm_bytes"] > 0 for r in ranks)


def test_smollm2_shape_refuses_tp2_and_accepts_tp3():
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9,
                          n_kv_heads=3, head_dim=64, ffn_dim=1536)
    errors = tp_errors(smollm2, 2)
    assert any("attention heads (9)" in e for e in errors)
    assert any("KV heads (3)" in e for e in errors)
    assert tp_errors(smollm2, 3) == []
    assert tp_errors(smollm2, 1) == []


def test_validate_tp_names_the_numbers():
    validate_tp(MOE, 2)  # 4 heads, 2 KV heads, 6 experts
    with pytest.raises(ValueError, match=r"KV heads \(2\) is not divisible by tp=4"):
        validate_tp(MOE, 4)
    with pytest.raises(ValueError, match=r"experts \(6\) is not divisible by tp=4"):
        validate_tp(MOE, 4)
    with pytest.raises(ValueError, match=r"FFN size \(32\) is not divisible by tp=3"):
        validate_tp("tiny-random:dense=1", 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp must be a positive int"):
            validate_tp(MOE, bad)


def test_an_indivisible_tp_is_refused_before_any_actor_starts():
    import ray

    assert not ray.is_initialized()
    with pytest.raises(ValueError, match=r"attention heads \(4\) is not divisible by tp=3"):
        create_target_replica(MOE, tp=3)
    # Starting an actor (or a placement group) would have initialised Ray implicitly.
    assert not ray.is_initialized()


def test_a_bfloat16_shard_computes_in_bf16_and_answers_in_float32():
    # The GPU path's dtype plumbing (bf16 weights, cache, RoPE and mask; float32 results),
    # exercised on the CPU with tp=1.
    from target_worker.sharded import ShardedDecoder, StateDictSource

    decoder, _ = load_tiny_random(MOE)
    shard = ShardedDecoder.load(decoder.config, StateDictSource(decoder.state_dict()), 0, 1,
                                dtype=torch.bfloat16)
    assert shard.dtype == torch.bfloat16
    cache = shard.new_cache()
    assert cache.k.dtype == torch.bfloat16
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    (logits, hidden), = shard.forward_packed([(tokens, 0, cache)])
    ref, ref_hidden = decoder.forward_batch_with_hidden(tokens, 0, decoder.new_cache())
    assert logits.dtype == hidden.dtype == torch.float32
    # bf16 keeps 8 significant bits: errors of a few 1e-2 on these O(1) logits, not more.
    assert (logits - ref).abs().max().item() < 0.1
    assert (hidden - ref_hidden).abs().max().item() < 0.1


def test_gguf_shards_are_slices_of_the_full_model(tmp_path, monkeypatch):
    # GGUF -> float32 cache -> per-rank slices, against the whole-model load of the same file.
    from test_loader import tiny_dense, write_gguf

    from target_worker.disk_cache import weights_cache_path
    from target_worker.loader import load_gguf_decoder, model_config
    from target_worker.tp import load_shard

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    config = tiny_dense()  # 6 heads, 2 KV heads, FFN 32
    path = write_gguf(Decoder.random(config, seed=4), tmp_path / "m.gguf")
    assert model_config(path) == config  # from the GGUF metadata: no cache yet
    assert not weights_cache_path(path).exists()
    with pytest.raises(ValueError, match=r"attention heads \(6\) is not divisible by tp=4"):
        validate_tp(str(path), 4)
    validate_tp(str(path), 2)
    shards = [load_shard(str(path), rank, 2) for rank in range(2)]
    assert weights_cache_path(path).exists() and model_config(path) == config
    full = load_gguf_decoder(path)
    h, kvh, d, ffn = config.n_heads, config.n_kv_heads, config.head_dim, config.ffn_dim
    for rank, shard in enumerate(shards):
        for i in range(config.n_layers):
            f, s = full.layers[i], shard.layers[i]
            wqkv = f.attn.wqkv.weight
            q = wqkv[rank * h // 2 * d:(rank + 1) * h // 2 * d]
            k = wqkv[h * d:][rank * kvh // 2 * d:(rank + 1) * kvh // 2 * d]
            v = wqkv[(h + kvh) * d:][rank * kvh // 2 * d:(rank + 1) * kvh // 2 * d]
            assert torch.equal(s.attn.wqkv.weight, torch.cat([q, k, v]))
            cols = slice(rank * h // 2 * d, (rank + 1) * h // 2 * d)
            assert torch.equal(s.attn.wo.weight, f.attn.wo.weight[:, cols])
            part = slice(rank * ffn // 2, (rank + 1) * ffn // 2)
            gate, up = f.ffn.w_gate_up.weight[:ffn], f.ffn.w_gate_up.weight[ffn:]
            assert torch.equal(s.ffn.w_gate_up.weight, torch.cat([gate[part], up[part]]))
            assert torch.equal(s.ffn.w_down.weight, f.ffn.w_down.weight[:, part])
        lo, hi = vocab_range(config.vocab_size, rank, 2)
        assert torch.equal(shard.embed_tokens.weight, full.embed_tokens.weight[lo:hi])


def test_a_replicas_step_bytes_are_counted_without_pickling_the_step(monkeypatch):
    """`TPRank` meters ``bytes_in`` / ``bytes_out`` from the items' and outputs' structure
    (`payload_bytes`); serialising the step again to measure it would cost a copy per step."""
    import pickle

    from specd_core.sampling import SamplingParams
    from specd_core.step import PrefillItem, VerifyItem, payload_bytes
    from target_worker.tp import TPRank

    threads = torch.get_num_threads()
    try:
        rank = TPRank(MOE, max_slots=2, num_threads=1)
    finally:
        torch.set_num_threads(threads)

    def refuse(*args, **kwargs):
        raise AssertionError("the step was pickled to meter it")

    monkeypatch.setattr(pickle, "dumps", refuse)
    slot = rank.allocate()
    prefill = [PrefillItem(slot, [1, 2, 3], SamplingParams(), want_hidden=True)]
    out = rank.prefill(prefill)
    verify = [VerifyItem(slot, 3, [4, 5], SamplingParams())]
    out2 = rank.verify(verify)
    step = rank.status()["step"]
    assert step["bytes_in"] == payload_bytes(prefill) + payload_bytes(verify)
    assert step["bytes_out"] == payload_bytes(out) + payload_bytes(out2)
    assert rank.status()["last_step"]["bytes_out"] == payload_bytes(out2) > 0
