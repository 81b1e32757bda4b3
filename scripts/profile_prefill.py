"""Where a long prefill's time goes: torch's profiler over one SmolLM2 forward of a
``--tokens`` prompt, through the long-segment SDPA path and through the bmm + softmax path
(the one every segment took before `target_worker.model.SDPA_MIN_ROWS`). Prints the wall time
and the operators with the most self CPU time for each.

Usage: ``python scripts/profile_prefill.py --tokens 2000,6000 [--threads 2] [--top 6]``
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

import target_worker.model as model
from target_worker.loader import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2000,6000", help="prompt lengths, comma separated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--top", type=int, default=6, help="operators to list (default: 6)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    decoder, _ = load_model()
    sdpa_min_rows = model.SDPA_MIN_ROWS
    for n in (int(t) for t in args.tokens.split(",")):
        ids = [(7 * i + 11) % 40000 + 100 for i in range(n)]
        for path, threshold in (("sdpa", sdpa_min_rows), ("bmm", n + 1)):
            model.SDPA_MIN_ROWS = threshold
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                decoder.forward_batch_with_hidden(ids, 0, decoder.new_cache(),
                                                  last_logits_only=True)
                seconds = time.perf_counter() - start
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total,
                            reverse=True)[:args.top]
            total = sum(e.self_cpu_time_total for e in prof.key_averages())
            print(f"{n} tokens, {path} path: {seconds:.2f} s")
            for e in events:
                print(f"    {e.key:38} {e.self_cpu_time_total / 1e6:7.2f} s "
                      f"{100 * e.self_cpu_time_total / total:5.1f}%")
    model.SDPA_MIN_ROWS = sdpa_min_rows


if __name__ == "__main__":
    main()
