"""The native CPU forward (`target_worker.native`, ``csrc/forward.c``): the same model as the
torch forward, each row's bits independent of the batch, the thread count and the call's size
(in float32 and in q8), weights read as a GGUF file stores them."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import pickle

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from target_worker import native
from target_worker.config import ModelConfig
from target_worker.model import KEY_BLOCK, Decoder
from target_worker.native import StoredWeight, fingerprint

pytestmark = pytest.mark.skipif(native.native_unavailable() is not None,
                                reason=f"no native forward here: {native.native_unavailable()}")

#: Every size a multiple of 32 (whole quantization blocks), two KV heads of four query heads,
#: and a context that crosses a key block.
CONFIG = ModelConfig(vocab_size=96, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=128, max_seq_len=2 * KEY_BLOCK + 64)


def quantized(decoder: Decoder, types: dict[str, T]) -> Decoder:
    """``decoder`` with each matrix rounded to a ggml type as a GGUF file would store it: the
    float32 weights become the dequantized values, `stored_weights` the blocks."""
    stored = {}

    def put(name: str, tensor: torch.Tensor, kind: T) -> None:
        blocks = gguf.quants.quantize(tensor.numpy(), kind)
        tensor.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(tensor.shape)))
        data = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(
            tensor.shape[0], -1).copy())
        stored[name] = StoredWeight(int(kind), tensor.shape[0], tensor.shape[1], data)

    c = decoder.config
    h, kvh, d, f = c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim
    with torch.no_grad():
        put("embed", decoder.embed_tokens.weight, types["embed"])
        for i, block in enumerate(decoder.layers):
            qkv = block.attn.wqkv.weight
            put(f"{i}.q", qkv[: h * d], types["q"])
            put(f"{i}.k", qkv[h * d : (h + kvh) * d], types["k"])
            put(f"{i}.v", qkv[(h + kvh) * d :], types["v"])
            put(f"{i}.o", block.attn.wo.weight, types["o"])
            put(f"{i}.gate", block.ffn.w_gate_up.weight[:f], types["gate"])
            put(f"{i}.up", block.ffn.w_gate_up.weight[f:], types["up"])
            put(f"{i}.down", block.ffn.w_down.weight, types["down"])
    decoder.stored_weights = stored
    decoder.stored_fingerprint = fingerprint(decoder)
    return decoder


MIXED = {"embed": T.Q8_0, "q": T.Q4_0, "k": T.Q4_1, "v": T.Q8_0, "o": T.Q4_1, "gate": T.Q4_1,
         "up": T.Q4_0, "down": T.Q8_0}


def model(mode: str = "float32", stored: bool = True, seed: int = 3) -> Decoder:
    decoder = Decoder.random(CONFIG, seed=seed)
    if stored:
        quantized(decoder, MIXED)
    decoder.native_mode = mode
    return decoder


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, CONFIG.vocab_size, (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


def test_float32_is_the_torch_forward_up_to_the_order_of_sums():
    """The native float32 forward computes the model the torch forward computes (same weights,
    same operations): only the summation order differs."""
    ref = model(stored=True)
    fast = copy.deepcopy(ref)
    assert "native" in fast.make_batch_invariant((1,))
    seq = tokens(300)
    want = ref.forward_batch(seq, 0, ref.new_cache())
    got = fast.forward_batch(seq, 0, fast.new_cache())
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_stored_blocks_are_the_float32_weights():
    """Multiplying the stored blocks and the float32 weights gives the same logits: the
    dequantization is gguf-py's, bit for bit."""
    a = model()
    b = copy.deepcopy(a)
    b.stored_weights = None
    a.make_batch_invariant((1,))
    b.make_batch_invariant((1,))
    assert a._native_forward().weight_types == ["Q4_0", "Q4_1", "Q8_0"]
    assert b._native_forward().weight_types == ["F32"]
    seq = tokens(40)
    assert torch.equal(a.forward_batch(seq, 0, a.new_cache()),
                       b.forward_batch(seq, 0, b.new_cache()))


