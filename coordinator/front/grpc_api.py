"""The gRPC ``specd.v1.Generation`` front end (grpc.aio) over a `coordinator.front.gateway.Gateway`.

The servicer is the gateway (admission, limits, tokenizing, streaming) plus the RPCs: it
converts ``GenerateRequest`` messages to `GenerationRequest` s and results to messages. Bad
input is refused with ``INVALID_ARGUMENT`` and a message naming the field (its path in the
request message); the server keeps serving others. Bytes that are not a valid request message
are ``INVALID_ARGUMENT`` too (each handler parses its own request, see `generation_handlers`).
A prompt over the size cap (``max_prompt_bytes``) is refused before it is tokenized, and
reading the message, tokenizing and chat rendering run in a worker thread, so a big prompt
never stalls the event loop (every stream's steps). A client that cancels (or whose deadline
passes) stops its request at the next step boundary and frees its KV slot. Optional TLS and a
bearer token checked by a server interceptor (the health service is exempt so probes work
without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_worker.server import CredentialInterceptor, refusing_handler
from drafter_worker.sessions import DRAFTER_STATS
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.grammar import GrammarError, GrammarSpec
from specd_core.logprobs import TokenLogprob
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from specd_core.sampling import SamplingParams

from ..step.errors import RequestError, RequestInvalid, client_status, literal
from ..step.requests import ServiceRequest
from .gateway import Gateway, speculation_counters
from .generation_request import SAMPLING_FLOATS, GenerationRequest, sampling_params
from .tenants import ANONYMOUS, Tenant, Tenants
from .tool_calls import call_id, openai_calls, tools_request

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """`SamplingParams` from the proto, unset fields taking their defaults
    (`coordinator.front.gateway.sampling_params`: the float32 values as the client wrote them).

    Raises:
        RequestInvalid: naming the out-of-range field (``sampling.<name>``).
    """
    values: dict[str, float | int] = {f: getattr(msg, f) for f in SAMPLING_FLOATS
                                      if msg.HasField(f)}
    if msg.HasField("top_k"):
        values["top_k"] = msg.top_k
    return sampling_params(values)


def generation_request(msg: generation_pb2.GenerateRequest) -> GenerationRequest:
    """The `GenerationRequest` a ``GenerateRequest`` message means (its field paths are the
    gateway's field names). Reads every string of the message: call it off the event loop
    for a big one."""
    kind = msg.WhichOneof("prompt")
    spec = msg.speculation
    request = GenerationRequest(
        text=msg.text if kind == "text" else None,
        chat=[_chat_message(m) for m in msg.chat.messages] if kind == "chat" else None,
        token_ids=msg.token_ids.ids if kind == "token_ids" else None,  # not copied
        max_new_tokens=msg.max_new_tokens,
        sampling={f: getattr(msg.sampling, f) for f in (*SAMPLING_FLOATS, "top_k")
                  if msg.sampling.HasField(f)},
        seed=msg.seed if msg.HasField("seed") else None,
        stop=tuple(msg.stop),
        stop_token_ids=msg.stop_token_ids,
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=(msg.include_stop_str_in_output
                                    if msg.HasField("include_stop_str_in_output") else None),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        speculate=spec.enabled if spec.HasField("enabled") else None,
        max_draft_len=spec.max_draft_len if spec.HasField("max_draft_len") else None,
        drafter=spec.drafter,
        constraint=constraint_from_proto(msg) if msg.HasField("constraint") else None,
    )
    if kind == "chat":
        chat = msg.chat
        if chat.HasField("add_generation_prompt"):
            request.add_generation_prompt = chat.add_generation_prompt
        request.continue_final_message = chat.continue_final_message
        if request.continue_final_message and request.add_generation_prompt:
            raise RequestInvalid("{field}: needs add_generation_prompt false",
                                 "chat.continue_final_message")
    if msg.HasField("tools") and msg.tools.json:
        _tools_into(request, msg)
    return request


def _tools_into(request: GenerationRequest, msg: generation_pb2.GenerateRequest) -> None:
    """Sets ``request`` 's tools (`coordinator.front.tool_calls.tools_request`) from ``msg``.

    Raises:
        RequestInvalid: naming ``tools`` (or ``constraint`` beside a forced call).
    """
    t = msg.tools
    if msg.WhichOneof("prompt") != "chat":
        raise RequestInvalid("{field}: only with a chat prompt", "tools")
    try:
        tools, choice, spec, _ = tools_request(
            t.json, t.choice, t.parallel_calls if t.HasField("parallel_calls") else None)
    except ValueError as exc:
        raise RequestInvalid("{field}: " + literal(str(exc).split(": ", 1)[-1]),
                             "tools") from None
    if choice == "none":
        return
    request.tools = list(tools)
    if spec is not None:
        if request.constraint is not None:
            raise RequestInvalid("{field}: only one constraint per request (constraint and "
                                 "a forced tool call were set)", "tools")
        request.constraint = spec
    elif choice == "auto":
        request.tool_choice = "auto"
        request.parallel_tool_calls = not (t.HasField("parallel_calls")
                                           and not t.parallel_calls)


def _auto_parser(servicer: Gateway, msg: generation_pb2.GenerateRequest):
    """A `specd_core.tool_calls.ToolCallParser` for a request whose tools are "auto" (the
    text a continued final message holds read first), else None."""
    if (not msg.HasField("tools") or not msg.tools.json
            or msg.tools.choice not in ("", "auto") or msg.WhichOneof("prompt") != "chat"):
        return None
    chat = msg.chat
    prefix = (chat.messages[-1].content if chat.continue_final_message and chat.messages
              else "")
    return servicer.tools.parser(prefix)


def _call_deltas(events: Sequence[tuple], ids: list[str]) -> list:
    """``ToolCallDelta`` s of parser events (content left to the chunk's text); ``ids``:
    the calls' ids so far (grown here)."""
    out = []
    for event in events:
        if event[0] == "call":
            ids.append(call_id())
            out.append(generation_pb2.ToolCallDelta(index=event[1], id=ids[event[1]],
                                                    name=event[2]))
        elif event[0] == "arguments":
            out.append(generation_pb2.ToolCallDelta(index=event[1], arguments=event[2]))
    return out


def tool_result_fields(servicer: Gateway, msg: generation_pb2.GenerateRequest, text: str,
                       finish: str, parser=None, ids: Sequence[str] = ()) -> dict:
    """The ``tool_calls``, ``content`` and finish reason of a finished output of a request
    with tools (calls parsed from the model's own format for "auto", or the forced call);
    {} for one without tools or without a completed call. ``parser`` and ``ids``: a stream's
    (the calls keep the ids their deltas had)."""
    if not msg.HasField("tools") or not msg.tools.json or msg.tools.choice == "none":
        return {}
    try:
        _, choice, _, forced = tools_request(msg.tools.json, msg.tools.choice, None)
    except ValueError:
        return {}
    if forced is not None:
        calls = forced.calls(text)
        content = None
    else:
        parser = parser or _auto_parser(servicer, msg)
        content, found = parser.result(text)
        calls = None if found is None else openai_calls(found)
        for call, given in zip(calls or (), ids, strict=False):
            call["id"] = given
    if not calls:
        return {}
    fields = {"tool_calls": [generation_pb2.ToolCall(
        id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
        for c in calls]}
    if content is not None:
        fields["content"] = content
    if finish == "stop":
        fields["finish_reason"] = "tool_calls"
    return fields


def constraint_from_proto(msg: generation_pb2.GenerateRequest) -> GrammarSpec | None:
    """The `GrammarSpec` of a request's ``constraint`` (None when its kind is unset).

    Raises:
        RequestInvalid: naming ``constraint`` (a schema that is not JSON, an empty field).
    """
    c = msg.constraint
    kind = c.WhichOneof("kind")
    separators = (",", ":") if c.compact_json else None
    try:
        if kind is None:
            return None
        if kind == "json_schema":
            try:
                schema = json.loads(c.json_schema)
            except ValueError as exc:
                raise GrammarError(f"json_schema is not JSON: {exc}") from None
            return GrammarSpec("json_schema", schema, separators=separators,
                               field="constraint")
        if kind == "json_object":
            return GrammarSpec("json_object", separators=separators, field="constraint")
        if kind == "choice":
            return GrammarSpec("choice", list(c.choice.choices), field="constraint")
        if kind == "grammar" and "::=" in c.grammar:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return GrammarSpec("lark", gbnf_to_lark(c.grammar), field="constraint")
        return GrammarSpec("lark" if kind == "grammar" else "regex", getattr(c, kind),
                           field="constraint")
    except Exception as exc:  # GrammarError, or the EBNF converter's own errors
        why = str(exc).removeprefix("constraint: ")
        raise RequestInvalid("{field}: " + literal(why), "constraint") from exc


def _final_fields(req: ServiceRequest, result: SpeculativeDecodeResult) -> dict:
    """The finish reason, usage and speculation counters both RPC shapes end with."""
    return {
        "finish_reason": result.finish_reason,
        "usage": generation_pb2.Usage(prompt_tokens=req.decode.num_prompt_tokens,
                                      completion_tokens=result.tokens_generated,
                                      cached_tokens=req.cached_tokens),
        "speculation": generation_pb2.SpeculationStats(
            **speculation_counters(result, req.drafter_failures)),
    }


def logprob_protos(records: Sequence[TokenLogprob | None]
                   ) -> list[generation_pb2.TokenLogprob]:
    """``TokenLogprob`` messages of ``records`` (None entries, the first prompt token's,
    skipped)."""
    return [generation_pb2.TokenLogprob(
                token_id=r.token, logprob=r.logprob,
                top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in r.top])
            for r in records if r is not None]


def trimmed_stops(request: generation_pb2.GenerateRequest) -> tuple[str, ...]:
    """The stop strings to cut the text before: the request's when it set
    ``include_stop_str_in_output`` false, else none (the gRPC API's default keeps them)."""
    if request.HasField("include_stop_str_in_output") and not request.include_stop_str_in_output:
        return tuple(request.stop)
    return ()


class GenerationServicer(Gateway, generation_pb2_grpc.GenerationServicer):
    """``specd.v1.Generation`` over a scheduler: a `Gateway` (same arguments) with the RPCs.

    Its `parse` (so `submit` and `submit_choices` too) also takes a ``GenerateRequest``
    message, converted (`generation_request`) in the worker thread that tokenizes.
    Status reports a `coordinator.cluster.router.Router` 's replicas and drafters, and Scale works
    with one.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scale_tasks: set[asyncio.Task] = set()
        #: The server's health service (set by `start_generation_server`), for `drain`.
        self.health = None
        #: The token table (set by `start_generation_server`; None: no tokens, one
        #: anonymous tenant).
        self.tenants: Tenants | None = None

    def parse(self, request: generation_pb2.GenerateRequest | GenerationRequest,
              default_max_new_tokens: bool = False,
              ) -> tuple[list[int], SpeculativeOptions, bool, int | None]:
        """`Gateway.parse`, of a ``GenerateRequest`` message too."""
        if isinstance(request, generation_pb2.GenerateRequest):
            request = generation_request(request)
        return super().parse(request, default_max_new_tokens)

    async def on_drain(self) -> None:
        """Health reports ``NOT_SERVING`` from now on; new Generate calls get ``UNAVAILABLE``
        from the handler itself. (Stopping the gRPC server at once instead ends calls that
        have arrived but not reached a handler with ``CANCELLED``, grpc/grpc#41785.)"""
        if self.health is not None:
            await self.health.enter_graceful_shutdown()

    async def _submit(self, request, context) -> ServiceRequest:
        salt = request.cache_salt if request.HasField("cache_salt") else None
        try:
            return await self.submit(request, tenant=tenant_of(self.tenants, context).name,
                                     cache_salt=salt)
        except RequestError as exc:
            await _abort_failed(context, exc)
            raise

    # ---- RPCs ----

    async def Generate(self, request, context):
        with self.tracked():
            req = await self._submit(request, context)
            seen: list[str] = []
            parser, ids = _auto_parser(self, request), []
            try:
                async with contextlib.aclosing(
                        self.stream(req, trimmed_stops(request))) as chunks:
                    async for chunk in chunks:
                        seen.append(chunk.text)
                        lp = {"logprobs": logprob_protos(chunk.logprobs or ()),
                              "prompt_logprobs": logprob_protos(chunk.prompt_logprobs or ())}
                        if parser is not None:
                            lp["tool_call_deltas"] = _call_deltas(
                                parser.feed("".join(seen), chunk.result is not None), ids)
                        if chunk.result is None:
                            yield generation_pb2.GenerateResponse(token_ids=chunk.token_ids,
                                                                  text=chunk.text, **lp)
                        else:
                            final = _final_fields(req, chunk.result)
                            final.update(tool_result_fields(self, request, "".join(seen),
                                                            chunk.result.finish_reason,
                                                            parser, ids))
                            yield generation_pb2.GenerateResponse(text=chunk.text, **final,
                                                                  **lp)
            except RequestError as exc:
                await _abort_failed(context, exc)

    async def GenerateUnary(self, request, context):
        with self.tracked():
            req = await self._submit(request, context)
            try:
                tokens, text, result = await self.collect(req, trimmed_stops(request))
            except RequestError as exc:
                await _abort_failed(context, exc)
            final = _final_fields(req, result)
            final.update(tool_result_fields(self, request, text, result.finish_reason))
            return generation_pb2.GenerateResult(
                text=text, token_ids=tokens, **final,
                logprobs=logprob_protos(req.decode.token_logprobs),
                prompt_logprobs=logprob_protos(req.decode.prompt_logprobs))

    async def Status(self, request, context):
        refresh = getattr(self.scheduler, "refresh", None)  # a Router: replicas' own stats
        if refresh is not None:
            await refresh()
        s = self.scheduler.status()
        return generation_pb2.StatusResponse(
            active_requests=s["active_requests"], waiting_requests=s["waiting_requests"],
            used_slots=s["used_slots"], total_slots=s["total_slots"], steps=s["steps"],
            tokens_generated=s["tokens_generated"], drafter_failures=s["drafter_failures"],
            model=self.model_name, drafter=self.drafter_name, forward_calls=s["forward_calls"],
            failed=s.get("failed", 0),
            replicas=[_replica_proto(r) for r in s.get("replicas", ())],
            drafters=[_drafter_proto(d) for d in s.get("drafters", ())],
            tenants=[generation_pb2.TenantStatus(name=name, **counts)
                     for name, counts in sorted(self.tenant_stats.items())],
        )

    async def Scale(self, request, context):
        """Admin: scales replicas and drafters (`coordinator.cluster.router.Router.scale`). The work
        runs to completion even if the caller goes away (a half-done scale helps no one)."""
        scale = getattr(self.scheduler, "scale", None)
        if scale is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server cannot scale")
        task = asyncio.ensure_future(scale(
            target_replicas=(request.target_replicas if request.HasField("target_replicas")
                             else None),
            drafters=request.drafters if request.HasField("drafters") else None))
        self._scale_tasks.add(task)
        task.add_done_callback(self._scale_tasks.discard)
        try:
            result = await asyncio.shield(task)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RuntimeError as exc:
            log.error("scaling failed: %s", exc)  # may name pids, actor ids, addresses
            await context.abort(grpc.StatusCode.INTERNAL,
                                "scaling failed: a new worker did not start (the server log "
                                "has the details)")
        return generation_pb2.ScaleResponse(**result)



def _chat_message(m: generation_pb2.ChatMessage) -> dict:
    """A chat message as the chat template gets it: ``name`` only when set (templates that
    do not use it ignore the key); an assistant turn's ``tool_calls`` and a tool turn's
    ``tool_call_id`` as the HTTP API takes them."""
    message = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    if m.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments or "{}"}} for c in m.tool_calls]
    if m.tool_call_id:
        message["tool_call_id"] = m.tool_call_id
    return message


