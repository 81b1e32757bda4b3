"""OpenAI request bodies (chat completions, completions) for `coordinator.front.http_api`: read
(strict UTF-8 JSON, bounded nesting, valid Unicode: `parse_body`), validated (pydantic models,
unknown and unsupported fields refused), and translated into the gateway's
`coordinator.front.gateway.GenerationRequest` (`generation_request`); and errors in OpenAI's shape
(`ApiError`), a failed request's included (`request_error`: a `RequestInvalid` 's field named
as the OpenAI parameter it came from)."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ..step.errors import RequestError, RequestInvalid, client_status
from .generation_request import (
    GenerationRequest,
    check_chat_role,
    check_max_draft_len,
)
from .openai_errors import ApiError, unavailable
from .openai_structured import constraint_of

#: ``max_tokens`` when a completion request does not set it (OpenAI's default).
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: OpenAI's default temperature (the gRPC API's is 0, greedy).
DEFAULT_TEMPERATURE = 1.0
_UINT32_MAX = 2**32 - 1


# ---- request bodies ----

class _Strict(BaseModel):
    # strict: a string or a boolean is not a number ("temperature": "0.5" or true is a 400);
    # JSON integers are still accepted where a float is expected.
    model_config = ConfigDict(extra="forbid", strict=True)


class SpeculationBody(_Strict):
    """The ``speculation`` extra body field (the gRPC ``SpeculationOptions``)."""

    enabled: bool | None = None
    max_draft_len: int | None = None
    drafter: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class Body(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with it
    # Extra body fields (vLLM's names):
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    speculation: SpeculationBody | None = None
    # vLLM's: partitions the cross-request caches within the caller's tenant
    # (`coordinator.front.tenants.partition_of`).
    cache_salt: str | None = None
    # Structured outputs (`coordinator.front.openai_structured`): OpenAI's and vLLM's extra body.
    response_format: Any = None
    structured_outputs: Any = None
    # Known but unsupported: refused by `_refuse_unsupported` with a message naming them.
    logit_bias: Any = None


#: The most choices (``n``) one request may ask for: each takes a decoding slot.
MAX_CHOICES = 16
#: Alternatives per position: chat ``top_logprobs`` and completions ``logprobs`` (OpenAI's
#: bounds).
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


class ChatMessage(_Strict):
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    # An assistant turn that called tools, and a tool's answer to one: the calls are given
    # to the template as JSON text.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None


class ChatBody(Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat prompt extensions (`specd_core.text.encode_chat`).
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class CompletionBody(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: Any = None
    best_of: Any = None


def _refuse_unsupported(body: Body) -> None:
    """Raises a 400 naming the first field set to something this server cannot do."""
    checks = ["logit_bias", "functions", "function_call", "suffix"]
    for name in checks:
        value = getattr(body, name, None)
        if value not in (None, False) and not (name in ("tools", "functions") and value == []):
            raise ApiError(400, f"{name}: not supported by this server", param=name)
    best_of = getattr(body, "best_of", None)
    if best_of is not None and best_of != (body.n or 1):
        raise ApiError(400, f"best_of: only best_of equal to n is supported, got {best_of!r}",
                       param="best_of")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream=true",
                       param="stream_options")


def _int_field(name: str, value: int | None, low: int, high: int) -> int | None:
    if value is not None and not low <= value <= high:
        raise ApiError(400, f"{name}: must be in [{low}, {high}], got {value}", param=name)
    return value


def _checked(check, value, where: str) -> None:
    """Runs a shared `coordinator.front.generation_request` check (the gRPC API's too), its
    `RequestInvalid` as a 400 naming ``where``."""
    try:
        check(value, where)
    except RequestInvalid as exc:
        raise ApiError(400, str(exc), param=where) from None


def _chat_content(i: int, content: str | list[dict] | None) -> str:
    """A message's text: a string, or the ``text`` parts of a content list."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError(400, f"messages[{i}].content[{j}]: only text parts are supported",
                           param=f"messages[{i}].content")
        parts.append(part["text"])
    return "".join(parts)


def _past_calls(i: int, calls: list[dict]) -> list[dict]:
    """An assistant message's ``tool_calls``, checked: ``{"id"?, "type"?, "function":
    {"name", "arguments"}}`` each (``arguments`` a JSON string, or an object)."""
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function")
        where = f"messages[{i}].tool_calls[{j}]"
        if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", "{}"), str | dict)):
            raise ApiError(400, f"{where}: must be {{\"function\": {{\"name\": ..., "
                                "\"arguments\": ...}}", param=f"messages[{i}].tool_calls")
        args = fn.get("arguments", "{}")
        out.append({"id": str(call.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": (
                        args if isinstance(args, str) else json.dumps(args))}})
    return out


