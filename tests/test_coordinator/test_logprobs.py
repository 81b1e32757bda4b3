"""Log probabilities through the scheduler that serves (`specd_core.logprobs`): each generated
and prompt token's value and top alternatives equal ``torch.log_softmax`` over the decoder's
own forward on the same ids, with drafts accepted and undrafted, greedy and seeded (dense and
sparse sampling rows), chunked or whole prompts; identical with and without speculation; a
prompt scored without generating; prefix reuse skipped for a request scoring its prompt; and
nothing shipped for requests that ask for none."""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_chunked_prefill import FLAT, LONG, RecordingTarget
from test_service import REPEATING

from coordinator.step.plan import ChunkPolicy
from coordinator.step.scheduler import Scheduler
from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.logprobs import RowLogprobs
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem, payload_bytes
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"
#: Packed and block forwards differ from one whole-sequence forward by float rounding only
#: (< 2e-6 measured on the tiny models); log-softmax keeps that scale.
TOL = 1e-4
SAMPLINGS = {
    "greedy": SamplingParams(),
    "dense": SamplingParams(temperature=0.8),              # full rows: every token can win
    "sparse": SamplingParams(temperature=1.0, top_k=5),    # sparse rows: the support only
}


@pytest.fixture(scope="module")
def decoder():
    return load_model(MODEL)[0]


def reference(decoder, ids: list[int]) -> torch.Tensor:
    """float32 ``[len(ids), vocab]``: log-softmax of one forward over ``ids`` from position 0
    (row ``i`` is the distribution of the token after ``ids[i]``)."""
    return torch.log_softmax(decoder.forward_batch(ids, 0, decoder.new_cache()).float(), -1)


def check_record(record, token: int, row: torch.Tensor, k: int) -> None:
    assert record.token == token
    assert record.logprob == pytest.approx(float(row[token]), abs=TOL)
    assert len(record.top) == k
    values = [v for _, v in record.top]
    assert values == pytest.approx(torch.topk(row, k).values.tolist(), abs=TOL)
    for t, v in record.top:  # each alternative is the token it claims (ties may reorder)
        assert v == pytest.approx(float(row[t]), abs=TOL)


def check_against_reference(decoder, prompt: list[int], decode, k: int) -> None:
    """Every recorded generated and prompt value against `reference`."""
    generated = decode.generated
    ref = reference(decoder, prompt + generated[:-1] if generated else prompt)
    if decode.options.logprobs is None:
        assert decode.token_logprobs == []
    else:
        assert len(decode.token_logprobs) == len(generated)
        for i, (token, record) in enumerate(zip(generated, decode.token_logprobs,
                                                strict=True)):
            check_record(record, token, ref[len(prompt) - 1 + i], k)
    if decode.options.prompt_logprobs is not None:
        assert len(decode.prompt_logprobs) == len(prompt)
        assert decode.prompt_logprobs[0] is None
        for j in range(1, len(prompt)):
            check_record(decode.prompt_logprobs[j], prompt[j], ref[j - 1],
                         decode.options.prompt_logprobs)


