"""The OpenAI-compatible HTTP API (``specd serve --http-port``), beside the gRPC one.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus), on FastAPI + uvicorn as vLLM and SGLang serve theirs. The
layer is a thin adapter: an OpenAI request body becomes a ``specd.v1.GenerateRequest`` and
goes through `GenerationServicer.submit` / `GenerationServicer.stream`, the very path the gRPC
API takes (validation, limits, the router, the `coordinator.errors` contract), so the same
request gives the same tokens on both APIs. It differs from OpenAI's defaults as OpenAI's
own does from gRPC's: ``temperature`` defaults to 1, chat ``max_tokens`` to the rest of the
context, completion ``max_tokens`` to 16.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 400 names the
field as the client wrote it (fields it does not support, such as ``n > 1``, ``logprobs``,
``tools``, ``response_format`` and any unknown field, are refused, never ignored), 401 a
missing or wrong ``Authorization: Bearer`` token (the gRPC API's token; ``/health`` is
exempt), 404 an unknown model or path, 503 while the service starts, drains or has no
replica that can serve, 500 an internal failure (details in the server log only). A client
that disconnects, mid-stream or while waiting for a unary answer, has its request cancelled:
its slot is freed at the next step.
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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt

from specd.v1 import generation_pb2

from .errors import RequestError, client_status

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
    model_config = ConfigDict(extra="forbid")


class SpeculationBody(_Strict):
    """The ``speculation`` extra body field (the gRPC ``SpeculationOptions``)."""

    enabled: StrictBool | None = None
    max_draft_len: StrictInt | None = None
    drafter: str | None = None


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class _Body(_Strict):
    model: str
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for abuse tracking: nothing to do with it
    # Extra body fields (vLLM's names):
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    speculation: SpeculationBody | None = None
    # Known but unsupported: refused by `_refuse_unsupported` with a message naming them.
    n: StrictInt | None = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None


class ChatMessage(_Strict):
    role: str
    content: str | list[dict] | None = None


class ChatBody(_Body):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None


class CompletionBody(_Body):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


def _refuse_unsupported(body: _Body) -> None:
    """Raises a 400 naming the first field set to something this server cannot do."""
    if body.n not in (None, 1):
        raise ApiError(400, f"n: only n=1 is supported, got {body.n}", param="n")
    checks = ["logprobs", "top_logprobs", "logit_bias", "tools", "tool_choice", "functions",
              "function_call", "parallel_tool_calls", "response_format", "echo", "suffix"]
    for name in checks:
        value = getattr(body, name, None)
        if value not in (None, False) and not (name in ("tools", "functions") and value == []):
            raise ApiError(400, f"{name}: not supported by this server", param=name)
    best_of = getattr(body, "best_of", None)
    if best_of not in (None, 1):
        raise ApiError(400, f"best_of: only best_of=1 is supported, got {best_of}",
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


def grpc_request(body: _Body) -> tuple[generation_pb2.GenerateRequest, str]:
    """The ``GenerateRequest`` an OpenAI body means, and the name of its max-tokens field.
    ``max_new_tokens`` is left 0 (= the rest of the context) for a chat request without one.

    Raises:
        ApiError: 400 naming the field.
    """
    _refuse_unsupported(body)
    req = generation_pb2.GenerateRequest(ignore_eos=body.ignore_eos)
    max_name, max_tokens = "max_tokens", body.max_tokens
    if isinstance(body, ChatBody):
        if body.max_completion_tokens is not None:
            max_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
        if not body.messages:
            raise ApiError(400, "messages: at least one message is required", param="messages")
        for i, m in enumerate(body.messages):
            req.chat.messages.add(role=m.role, content=_chat_content(i, m.content))
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
            req.token_ids.ids.extend(prompt)
        if max_tokens is None:
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    if max_tokens is not None:
        req.max_new_tokens = _int_field(max_name, max_tokens, 1, _UINT32_MAX)
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    req.sampling.temperature = temperature
    for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            setattr(req.sampling, name, value)
    if body.top_k is not None:
        # -1 is OpenAI-side tooling's (vLLM's) "off"; the gRPC API says 0.
        req.sampling.top_k = 0 if body.top_k == -1 else _int_field("top_k", body.top_k, 0,
                                                                    2**31 - 1)
    if body.seed is not None:
        req.seed = _int_field("seed", body.seed, 0, 2**64 - 1)
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    req.stop.extend(stops)
    for t in body.stop_token_ids or ():
        _int_field("stop_token_ids", t, -(2**31), 2**31 - 1)
    req.stop_token_ids.extend(body.stop_token_ids or ())
    if body.speculation is not None:
        spec = body.speculation
        if spec.enabled is not None:
            req.speculation.enabled = spec.enabled
        if spec.max_draft_len is not None:
            req.speculation.max_draft_len = _int_field("speculation.max_draft_len",
                                                       spec.max_draft_len, 0, _UINT32_MAX)
        if spec.drafter is not None:
            req.speculation.drafter = spec.drafter
    return req, max_name


#: A shared-validation message's leading field: ``sampling.top_p=...``, ``stop[2]: ...``.
_FIELD_RE = re.compile(r"^(sampling\.)?([a-z_]+(?:\.[a-z_]+)?)(?=[=:\[])")
#: gRPC request fields -> the OpenAI field they come from (others keep their name).
_GRPC_TO_OPENAI = {"chat": "messages", "text": "prompt", "token_ids": "prompt"}
_KNOWN_PARAMS = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                 "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                 "stop", "stop_token_ids", "prompt", "messages", "speculation.drafter",
                 "speculation.max_draft_len", "speculation.enabled"}


def _openai_field(message: str, max_name: str, chat: bool) -> tuple[str, str | None]:
    """(message, param) of a shared-validation message, in the OpenAI request's terms."""
    message = message.replace("max_new_tokens", max_name)
    m = _FIELD_RE.match(message)
    if m is None:
        return message, None
    name = m.group(2)
    param = _GRPC_TO_OPENAI.get(name, name)
    if name == "prompt" and chat:
        param = "messages"
    if param not in _KNOWN_PARAMS:
        return message, None
    return param + message[m.end():], param


