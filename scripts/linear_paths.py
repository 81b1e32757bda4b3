"""Times ``target_worker.model.fast_linear``'s two orders against each other on this machine:
``F.linear(x, W)`` and ``(W @ x.T).T``, for SmolLM2-135M's projection shapes (fused gate+up
3072x576, down 576x1536, LM head 49152x576) at 1 and 2 torch threads, per row count.

Prints the median of 20 calls (after 3 warm-up calls) of each and which is faster; the
crossover sets `target_worker.model.FAST_LINEAR_MIN_ROWS`. Run it on a quiet machine:

    python scripts/linear_paths.py

With ``--kernels [DTYPE]`` it times the batch-invariant linear kernels instead
(`target_worker.invariant.LINEAR_KERNELS`, the order a planned target tries them in) over
all of SmolLM2's layer shapes (30 layers of QKV, output, gate+up and down, and the LM head):
ms for those matmuls by rows, and whether `target_worker.invariant.check_linear` proves
each kernel invariant here (at its least padding), at the current thread count.
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


LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def kernels_main(dtype_name: str) -> None:
    from target_worker import invariant

    dtype = getattr(torch, dtype_name)
    threads = torch.get_num_threads()
    weights = [[torch.randn(o, i).to(dtype) for o, i in LAYER_SHAPES] for _ in range(30)]
    head = torch.randn(49152, 576).to(dtype)
    rows = (1, 2, 4, 8, 16, 32, 64)
    print(f"{dtype_name}, {threads} threads: ms for 30 layers + head, by rows")
    print(f"{'kernel':<8}{'invariant':>12}" + "".join(f"{n:>8}" for n in rows))
    for kernel in invariant.LINEAR_KERNELS:
        try:
            prepared = [[kernel.prepare(w) for w in layer] for layer in weights]
            head_prepared = kernel.prepare(head)
        except RuntimeError as exc:
            print(f"{kernel.name:<8}  unavailable here: {exc}")
            continue
        proven = next((m for m in invariant._MIN_ROWS
                       if invariant.check_linear(kernel, head, None, m, (threads,))
                       == (True, True)), None)
        times = []
        for n in rows:
            x = {i: torch.randn(n, i).to(dtype) for i in (576, 1536)}

            def forward(x=x, kernel=kernel, prepared=prepared, head_prepared=head_prepared):
                for layer, packs in zip(weights, prepared, strict=True):
                    for w, p in zip(layer, packs, strict=True):
                        kernel.run(x[w.shape[1]], p, w, None)
                kernel.run(x[576], head_prepared, head, None)
            times.append(median_ms(forward, calls=7))
        label = "no" if proven is None else f"from {proven}"
        print(f"{kernel.name:<8}{label:>12}" + "".join(f"{t:>8.1f}" for t in times))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", nargs="?", const="float32", default=None,
                        metavar="DTYPE", help="time the batch-invariant linear kernels "
                        "(float32 or bfloat16)")
    args = parser.parse_args()
    if args.kernels is None:
        main()
    else:
        kernels_main(args.kernels)
