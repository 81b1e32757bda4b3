"""An EAGLE-3 head's greedy acceptance length, replayed offline over distilled answers
(`specd_tools.distill` shards: the target's own greedy answers and its captured layers), in the
head's float32 and bfloat16 weights (the drafter's default dtype where the CPU has native
bfloat16 dot products).

    python scripts/eagle3_acceptance.py HEAD_DIR DATA_DIR [--k 1 2 3 4] [--conversations 80]

Prints, per k, committed tokens per target forward (bonus included) and the share of steps
whose draft i was accepted (`specd_tools.train_eagle3.acceptance`).
"""

from __future__ import annotations

import argparse

import torch

from drafter_worker.eagle3 import load_eagle3
from specd_tools.train_eagle3 import Conversations, acceptance
from target_worker.loader import load_decoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("head")
    ap.add_argument("data_dir")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--conversations", type=int, default=0, help="0: all")
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    data = Conversations.load(args.data_dir, args.max_len, args.conversations)
    answer = sum(t.numel() - p for t, p in zip(data.tokens, data.prompt_lens, strict=True))
    print(f"{len(data.tokens)} conversations, {answer} answer tokens")
    decoder = load_decoder(None, "float32")  # the data's target: SmolLM2 by default
    head = load_eagle3(args.head, decoder.config)[0].float()
    for dtype in (torch.float32, torch.bfloat16):
        h = head.to(dtype)
        h.set_target_embedding(decoder.embed_tokens.weight.to(dtype))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16,
                                             enabled=dtype == torch.bfloat16):
            for k in args.k:
                r = acceptance(h, data, k)
                print(f"{str(dtype)[6:]:<9} k={k}: acceptance length "
                      f"{r['acceptance_length']:.3f}  per position {r['per_position']}")


if __name__ == "__main__":
    main()
