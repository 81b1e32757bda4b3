"""The EAGLE drafter on a tiny random target with a tiny random head: block shape, honest q,
KV rollback, losslessness through the core loop, the gRPC worker, and training end to end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from drafters import exact_marginals, plain_decode, tiny_decoder, tv_tolerance

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.client import DrafterClient, ProposeJob
from drafter_worker.eagle import (
    EagleConfig,
    EagleDrafter,
    EagleHead,
    LookupThenEagle,
    NeedsResync,
    draft_distribution,
)
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.registry import build_drafter, check_drafter
from drafter_worker.server import DrafterServicer, start_drafter_server
from specd_core.draft import DraftBlock
from specd_core.request import DecodeRequest, SpeculativeOptions
from specd_core.sampling import DraftSamplingParams, SamplingParams


def tiny_eagle(decoder, vocab_ids=None, seed: int = 1, max_draft_len: int = 4,
               stop_token_ids=()) -> EagleDrafter:
    ids = torch.arange(decoder.config.vocab_size) if vocab_ids is None else torch.tensor(vocab_ids)
    config = EagleConfig.for_target(decoder.config, draft_vocab_size=len(ids), ffn_dim=24)
    head = EagleHead.random(config, seed=seed, draft_vocab=ids)
    return EagleDrafter(head, decoder.embed_tokens.weight, decoder.lm_head.weight,
                        max_draft_len=max_draft_len, stop_token_ids=stop_token_ids)


def hidden_of(decoder, tokens):
    """float32 [len(tokens), H]: the target's final-norm states for ``tokens``."""
    return decoder.forward_batch_with_hidden(list(tokens), 0, decoder.new_cache())[1]


# ---- blocks and q ----


def test_greedy_blocks_are_argmax_point_masses_inside_the_draft_vocabulary():
    decoder = tiny_decoder(16, seed=2)
    drafter = tiny_eagle(decoder, vocab_ids=[3, 5, 7, 9, 11, 13])
    history = [1, 2, 3, 4, 5, 6]
    block = drafter.session().propose(history, hidden_of(decoder, history[:-1]), 4)
    assert 1 <= len(block) <= 4
    for token, dist in zip(block.tokens, block.dists, strict=True):
        assert token in (3, 5, 7, 9, 11, 13)
        assert dist.support() == ((token, 1.0),)
    # The first draft is the argmax of the head's logits over the draft vocabulary.
    session = drafter.session()
    session.propose(history, hidden_of(decoder, history[:-1]), 0)
    logits = drafter.draft_logits(session._feature)[0]
    assert block.tokens[0] == int(drafter.vocab_ids[int(logits.argmax())])


def test_block_respects_max_len_and_stops_after_a_stop_token():
    decoder = tiny_decoder(8, seed=0)
    history = [1, 2, 3, 4]
    rows = hidden_of(decoder, history[:-1])
    free = tiny_eagle(decoder, max_draft_len=6).session().propose(history, rows, 3)
    assert len(free) == 3
    stop = free.tokens[1]
    stopped = tiny_eagle(decoder, max_draft_len=6, stop_token_ids=[stop]).session().propose(
        history, rows, 3)
    assert stopped.tokens == free.tokens[: free.tokens.index(stop) + 1]


