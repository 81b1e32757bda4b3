"""Lossless bitwise, on the real default model (SmolLM2-135M-Instruct) in float32 and
bfloat16: a row's logits and KV entries are the same in any step, and greedy and seeded
outputs, with their log probabilities, are the same with the default drafter and without,
one request at a time and batched (`Decoder.make_batch_invariant`, which every target runs).

Slow: ~2 minutes on 2 cores.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from service_harness import run_scheduler

from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from specd_core.text import encode_prompt
from specd_tools.bench.serve_data import MT_BENCH_FILE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def targets(smollm2):
    """``{dtype: decoder}``: the module's float32 SmolLM2 and a bfloat16 copy."""
    decoder, tokenizer = smollm2
    return {"float32": decoder, "bfloat16": copy.deepcopy(decoder).to(torch.bfloat16)}, tokenizer


def _questions(n: int) -> list[str]:
    """The first turn of ``n`` MT-Bench questions, from different categories first."""
    rows = [json.loads(line) for line in MT_BENCH_FILE.read_text().splitlines() if line]
    by_category: dict[str, list[str]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row["turns"][0])
    picked, i = [], 0
    while len(picked) < n:
        for questions in by_category.values():
            if i < len(questions) and len(picked) < n:
                picked.append(questions[i])
        i += 1
    return picked


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_and_kv_rows_are_the_same_bits_in_any_step(targets, dtype):
    decoders, tokenizer = targets
    decoder = decoders[dtype]
    decoder.make_batch_invariant()
    rng = random.Random(dtype)
    tokens = encode_prompt(tokenizer, _questions(1)[0], raw=False)[:40]
    tokens += [rng.randrange(decoder.config.vocab_size) for _ in range(24)]
    alone = decoder.new_cache()
    ref = torch.cat([decoder.forward_batch([t], i, alone) for i, t in enumerate(tokens)])
    cache, other, got, pos = decoder.new_cache(), decoder.new_cache(), [], 0
    for n in (9, 1, 17, 3, 30, 4):  # prompt chunks, verify blocks, single tokens
        segments = [(tokens[pos:pos + n], pos, cache), ([7] * 5, other.seq_len, other)]
        got.append(decoder.forward_packed(segments)[0][0].clone())
        pos += n
    assert pos == len(tokens)
    assert torch.equal(torch.cat(got), ref)
    assert torch.equal(cache.keys(), alone.keys()) and torch.equal(cache.values(),
                                                                    alone.values())


def _run(decoder, prompts, options, drafter: bool, batched: bool):
    """Each request's ``(tokens, [(logprob, top), ...])`` through the scheduler that serves."""
    reqs = run_scheduler(decoder, prompts, options, drafter, batched)
    return [(req.decode.generated, [(r.logprob, r.top) for r in req.decode.token_logprobs])
            for req in reqs], sum(r.decode.result.accepted_tokens for r in reqs)


@pytest.mark.parametrize("dtype,sampling,count", [
    ("float32", SamplingParams(), 6),
    ("float32", SamplingParams(temperature=0.8, top_p=0.95), 6),
    ("bfloat16", SamplingParams(), 4),
], ids=["float32-greedy", "float32-seeded", "bfloat16-greedy"])
def test_outputs_and_logprobs_are_the_same_bits_with_and_without_speculation(targets, dtype,
                                                                             sampling, count):
    decoders, tokenizer = targets
    decoder = decoders[dtype]
    prompts = [encode_prompt(tokenizer, q, raw=False) for q in _questions(count)]
    options = [SpeculativeOptions(max_new_tokens=32, sampling=sampling, seed=11 + i,
                                  stop_token_ids=(tokenizer.eos_token_id,), logprobs=2)
               for i in range(count)]
    plain, _ = _run(decoder, prompts, options, drafter=False, batched=False)
    for batched in (True, False):
        drafted, accepted = _run(decoder, prompts, options, drafter=True, batched=batched)
        assert drafted == plain, f"batched={batched}"  # tokens and logprobs, exactly
    assert accepted > 0  # drafts were accepted: speculation really ran
    assert all(tokens for tokens, _ in plain)