def decodes(decoder, prompts, options, drafter=True, chunking=None, engine=None):
    """Runs ``prompts`` through one scheduler (prompt lookup drafting unless ``drafter`` is
    False); returns (each request's `DecodeRequest`, the recording target)."""
    if isinstance(options, SpeculativeOptions):
        options = [options] * len(prompts)

    async def go():
        local = LocalDrafter(PromptLookupSpeculator(2, 6)) if drafter else None
        target = RecordingTarget(engine or TargetEngine(decoder, max_slots=len(prompts)))
        sched = Scheduler(target, local, max_active=len(prompts), adaptive=False,
                          cost_model=FLAT, pipeline=True, hidden_dtype=torch.float32,
                          chunking=chunking)
        reqs = [sched.submit(p, o) for p, o in zip(prompts, options, strict=True)]
        await sched.run_until_idle()
        await asyncio.sleep(0)
        for req in reqs:
            assert req.cause is None, req.cause
        return [r.decode for r in reqs], target

    return asyncio.run(go())


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
@pytest.mark.parametrize("drafter", [True, False], ids=["drafted", "undrafted"])
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_values_equal_log_softmax_of_the_decoders_own_forward(decoder, sampling, drafter,
                                                              chunk):
    prompts = [REPEATING, [11, 3, 40, 22, 17, 9, 31], LONG[:20]]
    options = [SpeculativeOptions(max_new_tokens=20, sampling=SAMPLINGS[sampling], seed=3 + i,
                                  logprobs=4, prompt_logprobs=4) for i in range(len(prompts))]
    found, target = decodes(decoder, prompts, options, drafter=drafter,
                            chunking=ChunkPolicy(chunk) if chunk else None)
    for prompt, decode in zip(prompts, found, strict=True):
        check_against_reference(decoder, prompt, decode, 4)
    if drafter and sampling == "greedy":
        # Values of accepted draft tokens were checked, not only of resampled ones.
        assert sum(d.result.accepted_tokens for d in found) > 0
    items = [i for call in target.calls for i in call]
    if chunk:
        assert any(isinstance(i, PrefillItem) and not i.last for i in items)
    if sampling == "dense":  # full rows shipped (any token may be sampled)
        assert all(out.logprobs.full is not None for out in _verify_outputs(decoder, options))


def _verify_outputs(decoder, options):
    """One verify step's outputs for a dense-sampling request asking for log probabilities."""
    engine = TargetEngine(decoder, max_slots=1)
    slot = engine.allocate()
    sampling, k = options[0].sampling, options[0].logprobs
    engine.step([PrefillItem(slot, [1, 2, 3], sampling)])
    return engine.step([VerifyItem(slot, 3, [4, 5, 6], sampling, logprobs=k)])


@pytest.mark.parametrize("sampling", ["greedy", "sparse"])
def test_identical_with_and_without_speculation(decoder, sampling):
    """Same tokens (a point-mass drafter keeps seeded output token-identical) and the same
    values, whether a token was an accepted draft, a resample or a plain step's."""
    prompts = [REPEATING, LONG[:30]]
    options = [SpeculativeOptions(max_new_tokens=24, sampling=SAMPLINGS[sampling], seed=5,
                                  logprobs=3, prompt_logprobs=2) for _ in prompts]
    spec, _ = decodes(decoder, prompts, options, drafter=True)
    plain, _ = decodes(decoder, prompts, options, drafter=False)
    assert sum(d.result.accepted_tokens for d in spec) > 0
    for a, b in zip(spec, plain, strict=True):
        assert a.generated == b.generated
        for x, y in zip(a.token_logprobs + a.prompt_logprobs[1:],
                        b.token_logprobs + b.prompt_logprobs[1:], strict=True):
            assert x.token == y.token
            assert x.logprob == pytest.approx(y.logprob, abs=TOL)
            assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=TOL)


def test_max_new_tokens_zero_scores_the_prompt_without_generating(decoder):
    prompt = LONG[:25]
    options = SpeculativeOptions(max_new_tokens=0, prompt_logprobs=1)
    found, target = decodes(decoder, [prompt], [options], chunking=ChunkPolicy(8))
    decode = found[0]
    assert decode.generated == [] and decode.result.finish_reason == "length"
    check_against_reference(decoder, prompt, decode, 1)
    assert not any(isinstance(i, VerifyItem) for call in target.calls for i in call)


def test_prefix_reuse_is_skipped_for_a_request_scoring_its_prompt(decoder):
    engine = TargetEngine(decoder, max_slots=2)
    prompt = LONG[:30]
    plain = SpeculativeOptions(max_new_tokens=4)
    decodes(decoder, [prompt], plain, drafter=False, engine=engine)
    decodes(decoder, [prompt], plain, drafter=False, engine=engine)
    hits = engine.stats["prefix_hits"]
    assert hits == 1  # the warm prefix was there to reuse
    scored = SpeculativeOptions(max_new_tokens=4, prompt_logprobs=0)
    found, _ = decodes(decoder, [prompt], [scored], engine=engine)
    assert engine.stats["prefix_hits"] == hits
    check_against_reference(decoder, prompt, found[0], 0)


