"""The OpenAI-compatible HTTP API (``specd serve --http-port``), beside the gRPC one.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` and ``GET /metrics`` (Prometheus), on FastAPI +
uvicorn as vLLM and SGLang serve theirs. The layer is a thin adapter: an OpenAI request body
becomes a `coordinator.gateway.GenerationRequest` (`generation_request`) and goes through
`Gateway.submit_choices` / `Gateway.stream`, the very path the gRPC API takes (validation,
limits, the router, the `coordinator.errors` contract), so the same request gives the same
tokens on both APIs; a `RequestInvalid` 's field is named as the OpenAI parameter it came
from. It differs from gRPC's defaults as OpenAI's own API does: ``temperature`` defaults to
1, chat ``max_tokens`` to the rest of the context, completion ``max_tokens`` to 16, and the
text ends before a stop string (``include_stop_str_in_output: true`` keeps it, as gRPC does).
Log probabilities (chat ``logprobs``/``top_logprobs``, completions ``logprobs``/``echo``) are
the target's raw log-softmax (`specd_core.logprobs`), in OpenAI's shapes, streamed too.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, for every
status, malformed HTTP and bodies included: 400 names the field as the client wrote it
(fields it does not support, such as ``logit_bias``, ``tools``, ``response_format`` and any
unknown field, are refused, never ignored), 401 a missing or wrong ``Authorization: Bearer``
token (the gRPC API's token; ``/health`` is exempt; checked before the body is read), 404 an
unknown model or path, 408/413/431 a body too slow or too large or headers too large
(`HttpLimits`), 503 while the service starts, drains or has no replica that can serve, 500
an internal failure (details in the server log only). A stream cut after it started ends
with an error event and ``data: [DONE]``. A client that disconnects, mid-stream or while
waiting for a unary answer, has its requests cancelled: their slots are freed at the next
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from specd_core.request import SpeculativeDecodeResult

from .errors import RequestError, RequestInvalid, client_status
from .gateway import GenerationRequest

log = logging.getLogger(__name__)

#: ``max_tokens`` when a completion request does not set it (OpenAI's default).
COMPLETION_DEFAULT_MAX_TOKENS = 16
#: OpenAI's default temperature (the gRPC API's is 0, greedy).
DEFAULT_TEMPERATURE = 1.0
_UINT32_MAX = 2**32 - 1


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type_, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable_error", code="service_unavailable")


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


class _Body(_Strict):
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
    # Known but unsupported: refused by `_refuse_unsupported` with a message naming them.
    logit_bias: Any = None


#: Chat roles OpenAI defines (``developer`` is its newer name for ``system``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
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


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: Any = None
    best_of: Any = None


def _refuse_unsupported(body: _Body) -> None:
    """Raises a 400 naming the first field set to something this server cannot do."""
    checks = ["logit_bias", "tools", "tool_choice", "functions", "function_call",
              "parallel_tool_calls", "response_format", "suffix"]
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


def generation_request(body: _Body) -> tuple[GenerationRequest, str]:
    """The `GenerationRequest` an OpenAI body means, and the name of its max-tokens field.
    ``max_new_tokens`` is left 0 (= the rest of the context) for a chat request without one.
    ``n`` is checked here but not carried: the caller submits that many choices.

    Raises:
        ApiError: 400 naming the field.
    """
    _refuse_unsupported(body)
    _int_field("n", body.n, 1, MAX_CHOICES)
    req = GenerationRequest(ignore_eos=body.ignore_eos)
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
        req.chat = []
        for i, m in enumerate(body.messages):
            if m.role not in CHAT_ROLES:
                raise ApiError(400, f"messages[{i}].role: {m.role!r} is not a chat role; "
                                    f"expected one of {', '.join(CHAT_ROLES)}",
                               param=f"messages[{i}].role")
            message = {"role": m.role, "content": _chat_content(i, m.content)}
            if m.name:  # only when set: templates that do not use it ignore the key
                message["name"] = m.name
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
        # -1 is OpenAI-side tooling's (vLLM's) "off"; the gRPC API says 0.
        req.sampling["top_k"] = 0 if body.top_k == -1 else _int_field("top_k", body.top_k, 0,
                                                                       2**31 - 1)
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
            req.max_draft_len = _int_field("speculation.max_draft_len", spec.max_draft_len, 0,
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


def _request_error(exc: RequestError, max_name: str, chat: bool) -> ApiError:
    """The HTTP answer to a request that failed (`coordinator.errors.client_status`)."""
    code, message = client_status(exc)
    if code == "INVALID_ARGUMENT":
        if isinstance(exc, RequestInvalid) and exc.field is not None:
            param = _openai_param(exc.field, max_name, chat)
            return ApiError(400, exc.naming(param), param=param)
        return ApiError(400, message)
    if code == "UNAVAILABLE":
        return _unavailable(message)
    return ApiError(500, message, "server_error", code="internal_error")


def _speculation(result, drafter_failures: int) -> dict:
    """The request's speculation counters (the gRPC ``SpeculationStats`` fields)."""
    return {
        "forward_calls": result.forward_calls,
        "verification_steps": result.verification_steps,
        "drafted_tokens": result.drafted_tokens,
        "accepted_tokens": result.accepted_tokens,
        "acceptance_length": result.acceptance_length() or 0.0,
        "accept_rate": result.accept_rate() or 0.0,
        "evaluated_at_position": list(result.evaluated_at_position),
        "accepted_at_position": list(result.accepted_at_position),
        "drafter_failures": drafter_failures,
    }


