"""Transport-neutral admission: what both front ends (the gRPC API, `coordinator.front.grpc_api`,
and the OpenAI HTTP API, `coordinator.front.http_api`) do with a request between their wire format
and the scheduler.

A front end turns its message into a `coordinator.front.generation_request.GenerationRequest` (the
fields of ``specd.v1.GenerateRequest``, as plain Python values) and hands it to a `Gateway`,
which validates it (caps on what a client controls, the model's vocabulary and context, the
drafter), tokenizes it in a worker thread (a big prompt never stalls the event loop, every
stream's steps), queues it on the scheduler or router, and turns its events into
`StreamChunk` s (stable text deltas, stop strings trimmed, log probabilities). Bad input is
`coordinator.step.errors.RequestInvalid` whose ``field`` is the request field's gRPC path; each
front end names it in its own terms. A draining gateway refuses new requests
(`ServiceStopping`) and waits for those in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from drafter_worker.registry import DRAFTERS
from specd_core.grammar import GrammarCompiler, GrammarError, GrammarSpec
from specd_core.logprobs import TokenLogprob
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from specd_core.text import TextStream, encode_chat, encode_prompt

from ..step.errors import (
    REQUEST_FAILED,
    ReplicaUnavailable,
    RequestError,
    RequestFailed,
    RequestInvalid,
    ServiceStopping,
    client_status,
    literal,
)
from ..step.requests import ServiceRequest
from ..step.scheduler import Scheduler
from .generation_request import (
    GenerationRequest,
    check_chat_role,
    check_max_draft_len,
    check_stops,
    default_max_prompt_bytes,
    sampling_params,
    text_bytes,
    top_count,
)
from .refusals import RefusalBudget
from .tenants import partition_of
from .tool_calls import ChatTools

log = logging.getLogger(__name__)

def _constraint_field(request) -> str | None:
    """The field a request's constraint came in (None: no constraint), for a
    `GenerationRequest` or a front end's own message (gRPC's ``GenerateRequest``, whose field is
    ``constraint``)."""
    if isinstance(request, GenerationRequest):
        return None if request.constraint is None else request.constraint.field
    has = getattr(request, "HasField", None)
    return "constraint" if has is not None and has("constraint") else None


def speculation_counters(result: SpeculativeDecodeResult, drafter_failures: int) -> dict:
    """A finished request's speculation counters, by the names both APIs report them under
    (the gRPC ``SpeculationStats`` fields)."""
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
        "forced_tokens": result.forced_tokens,
        "grammar_rejected_tokens": result.grammar_rejected_tokens,
    }


class StopTrimmer:
    """Cuts a text stream before its first stop string (OpenAI's and vLLM's default stop
    semantics), without ever returning text that a later match would remove: a delta holds
    back only the trailing characters that could still start a stop string.

    Why the hold-back suffices: a position whose following text has already diverged from
    every stop string can never start a match, and a position whose following text is still
    a proper prefix of one is held back, so no match ever starts inside text already returned.

    Args:
        stops: the request's stop strings (non-empty).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.longest = max(len(s) for s in self.stops)
        self._firsts = {s[0] for s in self.stops}
        self.text = ""
        self.sent = 0
        #: True once a stop string matched: the output ends before it.
        self.stopped = False

    def push(self, delta: str) -> str:
        """Adds ``delta``; returns the text now safe to send (possibly "")."""
        if self.stopped or not delta:
            return ""
        self.text += delta
        found = [i for i in (self.text.find(s, self.sent) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            end = min(found)
        else:
            end = len(self.text) - self._held()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def _held(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of a stop
        string (the earliest start wins: it is the longest)."""
        text = self.text
        for i in range(max(self.sent, len(text) - self.longest + 1), len(text)):
            if text[i] in self._firsts:
                tail = text[i:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stops):
                    return len(text) - i
        return 0

    def flush(self) -> str:
        """At the end of the output: what was held back (no stop string completed)."""
        if self.stopped:
            return ""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


@dataclass(frozen=True)
class StreamChunk:
    """One step's output of a request (`Gateway.stream`).

    Attributes:
        token_ids: the tokens emitted (empty on the final chunk).
        text: their stable text delta (the final chunk flushes the rest).
        result: the request's counters, on the final chunk only.
        logprobs: one `TokenLogprob` per entry of ``token_ids`` when the request asked for
            them, else None.
        prompt_logprobs: on the first chunk of a request that asked for them, one entry per
            prompt token (the first None); else None.
    """

    token_ids: list[int]
    text: str
    result: SpeculativeDecodeResult | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None



class Gateway:
    """Admission of generation requests to a scheduler, for every front end.

    Args:
        scheduler: the running `Scheduler`, or a `coordinator.cluster.router.Router` (replicas and
            drafters).
        tokenizer: encodes text / chat prompts and decodes text deltas.
        vocab_size, max_seq_len: the target's, for validation.
        drafter_name: the service's drafter ("none" when it has none).
        model_name: the served model's name (the front ends report it).
        max_prompt_bytes: the most UTF-8 bytes of prompt text (or of all chat messages'
            contents) accepted, checked before tokenizing; None derives it from the
            tokenizer so the model's context stays reachable (`default_max_prompt_bytes`).
        tool_call_parser: the format of the model's tool calls for ``tool_choice: "auto"``
            (`specd_core.tool_calls.TOOL_CALL_PARSERS`); None: the one its chat template
            names, else ``hermes`` (`coordinator.front.tool_calls.ChatTools`).

    Raises:
        ValueError: ``max_prompt_bytes`` is not a positive integer, or an unknown
            ``tool_call_parser``.
    """

    def __init__(self, scheduler: Scheduler, tokenizer, vocab_size: int, max_seq_len: int,
                 drafter_name: str, model_name: str, max_prompt_bytes: int | None = None,
                 tool_call_parser: str | None = None):
        if max_prompt_bytes is None:
            max_prompt_bytes = default_max_prompt_bytes(tokenizer, max_seq_len)
        if (isinstance(max_prompt_bytes, bool) or not isinstance(max_prompt_bytes, int)
                or max_prompt_bytes < 1):
            raise ValueError(f"max_prompt_bytes must be a positive integer, got "
                             f"{max_prompt_bytes!r}")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_prompt_bytes = max_prompt_bytes
        self.drafter_name = drafter_name
        self.model_name = model_name
        #: Structured outputs: constraints compiled for this tokenizer, cached (bounded).
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        #: ``tool_choice: "auto"``: the model's tool-call format and prompt rendering.
        self.tools = ChatTools(tokenizer, tool_call_parser)
        #: Refused constraints count against their tenant (`coordinator.front.refusals`).
        self.refusals = RefusalBudget()
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        #: Per tenant name ("" without tokens): ``requests``, ``prompt_tokens`` (counted
        #: when queued), ``generation_tokens`` (when finished) -- the ``tenant``-labelled
        #: metrics (`coordinator.cluster.metrics`).
        self.tenant_stats: dict[str, dict[str, int]] = {}

    def _book(self, tenant: str, **counts: int) -> None:
        stats = self.tenant_stats.setdefault(
            tenant, {"requests": 0, "prompt_tokens": 0, "generation_tokens": 0})
        for name, n in counts.items():
            stats[name] += n

    # ---- request parsing ----

    def _prompt_tokens(self, request: GenerationRequest) -> list[int]:
        kind = request.prompt_kind()
        if kind is None:
            raise RequestInvalid("{field}: set one of text, chat or token_ids", "prompt")
        if kind == "token_ids":
            if len(request.token_ids) >= self.max_seq_len:  # before copying or scanning
                raise RequestInvalid(
                    f"{{field}}: {len(request.token_ids)} tokens leave no room in the "
                    f"model's context of {self.max_seq_len}", "prompt")
            ids = list(request.token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestInvalid(f"{{field}}: id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", "token_ids")
        elif kind == "text":
            self._check_size("text", [request.text])
            ids = encode_prompt(self.tokenizer, request.text, raw=True) if request.text else []
        else:
            messages = request.chat
            if not messages or not any(m["content"] for m in messages):
                raise RequestInvalid("{field}: at least one message with content is required",
                                     "chat")
            tools = request.tools or None
            self._check_size("chat", [t if isinstance(t, str) else json.dumps(t)
                                      for m in messages for t in m.values()]
                             + ([json.dumps(tools)] if tools else []))
            messages, tools = self.tools.messages(messages, tools)
            try:
                ids = encode_chat(self.tokenizer, messages, tools,
                                  request.add_generation_prompt, request.continue_final_message)
            except ValueError as exc:  # "chat: the model's chat template refused ..."
                raise RequestInvalid("{field}: " + literal(str(exc).removeprefix("chat: ")),
                                     "chat") from exc
        if not ids:
            raise RequestInvalid(f"{{field}}: the {kind} prompt is empty", "prompt")
        return ids

    def _check_size(self, kind: str, texts: Sequence[str]) -> None:
        size = text_bytes(texts, self.max_prompt_bytes)
        if size > self.max_prompt_bytes:
            raise RequestInvalid(
                f"{{field}}: the prompt is over {self.max_prompt_bytes} bytes, more than the "
                f"model's context of {self.max_seq_len} tokens can hold", kind)

    def parse(self, request: GenerationRequest,
              default_max_new_tokens: bool = False,
              ) -> tuple[list[int], SpeculativeOptions, bool, int | None]:
        """(prompt ids, options, speculate, max_draft_len) or `RequestInvalid`. Tokenizes:
        blocking (the server calls it in a worker thread). ``default_max_new_tokens``: an
        unset (0) ``max_new_tokens`` takes the rest of the model's context."""
        check_stops(request)  # cheap, before tokenizing
        for i, message in enumerate(request.chat or ()):
            check_chat_role(message.get("role"), f"chat.messages[{i}].role")
        check_max_draft_len(request.max_draft_len)
        prompt = self._prompt_tokens(request)
        sampling = sampling_params(request.sampling)
        logprobs = top_count(request, "logprobs")
        prompt_logprobs = top_count(request, "prompt_logprobs")
        if default_max_new_tokens and request.max_new_tokens == 0:
            request = dataclasses.replace(
                request, max_new_tokens=max(1, self.max_seq_len - len(prompt) + 1))
        if request.max_new_tokens <= 0 and prompt_logprobs is None:
            # 0 only scores the prompt, which needs prompt_logprobs to say anything.
            raise RequestInvalid("{field}: must be >= 1 (0 only with prompt_logprobs)",
                                 "max_new_tokens")
        if len(prompt) >= self.max_seq_len:
            raise RequestInvalid(f"{{field}}: {len(prompt)} tokens leave no room in the "
                                 f"model's context of {self.max_seq_len}", "prompt")
        if len(prompt) + request.max_new_tokens - 1 > self.max_seq_len:
            raise RequestInvalid(
                f"{{field}}: prompt ({len(prompt)} tokens) + {{field}} "
                f"({request.max_new_tokens}) exceeds the model's context of {self.max_seq_len}",
                "max_new_tokens")
        bad = [t for t in request.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestInvalid(f"{{field}}: id {bad[0]} is outside the vocabulary",
                                 "stop_token_ids")
        constraint = request.constraint
        if constraint is None and request.tool_choice == "auto" and request.tools:
            constraint = self.tools.grammar(request.tools, request.parallel_tool_calls)
        grammar = self._compile(constraint)
        if (constraint is not request.constraint and request.continue_final_message
                and request.chat):  # a continued message may have opened a call
            try:
                grammar = self.tools.continued(grammar, request.chat[-1]["content"],
                                               self.grammars.ll_tokenizer())
            except ValueError as exc:
                raise RequestInvalid("{field}: " + literal(str(exc)),
                                     "continue_final_message") from exc

        drafter = request.drafter
        if drafter not in ("", "none", self.drafter_name):
            # A drafter specd has but this service was not started with is not "unknown".
            what = "is not served by this service" if drafter in DRAFTERS else "is unknown"
            raise RequestInvalid(
                "{field}: drafter " + literal(f"{drafter!r} {what}; this service has "
                                              f"{self.drafter_name!r} (or 'none')"),
                "speculation.drafter")
        speculate = (drafter != "none" and request.speculate is not False
                     and self.drafter_name != "none")
        max_draft_len = request.max_draft_len
        stops = list(request.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and not request.ignore_eos:
            stops.append(eos)
        options = SpeculativeOptions(
            max_new_tokens=request.max_new_tokens,
            sampling=sampling,
            seed=request.seed,
            stop_token_ids=tuple(stops),
            stop_strings=tuple(request.stop),
            detokenize=self.detokenize,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            grammar=grammar,
        )
        return prompt, options, speculate, max_draft_len

    def _compile(self, constraint: GrammarSpec | None):
        """The compiled constraint (`specd_core.grammar.Grammar`; cached by constraint), or
        None. Blocking: `parse` runs in a worker thread, off the event loop.

        Raises:
            RequestInvalid: naming the constraint's field (``constraint.field``).
        """
        if constraint is None:
            return None
        try:
            return self.grammars.compile(constraint)
        except GrammarError as exc:
            field = constraint.field
            why = str(exc).removeprefix(f"{field}: ")
            raise RequestInvalid("{field}: " + literal(why), field) from exc

    def detokenize(self, ids: Sequence[int]) -> str:
        """``ids`` as text (special tokens skipped), as the stream decodes them."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ---- in flight, and draining ----

    @contextlib.contextmanager
    def tracked(self):
        """Counts a call in flight (for `drain`): a front end holds it while it serves one."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    @property
    def draining(self) -> bool:
        """True once `drain` began: new requests are refused."""
        return self._draining

    async def drain(self, grace_s: float) -> None:
        """Starts a graceful shutdown: new requests get `ServiceStopping` from now on, and
        this waits up to ``grace_s`` seconds for the calls in flight (`tracked`) to finish."""
        self._draining = True
        await self.on_drain()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            log.warning("%d call(s) still in flight after the %g s grace period",
                        self._in_flight, grace_s)

    async def on_drain(self) -> None:
        """Called by `drain` once new requests are refused, before it waits: a front end's
        hook to announce it (the gRPC one's health service answers NOT_SERVING)."""

    def can_serve(self) -> bool:
        """Whether some target replica can serve now (always, for a bare scheduler)."""
        can_serve = getattr(self.scheduler, "can_serve", None)  # a Router
        return can_serve is None or can_serve()

    def cancel(self, req: ServiceRequest) -> None:
        """Stops a submitted request at the next step and frees its slot."""
        self.scheduler.cancel(req)

    # ---- submit, stream, collect ----

    async def submit(self, request: GenerationRequest,
                     default_max_new_tokens: bool = False, tenant: str = "",
                     cache_salt: str | None = None) -> ServiceRequest:
        """Parses, validates and queues ``request``: the one path both front ends (gRPC,
        `coordinator.front.grpc_api`, and the OpenAI HTTP API, `coordinator.front.http_api`) take.

        ``default_max_new_tokens``: an unset (0) ``max_new_tokens`` means "the rest of the
        model's context" instead of an error (OpenAI's chat default). ``tenant``: the
        caller's tenant name (`coordinator.front.tenants`; "" without tokens) and ``cache_salt``
        the request's: together they choose the partition of cross-request state the request
        may share (`coordinator.front.tenants.partition_of`).

        Raises:
            RequestInvalid: a bad field (the message names it).
            ServiceStopping: the server is draining.
            ReplicaUnavailable: no replica can serve now.
            RequestFailed: tokenizing failed (the cause is logged, not shown).
        """
        return (await self.submit_choices(request, 1, default_max_new_tokens, tenant,
                                          cache_salt))[0]

    async def _parse(self, request: GenerationRequest,
                     default_max_new_tokens: bool):
        """`parse` off the event loop, refused while draining, its errors as `submit`
        raises them."""
        if self._draining:
            raise ServiceStopping("the service is shutting down")
        try:
            # Off the event loop: tokenizing a big prompt (or rendering a chat template) must
            # not stall every other stream's steps. Hugging Face fast tokenizers release the
            # GIL while encoding, and encode/decode with fixed settings are thread-safe.
            return await asyncio.to_thread(self.parse, request, default_max_new_tokens)
        except RequestInvalid:
            raise
        except ValueError as exc:
            raise RequestInvalid(str(exc)) from exc
        except Exception as exc:  # the tokenizer failed: no internals to the client
            log.exception("parsing a request failed")
            raise RequestFailed(REQUEST_FAILED) from exc

    async def submit_choices(self, request: GenerationRequest, n: int,
                             default_max_new_tokens: bool = False, tenant: str = "",
                             cache_salt: str | None = None) -> list[ServiceRequest]:
        """`submit` for ``n`` independent choices of one prompt, tokenized once. Choice ``i``
        samples with seed ``seed + i`` (mod 2**64) when the request has a seed, so a seeded
        request gives the same ``n`` outputs every time; without one each draws fresh
        entropy. If a later choice cannot be queued, the earlier ones are cancelled.

        Raises:
            ValueError: ``n`` < 1.
            RequestError: as `submit`.
        """
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        try:
            partition = partition_of(tenant, cache_salt)
        except ValueError as exc:
            why = str(exc).removeprefix("cache_salt: ")
            raise RequestInvalid("{field}: " + literal(why), "cache_salt") from exc
        constraint = _constraint_field(request)
        if constraint is not None:  # a client out of refusals compiles nothing more
            self.refusals.check(tenant, constraint)
        try:
            prompt, options, speculate, max_draft_len = await self._parse(
                request, default_max_new_tokens)
        except RequestInvalid as exc:
            cause = exc.__cause__
            if (constraint is not None and isinstance(cause, GrammarError)
                    and not getattr(cause, "cached", False)):  # a compile that failed
                self.refusals.charge(tenant)
            raise
        reqs: list[ServiceRequest] = []
        try:
            for i in range(n):
                seed = options.seed
                if n > 1 and seed is not None:
                    seed = (seed + i) % 2**64
                reqs.append(self.scheduler.submit(
                    prompt, dataclasses.replace(options, seed=seed), speculate, max_draft_len,
                    partition=partition))
        except BaseException as exc:
            for req in reqs:
                self.scheduler.cancel(req)
            if isinstance(exc, ValueError):
                raise RequestInvalid(str(exc)) from exc
            if isinstance(exc, RuntimeError):
                raise ReplicaUnavailable(str(exc)) from exc
            raise
        for req in reqs:
            req.tenant = tenant
        self._book(tenant, requests=n, prompt_tokens=len(prompt))
        return reqs

    async def stream(self, req: ServiceRequest, trim_stops: Sequence[str] = ()
                     ) -> AsyncIterator[StreamChunk]:
        """The chunks of a submitted request, in order; the last carries its result. Text
        deltas never end inside a UTF-8 character (`TextStream`). Closing the iterator early
        (a client gone) cancels the request, which frees its slot at the next step.

        ``trim_stops``: the text ends before the first of these strings (`StopTrimmer`;
        token ids are not trimmed) and the finish reason is then "stop". Empty: the text
        keeps a matched stop string (the gRPC API's default).

        Raises:
            RequestError: the request failed (the message is client-safe); a detokenizer
                failure is `RequestFailed` (the cause is logged).
        """
        text = TextStream(self.tools.text_tokenizer)
        trimmer = StopTrimmer(trim_stops) if trim_stops else None
        options, decode = req.decode.options, req.decode
        # The prompt's log probabilities ride on the first chunk (all are known by then:
        # the first token is sampled after the last prompt chunk).
        prompt_logprobs = (None if options.prompt_logprobs is None else
                           lambda: list(decode.prompt_logprobs))
        seen = 0
        try:
            while True:
                event = await req.events.get()
                if isinstance(event, list):
                    try:
                        delta = text.push(event)
                    except Exception as exc:  # detokenizing failed: this stream alone ends
                        log.exception("streaming request %s failed", req.id)
                        raise RequestFailed(REQUEST_FAILED) from exc
                    if trimmer is not None:
                        delta = trimmer.push(delta)
                    logprobs = None
                    if options.logprobs is not None:
                        # Recorded as each token was committed, so always there by now.
                        logprobs = decode.token_logprobs[seen:seen + len(event)]
                    seen += len(event)
                    yield StreamChunk(list(event), delta, None, logprobs,
                                      prompt_logprobs and prompt_logprobs())
                    prompt_logprobs = None
                elif isinstance(event, SpeculativeDecodeResult):
                    self._book(req.tenant, generation_tokens=event.tokens_generated)
                    try:
                        delta = text.flush()
                    except Exception as exc:
                        log.exception("streaming request %s failed", req.id)
                        raise RequestFailed(REQUEST_FAILED) from exc
                    if trimmer is not None:
                        delta = trimmer.push(delta) + trimmer.flush()
                        if trimmer.stopped:
                            # The scheduler matches stop strings in a window of recent
                            # tokens; a match found here is one too.
                            event.finish_reason = "stop"
                    yield StreamChunk([], delta, event,
                                      None if options.logprobs is None else [],
                                      prompt_logprobs and prompt_logprobs())
                    return
                elif isinstance(event, RequestError):
                    raise event
                else:  # not meant for the client: logged, answered generically
                    log.error("request %s failed: %r", req.id, event)
                    raise RequestFailed(client_status(event)[1])
        finally:
            # Client cancel, deadline, or a dropped stream: free the slot at the next step.
            self.scheduler.cancel(req)

    async def collect(self, req: ServiceRequest, trim_stops: Sequence[str] = ()
                      ) -> tuple[list[int], str, SpeculativeDecodeResult]:
        """(token ids, text, result) of a submitted request: the text is the streamed
        deltas joined, so a unary answer equals the concatenated stream (``trim_stops`` as
        in `stream`).

        Raises:
            RequestError: as `stream`.
        """
        tokens: list[int] = []
        parts: list[str] = []
        async with contextlib.aclosing(self.stream(req, trim_stops)) as chunks:
            async for chunk in chunks:
                tokens.extend(chunk.token_ids)
                parts.append(chunk.text)
                if chunk.result is not None:
                    return tokens, "".join(parts), chunk.result
        raise RequestFailed(REQUEST_FAILED)  # pragma: no cover - stream always ends so


__all__ = ["Gateway", "StopTrimmer", "StreamChunk", "speculation_counters"]