@pytest.mark.parametrize("mode", ["float32", "q8", "bfloat16"])
def test_rows_do_not_depend_on_the_step(mode):
    """Each row's logits and hidden rows are bitwise the row computed alone, one token at a
    time, whether it is fed in a prompt chunk of any size, a verify block, beside other
    sequences, across a key block boundary, on one thread or two."""
    decoder = model(mode) if mode != "bfloat16" else model().to(torch.bfloat16)
    decoder.make_batch_invariant((1, 2))
    assert decoder._native_forward().mode == mode
    seq = tokens(KEY_BLOCK + 40, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = decoder.new_cache()
        ref = [decoder.forward_batch_with_hidden([t], p, alone) for p, t in enumerate(seq)]
        for t in (1, 2):
            torch.set_num_threads(t)
            cache, at = decoder.new_cache(), 0
            for size in (37, 1, 64, 9, 128, 17, 40):
                logits, hidden = decoder.forward_batch_with_hidden(seq[at:at + size], at, cache)
                for i in range(size):
                    assert torch.equal(logits[i], ref[at + i][0][0]), (mode, t, at + i)
                    assert torch.equal(hidden[i], ref[at + i][1][0]), (mode, t, at + i)
                at += size
            # A verify block rolled back and fed again beside two other sequences.
            cache.truncate(KEY_BLOCK + 20)
            others = [decoder.new_cache(), decoder.new_cache()]
            out = decoder.forward_packed([
                (seq[:3], 0, others[0]), (seq[KEY_BLOCK + 20:], KEY_BLOCK + 20, cache),
                (seq[:11], 0, others[1])])
            for i in range(20):
                assert torch.equal(out[1][0][i], ref[KEY_BLOCK + 20 + i][0][0])
            for i in range(11):
                assert torch.equal(out[2][0][i], ref[i][0][0])
    finally:
        torch.set_num_threads(threads)


def test_bfloat16_weights_run_natively_with_a_bfloat16_cache():
    """A bfloat16 decoder multiplies its bfloat16 weights in float32: the float32 forward
    of the same (rounded) weights, up to the order of sums, with a bfloat16 KV cache."""
    b16 = model(stored=False).to(torch.bfloat16)
    ref = copy.deepcopy(b16).float()  # the rounded weights, in float32, the torch forward
    b16.make_batch_invariant((1,))
    assert b16.new_cache().k.dtype == torch.bfloat16
    assert b16._native_forward().weight_types == ["BF16"]
    seq = tokens(30, seed=7)
    got = b16.forward_batch(seq, 0, b16.new_cache())
    want = ref.forward_batch(seq, 0, ref.new_cache())
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.02 * want.abs().max()  # the cache's rounding only


def test_the_check_refuses_a_forward_whose_rows_depend_on_the_step(monkeypatch, tmp_path):
    """The start-up check has teeth: a forward whose rows move with the call's size (by one
    part in a million) is refused, and the decoder runs the torch forward instead."""
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))  # no stored verdict
    monkeypatch.setattr(native, "_PROVEN", set())
    real = native.NativeForward.forward

    def skewed(self, decoder, ids, segments, last, capture):
        out = real(self, decoder, ids, segments, last, capture)
        rows = sum(i.numel() for i in ids)
        return [(logits * (1 + 1e-6 * (rows > 1)), hidden) for logits, hidden in out]

    monkeypatch.setattr(native.NativeForward, "forward", skewed)
    decoder = model()
    report = decoder.make_batch_invariant((1,))
    assert "batch-invariance check failed" in report["native_off"]
    assert "differs from the row computed alone" in report["native_off"]
    assert decoder._native_forward() is None and "linear" in report


def test_q8_is_close_to_float32_and_keeps_a_float16_cache():
    f32, q8 = model("float32"), model("q8")
    f32.make_batch_invariant((1,))
    q8.make_batch_invariant((1,))
    assert q8.new_cache().k.dtype == torch.float16
    assert f32.new_cache().k.dtype == torch.float32
    seq = tokens(64, seed=2)
    a = f32.forward_batch(seq, 0, f32.new_cache())
    b = q8.forward_batch(seq, 0, q8.new_cache())
    assert not torch.equal(a, b)  # another arithmetic ...
    assert (a - b).abs().max() < 0.05 * a.abs().max()  # ... of the same model


def test_a_cache_of_another_dtype_is_refused_by_name():
    decoder = model("q8")
    decoder.make_batch_invariant((1,))
    wrong = Decoder.random(CONFIG).new_cache()  # float32
    with pytest.raises(ValueError, match="float32 KV cache.*float16"):
        decoder.forward_batch([1, 2], 0, wrong)


def test_a_changed_weight_is_seen():
    """In place or replaced, a weight changed after the plan is what the next forward uses
    (the stored blocks no longer describe it, so the float32 tensor is multiplied)."""
    decoder = model()
    decoder.make_batch_invariant((1,))
    seq = tokens(20, seed=4)
    before = decoder.forward_batch(seq, 0, decoder.new_cache())
    with torch.no_grad():
        decoder.layers[1].ffn.w_down.weight.mul_(1.5)
    changed = decoder.forward_batch(seq, 0, decoder.new_cache())
    plain = copy.deepcopy(decoder)
    plain.stored_weights = None
    plain._native = None
    assert not torch.equal(changed, before)
    assert torch.equal(changed, plain.forward_batch(seq, 0, plain.new_cache()))
    with torch.no_grad():
        decoder.norm.weight = torch.nn.Parameter(decoder.norm.weight * 0.5)
    assert not torch.equal(decoder.forward_batch(seq, 0, decoder.new_cache()), changed)


