"""The OpenAI-compatible HTTP API (``specd serve --http-port``), beside the gRPC one.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` and ``GET /metrics`` (Prometheus), on FastAPI +
uvicorn as vLLM and SGLang serve theirs. The layer is a thin adapter: an OpenAI request body
becomes a `coordinator.front.gateway.GenerationRequest` (`generation_request`) and goes through
`Gateway.submit_choices` / `Gateway.stream`, the very path the gRPC API takes (validation,
limits, the router, the `coordinator.step.errors` contract), so the same request gives the same
tokens on both APIs; a `RequestInvalid` 's field is named as the OpenAI parameter it came
from. It differs from gRPC's defaults as OpenAI's own API does: ``temperature`` defaults to
1, chat ``max_tokens`` to the rest of the context, completion ``max_tokens`` to 16, and the
text ends before a stop string (``include_stop_str_in_output: true`` keeps it, as gRPC does).
Log probabilities (chat ``logprobs``/``top_logprobs``, completions ``logprobs``/``echo``) are
the target's raw log-softmax (`specd_core.logprobs`), in OpenAI's shapes, streamed too.
Tool calls (``tools``; ``tool_choice`` ``"auto"`` by default) come back as ``tool_calls``,
parsed from the model's own format (`coordinator.front.tool_calls`), streamed as argument deltas.

Errors are OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``, for every
status, malformed HTTP and bodies included: 400 names the field as the client wrote it
(fields it does not support, such as ``logit_bias``, ``functions`` and any unknown field,
are refused, never ignored), 401 a missing or wrong ``Authorization: Bearer``
token (the gRPC API's token; ``/health`` is exempt; checked before the body is read), 404 an
unknown model or path, 408/413/431 a body too slow or too large or headers too large
(`HttpLimits`), 503 while the service starts, drains or has no replica that can serve, 500
an internal failure (details in the server log only). A stream cut after it started ends
with an error event and ``data: [DONE]``. A client that disconnects, mid-stream or while
waiting for a unary answer, has its requests cancelled: their slots are freed at the next
step.

This module is the app (`OpenAIApi`: routes, answers, server-sent events); request bodies and
errors are `coordinator.front.openai_request`, log probabilities
`coordinator.front.openai_logprobs`, and the server with its limits `coordinator.front.http_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse

from specd_core.request import SpeculativeDecodeResult

from ..step.errors import RequestError
from .gateway import speculation_counters
from .http_server import Guard, HttpLimits
from .openai_errors import ApiError, unavailable
from .openai_logprobs import chat_logprobs, completion_logprobs
from .openai_request import (
    Body,
    ChatBody,
    CompletionBody,
    generation_request,
    parse_body,
    request_error,
    validation_error,
)
from .openai_structured import ToolCalls, constraint_of
from .tenants import ANONYMOUS, TENANT_SCOPE_KEY, Tenant, Tenants
from .tool_calls import ChatTools, openai_calls, stream_delta

log = logging.getLogger(__name__)


def _combined(results: list[SpeculativeDecodeResult]) -> SpeculativeDecodeResult:
    """Several choices' counters summed (a request with ``n`` > 1)."""
    total = SpeculativeDecodeResult()
    for r in results:
        total.forward_calls += r.forward_calls
        total.tokens_generated += r.tokens_generated
        total.verification_steps += r.verification_steps
        total.drafted_tokens += r.drafted_tokens
        total.accepted_tokens += r.accepted_tokens
        total.forced_tokens += r.forced_tokens
        total.grammar_rejected_tokens += r.grammar_rejected_tokens
        for name in ("evaluated_at_position", "accepted_at_position"):
            mine, theirs = getattr(total, name), getattr(r, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for pos, count in enumerate(theirs):
                mine[pos] += count
    return total


def _usage(reqs: list, results: list) -> dict:
    """OpenAI's usage: the prompt counted once, the completion tokens of every choice, and
    ``prompt_tokens_details.cached_tokens``: the prompt tokens the first choice reused from
    a warm prefix (vLLM's field)."""
    prompt = reqs[0].decode.num_prompt_tokens
    completion = sum(r.tokens_generated for r in results if r is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": reqs[0].cached_tokens}}


#: Bodies larger than this many bytes are parsed (JSON, then the request's fields and
#: constraint) in a worker thread: a multi-megabyte schema takes ~0.5 s to parse, which on
#: the event loop would stall every other stream's chunks.
BIG_BODY_BYTES = 64 * 1024


async def _off_loop(size: int, fn, *args):
    """``fn(*args)``: inline for a small body, in a worker thread for a big one."""
    if size > BIG_BODY_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _tool_calls(body) -> ToolCalls | None:
    """How a chat body's forced tool call is answered (its constraint was read and checked
    by `generation_request` already; without tools there is none, and the other
    constraints, a GBNF grammar's conversion, are not read again on the event loop)."""
    return constraint_of(body)[1] if getattr(body, "tools", None) else None


@dataclass(frozen=True)
class _Shape:
    """How a request's choices are answered beyond their text: ``chat`` or completions,
    whether they carry ``logprobs``, the echoed prompt (completions ``echo``: its text,
    or None), and a forced tool call's shape (`ToolCalls`; None: text)."""

    chat: bool
    logprobs: bool
    echo: str | None
    tools: ToolCalls | None = None
    #: ``tool_choice: "auto"``: calls parsed out of the model's own format
    #: (`coordinator.front.tool_calls.ChatTools`), or None.
    auto_tools: ChatTools | None = None
    #: The text the output continues (``continue_final_message``), read before it.
    tool_prefix: str = ""


def _tool_finish(finish: str | None) -> str | None:
    """A tool call's finish reason: ``tool_calls`` when the arguments are complete."""
    return "tool_calls" if finish == "stop" else finish


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class StreamsClosed(Exception):
    """The service is stopping: open streams end (`OpenAIApi.close_streams`)."""


class OpenAIApi:
    """The HTTP app's state. ``servicer`` is the running `coordinator.front.gateway.Gateway` (the
    service's `GenerationServicer`, so that a drain covers both APIs), or None while the
    service starts (every generation call and ``/health`` answer 503 then).

    Args:
        auth_token: the tenants' token table (`coordinator.front.tenants.Tenants`) or a single
            token, one of which is required as ``Authorization: Bearer`` on everything but
            ``/health``; ``/metrics`` needs an admin's. None: open, one anonymous tenant.
        registry: a prometheus_client registry for ``/metrics`` (None: 404).
        limits: connection, header and body limits (`HttpLimits`).
    """

    def __init__(self, servicer=None, auth_token: str | Tenants | None = None, registry=None,
                 limits: HttpLimits | None = None):
        self.servicer = servicer
        if isinstance(auth_token, str):
            auth_token = Tenants((auth_token,)) if auth_token else None
        self.tenants: Tenants | None = (
            auth_token if auth_token is not None and auth_token.enabled else None)
        self.registry = registry
        self.limits = limits or HttpLimits()
        #: ``created`` of the model card: when this API started, Unix seconds.
        self.created = int(time.time())
        self._closing = asyncio.Event()
        self._open_streams = 0
        self._no_streams = asyncio.Event()
        self._no_streams.set()
        self.app = self._build()
        #: The ASGI app to serve: the token and body limits before `app` (`Guard`).
        self.asgi = Guard(self, self.app)

    def check_auth(self, authorization: str) -> Tenant:
        """The tenant ``authorization`` (``Bearer <token>``) names: `ANONYMOUS` on a server
        without tokens.

        Raises:
            ApiError: 401 for a missing or unknown token.
        """
        if self.tenants is None:
            return ANONYMOUS
        tenant = self.tenants.from_authorization(authorization)
        if tenant is None:
            raise ApiError(401, "missing or invalid bearer token: send the server's token as "
                                "'Authorization: Bearer <token>'", code="invalid_api_key")
        return tenant

    def _ready(self):
        servicer = self.servicer
        if servicer is None:
            raise unavailable("the service is starting")
        if servicer.draining:
            raise unavailable("the service is shutting down")
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
            return validation_error(exc.errors()).response()

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
                raise unavailable("the service is starting")
            if servicer.draining:
                raise unavailable("the service is shutting down")
            if not servicer.can_serve():
                raise unavailable("no target replica can serve now")
            return {"status": "ok"}

        @app.get("/metrics")
        async def metrics(request: Request):
            if not _tenant(request).admin:
                raise ApiError(403, "/metrics needs an admin token (the server's "
                                    "--admin-token, or a tokens-file line marked admin)",
                               "permission_error",
                               code="permission_denied")
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
            raw = await request.body()
            body = await _off_loop(len(raw), parse_body, raw, ChatBody)
            return await self._generate(body, request, chat=True, size=len(raw))

        @app.post("/v1/completions")
        async def completions(request: Request):
            raw = await request.body()
            body = await _off_loop(len(raw), parse_body, raw, CompletionBody)
            return await self._generate(body, request, chat=False, size=len(raw))

        return app

    async def _generate(self, body: Body, request: Request, chat: bool, size: int = 0):
        servicer = self._ready()
        self._check_model(servicer, body.model)
        gen, max_name = await _off_loop(size, generation_request, body)
        trim = gen.trimmed_stops()
        with contextlib.ExitStack() as stack:
            stack.enter_context(servicer.tracked())
            try:
                reqs = await servicer.submit_choices(
                    gen, body.n or 1, default_max_new_tokens=chat,
                    tenant=_tenant(request).name, cache_salt=body.cache_salt)
            except RequestError as exc:
                raise request_error(exc, max_name, chat) from None

            def cancel_all() -> None:
                for req in reqs:
                    servicer.cancel(req)

            meta = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                    "created": int(time.time()), "model": servicer.model_name}
            shape = _Shape(chat, bool(body.logprobs) if chat else body.logprobs is not None,
                           None if chat or not body.echo else _echo_text(servicer, body,
                                                                          reqs[0]),
                           _tool_calls(body) if chat else None,
                           servicer.tools if gen.tool_choice == "auto" else None,
                           gen.chat[-1]["content"] if gen.continue_final_message else "")
            if body.stream:
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = self._sse(servicer, reqs, trim, meta, shape, include_usage, max_name)
                tracked = stack.pop_all()  # the stream holds it until it ends
                return _CancellingStream(events, lambda: (cancel_all(), tracked.close()))
            try:
                outs = await _unless_disconnected(request, _collect_all(servicer, reqs, trim))
            except RequestError as exc:
                raise request_error(exc, max_name, chat) from None
            finally:
                cancel_all()
            if outs is None:  # the client went away: nobody to answer
                return Response(status_code=499)
            choices = []
            for i, (tokens, text, result) in enumerate(outs):
                decode, logprobs = reqs[i].decode, None
                finish = result.finish_reason
                if chat:
                    choice = {"index": i, "message": {"role": "assistant", "content": text}}
                    calls = None if shape.tools is None else shape.tools.calls(text)
                    if calls is not None:
                        choice["message"] = {"role": "assistant", "content": None,
                                             "tool_calls": calls}
                        finish = _tool_finish(finish)
                    elif shape.auto_tools is not None:
                        # (a special-token trigger is in the text: `ChatTools.text_tokenizer`)
                        content, found = shape.auto_tools.parser(shape.tool_prefix).result(text)
                        if found is not None:
                            choice["message"] = {"role": "assistant", "content": content,
                                                 "tool_calls": openai_calls(found)}
                            finish = _tool_finish(finish)
                    if shape.logprobs:
                        logprobs = chat_logprobs(servicer.tokenizer, decode.token_logprobs)
                else:
                    if shape.echo is not None:
                        text = shape.echo + text
                    choice = {"index": i, "text": text}
                    if shape.logprobs:
                        ids, records = tokens, decode.token_logprobs
                        if shape.echo is not None:
                            ids = decode.prefill_tokens() + ids
                            records = decode.prompt_logprobs + records
                        logprobs = completion_logprobs(servicer.tokenizer, ids, records, 0)[0]
                choice.update(finish_reason=finish, logprobs=logprobs)
                choices.append(choice)
            results = [out[2] for out in outs]
            return {**meta, "object": "chat.completion" if chat else "text_completion",
                    "choices": choices, "usage": _usage(reqs, results),
                    "speculation": speculation_counters(
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

        tools = shape.tools
        # A forced tool call: the arguments stream as tool_calls deltas (a named function),
        # or, choosing among several, arrive whole once the call is complete.
        held = [""] * len(reqs)
        call_ids = [None if tools is None else tools.call_id() for _ in reqs]

        def tool_delta(i: int, text: str, first: bool) -> dict:
            call = {"index": 0, "function": {"arguments": text}}
            if first:
                call = {"index": 0, "id": call_ids[i], "type": "function",
                        "function": {"name": tools.name, "arguments": text}}
            return {"tool_calls": [call]}

        auto = shape.auto_tools
        # tool_choice "auto": each choice's output read into content and tool calls as it
        # grows (a possible trigger's start held back until it is known).
        parsers = [None if auto is None else auto.parser(shape.tool_prefix) for _ in reqs]
        seen = [""] * len(reqs)
        auto_ids: list[list[str]] = [[] for _ in reqs]

        def auto_delta(i: int, text: str | None, final: bool) -> dict:
            seen[i] += text or ""
            return stream_delta(parsers[i].feed(seen[i], final), auto_ids[i])

        def choice(i: int, text: str | None, finish: str | None = None,
                   logprobs: dict | None = None) -> dict:
            if chat and auto is not None:
                delta = auto_delta(i, text, finish is not None)
                if finish is not None and parsers[i].calls and all(
                        c.complete for c in parsers[i].calls):
                    finish = _tool_finish(finish)
                return {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": logprobs}
            if chat:
                delta = {} if text is None else {"content": text}
                if tools is not None and text is not None:
                    if tools.name is not None:
                        delta = tool_delta(i, text, False)
                    else:
                        held[i] += text
                        delta = {}
                if tools is not None and finish is not None:
                    if tools.name is None:
                        calls = tools.calls(held[i])
                        delta = ({"tool_calls": [{"index": 0, **calls[0]}]} if calls
                                 else {"content": held[i]})
                        if calls:
                            finish = _tool_finish(finish)
                    else:
                        finish = _tool_finish(finish)
                return {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": logprobs}
            return {"index": i, "text": text or "", "finish_reason": finish,
                    "logprobs": logprobs}

        def choice_logprobs(i: int, ids: list[int], records: list) -> dict:
            logprobs, offsets[i] = completion_logprobs(servicer.tokenizer, ids, records,
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
                    logprobs = choice_logprobs(i, reqs[i].decode.prefill_tokens(),
                                                   c.prompt_logprobs)
                out.append(chunk([choice(i, shape.echo, logprobs=logprobs)]))
            logprobs = None
            if shape.logprobs and c.logprobs:
                logprobs = (chat_logprobs(servicer.tokenizer, c.logprobs) if chat else
                            choice_logprobs(i, c.token_ids, c.logprobs))
            if c.text or logprobs is not None:
                piece = choice(i, c.text, logprobs=logprobs)
                if piece.get("delta", True) or logprobs is not None:  # not a held-back piece
                    out.append(chunk([piece]))
            return out

        self._open_streams += 1
        self._no_streams.clear()
        try:
            if chat:
                for i in range(len(reqs)):
                    first = {"role": "assistant", "content": ""}
                    if tools is not None and tools.name is not None:
                        first = {"role": "assistant", "content": None,
                                 **tool_delta(i, "", True)}
                    yield chunk([{"index": i, "delta": first,
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
                                        speculation=speculation_counters(c.result,
                                                                 reqs[i].drafter_failures))
                if include_usage:
                    yield chunk([], usage=_usage(reqs, results))
            except RequestError as exc:
                yield _event(request_error(exc, max_name, chat).body())
            except StreamsClosed:
                yield _event(unavailable("the service is shutting down: this stream was "
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


def _tenant(request: Request) -> Tenant:
    """The caller's tenant, as `coordinator.front.http_server.Guard` found it."""
    return request.scope.get(TENANT_SCOPE_KEY, ANONYMOUS)


def _echo_text(servicer, body: CompletionBody, req) -> str:
    """The prompt a completion with ``echo`` repeats: its text as sent, or a token-id
    prompt's ids decoded."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else servicer.detokenize(req.decode.prefill_tokens())


__all__ = ["OpenAIApi", "StreamsClosed"]
