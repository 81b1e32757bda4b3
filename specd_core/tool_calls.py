"""Tool calls the model writes in its own format (``tool_choice: "auto"``): the formats
(`ToolFormat`: Hermes ``<tool_call>...</tool_call>``, Llama 3 JSON, Mistral
``[TOOL_CALLS]``, vLLM's ``--tool-call-parser`` names), the lazy grammar that constrains a
call once the model starts one (`ToolFormat.grammar`), the prompt text for a chat template
that does not render tools itself (`ToolFormat.system_prompt`, `ToolFormat.render_calls`),
and an incremental parser of the output into content and calls (`ToolCallParser`).

The lazy grammar (llguidance's Lark dialect; its docs/syntax.md "Tool calling") leaves the
text free until the trigger appears (a ``lazy`` lexeme ``TEXT "<tool_call>"`` ends at the
first trigger; a trigger that is one special token is matched as that token), then
constrains the rest of the call to ``{"name": <one of the tools>, "arguments": <that tool's
parameters>}`` and the format's closing text; after it the model may write text or another
call (``parallel``) or must stop. It runs through the ordinary structured-outputs machinery
(`specd_core.grammar`), so it stays lossless under speculation and its forced tokens are
drafted for free. This is llama.cpp's "lazy grammar" for tool calls; vLLM and SGLang parse
calls out of unconstrained text, where a started call may not parse.

Pure: no tokenizer, no network; the caller says whether the trigger is a special token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["TOOL_CALL_PARSERS", "ToolCallParser", "ToolFormat", "call_schema",
           "format_from_template", "tool_format"]

#: JSON inside a call is written as `specd_core.grammar` writes it by default: ``", "`` and
#: ``": "``, no other whitespace (no runaway whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _ref_rewriter(prefix: str):
    """A function rewriting a local ``$ref`` of a tool's parameters for the schema where
    they live under ``$defs/<prefix>`` (their own ``$defs`` / ``definitions`` hoisted to
    ``$defs/<prefix>.<name>``)."""

    def rewrite(ref: str) -> str:
        if not ref.startswith("#"):
            return ref
        pointer = ref[1:]
        for defs in ("/$defs/", "/definitions/"):
            if pointer.startswith(defs):
                return f"#/$defs/{prefix}.{pointer[len(defs):]}"
        return f"#/$defs/{prefix}{pointer}"

    def walk(value):
        if isinstance(value, dict):
            return {k: (rewrite(v) if k == "$ref" and isinstance(v, str) else walk(v))
                    for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk


def call_schema(tools: Mapping[str, dict], args_key: str = "arguments") -> dict:
    """The JSON schema of one call among ``tools`` (name -> parameters schema): ``{"name":
    <const>, args_key: <its parameters>}``, one ``anyOf`` branch per tool, name first (the
    order llguidance writes properties in). Each tool's parameters move to
    ``$defs/<name>`` and their own ``$defs`` / ``definitions`` to ``$defs/<name>.<def>``,
    local ``$ref`` s rewritten, so a recursive or ``$defs``-using schema keeps working once
    nested."""
    defs: dict[str, dict] = {}
    branches = []
    for name, params in tools.items():
        params = params if isinstance(params, dict) and params else {"type": "object"}
        walk = _ref_rewriter(name)
        for key in ("$defs", "definitions"):
            for def_name, value in (params.get(key) or {}).items():
                defs[f"{name}.{def_name}"] = walk(value)
        defs[name] = walk({k: v for k, v in params.items()
                           if k not in ("$defs", "definitions", "$schema", "$id")})
        branches.append({"type": "object", "additionalProperties": False,
                         "required": ["name", args_key],
                         "properties": {"name": {"const": name},
                                        args_key: {"$ref": f"#/$defs/{name}"}}})
    return {"x-guidance": dict(_JSON_OPTIONS), "anyOf": branches, "$defs": defs}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls.

    Attributes:
        name: vLLM's ``--tool-call-parser`` name.
        trigger: the text (or special token) that starts calls.
        close: the text that ends a group of calls ("" : the output ends).
        args_key: the key holding a call's arguments.
        separator: between two calls of one group ("" : one call per group).
        open_array: a group is a JSON array of calls (``[`` after the trigger).
        at_start: the trigger counts only as the output's first character, and is the
            call's own first character (Llama 3 JSON's ``{``).
    """

    name: str
    trigger: str
    close: str
    args_key: str = "arguments"
    separator: str = ""
    open_array: bool = False
    at_start: bool = False

    def grammar(self, tools: Mapping[str, dict], parallel: bool = True,
                special_trigger: int | None = None) -> str:
        """The lazy Lark grammar for ``tools`` (name -> parameters schema): free text, and
        once the trigger appears, calls that parse and match their tool's parameters.
        ``parallel``: several calls (and text between groups) allowed; else at most one
        call, and the output ends after it. ``special_trigger``: the trigger is that
        special token's id (matched as the token, never as text)."""
        call = f"call: %json {json.dumps(call_schema(tools, self.args_key))}"
        text = "TEXT: /(.|\\n)*/"
        if self.at_start:  # Llama 3 JSON: text that does not start with "{", or calls
            calls = f'call ("{self.separator.strip()}" " "? call)*' if parallel else "call"
            return "\n".join(["%llguidance {}", f"start: PLAIN | {calls}",
                              "PLAIN: /([^{](.|\\n)*)?/", call])
        if special_trigger is not None:
            head = f"TEXT <[{int(special_trigger)}]>"
            head_rule = ""
        else:
            head = "tc_hd"
            head_rule = f"tc_hd[lazy]: TEXT {json.dumps(self.trigger)}"
        if self.open_array:
            sep = f'"{self.separator.strip()}" " "?'
            body = f'" "? "[" call ({sep} call)* "]"' if parallel else '" "? "[" call "]"'
        else:
            body = '"\\n"? call "\\n"?'
        group = f"{head} {body} {json.dumps(self.close) if self.close else ''}".strip()
        start = "start: group* TEXT" if parallel else "start: TEXT | group"
        return "\n".join(line for line in ["%llguidance {}", start, f"group: {group}",
                                           head_rule, text, call] if line)

    def system_prompt(self, tools: Sequence[dict]) -> str:
        """The tools described in the format's own words, for a chat template that does
        not render ``tools`` (Hermes / Qwen 2.5's text for ``hermes``)."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        if self.name == "hermes":
            return ("# Tools\n\nYou may call one or more functions to assist with the user "
                    "query.\n\nYou are provided with function signatures within <tools></tools>"
                    f" XML tags:\n<tools>\n{listed}\n</tools>\n\nFor each function call, return"
                    " a json object with function name and arguments within "
                    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
                    "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
        if self.name == "llama3_json":
            return ("You have access to the following functions. To call a function, respond "
                    "with only a JSON object of the form {\"name\": function name, "
                    "\"parameters\": dictionary of argument name and its value}.\n\n" + listed)
        return ("You have access to the following functions:\n" + listed + "\n\nTo call "
                "functions, write [TOOL_CALLS] followed by a JSON list of "
                "{\"name\": ..., \"arguments\": {...}} objects.")

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """An assistant turn's calls (``(name, arguments JSON text)``) written as the model
        writes them, for a template that does not render ``tool_calls``."""
        objs = [f'{{"name": {json.dumps(n)}, "{self.args_key}": {a or "{}"}}}' for n, a in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objs)
        if self.name == "llama3_json":
            return "; ".join(objs)
        return f"{self.trigger}[{', '.join(objs)}]"

    def render_result(self, content: str) -> str:
        """A tool's answer as the format's models read it (Hermes: ``<tool_response>``)."""
        if self.name == "hermes":
            return f"<tool_response>\n{content}\n</tool_response>"
        return content


_FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "{", "", args_key="parameters", separator="; ",
                              at_start=True),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", separator=", ", open_array=True),
}
#: The tool-call formats served (vLLM's ``--tool-call-parser`` names).
TOOL_CALL_PARSERS = tuple(_FORMATS)


def tool_format(name: str) -> ToolFormat:
    """The `ToolFormat` named ``name``.

    Raises:
        ValueError: not one of `TOOL_CALL_PARSERS`.
    """
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of "
                         f"{', '.join(TOOL_CALL_PARSERS)}") from None


def format_from_template(template: str | None) -> str:
    """The tool-call format a chat template names: ``mistral`` where it writes
    ``[TOOL_CALLS]``, ``llama3_json`` where it has Llama 3's ``<|python_tag|>`` or
    ``"parameters"`` calls, else ``hermes`` (Qwen 2.5, Hermes, and the fallback)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "<|eom_id|>" in template:
        return "llama3_json"
    return "hermes"