def test_copies_build_their_own_native_forward():
    decoder = model("q8")
    decoder.make_batch_invariant((1,))
    seq = tokens(12, seed=5)
    want = decoder.forward_batch(seq, 0, decoder.new_cache())
    for other in (copy.deepcopy(decoder), pickle.loads(pickle.dumps(decoder))):
        assert other._native is None
        assert torch.equal(other.forward_batch(seq, 0, other.new_cache()), want)


def test_turned_off_it_is_the_torch_forward(monkeypatch):
    monkeypatch.setenv("SPECD_NATIVE", "0")
    decoder = model()
    report = decoder.make_batch_invariant((1,))
    assert report["native_off"] == "SPECD_NATIVE=0"
    assert decoder._native_forward() is None
    assert decoder.new_cache().k.dtype == torch.float32


def test_decoders_it_does_not_run_say_why():
    moe = Decoder.random(ModelConfig.tiny_test(32))
    assert "mixture-of-experts" in native.supports(moe)
    assert "float16" in native.supports(Decoder.random(CONFIG).to(torch.float16))
    report = moe.make_batch_invariant((1,))
    assert "mixture-of-experts" in report["native_off"] and "linear" in report


def test_no_compiler_is_a_clear_refusal(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_LIB", None)
    monkeypatch.setattr(native, "_UNAVAILABLE", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.library()
    decoder = model()
    assert "no C compiler" in decoder.make_batch_invariant((1,))["native_off"]


# --- the kernels ---------------------------------------------------------------------------


def _stored(kind: T, n: int, k: int, seed: int = 0) -> tuple[StoredWeight, torch.Tensor]:
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((n, k)).astype(np.float32)
    w[0, :8] = 0.0
    w[1, :] *= 1e-30  # tiny scales: half-precision d rounds to a denormal or zero
    blocks = gguf.quants.quantize(w, kind)
    dense = gguf.quants.dequantize(blocks, kind).reshape(n, k).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(blocks).view(np.uint8).reshape(n, -1).copy())
    return StoredWeight(int(kind), n, k, data), torch.from_numpy(dense)


@pytest.mark.parametrize("kind", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0])
def test_dequantization_is_gguf_py_bit_for_bit(kind):
    w, dense = _stored(kind, 37, 96)
    lib = native.library()
    mat = native._wmat(w)
    out = torch.empty(96 + 16)
    for row in range(w.n):
        lib.specd_dequant_row(ctypes.byref(mat), row, out.data_ptr())
        assert torch.equal(out[:96], dense[row]), row


def _packed(w: StoredWeight):
    lib = native.library()
    mat = native._wmat(w)
    buf = torch.empty(lib.specd_packed_bytes(ctypes.byref(mat)), dtype=torch.uint8)
    assert lib.specd_repack(ctypes.byref(mat), buf.data_ptr()) == 0
    return native._WMat(mat.type + 100, mat.n, mat.k, 0, 0, buf.data_ptr()), buf


def _matmul(mat, x: torch.Tensor, n_out: int, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], n_out)
    assert native.library().specd_matmul(ctypes.byref(mat), x.data_ptr(), x.shape[0],
                                         x.shape[1], y.data_ptr(), threads) == 0
    return y