def test_sampled_positions_report_exactly_the_distribution_they_were_drawn_from():
    # Draw the first position many times and compare the frequencies with the reported q.
    decoder = tiny_decoder(8, seed=4)
    drafter = tiny_eagle(decoder, seed=5)
    history = [1, 2, 3, 1]
    rows = hidden_of(decoder, history[:-1])
    sampling = DraftSamplingParams(temperature=1.0, top_k=5, top_p=0.9)
    session = drafter.session(sampling, seed=7)
    n = 1500
    counts = np.zeros(8)
    reported = None
    for _ in range(n):
        block = session.propose(history, rows, 1)
        counts[block.tokens[0]] += 1
        q = dict(block.dists[0].support())
        assert reported is None or q == reported  # the same distribution every time
        reported = q
    exact = np.zeros(8)
    for token, p in reported.items():
        exact[token] = p
    assert abs(sum(reported.values()) - 1) < 1e-9 and len(reported) <= 5
    # And it is the head's softmax after the transforms.
    session.propose(history, rows, 0)
    idx, probs = draft_distribution(drafter.draft_logits(session._feature)[0], sampling)
    assert {int(drafter.vocab_ids[i]): p for i, p in zip(idx.tolist(), probs.tolist(),
                                                          strict=True)} == reported
    tv = 0.5 * np.abs(counts / n - exact).sum()
    assert tv < tv_tolerance(exact, n)


def test_same_seed_same_drafts_at_temperature():
    decoder = tiny_decoder(8, seed=4)
    drafter = tiny_eagle(decoder, seed=5)
    history = [1, 2, 3, 1]
    rows = hidden_of(decoder, history[:-1])
    sampling = DraftSamplingParams(temperature=1.0)
    a = [drafter.session(sampling, 3).propose(history, rows, 4).tokens for _ in range(2)]
    b = drafter.session(sampling, 4)
    assert a[0] == a[1]
    assert any(b.propose(history, rows, 4).tokens != a[0] for _ in range(20))


# ---- KV cache rollback ----


def test_after_partial_acceptance_proposals_equal_a_fresh_session_on_the_committed_prefix():
    decoder = tiny_decoder(16, seed=6)
    drafter = tiny_eagle(decoder, seed=2, max_draft_len=5)
    stream = [1, 4, 2, 8, 5, 7, 3, 9, 11, 6, 2, 12, 10, 4, 1]
    full_hidden = hidden_of(decoder, stream)
    session = drafter.session()
    # Commit 5 tokens, then steps accepting 0, 2 and 1 drafts (1, 3 and 2 new tokens).
    ends = [5, 6, 9, 11]
    prev = None
    for end in ends:
        history = stream[:end]
        rows = full_hidden[: end - 1] if prev is None else full_hidden[prev - 1: end - 1]
        got = session.propose(history, rows, 5)
        fresh = drafter.session().propose(history, full_hidden[: end - 1], 5)
        assert got == fresh
        assert len(got) == 5
        # The cache holds exactly the committed positions after drafting.
        assert session.cache.seq_len == end - 1
        prev = end


def test_rows_that_do_not_continue_the_session_ask_for_a_resync():
    decoder = tiny_decoder(8, seed=0)
    drafter = tiny_eagle(decoder)
    stream = [1, 2, 3, 4, 5, 6, 7]
    hidden = hidden_of(decoder, stream)
    session = drafter.session()
    session.propose(stream[:3], hidden[:2], 3)
    with pytest.raises(NeedsResync):  # 1 row for 3 new tokens: rows were lost
        session.propose(stream[:6], hidden[4:5], 3)
    # Every row of the history always works, from any state.
    assert session.propose(stream[:6], hidden[:5], 3) == drafter.session().propose(
        stream[:6], hidden[:5], 3)


