"""The decoder's device-dependent kernels agree: the GPU attention path
(``scaled_dot_product_attention`` with grouped-query heads) and GPU linear path
(``F.linear``), forced on the CPU here, give the CPU paths' logits."""

from __future__ import annotations

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
