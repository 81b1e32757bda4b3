"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client against a live
server (the tiny random model): models, chat and completions unary and streamed, equality with
the gRPC API, OpenAI-shaped errors, and a disconnect freeing the request's slot."""

from __future__ import annotations

import time

import openai
import pytest
from http_harness import MESSAGES, TOKEN, GatedService, httpx, sse_events
from service_harness import MODEL, LocalService, SplitCharTokenizer

from coordinator.front.http_api import OpenAIApi
from coordinator.front.http_server import start_http_server
from specd.v1 import generation_pb2


@pytest.fixture(scope="module")
def service():
    svc = GatedService(http=True, auth_token=TOKEN).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key=TOKEN,
                       max_retries=0, timeout=60) as c:
        yield c


def grpc_unary(service, req: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResult:
    channel, stub = service.stub()
    with channel:
        return stub.GenerateUnary(req, metadata=[("authorization", f"Bearer {TOKEN}")],
                                  timeout=60)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.9, "seed": 7, "top_p": 0.95}])
def test_chat_streamed_deltas_equal_the_unary_text(client, sampling):
    unary = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                           extra_body={"ignore_eos": True}, **sampling)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **sampling)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert unary.choices[0].message.content and text == unary.choices[0].message.content
    assert unary.choices[0].finish_reason == "length"
    finish = [c.choices[0].finish_reason for c in chunks if c.choices
              and c.choices[0].finish_reason]
    assert finish == ["length"]
    usage = chunks[-1].usage  # the include_usage chunk comes last, with no choices
    assert chunks[-1].choices == [] and usage.completion_tokens == 30
    assert usage.total_tokens == usage.prompt_tokens + 30
    # The same usage, but for the warm prefix the second of the two requests reused.
    streamed, answered = usage.model_dump(), unary.usage.model_dump()
    assert streamed.pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert answered.pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert streamed == answered
    spec = unary.model_extra["speculation"]
    assert spec["verification_steps"] >= 1 and spec["accepted_tokens"] <= spec["drafted_tokens"]


def test_completion_streamed_deltas_equal_the_unary_text(client):
    kw = dict(model=MODEL, prompt="xyzxyzxyzxyz", max_tokens=25, temperature=1.0, seed=3,
              extra_body={"ignore_eos": True, "top_k": 20})
    unary = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == unary.choices[0].text
    assert unary.usage.completion_tokens == 25 and len(unary.choices[0].text) == 25
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "speculation" in chunks[-1].model_extra


def test_greedy_and_seeded_text_equal_the_grpc_apis(service, client):
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 11, "min_p": 0.02}):
        req = generation_pb2.GenerateRequest(max_new_tokens=20, ignore_eos=True)
        req.chat.messages.add(role="user", content=MESSAGES[0]["content"])
        for name, value in sampling.items():
            if name == "seed":
                req.seed = value
            else:
                setattr(req.sampling, name, value)
        grpc_text = grpc_unary(service, req).text
        extra = {"ignore_eos": True, **({"min_p": 0.02} if "min_p" in sampling else {})}
        http = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=20, temperature=sampling["temperature"],
            seed=sampling.get("seed"), extra_body=extra)
        assert http.choices[0].message.content == grpc_text
        # A raw-text completion is the gRPC API's ``text`` prompt.
        raw = generation_pb2.GenerateRequest(text="hello hello", max_new_tokens=12,
                                             ignore_eos=True)
        raw.sampling.temperature = sampling["temperature"]
        if "seed" in sampling:
            raw.seed = sampling["seed"]
        completion = client.completions.create(
            model=MODEL, prompt="hello hello", max_tokens=12, temperature=sampling["temperature"],
            seed=sampling.get("seed"), extra_body={"ignore_eos": True})
        assert completion.choices[0].text == grpc_unary(service, raw).text


