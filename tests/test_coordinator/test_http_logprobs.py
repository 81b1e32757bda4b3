"""Log probabilities on the OpenAI HTTP API, through the official ``openai`` client against a
live server (tiny random model, prompt lookup drafting): chat ``logprobs``/``top_logprobs``
and completions ``logprobs``/``echo`` in OpenAI's shapes, equal to the gRPC API's and to
``torch.log_softmax`` over the decoder's own forward, streamed equal to unary, the same with
and without speculation, lm-evaluation-harness's scoring request (``echo``, ``logprobs: 1``,
``max_tokens: 1``), ``max_tokens: 0`` scoring a prompt, and the bounds as 400s naming the
field."""

from __future__ import annotations

import grpc
import openai
import pytest
from service_harness import MODEL, LocalService
from test_logprobs import TOL, reference

from specd.v1 import generation_pb2

TOKEN = "logprob-token"
PROMPT_IDS = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 3, 40, 22]  # repeats: drafts accepted
MESSAGES = [{"role": "user", "content": "abcabcabcabc"}]


@pytest.fixture(scope="module")
def service():
    svc = LocalService(http=True, auth_token=TOKEN).start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service):
    with openai.OpenAI(base_url=f"http://{service.http_address}/v1", api_key=TOKEN,
                       max_retries=0, timeout=60) as c:
        yield c


def grpc_unary(service, req):
    channel, stub = service.stub()
    with channel:
        return stub.GenerateUnary(req, metadata=[("authorization", f"Bearer {TOKEN}")],
                                  timeout=60)


def token_text(service, token: int) -> str:
    return service.tokenizer.decode([token])


def test_chat_logprobs_equal_the_grpc_apis_and_the_decoders_log_softmax(service, client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 12
    req = generation_pb2.GenerateRequest(max_new_tokens=12, ignore_eos=True, logprobs=3)
    req.chat.messages.add(role="user", content=MESSAGES[0]["content"])
    grpc = grpc_unary(service, req)
    assert len(grpc.logprobs) == len(grpc.token_ids) == 12 and not grpc.prompt_logprobs
    prompt = service.http_api.servicer.parse(req)[0]
    ref = reference(service.decoder, prompt + list(grpc.token_ids)[:-1])
    for j, (entry, mine, token) in enumerate(zip(content, grpc.logprobs, grpc.token_ids,
                                                 strict=True)):
        assert mine.token_id == token
        assert entry.token == token_text(service, token)
        assert entry.bytes == list(entry.token.encode("utf-8"))
        row = ref[len(prompt) - 1 + j]
        assert entry.logprob == pytest.approx(float(row[token]), abs=TOL)
        assert mine.logprob == pytest.approx(entry.logprob, abs=TOL)
        assert len(entry.top_logprobs) == len(mine.top) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            row.topk(3).values.tolist(), abs=TOL)
        assert [t.token for t in entry.top_logprobs] == [
            token_text(service, t.token_id) for t in mine.top]
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=TOL)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 0.9, "seed": 7, "top_p": 0.95}])
def test_chat_streamed_logprobs_equal_the_unary_ones(client, sampling):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=20, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True}, **sampling)
    unary = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert len(streamed) == 20
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        unary.choices[0].message.content
    for a, b in zip(streamed, unary.choices[0].logprobs.content, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=TOL)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_chat_without_logprobs_answers_null(client):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                         temperature=0)
    assert out.choices[0].logprobs is None
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                         temperature=0, logprobs=True)
    assert [e.top_logprobs for e in out.choices[0].logprobs.content] == [[], [], []]


