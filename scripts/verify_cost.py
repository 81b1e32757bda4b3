"""What verifying a block costs against a one-token step: the target's batch-invariant forward
(`Decoder.make_batch_invariant`, what every served target runs) timed at 1 to 17 new tokens
over a cached context, per dtype, with `coordinator.step.adaptive.calibrate` (rounds over all
sizes, median per size: the curve the adaptive draft length's cost model starts from).

    python scripts/verify_cost.py                       # SmolLM2, q8, float32, bfloat16
    python scripts/verify_cost.py --dtype float32 --context 1000 --threads 2

Prints, per dtype, ms per forward by tokens fed and the ratio to one token; "9" is a verify
block of 8 drafts plus the anchor. With ``--prefill N [N ...]`` it also times prompts of N
tokens prefilled in ``--chunk``-token chunks (the service's default token budget is 128).
Wall-clock: run it on a quiet machine. Copied into a checkout from before batch invariance
(a decoder without `make_batch_invariant`), it times that checkout's forward as it was, which
is how docs/benchmarks.md compares the two.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from coordinator.step.adaptive import calibrate  # noqa: E402
from target_worker import loader  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default SmolLM2)")
    p.add_argument("--dtype", nargs="+", default=["q8", "float32", "bfloat16"],
                   choices=["auto", "q8", "float32", "bfloat16", "float16"])
    p.add_argument("--context", type=int, default=300, help="cached positions before the step")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 9, 16, 17])
    p.add_argument("--repeats", type=int, default=15, help="timed rounds over all sizes")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--prefill", type=int, nargs="*", default=[], metavar="N",
                   help="also time prompts of N tokens, in --chunk-token chunks")
    p.add_argument("--chunk", type=int, default=128)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, context {args.context}, auto prefers bfloat16: "
          f"{getattr(loader, 'cpu_prefers_bf16', lambda: 'unknown')()}")
    for dtype in args.dtype:
        decoder = loader.load_decoder(args.model, dtype)
        began = time.perf_counter()
        if hasattr(decoder, "make_batch_invariant"):
            # The thread counts a served target checks (every core, then one fewer), so the
            # verdicts a server stored are reused.
            report = decoder.make_batch_invariant((args.threads, max(1, args.threads - 1)))
            if "native" in report:
                r = report["native"]
                print(f"\n{dtype}: native forward, {r['mode']} arithmetic, {r['isa']}, weights "
                      f"{', '.join(r['weights'])} (ready in {time.perf_counter() - began:.1f} s)")
            else:
                kernels = sorted({f"{p.kernel}/{p.min_rows}" for p in report["linear"].values()})
                print(f"\n{dtype}: torch forward ({report.get('native_off')}), linear kernels "
                      f"{', '.join(kernels)}, attention {report['scores'].kernel}/"
                      f"{report['scores'].min_rows} (plans ready in "
                      f"{time.perf_counter() - began:.1f} s)")
        else:  # a checkout from before batch invariance: its engine packed the weights
            from target_worker import model as model_mod

            packed = model_mod.pack_weights(decoder, extra=[decoder.head_weight()])
            print(f"\n{dtype}: no batch-invariant plans (this checkout's own forward, "
                  f"{packed} weights packed)")
        points = calibrate(decoder, cache_len=args.context, sizes=args.sizes,
                           repeats=args.repeats).points()
        one = points[min(points)]
        print(f"{'tokens':>8}{'ms':>10}{'x 1 token':>12}")
        for n, seconds in points.items():
            print(f"{n:>8}{seconds * 1000:>10.1f}{seconds / one:>11.2f}x")
        for n in args.prefill:
            cache = decoder.new_cache(n)
            vocab = decoder.config.vocab_size
            began = time.perf_counter()
            with torch.inference_mode():
                for start in range(0, n, args.chunk):
                    ids = [(7 * i + 1) % vocab for i in range(start, min(n, start + args.chunk))]
                    decoder.forward_batch(ids, start, cache)
            print(f"prefill of {n} tokens in {args.chunk}-token chunks: "
                  f"{time.perf_counter() - began:.2f} s")
        del decoder
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
