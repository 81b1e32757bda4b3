"""The target engine: batched requests through slots equal each request decoded alone; slot
bookkeeping; the tiny-random test model; the actor body (called directly, without Ray)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from drafters import OracleDrafter, TopKSamplingDrafter, plain_decode, tiny_decoder

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock, DraftDist, drafter_capabilities
from specd_core.request import DecodeRequest, SpeculativeOptions
from specd_core.rule import GreedyRows, ProbRows, SparseProbRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem
from target_worker.actor import TargetActor
from target_worker.config import ModelConfig
from target_worker.engine import TargetEngine
from target_worker.loader import load_model, resolve_dtype
from target_worker.model import Decoder
from target_worker.testing import TinyTokenizer

VOCAB = 24


class RandomDrafter:
    """Random blocks of 0..5 tokens from its own seeded generator: deterministic ones, or
    honestly sampled from a random spread distribution that it reports."""

    def __init__(self, seed: int, spread: bool):
        self.rng = np.random.default_rng(seed)
        self.spread = spread

    def propose(self, history, target_hidden, max_len):
        tokens, dists = [], []
        for _ in range(int(self.rng.integers(0, 6))):
            if self.spread:
                support = self.rng.choice(VOCAB, size=4, replace=False)
                q = self.rng.dirichlet(np.ones(4))
                tokens.append(int(support[self.rng.choice(4, p=q)]))
                dists.append(DraftDist.from_support(zip(support.tolist(), q.tolist(),
                                                        strict=True)))
            else:
                token = int(self.rng.integers(0, VOCAB))
                tokens.append(token)
                dists.append(DraftDist.deterministic(token))
        return DraftBlock(tokens, dists)


class HiddenRecorder:
    """Prompt lookup that conditions on nothing but records the target hidden rows it gets."""

    def __init__(self):
        self.inner = PromptLookupSpeculator(2, 4)
        self.seen: list[torch.Tensor | None] = []

    def propose(self, history, target_hidden, max_len):
        self.seen.append(target_hidden)
        return self.inner.propose(history, target_hidden, max_len)


@dataclass
class Case:
    prompt: list[int]
    options: SpeculativeOptions
    drafter: object  # a factory: called once per run so both runs start from the same state


def _cases(decoder: Decoder, draft_model: Decoder) -> list[Case]:
    def opts(max_new, **sampling):
        seed = sampling.pop("seed", 0)
        stops = sampling.pop("stop", ())
        return SpeculativeOptions(max_new_tokens=max_new, sampling=SamplingParams(**sampling),
                                  seed=seed, stop_token_ids=stops)

    rep = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 3, 1, 4, 1, 5]
    # Greedy from [11, 12, 13] first emits 22 at output index 16, inside an all-accepted
    # oracle block (k=5): a stop in the middle of a verified block.
    truth = plain_decode(decoder, [11, 12, 13], 30)
    return [
        Case(rep, opts(20), lambda: PromptLookupSpeculator(2, 4)),
        Case([7, 7, 2, 9], opts(17, repetition_penalty=1.4), lambda: RandomDrafter(1, False)),
        Case(rep[:9], opts(24, temperature=0.9, top_k=5, seed=11),
             lambda: TopKSamplingDrafter(draft_model, 3, 4, seed=5)),
        Case([1, 2, 3, 1, 2, 3, 1, 2], opts(22, temperature=1.2, top_p=0.8, seed=3,
                                            presence_penalty=0.6, frequency_penalty=0.4),
             lambda: RandomDrafter(2, True)),
        Case([5, 6], opts(15, temperature=1.0, seed=8), lambda: RandomDrafter(3, True)),
        Case(rep[2:], opts(19, temperature=0.7, min_p=0.15, seed=4, repetition_penalty=0.8),
             lambda: PromptLookupSpeculator(1, 3)),
        Case([11, 12, 13], opts(30, stop=(22,)), lambda: OracleDrafter(3, truth, 5)),
        Case([11, 13], opts(20, repetition_penalty=1.1), lambda: RandomDrafter(4, False)),
        Case([4, 4, 4, 4], opts(12, temperature=0.8, seed=6), lambda: None),
        Case(rep, opts(18, temperature=1.0, top_k=3, seed=21), HiddenRecorder),
    ]


def _drive(engine: TargetEngine, cases: list[Case], drafters: list) -> list[DecodeRequest]:
    """The coordinator's loop over the engine: admit requests while slots are free (prefill
    batch), then one verify batch over every active request; free slots as requests end."""
    requests = [DecodeRequest(c.prompt, c.options) for c in cases]
    waiting = list(range(len(cases)))
    active: dict[int, int] = {}  # request index -> slot
    wants = [d is not None and drafter_capabilities(d).wants_hidden for d in drafters]
    step = 0
    while waiting or active:
        admitted = []
        while waiting and engine.used_slots < engine.max_slots:
            r = waiting.pop(0)
            active[r] = engine.allocate()
            admitted.append(r)
        outs = engine.prefill([
            PrefillItem(active[r], requests[r].prefill_tokens(), requests[r].sampling, wants[r])
            for r in admitted
        ])
        for r, out in zip(admitted, outs, strict=True):
            assert len(out.rows) == 1
            assert (out.hidden is None) == (not wants[r])
            requests[r].on_prefill(out.rows, out.hidden)
            assert engine.slot_length(active[r]) == requests[r].cache_len
        for r in [r for r in active if requests[r].finished]:
            engine.free(active.pop(r))
        order, items, drafts = list(active), [], []
        for r in order:
            req, drafter = requests[r], drafters[r]
            budget = req.draft_budget()
            draft = DraftBlock.empty()
            if budget > 0 and drafter is not None:
                draft = drafter.propose(tuple(req.history), req.take_hidden(), budget)
                draft.truncate(budget)
            drafts.append(draft)
            # The slot still holds last step's rejected positions until this verify.
            assert engine.slot_length(active[r]) >= req.cache_len
            items.append(VerifyItem(active[r], req.cache_len, req.verify_tokens(draft),
                                    req.sampling, wants[r]))
        outs = engine.verify(items)
        for r, item, draft, out in zip(order, items, drafts, outs, strict=True):
            req, slot = requests[r], active[r]
            assert len(out.rows) == len(item.tokens)
            # Rolled back to the committed length, then every fed token appended.
            assert engine.slot_length(slot) == item.start_pos + len(item.tokens)
            keep = req.on_verify(draft, out.rows, out.hidden)
            assert keep == req.cache_len
            if step % 2:  # the service may also roll back eagerly
                engine.rollback(slot, keep)
                assert engine.slot_length(slot) == req.cache_len
            if req.finished:
                engine.free(active.pop(r))
        step += 1
    return requests


@pytest.mark.parametrize("max_slots", [16, 3])
def test_batched_requests_through_the_engine_equal_each_decoded_alone(max_slots):
    # THE invariant: prefills and verifications packed across requests (greedy, seeded
    # sampling with filters and penalties; lookup, model-like and random drafts; a stop
    # token) give every request exactly the tokens and counters of decoding it alone.
    # max_slots=3 queues requests, so freed slots are reused mid-run.
    decoder = tiny_decoder(VOCAB, seed=2)
    draft_model = tiny_decoder(VOCAB, seed=9, n_layers=1)
    cases = _cases(decoder, draft_model)
    alone = []
    for c in cases:
        alone.append(speculative_decode_with(decoder, c.prompt, decoder.new_cache(),
                                             c.drafter(), c.options))
    engine = TargetEngine(decoder, max_slots=max_slots)
    drafters = [c.drafter() for c in cases]
    batched = _drive(engine, cases, drafters)
    for c, req, ref in zip(cases, batched, alone, strict=True):
        assert req.generated == ref.generated_tokens, c
        assert req.result.to_dict() == ref.to_dict()
    assert engine.used_slots == 0
    stopped = [ref for ref in alone if ref.finish_reason == "stop"]
    assert [ref.generated_tokens[-1] for ref in stopped] == [22]  # the stop path ran


def test_hidden_rows_reach_the_drafter_as_in_process():
    decoder = tiny_decoder(VOCAB, seed=2)
    case = _cases(decoder, tiny_decoder(VOCAB, seed=9, n_layers=1))[-1]
    ref_drafter = case.drafter()
    speculative_decode_with(decoder, case.prompt, decoder.new_cache(), ref_drafter,
                            case.options)
    drafter = case.drafter()
    _drive(TargetEngine(decoder), [case], [drafter])
    assert len(drafter.seen) == len(ref_drafter.seen) > 1
    for got, want in zip(drafter.seen, ref_drafter.seen, strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rows_are_compacted_and_penalties_use_the_slot_history():
    decoder = tiny_decoder(VOCAB, seed=2)
    engine = TargetEngine(decoder)
    slot = engine.allocate()
    prompt, params = [1, 2, 3, 2], SamplingParams(temperature=1.0, top_k=2,
                                                  frequency_penalty=1.5)
    (out,) = engine.prefill([PrefillItem(slot, prompt, params)])
    assert isinstance(out.rows, SparseProbRows) and out.hidden is None
    engine.verify([VerifyItem(slot, 4, [5, 6], params)])  # 6 is rejected: keep 5
    (out,) = engine.verify([VerifyItem(slot, 5, [7, 8, 7], params)])
    # Reference: the same rows from a fresh forward with the explicit history.
    cache = decoder.new_cache()
    decoder.forward_batch([1, 2, 3, 2, 5], 0, cache)
    logits = decoder.forward_batch([7, 8, 7], 5, cache)
    from specd_core.rule import target_rows

    want = target_rows(logits, params, [1, 2, 3, 2, 5, 7], 4, [8, 7])
    torch.testing.assert_close(out.rows.to_dense(), want.probs, atol=1e-5, rtol=0)
    greedy = engine.verify([VerifyItem(slot, 5, [7, 8], SamplingParams())])[0].rows
    assert isinstance(greedy, GreedyRows) and len(greedy) == 2
    dense = engine.verify([VerifyItem(slot, 5, [7], SamplingParams(temperature=1.0))])[0].rows
    assert isinstance(dense, ProbRows)  # full support: dense is smaller


def test_slots_allocate_free_and_reuse():
    engine = TargetEngine(tiny_decoder(VOCAB), max_slots=2)
    assert (engine.allocate(), engine.allocate(), engine.used_slots) == (0, 1, 2)
    with pytest.raises(RuntimeError, match="all 2 target slots are in use"):
        engine.allocate()
    engine.prefill([PrefillItem(0, [1, 2, 3], SamplingParams())])
    assert engine.slot_length(0) == 3
    engine.free(0)
    with pytest.raises(ValueError, match="not allocated"):
        engine.free(0)
    with pytest.raises(ValueError, match="not allocated"):
        engine.slot_length(0)
    assert engine.allocate() == 0 and engine.slot_length(0) == 0  # reused, empty
    with pytest.raises(ValueError, match="max_slots"):
        TargetEngine(tiny_decoder(VOCAB), max_slots=0)


def test_prefill_discards_what_the_slot_held():
    decoder = tiny_decoder(VOCAB, seed=4)
    engine = TargetEngine(decoder)
    slot = engine.allocate()
    engine.prefill([PrefillItem(slot, [9, 8, 7, 6, 5], SamplingParams())])
    engine.verify([VerifyItem(slot, 5, [1, 2], SamplingParams())])
    (again,) = engine.prefill([PrefillItem(slot, [3, 4], SamplingParams(), want_hidden=True)])
    fresh = decoder.forward_batch_with_hidden([3, 4], 0, decoder.new_cache())
    assert engine.slot_length(slot) == 2
    assert again.rows.argmax == (int(fresh[0][-1].argmax()),)
    torch.testing.assert_close(again.hidden, fresh[1], atol=1e-5, rtol=0)


def test_bad_items_are_rejected_without_changing_any_slot():
    engine = TargetEngine(tiny_decoder(VOCAB))
    a, b = engine.allocate(), engine.allocate()
    greedy = SamplingParams()
    engine.prefill([PrefillItem(a, [1, 2, 3], greedy), PrefillItem(b, [4, 5], greedy)])
    engine.verify([VerifyItem(a, 3, [6, 7, 8], greedy)])
    bad_batches = {
        "beyond its length": [VerifyItem(a, 4, [1], greedy), VerifyItem(b, 3, [1], greedy)],
        "outside the vocabulary": [VerifyItem(a, 4, [1], greedy), VerifyItem(b, 2, [VOCAB],
                                                                               greedy)],
        "appears twice": [VerifyItem(a, 4, [1], greedy), VerifyItem(a, 4, [2], greedy)],
        "no tokens": [VerifyItem(a, 4, [1], greedy), VerifyItem(b, 2, [], greedy)],
        "not allocated": [VerifyItem(a, 4, [1], greedy), VerifyItem(7, 0, [1], greedy)],
        "exceeds the context": [VerifyItem(a, 4, [1] * 300, greedy)],
    }
    for match, items in bad_batches.items():
        with pytest.raises(ValueError, match=match):
            engine.verify(items)
        assert (engine.slot_length(a), engine.slot_length(b)) == (6, 2)
    with pytest.raises(ValueError, match="slot_length|seq_len"):
        engine.rollback(b, 3)
    assert engine.verify([]) == [] and engine.prefill([]) == []


def test_stats_count_forwards_and_tokens():
    engine = TargetEngine(tiny_decoder(VOCAB))
    a, b = engine.allocate(), engine.allocate()
    greedy = SamplingParams()
    engine.prefill([PrefillItem(a, [1, 2, 3], greedy), PrefillItem(b, [4, 5], greedy)])
    engine.verify([VerifyItem(a, 3, [6, 7], greedy), VerifyItem(b, 2, [1], greedy)])
    s = engine.stats
    assert (s["forward_calls"], s["prefill_calls"], s["verify_calls"]) == (2, 1, 1)
    assert s["tokens_fed"] == 8
    assert s["forward_seconds"] > 0.0


# --- the tiny-random test model and the actor body -----------------------------------------


def test_tiny_random_spec_loads_the_documented_decoder_and_tokenizer():
    decoder, tok = load_model("tiny-random:vocab=40,seed=3,layers=1")
    # In the machine's default dtype (`resolve_dtype`: bfloat16 where it is the faster
    # forward), cast from the float32 weights the seed draws.
    want = Decoder.random(ModelConfig.tiny_test(40, n_layers=1), seed=3).to(
        resolve_dtype(None))
    assert decoder.config == want.config
    for (name, p), (_, q) in zip(decoder.state_dict().items(), want.state_dict().items(),
                                 strict=True):
        assert torch.equal(p, q), name
    assert isinstance(tok, TinyTokenizer) and tok.vocab_size == 40
    default, _ = load_model("tiny-random")
    assert default.config == ModelConfig.tiny_test(64, n_layers=2)
    for bad in ("tiny-random:vocab=1", "tiny-random:size=3", "tiny-random:seed=x",
                "tiny-random:seed=1,seed=2"):
        with pytest.raises(ValueError, match="tiny-random"):
            load_model(bad)


def test_tiny_tokenizer_round_trips_the_service_api():
    tok = TinyTokenizer(10)
    ids = tok.encode("héllo, world\n" * 3)
    assert ids and all(1 <= i < 10 for i in ids)  # never the EOS id 0
    assert tok("abc") == {"input_ids": tok.encode("abc")}
    text = tok.decode([0, 1, 9, 57, 58])
    assert len(text) == 5 and text.isprintable()
    assert tok.decode([0, 1], skip_special_tokens=True) == tok.decode([1])
    # One character per token: streaming text deltas grow with every token.
    assert [len(tok.decode(ids[:k])) for k in range(4)] == [0, 1, 2, 3]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "user: hi\nassistant: "
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True) == \
        tok.encode(chat)


def test_actor_body_serves_a_request_without_ray():
    before = torch.get_num_threads()
    try:
        actor = TargetActor("tiny-random:vocab=32", max_slots=2, num_threads=1)
        assert actor._compute.run(torch.get_num_threads) == 1  # where its torch calls run
        info = actor.model_info()
        assert info.pop("forward").startswith("torch float32 forward")  # MoE: torch's
        assert info == {"model": "tiny-random:vocab=32", "vocab_size": 32, "hidden_size": 16,
                        "max_seq_len": 256, "n_layers": 2}
        slot = actor.allocate()
        (out,) = actor.prefill([PrefillItem(slot, [1, 2, 3], SamplingParams())])
        assert isinstance(out.rows, GreedyRows) and out.hidden is None
        (out,) = actor.verify([VerifyItem(slot, 3, [out.rows.argmax[0], 5], SamplingParams(),
                                          want_hidden=True)])
        assert len(out.rows) == 2 and out.hidden.shape == (2, 16)
        actor.rollback(slot, 4)
        status = actor.status()
        assert (status["used_slots"], status["max_slots"]) == (1, 2)
        assert status["stats"]["forward_calls"] == 2
        actor.free(slot)
        assert actor.status()["used_slots"] == 0
    finally:
        torch.set_num_threads(before)


def test_an_adopted_warm_cache_continues_at_its_length_and_refuses_positions_before_it():
    decoder = tiny_decoder(VOCAB)
    context, prompt, greedy = [3, 1, 4, 1, 5], [9, 2, 6], SamplingParams()
    cache = decoder.new_cache()
    decoder.forward_batch(context, 0, cache)
    engine = TargetEngine(decoder, max_slots=2)
    slot = engine.adopt(cache)
    with pytest.raises(ValueError, match="beyond its length"):
        engine.prefill([PrefillItem(slot, prompt, greedy, start_pos=len(context) + 1)])
    assert cache.seq_len == len(context)  # a refused item changes nothing
    (out,) = engine.prefill([PrefillItem(slot, prompt, greedy, start_pos=len(context))])
    ref = decoder.new_cache()
    decoder.forward_batch(context, 0, ref)
    logits = decoder.forward_batch(prompt, len(context), ref)
    assert out.rows.argmax == (int(logits[-1].argmax()),)
    assert cache.seq_len == len(context) + len(prompt)
    with pytest.raises(ValueError, match="before its prompt"):
        engine.verify([VerifyItem(slot, len(context) - 1, [1], greedy)])
    (step,) = engine.verify([VerifyItem(slot, len(context) + len(prompt), [7, 8], greedy)])
    assert len(step.rows) == 2 and cache.seq_len == len(context) + len(prompt) + 2
    engine.free(slot)
    assert cache.seq_len == len(context) + len(prompt) + 2  # the cache stays its owner's


def test_each_step_captures_the_layers_its_items_ask_and_leaves_the_decoder_as_it_was():
    """`VerifyItem.hidden_layers` / `PrefillItem.hidden_layers`: the step's hidden rows are the
    residual streams entering those layers (a plain forward with `set_capture_layers` on an
    identical decoder gives the same rows); items that want none get none; the decoder's own
    setting is back after every step; items asking different layers in one step, or layers
    the decoder lacks, are refused before anything changes."""
    config = ModelConfig.tiny_test(VOCAB, n_layers=5)
    engine = TargetEngine(Decoder.random(config, seed=3), max_slots=3)
    reference = Decoder.random(config, seed=3)
    h, layers = config.hidden_size, (1, 2, 4)

    def captured(tokens, capture):
        reference.set_capture_layers(capture)
        return reference.forward_batch_with_hidden(tokens, 0, reference.new_cache())[1]

    a, b, c = engine.allocate(), engine.allocate(), engine.allocate()
    pa, pb = [3, 1, 4, 1, 5], [9, 2, 6]
    out = engine.step([PrefillItem(a, pa, SamplingParams(), want_hidden=True,
                                   hidden_layers=layers),
                       PrefillItem(b, pb, SamplingParams()),
                       PrefillItem(c, [7, 7], SamplingParams(), hidden_layers=(0,))])
    assert out[0].hidden.shape == (5, 3 * h) and out[1].hidden is None
    assert out[2].hidden is None  # layers without want_hidden: nothing asked
    torch.testing.assert_close(out[0].hidden, captured(pa, layers), rtol=1e-5, atol=1e-6)
    assert engine.decoder.capture_layers == ()
    # A verify step with other layers (and the final-norm rows for a () item next).
    (v,) = engine.step([VerifyItem(a, 5, [2, 6], SamplingParams(), want_hidden=True,
                                   hidden_layers=(0, 5))])
    torch.testing.assert_close(v.hidden, captured([*pa, 2, 6], (0, 5))[5:], rtol=1e-5,
                               atol=1e-6)
    (w,) = engine.step([VerifyItem(b, 3, [5], SamplingParams(), want_hidden=True)])
    torch.testing.assert_close(w.hidden, captured([*pb, 5], ())[3:], rtol=1e-5, atol=1e-6)
    engine.decoder.set_capture_layers((3,))  # a caller's own setting survives steps
    engine.step([VerifyItem(b, 4, [5], SamplingParams(), want_hidden=True)])
    assert engine.decoder.capture_layers == (3,)
    engine.decoder.set_capture_layers(())
    lengths = [engine.slot_length(s) for s in (a, b)]
    for items, match in [
        ([VerifyItem(a, 7, [1], SamplingParams(), want_hidden=True, hidden_layers=(1, 2)),
          VerifyItem(b, 5, [1], SamplingParams(), want_hidden=True, hidden_layers=(1, 3))],
         "differ among the items"),
        ([VerifyItem(a, 7, [1], SamplingParams(), want_hidden=True, hidden_layers=(1,)),
          VerifyItem(b, 5, [1], SamplingParams(), want_hidden=True)],
         "differ among the items"),
        ([VerifyItem(a, 7, [1], SamplingParams(), want_hidden=True, hidden_layers=(6,))],
         r"layer 6 is outside \[0, 5\]"),
        ([VerifyItem(a, 7, [1], SamplingParams(), want_hidden=True, hidden_layers=(2, 2))],
         "repeats"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.step(items)
        assert [engine.slot_length(s) for s in (a, b)] == lengths
