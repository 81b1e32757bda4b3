"""The shipped EAGLE head on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.registry import build_drafter
from specd_core.request import SpeculativeOptions
from specd_core.text import encode_prompt

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


@pytest.mark.parametrize("name", ["eagle", "eagle+lookup"])
def test_shipped_head_is_lossless_and_accepts_more_than_lookup_on_an_open_question(smollm2, name):
    decoder, tokenizer = smollm2
    prompt = encode_prompt(tokenizer, (PROMPTS / "open_question.txt").read_text(), raw=False)
    options = SpeculativeOptions(max_new_tokens=64, stop_token_ids=(tokenizer.eos_token_id,))
    plain = speculative_decode_with(decoder, prompt, decoder.new_cache(), None, options)
    drafter = build_drafter(name, target=decoder, stop_token_ids=[tokenizer.eos_token_id])
    out = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter, options)
    assert out.generated_tokens == plain.generated_tokens
    # Prompt lookup sits at ~1.03 here and a head that learnt nothing would too; the shipped
    # head measured 1.39 on these 64 tokens (a modest head: see drafter_worker/heads/README.md).
    assert out.acceptance_length() > 1.2
