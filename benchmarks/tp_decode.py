"""Greedy decode speed and output equality of tensor-parallel target replicas (Ray).

Each configuration is a replica (`target_worker.tp.create_target_replica`); rounds run the
configurations interleaved (so a noisy, shared machine hits them alike): allocate a slot,
prefill the prompt, then decode one token per ``verify`` call (plain decoding, no drafts) and
time those calls. Prints ms/token and tok/s per configuration (median over rounds), the
replica's per-step metrics, and whether every configuration produced the same tokens.

    python benchmarks/tp_decode.py --configs 1:2 3:1 3:1:replicated --tokens 32 --rounds 3

A configuration is ``TP:THREADS[:replicated]`` (threads per rank; ``replicated`` keeps the
embedding / LM head whole on every rank instead of vocab-parallel). Exit status 1 when
``--check-equal`` and the greedy tokens differ.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def parse_config(text: str) -> tuple[int, int, bool]:
    parts = text.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "replicated"):
        raise argparse.ArgumentTypeError(f"expected TP:THREADS[:replicated], got {text!r}")
    return int(parts[0]), int(parts[1]), len(parts) == 3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="load_model source (default: SmolLM2)")
    p.add_argument("--configs", nargs="+", type=parse_config,
                   default=[(1, 2, False), (3, 1, False)])
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", default="Write a short poem about the sea.")
    p.add_argument("--gpu", choices=["auto", "yes", "no"], default="auto")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--check-equal", action="store_true")
    args = p.parse_args(argv)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    from specd_core.sampling import SamplingParams
    from specd_core.step import PrefillItem, VerifyItem
    from target_worker.disk_cache import ensure_weights_cache
    from target_worker.loader import load_model, model_path
    from target_worker.testing import is_tiny_random_spec
    from target_worker.tp import create_target_replica, destroy_target_replica

    tokenizer = load_model(args.model)[1] if is_tiny_random_spec(args.model) else None
    if tokenizer is None:
        from target_worker.loader import load_tokenizer

        path = model_path(args.model)
        ensure_weights_cache(path)  # convert once here rather than in a rank
        tokenizer = load_tokenizer(path)
    prompt = tokenizer.encode(args.prompt)
    use_gpu = {"auto": None, "yes": True, "no": False}[args.gpu]
    greedy = SamplingParams()

    from coordinator.cluster.service import init_embedded_ray

    init_embedded_ray()  # loopback only, as the embedded service
    names = [f"tp={tp} threads={th}" + (" replicated-vocab" if rep else "")
             for tp, th, rep in args.configs]
    replicas = [create_target_replica(args.model, tp=tp, max_slots=2, num_threads=th,
                                      use_gpu=use_gpu, dtype=args.dtype,
                                      vocab_parallel=not rep)
                for tp, th, rep in args.configs]
    try:
        t0 = time.perf_counter()
        ray.get([r.ready.remote() for r in replicas])
        print(f"replicas ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        per_token: dict[str, list[float]] = {n: [] for n in names}
        outputs: dict[str, list[int]] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms up (caches, allocator)
            for name, replica in zip(names, replicas, strict=True):
                slot = ray.get(replica.allocate.remote())
                pre = ray.get(replica.prefill.remote([PrefillItem(slot, prompt, greedy)]))
                tokens = [pre[0].rows.argmax[0]]
                start = time.perf_counter()
                for _ in range(args.tokens - 1):
                    out = ray.get(replica.verify.remote(
                        [VerifyItem(slot, len(prompt) + len(tokens) - 1, [tokens[-1]], greedy)]))
                    tokens.append(out[0].rows.argmax[0])
                elapsed = time.perf_counter() - start
                ray.get(replica.free.remote(slot))
                if rnd:
                    per_token[name].append(1000 * elapsed / (args.tokens - 1))
                outputs.setdefault(name, tokens)
                if outputs[name] != tokens:
                    print(f"{name}: round {rnd} differs from round 0", file=sys.stderr)
        for name, replica in zip(names, replicas, strict=True):
            ms = statistics.median(per_token[name])
            last = ray.get(replica.status.remote())["last_step"]
            rounds = ", ".join(f"{x:.1f}" for x in per_token[name])
            print(f"{name}: {ms:.1f} ms/token ({1000 / ms:.1f} tok/s; rounds {rounds} ms); "
                  f"last step: call {1000 * last['seconds']:.1f} ms, forward "
                  f"{1000 * last['forward_seconds']:.1f} ms, collective "
                  f"{last['collective_bytes']} B, in {last['bytes_in']} B, "
                  f"out {last['bytes_out']} B")
        reference = outputs[names[0]]
        same = all(tokens == reference for tokens in outputs.values())
        for name in names[1:]:
            agree = next((i for i, (a, b) in enumerate(zip(reference, outputs[name], strict=True))
                          if a != b), len(reference))
            print(f"{name}: first {agree}/{len(reference)} greedy tokens equal {names[0]}")
        print("greedy tokens identical across configurations:", same)
        return 0 if same or not args.check_equal else 1
    finally:
        for replica in replicas:
            destroy_target_replica(replica)
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
