"""The decoder's device-dependent kernels agree: the GPU attention path
(``scaled_dot_product_attention`` with grouped-query heads) and GPU linear path
(``F.linear``), forced on the CPU here, give the CPU paths' logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import target_worker.model as model_module
from target_worker.loader import load_model


def _forwards(decoder):
    """Prefill, a k=1 step, a k=5 verify block after a rollback, and a packed forward."""
    out = []
    cache = decoder.new_cache()
    out.append(decoder.forward_batch(list(range(3, 40)), 0, cache))
    out.append(decoder.forward_batch([7], 37, cache))
    cache.truncate(30)
    out.append(decoder.forward_batch([1, 2, 3, 4, 5], 30, cache))
    other = decoder.new_cache()
    decoder.forward_batch([9, 8, 7, 6], 0, other)
    packed = decoder.forward_packed([([11, 12], 35, cache), ([13], 4, other)])
    out += [logits for logits, _ in packed]
    return out


def test_gpu_attention_and_linear_paths_match_the_cpu_paths(monkeypatch):
    for spec in ("tiny-random:vocab=64,seed=1,layers=2",
                 "tiny-random:vocab=64,seed=2,layers=2,dense=1"):
        decoder, _ = load_model(spec)
        reference = _forwards(decoder)
        with monkeypatch.context() as m:
            m.setattr(model_module, "_use_sdpa", lambda x: True)
            m.setattr(model_module, "fast_linear", lambda x, w, b=None: F.linear(x, w, b))
            forced = _forwards(decoder)
            # The forced paths really ran: SDPA is what this forward calls.
            calls = []
            real = F.scaled_dot_product_attention
            m.setattr(F, "scaled_dot_product_attention",
                      lambda *a, calls=calls, real=real, **k: calls.append(1) or real(*a, **k))
            decoder.forward_batch([1, 2], 0, decoder.new_cache())
            assert len(calls) == decoder.config.n_layers
        for a, b in zip(reference, forced, strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_fast_linear_equals_f_linear_at_every_row_count_either_side_of_both_thresholds():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=gen)
    bias = torch.randn(48, generator=gen)
    rows = {1, 2, model_module.FAST_LINEAR_MIN_ROWS - 1, model_module.FAST_LINEAR_MIN_ROWS,
            33, 64, 65}
    for n in sorted(rows):
        x = torch.randn(n, 40, generator=gen)
        for b in (None, bias):
            got = model_module.fast_linear(x, weight, b)
            assert got.shape == (n, 48)
            assert torch.allclose(got, F.linear(x, weight, b), atol=1e-5, rtol=0), n


needs_mkl = pytest.mark.skipif(not model_module.mkl_packing_available(),
                               reason="this torch has no MKL packed GEMM")


def _linear_module(out_f: int = 48, in_f: int = 40, bias: bool = True) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(in_f, out_f, bias=bias).requires_grad_(False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_f, in_f, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_f, generator=gen))
    return layer


@needs_mkl
def test_packed_weights_run_the_packed_gemm_from_2_to_packed_max_rows_and_agree_with_f_linear():
    # 1536 inputs: long enough dot products that the packed GEMM's summation order differs
    # from the unpacked kernels' in the last bits, so the routing below is observable.
    layer = _linear_module(96, 1536)
    weight = layer.weight
    assert model_module.pack_weights(layer) == 1
    copy = model_module._PACKED[weight][0]

    def unpacked(x, b):
        entry = model_module._PACKED.pop(weight)
        try:
            return model_module.fast_linear(x, weight, b)
        finally:
            model_module._PACKED[weight] = entry

    gen = torch.Generator().manual_seed(2)
    top = model_module.PACKED_MAX_ROWS
    routed_differently = 0
    for n in (1, 2, 3, model_module.FAST_LINEAR_MIN_ROWS, 64, 65, top, top + 1):
        x = torch.randn(n, 1536, generator=gen)
        for b in (None, layer.bias):
            got = model_module.fast_linear(x, weight, b)
            assert got.shape == (n, 96)
            # float32 rounding of 1536-term sums of magnitude ~40: a few 1e-5.
            assert torch.allclose(got, F.linear(x, weight, b), atol=2e-4, rtol=0), n
            if 2 <= n <= top:  # routed through the packed copy: bit-equal to it
                assert torch.equal(got, torch.ops.mkl._mkl_linear(x, copy, weight, b, n)), n
                routed_differently += not torch.equal(got, unpacked(x, b))
            else:  # 1 row and prompt-sized inputs keep the unpacked paths
                assert torch.equal(got, unpacked(x, b)), n
    assert routed_differently > 0  # the check above could tell the two paths apart


@needs_mkl
def test_a_weight_changed_in_place_after_packing_is_multiplied_as_it_is_now():
    layer = _linear_module(bias=False)
    model_module.pack_weights(layer)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    before = model_module.fast_linear(x, layer.weight)
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    after = model_module.fast_linear(x, layer.weight)
    assert torch.allclose(after, -2.0 * before, atol=1e-4, rtol=0)
    # Packing again refreshes the copy, and only the changed weight is packed.
    assert model_module.pack_weights(layer) == 1
    assert model_module.pack_weights(layer) == 0
    assert torch.allclose(model_module.fast_linear(x, layer.weight), after, atol=1e-5, rtol=0)


@needs_mkl
def test_a_weight_given_new_data_after_packing_is_multiplied_unpacked():
    layer = _linear_module(bias=False)
    model_module.pack_weights(layer)
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(4))
    layer.weight.data = layer.weight.data * 3.0  # what Module.to does to a parameter
    assert torch.allclose(model_module.fast_linear(x, layer.weight), F.linear(x, layer.weight),
                          atol=1e-4, rtol=0)


@needs_mkl
def test_pack_weights_skips_trainable_and_non_float32_weights_and_packs_a_shared_weight_once():
    trainable = torch.nn.Linear(40, 48)
    assert model_module.pack_weights(trainable) == 0
    half = _linear_module().to(torch.bfloat16)
    assert model_module.pack_weights(half) == 0
    a = _linear_module()
    b = _linear_module()
    b.weight = a.weight  # tied, as an LM head and its embedding
    assert model_module.pack_weights(torch.nn.ModuleList([a, b]), extra=[a.weight]) == 1


@needs_mkl
def test_a_target_engine_packs_its_decoders_weights_and_tied_head():
    from target_worker.engine import TargetEngine

    decoder, _ = load_model("tiny-random:vocab=64,seed=3,layers=2,dense=1")
    TargetEngine(decoder, max_slots=1)
    linear_weights = [m.weight for m in decoder.modules() if isinstance(m, torch.nn.Linear)]
    for weight in [*linear_weights, decoder.head_weight()]:
        entry = model_module._PACKED.get(weight)
        assert entry is not None and entry[1] == (weight._version, weight.data_ptr())
