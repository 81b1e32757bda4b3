"""Structured outputs on the real default model (SmolLM2-135M-Instruct): JSON-schema answers
are token-identical with the default drafter and without (greedy and seeded, one request at
a time and batched), and every finished answer validates against its schema.

Slow: loads SmolLM2.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from service_harness import run_scheduler

from specd_core.grammar import GrammarCompiler, GrammarSpec
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from specd_core.text import encode_prompt
from specd_tools.workloads.structured import json_schema_requests

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)],
                         ids=["greedy", "seeded"])
def test_json_schema_answers_are_identical_with_and_without_speculation(smollm2, sampling):
    decoder, tokenizer = smollm2
    compiler = GrammarCompiler(tokenizer, decoder.config.vocab_size)
    requests = json_schema_requests(3, seed=0)
    prompts = [encode_prompt(tokenizer, text, raw=False) for _, text, _ in requests]
    options = [SpeculativeOptions(max_new_tokens=64, sampling=sampling, seed=i,
                                  stop_token_ids=(tokenizer.eos_token_id,),
                                  grammar=compiler.compile(GrammarSpec("json_schema", schema)))
               for i, (_, _, schema) in enumerate(requests)]
    plain = run_scheduler(decoder, prompts, options, drafter=False, batched=False)
    for drafter, batched in ((True, False), (True, True)):
        reqs = run_scheduler(decoder, prompts, options, drafter, batched)
        assert [r.decode.generated for r in reqs] == [r.decode.generated for r in plain]
        assert sum(r.decode.result.forced_tokens for r in reqs) > 0
    for req, (_, _, schema) in zip(plain, requests, strict=True):
        if req.decode.result.finish_reason == "stop":
            text = tokenizer.decode(req.decode.generated, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), schema)
