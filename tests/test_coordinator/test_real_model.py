"""Speculative decoding on the real default model (SmolLM2-135M-Instruct): greedy output is
token-identical to plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.request import SpeculativeOptions
from specd_core.text import encode_prompt

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def plain_greedy(decoder, prompt, max_new, eos):
    cache = decoder.new_cache()
    logits = decoder.forward_batch(prompt, 0, cache)[-1]
    out = []
    for _ in range(max_new):
        token = int(logits.argmax())
        out.append(token)
        if token == eos:
            break
        logits = decoder.forward_token(token, cache.seq_len, cache)
    return out


@pytest.mark.parametrize("name", ["code_edit", "open_question"])
def test_greedy_speculative_decode_equals_plain_greedy(smollm2, name):
    decoder, tokenizer = smollm2
    prompt = encode_prompt(tokenizer, (PROMPTS / f"{name}.txt").read_text(), raw=False)
    max_new = 48
    result = speculative_decode_with(
        decoder, prompt, decoder.new_cache(), PromptLookupSpeculator(3, 10),
        SpeculativeOptions(max_new_tokens=max_new, stop_token_ids=(tokenizer.eos_token_id,)),
    )
    assert result.generated_tokens == plain_greedy(decoder, prompt, max_new,
                                                   tokenizer.eos_token_id)
    if name == "code_edit":
        # The answer copies its prompt: speculation must have saved forward calls.
        assert result.forward_calls < result.tokens_generated / 2


@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "serial"])
def test_greedy_through_the_service_equals_the_in_process_core(smollm2, pipeline):
    import grpc

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service
    from specd.v1 import generation_pb2, generation_pb2_grpc

    decoder, tokenizer = smollm2
    text = (PROMPTS / "code_edit.txt").read_text()
    prompt = encode_prompt(tokenizer, text, raw=False)
    expected = speculative_decode_with(
        decoder, prompt, decoder.new_cache(), PromptLookupSpeculator(3, 10),
        SpeculativeOptions(max_new_tokens=32, stop_token_ids=(tokenizer.eos_token_id,)),
    ).generated_tokens
    request = generation_pb2.GenerateRequest(max_new_tokens=32)
    request.chat.messages.add(role="user", content=text)
    with Service(ServiceConfig(port=0, pipeline=pipeline)) as service, \
            grpc.insecure_channel(service.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        tokens = [t for chunk in stub.Generate(request, timeout=300) for t in chunk.token_ids]
    assert tokens == expected


@pytest.mark.parametrize("drafter", ["eagle", "eagle+lookup"])
def test_pipelined_eagle_greedy_equals_plain_greedy(smollm2, drafter):
    from drafter_worker.registry import build_drafter

    decoder, tokenizer = smollm2
    prompt = encode_prompt(tokenizer, (PROMPTS / "open_question.txt").read_text(), raw=False)
    max_new = 40
    options = SpeculativeOptions(max_new_tokens=max_new, stop_token_ids=(tokenizer.eos_token_id,))
    result = speculative_decode_with(decoder, prompt, decoder.new_cache(),
                                     build_drafter(drafter, target=decoder), options,
                                     pipeline=True)
    assert result.generated_tokens == plain_greedy(decoder, prompt, max_new,
                                                   tokenizer.eos_token_id)
    assert result.drafted_tokens > 0


def test_chunked_prefill_gives_the_unchunked_greedy_tokens_and_transformers_agrees(
        smollm2_float32):
    """A ~900-token chat prompt (more than one 256-position key block) computed whole
    and in chunks of 5 (a boundary inside the chat template's first tokens), 64 and 300,
    beside a short request: the same greedy tokens, and each is transformers' argmax after
    the same prefix (its forward over prompt + output; a top-2 gap under 1e-3 excepted:
    transformers' own incremental generate flips such near-ties against its own forward).
    float32, as transformers' reference and the 1e-3 gap are."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM

    from coordinator.step.plan import ChunkPolicy
    from coordinator.step.scheduler import Scheduler
    from coordinator.step.targets import LocalTarget
    from target_worker.engine import TargetEngine
    from target_worker.fetch import default_model_path

    decoder, tokenizer = smollm2_float32
    doc = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:3500]
    long = encode_prompt(tokenizer, doc + "\n\nSummarize the text above.", raw=False)
    short = encode_prompt(tokenizer, (PROMPTS / "open_question.txt").read_text(), raw=False)
    assert len(long) > 800
    opts = SpeculativeOptions(max_new_tokens=24)

    async def run(budget):
        sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=2)), None, max_active=2,
                          adaptive=False, chunking=ChunkPolicy(budget))
        reqs = [sched.submit(p, opts) for p in (long, short)]
        await sched.run_until_idle()
        return [r.decode.result.generated_tokens for r in reqs]

    whole = asyncio.run(run(None))
    for budget in (5, 64, 300):
        assert asyncio.run(run(budget)) == whole, budget
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32)
    for prompt, out in zip((long, short), whole, strict=True):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
        top = logits.topk(2)
        clear = (top.values[:, 0] - top.values[:, 1]) > 1e-3
        agree = top.indices[:, 0] == torch.tensor(out)
        assert bool((agree | ~clear).all()), (agree.tolist(), clear.tolist())
        assert int(clear.sum()) >= len(out) - 2  # the exception stays an exception
