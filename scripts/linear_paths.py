"""Times ``target_worker.model.fast_linear``'s two orders against each other on this machine:
``F.linear(x, W)`` and ``(W @ x.T).T``, for SmolLM2-135M's projection shapes (fused gate+up
3072x576, down 576x1536, LM head 49152x576) at 1 and 2 torch threads, per row count.

Prints the median of 20 calls (after 3 warm-up calls) of each and which is faster; the
crossover sets `target_worker.model.FAST_LINEAR_MIN_ROWS`. Run it on a quiet machine:

    python scripts/linear_paths.py

With ``--forward [MODEL]`` it times whole target forwards instead (the default model, or a
GGUF file / HF directory): the median ms of a forward over 1-100 new rows after 300 cached
positions, with the weights unpacked and then packed (`target_worker.model.pack_weights`,
which sets `target_worker.model.PACKED_MAX_ROWS`), at 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = ((3072, 576), (576, 1536), (49152, 576))
ROWS = (1, 2, 4, 6, 8, 16, 32, 64)


def median_ms(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return sorted(times)[calls // 2] * 1e3


def main() -> None:
    print("threads  weight        rows  F.linear ms  W@x.T ms  faster")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for out_f, in_f in SHAPES:
            w = torch.randn(out_f, in_f)
            for n in ROWS:
                x = torch.randn(n, in_f)
                plain = median_ms(lambda x=x, w=w: F.linear(x, w))
                other = median_ms(lambda x=x, w=w: (w @ x.T).T)
                print(f"{threads:>7}  {out_f:>5}x{in_f:<5}  {n:>4}  {plain:>11.3f}  {other:>8.3f}  "
                      f"{'F.linear' if plain <= other else 'W@x.T'}")


def forward_main(model: str | None) -> None:
    from target_worker import model as model_mod
    from target_worker.loader import load_decoder

    decoder = load_decoder(model)
    rows = (1, 2, 4, 8, 16, 32, 64, 100)
    print("threads  weights   " + "".join(f"{n:>8}" for n in rows) + "  (ms per forward, by rows)")
    for packed in (False, True):
        if packed and not model_mod.pack_weights(decoder, extra=[decoder.head_weight()]):
            print("no MKL packed GEMM in this torch")
            return
        for threads in (1, 2):
            torch.set_num_threads(threads)
            times = []
            for n in rows:
                cache = decoder.new_cache(1024)
                with torch.inference_mode():
                    decoder.forward_batch(list(range(100, 400)), 0, cache)

                    def step(n=n, cache=cache):
                        cache.truncate(300)
                        decoder.forward_batch(list(range(500, 500 + n)), 300, cache)
                    times.append(median_ms(step, calls=9))
            print(f"{threads:>7}  {'packed' if packed else 'unpacked':<8}  "
                  + "".join(f"{t:>8.1f}" for t in times))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forward", nargs="?", const="", default=None, metavar="MODEL",
                        help="time whole forwards, unpacked then packed")
    args = parser.parse_args()
    if args.forward is None:
        main()
    else:
        forward_main(args.forward or None)