def _request_error(exc: RequestError, max_name: str, chat: bool) -> ApiError:
    """The HTTP answer to a request that failed (`coordinator.errors.client_status`)."""
    code, message = client_status(exc)
    if code == "INVALID_ARGUMENT":
        message, param = _openai_field(message, max_name, chat)
        return ApiError(400, message, param=param)
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


def _usage(req, result) -> dict:
    prompt = req.decode.num_prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": result.tokens_generated,
            "total_tokens": prompt + result.tokens_generated}


class OpenAIApi:
    """The HTTP app's state. ``servicer`` is the running `GenerationServicer`, or None while
    the service starts (every generation call and ``/health`` answer 503 then).

    Args:
        auth_token: required as ``Authorization: Bearer`` on everything but ``/health``.
        registry: a prometheus_client registry for ``/metrics`` (None: 404).
    """

    def __init__(self, servicer=None, auth_token: str | None = None, registry=None):
        self.servicer = servicer
        self.auth_token = auth_token
        self.registry = registry
        self.app = self._build()

    def _check_auth(self, request: Request) -> None:
        if not self.auth_token:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self.auth_token.encode()):
            raise ApiError(401, "missing or invalid bearer token", code="invalid_api_key")

    def _ready(self):
        servicer = self.servicer
        if servicer is None:
            raise _unavailable("the service is starting")
        if servicer._draining:
            raise _unavailable("the service is shutting down")
        return servicer

    def _check_model(self, servicer, model: str) -> None:
        if model != servicer.model_name:
            raise ApiError(404, f"model: {model!r} is not served here; this server serves "
                                f"{servicer.model_name!r}", param="model",
                           code="model_not_found")

    def _build(self) -> FastAPI:
        app = FastAPI(title="specd", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(ApiError)
        async def api_error(_request, exc: ApiError):
            return exc.response()

        @app.middleware("http")
        async def authenticate(request: Request, call_next):
            # Before routing and body parsing: a caller without the token learns nothing
            # about the request it sent (a malformed body is 401, not 400).
            if request.url.path != "/health":
                try:
                    self._check_auth(request)
                except ApiError as exc:
                    return exc.response()
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def invalid_body(_request, exc: RequestValidationError):
            return _validation_error(exc).response()

        @app.exception_handler(404)
        async def not_found(request, _exc):
            return ApiError(404, f"no such path: {request.url.path}", code="not_found").response()

        @app.exception_handler(405)
        async def bad_method(request, _exc):
            return ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                            code="method_not_allowed").response()

        @app.get("/health")
        async def health():
            servicer = self.servicer
            if servicer is None:
                raise _unavailable("the service is starting")
            if servicer._draining:
                raise _unavailable("the service is shutting down")
            can_serve = getattr(servicer.scheduler, "can_serve", None)
            if can_serve is not None and not can_serve():
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
            servicer = self._ready()
            return {"object": "list", "data": [{
                "id": servicer.model_name, "object": "model", "created": 0,
                "owned_by": "specd", "max_model_len": servicer.max_seq_len}]}

        @app.post("/v1/chat/completions")
        async def chat(body: ChatBody, request: Request):
            return await self._generate(body, request, chat=True)

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, request: Request):
            return await self._generate(body, request, chat=False)

        return app

    async def _generate(self, body: _Body, request: Request, chat: bool):
        servicer = self._ready()
        self._check_model(servicer, body.model)
        grpc_req, max_name = grpc_request(body)
        with contextlib.ExitStack() as stack:
            stack.enter_context(servicer._tracked())
            try:
                req = await servicer.submit(grpc_req, default_max_new_tokens=chat)
            except RequestError as exc:
                raise _request_error(exc, max_name, chat) from None
            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                    "created": int(time.time()), "model": servicer.model_name}
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = self._sse(servicer, req, meta, chat, include_usage, max_name)
                tracked = stack.pop_all()  # the stream holds it until it ends
                return _CancellingStream(events, lambda: (servicer.scheduler.cancel(req),
                                                          tracked.close()))
            try:
                tokens, text, result = await _unless_disconnected(
                    request, servicer.collect(req))
            except RequestError as exc:
                raise _request_error(exc, max_name, chat) from None
            finally:
                servicer.scheduler.cancel(req)
            if result is None:  # the client went away: nobody to answer
                return Response(status_code=499)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                      if chat else {"index": 0, "text": text})
            choice.update(finish_reason=result.finish_reason, logprobs=None)
            return {**meta, "object": "chat.completion" if chat else "text_completion",
                    "choices": [choice], "usage": _usage(req, result),
                    "speculation": _speculation(result, req.drafter_failures)}

    async def _sse(self, servicer, req, meta: dict, chat: bool, include_usage: bool,
                   max_name: str) -> AsyncIterator[str]:
        """Server-sent events: ``data: {chunk}`` per text delta, the finish chunk (with the
        ``speculation`` counters), the usage chunk when asked, then ``data: [DONE]``. A
        failure after the stream started is sent as ``data: {"error": ...}``."""
        kind = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(choices: list, **fields) -> str:
            payload = {**meta, "object": kind, "choices": choices, **extra, **fields}
            return f"data: {json.dumps(payload)}\n\n"

        def choice(text: str | None, finish: str | None = None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}

        if chat:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "finish_reason": None, "logprobs": None}])
        try:
            async with contextlib.aclosing(servicer.stream(req)) as chunks:
                async for c in chunks:
                    if c.text:
                        yield chunk([choice(c.text)])
                    if c.result is not None:
                        yield chunk([choice(None, c.result.finish_reason)],
                                    speculation=_speculation(c.result, req.drafter_failures))
                        if include_usage:
                            yield chunk([], usage=_usage(req, c.result))
        except RequestError as exc:
            yield f"data: {json.dumps(_request_error(exc, max_name, chat).body())}\n\n"
        yield "data: [DONE]\n\n"


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