def test_dynamic_draft_length_stops_where_the_heads_confidence_product_drops_below_it():
    """EAGLE-2's dynamic depth: a block is the longest prefix of the full greedy block whose
    running product of the head's top probabilities stays >= min_confidence."""
    decoder = tiny_decoder(16, seed=4)
    history = [1, 2, 3, 4, 5, 6, 7]
    rows = hidden_of(decoder, history[:-1])
    full_drafter = tiny_eagle(decoder, vocab_ids=list(range(2, 14)), max_draft_len=5)
    full = full_drafter.session().propose(history, rows, 5)
    assert len(full) == 5
    # The head's confidence at each position of the full block, recomputed by hand.
    session = full_drafter.session()
    session.propose(history, rows, 0)
    feature, reach, reaches = session._feature, 1.0, []
    for token in full.tokens:
        logits = full_drafter.draft_logits(feature)[0]
        reach *= float(torch.softmax(logits, 0).max())
        reaches.append(reach)
        feature = full_drafter.head.step(feature, full_drafter.embed(torch.tensor([token])),
                                         session.cache)
    cuts = set()
    for threshold in [0.0, *reaches, 0.999]:
        drafter = tiny_eagle(decoder, vocab_ids=list(range(2, 14)), max_draft_len=5)
        drafter.min_confidence = threshold
        block = drafter.session().propose(history, rows, 5)
        expected = sum(1 for r in reaches if r >= threshold)
        assert block.tokens == full.tokens[:expected], threshold
        cuts.add(len(block))
    assert len(cuts) > 2  # the thresholds did cut blocks at several lengths
    with pytest.raises(ValueError, match="min_confidence"):
        EagleDrafter(full_drafter.head, decoder.embed_tokens.weight, decoder.lm_head.weight,
                     min_confidence=1.5)


def test_run_ahead_continues_the_heads_own_chain_and_leaves_the_committed_state():
    # Greedy: drafting past `assumed` on predicted features is the head's own longer chain;
    # the cache is back at the committed positions afterwards, so the next call with the
    # real rows gives what a fresh session gives.
    decoder = tiny_decoder(16, seed=6)
    drafter = tiny_eagle(decoder, seed=2, max_draft_len=6)
    drafter.min_confidence = 0.0
    stream = [1, 4, 2, 8, 5, 7, 3, 9, 11, 6, 2, 12]
    hidden = hidden_of(decoder, stream)
    history = stream[:6]
    chain = drafter.session().propose(history, hidden[:5], 6)
    session = drafter.session()
    ahead = session.propose_ahead(history, hidden[:5], chain.tokens[:2], 4)
    assert ahead.tokens == chain.tokens[2:6]
    assert session.cache.seq_len == 5 and session.tokens == history
    later = stream[:8]
    assert session.propose(later, hidden[5:7], 4) == drafter.session().propose(
        later, hidden[:7], 4)


@pytest.mark.parametrize("name", ["eagle", "eagle+lookup"])
def test_pipelined_eagle_output_is_token_identical_to_plain_decoding(name):
    decoder = tiny_decoder(16, seed=1)
    prompt = [1, 5, 2, 9, 3, 1, 5]
    eagle = tiny_eagle(decoder, vocab_ids=list(range(2, 14)), seed=1)
    drafter = eagle if name == "eagle" else LookupThenEagle(PromptLookupSpeculator(2, 4), eagle)
    out = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                  SpeculativeOptions(max_new_tokens=24), pipeline=True)
    assert out.generated_tokens == plain_decode(decoder, prompt, 24)
    assert out.drafted_tokens > 0


# ---- losslessness through the core loop ----


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("min_confidence", [0.0, 0.12])
def test_greedy_output_is_token_identical_to_plain_decoding(seed, min_confidence):
    decoder = tiny_decoder(16, seed=seed)
    prompt = [1, 5, 2, 9, 3]
    for name in ("eagle", "eagle+lookup"):
        eagle = tiny_eagle(decoder, vocab_ids=list(range(2, 14)), seed=seed)
        eagle.min_confidence = min_confidence
        drafter = eagle if name == "eagle" else LookupThenEagle(PromptLookupSpeculator(2, 4),
                                                                eagle)
        out = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                      SpeculativeOptions(max_new_tokens=20))
        assert out.generated_tokens == plain_decode(decoder, prompt, 20)
        assert out.drafted_tokens > 0