@pytest.mark.parametrize("kind", [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0])
@pytest.mark.parametrize("packed", [False, True])
def test_matmul_rows_never_depend_on_the_call(kind, packed):
    """Every row of every call size (1-17 rows, a prompt chunk) on one thread or two is the
    row computed alone, on activations with denormals, zeros and exact cancellations."""
    if packed and kind not in (T.Q4_0, T.Q4_1, T.Q8_0):
        pytest.skip("only Q4_0, Q4_1 and Q8_0 are multiplied in integers")
    w, _ = _stored(kind, 75, 160, seed=int(kind))  # 75 columns: a partial tile and group
    keep = None
    mat = native._wmat(w)
    if packed:
        mat, keep = _packed(w)
    gen = torch.Generator().manual_seed(int(kind))
    x = torch.randn(70, 160, generator=gen)
    x[::3, :80] *= 1e-39  # denormal activations
    x[1::4, ::7] = 0.0
    x[2, 1::2] = -x[2, ::2]  # pairs that cancel
    alone = torch.cat([_matmul(mat, x[r:r + 1], w.n, 1) for r in range(x.shape[0])])
    for rows in (*range(2, 18), 70):
        for threads in (1, 2):
            assert torch.equal(_matmul(mat, x[:rows], w.n, threads), alone[:rows]), \
                (rows, threads)
    del keep


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q8_0])
def test_q8_matmul_is_its_formula(kind):
    """x rounded to int8 blocks (scale amax / 127, ties to even), integer block sums times
    d * dx, plus m times the block's float sum for Q4_1: computed here in float64."""
    w, dense = _stored(kind, 40, 128, seed=9)
    mat, keep = _packed(w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
    got = _matmul(mat, x, w.n, 2).double()
    raw = w.data.numpy().reshape(w.n, 4, -1)
    d = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)
    if kind == T.Q8_0:
        q = raw[:, :, 2:].view(np.int8).astype(np.float64)
        m = np.zeros_like(d)
    else:
        off = 4 if kind == T.Q4_1 else 2
        nib = raw[:, :, off:]
        q = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.float64)
        m = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64) \
            if kind == T.Q4_1 else np.zeros_like(d)
        if kind == T.Q4_0:
            q -= 8
    xb = x.numpy().reshape(3, 4, 32)
    dx = (np.abs(xb).max(-1).astype(np.float32) / np.float32(127)).astype(np.float64)
    qx = np.clip(np.round(xb / dx[..., None]), -127, 127)
    isum = np.einsum("cbk,rbk->rcb", q, qx)
    want = (isum * d[None] * dx[:, None, :] + m[None] * xb.sum(-1)[:, None, :]).sum(-1)
    assert np.allclose(got.numpy(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    del keep, dense


def test_vector_exp():
    x = torch.cat([torch.linspace(-90, 90, 4001), torch.tensor([-1e30, -86.5, 88.8,
                                                                float("inf"), float("-inf")])])
    y = torch.empty_like(x)
    native.library().specd_exp(x.data_ptr(), y.data_ptr(), x.numel())
    ok = (x > -86) & (x < 88.7)
    assert torch.allclose(y[ok].double(), x[ok].double().exp(), rtol=3e-7, atol=0)
    assert torch.all(y[x < -86] == 0)
    assert torch.all(torch.isinf(y[x > 88.73]))
    nan = torch.tensor([float("nan")] * 16)
    native.library().specd_exp(nan.data_ptr(), y.data_ptr(), 16)
    assert torch.all(torch.isnan(y[:16]))


# --- loading -------------------------------------------------------------------------------


def test_a_quantized_gguf_file_is_read_as_stored(tmp_path, monkeypatch):
    """A GGUF file with Q4_0 / Q4_1 / Q8_0 matrices: the loader keeps their blocks (Q and K
    rows un-permuted like the float32 weights) and the native forward multiplies them, with
    the float32 forward's logits bit for bit; "auto" takes q8 for such a file."""
    from gguf_files import write_gguf

    from target_worker.loader import load_decoder

    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "cache"))
    kinds = {"token_embd": T.Q8_0, "attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q8_0,
             "attn_output": T.Q4_1, "ffn_gate": T.Q4_1, "ffn_up": T.Q4_0, "ffn_down": T.Q8_0}
    path = write_gguf(Decoder.random(CONFIG, seed=5), tmp_path / "q.gguf", types=kinds)
    loaded = load_decoder(path, "float32")
    assert loaded.native_mode == "float32"
    assert loaded.stored_weights["0.q"].type == int(T.Q4_0)
    assert loaded.stored_weights["1.k"].type == int(T.Q4_1)
    assert loaded.stored_weights["embed"].type == int(T.Q8_0)
    plain = copy.deepcopy(loaded)
    plain.stored_weights = None
    loaded.make_batch_invariant((1,))
    plain.make_batch_invariant((1,))
    assert loaded._native_forward().weight_types == ["Q4_0", "Q4_1", "Q8_0"]
    seq = tokens(30, seed=6)
    assert torch.equal(loaded.forward_batch(seq, 0, loaded.new_cache()),
                       plain.forward_batch(seq, 0, plain.new_cache()))
    again = load_decoder(path, "auto")  # from the cache this time
    assert again.native_mode == "q8"
    assert torch.equal(again.stored_weights["1.k"].data, loaded.stored_weights["1.k"].data)
    assert dataclasses.asdict(again.config) == dataclasses.asdict(loaded.config)


@pytest.mark.parametrize("march", [
    "x86-64-v3",  # AVX2 + FMA + F16C: the Zen 3 machines' kernels
    pytest.param("x86-64", marks=pytest.mark.slow),  # no AVX: the plain C kernels
])
def test_the_other_instruction_sets_are_invariant_too(march, tmp_path):
    """The kernels this CPU does not pick, built for an older instruction set and run here:
    the same invariance, kernel and model tests pass."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() != "x86_64" or "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("needs an x86-64 CPU with AVX2")
    env = {**os.environ, "SPECD_NATIVE_MARCH": march, "SPECD_CACHE": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "rows or matmul or dequant or q8 or exp or float32", "-m", "not slow"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "passed" in done.stdout
