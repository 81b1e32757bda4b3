"""How tools reach the prompt and calls come out of the text for a Hugging Face tokenizer
(`coordinator.front.tool_calls.ChatTools`): a template that ignores tools gets them in the
format's words in the system message, past calls and tool answers written into the turns;
a trigger that is a special token (Mistral's ``[TOOL_CALLS]``) is matched as that token by
the grammar and kept in the text the parser reads."""

from __future__ import annotations

import json

import pytest
from hf_checkpoints import train_tokenizer

from coordinator.front.tool_calls import ChatTools, tools_request
from specd_core.grammar import GrammarCompiler, _allowed_ids
from specd_core.text import encode_chat

TOOLS = [{"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


def test_a_template_without_tools_gets_them_in_the_formats_words(tokenizer):
    tools = ChatTools(tokenizer)  # its template names no format: hermes
    assert tools.format.name == "hermes" and not tools.renders_tools()
    history = [{"role": "user", "content": "ping it"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "ping", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "pong"}]
    messages, given = tools.messages(history, TOOLS)
    assert given is None
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\npong\n</tool_response>"}
    text = tokenizer.decode(encode_chat(tokenizer, messages))
    assert "<tool_response>" in text and "<tools>" in text


def test_a_special_token_trigger_is_matched_as_the_token_and_kept_in_the_text(tokenizer):
    tok = train_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tools = ChatTools(tok, "mistral")
    trigger = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert tools.special_trigger == trigger
    matcher = GrammarCompiler(tok, len(tok)).compile(tools.grammar(TOOLS)).matcher()
    assert trigger in _allowed_ids(matcher.mask(), len(tok)).tolist()
    ids = (tok.encode("hi ", add_special_tokens=False) + [trigger]
           + tok.encode('[{"name": "ping", "arguments": {}}]', add_special_tokens=False))
    for t in ids:
        matcher.commit(t)
    assert matcher.is_accepting()
    # Skipping special tokens would drop the trigger; the text the parser reads keeps it.
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)
    text = tools.text_tokenizer.decode(ids, skip_special_tokens=True)
    assert tools.parser().result(text) == ("hi", [("ping", "{}")])


def test_grpc_tool_fields_read_as_openai_ones():
    tools, choice, spec, calls = tools_request(json.dumps(TOOLS), "", None)
    assert choice == "auto" and spec is None and calls is None
    _, choice, spec, calls = tools_request(json.dumps(TOOLS), "ping", None)
    assert choice == {"type": "function", "function": {"name": "ping"}}
    assert spec is not None and calls.name == "ping"
    for bad, words in (("[", "not JSON"), (json.dumps([{"type": "x"}]), "[0]")):
        with pytest.raises(ValueError, match="tools") as info:
            tools_request(bad, "", None)
        assert words in str(info.value)


def test_mistral_templates_get_nine_character_call_ids():
    tok = train_tokenizer()
    # A template that renders tools and, as Mistral's does, refuses other call ids.
    tok.chat_template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{% if c.id | length != 9 %}{{ raise_exception('bad id') }}{% endif %}"
        "[TOOL_CALLS]{{ c.id }}{% endfor %}{% if m.tool_call_id is defined %}"
        "[TOOL_RESULTS]{{ m.tool_call_id }}{% endif %}{{ m.content }}{% endfor %}"
        "{% if tools %}[AVAILABLE_TOOLS]{% endif %}")
    tools = ChatTools(tok)
    assert tools.format.name == "mistral" and tools.renders_tools()
    history = [{"role": "user", "content": "ping"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_0123456789abcdef", "type": "function",
                    "function": {"name": "ping", "arguments": "{}"}}]},
               {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "pong"}]
    messages, _ = tools.messages(history, TOOLS)
    short = messages[1]["tool_calls"][0]["id"]
    assert len(short) == 9 and short.isalnum() and messages[2]["tool_call_id"] == short
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {}
    text = tok.decode(encode_chat(tok, messages, TOOLS))
    assert f"[TOOL_CALLS]{short}" in text and f"[TOOL_RESULTS]{short}" in text