def test_requests_without_logprobs_ship_none_and_compute_last_rows_only(decoder, monkeypatch):
    engine = TargetEngine(decoder, max_slots=2)
    a, b = engine.allocate(), engine.allocate()
    seen = []
    forward = decoder.forward_packed

    def spy(segments, last_only):
        seen.append(list(last_only))
        return forward(segments, last_only)

    # An instance attribute (undone after the test): the decoder keeps the rest.
    monkeypatch.setattr(decoder, "forward_packed", spy)
    greedy = SamplingParams()
    outs = engine.step([PrefillItem(a, LONG[:10], greedy),
                        PrefillItem(b, LONG[:10], greedy, prompt_logprobs=2, logprobs=2)])
    assert seen == [[True, False]]  # only the scoring prompt needs every row's logits
    assert outs[0].logprobs is None and isinstance(outs[1].logprobs, RowLogprobs)
    assert len(outs[1].logprobs) == 10
    plain = engine.step([VerifyItem(a, 10, [1, 2, 3], greedy)])[0]
    asked = engine.step([VerifyItem(b, 10, [1, 2, 3], greedy, logprobs=2)])[0]
    assert plain.logprobs is None
    # The greedy cost per verified row: 2 alternatives (4 + 4 bytes each), the argmax and
    # the draft (4 + 4 bytes each), 8 bytes of offset; under 50 bytes a row.
    extra = payload_bytes(asked) - payload_bytes(plain)
    assert 0 < extra <= 50 * 3


def test_log_probabilities_cross_the_replicas_step_channel_unchanged(decoder):
    """What a Ray replica ships (pickled over `target_worker.channel`) equals the engine's
    own output, dense rows included."""
    import numpy as np

    from coordinator.step.targets import LocalTarget
    from target_worker.actor import TargetActor
    from target_worker.channel import ChannelTarget

    actor = TargetActor(MODEL, max_slots=1, num_threads=1)
    address = actor.open_channel("127.0.0.1", "s3cret")
    dense = SAMPLINGS["dense"]

    async def steps(target):
        slot = await target.allocate()
        first = await target.prefill([PrefillItem(slot, LONG[:6], dense, logprobs=3,
                                                  prompt_logprobs=3, last=False,
                                                  next_token=LONG[6]),
                                      ])
        last = await target.prefill([PrefillItem(slot, LONG[6:9], dense, offset=6,
                                                 logprobs=3, prompt_logprobs=3)])
        out = await target.verify([VerifyItem(slot, 9, [4, 5, 6], dense, logprobs=3)])
        await target.free(slot)
        return [first[0].logprobs, last[0].logprobs, out[0].logprobs]

    async def both():
        channel = ChannelTarget(address, "s3cret")
        try:
            return (await steps(channel),
                    await steps(LocalTarget(TargetEngine(decoder, max_slots=1))))
        finally:
            await channel.close()

    remote, local = asyncio.run(both())
    for a, b in zip(remote, local, strict=True):
        assert isinstance(a, RowLogprobs) and len(a) == len(b)
        for name in ("top_ids", "top_logprobs", "offsets", "token_ids", "logprobs"):
            assert np.allclose(getattr(a, name), getattr(b, name), atol=TOL), name
        assert (a.full is None) == (b.full is None)
    assert remote[2].full is not None  # a dense verify ships whole rows
    assert len(remote[0]) == 6 and len(remote[1]) == 3
    assert remote[0].value(5, LONG[6]) == pytest.approx(local[0].value(5, LONG[6]), abs=TOL)


def test_a_prompt_chunk_scoring_its_prompt_needs_the_next_token(decoder):
    engine = TargetEngine(decoder, max_slots=1)
    slot = engine.allocate()
    for bad in (None, 64, -1):
        with pytest.raises(ValueError, match="next prompt token"):
            engine.step([PrefillItem(slot, LONG[:5], SamplingParams(), last=False,
                                     prompt_logprobs=1, next_token=bad)])
        assert engine.slot_length(slot) == 0  # refused before anything was fed