@pytest.mark.parametrize("min_confidence", [0.0, 0.3])
def test_temperature_one_output_is_distributed_as_plain_sampling(min_confidence):
    decoder = tiny_decoder(6, seed=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    seeds, max_new = 1200, 3
    exact = exact_marginals(decoder, prompt, params, max_new)
    drafter = tiny_eagle(decoder, vocab_ids=[0, 1, 2, 4], seed=3, max_draft_len=3)
    drafter.min_confidence = min_confidence
    counts = np.zeros((max_new, 6))
    drafted = 0
    for seed in range(seeds):
        out = speculative_decode_with(
            decoder, prompt, decoder.new_cache(), drafter,
            SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=seed))
        drafted += out.drafted_tokens
        for i, token in enumerate(out.generated_tokens):
            counts[i, token] += 1
    assert drafted > 0
    for i in range(max_new):
        tv = 0.5 * np.abs(counts[i] / seeds - exact[i]).sum()
        assert tv < tv_tolerance(exact[i], seeds), (i, tv)


# ---- hidden rows kept by the coordinator ----


def test_decode_request_keeps_one_hidden_row_per_committed_position():
    decoder = tiny_decoder(16, seed=0)
    req = DecodeRequest([1, 2, 3], SpeculativeOptions(max_new_tokens=8),
                        hidden_dtype=torch.float16)
    cache = decoder.new_cache()
    logits, hidden = decoder.forward_batch_with_hidden([1, 2, 3], 0, cache)
    req.on_prefill(req.rows(logits[-1:]), hidden)
    rows = [hidden]
    for draft in ([req.pending], [5, 6, 7]):  # one block accepted, one likely partly not
        block = DraftBlock.deterministic(draft)
        logits, hidden = decoder.forward_batch_with_hidden(req.verify_tokens(block),
                                                           req.cache_len, cache)
        before = len(req.history)
        keep = req.on_verify(block, req.rows(logits, block.tokens), hidden)
        cache.truncate(keep)
        rows.append(hidden[: len(req.history) - before])
        log = req.hidden_log()
        assert log.dtype == torch.float16 and log.shape[0] == len(req.history) - 1
    assert torch.equal(req.hidden_log(), torch.cat(rows).half())


# ---- the drafter worker over gRPC ----


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_grpc_proposals_equal_in_process_and_a_lost_call_is_recovered_by_resending_rows():
    decoder = tiny_decoder(16, seed=3)
    drafter = tiny_eagle(decoder, seed=4)
    stream = [1, 4, 2, 8, 5, 7, 3, 9, 11, 6, 2, 12]
    hidden = hidden_of(decoder, stream).half()  # the coordinator's float16 log

    def expected(end):
        return drafter.session().propose(stream[:end], hidden[: end - 1].float(), 4)

    async def main():
        server, port = await start_drafter_server(drafter)
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=5,
                                     hidden_dtype="float16") as client:
                assert (await client.info()).wants_hidden
                for end in (4, 6, 7):
                    [block] = await client.propose(
                        [ProposeJob("r", stream[:end], 4, hidden_log=hidden[: end - 1])])
                    assert block == expected(end)
                # The client loses track (as after an RPC error): the next call resends the
                # whole history with every row, and the worker starts the session over.
                client.forget("r")
                [block] = await client.propose(
                    [ProposeJob("r", stream[:10], 4, hidden_log=hidden[:9])])
                assert block == expected(10)
        finally:
            await server.stop(None)

    run(main())


