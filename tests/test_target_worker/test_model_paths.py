"""The decoder's kernels compute what the reference ones do: its blocked, fixed-order
attention gives ``scaled_dot_product_attention``'s logits, and `fast_linear` gives
``F.linear``'s, up to float32 rounding."""

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


def _sdpa_forwards(decoder, monkeypatch):
    """`_forwards` with attention computed by ``scaled_dot_product_attention`` over the
    cache's committed positions (the reference: what transformers' SDPA path computes)."""

    def sdpa(self, q, cache, layer, chunk, plans):
        m = q.shape[0]
        end = chunk.pos + m
        keys = cache.keys(chunk.pos + m - end, end)[layer]  # [kvh, end, d]
        values = cache.values(0, end)[layer]
        allowed = torch.arange(end)[None, :] <= torch.arange(chunk.pos, end)[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(), keys[None].float(), values[None].float(),
            attn_mask=allowed, scale=self.scale, enable_gqa=True)  # [1, h, m, d]
        return o[0].transpose(0, 1).reshape(m, -1)

    with monkeypatch.context() as m:
        m.setattr(model_module.Attention, "_attend", sdpa)
        return _forwards(decoder)


def test_blocked_attention_computes_what_scaled_dot_product_attention_does(monkeypatch):
    for spec in ("tiny-random:vocab=64,seed=1,layers=2",
                 "tiny-random:vocab=64,seed=2,layers=2,dense=1"):
        decoder, _ = load_model(spec, dtype="float32")  # SDPA agrees to float32 rounding
        decoder.make_batch_invariant()
        reference = _sdpa_forwards(decoder, monkeypatch)
        for a, b in zip(reference, _forwards(decoder), strict=True):
            assert a.shape == b.shape
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
            assert not torch.equal(a, torch.zeros_like(a))


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