@pytest.mark.parametrize("kwargs, param", [
    ({"top_p": 2.0}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"repetition_penalty": 0.0}}, "repetition_penalty"),
    ({"extra_body": {"speculation": {"drafter": "nope"}}}, "speculation.drafter"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"extra_body": {"include_stop_str_in_output": "yes"}}, "include_stop_str_in_output"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "", "content": "x"}]},
     "messages[1].role"),
    ({"messages": [{"role": "user", "content": "hi", "name": 3}]}, "messages[0].name"),
    # The rules the gRPC API and `specd generate` apply too
    # (`coordinator.front.generation_request`).
    ({"extra_body": {"speculation": {"max_draft_len": 0}}}, "speculation.max_draft_len"),
    ({"extra_body": {"top_k": -2}}, "top_k"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"messages": []}, "messages"),
])
def test_bad_or_unsupported_fields_get_400_naming_them(client, kwargs, param):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("drafter, says", [
    ("suffix", "'suffix' is not served by this service"),  # specd has it; this service does not
    ("nope", "'nope' is unknown"),
])
def test_a_drafter_this_service_does_not_serve_is_named_as_such(client, drafter, says):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                       extra_body={"speculation": {"drafter": drafter}})
    message = info.value.body["message"]
    assert says in message and "'prompt-lookup'" in message, message
    assert ("unknown" in message) == (drafter == "nope"), message


def test_models_have_a_created_time_and_can_be_fetched_by_id(client):
    (card,) = client.models.list().data
    assert abs(card.created - time.time()) < 3600  # this run's start, not 0
    assert client.models.retrieve(MODEL).model_dump() == card.model_dump()
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_unknown_model_is_404_and_the_server_keeps_serving(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=3)
    assert info.value.body["param"] == "model" and info.value.body["code"] == "model_not_found"
    assert client.completions.create(model=MODEL, prompt="ab", max_tokens=3,
                                     temperature=0).choices[0].text


def test_a_bad_token_is_401_and_health_needs_none(service):
    base = f"http://{service.http_address}"
    with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
    assert info.value.status_code == 401
    assert set(info.value.body) == {"message", "type", "param", "code"}
    missing = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    # Checked before the body is read: a malformed or incomplete body without the token is
    # 401 too, never a 400 that describes the request.
    for body in ({"model": "x"}, {"bogus": 1}):
        assert httpx.post(base + "/v1/chat/completions", json=body).status_code == 401
    assert httpx.post(base + "/v1/completions", content=b"{x",
                      headers={"Content-Type": "application/json"}).status_code == 401
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/metrics").status_code == 401
    metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert metrics.status_code == 200 and "specd_replica_tokens_total" in metrics.text


def test_503_until_the_service_is_ready(service):
    """An API whose servicer is not set yet (the coordinator is still starting replicas)."""
    api = OpenAIApi(servicer=None)
    server, port = service.call(start_http_server(api))
    try:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                           max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as info:
                c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
            assert info.value.status_code == 503
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 503
        api.servicer = service.http_api.servicer
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
    finally:
        service.call(server.stop())


def test_a_client_that_disconnects_mid_stream_frees_its_slot(service):
    submitted = []
    submit = service.router.submit

    def recording_submit(*args, **kwargs):
        submitted.append(submit(*args, **kwargs))
        return submitted[-1]

    service.router.submit = recording_submit
    service.loop.call_soon_threadsafe(service.gate.clear)  # no step completes now
    try:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", f"http://{service.http_address}/v1/chat/completions",
                          json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                          timeout=30) as response:
            assert response.status_code == 200
            first = next(response.iter_lines())
            assert first.startswith("data: ")  # the role chunk: the request is running
        # The connection is closed: the server must cancel the request (the gate holds every
        # step, so it cannot have finished on its own).
        deadline = time.monotonic() + 20
        while not (submitted and submitted[0].cancelled) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert submitted and submitted[0].cancelled
    finally:
        service.router.submit = submit
        service.loop.call_soon_threadsafe(service.gate.set)
    deadline = time.monotonic() + 20
    while service.engine.used_slots and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.engine.used_slots == 0
    assert len(submitted[0].decode.generated) < 200




