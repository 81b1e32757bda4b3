"""``tool_choice: "auto"`` through the served HTTP API with the official ``openai`` client,
on a tiny model scripted to write Hermes tool calls (`tool_models.scripted_decoder`): calls
in OpenAI's shape (ids, ``finish_reason: "tool_calls"``, streamed argument deltas, several
in one turn or one with ``parallel_tool_calls: false``), the calls and the tool's answer
rendered back on the next turn, a turn without a call answered as plain content; every
started call parses and validates even when the drafter proposes broken JSON and the model
samples; greedy outputs the same with speculation on and off, seeded ones alone and
batched; vLLM's ``add_generation_prompt`` / ``continue_final_message``; the same over
gRPC."""

from __future__ import annotations

import json

import grpc
import jsonschema
import openai
import pytest
from service_harness import LocalService
from tool_models import BrokenJsonDrafter, scripted_decoder

from specd.v1 import generation_pb2

MODEL = "tiny-random:vocab=128,seed=0,layers=2,ascii=1"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
#: What the scripted model writes: the final answer once a tool answered ("tool: " is how
#: the test tokenizer's template writes a tool turn), two calls when asked for "both", else
#: one call.
SCRIPTS = [("tool: ", "It is sunny."),
           ("both", CALL + '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'),
           ("", CALL)]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def start(**kwargs) -> LocalService:
    svc = LocalService(http=True, model=MODEL, **kwargs)
    scripted_decoder(svc.decoder, svc.tokenizer, SCRIPTS, bias=kwargs.pop("bias", 30.0))
    return svc.start()


@pytest.fixture(scope="module")
def service():
    svc = start()
    yield svc
    svc.stop()


def client_for(svc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="x",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(service):
    with client_for(service) as c:
        yield c


def chat(client, messages=ASK, **kwargs):
    body = {"model": MODEL, "messages": messages, "max_tokens": 150, "temperature": 0,
            "tools": TOOLS, **kwargs}
    return client.chat.completions.create(**body)


def assert_valid(calls) -> None:
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_a_call_comes_back_in_openai_shape(client):
    out = chat(client)  # no tool_choice: "auto", OpenAI's default with tools
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    # The grammar drafted the call's forced tokens.
    assert out.model_extra["speculation"]["forced_tokens"] > 0


def test_streamed_calls_arrive_as_argument_deltas(client):
    unary = chat(client, messages=[{"role": "user", "content": "both please"}])
    calls, finish, content = {}, None, ""
    for chunk in chat(client, messages=[{"role": "user", "content": "both please"}],
                      stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or ():
                if d.id is not None:  # a call's first delta: id, type and name
                    assert d.index not in calls and d.type == "function"
                    calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                calls[d.index]["args"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    expected = unary.choices[0].message.tool_calls
    assert [(c["name"], c["args"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in expected]
    assert [t.function.name for t in expected] == ["get_weather", "ping"]
    assert len({c["id"] for c in calls.values()}) == 2
    assert_valid(expected)


def test_parallel_tool_calls_false_makes_one_call(client):
    out = chat(client, messages=[{"role": "user", "content": "both please"}],
               parallel_tool_calls=False)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls"
    assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]


def test_the_calls_and_the_tool_answer_go_back_and_a_turn_without_a_call_is_content(client):
    first = chat(client).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                      "content": "sunny, 21 C"}]
    out = chat(client, messages=history)
    c = out.choices[0]
    # The model saw the tool's answer (its script switches on it) and wrote plain text.
    assert c.message.content == "It is sunny." and c.message.tool_calls is None
    assert c.finish_reason == "stop"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       chat(client, messages=history, stream=True) if ch.choices)
    assert streamed == "It is sunny."


def test_tool_choice_none_writes_text(client):
    out = chat(client, tool_choice="none", max_tokens=20)
    c = out.choices[0]
    assert c.message.tool_calls is None and c.message.content.startswith("<tool_call>")


def test_greedy_output_is_the_same_with_speculation_on_and_off(client):
    for prompt in ("Weather?", "both please"):
        messages = [{"role": "user", "content": prompt}]
        on = chat(client, messages=messages)
        off = chat(client, messages=messages, extra_body={"speculation": {"enabled": False}})
        assert ([t.function.model_dump() for t in on.choices[0].message.tool_calls]
                == [t.function.model_dump() for t in off.choices[0].message.tool_calls])
        assert off.model_extra["speculation"]["drafted_tokens"] == 0


def test_continue_final_message_and_add_generation_prompt(client):
    base = chat(client, tools=None, max_tokens=1).usage.prompt_tokens
    bare = chat(client, tools=None, max_tokens=1,
                extra_body={"add_generation_prompt": False}).usage.prompt_tokens
    assert base - bare == len("assistant: ")
    opened = ASK + [{"role": "assistant", "content": "The weather"}]
    out = chat(client, messages=opened, tools=None, max_tokens=1, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    # The assistant turn is left open: its text, without the turn's end.
    assert out.usage.prompt_tokens == bare + len("assistant: The weather")
    for extra, words in (({"continue_final_message": True}, "add_generation_prompt"),
                         ({"add_generation_prompt": False, "continue_final_message": True},
                          "assistant")):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, tools=None, extra_body=extra)
        assert info.value.body["param"] == "continue_final_message"
        assert words in info.value.body["message"]


def test_a_continued_message_that_opened_a_call_finishes_a_valid_call(client):
    opened = '<tool_call>{"name": "get_wea'
    messages = ASK + [{"role": "assistant", "content": opened}]
    extra = {"add_generation_prompt": False, "continue_final_message": True}
    out = chat(client, messages=messages, extra_body=extra)
    c = out.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls  # the whole call: its name began in the message
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    deltas = [d for ch in chat(client, messages=messages, extra_body=extra, stream=True)
              for d in (ch.choices[0].delta.tool_calls or ()) if ch.choices]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # A message that does not fit the format cannot be continued under the grammar.
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=ASK + [{"role": "assistant", "content": "<tool_call>{nope"}],
             extra_body=extra)
    assert info.value.body["param"] == "continue_final_message"


