"""A failure stays with its request: sampling never raises on legal parameters, one request's
fault (admission, prefill, verify, the rule) fails that request alone and frees its slot and
drafter state, big prompts are refused before tokenizing and tokenized off the event loop,
and malformed request bytes are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_harness import LocalService, run_in_thread
from test_service import REPEATING, solo
from test_service import request as make_request

from specd.v1 import generation_pb2
from specd_core.draft import DraftDist
from specd_core.request import DecodeRequest, SpeculativeDecodeResult
from specd_core.rule import target_rows
from specd_core.sampling import Sampler, SamplingParams, greedy_tokens, sampling_distributions
from target_worker.engine import TargetEngine

# ---- sampling: no legal input raises ----

GREEDY_TEMPERATURE = 1e-5  # specd_core.sampling.GREEDY_TEMPERATURE (vLLM's _SAMPLING_EPS)

TEMPERATURES = [0.0, 1e-45, 1e-40, 1e-20, 1e-6, 9.99e-6, GREEDY_TEMPERATURE, 1e-3, 0.7, 1.0,
                50.0, 1e30, 1.7e308]
REPETITION = [0.01, 0.5, 1.0, 1.3, 100.0]
PENALTIES = [-2.0, 0.0, 2.0]
TOP_K = [0, 1, 2, 63, 64, 10**9]
TOP_P = [5e-324, 1e-6, 0.5, 1.0]
MIN_P = [0.0, 5e-324, 0.5, 1.0]
LOGIT_SCALES = [0.0, 1e-30, 1.0, 30.0, 1e4, 1e8]


def _check_rows(probs: torch.Tensor, vocab: int) -> None:
    assert probs.shape[-1] == vocab
    assert bool(torch.isfinite(probs).all()), "a row has a non-finite probability"
    assert bool((probs >= 0).all()), "a row has a negative probability"
    torch.testing.assert_close(probs.double().sum(-1), torch.ones(probs.shape[0],
                                                                  dtype=torch.float64))


def test_extreme_legal_parameters_always_give_valid_distributions_and_samples():
    """Seeded random combinations of the extremes of every legal range, over logits from all
    zeros (ties everywhere) to huge: every row is a distribution and every sampling path (the
    bonus draw, the rule against a point-mass and a spread draft) returns a token."""
    vocab, rng = 64, random.Random(1234)
    for case in range(400):
        params = SamplingParams(
            temperature=rng.choice(TEMPERATURES), top_k=rng.choice(TOP_K),
            top_p=rng.choice(TOP_P), min_p=rng.choice(MIN_P),
            repetition_penalty=rng.choice(REPETITION),
            presence_penalty=rng.choice(PENALTIES), frequency_penalty=rng.choice(PENALTIES))
        gen = torch.Generator().manual_seed(case)
        n = rng.randint(1, 5)
        logits = torch.randn(n, vocab, generator=gen) * rng.choice(LOGIT_SCALES)
        history = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        prompt = rng.randint(0, len(history))
        block = [rng.randrange(vocab) for _ in range(n - 1)]
        where = f"case {case}: {params}, logit scale {logits.abs().max():.3g}"
        probs = sampling_distributions(logits, params, history, prompt, block)
        try:
            _check_rows(probs, vocab)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        if params.greedy:
            assert greedy_tokens(logits, params, history, prompt, block) == \
                probs.argmax(-1).tolist(), where
        rows = target_rows(logits, params, history, prompt, block)
        sampler = Sampler(case)
        spread = DraftDist.from_dense(torch.softmax(torch.randn(vocab, generator=gen), 0))
        for i in range(n):
            for token in (rows.sample(i, sampler),
                          rows.judge(i, 3, DraftDist.deterministic(3), sampler),
                          rows.judge(i, 5, spread, sampler)):
                assert token is None or 0 <= token < vocab, where
                if token is not None:
                    assert probs[i, token] > 0, f"{where}: drew a zero-probability token"


def test_temperature_below_the_epsilon_is_greedy_everywhere():
    for t in (1e-45, 1e-40, 9.99e-6):
        params = SamplingParams(temperature=t, top_k=3, top_p=0.5)
        assert params.greedy and params.temperature == 0.0
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


@pytest.mark.parametrize("value", [1e-45, 1e-3, 0.0099, 100.01, 1e45])
def test_a_repetition_penalty_that_would_overflow_is_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=r"repetition_penalty=.*must be in \[0.01, 100\]"):
        SamplingParams(temperature=1.0, repetition_penalty=value)


# ---- one request's fault fails that request alone ----

POISON_VERIFY_SEED = 660001  # on_verify raises for requests with this seed (injected fault)
POISON_PREFILL_SEED = 660002  # on_prefill raises
MARKER = [60, 61, 62, 63, 60, 61]  # the engine refuses / fails calls carrying this prompt
GOOD = [
    make_request(REPEATING, max_new=150),
    make_request([11, 3, 40, 22, 17, 9, 31], max_new=150, seed=4, temperature=0.9),
    make_request([1, 2, 3, 1, 2, 3], max_new=150, repetition_penalty=1.3,
                 frequency_penalty=0.5),
    make_request([9, 9, 9, 9], max_new=150, seed=11, temperature=1.2, min_p=0.05),
]


def _wait_for(condition, what: str, timeout_s: float = 60.0):
    """Polls ``condition`` (a cheap check) until it holds; fails naming ``what`` at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    tick = threading.Event()
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        tick.wait(0.01)