@pytest.mark.parametrize("prompt", [PROMPT_IDS, "hello hello hello"], ids=["ids", "text"])
def test_an_lm_eval_scoring_request_reads_the_prompts_log_probabilities(service, client,
                                                                        prompt):
    """lm-evaluation-harness's ``local-completions`` loglikelihood request: ``echo: true,
    logprobs: 1, max_tokens: 1, temperature: 0``, then ``token_logprobs[ctxlen:-1]`` summed
    and each compared with ``max(top_logprobs[i].values())`` (is it greedy)."""
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                    max_tokens=1, temperature=0)
    ids = prompt if isinstance(prompt, list) else service.tokenizer.encode(prompt)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[:len(ids)] == [token_text(service, t) for t in ids]
    echoed = prompt if isinstance(prompt, str) else service.tokenizer.decode(ids)
    assert choice.text.startswith(echoed) and len(choice.text) == len(echoed) + 1
    assert lp.text_offset == list(range(len(ids) + 1))  # one character per tiny token
    ref = reference(service.decoder, ids)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=TOL)
        top = lp.top_logprobs[j]
        # The alternative plus the token itself ("up to logprobs + 1" entries, keyed by
        # text: a more likely token with the same text keeps its own value).
        assert 1 <= len(top) <= 2 and top[lp.tokens[j]] >= lp.token_logprobs[j] - TOL
        assert max(top.values()) == pytest.approx(float(ref[j - 1].max()), abs=TOL)
    # The generated token's value is its row's maximum (greedy).
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=TOL)
    ctxlen = len(ids) // 2
    loglikelihood = sum(lp.token_logprobs[ctxlen:-1])
    expected = sum(float(ref[j - 1, ids[j]]) for j in range(ctxlen, len(ids)))
    assert loglikelihood == pytest.approx(expected, abs=TOL * len(ids))
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1


def test_echo_with_max_tokens_zero_scores_the_prompt_without_generating(service, client):
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, echo=True, logprobs=2,
                                    max_tokens=0)
    choice = out.choices[0]
    assert choice.text == service.tokenizer.decode(PROMPT_IDS)
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(PROMPT_IDS)
    ref = reference(service.decoder, PROMPT_IDS)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        [float(ref[j - 1, PROMPT_IDS[j]]) for j in range(1, len(PROMPT_IDS))], abs=TOL)
    # Echo alone (no logprobs) repeats the prompt too.
    plain = client.completions.create(model=MODEL, prompt="abc", echo=True, max_tokens=0)
    assert plain.choices[0].text == "abc" and plain.choices[0].logprobs is None


