"""Agent frameworks against the served API (the ``agents`` extra; skipped without it): a
LangChain ``bind_tools`` agent loop (``tool_choice`` auto) and instructor's TOOLS and
PARALLEL_TOOLS modes complete two-tool tasks, on a tiny model scripted to write Hermes tool
calls (`tool_models.scripted_decoder`)."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.util import find_spec
from typing import Literal

import pytest
from service_harness import LocalService
from tool_models import scripted_decoder

MODEL = "tiny-random:vocab=128,seed=0,layers=2,ascii=1"
WEATHER = ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
           "</tool_call>")
PING = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'
#: Turn 1 asks for the weather, turn 2 (a tool answered) pings, turn 3 (the ping answered
#: "pong") answers; asked for "both", the two calls come in one turn.
SCRIPTS = [("pong", "Sunny in Paris."), ("both", WEATHER + PING), ("tool: ", PING),
           ("", WEATHER)]


@pytest.fixture(scope="module")
def base_url():
    if not (find_spec("langchain_openai") or find_spec("instructor")):
        pytest.skip("needs the agents extra: pip install -e '.[agents]'")
    svc = LocalService(http=True, model=MODEL)
    scripted_decoder(svc.decoder, svc.tokenizer, SCRIPTS)
    svc.start()
    yield f"http://{svc.http_address}/v1"
    svc.stop()


def test_a_langchain_bind_tools_agent_loop_completes_a_two_tool_task(base_url):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    called = []

    @tool
    def get_weather(city: Literal["Paris", "Oslo"], days: int) -> str:
        """The weather forecast for a city."""
        called.append(("get_weather", city, days))
        return "sunny"

    @tool
    def ping() -> str:
        """Checks that the weather service is up."""
        called.append(("ping",))
        return "pong"

    tools = {t.name: t for t in (get_weather, ping)}
    # No max_tokens: the rest of the tiny model's context of 256 (the scripted model stops).
    llm = ChatOpenAI(model=MODEL, base_url=base_url, api_key="x", temperature=0,
                     max_retries=0).bind_tools(list(tools.values()))
    messages = [HumanMessage("What is the weather in Paris for 3 days?")]
    for _ in range(4):  # the agent loop: call tools until the model answers
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = tools[call["name"]].invoke(call["args"])
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    assert called == [("get_weather", "Paris", 3), ("ping",)]
    assert messages[-1].content == "Sunny in Paris." and not messages[-1].tool_calls


def test_instructor_tools_and_parallel_tools_modes(base_url):
    instructor = pytest.importorskip("instructor")
    import openai
    from pydantic import BaseModel, Field

    class get_weather(BaseModel):  # noqa: N801 - the tool's name is the class's
        city: Literal["Paris", "Oslo"]
        days: int = Field(ge=1, le=7)

    class ping(BaseModel):  # noqa: N801
        pass

    raw = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    # TOOLS: a forced call to the one tool, its arguments constrained to the model.
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    weather = client.chat.completions.create(
        model=MODEL, response_model=get_weather, max_tokens=150, temperature=0,
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}])
    assert weather.model_dump() == {"city": "Paris", "days": 3}
    # PARALLEL_TOOLS: tool_choice auto, both calls in one turn.
    client = instructor.from_openai(raw, mode=instructor.Mode.PARALLEL_TOOLS)
    calls = client.chat.completions.create(
        model=MODEL, response_model=Iterable[get_weather | ping], max_tokens=150,
        temperature=0, messages=[{"role": "user", "content": "both: weather, then ping"}])
    assert [(type(c).__name__, c.model_dump()) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("ping", {})]
