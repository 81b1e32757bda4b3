"""Structured outputs through the served APIs, with the official ``openai`` client and gRPC,
on a tiny random model whose tokenizer spells ASCII: ``response_format`` JSON schemas and
objects, vLLM's ``structured_outputs`` (regex, choice, grammar), named and required tool
calls, streamed and unary, ``n`` > 1, 400s naming the field, finish reasons."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from service_harness import LocalService

from specd.v1 import generation_pb2

MODEL = "tiny-random:vocab=128,seed=0,layers=2,ascii=1"
MESSAGES = [{"role": "user", "content": "Give me a record."}]
#: A finite schema: every output completes well within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["ok", "color", "n"],
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "record", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def service():
    svc = LocalService(http=True, model=MODEL).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key="x",
                       max_retries=0, timeout=60) as c:
        yield c


def chat(client, **kwargs):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 120, **kwargs}
    return client.chat.completions.create(**body)


def streamed(client, **kwargs) -> tuple[list[str], list[str | None], list]:
    """Per choice: the streamed text, the finish reason and the tool call deltas."""
    texts, finishes, calls = {}, {}, {}
    for chunk in chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            texts.setdefault(c.index, "")
            texts[c.index] += c.delta.content or ""
            calls.setdefault(c.index, []).extend(c.delta.tool_calls or [])
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    keys = sorted(texts)
    return [texts[k] for k in keys], [finishes.get(k) for k in keys], [calls[k] for k in keys]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 5}])
def test_json_schema_outputs_parse_and_validate_unary_and_streamed(client, sampling):
    out = chat(client, response_format=RESPONSE_FORMAT, n=3, **sampling)
    assert out.model_extra["speculation"]["forced_tokens"] > 0  # summed over the choices
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    texts, finishes, _ = streamed(client, response_format=RESPONSE_FORMAT, n=3, **sampling)
    assert texts == [c.message.content for c in out.choices]
    assert finishes == ["stop"] * 3
    # The default separators: one space after ',' and ':', no other whitespace.
    assert ", " in texts[0] and ": " in texts[0] and "  " not in texts[0]


def test_json_object_and_compact_whitespace(client):
    out = chat(client, response_format={"type": "json_object"}, max_tokens=40, seed=1)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    compact = chat(client, max_tokens=120, temperature=0, extra_body={
        "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    text = compact.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in text


def test_regex_choice_and_grammar_outputs_match(client):
    out = chat(client, n=4, seed=3, temperature=1.0,
               extra_body={"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]"}})
    assert all(re.fullmatch("[a-c]{2,4}-[0-9]", c.message.content) for c in out.choices)
    assert all(c.finish_reason == "stop" for c in out.choices)
    choices = ["yes", "no", "maybe later"]
    out = chat(client, n=4, seed=3, temperature=1.0,
               extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.message.content in choices for c in out.choices)
    out = chat(client, temperature=0,
               extra_body={"structured_outputs": {"grammar": 'start: "x" ("+" "y")*'}},
               max_tokens=9)
    assert re.fullmatch(r"x(\+y)*", out.choices[0].message.content)
    gbnf = 'root ::= "ab" | "cd"'
    out = chat(client, extra_body={"structured_outputs": {"grammar": gbnf}})
    assert out.choices[0].message.content in ("ab", "cd")


def test_greedy_constrained_text_is_the_same_with_speculation_on_and_off(client):
    on = chat(client, response_format=RESPONSE_FORMAT, temperature=0)
    off = chat(client, response_format=RESPONSE_FORMAT, temperature=0,
               extra_body={"speculation": {"enabled": False}})
    assert on.choices[0].message.content == off.choices[0].message.content
    spec_on, spec_off = on.model_extra["speculation"], off.model_extra["speculation"]
    assert spec_on["forced_tokens"] > 0 and spec_off["drafted_tokens"] == 0


def test_max_tokens_mid_document_is_length(client):
    out = chat(client, response_format=RESPONSE_FORMAT, max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason == "length"
    assert len(out.choices[0].message.content) == 5


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["city", "days"],
             "properties": {"city": {"enum": ["Paris", "Oslo"]},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]


def test_a_named_tool_call_comes_back_in_openai_shape_unary_and_streamed(client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, tools=TOOLS, tool_choice=choice, temperature=0)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        TOOLS[0]["function"]["parameters"])
    _, finishes, deltas = streamed(client, tools=TOOLS, tool_choice=choice, temperature=0)
    assert finishes == ["tool_calls"]
    assert deltas[0][0].function.name == "get_weather" and deltas[0][0].id
    assert "".join(d.function.arguments or "" for d in deltas[0]) == call.function.arguments


def test_tool_choice_required_picks_one_of_the_tools(client):
    for seed in range(3):
        out = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
        c = out.choices[0]
        assert c.finish_reason == "tool_calls"
        (call,) = c.message.tool_calls
        fn = {t["function"]["name"]: t["function"] for t in TOOLS}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    _, finishes, deltas = streamed(client, tools=TOOLS, tool_choice="required", seed=0)
    assert finishes == ["tool_calls"] and deltas[0][0].function.name in ("get_weather", "ping")


def test_tool_choice_auto_and_none_answer_text(client):
    prompt_tokens = {}
    for choice in ("auto", "none"):
        out = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=5, temperature=0)
        assert out.choices[0].message.tool_calls is None
        assert out.choices[0].finish_reason == "length"
        prompt_tokens[choice] = out.usage.prompt_tokens
    # The tools reach the chat template (the test tokenizer's lists their names), except
    # with "none".
    plain = chat(client, max_tokens=5, temperature=0).usage.prompt_tokens
    assert prompt_tokens["auto"] == plain + len("tools: get_weather, ping\n")
    assert prompt_tokens["none"] == plain


@pytest.mark.parametrize("kwargs,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format", "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "format": "zip-code"}}}},
     "response_format", "zip-code"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"extra_body": {"structured_outputs": {"regex": "(a"}}}, "structured_outputs", "regex"),
    ({"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
     "structured_outputs", "exactly one"),
    ({"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs",
     "structural_tag"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: nope"}}}, "structured_outputs",
     "nope"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    # A call's arguments are an object: a schema of another type (or none) is refused.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "required"}, "tools", "type \"object\""),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "anyOf": [{"type": "object"}, {"type": "string"}]}}}]}, "tools", "got type null"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "only one constraint"),
])
def test_bad_or_unsupported_constraints_get_400_naming_the_field(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    error = info.value.body
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(param) and words in error["message"], error


def test_a_constraint_no_token_can_meet_fails_that_request_alone(client):
    # A choice whose one string uses a character this tokenizer cannot spell: refused at
    # admission (a streamed request gets the 400 itself, not a stream that fails).
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, stream=stream,
                 extra_body={"structured_outputs": {"choice": ["\u00e9t\u00e9"]}})
        error = info.value.body
        assert error["param"] == "structured_outputs"
        assert error["message"].startswith("structured_outputs: this model's tokenizer cannot "
                                           "spell the start of any output"), error
    assert chat(client, max_tokens=3).choices[0].finish_reason == "length"


#: A JSON schema with no finite document: a required property that is the object again.
RECURSIVE = {"$defs": {"n": {"type": "object", "required": ["next"],
                             "properties": {"next": {"$ref": "#/$defs/n"}}}},
             "$ref": "#/$defs/n"}
#: Constraints llguidance compiles but generation cannot meet: (body, param, words).
UNGENERABLE = [
    ({"extra_body": {"structured_outputs": {"regex": "y{300000}"}}}, "structured_outputs",
     "beyond the matcher's limits"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": RECURSIVE}}},
     "response_format", "admits no finite output"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["next"], "properties": {"next": {"$ref": "#"}}}}}],
      "tool_choice": "required"}, "tools", "admits no finite output"),
    ({"extra_body": {"structured_outputs": {"grammar": 'start: "a" b\nb: "b" b'}}},
     "structured_outputs", "admits no finite output"),
]


@pytest.mark.parametrize("kwargs,param,words", UNGENERABLE)
def test_constraints_generation_cannot_meet_are_refused_at_admission(client, kwargs, param,
                                                                      words):
    # Before: each failed mid-generation, "token N does not fit the constraint", param null.
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, stream=stream, **kwargs)
        error = info.value.body
        assert error["param"] == param, error
        assert error["message"].startswith(param) and words in error["message"], error


@pytest.mark.parametrize("field,value", [
    ("regex", "y{300000}"), ("json_schema", json.dumps(RECURSIVE)),
    ("grammar", 'start: "a" b\nb: "b" b')])
def test_grpc_refuses_constraints_generation_cannot_meet_naming_constraint(service, field,
                                                                           value):
    import grpc

    req = generation_pb2.GenerateRequest(text="hi", max_new_tokens=40, seed=1)
    setattr(req.constraint, field, value)
    channel, stub = service.stub()
    with channel:
        for call in (stub.GenerateUnary, lambda r, timeout: list(stub.Generate(r,
                                                                          timeout=timeout))):
            with pytest.raises(grpc.RpcError) as info:
                call(req, timeout=60)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("constraint: "), info.value.details()


def test_grpc_constraint_field(service):
    req = generation_pb2.GenerateRequest(text="hi", max_new_tokens=40, seed=1)
    req.sampling.temperature = 1.0
    req.constraint.json_schema = json.dumps(SCHEMA)
    channel, stub = service.stub()
    with channel:
        out = stub.GenerateUnary(req, timeout=60)
        jsonschema.validate(json.loads(out.text), SCHEMA)
        assert out.finish_reason == "stop" and out.speculation.forced_tokens > 0
        req.constraint.Clear()
        req.constraint.choice.choices.extend(["alpha", "beta"])
        assert stub.GenerateUnary(req, timeout=60).text in ("alpha", "beta")
        req.constraint.Clear()
        req.constraint.json_schema = "{not json"
        with pytest.raises(Exception) as info:
            stub.GenerateUnary(req, timeout=60)
        assert "constraint" in info.value.details()


def test_forced_and_refused_drafts_reach_prometheus(service, client):
    chat(client, response_format=RESPONSE_FORMAT, temperature=0)
    import urllib.request

    text = urllib.request.urlopen(f"http://{service.http_address}/metrics", timeout=30).read()
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in text.decode().splitlines()
              if line.startswith("specd_replica_grammar_")}
    assert values["specd_replica_grammar_forced_drafts_total"] > 0
    assert "specd_replica_grammar_rejected_drafts_total" in values


def test_bench_json_schema_dataset_sends_constrained_requests_that_validate(service):
    # `specd bench serve --dataset-name json-schema`: each prompt's answer is constrained to
    # its schema through response_format, and checked.
    import asyncio

    from specd_tools.bench.serve import (
        ServeBenchConfig,
        compute_metrics,
        load_workload,
        openai_client,
        send_request,
    )

    cfg = ServeBenchConfig(base_url=f"http://{service.http_address}/v1",
                           dataset_name="json-schema", num_prompts=6, output_len=130,
                           temperature=1.0)
    prompts = load_workload(cfg)
    assert [p.category for p in prompts] == ["person", "order", "event"] * 2
    assert prompts == load_workload(cfg) and all(p.schema for p in prompts)

    async def run():
        client = openai_client(cfg.base_url, None, 60)
        return [await send_request(client, MODEL, p, cfg) for p in prompts]

    outcomes = asyncio.run(run())
    assert all(o.success for o in outcomes), [o.error for o in outcomes]
    finished = [o for o in outcomes if o.schema_valid is not None]
    assert finished and all(o.schema_valid for o in finished)
    metrics = compute_metrics(outcomes, 1.0)
    assert metrics["schema_valid"] == metrics["schema_checked"] == len(finished)


def test_completions_take_the_same_constraints(client):
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=20, n=2, seed=4,
                                    temperature=1.0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert all(re.fullmatch("[0-9]{3}", c.text) for c in out.choices)
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=120, temperature=0,
                                    extra_body={"response_format": RESPONSE_FORMAT})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)


def test_refused_constraints_count_against_their_client(service, client):
    import grpc

    from coordinator.front.refusals import RefusalBudget

    now = [0.0]
    saved = service.servicer.refusals
    service.servicer.refusals = RefusalBudget(burst=2, per_second=1.0, clock=lambda: now[0])
    try:
        def heavy(i):
            return {"extra_body": {"structured_outputs": {"regex": f"y{{{400000 + i}}}"}}}

        for i in range(2):  # two compiles refused: the bucket is empty
            with pytest.raises(openai.BadRequestError):
                chat(client, **heavy(i))
        with pytest.raises(openai.RateLimitError) as info:  # not compiled at all
            chat(client, **heavy(2))
        assert "too many refused constraints" in info.value.body["message"]
        req = generation_pb2.GenerateRequest(text="hi", max_new_tokens=4)
        req.constraint.regex = "y{400003}"
        channel, stub = service.stub()
        with channel:
            with pytest.raises(grpc.RpcError) as rpc:
                stub.GenerateUnary(req, timeout=60)
        assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Requests without a constraint are untouched; a refusal from the cache costs
        # nothing; and the bucket refills with time.
        assert chat(client, max_tokens=3).choices[0].finish_reason == "length"
        now[0] += 1.0
        with pytest.raises(openai.BadRequestError):
            chat(client, **heavy(0))  # refused from the cache: the refill is still there
        out = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert out.choices[0].message.content in ("yes", "no")
    finally:
        service.servicer.refusals = saved


def test_a_body_parsed_in_a_worker_thread_gets_the_answers_a_small_one_gets(client):
    from coordinator.front.http_api import BIG_BODY_BYTES

    # Over BIG_BODY_BYTES: parsed in a worker thread (a multi-megabyte schema must not
    # stall other streams), answered as a small body is.
    huge = {"enum": ["x" * 100 + str(i) for i in range(3000)]}
    assert len(json.dumps(huge)) > BIG_BODY_BYTES
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": huge}})
    assert info.value.body["param"] == "response_format"
    assert "the constraint is over" in info.value.body["message"]
    # A big valid body: a schema whose description fills it (not part of the prompt).
    big = {"type": "json_schema", "json_schema": {
        "name": "record", "schema": SCHEMA, "description": "d" * BIG_BODY_BYTES}}
    out = chat(client, response_format=big, temperature=0)
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