@pytest.mark.parametrize("echo", [True, False])
def test_streamed_completion_logprobs_equal_the_unary_ones(client, echo):
    kw = dict(model=MODEL, prompt=PROMPT_IDS, echo=echo, logprobs=2, max_tokens=10,
              temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    unary = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == unary.text
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.logprobs is not None:
            for name, values in joined.items():
                values.extend(getattr(c.logprobs, name))
    assert joined["tokens"] == unary.logprobs.tokens
    assert joined["text_offset"] == unary.logprobs.text_offset
    assert len(joined["tokens"]) == 10 + (len(PROMPT_IDS) if echo else 0)
    for a, b in zip(joined["token_logprobs"], unary.logprobs.token_logprobs, strict=True):
        assert a == b is None or a == pytest.approx(b, abs=TOL)
    for a, b in zip(joined["top_logprobs"], unary.logprobs.top_logprobs, strict=True):
        assert a == b is None or a.keys() == b.keys()


def test_values_are_the_same_with_and_without_speculation(client):
    kw = dict(model=MODEL, prompt=PROMPT_IDS, logprobs=3, max_tokens=24, temperature=0,
              echo=True)
    spec = client.completions.create(**kw)
    plain = client.completions.create(**kw, extra_body={"speculation": {"enabled": False}})
    assert spec.model_extra["speculation"]["accepted_tokens"] > 0
    assert plain.model_extra["speculation"]["drafted_tokens"] == 0
    a, b = spec.choices[0].logprobs, plain.choices[0].logprobs
    assert a.tokens == b.tokens
    assert a.token_logprobs[0] is None and b.token_logprobs[0] is None
    assert a.token_logprobs[1:] == pytest.approx(b.token_logprobs[1:], abs=TOL)
    assert [t.keys() for t in a.top_logprobs[1:]] == [t.keys() for t in b.top_logprobs[1:]]


@pytest.mark.parametrize("chat, fields, param", [
    (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    (True, {"top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    (True, {"logprobs": "yes"}, "logprobs"),
    (True, {"logprobs": 1}, "logprobs"),
    (False, {"logprobs": 6}, "logprobs"),
    (False, {"logprobs": -1}, "logprobs"),
    (False, {"logprobs": True}, "logprobs"),
    (False, {"max_tokens": 0}, "max_tokens"),
    (False, {"echo": "yes"}, "echo"),
])
def test_out_of_bounds_fields_get_400_naming_them(client, chat, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        if chat:
            client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                           **{"max_tokens": 3, **fields})
        else:
            client.completions.create(model=MODEL, prompt="abc", **{"max_tokens": 3, **fields})
    error = info.value.body
    assert error["param"] == param and error["message"].startswith(param), error


def test_grpc_streams_the_same_log_probabilities_as_its_unary_answer(service):
    req = generation_pb2.GenerateRequest(max_new_tokens=12, ignore_eos=True, logprobs=2,
                                         prompt_logprobs=1, seed=9)
    req.token_ids.ids.extend(PROMPT_IDS)
    req.sampling.temperature = 0.7
    unary = grpc_unary(service, req)
    channel, stub = service.stub()
    with channel:
        chunks = list(stub.Generate(req, metadata=[("authorization", f"Bearer {TOKEN}")],
                                    timeout=60))
    streamed = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token_id for lp in streamed] == list(unary.token_ids)
    assert [lp.logprob for lp in streamed] == pytest.approx(
        [lp.logprob for lp in unary.logprobs], abs=TOL)
    # The prompt's, on the first chunk only: every prompt token but the first.
    assert [len(c.prompt_logprobs) for c in chunks] == [len(PROMPT_IDS) - 1] + [0] * (
        len(chunks) - 1)
    assert [lp.token_id for lp in chunks[0].prompt_logprobs] == PROMPT_IDS[1:]
    assert [lp.token_id for lp in unary.prompt_logprobs] == PROMPT_IDS[1:]
    assert all(len(lp.top) == 1 for lp in unary.prompt_logprobs)
    bad = generation_pb2.GenerateRequest(max_new_tokens=3, logprobs=21)
    bad.token_ids.ids.extend(PROMPT_IDS)
    with pytest.raises(grpc.RpcError) as err:
        grpc_unary(service, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("logprobs")


def test_chat_bytes_of_tokens_that_split_a_character_join_into_its_utf8():
    """A byte-level BPE token holding part of a character decodes alone to U+FFFD; its
    ``bytes`` are the bytes it stands for, so a client can join them (OpenAI's purpose for
    the field)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from coordinator.front.openai_logprobs import chat_logprobs as _chat_logprobs
    from specd_core.logprobs import TokenLogprob

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["plain ascii text only"] * 4, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")
    text = "a \u20ac b<|end|>"
    ids = fast.encode(text, add_special_tokens=False)
    content = _chat_logprobs(fast, [TokenLogprob(t, -1.0, ((t, -1.0),)) for t in ids])["content"]
    assert "\ufffd" in [e["token"] for e in content]  # the euro sign's bytes, one per token
    assert bytes(b for e in content for b in e["bytes"]).decode() == text
    assert all(e["top_logprobs"][0]["bytes"] == e["bytes"] for e in content)


def test_streamed_chunks_whose_text_is_held_back_still_carry_their_log_probabilities():
    """Tokens that end inside a character have no text yet: their chunk carries their
    values with an empty delta, so the stream lists every token as the unary answer does."""
    from service_harness import SplitCharTokenizer

    svc = LocalService(http=True)
    svc.tokenizer = SplitCharTokenizer(svc.tokenizer)
    svc.start()
    try:
        with openai.OpenAI(base_url=f"http://{svc.http_address}/v1", api_key="x",
                           max_retries=0, timeout=60) as c:
            held = 0
            for seed in range(4):
                kw = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0,
                          seed=seed, logprobs=True, extra_body={"ignore_eos": True})
                unary = c.chat.completions.create(**kw)
                chunks = [ch.choices[0] for ch in c.chat.completions.create(stream=True, **kw)
                          if ch.choices]
                held += sum(1 for ch in chunks if ch.logprobs and not ch.delta.content)
                streamed = [e for ch in chunks if ch.logprobs for e in ch.logprobs.content]
                assert len(streamed) == len(unary.choices[0].logprobs.content) == 8
                assert [e.bytes for e in streamed] == [
                    e.bytes for e in unary.choices[0].logprobs.content]
            assert held, "no chunk's text was held back: the case was not exercised"
    finally:
        svc.stop()