def _combined(results: list[SpeculativeDecodeResult]) -> SpeculativeDecodeResult:
    """Several choices' counters summed (a request with ``n`` > 1)."""
    total = SpeculativeDecodeResult()
    for r in results:
        total.forward_calls += r.forward_calls
        total.tokens_generated += r.tokens_generated
        total.verification_steps += r.verification_steps
        total.drafted_tokens += r.drafted_tokens
        total.accepted_tokens += r.accepted_tokens
        for name in ("evaluated_at_position", "accepted_at_position"):
            mine, theirs = getattr(total, name), getattr(r, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for pos, count in enumerate(theirs):
                mine[pos] += count
    return total


def _usage(reqs: list, results: list) -> dict:
    """OpenAI's usage: the prompt counted once, the completion tokens of every choice."""
    prompt = reqs[0].decode.num_prompt_tokens
    completion = sum(r.tokens_generated for r in results if r is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _token_texts(tokenizer, ids: list[int]) -> dict[int, str]:
    """Each distinct id of ``ids`` -> its text decoded alone (special tokens kept, as vLLM
    shows them; a token holding part of a UTF-8 character decodes to U+FFFD)."""
    distinct = list(dict.fromkeys(ids))
    batch = getattr(tokenizer, "batch_decode", None)
    if batch is not None:
        texts = batch([[i] for i in distinct], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in distinct]
    return dict(zip(distinct, texts, strict=True))


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``) inverted: the printable
    character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()


def _token_bytes(tokenizer, texts: dict[int, str]) -> dict[int, list[int]]:
    """Each token's bytes (OpenAI chat's ``bytes``): for a byte-level BPE tokenizer (a
    Hugging Face fast tokenizer whose decoder is ``ByteLevel``, as SmolLM2's) the bytes its
    vocabulary entry stands for, so tokens that split a character still join into its UTF-8
    (each alone decodes to U+FFFD); otherwise, and for added or special tokens, the UTF-8
    of the token's text (vLLM's choice)."""
    out = {t: list(text.encode("utf-8")) for t, text in texts.items()}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return out
    try:
        added = set(tokenizer.get_added_vocab().values())
        pieces = tokenizer.convert_ids_to_tokens(list(texts))
    except Exception:  # a tokenizer without those: text bytes
        return out
    for t, piece in zip(texts, pieces, strict=True):
        if t not in added and piece and all(c in _BYTE_DECODER for c in piece):
            out[t] = [_BYTE_DECODER[c] for c in piece]
    return out


def _chat_logprobs(tokenizer, records: list) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}`` for `TokenLogprob` ``records`` (``bytes``: `_token_bytes`)."""
    texts = _token_texts(tokenizer, [t for r in records for t in (r.token, *(a for a, _ in
                                                                              r.top))])
    raw = _token_bytes(tokenizer, texts)

    def entry(token: int, logprob: float) -> dict:
        return {"token": texts[token], "logprob": logprob, "bytes": raw[token]}

    return {"content": [{**entry(r.token, r.logprob),
                         "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records],
            "refusal": None}


def _completion_logprobs(tokenizer, ids: list[int], records: list, offset: int
                         ) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` for tokens ``ids`` (``records[i]`` is ``ids[i]``'s
    `TokenLogprob`, None for the first prompt token: its value and alternatives are null)
    whose text starts at character ``offset`` of the choice's text: ``{tokens,
    token_logprobs, top_logprobs, text_offset}``; ``top_logprobs[i]`` maps token text to
    value for the ``k`` alternatives plus the token itself (OpenAI's "up to logprobs + 1").
    Also returns the offset after the last token."""
    texts = _token_texts(tokenizer, [*ids, *(t for r in records if r is not None
                                             for t, _ in r.top)])
    tokens, values, tops, offsets = [], [], [], []
    for token, r in zip(ids, records, strict=True):
        text = texts[token]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if r is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(r.logprob)
        top: dict[str, float] = {}
        for t, v in r.top:
            top.setdefault(texts[t], v)
        top.setdefault(text, r.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}, offset