def _stream(svc, req, started: threading.Event | None = None, timeout_s: float = 120):
    """Runs one stream: (tokens, final chunk, None) or (tokens, None, grpc.RpcError)."""
    channel, stub = svc.stub()
    tokens = []
    with channel:
        try:
            final = None
            for chunk in stub.Generate(req, timeout=timeout_s):
                tokens.extend(chunk.token_ids)
                final = chunk
                if started is not None:
                    started.set()
            return tokens, final, None
        except grpc.RpcError as err:
            return tokens, None, err
        finally:
            if started is not None:
                started.set()


def _assert_client_safe(err: grpc.RpcError) -> None:
    """The status message names no internals (exception text, class names, paths, pids)."""
    details = err.details()
    assert details and "request" in details
    for leak in ("injected", "secret", "pid", "Error", "Traceback", "slot"):
        assert leak not in details, f"{leak!r} leaked into {details!r}"


def _healthy_and_empty(svc) -> None:
    channel, stub = svc.stub()
    with channel:
        def drained():
            s = stub.Status(generation_pb2.StatusRequest(), timeout=10)
            return (s.used_slots == 0 and s.active_requests == 0 and s.waiting_requests == 0
                    and all(e.used_slots == 0 for e in svc.engines.values()))
        _wait_for(drained, "every slot to be freed")
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        good = stub.GenerateUnary(GOOD[0], timeout=60)
        assert list(good.token_ids) == solo(svc, GOOD[0])


@pytest.fixture()
def faulty(monkeypatch):
    """A service whose DecodeRequest raises inside on_verify / on_prefill for the poison seeds;
    records how many requests were decoding on the replica when on_verify raised."""
    svc = LocalService(max_active=16).start()
    svc.coactive_at_fault = []
    on_verify, on_prefill = DecodeRequest.on_verify, DecodeRequest.on_prefill

    def faulty_verify(self, *args, **kwargs):
        if self.options.seed == POISON_VERIFY_SEED:
            svc.coactive_at_fault.append(
                sum(len(r.scheduler.active) for r in svc.router.replicas.values()))
            raise RuntimeError("injected fault in on_verify at /secret/path pid 1234")
        return on_verify(self, *args, **kwargs)

    def faulty_prefill(self, *args, **kwargs):
        if self.options.seed == POISON_PREFILL_SEED:
            raise ValueError("cannot sample from a distribution with no positive mass")
        return on_prefill(self, *args, **kwargs)

    monkeypatch.setattr(DecodeRequest, "on_verify", faulty_verify)
    monkeypatch.setattr(DecodeRequest, "on_prefill", faulty_prefill)
    yield svc
    svc.stop()


def _start_good(svc) -> tuple[list[list[int]], list]:
    expected = [solo(svc, r) for r in GOOD]
    started = [threading.Event() for _ in GOOD]
    futures = [run_in_thread(_stream, svc, r, e) for r, e in zip(GOOD, started, strict=True)]
    for e in started:
        assert e.wait(60), "a good stream never started"
    return expected, futures