def test_servicer_answers_resync_when_rows_are_missing_and_keeps_sessions_per_request():
    decoder = tiny_decoder(16, seed=3)
    servicer = DrafterServicer(tiny_eagle(decoder, seed=4))
    stream = [1, 4, 2, 8, 5, 7, 3, 9]
    hidden = hidden_of(decoder, stream)
    from drafter_worker import wire
    from specd.v1 import drafter_pb2

    def item(rid, known, end, rows):
        it = drafter_pb2.ProposeItem(request_id=rid, known=known, append=stream[known:end],
                                     max_len=3)
        it.hidden.CopyFrom(wire.tensor_to_proto(rows))
        return it

    reply = servicer.propose_batch(drafter_pb2.ProposeRequest(items=[
        item("a", 0, 4, hidden[:3]), item("b", 0, 5, hidden[:4])]))
    assert not any(r.resync for r in reply.results)
    assert len(servicer.sessions._sessions) == 2
    # "a" sends one row for three new tokens: the worker asks for everything again.
    reply = servicer.propose_batch(drafter_pb2.ProposeRequest(items=[
        item("a", 4, 7, hidden[5:6]), item("b", 5, 6, hidden[4:5])]))
    assert [r.resync for r in reply.results] == [True, False]
    assert "a" not in servicer.sessions._sessions
    servicer.release_ids(["b"])
    assert not servicer.sessions._sessions


def test_prompt_lookup_is_sent_no_hidden_rows_by_the_scheduler():
    from coordinator.step.scheduler import Scheduler

    class FakeClient:
        def __init__(self):
            self.jobs = []

        async def propose(self, jobs):
            self.jobs.extend(jobs)
            return [DraftBlock.empty() for _ in jobs]

    async def jobs_for(wants_hidden):
        client = FakeClient()
        sched = Scheduler(target=None, drafter=client, wants_hidden=wants_hidden)
        req = sched.submit([1, 2, 3], SpeculativeOptions(max_new_tokens=5))
        decoder = tiny_decoder(8)
        logits, hidden = decoder.forward_batch_with_hidden([1, 2, 3], 0, decoder.new_cache())
        req.decode.on_prefill(req.decode.rows(logits[-1:]),
                              hidden if sched._hidden_for(req) else None)
        await sched._propose([req])
        return client.jobs

    [job] = run(jobs_for(False))
    assert job.hidden_log is None and job.hidden is None
    [job] = run(jobs_for(True))
    assert job.hidden_log is not None and job.hidden_log.shape == (3, 16)


# ---- build / load / train ----


def test_unrolled_training_forward_replays_the_drafting_steps():
    """Pass j of `forward_unrolled` at position p is what draft step j + 1 computes from
    anchor p - j (KV cache over the true prefix, then the head's own predictions): the
    property that makes training-time test train the drafting path itself."""

    config = EagleConfig(hidden_size=16, vocab_size=32, n_heads=4, n_kv_heads=2, head_dim=4,
                         ffn_dim=24, draft_vocab_size=32)
    head = EagleHead.random(config, seed=3).eval()
    gen = torch.Generator().manual_seed(0)
    t = 9
    feats = torch.randn(1, t, 16, generator=gen)
    embeds = torch.randn(1, t, 16, generator=gen)
    with torch.no_grad():
        passes = head.forward_unrolled(feats, embeds, 3)
    assert torch.allclose(passes[0], head(feats, embeds))
    for anchor in range(t - 2):
        cache = head.new_cache()
        pred = head.step(feats[0, : anchor + 1], embeds[0, : anchor + 1], cache)[-1:]
        assert torch.allclose(pred[0], passes[0][0, anchor], atol=1e-5)
        for j in (1, 2):
            pred = head.step(pred, embeds[0, anchor + j: anchor + j + 1], cache)
            assert torch.allclose(pred[0], passes[j][0, anchor + j], atol=1e-5), (anchor, j)
    # Teacher forcing (pass 0 at p) is not what step 2 sees: the replay is not trivial.
    assert not torch.allclose(passes[1][0, 1:], passes[0][0, 1:], atol=1e-3)