@dataclass(frozen=True)
class _Shape:
    """How a request's choices are answered beyond their text: ``chat`` or completions,
    whether they carry ``logprobs``, and the echoed prompt (completions ``echo``: its text,
    or None)."""

    chat: bool
    logprobs: bool
    echo: str | None


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class StreamsClosed(Exception):
    """The service is stopping: open streams end (`OpenAIApi.close_streams`)."""


@dataclass(frozen=True)
class HttpLimits:
    """What one HTTP client may hold of the server (README, "The OpenAI-compatible HTTP API").

    Attributes:
        max_body_bytes: the largest request body, bytes; a larger one is refused with 413
            before it is read (from its ``Content-Length``) or as soon as a chunked body
            passes it. 8 MiB holds the largest prompt the default cap admits (~1.3 MB of
            SmolLM2 text) even with every character JSON-escaped (6 bytes each).
        body_timeout_s: the whole body must arrive within this many seconds of the
            headers, else 408 (a client trickling its body holds a connection).
        header_timeout_s: a connection must complete a request's headers within this many
            seconds of opening (or of its previous response), else it is closed (slowloris).
        max_connections: HTTP connections held at once; one more is answered 503 and closed
            at once (idle connections count: each holds a file descriptor in the process
            that also serves gRPC).
        keep_alive_s: an idle keep-alive connection is closed after this many seconds
            (uvicorn's ``timeout_keep_alive``).
        max_header_bytes: the request line and headers, bytes: over it is a 431 (or, while
            they are still arriving, h11's ``max_incomplete_event_size``: a 400).
    """

    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 30.0
    header_timeout_s: float = 10.0
    max_connections: int = 256
    keep_alive_s: int = 5
    max_header_bytes: int = 16 * 1024


#: JSON nesting this API reads (its deepest field, ``messages[i].content[j].text``, is 4).
MAX_JSON_DEPTH = 32


