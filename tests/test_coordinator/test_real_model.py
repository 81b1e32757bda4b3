"""Speculative decoding on the real default model (SmolLM2-135M-Instruct): greedy output is
token-identical to plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import SpeculativeOptions, speculative_decode_with
from drafter_worker import PromptLookupSpeculator
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

    from coordinator.service import Service, ServiceConfig
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