def _check_good(expected, futures) -> None:
    for i, (want, future) in enumerate(zip(expected, futures, strict=True)):
        tokens, final, err = future.result(timeout=120)
        assert err is None, f"good stream {i} failed beside the poison: {err.code()} " \
                            f"{err.details()}"
        assert tokens == want, f"good stream {i} changed beside the poison"
        assert final.finish_reason == "length"


def test_poison_requests_fail_alone_free_their_slots_and_the_service_keeps_serving(faulty):
    svc = faulty
    expected, futures = _start_good(svc)
    tiny_t = make_request(REPEATING, max_new=20, temperature=1e-45, top_k=5)
    penalty = make_request(REPEATING, max_new=20, temperature=1.0, repetition_penalty=1e-45)
    in_verify = make_request(REPEATING, max_new=20, seed=POISON_VERIFY_SEED)
    in_prefill = make_request(REPEATING, max_new=20, seed=POISON_PREFILL_SEED)
    poison = [run_in_thread(_stream, svc, r) for r in (tiny_t, penalty, in_verify, in_prefill)]
    _check_good(expected, futures)
    results = [f.result(timeout=120) for f in poison]

    # temperature 1e-45 is greedy: served, token-identical to the greedy request.
    tokens, final, err = results[0]
    assert err is None and tokens == solo(svc, make_request(REPEATING, max_new=20))
    # repetition_penalty 1e-45 would overflow: refused naming the field.
    _, _, err = results[1]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "repetition_penalty" in err.details()
    # Faults inside on_verify / on_prefill: INTERNAL with a message carrying no internals.
    for _, _, err in results[2:]:
        assert err is not None and err.code() == grpc.StatusCode.INTERNAL
        _assert_client_safe(err)
    assert svc.coactive_at_fault and max(svc.coactive_at_fault) > 1, \
        "the on_verify fault never fired beside another request"
    _healthy_and_empty(svc)

    # 40 more poison requests (more than the 16 slots): every one answered, none leaks.
    more = [make_request(REPEATING, max_new=8,
                         seed=(POISON_VERIFY_SEED, POISON_PREFILL_SEED)[i % 2])
            for i in range(40)]
    for future in [run_in_thread(_stream, svc, r) for r in more]:
        _, _, err = future.result(timeout=120)
        assert err is not None and err.code() == grpc.StatusCode.INTERNAL
    _healthy_and_empty(svc)


def _engine_fault(monkeypatch, kind: str, exc_type: type[Exception]) -> None:
    """Makes a target step (`TargetEngine.step`: verify blocks and prompt chunks in one call)
    raise ``exc_type`` when it holds an item of ``kind`` ("prefill": a prompt chunk,
    "verify": a verify block) of a request whose prompt is `MARKER` (as a per-item
    validation error or a whole-call failure)."""
    from specd_core.step import PrefillItem

    original = TargetEngine.step

    def faulty(self, items):
        for item in items:
            if isinstance(item, PrefillItem) != (kind == "prefill"):
                continue
            tokens = item.tokens if kind == "prefill" else self._slots[item.slot].tokens
            if list(tokens[:len(MARKER)]) == MARKER:
                raise exc_type(f"slot {item.slot}: injected {kind} fault")
        return original(self, items)

    monkeypatch.setattr(TargetEngine, "step", faulty)