def test_streamed_text_never_ends_in_a_partial_character():
    svc = LocalService(http=True)
    svc.tokenizer = SplitCharTokenizer(svc.tokenizer)
    svc.start()
    try:
        cut = 0
        with openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="x",
                           max_retries=0) as c:
            for seed in range(8):
                req = generation_pb2.GenerateRequest(text="hello", max_new_tokens=6,
                                                     ignore_eos=True, seed=seed)
                req.sampling.temperature = 1.0
                channel, stub = svc.stub()
                with channel:
                    chunks = list(stub.Generate(req, timeout=60))
                    unary = stub.GenerateUnary(req, timeout=60)
                grpc_text = "".join(ch.text for ch in chunks)
                ids = [t for ch in chunks for t in ch.token_ids]
                cut += svc.tokenizer.decode(ids).endswith("\ufffd")
                http = "".join(ch.choices[0].text for ch in c.completions.create(
                    model=MODEL, prompt="hello", max_tokens=6, temperature=1.0, seed=seed,
                    stream=True, extra_body={"ignore_eos": True}))
                for text in (grpc_text, unary.text, http):
                    assert not text.endswith("\ufffd"), (seed, text)
                assert grpc_text == unary.text == http
        assert cut, "no output ended inside a character: the case was not exercised"
    finally:
        svc.stop()


# ---- stop strings (OpenAI semantics: the text ends before the stop string) ----

STOP_PROMPT = "qrst"


def _stop_in(text: str) -> tuple[str, int]:
    """A 3-character stop string from inside ``text`` (where its characters change, so it
    occurs late enough to leave text before it) and where it first occurs."""
    i = next(i for i in range(1, len(text) - 3) if text[i] != text[i + 1])
    stop = text[i:i + 3]
    cut = text.find(stop)
    assert cut > 0
    return stop, cut


def _stop_case(client) -> tuple[str, str, int]:
    """(greedy text, a stop string from its middle, where it first occurs). The tiny
    tokenizer decodes one character per token, so the token completing the stop string
    ends exactly at its end."""
    text = client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True}
                                     ).choices[0].text
    assert len(text) == 24
    return (text, *_stop_in(text))


def test_a_stop_string_ends_the_text_before_it_unary_and_streamed(service, client):
    text, stop, cut = _stop_case(client)
    kw = dict(model=MODEL, prompt=STOP_PROMPT, max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    unary = client.completions.create(**kw).choices[0]
    assert (unary.text, unary.finish_reason) == (text[:cut], "stop")
    # One token per step (no drafts), so the stop string arrives over several deltas: none
    # may carry a character the match later removes.
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, "stream": True,
            "ignore_eos": True, "speculation": {"enabled": False}}
    events = sse_events(service.http_address, "/v1/completions", body)
    deltas = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert "".join(deltas) == text[:cut] and len([d for d in deltas if d]) > 1
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    chat_text = chat.choices[0].message.content
    chat_stop, chat_cut = _stop_in(chat_text)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=chat_stop,
        stream=True, extra_body={"ignore_eos": True}))
    assert streamed == chat_text[:chat_cut]