def generation_request(body: Body) -> tuple[GenerationRequest, str]:
    """The `GenerationRequest` an OpenAI body means, and the name of its max-tokens field.
    ``max_new_tokens`` is left 0 (= the rest of the context) for a chat request without one.
    ``n`` is checked here but not carried: the caller submits that many choices.

    Raises:
        ApiError: 400 naming the field.
    """
    _refuse_unsupported(body)
    _int_field("n", body.n, 1, MAX_CHOICES)
    req = GenerationRequest(ignore_eos=body.ignore_eos)
    req.constraint = constraint_of(body)[0]
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if tools and choice != "none":
        req.tools = list(tools)  # valid: `constraint_of` checked them
        if choice in (None, "auto"):  # OpenAI's default with tools
            req.tool_choice = "auto"
            req.parallel_tool_calls = body.parallel_tool_calls is not False
    max_name, max_tokens = "max_tokens", body.max_tokens
    min_tokens = 1
    if isinstance(body, ChatBody):
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise ApiError(400, "top_logprobs: requires logprobs: true",
                               param="top_logprobs")
            _int_field("top_logprobs", body.top_logprobs, 0, MAX_CHAT_TOP_LOGPROBS)
        if body.logprobs:
            req.logprobs = body.top_logprobs or 0
        if body.max_completion_tokens is not None:
            max_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
        if not body.messages:
            raise ApiError(400, "messages: at least one message is required", param="messages")
        if body.add_generation_prompt and body.continue_final_message:
            raise ApiError(400, "continue_final_message: cannot be true with "
                                "add_generation_prompt (set add_generation_prompt: false)",
                           param="continue_final_message")
        if body.continue_final_message and body.messages[-1].role != "assistant":
            raise ApiError(400, "continue_final_message: the last message must be the "
                                "assistant's", param="continue_final_message")
        req.add_generation_prompt = body.add_generation_prompt
        req.continue_final_message = body.continue_final_message
        req.chat = []
        for i, m in enumerate(body.messages):
            _checked(check_chat_role, m.role, f"messages[{i}].role")
            message = {"role": m.role, "content": _chat_content(i, m.content)}
            if m.name:  # only when set: templates that do not use it ignore the key
                message["name"] = m.name
            if m.tool_calls:  # rendered by `coordinator.front.tool_calls.ChatTools.messages`
                message["tool_calls"] = _past_calls(i, m.tool_calls)
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            req.chat.append(message)
    else:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: batched prompts ({len(prompt)}) are not "
                                    "supported: send one request per prompt", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.text = prompt
        else:
            for t in prompt:
                _int_field("prompt", t, -(2**31), 2**31 - 1)
            req.token_ids = list(prompt)
        if max_tokens is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        if body.logprobs is not None:
            req.logprobs = _int_field("logprobs", body.logprobs, 0,
                                      MAX_COMPLETION_LOGPROBS)
        if body.echo:
            # 0 scores (and echoes) the prompt without generating; with no ``logprobs``
            # the prompt is still fed once (the path that answers it), its values dropped.
            min_tokens = 0
            if body.logprobs is not None or max_tokens == 0:
                req.prompt_logprobs = body.logprobs or 0
    if max_tokens is not None:
        req.max_new_tokens = _int_field(max_name, max_tokens, min_tokens, _UINT32_MAX)
    req.sampling["temperature"] = (DEFAULT_TEMPERATURE if body.temperature is None
                                   else body.temperature)
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            req.sampling[name] = value
    if body.top_k is not None:
        # -1 is vLLM's "off", as over gRPC (`sampling_params` makes it 0).
        req.sampling["top_k"] = _int_field("top_k", body.top_k, -1, 2**31 - 1)
    if body.seed is not None:
        req.seed = _int_field("seed", body.seed, 0, 2**64 - 1)
    req.stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    # OpenAI's semantics by default: the text ends before the stop string.
    req.include_stop_str_in_output = body.include_stop_str_in_output
    for t in body.stop_token_ids or ():
        _int_field("stop_token_ids", t, -(2**31), 2**31 - 1)
    req.stop_token_ids = list(body.stop_token_ids or ())
    if body.speculation is not None:
        spec = body.speculation
        req.speculate = spec.enabled
        if spec.max_draft_len is not None:
            _checked(check_max_draft_len, spec.max_draft_len, "speculation.max_draft_len")
            req.max_draft_len = _int_field("speculation.max_draft_len", spec.max_draft_len, 1,
                                           _UINT32_MAX)
        if spec.drafter is not None:
            req.drafter = spec.drafter
    return req, max_name


