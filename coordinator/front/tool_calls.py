"""``tool_choice: "auto"`` for one served model (`ChatTools`): which format its calls take
(`specd_core.tool_calls.ToolFormat`, from ``--tool-call-parser`` or its chat template), how
tools, past calls and tool answers reach the prompt (the chat template's own ``tools`` /
``tool_calls`` rendering where it has one, else the format's text in a system message and
in the turns), the lazy grammar a request is constrained by, and the OpenAI ``tool_calls``
of an answer (`openai_calls`, `stream_delta`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from specd_core.grammar import GrammarError, GrammarSpec
from specd_core.text import encode_chat
from specd_core.tool_calls import (
    ToolCallParser,
    ToolFormat,
    format_from_template,
    tool_format,
)

__all__ = ["ChatTools", "call_id", "openai_calls", "stream_delta", "tool_parameters"]

_PROBE_TOOL = {"type": "function", "function": {
    "name": "specd_probe_tool", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def call_id() -> str:
    """A fresh OpenAI tool call id."""
    return "call_" + uuid.uuid4().hex[:24]


def tool_parameters(tools: Sequence[dict]) -> dict[str, dict]:
    """name -> parameters schema of OpenAI function definitions already checked
    (`coordinator.front.openai_structured.constraint_of`)."""
    return {t["function"]["name"]: (t["function"].get("parameters") or {"type": "object"})
            for t in tools}


def openai_calls(calls: Sequence[tuple[str, str]]) -> list[dict]:
    """OpenAI ``tool_calls`` for ``(name, arguments JSON text)`` pairs, fresh ids."""
    return [{"id": call_id(), "type": "function",
             "function": {"name": name, "arguments": args}} for name, args in calls]


def stream_delta(events: Sequence[tuple], ids: list[str]) -> dict:
    """One chat ``delta`` for `specd_core.tool_calls.ToolCallParser` events: ``content``
    text and ``tool_calls`` entries (a call's first carries its ``id``, ``type`` and
    ``name``; the next ones ``arguments`` pieces). ``ids``: the calls' ids so far (grown
    here)."""
    content, calls = "", []
    for event in events:
        if event[0] == "content":
            content += event[1]
        elif event[0] == "call":
            ids.append(call_id())
            calls.append({"index": event[1], "id": ids[event[1]], "type": "function",
                          "function": {"name": event[2], "arguments": ""}})
        elif calls and calls[-1]["index"] == event[1]:
            calls[-1]["function"]["arguments"] += event[2]
        else:
            calls.append({"index": event[1], "function": {"arguments": event[2]}})
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta


class _KeepToken:
    """A tokenizer whose ``decode`` keeps one special token's text (a tool-call trigger
    such as Mistral's ``[TOOL_CALLS]``, which skipping special tokens would drop) and skips
    the others as asked; everything else is the wrapped tokenizer's."""

    def __init__(self, tokenizer, token_id: int, text: str):
        self._tok, self._id, self._text = tokenizer, token_id, text

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        ids = [int(i) for i in ids]
        if not skip_special_tokens or self._id not in ids:
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        parts, start = [], 0
        for at, t in enumerate(ids):
            if t == self._id:
                parts.append(self._tok.decode(ids[start:at], skip_special_tokens=True, **kwargs))
                start = at + 1
        parts.append(self._tok.decode(ids[start:], skip_special_tokens=True, **kwargs))
        return self._text.join(parts)


class _Continued:
    """A compiled grammar (`specd_core.grammar.Grammar`) whose matchers start after
    ``tokens``; the rest is the grammar's."""

    def __init__(self, grammar, tokens: Sequence[int]):
        self._grammar, self._tokens = grammar, list(tokens)

    def __getattr__(self, name):
        return getattr(self._grammar, name)

    def matcher(self):
        m = self._grammar.matcher()
        for token in self._tokens:
            m.commit(token)
        return m