@pytest.mark.parametrize("method,exc_type,code,beside", [
    # A per-item refusal of a batched verify: retried one by one, only the offender fails.
    ("verify", ValueError, grpc.StatusCode.INTERNAL, True),
    # The same for a prompt chunk sharing a step with the good requests' verify blocks.
    ("prefill", ValueError, grpc.StatusCode.INTERNAL, True),
    # A step carrying the poison's prompt fails as a whole (not a validation error): every
    # request in it fails (here the poison alone), the service serves the next ones.
    ("prefill", RuntimeError, grpc.StatusCode.UNAVAILABLE, False),
    # The batched verify fails as a whole: every request in it fails (here the poison alone:
    # any request beside it shares its call), the service serves the next ones.
    ("verify", RuntimeError, grpc.StatusCode.UNAVAILABLE, False),
])
def test_a_failing_target_call_fails_only_the_requests_in_it(monkeypatch, method, exc_type,
                                                             code, beside):
    svc = LocalService(max_active=16).start()
    try:
        expected = [solo(svc, r) for r in GOOD]
        _engine_fault(monkeypatch, method, exc_type)
        futures = []
        if beside:
            started = [threading.Event() for _ in GOOD]
            futures = [run_in_thread(_stream, svc, r, e)
                       for r, e in zip(GOOD, started, strict=True)]
            for e in started:
                assert e.wait(60), "a good stream never started"
        _, _, err = _stream(svc, make_request(MARKER, max_new=20))
        assert err is not None and err.code() == code
        _assert_client_safe(err)
        if beside:
            _check_good(expected, futures)
        _healthy_and_empty(svc)
    finally:
        svc.stop()


@pytest.mark.parametrize("where", ["job", "pool"])
def test_a_request_whose_drafting_fails_decodes_undrafted_and_the_others_keep_drafting(
        monkeypatch, where):
    """Building the poison's propose job raises, or the drafter pool refuses any batch holding
    it (ValueError: bad job, nothing sent): the poison is still served, token-identical (drafts
    never change tokens), and the good streams are unaffected."""
    import drafter_worker.client as client
    from coordinator.cluster.drafter_pool import DrafterPool

    svc = LocalService(max_active=16).start()
    try:
        expected = [solo(svc, r) for r in GOOD]
        poison = make_request(MARKER + MARKER, max_new=40)
        want = solo(svc, poison)

        def is_poison(job) -> bool:
            return list(job.history[:len(MARKER)]) == MARKER

        if where == "job":
            real = client.ProposeJob

            def job(**kwargs):
                made = real(**kwargs)
                if is_poison(made):
                    raise RuntimeError("injected fault building a propose job")
                return made

            monkeypatch.setattr(client, "ProposeJob", job)
        else:
            propose = DrafterPool.propose

            async def refusing(self, jobs):
                if len(jobs) > 0 and any(is_poison(j) for j in jobs):
                    raise ValueError("injected: a job the drafter client refuses")
                return await propose(self, jobs)

            monkeypatch.setattr(DrafterPool, "propose", refusing)
        started = [threading.Event() for _ in GOOD]
        futures = [run_in_thread(_stream, svc, r, e) for r, e in zip(GOOD, started, strict=True)]
        for e in started:
            assert e.wait(60), "a good stream never started"
        tokens, final, err = _stream(svc, poison)
        assert err is None, f"the poison failed: {err.code()} {err.details()}"
        assert tokens == want
        _check_good(expected, futures)
        # The good greedy stream, on a repeating prompt, still drafted and accepted.
        _, final, _ = _stream(svc, GOOD[0])
        assert final.speculation.accepted_tokens > 0
        _healthy_and_empty(svc)
    finally:
        svc.stop()


def test_status_counts_a_slot_held_while_its_request_is_being_admitted():
    from coordinator.step.scheduler import Scheduler
    from coordinator.step.targets import LocalTarget
    from specd_core.request import SpeculativeOptions
    from target_worker.loader import load_model

    decoder, _ = load_model("tiny-random:vocab=64,seed=0,layers=2")

    async def main():
        engine = TargetEngine(decoder, max_slots=4)
        entered, gate = asyncio.Event(), asyncio.Event()

        class SlowPrefill(LocalTarget):
            async def prefill(self, items):
                entered.set()
                await gate.wait()
                return await super().prefill(items)

        scheduler = Scheduler(SlowPrefill(engine), adaptive=False)
        scheduler.start()
        req = scheduler.submit([1, 2, 3], SpeculativeOptions(max_new_tokens=3))
        await asyncio.wait_for(entered.wait(), 30)
        assert engine.used_slots == 1
        assert scheduler.status()["used_slots"] == 1, "an allocated slot is not reported"
        gate.set()
        while not isinstance(await asyncio.wait_for(req.events.get(), 30),
                             SpeculativeDecodeResult):
            pass
        assert scheduler.status()["used_slots"] == engine.used_slots == 0
        await scheduler.close()

    asyncio.run(main())


