"""The gRPC ``specd.v1.Generation`` front end (grpc.aio) over a `Scheduler`.

Bad input is refused with ``INVALID_ARGUMENT`` and a message naming the field; the server
keeps serving others. Bytes that are not a valid request message are ``INVALID_ARGUMENT`` too
(each handler parses its own request, see `generation_handlers`). A prompt over the size cap
(``max_prompt_bytes``) is refused before it is tokenized, and tokenizing and chat rendering run
in a worker thread, so a big prompt never stalls the event loop (every stream's steps).
A client that cancels (or whose deadline passes) stops its request at the next step boundary
and frees its KV slot. Optional TLS and a bearer token checked by a server interceptor (the
health service is exempt so probes work without it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from drafter_worker.server import CredentialInterceptor
from specd.v1 import generation_pb2, generation_pb2_grpc
from specd_core.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specd_core.request import SpeculativeDecodeResult, SpeculativeOptions
from specd_core.sampling import SamplingParamError, SamplingParams
from specd_core.text import TextStream, encode_chat, encode_prompt

from .errors import (
    REQUEST_FAILED,
    ReplicaUnavailable,
    RequestError,
    RequestFailed,
    RequestInvalid,
    ServiceStopping,
    client_status,
    literal,
)
from .scheduler import Scheduler, ServiceRequest

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Bytes per token assumed for a tokenizer that does not list its vocabulary (a guess).
FALLBACK_TOKEN_BYTES = 64


def default_max_prompt_bytes(tokenizer, max_seq_len: int) -> int:
    """The prompt-size cap (UTF-8 bytes of prompt text or chat contents) that still admits
    every prompt of up to ``max_seq_len`` tokens: ``max_seq_len`` x the longest vocabulary
    entry in UTF-8 bytes. No token covers more text than that, so a longer prompt would
    tokenize into more than ``max_seq_len`` tokens and be refused anyway, after tokenizing.
    (Vocabulary entries are written in the tokenizer's alphabet: byte-level BPE's ``Ġ`` is two
    UTF-8 bytes for one byte of text, so the bound errs towards admitting.) For SmolLM2
    (context 8192, longest entry 162 bytes) it is ~1.3 MB.

    A tokenizer without ``get_vocab`` gets `FALLBACK_TOKEN_BYTES` per token.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    longest = FALLBACK_TOKEN_BYTES
    if get_vocab is not None:
        longest = max((len(t.encode("utf-8")) for t in get_vocab()), default=longest)
    return max_seq_len * max(longest, 4)  # one UTF-8 character is up to 4 bytes


def _text_bytes(texts: Sequence[str], cap: int) -> int:
    """UTF-8 size of ``texts``, or some value > ``cap`` as soon as it is known to exceed it
    (without encoding a huge string: a character is 1 to 4 bytes)."""
    chars = sum(len(t) for t in texts)
    if chars > cap:
        return chars
    if 4 * chars <= cap:
        return chars  # a lower bound, enough to know it fits
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


#: Most stop strings per request, and UTF-8 bytes per stop string: each step checks every
#: string against the output's tail, so an unbounded list slows the whole batch down.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_BYTES = 1024
#: Most stop token ids per request.
MAX_STOP_TOKEN_IDS = 1024


def _check_stops(request: generation_pb2.GenerateRequest) -> None:
    """Raises `RequestInvalid` naming ``stop`` / ``stop_token_ids`` when over their caps or
    a stop string is empty."""
    if len(request.stop) > MAX_STOP_STRINGS:
        raise RequestInvalid(f"{{field}}: {len(request.stop)} stop strings, at most "
                             f"{MAX_STOP_STRINGS} are allowed", "stop")
    for i, stop in enumerate(request.stop):
        if not stop:
            raise RequestInvalid("{field}: stop strings must be non-empty", "stop")
        if _text_bytes([stop], MAX_STOP_STRING_BYTES) > MAX_STOP_STRING_BYTES:
            raise RequestInvalid(f"{{field}}[{i}]: longer than {MAX_STOP_STRING_BYTES} bytes",
                                 "stop")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestInvalid(f"{{field}}: {len(request.stop_token_ids)} ids, at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")