def test_include_stop_str_in_output_keeps_the_stop_string(service, client):
    text, stop, cut = _stop_case(client)
    kw = dict(model=MODEL, prompt=STOP_PROMPT, max_tokens=24, temperature=0, stop=stop,
              extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    unary = client.completions.create(**kw).choices[0]
    assert (unary.text, unary.finish_reason) == (text[:cut + len(stop)], "stop")
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == unary.text


def test_the_grpc_api_keeps_stop_strings_unless_asked(service, client):
    text, stop, cut = _stop_case(client)
    req = generation_pb2.GenerateRequest(text=STOP_PROMPT, max_new_tokens=24,
                                         ignore_eos=True, stop=[stop])
    req.sampling.temperature = 0.0
    kept = grpc_unary(service, req)
    assert (kept.text, kept.finish_reason) == (text[:cut + len(stop)], "stop")
    req.include_stop_str_in_output = False
    trimmed = grpc_unary(service, req)
    assert (trimmed.text, trimmed.finish_reason) == (text[:cut], "stop")
    assert list(trimmed.token_ids) == list(kept.token_ids)  # token ids are never trimmed
    channel, stub = service.stub()
    with channel:
        chunks = list(stub.Generate(req, metadata=[("authorization", f"Bearer {TOKEN}")],
                                    timeout=60))
    assert "".join(c.text for c in chunks) == text[:cut]


# ---- n choices, message names ----

def test_n_choices_are_seeded_per_choice_and_reproducible(client):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=16, temperature=1.0,
              extra_body={"ignore_eos": True})
    both = client.chat.completions.create(n=2, seed=40, **kw)
    assert [c.index for c in both.choices] == [0, 1]
    texts = [c.message.content for c in both.choices]
    # Choice i samples with seed + i: each equals a single request with that seed.
    assert texts == [client.chat.completions.create(seed=40 + i, **kw).choices[0].message.content
                     for i in range(2)]
    assert texts[0] != texts[1]
    again = client.chat.completions.create(n=2, seed=40, **kw)
    assert [c.message.content for c in again.choices] == texts
    assert both.usage.completion_tokens == 32
    chunks = list(client.chat.completions.create(n=2, seed=40, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    streamed = ["", ""]
    finished = set()
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert streamed == texts and finished == {0, 1}
    assert chunks[-1].usage.completion_tokens == 32


def test_n_choices_without_a_seed_are_independent(client):
    out = client.completions.create(model=MODEL, prompt="xyz", max_tokens=20, temperature=1.0,
                                    n=3, extra_body={"ignore_eos": True})
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 60
    assert len(set(texts)) == 3  # 20 tokens from 64 at temperature 1: a tie is ~impossible


def test_a_message_name_reaches_the_chat_template(client):
    from coordinator.front.grpc_api import GenerationServicer
    from coordinator.front.openai_request import ChatBody
    from coordinator.front.openai_request import generation_request as grpc_request

    seen = []

    class Recording:
        eos_token_id = 0

        def apply_chat_template(self, messages, **kwargs):
            seen.append([dict(m) for m in messages])
            return "x"

        def encode(self, text, add_special_tokens=True):
            return [1]

    servicer = GenerationServicer(None, Recording(), vocab_size=64, max_seq_len=256,
                                  drafter_name="none", model_name=MODEL, max_prompt_bytes=100)
    req, _ = grpc_request(ChatBody.model_validate({"model": MODEL, "max_tokens": 3, "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi", "name": "ann"}]}))
    servicer.parse(req)
    assert seen == [[{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": "hi", "name": "ann"}]]
    # A template that does not use it (the tiny model's) just ignores it.
    named = [{"role": "user", "content": MESSAGES[0]["content"], "name": "ann"}]
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert client.chat.completions.create(messages=named, **kw).choices[0].message.content == \
        client.chat.completions.create(messages=MESSAGES, **kw).choices[0].message.content


def test_the_stop_trimmer_holds_back_only_what_could_start_a_stop_string():
    import random

    from coordinator.front.gateway import StopTrimmer

    t = StopTrimmer(["bcd", "xy"])
    assert [t.push(d) for d in ("ab", "c", "e", "bx", "z")] == ["a", "", "bce", "b", "xz"]
    assert t.flush() == "" and not t.stopped
    t = StopTrimmer(["bcd"])
    assert [t.push(d) for d in ("ab", "cdef")] == ["a", ""] and t.stopped
    # Random texts and deltas, fed until a stop string completes (generation ends there):
    # the deltas joined are the text before the earliest match, and none is taken back.
    rng = random.Random(0)
    for _ in range(500):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(2)]
        text = "".join(rng.choices("abc", k=rng.randint(0, 20)))
        t = StopTrimmer(stops)
        out = seen = expected = ""
        while len(seen) < len(text) and not t.stopped:
            delta = text[len(seen):len(seen) + rng.randint(1, 3)]
            seen += delta
            matches = [i for i in (seen.find(s) for s in stops) if i >= 0]
            expected = seen[:min(matches)] if matches else seen
            out += t.push(delta)
            assert expected.startswith(out)
            assert t.stopped == bool(matches)
        out += t.flush()
        assert out == expected
        if not t.stopped:  # nothing held back was a stop string after all
            assert out == text
