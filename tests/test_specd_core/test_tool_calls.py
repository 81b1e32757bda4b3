"""Tool-call formats (`specd_core.tool_calls`): the lazy grammar leaves text free until a
call starts and then allows only calls that parse and match their tool's parameters; the
incremental parser reads content and calls the same whether fed whole or piece by piece."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specd_core.grammar import GrammarCompiler, GrammarSpec, _allowed_ids
from specd_core.tool_calls import ToolCallParser, call_schema, format_from_template, tool_format
from target_worker.testing import TinyTokenizer

VOCAB = 128
TOOLS = {"get_weather": {"type": "object", "additionalProperties": False,
                         "required": ["city"], "properties": {"city": {"$ref": "#/$defs/c"}},
                         "$defs": {"c": {"enum": ["Paris", "Oslo"]}}},
         "ping": {"type": "object", "properties": {}, "additionalProperties": False}}
CALLS = {
    "hermes": 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
              '</tool_call><tool_call>{"name": "ping", "arguments": {}}</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                   '{"name": "ping", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
               '{"name": "ping", "arguments": {}}]',
}


def matcher(fmt: str, parallel: bool = True):
    tok = TinyTokenizer(VOCAB, ascii=True)
    spec = GrammarSpec("lark", tool_format(fmt).grammar(TOOLS, parallel), field="tools")
    return tok, GrammarCompiler(tok, VOCAB).compile(spec).matcher()


def walk(fmt: str, text: str, parallel: bool = True) -> list[int]:
    """Commits ``text`` character by character; the allowed-token count before each."""
    tok, m = matcher(fmt, parallel)
    counts = []
    for ch in text:
        counts.append(len(_allowed_ids(m.mask(), VOCAB)))
        m.commit(tok.encode(ch)[0])
    assert m.is_accepting()
    return counts


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_the_grammar_accepts_the_formats_calls_and_free_text(fmt):
    counts = walk(fmt, CALLS[fmt])
    assert min(counts) <= 2  # inside a call the grammar forces (the test vocabulary spells
    # each character twice at most)
    if fmt != "llama3_json":
        walk(fmt, "Just text, no call: <tool or [TOOL or {braces}.")
    else:
        walk(fmt, "Just text {with braces}.")


def test_hermes_text_is_free_until_the_trigger_then_only_valid_calls():
    tok, m = matcher("hermes")
    for ch in "I will check. <tool_call>":
        assert len(_allowed_ids(m.mask(), VOCAB)) == VOCAB  # free text (EOS included)
        m.commit(tok.encode(ch)[0])
    # Inside the call: a name that is not a tool, or broken JSON, is refused.
    for bad in ('{"name": "get_wea', '{"nam', '{name'):
        probe = m.fork()
        with pytest.raises(ValueError):
            for ch in bad + "X":
                probe.commit(tok.encode(ch)[0])
    for ch in '{"name": "get_weather", "arguments": {"city": "':
        m.commit(tok.encode(ch)[0])
    allowed = {tok.decode([i]) for i in _allowed_ids(m.mask(), VOCAB)}
    assert allowed == {"P", "O"}  # the enum, through the hoisted $defs


def test_one_call_only_when_not_parallel():
    tok, m = matcher("hermes", parallel=False)
    for ch in '<tool_call>{"name": "ping", "arguments": {}}</tool_call>':
        m.commit(tok.encode(ch)[0])
    assert m.stopped  # nothing may follow the one call but EOS


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
def test_the_parser_reads_the_same_calls_whole_and_piece_by_piece(fmt):
    text = CALLS[fmt]
    whole = ToolCallParser(tool_format(fmt)).result(text)
    content, calls = whole
    assert [name for name, _ in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0][1]) == {"city": "Oslo"} and json.loads(calls[1][1]) == {}
    assert content == ("Sure." if fmt == "hermes" else None)
    parser = ToolCallParser(tool_format(fmt))
    events = []
    for i in range(1, len(text) + 1):
        events += parser.feed(text[:i])
    events += parser.feed(text, final=True)
    args = ["", ""]
    names = []
    for e in events:
        if e[0] == "call":
            names.append(e[2])
        elif e[0] == "arguments":
            args[e[1]] += e[2]
    assert names == ["get_weather", "ping"] and args == [c[1] for c in calls]
    streamed = "".join(e[1] for e in events if e[0] == "content")
    assert streamed.strip() == (content or "")


def test_text_without_a_call_and_a_cut_call_are_content():
    fmt = tool_format("hermes")
    assert ToolCallParser(fmt).result("Hello <tool") == ("Hello <tool", None)
    cut = '<tool_call>{"name": "ping", "arguments": {"a'
    assert ToolCallParser(fmt).result(cut) == (cut, None)
    # A trigger's start is held back while it may still be one.
    parser = ToolCallParser(fmt)
    assert parser.feed("Hi <tool_") == [("content", "Hi ")]
    assert parser.feed("Hi <tool_x") == [("content", "<tool_x")]


def test_a_continued_prefix_is_not_repeated_and_its_open_call_is_reported_whole():
    fmt = tool_format("hermes")
    parser = ToolCallParser(fmt, prefix='Sure. <tool_call>{"name": "ping", "argu')
    events = parser.feed('ments": {}}</tool_call> done')
    assert events[0] == ("call", 0, "ping")
    assert "".join(e[2] for e in events if e[0] == "arguments") == "{}"
    assert [e for e in events if e[0] == "content"] == [("content", " done")]
    done = ToolCallParser(fmt, prefix='<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    assert done.result(" ok") == (" ok", None)  # its call was the message's, not new


def test_nested_schemas_keep_their_refs():
    schema = call_schema({"t": {"type": "object", "properties": {
        "node": {"$ref": "#/definitions/n"}}, "definitions": {"n": {
            "type": "object", "properties": {"kids": {"type": "array",
                                                      "items": {"$ref": "#/definitions/n"}}}}}}})
    jsonschema.validate({"name": "t", "arguments": {"node": {"kids": [{"kids": []}]}}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "t", "arguments": {"node": {"kids": [1]}}}, schema)


def test_the_format_comes_from_the_template():
    assert format_from_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert format_from_template("<tool_call>\n{{ tool_call | tojson }}") == "hermes"
    assert format_from_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert format_from_template(None) == "hermes"
    with pytest.raises(ValueError, match="pythonic"):
        tool_format("pythonic")