def sampling_from_proto(msg: generation_pb2.SamplingParams) -> SamplingParams:
    """`SamplingParams` from the proto, unset fields taking their defaults.

    Raises:
        RequestInvalid: naming the out-of-range field (``sampling.<name>``).
    """
    fields = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
              "frequency_penalty")
    # The proto's float32 back to the shortest decimal that round-trips it (0.01 arrives as
    # 0.0099999998): the value the client wrote, so a request means the same here as in
    # process, and documented bounds such as repetition_penalty >= 0.01 hold as written.
    kwargs = {f: float(np.format_float_positional(np.float32(getattr(msg, f)), unique=True))
              for f in fields if msg.HasField(f)}
    if msg.HasField("top_k"):
        kwargs["top_k"] = msg.top_k
    try:
        return SamplingParams(**kwargs)
    except SamplingParamError as exc:
        raise RequestInvalid("{field}=" + literal(f"{exc.value!r}: {exc.why}"),
                             f"sampling.{exc.field}") from exc


def speculation_stats(result: SpeculativeDecodeResult, drafter_failures: int
                      ) -> generation_pb2.SpeculationStats:
    return generation_pb2.SpeculationStats(
        forward_calls=result.forward_calls,
        verification_steps=result.verification_steps,
        drafted_tokens=result.drafted_tokens,
        accepted_tokens=result.accepted_tokens,
        acceptance_length=result.acceptance_length() or 0.0,
        accept_rate=result.accept_rate() or 0.0,
        evaluated_at_position=result.evaluated_at_position,
        accepted_at_position=result.accepted_at_position,
        drafter_failures=drafter_failures,
    )


def _final_fields(req: ServiceRequest, result: SpeculativeDecodeResult) -> dict:
    """The finish reason, usage and speculation counters both RPC shapes end with."""
    return {
        "finish_reason": result.finish_reason,
        "usage": generation_pb2.Usage(prompt_tokens=req.decode.num_prompt_tokens,
                                      completion_tokens=result.tokens_generated),
        "speculation": speculation_stats(result, req.drafter_failures),
    }


def logprob_protos(records: Sequence[TokenLogprob | None]
                   ) -> list[generation_pb2.TokenLogprob]:
    """``TokenLogprob`` messages of ``records`` (None entries, the first prompt token's,
    skipped)."""
    return [generation_pb2.TokenLogprob(
                token_id=r.token, logprob=r.logprob,
                top=[generation_pb2.TopLogprob(token_id=t, logprob=v) for t, v in r.top])
            for r in records if r is not None]


def _top_count(request: generation_pb2.GenerateRequest, name: str) -> int | None:
    """``request.<name>`` (a top-alternatives count) or None when unset.

    Raises:
        RequestInvalid: over `MAX_TOP_LOGPROBS`.
    """
    if not request.HasField(name):
        return None
    value = getattr(request, name)
    if value > MAX_TOP_LOGPROBS:
        raise RequestInvalid(f"{{field}}: must be in [0, {MAX_TOP_LOGPROBS}], got {value}",
                             name)
    return value


def _with_max_new_tokens(request: generation_pb2.GenerateRequest, n: int
                         ) -> generation_pb2.GenerateRequest:
    copy = generation_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.max_new_tokens = n
    return copy


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


def trimmed_stops(request: generation_pb2.GenerateRequest) -> tuple[str, ...]:
    """The stop strings to cut the text before: the request's when it set
    ``include_stop_str_in_output`` false, else none (the gRPC API's default keeps them)."""
    if request.HasField("include_stop_str_in_output") and not request.include_stop_str_in_output:
        return tuple(request.stop)
    return ()