class ChatTools:
    """Tool calling for one tokenizer (the served model's).

    Args:
        tokenizer: the model's tokenizer (its ``chat_template`` names the format when
            ``parser`` is None).
        parser: a `specd_core.tool_calls.TOOL_CALL_PARSERS` name, or None.

    Raises:
        ValueError: an unknown ``parser``.
    """

    def __init__(self, tokenizer, parser: str | None = None):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        self.format: ToolFormat = tool_format(
            parser or format_from_template(template if isinstance(template, str) else None))
        self._renders_tools: bool | None = None
        #: The trigger's id when it is one special token (matched as that token).
        self.special_trigger = self._special_id(self.format.trigger)
        #: What the output text is decoded with (keeps a special trigger's text).
        self.text_tokenizer = (tokenizer if self.special_trigger is None else
                               _KeepToken(tokenizer, self.special_trigger, self.format.trigger))

    def _special_id(self, text: str) -> int | None:
        if self.format.at_start:
            return None
        special = set(getattr(self.tokenizer, "all_special_ids", None) or ())
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - a tokenizer that cannot: treat it as text
            return None
        return int(ids[0]) if len(ids) == 1 and ids[0] in special else None

    def renders_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (probed once: a prompt with a tool
        differs from one without)."""
        if self._renders_tools is None:
            messages = [{"role": "user", "content": "hi"}]
            try:
                self._renders_tools = (encode_chat(self.tokenizer, messages, [_PROBE_TOOL])
                                       != encode_chat(self.tokenizer, messages))
            except Exception:  # noqa: BLE001 - a template that fails on tools ignores them
                self._renders_tools = False
        return self._renders_tools

    def grammar(self, tools: Sequence[dict], parallel: bool = True) -> GrammarSpec:
        """The lazy grammar for a request with ``tools`` (checked OpenAI definitions)."""
        return GrammarSpec("lark", self.format.grammar(tool_parameters(tools), parallel,
                                                       self.special_trigger), field="tools")

    def parser(self, prefix: str = "") -> ToolCallParser:
        """A parser of one output (``prefix``: the text it continues)."""
        return ToolCallParser(self.format, prefix)

    def continued(self, grammar, prefix: str, ll_tokenizer) -> _Continued:
        """``grammar`` (compiled) for an output that continues ``prefix`` (a final assistant
        message continued): its matchers start where ``prefix`` leaves the grammar, so a
        call the message opened is finished as a valid call.

        Raises:
            ValueError: ``prefix`` does not fit the format (e.g. a broken call).
        """
        tokens = ll_tokenizer.tokenize_str(prefix,
                                           parse_special=self.special_trigger is not None)
        continued = _Continued(grammar, tokens)
        try:
            continued.matcher()
        except GrammarError:
            raise ValueError("the final message does not fit the model's tool-call format "
                             f"({self.format.name})") from None
        return continued

    def messages(self, messages: Sequence[dict], tools: Sequence[dict] | None
                 ) -> tuple[list[dict], list[dict] | None]:
        """The chat messages and ``tools`` to give the template. A template that renders
        tools gets them as they are, past calls as ``tool_calls`` with their arguments as
        objects (what Hugging Face templates expect). Otherwise the tools are described in
        the format's words in the system message (``tools`` None), past calls are written
        into the assistant turns as the model writes them, and ``tool`` answers become user
        turns in the format's words (Hermes: ``<tool_response>``)."""
        has_calls = any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
        if not tools and not has_calls:
            return list(messages), None
        if self.renders_tools():
            # Mistral's templates refuse call ids that are not 9 letters and digits.
            ids = _mistral_id if self.format.name == "mistral" else str
            out = []
            for m in messages:
                m = dict(m)
                if m.get("tool_calls"):
                    m["tool_calls"] = [_template_call(c, ids) for c in m["tool_calls"]]
                if m.get("tool_call_id"):
                    m["tool_call_id"] = ids(m["tool_call_id"])
                out.append(m)
            return out, list(tools) if tools else None
        out = []
        for original in messages:
            m = {k: v for k, v in original.items() if k not in ("tool_calls", "tool_call_id")}
            calls = [_name_args(c) for c in original.get("tool_calls") or ()]
            if calls:
                text = self.format.render_calls(calls)
                m["content"] = f"{m['content']}\n{text}" if m.get("content") else text
            if m.get("role") == "tool":
                m = {"role": "user", "content": self.format.render_result(m.get("content", ""))}
            out.append(m)
        if tools:
            prompt = self.format.system_prompt(tools)
            if out and out[0].get("role") in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out, None


def _name_args(call: dict) -> tuple[str, str]:
    fn = call.get("function", call)
    args = fn.get("arguments", "{}")
    return str(fn.get("name", "")), args if isinstance(args, str) else json.dumps(args)


def _template_call(call: dict, ids=str) -> dict:
    """A past call as Hugging Face chat templates read it: ``arguments`` an object, the id
    through ``ids``."""
    name, args = _name_args(call)
    try:
        value = json.loads(args)
    except ValueError:
        value = args
    out = {"type": "function", "function": {"name": name, "arguments": value}}
    if call.get("id"):
        out["id"] = ids(call["id"])
    return out


def _mistral_id(call_id: str) -> str:
    """A call id as Mistral's templates take them (9 letters and digits): itself when it is
    one, else the first 9 hex digits of its SHA-1 (the same id maps the same way in the
    assistant's calls and the tool's answer)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    import hashlib

    return hashlib.sha1(call_id.encode()).hexdigest()[:9]


def tools_request(tools_json: str, choice: str, parallel: bool | None, field: str = "tools"):
    """A gRPC ``Tools`` message's fields as OpenAI's: ``(tools, tool_choice, forced
    constraint or None, its answer shape (`coordinator.front.openai_structured.ToolCalls`) or
    None)``. ``choice``: "" or "auto", "none", "required", or a function's name.

    Raises:
        ValueError: the message names the problem (``tools: ...``), as the HTTP API's 400.
    """
    from types import SimpleNamespace

    from .openai_errors import ApiError
    from .openai_structured import constraint_of

    try:
        tools = json.loads(tools_json)
    except ValueError as exc:
        raise ValueError(f"{field}: json is not JSON: {exc}") from None
    openai_choice = {"": "auto"}.get(choice, choice)
    if openai_choice not in ("auto", "none", "required"):
        openai_choice = {"type": "function", "function": {"name": choice}}
    body = SimpleNamespace(tools=tools, tool_choice=openai_choice,
                           parallel_tool_calls=parallel)
    try:
        spec, calls = constraint_of(body)
    except ApiError as exc:
        raise ValueError(exc.message) from None
    return tools, openai_choice, spec, calls