class OpenAIApi:
    """The HTTP app's state. ``servicer`` is the running `coordinator.gateway.Gateway` (the
    service's `GenerationServicer`, so that a drain covers both APIs), or None while the
    service starts (every generation call and ``/health`` answer 503 then).

    Args:
        auth_token: required as ``Authorization: Bearer`` on everything but ``/health``.
        registry: a prometheus_client registry for ``/metrics`` (None: 404).
        limits: connection, header and body limits (`HttpLimits`).
    """

    def __init__(self, servicer=None, auth_token: str | None = None, registry=None,
                 limits: HttpLimits | None = None):
        self.servicer = servicer
        self.auth_token = auth_token
        self.registry = registry
        self.limits = limits or HttpLimits()
        #: ``created`` of the model card: when this API started, Unix seconds.
        self.created = int(time.time())
        self._closing = asyncio.Event()
        self._open_streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self.app = self._build()
        #: The ASGI app to serve: the token and body limits before `app` (`_Guard`).
        self.asgi = _Guard(self, self.app)

    def check_auth(self, authorization: str) -> None:
        """Raises a 401 `ApiError` unless ``authorization`` is ``Bearer <the token>``."""
        if not self.auth_token:
            return
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self.auth_token.encode()):
            raise ApiError(401, "missing or invalid bearer token", code="invalid_api_key")

    def _ready(self):
        servicer = self.servicer
        if servicer is None:
            raise _unavailable("the service is starting")
        if servicer.draining:
            raise _unavailable("the service is shutting down")
        return servicer

    def _check_model(self, servicer, model: str) -> None:
        if model != servicer.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; this server serves "
                                f"{servicer.model_name!r}", param="model",
                           code="model_not_found")

    def _model_card(self, servicer) -> dict:
        return {"id": servicer.model_name, "object": "model", "created": self.created,
                "owned_by": "specd", "max_model_len": servicer.max_seq_len}

    async def close_streams(self, timeout_s: float = 2.0) -> None:
        """Ends every open stream (the service is stopping and their grace is over): each
        sends an OpenAI-shaped 503 error event and ``data: [DONE]``. Waits up to
        ``timeout_s`` seconds for them to be sent (a client that does not read is not
        waited for longer)."""
        self._closing.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._no_streams.wait(), timeout_s)

    def _build(self) -> FastAPI:
        app = FastAPI(title="specd", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_request, exc: ApiError):
            return exc.response()

        @app.exception_handler(RequestValidationError)
        async def invalid_body(_request, exc: RequestValidationError):
            return _validation_error(exc.errors()).response()

        @app.exception_handler(404)
        async def not_found(request, _exc):
            return ApiError(404, f"no such path: {request.url.path}", code="not_found").response()

        @app.exception_handler(405)
        async def bad_method(request, _exc):
            return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                            code="method_not_allowed").response()

        @app.exception_handler(Exception)
        async def internal(_request, exc: Exception):
            log.error("HTTP request failed: %r", exc)
            return ApiError(500, "internal error (the server log has the details)",
                            "server_error", code="internal_error").response()

        @app.get("/health")
        async def health():
            servicer = self.servicer
            if servicer is None:
                raise _unavailable("the service is starting")
            if servicer.draining:
                raise _unavailable("the service is shutting down")
            if not servicer.can_serve():
                raise _unavailable("no target replica can serve now")
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics():
            if self.registry is None:
                raise ApiError(404, "metrics are not enabled on this server", code="not_found")
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            # In a thread: the collector waits on this event loop for a router snapshot.
            data = await asyncio.to_thread(generate_latest, self.registry)
            return PlainTextResponse(data, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [self._model_card(self._ready())]}

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str):
            servicer = self._ready()
            self._check_model(servicer, model_id)
            return self._model_card(servicer)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = _parse_body(await request.body(), ChatBody)
            return await self._generate(body, request, chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = _parse_body(await request.body(), CompletionBody)
            return await self._generate(body, request, chat=False)

        return app

    async def _generate(self, body: _Body, request: Request, chat: bool):
        servicer = self._ready()
        self._check_model(servicer, body.model)
        gen, max_name = generation_request(body)
        trim = gen.trimmed_stops()
        with contextlib.ExitStack() as stack:
            stack.enter_context(servicer.tracked())
            try:
                reqs = await servicer.submit_choices(gen, body.n or 1,
                                                     default_max_new_tokens=chat)
            except RequestError as exc:
                raise _request_error(exc, max_name, chat) from None

            def cancel_all() -> None:
                for req in reqs:
                    servicer.cancel(req)

            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                    "created": int(time.time()), "model": servicer.model_name}
            shape = _Shape(chat, bool(body.logprobs) if chat else body.logprobs is not None,
                           None if chat or not body.echo else _echo_text(servicer, body,
                                                                          reqs[0]))
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = self._sse(servicer, reqs, trim, meta, shape, include_usage, max_name)
                tracked = stack.pop_all()  # the stream holds it until it ends
                return _CancellingStream(events, lambda: (cancel_all(), tracked.close()))
            try:
                outs = await _unless_disconnected(request, _collect_all(servicer, reqs, trim))
            except RequestError as exc:
                raise _request_error(exc, max_name, chat) from None
            finally:
                cancel_all()
            if outs is None:  # the client went away: nobody to answer
                return Response(status_code=499)
            choices = []
            for i, (tokens, text, result) in enumerate(outs):
                decode, logprobs = reqs[i].decode, None
                if chat:
                    choice = {"index": i, "message": {"role": "assistant", "content": text}}
                    if shape.logprobs:
                        logprobs = _chat_logprobs(servicer.tokenizer, decode.token_logprobs)
                else:
                    if shape.echo is not None:
                        text = shape.echo + text
                    choice = {"index": i, "text": text}
                    if shape.logprobs:
                        ids, records = tokens, decode.token_logprobs
                        if shape.echo is not None:
                            ids = decode.prefill_tokens() + ids
                            records = decode.prompt_logprobs + records
                        logprobs = _completion_logprobs(servicer.tokenizer, ids, records, 0)[0]
                choice.update(finish_reason=result.finish_reason, logprobs=logprobs)
                choices.append(choice)
            results = [out[2] for out in outs]
            return {**meta, "object": "chat.completion" if chat else "text_completion",
                    "choices": choices, "usage": _usage(reqs, results),
                    "speculation": _speculation(
                        results[0] if len(results) == 1 else _combined(results),
                        sum(req.drafter_failures for req in reqs))}

    async def _sse(self, servicer, reqs: list, trim: tuple[str, ...], meta: dict,
                   shape: _Shape, include_usage: bool, max_name: str) -> AsyncIterator[str]:
        """Server-sent events: ``data: {chunk}`` per text delta of each choice (``index``),
        with the log probabilities of the tokens it brought when asked (also when their text
        is held back: then the delta is empty), each choice's finish chunk (with its
        ``speculation`` counters), the usage chunk when asked, then ``data: [DONE]``. A
        completion with ``echo`` first sends each choice's prompt (and its log
        probabilities). However the stream is cut after it started (a request failed, the
        service stopped at the end of its grace, an internal error), it ends with
        ``data: {"error": ...}`` in OpenAI's shape, then ``data: [DONE]``."""
        chat = shape.chat
        kind = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}
        offsets = [0] * len(reqs)  # completions: each choice's text_offset so far
        echoed = [shape.echo is None] * len(reqs)

        def chunk(choices: list, **fields) -> str:
            return _event({**meta, "object": kind, "choices": choices, **extra, **fields})

        def choice(i: int, text: str | None, finish: str | None = None,
                   logprobs: dict | None = None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": logprobs}
            return {"index": i, "text": text or "", "finish_reason": finish,
                    "logprobs": logprobs}

        def completion_logprobs(i: int, ids: list[int], records: list) -> dict:
            logprobs, offsets[i] = _completion_logprobs(servicer.tokenizer, ids, records,
                                                        offsets[i])
            return logprobs

        def deltas(i: int, c) -> list[str]:
            """The chunks ``c`` (one of choice ``i``'s stream chunks) sends before its
            finish chunk."""
            out = []
            if not echoed[i]:  # the echoed prompt comes first
                echoed[i] = True
                logprobs = None
                if shape.logprobs:
                    logprobs = completion_logprobs(i, reqs[i].decode.prefill_tokens(),
                                                   c.prompt_logprobs)
                out.append(chunk([choice(i, shape.echo, logprobs=logprobs)]))
            logprobs = None
            if shape.logprobs and c.logprobs:
                logprobs = (_chat_logprobs(servicer.tokenizer, c.logprobs) if chat else
                            completion_logprobs(i, c.token_ids, c.logprobs))
            if c.text or logprobs is not None:
                out.append(chunk([choice(i, c.text, logprobs=logprobs)]))
            return out

        self._open_streams += 1
        self._no_streams.clear()
        try:
            if chat:
                for i in range(len(reqs)):
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                  "finish_reason": None, "logprobs": None}])
            results: list = [None] * len(reqs)
            try:
                async with contextlib.AsyncExitStack() as stack:
                    streams = [await stack.enter_async_context(
                        contextlib.aclosing(servicer.stream(req, trim))) for req in reqs]
                    merged = await stack.enter_async_context(
                        contextlib.aclosing(_merge(streams, self._closing)))
                    async for i, c in merged:
                        for event in deltas(i, c):
                            yield event
                        if c.result is not None:
                            results[i] = c.result
                            yield chunk([choice(i, None, c.result.finish_reason)],
                                        speculation=_speculation(c.result,
                                                                 reqs[i].drafter_failures))
                if include_usage:
                    yield chunk([], usage=_usage(reqs, results))
            except RequestError as exc:
                yield _event(_request_error(exc, max_name, chat).body())
            except StreamsClosed:
                yield _event(_unavailable("the service is shutting down: this stream was "
                                          "cut before it finished").body())
            except Exception:
                log.exception("streaming a response failed")
                yield _event(ApiError(500, "internal error (the server log has the details)",
                                      "server_error", code="internal_error").body())
            yield "data: [DONE]\n\n"
        finally:
            self._open_streams -= 1
            if not self._open_streams:
                self._no_streams.set()