def test_head_round_trips_through_a_file_and_build_drafter_loads_it(tmp_path):
    decoder = tiny_decoder(16, seed=0)
    drafter = tiny_eagle(decoder, vocab_ids=list(range(3, 13)))
    path = tmp_path / "head.safetensors"
    drafter.head.save(path, metadata={"note": "test"})
    loaded = build_drafter("eagle", max_draft_len=4, target=decoder, drafter_path=str(path),
                           min_confidence=0.0)
    history = [1, 2, 3, 4]
    rows = hidden_of(decoder, history[:-1])
    # float16 storage: same drafts as the float32 head on this input.
    assert loaded.session().propose(history, rows, 4).tokens == \
        drafter.session().propose(history, rows, 4).tokens
    assert torch.equal(loaded.vocab_ids, drafter.vocab_ids)
    # A worker without the target loaded: only the embedding / LM head of the model source.
    from target_worker.testing import load_tiny_random

    spec = "tiny-random:vocab=16,seed=0,layers=2"
    tiny_target = load_tiny_random(spec)[0]
    by_name = build_drafter("eagle", max_draft_len=4, model=spec, drafter_path=str(path))
    assert torch.equal(by_name.embed_weight, tiny_target.embed_tokens.weight)
    with pytest.raises(ValueError, match="expects"):
        build_drafter("eagle", target=tiny_decoder(8), drafter_path=str(path))
    with pytest.raises(FileNotFoundError):
        build_drafter("eagle", target=decoder, drafter_path=str(tmp_path / "missing"))


