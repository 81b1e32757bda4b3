"""Times one layer's attention on SmolLM2 shapes, bmm + softmax (specd's verify path) against
``scaled_dot_product_attention`` (its long-segment path), for prompt- and chunk-shaped
queries: the measurements behind `target_worker.model.SDPA_MIN_ROWS`.

Usage: ``python scripts/attention_paths.py [--threads N]``. Prints one line per shape:
milliseconds per call of each path and their largest absolute difference.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from target_worker.model import causal_mask

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
GROUP = HEADS // KV_HEADS
SCALE = 1 / math.sqrt(HEAD_DIM)
#: (query rows, keys): verify blocks, prefill chunks after a cached prefix, whole prompts.
SHAPES = [(8, 300), (8, 2000), (32, 2000), (64, 6000), (256, 2048), (512, 2048), (512, 6144),
          (2048, 2048), (6144, 6144)]


def bmm_path(q, k, v, start):
    m, end = q.shape[0], k.shape[1]
    mask = causal_mask(start, end, GROUP, q.dtype)
    qq = q.reshape(m, KV_HEADS, GROUP, HEAD_DIM).permute(1, 2, 0, 3).reshape(KV_HEADS, -1,
                                                                               HEAD_DIM)
    probs = torch.softmax(torch.baddbmm(mask, qq, k.transpose(1, 2), alpha=SCALE), dim=-1)
    o = torch.bmm(probs, v)
    return o.view(KV_HEADS, GROUP, m, HEAD_DIM).permute(2, 0, 1, 3).reshape(m, -1)


def sdpa_path(q, k, v, start):
    m, end = q.shape[0], k.shape[1]
    mask = causal_mask(start, end, 1, q.dtype) if start else None
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                       attn_mask=mask, is_causal=mask is None, scale=SCALE,
                                       enable_gqa=True)
    return o[0].transpose(0, 1).reshape(m, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m, end in SHAPES:
            q = torch.randn(m, HEADS, HEAD_DIM, generator=gen)
            k = torch.randn(KV_HEADS, end, HEAD_DIM, generator=gen)
            v = torch.randn(KV_HEADS, end, HEAD_DIM, generator=gen)
            ms, outs = {}, {}
            for name, fn in (("bmm", bmm_path), ("sdpa", sdpa_path)):
                outs[name] = fn(q, k, v, end - m)  # warm-up
                reps = max(2, min(20, int(2e7 // (m * end))))
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(q, k, v, end - m)
                ms[name] = (time.perf_counter() - t0) / reps * 1e3
            diff = (outs["bmm"] - outs["sdpa"]).abs().max().item()
            print(f"rows {m:5d} keys {end:5d}: bmm {ms['bmm']:9.2f} ms  sdpa {ms['sdpa']:9.2f} ms"
                  f"  max |diff| {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