def _openai_param(field: str, max_name: str, chat: bool) -> str:
    """The OpenAI request parameter a `RequestInvalid` field (the gRPC API's field path)
    comes from: ``max_new_tokens`` is ``max_name``, ``sampling.<x>`` is ``<x>``, the prompt
    (``text``, ``token_ids``, ``chat``, ``prompt``) is ``prompt`` or chat ``messages``,
    ``prompt_logprobs`` is ``logprobs``; the others share their name."""
    if field == "max_new_tokens":
        return max_name
    if field.startswith("sampling."):
        return field.removeprefix("sampling.")
    if field in ("text", "token_ids", "chat", "prompt"):
        return "messages" if chat or field == "chat" else "prompt"
    return "logprobs" if field == "prompt_logprobs" else field


def request_error(exc: RequestError, max_name: str, chat: bool) -> ApiError:
    """The HTTP answer to a request that failed (`coordinator.step.errors.client_status`)."""
    code, message = client_status(exc)
    if code == "INVALID_ARGUMENT":
        if isinstance(exc, RequestInvalid) and exc.field is not None:
            param = _openai_param(exc.field, max_name, chat)
            return ApiError(400, exc.naming(param), param=param)
        return ApiError(400, message)
    if code == "UNAVAILABLE":
        return unavailable(message)
    if code == "RESOURCE_EXHAUSTED":
        return ApiError(429, message, "rate_limit_error", code="rate_limit_exceeded")
    return ApiError(500, message, "server_error", code="internal_error")


#: JSON nesting this API reads (its deepest field, ``messages[i].content[j].text``, is 4).
MAX_JSON_DEPTH = 32


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def parse_body(raw: bytes, model: type[Body]) -> Body:
    """The request body as ``model``: strict UTF-8 JSON, an object, at most
    `MAX_JSON_DEPTH` deep, every string valid Unicode (a lone surrogate escape such as
    ``"\\ud800"`` is refused: it cannot be encoded, as a prompt or anywhere else).

    Raises:
        ApiError: 400 naming the field where there is one.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"invalid body: not UTF-8 (at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} "
                            "levels") from None
    except ValueError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid JSON body: expected an object")
    _check_json(data, "", 1)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _check_json(value, path: str, depth: int) -> None:
    """Raises a 400 for nesting past `MAX_JSON_DEPTH` or a string that is not valid
    Unicode (a lone surrogate), naming where."""
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"{path}: nested deeper than {MAX_JSON_DEPTH} levels",
                       param=path)
    if isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, path or "body")
            where = f"{path}.{key}" if path else key
            if isinstance(item, str):
                _check_text(item, where)
            elif isinstance(item, dict | list):
                _check_json(item, where, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, str):
                _check_text(item, f"{path}[{i}]")
            elif isinstance(item, dict | list):
                _check_json(item, f"{path}[{i}]", depth + 1)


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, f"{where}: contains a lone surrogate "
                            f"(\\u{ord(text[exc.start]):04x}), which is not valid Unicode text",
                       param=where) from None


def validation_error(errors: list) -> ApiError:
    """A 400 naming the first invalid field of the body (pydantic's location)."""
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union-member tags ("str", "list[int]") from the location.
    loc = [p for p in loc if not re.match(r"^(str|int|float|bool|list|dict|function-after)\b",
                                          p)]
    param = ".".join(p if not p.isdigit() else f"[{p}]" for p in loc).replace(".[", "[")
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: unrecognized request argument", param=param)
    if err.get("type") == "missing":
        return ApiError(400, f"{param}: required", param=param)
    if err.get("type") == "json_invalid" or not param:
        return ApiError(400, f"invalid JSON body: {err.get('msg', '')}")
    return ApiError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param)


__all__ = ["ApiError", "Body", "ChatBody", "CompletionBody", "generation_request", "parse_body",
           "request_error", "unavailable", "validation_error"]