@dataclass(frozen=True)
class StreamChunk:
    """One step's output of a request (`GenerationServicer.stream`).

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


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """``specd.v1.Generation`` over a scheduler.

    Args:
        scheduler: the running `Scheduler`, or a `coordinator.router.Router` (replicas and
            drafters; then Status reports them and Scale works).
        tokenizer: encodes text / chat prompts and decodes text deltas.
        vocab_size, max_seq_len: the target's, for validation.
        drafter_name: the service's drafter ("none" when it has none).
        model_name: reported by Status.
        max_prompt_bytes: the most UTF-8 bytes of prompt text (or of all chat messages'
            contents) accepted, checked before tokenizing; None derives it from the
            tokenizer so the model's context stays reachable (`default_max_prompt_bytes`).

    Raises:
        ValueError: ``max_prompt_bytes`` is not a positive integer.
    """

    def __init__(self, scheduler: Scheduler, tokenizer, vocab_size: int, max_seq_len: int,
                 drafter_name: str, model_name: str, max_prompt_bytes: int | None = None):
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
        self._scale_tasks: set[asyncio.Task] = set()
        #: The server's health service (set by `start_generation_server`), for `drain`.
        self.health = None
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- request parsing ----

    def _prompt_tokens(self, request: generation_pb2.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise RequestInvalid("{field}: set one of text, chat or token_ids", "prompt")
        if kind == "token_ids":
            if len(request.token_ids.ids) >= self.max_seq_len:  # before copying or scanning
                raise RequestInvalid(
                    f"{{field}}: {len(request.token_ids.ids)} tokens leave no room in the "
                    f"model's context of {self.max_seq_len}", "prompt")
            ids = list(request.token_ids.ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestInvalid(f"{{field}}: id {bad[0]} is outside the vocabulary "
                                     f"[0, {self.vocab_size})", "token_ids")
        elif kind == "text":
            self._check_size("text", [request.text])
            ids = encode_prompt(self.tokenizer, request.text, raw=True) if request.text else []
        else:
            messages = [_chat_message(m) for m in request.chat.messages]
            if not messages or not any(m["content"] for m in messages):
                raise RequestInvalid("{field}: at least one message with content is required",
                                     "chat")
            self._check_size("chat", [t for m in messages for t in m.values()])
            try:
                ids = encode_chat(self.tokenizer, messages)
            except ValueError as exc:  # "chat: the model's chat template refused ..."
                raise RequestInvalid("{field}: " + literal(str(exc).removeprefix("chat: ")),
                                     "chat") from exc
        if not ids:
            raise RequestInvalid(f"{{field}}: the {kind} prompt is empty", "prompt")
        return ids

    def _check_size(self, kind: str, texts: Sequence[str]) -> None:
        size = _text_bytes(texts, self.max_prompt_bytes)
        if size > self.max_prompt_bytes:
            raise RequestInvalid(
                f"{{field}}: the prompt is over {self.max_prompt_bytes} bytes, more than the "
                f"model's context of {self.max_seq_len} tokens can hold", kind)

    def parse(self, request: generation_pb2.GenerateRequest,
              default_max_new_tokens: bool = False,
              ) -> tuple[list[int], SpeculativeOptions, bool, int | None]:
        """(prompt ids, options, speculate, max_draft_len) or `RequestInvalid`. Tokenizes:
        blocking (the server calls it in a worker thread). ``default_max_new_tokens``: an
        unset (0) ``max_new_tokens`` takes the rest of the model's context."""
        _check_stops(request)  # cheap, before tokenizing
        prompt = self._prompt_tokens(request)
        sampling = sampling_from_proto(request.sampling)
        logprobs = _top_count(request, "logprobs")
        prompt_logprobs = _top_count(request, "prompt_logprobs")
        if default_max_new_tokens and request.max_new_tokens == 0:
            request = _with_max_new_tokens(request, max(1, self.max_seq_len - len(prompt) + 1))
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

        spec = request.speculation
        drafter = spec.drafter
        if drafter not in ("", "none", self.drafter_name):
            raise RequestInvalid(
                "{field}: unknown drafter " + literal(f"{drafter!r}; this service has "
                                                      f"{self.drafter_name!r} (or 'none')"),
                "speculation.drafter")
        speculate = (drafter != "none" and (not spec.HasField("enabled") or spec.enabled)
                     and self.drafter_name != "none")
        max_draft_len = spec.max_draft_len if spec.HasField("max_draft_len") else None
        stops = list(request.stop_token_ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and not request.ignore_eos:
            stops.append(eos)
        options = SpeculativeOptions(
            max_new_tokens=request.max_new_tokens,
            sampling=sampling,
            seed=request.seed if request.HasField("seed") else None,
            stop_token_ids=tuple(stops),
            stop_strings=tuple(request.stop),
            detokenize=self._detokenize,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        return prompt, options, speculate, max_draft_len

    def _detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    @contextlib.contextmanager
    def _tracked(self):
        """Counts a Generate call in flight (for `drain`)."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Starts a graceful shutdown: new Generate calls get ``UNAVAILABLE`` from the
        handler itself, health reports ``NOT_SERVING`` from now on, and this waits up to
        ``grace_s`` seconds for the calls in flight to finish. (Stopping the gRPC server
        at once instead ends calls that have arrived but not reached a handler with
        ``CANCELLED``, grpc/grpc#41785.)"""
        self._draining = True
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            log.warning("%d call(s) still in flight after the %g s grace period",
                        self._in_flight, grace_s)

    async def submit(self, request: generation_pb2.GenerateRequest,
                     default_max_new_tokens: bool = False) -> ServiceRequest:
        """Parses, validates and queues ``request``: the one path both front ends (gRPC and
        the OpenAI HTTP API, `coordinator.http_api`) take.

        ``default_max_new_tokens``: an unset (0) ``max_new_tokens`` means "the rest of the
        model's context" instead of an error (OpenAI's chat default).

        Raises:
            RequestInvalid: a bad field (the message names it).
            ServiceStopping: the server is draining.
            ReplicaUnavailable: no replica can serve now.
            RequestFailed: tokenizing failed (the cause is logged, not shown).
        """
        prompt, options, speculate, max_draft_len = await self._parse(
            request, default_max_new_tokens)
        try:
            return self.scheduler.submit(prompt, options, speculate, max_draft_len)
        except ValueError as exc:
            raise RequestInvalid(str(exc)) from exc
        except RuntimeError as exc:  # a router with no serving replica
            raise ReplicaUnavailable(str(exc)) from exc

    async def _parse(self, request: generation_pb2.GenerateRequest,
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

    async def submit_choices(self, request: generation_pb2.GenerateRequest, n: int,
                             default_max_new_tokens: bool = False) -> list[ServiceRequest]:
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
        if n == 1:
            return [await self.submit(request, default_max_new_tokens)]
        prompt, options, speculate, max_draft_len = await self._parse(
            request, default_max_new_tokens)
        reqs: list[ServiceRequest] = []
        try:
            for i in range(n):
                seed = None if options.seed is None else (options.seed + i) % 2**64
                reqs.append(self.scheduler.submit(
                    prompt, dataclasses.replace(options, seed=seed), speculate, max_draft_len))
        except BaseException as exc:
            for req in reqs:
                self.scheduler.cancel(req)
            if isinstance(exc, ValueError):
                raise RequestInvalid(str(exc)) from exc
            if isinstance(exc, RuntimeError):
                raise ReplicaUnavailable(str(exc)) from exc
            raise
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
        text = TextStream(self.tokenizer)
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

    async def _submit(self, request, context) -> ServiceRequest:
        try:
            return await self.submit(request)
        except RequestError as exc:
            await _abort_failed(context, exc)
            raise

    # ---- RPCs ----

    async def Generate(self, request, context):
        with self._tracked():
            req = await self._submit(request, context)
            try:
                async with contextlib.aclosing(
                        self.stream(req, trimmed_stops(request))) as chunks:
                    async for chunk in chunks:
                        lp = {"logprobs": logprob_protos(chunk.logprobs or ()),
                              "prompt_logprobs": logprob_protos(chunk.prompt_logprobs or ())}
                        if chunk.result is None:
                            yield generation_pb2.GenerateResponse(token_ids=chunk.token_ids,
                                                                  text=chunk.text, **lp)
                        else:
                            yield generation_pb2.GenerateResponse(
                                text=chunk.text, **_final_fields(req, chunk.result), **lp)
            except RequestError as exc:
                await _abort_failed(context, exc)

    async def GenerateUnary(self, request, context):
        with self._tracked():
            req = await self._submit(request, context)
            try:
                tokens, text, result = await self.collect(req, trimmed_stops(request))
            except RequestError as exc:
                await _abort_failed(context, exc)
            return generation_pb2.GenerateResult(
                text=text, token_ids=tokens, **_final_fields(req, result),
                logprobs=logprob_protos(req.decode.token_logprobs),
                prompt_logprobs=logprob_protos(req.decode.prompt_logprobs))

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
        )

    async def Scale(self, request, context):
        """Admin: scales replicas and drafters (`coordinator.router.Router.scale`). The work
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


def _chat_message(m: generation_pb2.ChatMessage) -> dict[str, str]:
    """A chat message as the chat template gets it: ``name`` only when set (templates that
    do not use it ignore the key)."""
    message = {"role": m.role, "content": m.content}
    if m.name:
        message["name"] = m.name
    return message


async def _abort_failed(context, exc: BaseException) -> None:
    """Ends an RPC whose request failed with the status and client-safe message
    `coordinator.errors.client_status` gives (internals stay in the server log)."""
    code, message = client_status(exc)
    if code == "INTERNAL":
        log.error("request failed: %r", exc)
    await context.abort(grpc.StatusCode[code], message)


def _replica_proto(r: dict) -> generation_pb2.ReplicaStatus:
    fields = generation_pb2.ReplicaStatus.DESCRIPTOR.fields_by_name
    return generation_pb2.ReplicaStatus(**{k: v for k, v in r.items() if k in fields})


def _drafter_proto(d: dict) -> generation_pb2.DrafterStatus:
    return generation_pb2.DrafterStatus(
        name=d["name"], address=d["address"], state=d["state"], calls=d["calls"],
        errors=d["errors"], mean_latency_seconds=d["mean_latency_s"],
        assigned_requests=d["assigned_requests"], in_flight=d["in_flight"],
        restarts=d.get("restarts", 0), node=d.get("node", ""))


class BearerTokenInterceptor(CredentialInterceptor):
    """Requires ``authorization: Bearer <token>`` metadata on every RPC except health checks;
    anything else gets ``UNAUTHENTICATED``.

    Raises:
        ValueError: an empty token.
    """

    EMPTY = "auth token must be non-empty"
    REFUSAL = "missing or invalid bearer token"

    def presented(self, metadata: Sequence[tuple[str, str | bytes]]) -> str:
        scheme, _, given = str(dict(metadata).get("authorization", "")).partition(" ")
        # The scheme name is case-insensitive (RFC 6750); the token is compared in constant time.
        return given if scheme.lower() == "bearer" else ""


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
    auth_token: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """Starts the Generation server with health checking and reflection.

    Returns:
        (server, bound port) — ``port=0`` picks a free one.

    Raises:
        ValueError: only one of ``tls_cert``/``tls_key``, or the port cannot be bound.
    """
    interceptors = [BearerTokenInterceptor(auth_token)] if auth_token else []
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
    "BearerTokenInterceptor",
    "GenerationServicer",
    "StopTrimmer",
    "StreamChunk",
    "default_max_prompt_bytes",
    "generation_handlers",
    "sampling_from_proto",
    "start_generation_server",
    "trimmed_stops",
]