async def _abort_failed(context, exc: BaseException) -> None:
    """Ends an RPC whose request failed with the status and client-safe message
    `coordinator.step.errors.client_status` gives (internals stay in the server log)."""
    code, message = client_status(exc)
    if code == "INTERNAL":
        log.error("request failed: %r", exc)
    await context.abort(grpc.StatusCode[code], message)


def _replica_proto(r: dict) -> generation_pb2.ReplicaStatus:
    fields = generation_pb2.ReplicaStatus.DESCRIPTOR.fields_by_name
    r = {**r, "schedule_costs": [generation_pb2.ScheduleCost(**c)
                                 for c in r.get("schedule_costs", ())]}
    return generation_pb2.ReplicaStatus(**{k: v for k, v in r.items() if k in fields})


def _drafter_proto(d: dict) -> generation_pb2.DrafterStatus:
    return generation_pb2.DrafterStatus(
        name=d["name"], address=d["address"], state=d["state"], calls=d["calls"],
        errors=d["errors"], mean_latency_seconds=d["mean_latency_s"],
        assigned_requests=d["assigned_requests"], in_flight=d["in_flight"],
        restarts=d.get("restarts", 0), node=d.get("node", ""),
        has_cache=d.get("has_cache", False),
        **{key: d.get(key, 0) for key in DRAFTER_STATS})


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata naming a tenant's token
    (`coordinator.front.tenants.Tenants`) on every RPC except health checks (``UNAUTHENTICATED``
    otherwise), and an admin's token on `ADMIN_METHODS` (``PERMISSION_DENIED`` otherwise).
    The handler finds the caller's tenant with `tenant_of`.

    Args:
        tenants: the token table, or a single token (a one-tenant server, its admin).

    Raises:
        ValueError: an empty token.
    """

    EXEMPT = CredentialInterceptor.EXEMPT
    EMPTY = "auth token must be non-empty"
    REFUSAL = "missing or invalid bearer token"
    #: RPCs that show every tenant's activity or change the service: admin only.
    ADMIN_METHODS = tuple(f"/{GENERATION_SERVICE}/{m}" for m in ("Status", "Scale"))
    FORBIDDEN = ("{method} needs an admin token (the server's --admin-token, or a tokens-file "
                 "line marked admin; specd status/scale send $SPECD_ADMIN_TOKEN)")

    def __init__(self, tenants: Tenants | str):
        if isinstance(tenants, str):
            if not tenants:
                raise ValueError(self.EMPTY)
            tenants = Tenants((tenants,))
        self.tenants = tenants

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if method.startswith(self.EXEMPT):
            return await continuation(handler_call_details)
        tenant = self.tenants.from_authorization(
            _authorization(handler_call_details.invocation_metadata or ()))
        if tenant is None:
            return refusing_handler(await continuation(handler_call_details), self.REFUSAL)
        if method in self.ADMIN_METHODS and not tenant.admin:
            return refusing_handler(await continuation(handler_call_details),
                                    self.FORBIDDEN.format(method=method.rsplit("/", 1)[1]),
                                    grpc.StatusCode.PERMISSION_DENIED)
        return await continuation(handler_call_details)


def _authorization(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    value = dict(metadata).get("authorization", "")
    return value if isinstance(value, str) else ""


def tenant_of(tenants: Tenants | None, context) -> Tenant:
    """The tenant of the RPC ``context`` belongs to: `ANONYMOUS` on a server without tokens
    (the interceptor has already refused a call without a valid one)."""
    if tenants is None or not tenants.enabled:
        return ANONYMOUS
    found = tenants.from_authorization(_authorization(context.invocation_metadata() or ()))
    if found is None:  # pragma: no cover - the interceptor refused it
        raise PermissionError("no tenant")
    return found


def generation_handlers(servicer: generation_pb2_grpc.GenerationServicer
                        ) -> dict[str, grpc.RpcMethodHandler]:
    """The ``specd.v1.Generation`` method handlers (as ``add_GenerationServicer_to_server``
    builds them) except that each parses its own request bytes: bytes that are not a valid
    message get ``INVALID_ARGUMENT`` naming the message type. (grpc.aio answers a failing
    ``request_deserializer`` with ``UNKNOWN`` and an exception class name.)"""
    handlers = {}
    for method in generation_pb2.DESCRIPTOR.services_by_name["Generation"].methods:
        if method.client_streaming:  # pragma: no cover - the API has none
            raise NotImplementedError(f"{method.full_name}: client streaming")
        request_cls = getattr(generation_pb2, method.input_type.name)
        serialize = getattr(generation_pb2, method.output_type.name).SerializeToString
        impl = getattr(servicer, method.name)
        if method.server_streaming:
            handlers[method.name] = grpc.unary_stream_rpc_method_handler(
                _parsing_stream(impl, request_cls), response_serializer=serialize)
        else:
            handlers[method.name] = grpc.unary_unary_rpc_method_handler(
                _parsing_unary(impl, request_cls), response_serializer=serialize)
    return handlers


async def _parse_request(raw: bytes, request_cls, context):
    try:
        return request_cls.FromString(raw)
    except Exception:  # DecodeError, or anything else a parser raises on bad bytes
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"malformed request: not a valid {request_cls.DESCRIPTOR.full_name}")


def _parsing_unary(impl: Callable, request_cls) -> Callable:
    async def handler(raw: bytes, context):
        return await impl(await _parse_request(raw, request_cls, context), context)

    return handler


def _parsing_stream(impl: Callable, request_cls) -> Callable:
    async def handler(raw: bytes, context):
        async for response in impl(await _parse_request(raw, request_cls, context), context):
            yield response

    return handler


async def start_generation_server(
    servicer: GenerationServicer,
    host: str = "127.0.0.1",
    port: int = 50051,
    tls_cert: bytes | None = None,
    tls_key: bytes | None = None,
    auth_token: str | Tenants | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Starts the Generation server with health checking and reflection.

    ``auth_token``: the tenants' token table (`coordinator.front.tenants.Tenants`), a single token
    (one tenant, its admin), or None (no tokens: open to every caller, one tenant).

    Returns:
        (server, bound port) — ``port=0`` picks a free one.

    Raises:
        ValueError: only one of ``tls_cert``/``tls_key``, or the port cannot be bound.
    """
    tenants = Tenants((auth_token,)) if isinstance(auth_token, str) and auth_token else (
        auth_token or None)
    if tenants is not None and not tenants.enabled:
        tenants = None
    interceptors = [BearerTokenInterceptor(tenants)] if tenants is not None else []
    servicer.tenants = tenants
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 # A second server on a busy port must fail, not silently share it.
                 ("grpc.so_reuseport", 0)],
    )
    handlers = generation_handlers(servicer)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(GENERATION_SERVICE, handlers),))
    server.add_registered_method_handlers(GENERATION_SERVICE, handlers)
    health_servicer = health.aio.HealthServicer()
    servicer.health = health_servicer
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("TLS needs both a certificate and a key")
    try:
        if tls_cert is not None:
            credentials = grpc.ssl_server_credentials([(tls_key, tls_cert)])
            bound = server.add_secure_port(address, credentials)
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        raise ValueError(f"cannot listen on {address}: the address is in use or invalid") \
            from exc
    await server.start()
    for name in ("", GENERATION_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    listen = getattr(servicer.scheduler, "add_health_listener", None)  # a Router
    if listen is not None:
        listen(_HealthReporter(health_servicer))
    return server, bound


class _HealthReporter:
    """Mirrors a router's "some replica can serve" into the health service, for the overall
    server ("") and the Generation service: SERVING or NOT_SERVING, in the order reported."""

    def __init__(self, health_servicer):
        self.health = health_servicer
        self._last: asyncio.Future | None = None

    def __call__(self, can_serve: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if can_serve
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        self._last = asyncio.ensure_future(self._set(self._last, status))

    async def _set(self, previous: asyncio.Future | None, status) -> None:
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)  # keep the order
        for name in ("", GENERATION_SERVICE):
            await self.health.set(name, status)



__all__ = [
    "GENERATION_SERVICE",
    "MAX_MESSAGE_BYTES",
    "BearerTokenInterceptor",
    "GenerationServicer",
    "generation_handlers",
    "generation_request",
    "sampling_from_proto",
    "start_generation_server",
    "trimmed_stops",
]