async def _collect_all(servicer, reqs: list, trim: tuple[str, ...]) -> list:
    """``servicer.collect`` of every choice, concurrently; the first failure (or a cancel)
    ends them all."""
    tasks = [asyncio.ensure_future(servicer.collect(req, trim)) for req in reqs]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merge(streams: list, closing: asyncio.Event) -> AsyncIterator[tuple]:
    """``(index, chunk)`` from several chunk streams as each arrives (each stream's own order
    kept).

    Raises:
        StreamsClosed: ``closing`` was set before every stream ended.
        RequestError: as a stream raises it (the other streams are then left unread).
    """
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    closed = asyncio.ensure_future(closing.wait())
    try:
        while pending:
            done, _ = await asyncio.wait([*pending, closed],
                                         return_when=asyncio.FIRST_COMPLETED)
            for future in sorted((f for f in done if f in pending), key=pending.get):
                i = pending.pop(future)
                try:
                    item = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, item
            if closed in done and pending:
                raise StreamsClosed
    finally:
        closed.cancel()
        for future in pending:
            future.cancel()
        # Before the streams are closed: a generator cannot be closed while it runs.
        await asyncio.gather(*pending, return_exceptions=True)


class _CancellingStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends (finished, the client gone,
    the server stopping): the request is cancelled, its slot freed at the next step."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            # The events generator may be suspended mid-stream (the client went away):
            # closing it closes the merged chunk streams it holds.
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and
    this returns None (vLLM's ``with_cancellation`` does the same)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RequestError):
            await task
        return None
    return task.result()


def _echo_text(servicer, body: CompletionBody, req) -> str:
    """The prompt a completion with ``echo`` repeats: its text as sent, or a token-id
    prompt's ids decoded."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else servicer.detokenize(req.decode.prefill_tokens())


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _parse_body(raw: bytes, model: type[_Body]) -> _Body:
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
        raise _validation_error(exc.errors()) from None


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


def _validation_error(errors: list) -> ApiError:
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


class _Guard:
    """The ASGI app uvicorn runs, in front of FastAPI: the bearer token is checked before
    anything is read (401), then the body is read within `HttpLimits` (413 over
    ``max_body_bytes``, refused from ``Content-Length`` before reading; 408 past
    ``body_timeout_s``) and replayed to the app. Errors are OpenAI-shaped."""

    def __init__(self, api: OpenAIApi, app):
        self.api = api
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            # h11 bounds only headers still arriving (max_incomplete_event_size); headers
            # that arrived in one read are bounded here.
            size = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b"")) + sum(
                len(k) + len(v) + 4 for k, v in scope["headers"])
            if size > self.api.limits.max_header_bytes:
                raise ApiError(431, f"the request line and headers are over "
                                    f"{self.api.limits.max_header_bytes} bytes",
                               code="request_header_fields_too_large")
            # Before routing and body parsing: a caller without the token learns nothing
            # about the request it sent (a malformed body is 401, not 400).
            if scope["path"] != "/health":
                self.api.check_auth(headers.get("authorization", ""))
            body = await self._read_body(headers, receive)
        except ApiError as exc:
            # A refused body is left unread: the connection closes after the answer.
            await _send_error(send, exc, close=exc.status in (408, 413, 431))
            return
        if body is None:  # the client went away
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, headers: dict, receive) -> bytes | None:
        limits = self.api.limits
        too_large = ApiError(413, f"the request body is over {limits.max_body_bytes} bytes",
                             code="request_too_large")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limits.max_body_bytes:
            raise too_large
        body = bytearray()
        try:
            async with asyncio.timeout(limits.body_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    body += message.get("body", b"")
                    if len(body) > limits.max_body_bytes:
                        raise too_large
                    if not message.get("more_body", False):
                        return bytes(body)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within "
                                f"{limits.body_timeout_s:g} s", code="request_timeout") from None


async def _send_error(send, exc: ApiError, close: bool = False) -> None:
    data = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _protocol_class(limits: HttpLimits):
    """uvicorn's h11 protocol with the connection cap, the header timeout and
    OpenAI-shaped answers to malformed HTTP (uvicorn's own are plain text)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    def raw_response(status: int, reason: bytes, exc: ApiError) -> list:
        data = json.dumps(exc.body()).encode()
        return [h11.Response(status_code=status, reason=reason, headers=[
                    (b"content-type", b"application/json"), (b"connection", b"close"),
                    (b"content-length", str(len(data)).encode())]),
                h11.Data(data=data), h11.EndOfMessage()]

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                # Answered before any request: the client reads it when it sends one.
                exc = _unavailable(f"too many connections (at most {limits.max_connections})")
                for event in raw_response(503, b"Service Unavailable", exc):
                    transport.write(self.conn.send(event))
                transport.close()
                return
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s,
                                                      self._headers_late)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if (self.cycle is None or self.cycle.response_complete) and (
                    not self.transport.is_closing()):
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm_header_timer()  # a request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            exc = ApiError(400, f"invalid HTTP request: {msg}", code="bad_request")
            for event in raw_response(400, b"Bad Request", exc):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return GuardedH11Protocol


class _Server:
    """A uvicorn server on a socket bound up front (so a busy port fails at once, and port 0
    reports the port it got), run as a task on the current event loop."""

    def __init__(self, api: OpenAIApi, sock: socket.socket, tls_cert: str | None,
                 tls_key: str | None):
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the process owner (Ray, specd serve) keeps them
                return contextlib.nullcontext()

        limits = api.limits
        # uvicorn's limit_concurrency stays off: it answers plain text and counts idle
        # connections with busy ones; `max_connections` caps connections instead.
        config = uvicorn.Config(api.asgi, lifespan="off", log_level="warning",
                                access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                timeout_graceful_shutdown=1, http=_protocol_class(limits),
                                timeout_keep_alive=limits.keep_alive_s,
                                h11_max_incomplete_event_size=limits.max_header_bytes)
        self.server = Server(config)
        self.sock = sock
        self.port = sock.getsockname()[1]
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task
        self.sock.close()


async def start_http_server(api: OpenAIApi, host: str = "127.0.0.1", port: int = 0,
                            tls_cert: str | None = None, tls_key: str | None = None
                            ) -> tuple[_Server, int]:
    """Serves ``api`` on ``host:port`` (0 picks a free port), TLS when given the PEM paths.

    Returns:
        ``(server, bound port)``; stop with ``await server.stop()``.

    Raises:
        ValueError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(128)
    sock.setblocking(False)
    server = _Server(api, sock, tls_cert, tls_key)
    await server.start()
    return server, server.port


__all__ = ["ApiError", "HttpLimits", "OpenAIApi", "generation_request", "start_http_server"]
