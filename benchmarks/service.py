"""Service throughput on the default model: one stream through Ray + gRPC vs the in-process
core, then N concurrent streams (aggregate tok/s). Greedy, prompt lookup.

    python benchmarks/service.py [--max-new-tokens 128] [--streams 8]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from coordinator import SpeculativeOptions, speculative_decode_with
from coordinator.service import Service, ServiceConfig
from coordinator.text import encode_prompt
from drafter_worker import PromptLookupSpeculator
from specd.v1 import generation_pb2, generation_pb2_grpc
from target_worker import load_model

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    texts = {name: (PROMPTS / f"{name}.txt").read_text() for name in ("code_edit",
                                                                       "open_question")}

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

    with Service(ServiceConfig(port=0)) as service:
        for name, text in texts.items():
            one_stream(service.address, chat_request(text, 8))  # warm up
            tokens, seconds = one_stream(service.address,
                                         chat_request(text, args.max_new_tokens))
            print(f"service x1  {name:14s} {len(tokens) / seconds:6.1f} tok/s "
                  f"({len(tokens)} tokens)")
        reqs = [chat_request(texts[name], args.max_new_tokens)
                for name in ("code_edit", "open_question") * (args.streams // 2)]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(reqs)) as pool:
            results = list(pool.map(lambda r: one_stream(service.address, r), reqs))
        seconds = time.perf_counter() - start
        total = sum(len(t) for t, _ in results)
        print(f"service x{len(reqs)}  mixed          {total / seconds:6.1f} tok/s aggregate "
              f"({total} tokens in {seconds:.1f} s)")


if __name__ == "__main__":
    main()
