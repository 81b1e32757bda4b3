"""Service throughput on the default model: one stream through Ray + gRPC vs the in-process
core, then N concurrent streams (aggregate tok/s) and the per-replica / per-drafter metrics.
Greedy, prompt lookup. Several replica counts run one after another (interleaved with
``--rounds``), each its own service.

    python benchmarks/service.py [--max-new-tokens 128] [--streams 8]
        [--target-replicas 1,2] [--drafters 1] [--tp 1] [--rounds 1] [--concurrent-only]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from coordinator.cluster.config import ServiceConfig
from coordinator.cluster.service import Service
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.request import SpeculativeOptions
from specd_core.text import encode_prompt
from target_worker.loader import load_model

PROMPTS = Path(__file__).resolve().parent / "prompts"


def chat_request(text: str, max_new: int) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new)
    req.chat.messages.add(role="user", content=text)
    return req


def one_stream(address: str, req) -> tuple[list[int], float]:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        start = time.perf_counter()
        tokens = [t for chunk in stub.Generate(req, timeout=600) for t in chunk.token_ids]
        return tokens, time.perf_counter() - start


def concurrent(address: str, texts: dict[str, str], streams: int, max_new: int
               ) -> tuple[int, float, list[list[int]]]:
    """``streams`` concurrent greedy streams (alternating prompts): (tokens, seconds, outputs)."""
    names = ("code_edit", "open_question")
    reqs = [chat_request(texts[names[i % 2]], max_new) for i in range(streams)]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(lambda r: one_stream(address, r), reqs))
    seconds = time.perf_counter() - start
    return sum(len(t) for t, _ in results), seconds, [t for t, _ in results]


def replica_lines(status: dict) -> list[str]:
    return [f"    {r['name']}: placed={r['requests_placed']} steps={r['steps']} "
            f"step={r['step_seconds'] * 1e3:.1f} ms "
            f"forward={r['forward_seconds_per_call'] * 1e3:.1f} ms/call "
            f"sent={r['bytes_sent_per_step']:.0f} B/step "
            f"received={r['bytes_received_per_step']:.0f} B/step"
            for r in status["replicas"]] + [
           f"    {d['name']}: calls={d['calls']} errors={d['errors']} "
           f"latency={d['mean_latency_s'] * 1e3:.2f} ms" for d in status["drafters"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--target-replicas", default="1", metavar="M[,M...]",
                        help="replica counts to compare, each its own service (e.g. 1,2)")
    parser.add_argument("--drafters", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--target-threads", type=int, default=None,
                        help="per rank (default: cores / (replicas x tp))")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the list of configurations (interleaved) this often")
    parser.add_argument("--concurrent-only", action="store_true",
                        help="skip the in-process and single-stream runs")
    args = parser.parse_args()
    texts = {name: (PROMPTS / f"{name}.txt").read_text() for name in ("code_edit",
                                                                       "open_question")}
    replica_counts = [int(m) for m in args.target_replicas.split(",")]

    if not args.concurrent_only:
        decoder, tokenizer = load_model()
        for name, text in texts.items():
            prompt = encode_prompt(tokenizer, text, raw=False)
            start = time.perf_counter()
            result = speculative_decode_with(
                decoder, prompt, decoder.new_cache(), PromptLookupSpeculator(3, 10),
                SpeculativeOptions(max_new_tokens=args.max_new_tokens,
                                   stop_token_ids=(tokenizer.eos_token_id,)))
            seconds = time.perf_counter() - start
            print(f"in-process  {name:14s} {result.tokens_generated / seconds:6.1f} tok/s "
                  f"({result.tokens_generated} tokens, {result.forward_calls} forward calls)")
        del decoder

    outputs: dict[int, list[list[int]]] = {}
    for _ in range(args.rounds):
        for replicas in replica_counts:
            cfg = ServiceConfig(port=0, tp=args.tp, target_replicas=replicas,
                                drafters=args.drafters, target_threads=args.target_threads)
            with Service(cfg) as service:
                label = f"tp={args.tp} replicas={replicas} drafters={args.drafters}"
                for name, text in texts.items():
                    one_stream(service.address, chat_request(text, 8))  # warm up
                    if args.concurrent_only:
                        continue
                    tokens, seconds = one_stream(service.address,
                                                 chat_request(text, args.max_new_tokens))
                    print(f"service x1  {name:14s} {len(tokens) / seconds:6.1f} tok/s "
                          f"({len(tokens)} tokens) [{label}]")
                total, seconds, outs = concurrent(service.address, texts, args.streams,
                                                  args.max_new_tokens)
                print(f"service x{args.streams}  mixed          {total / seconds:6.1f} tok/s "
                      f"aggregate ({total} tokens in {seconds:.1f} s) [{label}]", flush=True)
                for line in replica_lines(service.status()):
                    print(line)
                same = outputs.setdefault(0, outs) == outs
                print(f"    greedy outputs identical to the first configuration: {same}")


if __name__ == "__main__":
    main()