# ---- admission cannot stall the loop ----

class GatedTokenizer:
    """The tiny tokenizer, except that encoding a text containing ``BLOCK`` waits until
    ``release`` is set (``entered`` is set first); counts every encode call."""

    def __init__(self, inner):
        self.inner = inner
        self.entered, self.release = threading.Event(), threading.Event()
        self.encodes = 0
        self.crash_decode = False

    def encode(self, text, add_special_tokens=True):
        self.encodes += 1
        if "CRASH" in text:
            raise RuntimeError("injected tokenizer crash at /secret/path")
        if "BLOCK" in text:
            self.entered.set()
            assert self.release.wait(120), "the test never released the tokenizer"
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens=False):
        if self.crash_decode:
            raise RuntimeError("injected decode crash at /secret/path")
        return self.inner.decode(ids, skip_special_tokens)

    def apply_chat_template(self, messages, **kwargs):
        from jinja2.exceptions import TemplateError

        if any(m["content"] == "REFUSE" for m in messages):
            raise TemplateError("Conversation roles must alternate user/assistant")
        return self.inner.apply_chat_template(messages, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture()
def gated():
    svc = LocalService()
    svc.tokenizer = GatedTokenizer(svc.tokenizer)  # what the servicer will tokenize with
    svc.start()
    yield svc
    svc.tokenizer.release.set()
    svc.stop()


@pytest.mark.parametrize("kind", ["text", "chat"])
def test_a_prompt_being_tokenized_does_not_stall_other_streams(gated, kind):
    svc, tok = gated, gated.tokenizer
    blocked = generation_pb2.GenerateRequest(max_new_tokens=4, ignore_eos=True)
    if kind == "text":
        blocked.text = "BLOCK the loop"
    else:
        blocked.chat.messages.add(role="user", content="BLOCK the loop")
    slow = run_in_thread(_unary, svc, blocked)
    try:
        assert tok.entered.wait(30), "the blocked prompt was never tokenized"
        # While its tokenizer call is stuck, another stream runs to completion.
        req = make_request(REPEATING, max_new=30)
        tokens, final, err = _stream(svc, req, timeout_s=20)
        assert err is None, f"the other stream stalled behind tokenizing: {err.code()}"
        assert tokens == solo(svc, req) and final.finish_reason == "length"
        assert not slow.done()
    finally:
        tok.release.set()
    reply, err = slow.result(timeout=60)
    assert err is None and len(reply.token_ids) == 4


def _unary(svc, req):
    channel, stub = svc.stub()
    with channel:
        try:
            return stub.GenerateUnary(req, timeout=60), None
        except grpc.RpcError as err:
            return None, err


def test_tokenizer_failures_answer_their_request_with_a_clear_status(gated):
    svc, tok = gated, gated.tokenizer
    crash = generation_pb2.GenerateRequest(max_new_tokens=4, text="CRASH")
    refused = generation_pb2.GenerateRequest(max_new_tokens=4)
    refused.chat.messages.add(role="user", content="REFUSE")
    channel, stub = svc.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as err:  # encoding raised: internal, no details
            stub.GenerateUnary(crash, timeout=30)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        _assert_client_safe(err.value)
        with pytest.raises(grpc.RpcError) as err:  # the chat template refused the messages
            stub.GenerateUnary(refused, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == ("chat: the model's chat template refused the messages: "
                                       "Conversation roles must alternate user/assistant")
        tok.crash_decode = True  # detokenizing the stream's text raises
        try:
            for rpc in (lambda: list(stub.Generate(make_request(REPEATING), timeout=30)),
                        lambda: stub.GenerateUnary(make_request(REPEATING), timeout=30)):
                with pytest.raises(grpc.RpcError) as err:
                    rpc()
                assert err.value.code() == grpc.StatusCode.INTERNAL
                _assert_client_safe(err.value)
        finally:
            tok.crash_decode = False
    _healthy_and_empty(svc)


def test_a_prompt_over_the_size_cap_is_refused_before_tokenizing(gated):
    from coordinator.front.grpc_api import GenerationServicer, start_generation_server

    svc, tok = gated, gated.tokenizer
    servicer = GenerationServicer(svc.scheduler, tok, 64, 256, "prompt-lookup", "tiny",
                                  max_prompt_bytes=1000)
    server, port = svc.call(start_generation_server(servicer, "127.0.0.1", 0))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            from specd.v1 import generation_pb2_grpc

            stub = generation_pb2_grpc.GenerationStub(channel)
            before = tok.encodes
            for over in ("é" * 501, "x" * 1001):  # 1002 and 1001 UTF-8 bytes
                big = generation_pb2.GenerateRequest(max_new_tokens=2, text=over)
                with pytest.raises(grpc.RpcError) as err:
                    stub.GenerateUnary(big, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("text: the prompt is over 1000 bytes")
                chat = generation_pb2.GenerateRequest(max_new_tokens=2)
                chat.chat.messages.add(role="user", content=over[:300])
                chat.chat.messages.add(role="user", content=over[300:])
                with pytest.raises(grpc.RpcError) as err:
                    stub.GenerateUnary(chat, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("chat: the prompt is over 1000 bytes")
                # A role is one of a few short names, refused otherwise (as over HTTP),
                # before tokenizing, its echo cut short.
                role = generation_pb2.GenerateRequest(max_new_tokens=2)
                role.chat.messages.add(role=over, content="hi")
                with pytest.raises(grpc.RpcError) as err:
                    stub.GenerateUnary(role, timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert err.value.details().startswith("chat.messages[0].role: ")
                assert "is not a chat role" in err.value.details()
                assert len(err.value.details()) < 200
            assert tok.encodes == before, "an over-cap prompt was tokenized"
            ok = stub.GenerateUnary(generation_pb2.GenerateRequest(
                max_new_tokens=2, text="é" * 100, ignore_eos=True), timeout=30)
            assert len(ok.token_ids) == 2
    finally:
        svc.call(server.stop(None))


def test_the_default_size_cap_admits_a_full_context_of_the_longest_token():
    from coordinator.front.grpc_api import MAX_MESSAGE_BYTES, GenerationServicer
    from coordinator.step.errors import RequestInvalid as InvalidRequest

    class Vocab:
        def get_vocab(self):
            return {"a": 0, "Ġthe": 1, "<|im_start|>": 2, "ééé": 3}

    servicer = GenerationServicer(None, Vocab(), 4, 100, "none", "fake")
    # The longest entry (12 bytes) repeated to fill the context is admitted ...
    servicer._check_size("text", ["<|im_start|>" * 100])
    servicer._check_size("chat", ["<|im_start|>" * 50, "<|im_start|>" * 50])
    # ... anything longer cannot fit the context whatever it tokenizes to, and is refused
    # well below the transport's 64 MB limit.
    with pytest.raises(InvalidRequest, match="over 1200 bytes"):
        servicer._check_size("text", ["x" * 1201])
    assert servicer.max_prompt_bytes == 1200 < MAX_MESSAGE_BYTES
    with pytest.raises(ValueError, match="max_prompt_bytes"):
        GenerationServicer(None, Vocab(), 4, 100, "none", "fake", max_prompt_bytes=0)


def test_the_size_cap_is_configurable_from_the_cli():
    from specd_tools.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-prompt-bytes", "4096"])
    assert args.max_prompt_bytes == 4096
    assert build_parser().parse_args(["serve"]).max_prompt_bytes is None


# ---- malformed request bytes ----

@pytest.fixture(scope="module")
def plain():
    svc = LocalService().start()
    yield svc
    svc.stop()


@pytest.mark.parametrize("method", ["GenerateUnary", "Generate", "Status"])
@pytest.mark.parametrize("garbage", [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x08"])
def test_malformed_request_bytes_are_invalid_argument(plain, method, garbage):
    svc = plain
    with grpc.insecure_channel(svc.address) as channel:
        path = f"/specd.v1.Generation/{method}"
        if method == "Generate":
            call = channel.unary_stream(path, request_serializer=None,
                                        response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                list(call(garbage, timeout=30))
        else:
            call = channel.unary_unary(path, request_serializer=None,
                                       response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(garbage, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        name = "StatusRequest" if method == "Status" else "GenerateRequest"
        assert err.value.details() == f"malformed request: not a valid specd.v1.{name}"
    _healthy_and_empty(svc)
