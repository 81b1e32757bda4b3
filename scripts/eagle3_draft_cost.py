"""What an EAGLE-3 drafted token costs against the target's one-token forward, by draft
vocabulary size and head weight dtype, on this CPU.

    python scripts/eagle3_draft_cost.py                      # SmolLM2-shaped heads, 1 and 2 threads
    python scripts/eagle3_draft_cost.py --vocab 8192 --dtype bfloat16 --threads 1 --repeats 15

Heads are SmolLM2-shaped (`Eagle3Config.for_target` of the target's config: one layer, H 576,
the default layers (2, 15, 27)) with random weights (timing does not depend on the values:
``min_confidence`` 0 and greedy drafting, so every proposal drafts exactly k tokens), sharing
the target's float32 embedding. Per (threads, draft vocabulary, dtype) it times

- ``propose k``: a session's `Eagle3Session.propose` of k = 1..4 drafts after it ingested a
  300-token history (the target's real captured rows): ms per proposal and per drafted token;
- ``ingest n``: the same session ingesting n = 1..4 new rows without drafting (what each step
  costs besides drafting: a step that accepted n - 1 drafts sends n rows);

and, interleaved with them, the target's one-token forward over the same 300 cached positions
(its batch-invariant forward, what a served target runs; `scripts/verify_cost.py` times the
same). Rounds go over every measurement in turn, so a burst of load from another process hits
all of them alike; the first round is a warm-up; medians are printed. Wall-clock: say how busy
the machine was when quoting it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from drafter_worker.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head  # noqa: E402
from target_worker.loader import cpu_has_bf16_dot, load_decoder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the target (default SmolLM2-135M-Instruct)")
    p.add_argument("--vocab", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                   help="draft vocabulary sizes")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"], help="head weight dtypes")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--history", type=int, default=300, help="committed tokens before drafting")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4], help="drafts per proposal")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4],
                   help="new rows per ingestion")
    p.add_argument("--repeats", type=int, default=9, help="timed rounds")
    args = p.parse_args(argv)

    target = load_decoder(args.model, "float32")
    began = time.perf_counter()
    target.make_batch_invariant(tuple(args.threads))  # the served target's forward
    print(f"cpu_has_bf16_dot {cpu_has_bf16_dot()}; target plans ready in "
          f"{time.perf_counter() - began:.1f} s; history {args.history}, rounds "
          f"{args.repeats} (+1 warm-up)")
    vocab = target.config.vocab_size
    n = args.history + max(args.rows)
    tokens = [(7 * i + 1) % vocab for i in range(n + 1)]
    drafters = {}
    for size in args.vocab:
        for dtype in args.dtype:
            config = Eagle3Config.for_target(target.config, draft_vocab_size=size)
            head = Eagle3Head.random(config, seed=0)
            drafters[size, dtype] = Eagle3Drafter(head, target.embed_tokens.weight,
                                                  max_draft_len=max(args.k),
                                                  min_confidence=0.0, dtype=dtype)
    layers = next(iter(drafters.values())).hidden_layers
    target.set_capture_layers(layers)
    with torch.inference_mode():
        rows = target.forward_batch_with_hidden(tokens[:n], 0, target.new_cache())[1].clone()
    target.set_capture_layers(())
    history = tokens[: args.history]
    committed = rows[: args.history - 1]

    cache = target.new_cache(args.history + 1)
    with torch.inference_mode():
        target.forward_batch(tokens[: args.history], 0, cache)

    def target_step() -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            target.forward_batch_with_hidden([tokens[args.history]], args.history, cache)
            elapsed = time.perf_counter() - start
        cache.truncate(args.history)
        return elapsed

    sessions = {}
    for key, drafter in drafters.items():
        sessions[key] = drafter.session()
        sessions[key].propose(history, committed, 0)  # ingest the history (untimed)

    def propose(key, k: int) -> float:
        session = sessions[key]
        start = time.perf_counter()
        block = session.propose(history, None, k)
        elapsed = time.perf_counter() - start
        assert len(block) == k, (key, k, len(block))
        return elapsed

    def ingest(key, m: int) -> float:
        session = sessions[key]
        new = rows[args.history - 1: args.history - 1 + m]
        start = time.perf_counter()
        session.propose(tokens[: args.history + m], new, 0)
        elapsed = time.perf_counter() - start
        # Back to the committed history: rows that do not continue it make the session start
        # over on the whole history (untimed).
        session.propose(history, committed, 0)
        return elapsed

    times: dict[tuple, list[float]] = {}
    for r in range(args.repeats + 1):
        for threads in args.threads:
            torch.set_num_threads(threads)
            measured = [((threads, "target"), target_step())]
            for key in drafters:
                measured += [((threads, *key, "k", k), propose(key, k)) for k in args.k]
                measured += [((threads, *key, "rows", m), ingest(key, m)) for m in args.rows]
            if r:  # the first round is a warm-up
                for name, seconds in measured:
                    times.setdefault(name, []).append(seconds)

    def ms(name) -> float:
        return 1000 * statistics.median(times[name])

    for threads in args.threads:
        one = ms((threads, "target"))
        print(f"\n{threads} thread(s): target one-token forward {one:.1f} ms (median)")
        head = (f"{'vocab':>6} {'dtype':>9} | " + " ".join(f"{'k=' + str(k):>6}" for k in args.k)
                + " | " + f"{'ms/tok':>6} {'% fwd':>6} | "
                + " ".join(f"{'rows=' + str(m):>7}" for m in args.rows))
        print("propose k drafts (ms) | per drafted token at the largest k | ingest rows (ms)")
        print(head)
        for size, dtype in drafters:
            k_ms = [ms((threads, size, dtype, "k", k)) for k in args.k]
            per_token = k_ms[-1] / args.k[-1]
            row_ms = [ms((threads, size, dtype, "rows", m)) for m in args.rows]
            print(f"{size:>6} {dtype:>9} | " + " ".join(f"{v:>6.2f}" for v in k_ms)
                  + f" | {per_token:>6.2f} {100 * per_token / one:>5.1f}% | "
                  + " ".join(f"{v:>7.2f}" for v in row_ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
