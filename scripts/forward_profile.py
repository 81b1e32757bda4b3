"""Where the native forward's time goes: its own per-phase timers (``forward.c``'s
``specd_profile``) over steps of 1, 9 and 16 tokens at a cached context, per dtype.

    python scripts/forward_profile.py                          # SmolLM2, q8 and float32
    python scripts/forward_profile.py --dtype q8 --tokens 1 9 --context 1000

Prints ms per forward by phase: the matmuls (qkv, o, gate_up, down, the LM head), attention,
and the rest (norms, RoPE, SiLU, the embedding and copies), and the share outside matmuls.
Wall-clock: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from target_worker import loader, native  # noqa: E402

PHASES = ("norm", "qkv", "rope", "attention", "o", "gate_up", "silu", "down", "head", "other")
MATMULS = {"qkv", "o", "gate_up", "down", "head"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--dtype", nargs="+", default=["q8", "float32"],
                   choices=["auto", "q8", "float32", "bfloat16"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 9, 16])
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lib = native.library()
    for dtype in args.dtype:
        decoder = loader.load_decoder(args.model, dtype)
        report = decoder.make_batch_invariant((args.threads,))
        if "native" not in report:
            print(f"{dtype}: the torch forward ({report['native_off']}): nothing to profile")
            continue
        vocab = decoder.config.vocab_size
        cache = decoder.new_cache()
        decoder.forward_batch([(7 * i + 1) % vocab for i in range(args.context)], 0, cache)
        print(f"\n{dtype}: {report['native']['isa']}, {args.threads} threads, "
              f"{args.context} cached positions; ms per forward")
        print(f"{'tokens':>8}" + "".join(f"{name:>10}" for name in PHASES)
              + f"{'total':>10}{'outside matmuls':>17}")
        for n in args.tokens:
            feed = [(5 * i + 3) % vocab for i in range(n)]
            for _ in range(3):
                cache.truncate(args.context)
                decoder.forward_batch(feed, args.context, cache)
            seconds = (ctypes.c_double * len(PHASES))()
            lib.specd_profile(1, None)
            began = time.perf_counter()
            for _ in range(args.repeats):
                cache.truncate(args.context)
                decoder.forward_batch(feed, args.context, cache)
            total = (time.perf_counter() - began) / args.repeats * 1000
            lib.specd_profile(0, seconds)
            ms = [s / args.repeats * 1000 for s in seconds]
            outside = sum(v for name, v in zip(PHASES, ms, strict=True) if name not in MATMULS)
            print(f"{n:>8}" + "".join(f"{v:>10.2f}" for v in ms) + f"{total:>10.2f}"
                  f"{outside / total:>16.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