def test_head_files_keep_the_shipped_tensor_names_and_drafting_runs_the_targets_block(tmp_path):
    """The head's layer is the target's `Block` (its code, its cache), yet a saved head has
    exactly the tensor names and shapes of the shipped file, which loads unchanged."""
    from safetensors import safe_open

    from drafter_worker.eagle import DEFAULT_HEAD
    from target_worker.model import Block, KvCache

    shipped = EagleHead.load(DEFAULT_HEAD)
    assert isinstance(shipped.layer, Block)
    assert isinstance(shipped.new_cache(), KvCache)
    path = tmp_path / "head.safetensors"
    shipped.save(path)
    with safe_open(str(DEFAULT_HEAD), framework="pt") as a, \
            safe_open(str(path), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def test_training_runs_end_to_end_on_a_tiny_corpus(tmp_path):
    from specd_tools.train_eagle import TrainConfig, train
    from target_worker.testing import load_tiny_random

    decoder, tokenizer = load_tiny_random("tiny-random:vocab=64,seed=0,layers=2")
    cfg = TrainConfig(out=str(tmp_path / "h.safetensors"), data_dir=str(tmp_path / "data"),
                      max_prompts=8, max_new_tokens=12, gen_batch=4, stdlib_tokens=300,
                      seq_len=48, draft_vocab=24, ffn_dim=16, epochs=2, batch_size=4, unroll=2,
                      heldout_fraction=0.25, eval_positions=20, threads=1, plot=False)
    summary = train(cfg, decoder, tokenizer, progress=False)
    assert len(summary["epochs"]) == 2
    assert summary["epochs"][-1]["eval"]["positions"] > 0
    assert summary["data"]["chat_sequences"] == 8 and summary["data"]["stdlib_sequences"] > 0
    sidecar = json.loads((tmp_path / "h.json").read_text())
    assert sidecar["config"]["draft_vocab"] == 24
    head = EagleHead.load(tmp_path / "h.safetensors")
    assert head.config.draft_vocab_size == 24
    assert (tmp_path / "data").is_dir()  # the hidden-state cache, reused by a second run
    again = train(cfg, decoder, tokenizer, progress=False)
    assert again["data"] == summary["data"]
    # Answers are seen chat_repeat times per epoch, prose once.
    n_std = summary["data"]["stdlib_sequences"]
    n_chat = summary["train_sequences"] - n_std
    twice = train(dataclasses.replace(cfg, chat_repeat=2), decoder, tokenizer, progress=False)
    assert twice["sequences_per_epoch"] == 2 * n_chat + n_std
    assert len(twice["step_loss"]) == 2 * math.ceil((2 * n_chat + n_std) / cfg.batch_size)


def test_answer_cache_generates_only_new_prompts(tmp_path, monkeypatch):
    """More prompts cost only the new answers: the cached ones are not regenerated, and they
    come back identical."""
    from specd_tools import train_eagle
    from target_worker.testing import load_tiny_random

    decoder, tokenizer = load_tiny_random("tiny-random:vocab=64,seed=0,layers=2")
    generated = []
    real = train_eagle.self_distill

    def counting(decoder, prompts, *args, **kwargs):
        generated.extend(tuple(p) for p in prompts)
        return real(decoder, prompts, *args, **kwargs)

    monkeypatch.setattr(train_eagle, "self_distill", counting)
    cfg = train_eagle.TrainConfig(out="", data_dir=str(tmp_path), max_prompts=4,
                                  max_new_tokens=8, gen_batch=3, stdlib_tokens=0, seq_len=48)
    small = train_eagle.build_dataset(cfg, decoder, tokenizer, "tiny", progress=False)
    assert len(generated) == 4
    big = train_eagle.build_dataset(dataclasses.replace(cfg, max_prompts=8), decoder,
                                    tokenizer, "tiny", progress=False)
    assert len(generated) == 8 and len(set(generated)) == 8  # 4 new ones, none twice
    by_seq = {tuple(s): h for s, h in zip(big["sequences"], big["hidden"], strict=True)}
    for seq, hid in zip(small["sequences"], small["hidden"], strict=True):
        assert torch.equal(by_seq[tuple(seq)], hid)


def test_stdlib_prose_is_reference_topics_then_docstrings_not_code():
    from specd_tools.train_eagle import stdlib_texts

    try:
        from pydoc_data.topics import topics
    except ImportError:
        pytest.skip("this Python has no pydoc_data")
    budget = sum(len(t) for t in topics.values()) + 20_000
    texts = stdlib_texts(budget)
    assert sum(len(t) for t in texts) >= budget
    assert texts[: len(topics)] == [topics[k] for k in sorted(topics)]
    docstrings = texts[len(topics):]
    assert docstrings and all(len(t) >= 200 for t in docstrings)
    assert not any(t.lstrip().startswith(("import ", "from ", "#!", "# ", '"""'))
                   for t in docstrings)


def test_cli_in_process_eagle_gives_the_plain_greedy_output(tmp_path, capsys):
    from specd_tools.cli import main
    from target_worker.testing import load_tiny_random

    decoder, _ = load_tiny_random("tiny-random:vocab=64,seed=0,layers=2")
    path = tmp_path / "head.safetensors"
    tiny_eagle(decoder, vocab_ids=list(range(1, 40))).head.save(path)
    outputs = {}
    for drafter in ("none", "eagle", "eagle+lookup"):
        args = ["generate", "abcabc", "--model", "tiny-random:vocab=64,seed=0,layers=2",
                "--in-process", "--json", "--max-new-tokens", "12", "--drafter", drafter,
                "--drafter-path", str(path), "--no-adaptive"]  # adaptive may draft 0 here
        assert main(args) == 0
        outputs[drafter] = json.loads(capsys.readouterr().out)
    assert outputs["eagle"]["drafted_tokens"] > 0
    assert outputs["eagle"]["token_ids"] == outputs["none"]["token_ids"]
    assert outputs["eagle+lookup"]["token_ids"] == outputs["none"]["token_ids"]
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--in-process", "--drafter", "eagle",
              "--drafter-path", str(tmp_path / "missing.safetensors")])
    assert exc.value.code == 2
    assert "EAGLE head not found" in capsys.readouterr().err