_HEADER = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                     r"\s*:\s*")


def _json_end(text: str, start: int) -> int | None:
    """The index after the JSON value starting at ``text[start]`` (an object, array,
    string or scalar), or None when it is not complete yet."""
    depth, in_string, escaped = 0, False, False
    i = start
    if i < len(text) and text[i] not in "{[\"":  # a scalar: up to a delimiter
        m = re.compile(r"[^,}\]\s]*").match(text, i)
        return m.end() if m.end() < len(text) else None
    while i < len(text):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


@dataclass
class _Call:
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class ToolCallParser:
    """Reads a growing output into content and tool calls, in one pass: `feed` it the
    whole text so far each time (it keeps its place) and it returns what became certain:
    ``("content", text)``, ``("call", index, name)`` once a call's name is complete, and
    ``("arguments", index, text)`` pieces of its arguments JSON (as the model wrote them).
    Text that may be the start of the trigger is held back until it is not (or the end).
    Written for output its `ToolFormat.grammar` constrained; text that does not continue a
    call as the format says ends the call reading there, the rest taken as content.

    ``prefix``: text the output continues (a final assistant message continued,
    ``continue_final_message``): read first, its content not repeated, a call it opened
    reported whole (name and every argument piece) with the first events, calls it
    completed not reported."""

    fmt: ToolFormat
    prefix: str = ""
    calls: list[_Call] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pos: int = 0
    _mode: str = "text"  # text, plain (no more calls), group, header, args, after
    _args_at: int = 0
    _sent: int = 0
    _old: int = 0
    _stash: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.prefix:
            self._stash = self._feed(self.prefix, False)
            self._old = sum(c.complete for c in self.calls)

    def feed(self, text: str, final: bool = False) -> list[tuple]:
        """Events for ``text`` (the whole output so far; ``final``: it is complete)."""
        out, self._stash = self._stash + self._feed(self.prefix + text, final), []
        old = self._old
        return [e if e[0] == "content" else (e[0], e[1] - old, *e[2:]) for e in out
                if e[0] == "content" or e[1] >= old]

    def _feed(self, text: str, final: bool) -> list[tuple]:
        out: list[tuple] = []
        fmt = self.fmt
        while True:
            if self._mode == "plain":
                self._content(out, text, self._pos, len(text))
                self._pos = len(text)
                return out
            if self._mode == "text":
                if fmt.at_start:
                    if self._pos == 0 and not self.calls:
                        if not text:
                            return out
                        self._mode = "group" if text[0] == "{" else "plain"
                    else:
                        self._mode = "plain"
                    continue
                at = text.find(fmt.trigger, self._pos)
                if at >= 0:
                    self._content(out, text, self._pos, at)
                    self._pos = at + len(fmt.trigger)
                    self._mode = "group"
                    continue
                keep = 0 if final else _partial_suffix(text, fmt.trigger, self._pos)
                self._content(out, text, self._pos, len(text) - keep)
                self._pos = len(text) - keep
                return out
            if self._mode in ("group", "after"):
                skip = " \n\r\t" + ("[" if fmt.open_array and self._mode == "group" else "")
                skip += fmt.separator.strip() if self._mode == "after" else ""
                while self._pos < len(text) and text[self._pos] in skip:
                    if text[self._pos] not in " \n\r\t":
                        skip = " \n\r\t"  # one separator / bracket
                    self._pos += 1
                rest = text[self._pos:]
                if not rest:
                    if final:
                        self._mode = "text"
                    return out
                end = "]" if fmt.open_array else fmt.close
                if end and (rest.startswith(end) or (end.startswith(rest) and not final)):
                    if not rest.startswith(end):
                        return out
                    self._pos += len(end)
                    self._mode = "text"
                    continue
                if rest[0] != "{":
                    self._mode = "plain"
                    continue
                self._mode = "header"
                self._args_at = self._pos
            if self._mode == "header":
                m = _HEADER.match(text, self._args_at)
                if m is None or m.end() == len(text):
                    if final or (m is None and not _maybe_header(text[self._args_at:])):
                        self._pos = self._args_at
                        self._mode = "plain"
                        continue
                    return out
                try:
                    name = json.loads(f'"{m.group(1)}"')
                except ValueError:
                    name = m.group(1)
                self.calls.append(_Call(name))
                out.append(("call", len(self.calls) - 1, name))
                self._pos = self._sent = m.end()
                self._mode = "args"
            if self._mode == "args":
                end = _json_end(text, self._pos)
                upto = len(text) if end is None else end
                call = self.calls[-1]
                if upto > self._sent:
                    piece = text[self._sent:upto]
                    call.arguments += piece
                    out.append(("arguments", len(self.calls) - 1, piece))
                    self._sent = upto
                if end is None:
                    return out
                rest = text[end:].lstrip()
                if not rest:
                    return out
                if rest[0] != "}":
                    self._pos = end
                    self._mode = "plain"
                    continue
                call.complete = True
                self._pos = len(text) - len(rest) + 1
                self._mode = "after"

    def _content(self, out: list, text: str, start: int, end: int) -> None:
        piece = text[max(start, len(self.prefix)):end]  # the prefix's text is not repeated
        if piece and not (self.calls and not piece.strip()):
            self.content.append(piece)
            out.append(("content", piece))

    def result(self, text: str) -> tuple[str | None, list[tuple[str, str]] | None]:
        """``(content, calls)`` of a finished output: the calls as ``(name, arguments JSON
        text)`` and the text around them (stripped; None when only whitespace), or
        ``(text, None)`` when no call was completed (a turn without a call, or one cut
        short)."""
        self.feed(text, final=True)
        calls = self.calls[self._old:]
        if not calls or not all(c.complete for c in calls):
            return text, None
        content = "".join(self.content).strip()
        return content or None, [(c.name, c.arguments) for c in calls]


def _partial_suffix(text: str, trigger: str, start: int) -> int:
    """The length of the longest end of ``text[start:]`` that begins ``trigger``."""
    for k in range(min(len(trigger) - 1, len(text) - start), 0, -1):
        if trigger.startswith(text[len(text) - k:]):
            return k
    return 0


def _maybe_header(text: str) -> bool:
    """Whether ``text`` may still grow into a call's ``{"name": "...", "arguments": ``."""
    probe = '{"name": "x", "arguments": '
    compact = re.sub(r"\s+", "", text)
    if len(compact) <= len('{"name":"'):
        return probe.replace(" ", "").startswith(compact)
    return compact.startswith('{"name":"')