@pytest.fixture(scope="module")
def sampled_service():
    """A weakly scripted model (it strays from the script when sampled) and a drafter sure
    of a call whose JSON is broken."""
    broken = '<tool_call>{"name": "get_wether", "arguments": {city: Paris, "days": "3"}</tool'
    svc = LocalService(http=True, model=MODEL, max_draft_len=8)
    svc.drafter_impl = BrokenJsonDrafter(svc.tokenizer, broken, k=8)
    scripted_decoder(svc.decoder, svc.tokenizer, SCRIPTS, bias=8.0)
    svc.start()
    yield svc
    svc.stop()


def test_every_started_call_parses_and_validates_under_sampling_and_broken_drafts(
        sampled_service):
    with client_for(sampled_service) as client:
        started = rejected = 0
        for seed in range(6):
            out = chat(client, temperature=1.0, seed=seed, n=4, max_tokens=180)
            rejected += out.model_extra["speculation"]["grammar_rejected_tokens"]
            for c in out.choices:
                text = c.message.content or ""
                if c.message.tool_calls:
                    started += len(c.message.tool_calls)
                    assert_valid(c.message.tool_calls)
                    assert c.finish_reason == "tool_calls"
                else:  # no call completed: none was started, or max_tokens cut it
                    assert "<tool_call>" not in text or c.finish_reason == "length"
        assert started >= 6 and rejected > 0


def test_seeded_outputs_are_the_same_alone_and_batched_and_without_speculation(
        sampled_service):
    with client_for(sampled_service) as client:
        batched = chat(client, temperature=1.0, seed=11, n=3, max_tokens=120)
        alone = [chat(client, temperature=1.0, seed=11 + i, max_tokens=120).choices[0]
                 for i in range(3)]

        def answer(c):
            return (c.message.content, [(t.function.name, t.function.arguments)
                                        for t in c.message.tool_calls or ()])

        assert [answer(c) for c in batched.choices] == [answer(c) for c in alone]
        assert len({str(answer(c)) for c in alone}) > 1  # the seeds matter
        # The drafter drafts point masses (the rule's coupled form): seeded output is the
        # same without it, token for token.
        plain = chat(client, temperature=1.0, seed=11, n=3, max_tokens=120,
                     extra_body={"speculation": {"enabled": False}})
        assert [answer(c) for c in plain.choices] == [answer(c) for c in batched.choices]
        assert batched.model_extra["speculation"]["grammar_rejected_tokens"] > 0
        assert any(c.message.tool_calls for c in batched.choices)


def grpc_request(messages, choice: str = "", **chat) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        chat=generation_pb2.ChatMessages(messages=messages, **chat), max_new_tokens=150,
        tools=generation_pb2.Tools(json=json.dumps(TOOLS), choice=choice))


def test_grpc_calls_results_and_history(service):
    channel, stub = service.stub()
    with channel:
        ask = [generation_pb2.ChatMessage(role="user", content="both please")]
        result = stub.GenerateUnary(grpc_request(ask))
        assert result.finish_reason == "tool_calls" and result.content == ""
        assert [c.name for c in result.tool_calls] == ["get_weather", "ping"]
        assert json.loads(result.tool_calls[0].arguments) == {"city": "Paris", "days": 3}
        assert all(c.id.startswith("call_") for c in result.tool_calls)
        assert result.text.startswith("<tool_call>")  # the text as the model wrote it
        chunks = list(stub.Generate(grpc_request(ask)))
        assert "".join(c.text for c in chunks) == result.text
        last = chunks[-1]
        assert last.finish_reason == "tool_calls"
        assert ([(c.name, c.arguments) for c in last.tool_calls]
                == [(c.name, c.arguments) for c in result.tool_calls])
        # The calls streamed as they were written, with the ids the last chunk gives.
        streamed: dict[int, list[str]] = {}
        for d in (d for c in chunks for d in c.tool_call_deltas):
            if d.id:
                streamed[d.index] = [d.id, d.name, ""]
            streamed[d.index][2] += d.arguments
        assert [tuple(v) for v in streamed.values()] == [
            (c.id, c.name, c.arguments) for c in last.tool_calls]
        # The calls and a tool's answer go back; the model answers in text.
        history = [*ask, generation_pb2.ChatMessage(role="assistant",
                                                    tool_calls=result.tool_calls),
                   generation_pb2.ChatMessage(role="tool", content="sunny",
                                              tool_call_id=result.tool_calls[0].id)]
        answer = stub.GenerateUnary(grpc_request(history))
        assert answer.text == "It is sunny." and answer.finish_reason == "stop"
        assert not answer.tool_calls and not answer.HasField("content")
        # A forced call by name: the output is its arguments.
        forced = stub.GenerateUnary(grpc_request(ask, choice="ping"))
        assert forced.finish_reason == "tool_calls" and forced.text == "{}"
        assert [(c.name, c.arguments) for c in forced.tool_calls] == [("ping", "{}")]
        with pytest.raises(grpc.RpcError) as info:
            stub.GenerateUnary(grpc_request(ask, choice="nope"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("tools") and "nope" in info.value.details()
