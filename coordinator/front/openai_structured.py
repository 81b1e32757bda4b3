"""Structured outputs on the OpenAI API (`coordinator.front.openai_request`): ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` extra body (one of ``json``,
``regex``, ``choice``, ``grammar``, ``json_object``, with its whitespace options), and
``tools`` with ``tool_choice`` ``"required"`` or a named function, read into the
`specd_core.grammar.GrammarSpec` the gateway compiles, plus the `ToolCalls` shape the answer
takes. ``tool_choice`` ``"auto"`` (the default with tools) is no constraint here: the
gateway builds its lazy grammar and the answer's calls are parsed out of the model's own
format (`coordinator.front.tool_calls`); ``"none"`` is plain text. Bad or unsupported input is a
400 naming the field (`coordinator.front.openai_errors.ApiError`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from specd_core.grammar import GrammarError, GrammarSpec

from .openai_errors import ApiError

__all__ = ["ToolCalls", "constraint_of"]

#: OpenAI's rule for a ``json_schema`` ``name`` and a function ``name``.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: ``structured_outputs`` keys holding the constraint (exactly one), and its options.
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
               "disable_fallback")


def _error(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class ToolCalls:
    """How a constrained tool call is answered: the output is ``name`` 's arguments (a named
    function, or ``"required"`` with one tool), or ``{"name": ..., "arguments": {...}}``
    choosing among ``names`` (``name`` None)."""

    name: str | None
    names: tuple[str, ...]

    def call_id(self) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    def calls(self, text: str) -> list[dict] | None:
        """The OpenAI ``tool_calls`` of a finished output, or None when it does not parse (a
        wrapped call cut by ``max_tokens``)."""
        if self.name is not None:
            return [self._call(self.name, text)]
        try:
            value = json.loads(text)
            name, args = value["name"], value["arguments"]
        except (ValueError, KeyError, TypeError):
            return None
        return [self._call(name, json.dumps(args, ensure_ascii=False))]

    def _call(self, name: str, arguments: str) -> dict:
        return {"id": self.call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}


def constraint_of(body) -> tuple[GrammarSpec | None, ToolCalls | None]:
    """The constraint an OpenAI body asks for (None: none) and, for a forced tool call, how
    to answer it.

    Raises:
        ApiError: 400 naming ``response_format``, ``structured_outputs``, ``tools`` or
            ``tool_choice``.
    """
    specs: list[tuple[str, GrammarSpec]] = []
    try:
        rf = _response_format(getattr(body, "response_format", None))
        if rf is not None:
            specs.append(("response_format", rf))
        so = _structured_outputs(getattr(body, "structured_outputs", None))
        if so is not None:
            specs.append(("structured_outputs", so))
        tool = _tools(getattr(body, "tools", None), getattr(body, "tool_choice", None))
    except GrammarError as exc:
        field, _, why = str(exc).partition(": ")
        raise _error(field, why) from None
    calls = None
    if tool is not None:
        spec, calls = tool
        specs.append(("tool_choice", spec))
    if len(specs) > 1:
        names = " and ".join(name for name, _ in specs)
        raise _error(specs[1][0], f"only one constraint per request ({names} were set)")
    return (specs[0][1] if specs else None), calls


def _response_format(value: Any) -> GrammarSpec | None:
    field = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise GrammarError(f"{field}: must be an object with a type")
    kind = value["type"]
    extra = set(value) - {"type", "json_schema"}
    if extra:
        raise GrammarError(f"{field}: unrecognized field {sorted(extra)[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", field=field)
    if kind != "json_schema":
        raise GrammarError(f"{field}: type {kind!r} is not supported; expected text, "
                           "json_object or json_schema")
    js = value.get("json_schema")
    if not isinstance(js, dict):
        raise GrammarError(f"{field}: json_schema: required with type json_schema")
    extra = set(js) - {"name", "description", "schema", "strict"}
    if extra:
        raise GrammarError(f"{field}: json_schema: unrecognized field {sorted(extra)[0]!r}")
    name = js.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise GrammarError(f"{field}: json_schema.name: required, 1-64 characters of a-z, "
                           "A-Z, 0-9, _ and -")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise GrammarError(f"{field}: json_schema.strict: must be a boolean")
    schema = js.get("schema", {})
    if not isinstance(schema, dict):
        raise GrammarError(f"{field}: json_schema.schema: must be a JSON Schema object")
    # strict or not, the output is constrained (never silently unconstrained).
    return GrammarSpec("json_schema", schema, field=field)


def _structured_outputs(value: Any) -> GrammarSpec | None:
    field = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise GrammarError(f"{field}: must be an object")
    unknown = set(value) - set(_SO_KINDS) - set(_SO_OPTIONS)
    if unknown:
        raise GrammarError(f"{field}: unrecognized field {sorted(unknown)[0]!r}")
    kinds = [k for k in _SO_KINDS if value.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise GrammarError(f"{field}: set exactly one of {', '.join(_SO_KINDS[:-1])}"
                           + (f" (got {', '.join(kinds)})" if kinds else ""))
    kind = kinds[0]
    if kind == "structural_tag":
        raise GrammarError(f"{field}: structural_tag is not supported by this server")
    if value.get("disable_additional_properties"):
        raise GrammarError(f"{field}: disable_additional_properties is not supported; write "
                           "additionalProperties: false in the schema")
    for name in ("disable_any_whitespace", "disable_fallback", "disable_additional_properties"):
        if value.get(name) is not None and not isinstance(value[name], bool):
            raise GrammarError(f"{field}: {name}: must be a boolean")
    pattern = value.get("whitespace_pattern")
    if pattern is not None and (not isinstance(pattern, str) or not pattern):
        raise GrammarError(f"{field}: whitespace_pattern: must be a non-empty regex")
    json_options = {"separators": (",", ":") if value.get("disable_any_whitespace") else None,
                    "whitespace_pattern": pattern}
    spec = value[kind]
    if kind == "json_object":
        if spec is not True:
            raise GrammarError(f"{field}: json_object: must be true")
        return GrammarSpec("json_object", field=field, **json_options)
    if kind == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise GrammarError(f"{field}: json: not a JSON schema: {exc}") from None
        if not isinstance(spec, dict):
            raise GrammarError(f"{field}: json: must be a JSON Schema object")
        return GrammarSpec("json_schema", spec, field=field, **json_options)
    if kind == "regex":
        if not isinstance(spec, str) or not spec or "\x00" in spec:
            raise GrammarError(f"{field}: regex: must be a non-empty pattern")
        return GrammarSpec("regex", spec, field=field)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(
                isinstance(s, str) and s for s in spec):
            raise GrammarError(f"{field}: choice: must be a list of non-empty strings")
        return GrammarSpec("choice", list(spec), field=field)
    if not isinstance(spec, str) or not spec.strip():
        raise GrammarError(f"{field}: grammar: must be a Lark or EBNF (GBNF) grammar")
    if "::=" in spec:  # GBNF (llama.cpp's EBNF), as vLLM accepts: to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            spec = gbnf_to_lark(spec)
        except Exception as exc:  # the converter's own parse errors
            raise GrammarError(f"{field}: grammar: not a valid EBNF grammar: {exc}") from None
    return GrammarSpec("lark", spec, field=field)


def _tools(tools: Any, choice: Any) -> tuple[GrammarSpec, ToolCalls] | None:
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise GrammarError("tool_choice: needs tools")
        return None
    if not isinstance(tools, list):
        raise GrammarError("tools: must be a list of functions")
    params: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(
                tool.get("function"), dict):
            raise GrammarError(f"tools: [{i}] must be {{\"type\": \"function\", "
                               "\"function\": {...}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise GrammarError(f"tools: [{i}].function.name: required, 1-64 characters of "
                               "a-z, A-Z, 0-9, _ and -")
        if name in params:
            raise GrammarError(f"tools: [{i}].function.name: {name!r} appears twice")
        schema = fn.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise GrammarError(f"tools: [{i}].function.parameters: must be a JSON Schema "
                               "object")
        # A call's arguments are a JSON object (clients unpack them as keyword arguments):
        # as OpenAI does, a schema must say so; an empty one means any object.
        if schema and schema.get("type") != "object":
            raise GrammarError(f"tools: [{i}].function.parameters: must be a JSON Schema of "
                               f"type \"object\", got type {json.dumps(schema.get('type'))}")
        params[name] = schema or {"type": "object"}
    if choice in (None, "none", "auto"):
        return None  # free text, as without tools
    if choice == "required":
        if len(params) == 1:
            (name,) = params
            return (GrammarSpec("json_schema", params[name], field="tools"),
                    ToolCalls(name, (name,)))
        wrapped = {"anyOf": [
            {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
             "properties": {"name": {"const": n}, "arguments": s}} for n, s in params.items()]}
        return GrammarSpec("json_schema", wrapped, field="tools"), ToolCalls(None,
                                                                             tuple(params))
    if (not isinstance(choice, dict) or choice.get("type") != "function"
            or not isinstance(choice.get("function"), dict)):
        raise GrammarError("tool_choice: must be \"none\", \"auto\", \"required\" or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    name = choice["function"].get("name")
    if name not in params:
        raise GrammarError(f"tool_choice: function {name!r} is not in tools")
    return GrammarSpec("json_schema", params[name], field="tools"), ToolCalls(name, (name,))