async def _unless_disconnected(request: Request, work):
    """``await work``, unless the client disconnects first: then ``work`` is cancelled and
    this returns ``(None, None, None)`` (vLLM's ``with_cancellation`` does the same)."""
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
        return None, None, None
    return task.result()


def _validation_error(exc: RequestValidationError) -> ApiError:
    """A 400 naming the first invalid field of the body (pydantic's location)."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # Drop pydantic's union-member tags ("str", "list[int]") from the location.
    loc = [p for p in loc if not re.match(r"^(str|int|list|dict|function-after)\b", p)]
    param = ".".join(p if not p.isdigit() else f"[{p}]" for p in loc).replace(".[", "[")
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: unrecognized request argument", param=param)
    if err.get("type") == "missing":
        return ApiError(400, f"{param}: required", param=param)
    if err.get("type") == "json_invalid" or not param:
        return ApiError(400, f"invalid JSON body: {err.get('msg', '')}")
    return ApiError(400, f"{param}: {err.get('msg', 'invalid value')}", param=param)


class _Server:
    """A uvicorn server on a socket bound up front (so a busy port fails at once, and port 0
    reports the port it got), run as a task on the current event loop."""

    def __init__(self, api: OpenAIApi, sock: socket.socket, tls_cert: str | None,
                 tls_key: str | None):
        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the process owner (Ray, specd serve) keeps them
                return contextlib.nullcontext()

        config = uvicorn.Config(api.app, lifespan="off", log_level="warning",
                                access_log=False, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
                                timeout_graceful_shutdown=1)
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


__all__ = ["ApiError", "OpenAIApi", "grpc_request", "start_http_server"]
