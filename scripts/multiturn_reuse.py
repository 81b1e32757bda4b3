"""Second-turn prefix reuse of concurrent multi-turn chat users, through the gRPC API:
``--users`` users each send a first question at once; then each sends its second turn at
once (its first question, the answer it got, and a new question). Prints the prompt tokens a
second turn could reuse (the longest prefix its prompt shares with what its first turn's KV
cache held: prompt and answer but the last token; less the last prompt position, which is
always computed) beside the tokens the server
reports reused (``usage.cached_tokens``), summed over the users, and each turn's wall time.

    specd serve --auth-token tok &
    SPECD_AUTH_TOKEN=tok python scripts/multiturn_reuse.py --server 127.0.0.1:50051

Each user sends its own ``cache_salt`` (a chat app's per-user partition), so the run also
shows that a user's own turns still share warm prefixes inside its partition.
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from coordinator.cluster.actor import load_tokenizer_for
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.text import encode_chat
from target_worker.engine import common_prefix_len

TOPICS = ["tides", "volcanoes", "bread", "bicycles", "glaciers", "compilers", "bees", "kites"]


def turn(stub, metadata, messages: list[dict], salt: str, max_tokens: int):
    req = generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(**m)
                                                   for m in messages]),
        max_new_tokens=max_tokens, cache_salt=salt, seed=0)
    return stub.GenerateUnary(req, metadata=metadata, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--model", default=None, help="the served model (its tokenizer)")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    token = os.environ.get("SPECD_AUTH_TOKEN")
    metadata = [("authorization", f"Bearer {token}")] if token else None
    tokenizer = load_tokenizer_for(args.model)
    users = [[{"role": "user", "content": f"In two sentences, what are {TOPICS[i % 8]}?"}]
             for i in range(args.users)]
    salts = [f"user-{i}-{os.urandom(8).hex()}" for i in range(args.users)]
    with grpc.insecure_channel(args.server) as channel, ThreadPoolExecutor(args.users) as pool:
        stub = generation_pb2_grpc.GenerationStub(channel)
        began = time.perf_counter()
        first = list(pool.map(lambda i: turn(stub, metadata, users[i], salts[i],
                                             args.max_tokens), range(args.users)))
        t1 = time.perf_counter() - began
        reusable = 0
        for i, out in enumerate(first):
            # What the first turn's KV cache holds: its prompt and every generated token but
            # the last (sampled from the last position, never fed).
            before = encode_chat(tokenizer, users[i]) + list(out.token_ids)[:-1]
            users[i] = users[i] + [{"role": "assistant", "content": out.text},
                                   {"role": "user", "content": "And why does that matter?"}]
            prompt = encode_chat(tokenizer, users[i])
            reusable += min(common_prefix_len(before, prompt), len(prompt) - 1)
        began = time.perf_counter()
        second = list(pool.map(lambda i: turn(stub, metadata, users[i], salts[i],
                                              args.max_tokens), range(args.users)))
        t2 = time.perf_counter() - began
    reused = sum(out.usage.cached_tokens for out in second)
    prompts = sum(out.usage.prompt_tokens for out in second)
    print(f"{args.users} users: second-turn prompt tokens {prompts}, reusable {reusable}, "
          f"reused {reused} ({100 * reused / max(1, reusable):.1f}% of reusable); "
          f"turn 1 {t1:.2f} s, turn 2 {t2:.2f} s")


if __name__ == "__main__":
    main()