def test_scheduler_with_an_eagle_worker_is_lossless_and_recovers_from_a_lost_reply():
    from coordinator.step.scheduler import Scheduler
    from coordinator.step.targets import LocalTarget
    from drafter_worker.client import DrafterUnavailable
    from target_worker.engine import TargetEngine

    decoder = tiny_decoder(16, seed=5)
    drafter = tiny_eagle(decoder, seed=6)
    prompts = [[1, 5, 2, 9, 3], [4, 4, 7], [2, 8, 1, 6, 6, 3, 2]]

    class LossyClient(DrafterClient):
        """Every third reply is lost after the worker applied the call."""

        calls = 0

        async def propose(self, jobs):
            blocks = await super().propose(jobs)
            LossyClient.calls += 1
            if LossyClient.calls % 3 == 0:
                for job in jobs:
                    self.forget(job.request_id)
                raise DrafterUnavailable("reply lost (test)")
            return blocks

    async def main():
        server, port = await start_drafter_server(drafter)
        client = LossyClient(f"127.0.0.1:{port}", timeout_s=5, hidden_dtype="float16")
        # Fixed draft lengths: drafting every step is what loses replies (the tiny model's
        # forward is so cheap that the adaptive policy would price the drafter call out).
        sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=4)), client,
                          wants_hidden=True, adaptive=False)
        sched.start()
        try:
            reqs = [sched.submit(p, SpeculativeOptions(max_new_tokens=16)) for p in prompts]
            results = []
            for req in reqs:
                while True:
                    event = await req.events.get()
                    if not isinstance(event, list):
                        results.append(event)
                        break
            return results, sched.stats.drafter_failures
        finally:
            await sched.close()
            await client.close()
            await server.stop(None)

    results, failures = run(main())
    assert failures > 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.generated_tokens == plain_decode(decoder, prompt, 16)
        assert result.drafted_tokens > 0


def test_a_head_path_for_a_drafter_without_a_head_is_refused(tmp_path):
    head = tmp_path / "head.safetensors"
    head.write_bytes(b"")
    with pytest.raises(ValueError, match="drafter_path=.*prompt-lookup"):
        check_drafter("prompt-lookup", drafter_path=str(head))
    # Where a head is used, the file is opened and read before anything starts: an empty
    # one is refused naming it; a real head passes.
    with pytest.raises(ValueError, match=f"{head}: not a readable safetensors file"):
        check_drafter("eagle", drafter_path=str(head))
    from drafter_worker.eagle import DEFAULT_HEAD

    check_drafter("eagle", drafter_path=DEFAULT_HEAD)


@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_chunked_prefill_gives_eagle_the_same_rows_and_so_the_same_drafts(pipeline):
    # The prompt's hidden rows reach the head chunk by chunk (budget 4: a step with nothing
    # to verify takes 4 budgets, so a 40-token prompt goes in 3 chunks); the head drafts the
    # same blocks as with the prompt whole: same counters, same tokens, plain decoding's.
    from coordinator.step.plan import ChunkPolicy
    from coordinator.step.scheduler import Scheduler
    from coordinator.step.targets import LocalTarget
    from drafter_worker.local import LocalDrafter
    from target_worker.engine import TargetEngine

    decoder = tiny_decoder(16, seed=1)
    prompt = [(3 * i + 1) % 14 + 1 for i in range(40)]

    def run(budget):
        async def go():
            sched = Scheduler(LocalTarget(TargetEngine(decoder, max_slots=1)),
                              LocalDrafter(tiny_eagle(decoder, seed=1)), max_active=1,
                              adaptive=False, wants_hidden=True, pipeline=pipeline,
                              hidden_dtype=torch.float32, chunking=ChunkPolicy(budget))
            req = sched.submit(prompt, SpeculativeOptions(max_new_tokens=24))
            await sched.run_until_idle()
            await asyncio.sleep(0)
            return req.decode.result

        return asyncio.run(go())

    whole, chunked = run(None), run(4)
    assert chunked.generated_tokens == whole.generated_tokens == plain_decode(decoder, prompt, 24)
    assert (chunked.drafted_tokens, chunked.accepted_tokens, chunked.forward_calls) == (
        whole.drafted_tokens, whole.accepted_tokens, whole.forward_calls)
    assert whole.drafted_tokens > 0
