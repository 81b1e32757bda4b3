"""The CUDA-graph step path and the CUDA settings, checked on the CPU: the bucket logic, the
fixed-shape forward a graph captures (bitwise the eager forward, padded rows and whole key
blocks included), the decode-vs-verify check, and the device setting's plumbing. Replay
itself needs a GPU: `scripts/gpu_check.py` checks it there."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import target_worker.invariant as inv
from target_worker.cuda import configure_cublas, cublas_settings, decode_verify_mismatches
from target_worker.graphs import GraphedDecoder, block_bucket, graphable, row_bucket
from target_worker.loader import load_decoder, load_model
from target_worker.model import KEY_BLOCK, Decoder

DENSE = "tiny-random:vocab=64,seed=6,layers=2,dense=1"


@pytest.fixture(autouse=True)
def _fresh_verdicts(monkeypatch, tmp_path):
    """The torch forward (what a GPU runs), kernels checked afresh for each test."""
    monkeypatch.setenv("SPECD_NATIVE", "0")
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    monkeypatch.setattr(inv, "_VERDICTS", {})
    monkeypatch.setattr(inv, "_DISK_LOADED", False)
    monkeypatch.setattr(inv, "_CONFIRMED", set())


def _decoder(dtype=torch.float32, context=4 * KEY_BLOCK, invariant=True):
    decoder, _ = load_model(DENSE, dtype="float32")
    longer = Decoder(dataclasses.replace(decoder.config, max_seq_len=context))
    longer.load_state_dict(decoder.state_dict())
    longer = longer.to(dtype)
    if invariant:
        longer.make_batch_invariant()
    return longer


def test_row_bucket_is_the_least_bucket_holding_the_rows():
    assert [row_bucket(m, (1, 4, 8)) for m in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert row_bucket(9, (1, 4, 8)) is None
    assert row_bucket(17) == 17 and row_bucket(18) is None
    with pytest.raises(ValueError, match="at least one token"):
        row_bucket(0)


def test_block_bucket_is_a_power_of_two_of_blocks_capped_at_the_capacity():
    cap = 6 * KEY_BLOCK
    got = [block_bucket(end, cap) for end in (1, KEY_BLOCK, KEY_BLOCK + 1, 3 * KEY_BLOCK,
                                              3 * KEY_BLOCK + 1, cap)]
    assert got == [1, 1, 2, 4, 4, 6]
    with pytest.raises(ValueError, match="end must be in"):
        block_bucket(cap + 1, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_forward_rows_equal_the_eager_forward_bitwise(dtype):
    """Decode steps and verify blocks through `GraphedDecoder` (padded to buckets 1, 4, 8,
    18; reading 1, 2 or 4 whole key blocks, across the 256-position boundaries, with
    rollbacks) give the logits of the decoder's own forward of the same tokens, bitwise."""
    decoder = _decoder(dtype)
    graphed = GraphedDecoder(decoder, buckets=(1, 4, 8, 18), capture=False)
    eager = decoder.new_cache()
    rng = random.Random(3)
    prompt = [rng.randrange(64) for _ in range(KEY_BLOCK - 5)]
    assert torch.equal(graphed.prefill(prompt), decoder.forward_batch(prompt, 0, eager))
    steps = 0
    while graphed.cache.seq_len < 2 * KEY_BLOCK + 20:
        n = rng.choice([1, 1, 3, 5, 9, 17])
        block = [rng.randrange(64) for _ in range(n)]
        start = graphed.cache.seq_len
        got = graphed.step(block).clone()
        want = decoder.forward_batch(block, start, eager)
        assert torch.equal(got, want), (start, n)
        if n > 1 and rng.random() < 0.5:  # reject a tail, as verification does
            keep = start + rng.randrange(1, n)
            graphed.rollback(keep)
            eager.truncate(keep)
        steps += 1
    assert steps > 10
    # A block above every bucket runs eagerly, with the same result.
    block = [rng.randrange(64) for _ in range(19)]
    start = graphed.cache.seq_len
    assert torch.equal(graphed.step(block), decoder.forward_batch(block, start, eager))


def test_graphed_decoder_refuses_what_it_cannot_graph():
    with pytest.raises(ValueError, match="not batch invariant"):
        GraphedDecoder(_decoder(invariant=False), capture=False)
    with pytest.raises(ValueError, match="need a CUDA decoder"):
        GraphedDecoder(_decoder(), capture=True)
    moe, _ = load_model("tiny-random:vocab=64,seed=5,layers=2", dtype="float32")
    moe.make_batch_invariant()
    assert "mixture-of-experts" in graphable(moe)


def test_graphed_step_checks_its_tokens_before_writing():
    graphed = GraphedDecoder(_decoder(), capacity=KEY_BLOCK, buckets=(1, 4), capture=False)
    graphed.prefill([1, 2, 3])
    before = graphed.cache.k.clone()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        graphed.step([1, 64])
    assert graphed.cache.seq_len == 3 and torch.equal(graphed.cache.k, before)
    with pytest.raises(ValueError, match="capacity of 256"):
        graphed.step([1] * (KEY_BLOCK - 2))  # the graphed cache never grows
    assert graphed.cache.k.shape[1] == 1


def test_decode_verify_check_passes_an_invariant_decoder_and_catches_one_that_is_not():
    assert decode_verify_mismatches(_decoder(), ks=(1, 4), starts=(3, 250)) == []

    class Drifting(Decoder):
        """A forward whose rows change with the block's size (what a non-invariant kernel
        does): every row of a block of more than one token is nudged."""

        def forward_batch(self, tokens, start_pos, cache):
            out = super().forward_batch(tokens, start_pos, cache)
            return out + 1e-3 if len(tokens) > 1 else out

    plain = _decoder()
    drifting = Drifting(plain.config)
    drifting.load_state_dict(plain.state_dict())
    found = decode_verify_mismatches(drifting, ks=(4,), starts=(3,))
    assert len(found) == 1 and found[0].startswith("k=4 start=3: row 0 differs")


def test_cublas_settings_are_applied_and_read_back():
    settings = configure_cublas()
    assert settings["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert settings["CUBLASLT_WORKSPACE_SIZE"] == "1"
    assert settings["allow_tf32"] is False and settings["cudnn_allow_tf32"] is False
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False
    assert cublas_settings()["allow_fp16_reduced_precision_reduction"] == "False"


def test_a_cuda_device_is_refused_by_name_where_torch_has_none():
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    with pytest.raises(ValueError, match="device 'cuda': torch here has no CUDA device"):
        load_decoder(DENSE, "float32", device="cuda")


def test_the_device_setting_reaches_caches_and_rope_tables():
    decoder = load_decoder(DENSE, "float32", device="cpu")
    assert decoder.device == torch.device("cpu")
    cache = decoder.new_cache()
    assert cache.k.device == decoder.device
    decoder.forward_batch([1, 2], 0, cache)
    assert decoder._cos.device == decoder.device
