"""``tool_choice: "auto"`` on the real default model (SmolLM2-135M-Instruct, whose template
does not render tools: they reach it as Hermes text in the system message). SmolLM2 does not
start calls by itself, so the assistant turn is continued from ``<tool_call>``
(``continue_final_message``): the lazy grammar finishes a valid call, token-identical with
the default drafter and without (greedy and seeded, alone and batched), and the grammar's
forced tokens are drafted.

Slow: loads SmolLM2.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from service_harness import run_scheduler

from coordinator.front.tool_calls import ChatTools
from specd_core.grammar import GrammarCompiler
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from specd_core.text import encode_chat

pytestmark = pytest.mark.slow

PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 20}}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast for a city",
    "parameters": PARAMS}}]
OPENED = "<tool_call>\n"
QUESTIONS = ["What is the weather in Paris? Use the get_weather tool.",
             "Is it raining in Oslo today?", "Weather for Tokyo, please."]


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8)],
                         ids=["greedy", "seeded"])
def test_a_continued_call_is_valid_and_identical_with_and_without_speculation(smollm2,
                                                                               sampling):
    decoder, tokenizer = smollm2
    tools = ChatTools(tokenizer)
    assert tools.format.name == "hermes" and not tools.renders_tools()
    compiler = GrammarCompiler(tokenizer, decoder.config.vocab_size)
    grammar = tools.continued(compiler.compile(tools.grammar(TOOLS)), OPENED,
                              compiler.ll_tokenizer())
    prompts = []
    for question in QUESTIONS:
        messages, given = tools.messages([{"role": "user", "content": question},
                                          {"role": "assistant", "content": OPENED}], TOOLS)
        prompts.append(encode_chat(tokenizer, messages, given, add_generation_prompt=False,
                                   continue_final_message=True))
    options = [SpeculativeOptions(max_new_tokens=48, sampling=sampling, seed=i,
                                  stop_token_ids=(tokenizer.eos_token_id,), grammar=grammar)
               for i in range(len(prompts))]
    plain = run_scheduler(decoder, prompts, options, drafter=False, batched=False)
    for drafter, batched in ((True, False), (True, True)):
        reqs = run_scheduler(decoder, prompts, options, drafter, batched)
        assert [r.decode.generated for r in reqs] == [r.decode.generated for r in plain]
        assert sum(r.decode.result.forced_tokens for r in reqs) > 0
    for req in plain:
        text = tokenizer.decode(req.decode.generated, skip_special_tokens=True)
        content, calls = tools.parser(OPENED).result(text)
        assert calls is not None, text  # the call the message opened, finished
        (name, arguments), *_ = calls
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), PARAMS)
