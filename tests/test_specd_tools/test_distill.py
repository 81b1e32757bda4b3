"""Self-distillation data (`specd_tools.distill`): the batched forward computes each sequence as
the decoder does alone, conversations store the target's own captured rows, and generation
resumes after the last shard as if it had never stopped."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_checkpoints import build_checkpoint, train_tokenizer

from specd_tools import distill
from specd_tools.distill import BatchForward, DistillConfig
from target_worker.loader import load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with a chat template; 8 layers, so EAGLE-3's layers (2, 4, 5) are
    distinct."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    return build_checkpoint(tmp_path_factory.mktemp("distill") / "llama", "llama",
                            {"num_hidden_layers": 8, "tie_word_embeddings": False}, None,
                            train_tokenizer())


def test_batched_rows_equal_each_sequence_fed_alone():
    """Prompts of different lengths right-aligned in one batch, decode steps, and finished
    sequences dropped mid-way: every row's captured streams and last logits are the
    decoder's own for that sequence alone (float32 rounding apart)."""
    decoder, _ = load_model("tiny-random:layers=6", "float32")
    decoder.set_capture_layers((1, 3, 6))
    gen = torch.Generator().manual_seed(0)
    lens = [3, 8, 1, 5]
    seqs = [torch.randint(3, decoder.config.vocab_size, (n,), generator=gen).tolist()
            for n in lens]
    n = max(lens)
    fwd = BatchForward(decoder, len(seqs), n + 8)
    logits, feats = fwd.feed(torch.tensor([[0] * (n - len(s)) + s for s in seqs]),
                             torch.tensor(lens))
    rows = [[feats[r, n - len(s):]] for r, s in enumerate(seqs)]
    live = list(range(len(seqs)))
    for step in range(5):
        nxt = logits.argmax(-1)
        for j, r in enumerate(live):
            seqs[r].append(int(nxt[j]))
        if step == 2:  # sequences 1 and 2 finish
            keep = [j for j, r in enumerate(live) if r not in (1, 2)]
            fwd.keep(torch.tensor(keep))
            nxt, live = nxt[keep], [live[j] for j in keep]
        logits, feats = fwd.feed(nxt[:, None], torch.ones(len(live), dtype=torch.long))
        for j, r in enumerate(live):
            rows[r].append(feats[j])
    for j, r in enumerate(live):
        want_logits, want = decoder.forward_batch_with_hidden(seqs[r], 0, decoder.new_cache())
        torch.testing.assert_close(torch.cat(rows[r]), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits[j], want_logits[-1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="exceed"):
        fwd.feed(torch.zeros(len(live), 9, dtype=torch.long), torch.full((len(live),), 9))


def test_magpie_prefix_is_the_template_before_the_user_text(checkpoint):
    from specd_core.text import encode_chat

    _, tokenizer = load_model(str(checkpoint), "float32")
    prefix, header = distill.magpie_prefix(tokenizer)
    text = "hello there"
    assert tokenizer.decode(prefix + tokenizer.encode(text, add_special_tokens=False)
                            + header) == tokenizer.decode(
        encode_chat(tokenizer, [{"role": "user", "content": text}]))
    assert tokenizer.decode(prefix).endswith("user\n")


def test_conversations_store_the_targets_rows_and_resume_where_they_stopped(checkpoint,
                                                                             tmp_path):
    config = DistillConfig(model=str(checkpoint), dtype="float32", batch=4, user_min_words=1,
                           user_max_tokens=12, max_new_tokens=6, seed=3)
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    stats = distill.generate(config, whole, 8)
    assert stats["tried"] == 8 and stats["shards"] == 2 and stats["kept"] >= 1
    assert distill.generate(config, parts, 4)["shards"] == 1
    assert distill.generate(config, parts, 8)["shards"] == 1  # continues after conversation 3
    assert distill.generate(config, parts, 8)["shards"] == 0  # nothing left to do
    a, b = distill.shards(whole), distill.shards(parts)
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        sx, sy = distill.read_shard(x), distill.read_shard(y)
        assert sx["users"] == sy["users"]
        assert torch.equal(sx["tokens"], sy["tokens"])
        assert torch.equal(sx["indices"], sy["indices"])
    # Every stored row is the decoder's capture of that conversation (bfloat16 storage).
    decoder, _ = load_model(str(checkpoint), "float32")
    n = decoder.config.n_layers
    decoder.set_capture_layers((*distill.eagle3_layers(n), n))
    count = 0
    for tokens, prompt_len, feats in distill.iter_conversations(whole):
        assert 0 < prompt_len < tokens.numel()
        assert feats.shape == (tokens.numel() - 1, 4, decoder.config.hidden_size)
        _, want = decoder.forward_batch_with_hidden(tokens[:-1], 0, decoder.new_cache())
        got = feats.float().reshape(feats.shape[0], -1)
        torch.testing.assert_close(got, want.to(torch.bfloat16).float(), atol=0.02, rtol=0.02)
        count += 1
    assert count == stats["kept"]
    # Another recipe does not mix into the same directory.
    with pytest.raises(ValueError, match="another recipe"):
        distill.generate(dataclasses.replace(config, max_new_tokens=7), whole, 12)


def test_answers_are_the_targets_greedy_continuations(checkpoint, tmp_path):
    """The stored answer of each conversation is what the decoder itself decodes greedily
    from the stored prompt."""
    config = DistillConfig(model=str(checkpoint), dtype="float32", batch=4, user_min_words=1,
                           user_max_tokens=12, max_new_tokens=5, seed=1)
    distill.generate(config, tmp_path, 4)
    decoder, tokenizer = load_model(str(checkpoint), "float32")
    for tokens, prompt_len, _ in distill.iter_conversations(tmp_path):
        cache = decoder.new_cache()
        logits = decoder.forward_batch(tokens[:prompt_len], 0, cache)[-1]
        out = []
        while len(out) < tokens.numel() - prompt_len:
            out.append(int(logits.argmax()))
            if out[-1] == tokenizer.eos_token_id:
                break
            logits = decoder.forward_token(out[-1], cache.seq_len, cache)
        assert out == tokens[prompt_len:].tolist()


def test_config_refuses_non_positive_sizes():
    with pytest.raises(ValueError, match="batch"):
        DistillConfig(batch=0)


def test_a_user_turn_is_the_same_sampled_alone_or_in_a_batch(checkpoint):
    """Conversation i's user turn depends on (seed, i) only: sampled in a batch of 8 (where
    finished turns stay in the batch until it is compacted) or alone, the kept turns agree,
    and none carries text past its end of turn."""
    # A batch of 8: one finished turn (7 left of 8) stays in it until a quarter has finished.
    config = DistillConfig(model=str(checkpoint), dtype="float32", batch=8, user_min_words=1,
                           user_max_tokens=24, seed=5)
    decoder, tokenizer = load_model(str(checkpoint), "float32")
    together = distill.user_turns(decoder, tokenizer, config, 0, 8)
    alone = [turn for i in range(8) for turn in distill.user_turns(
        decoder, tokenizer, dataclasses.replace(config, batch=1), i, 1)]
    assert together == alone
    assert len(together) >= 2


def test_answers_to_given_prompts_are_stored_in_order(checkpoint, tmp_path):
    from specd_core.text import encode_chat

    config = DistillConfig(model=str(checkpoint), dtype="float32", batch=2, max_new_tokens=4)
    prompts = ["def add(a, b):", "The quick brown fox", "hello"]
    stats = distill.generate_answers(config, tmp_path, prompts)
    assert (stats["shards"], stats["kept"]) == (2, 3)
    _, tokenizer = load_model(str(checkpoint), "float32")
    got = [tokens[:prompt_len].tolist()
           for tokens, prompt_len, _ in distill.iter_conversations(tmp_path)]
    assert got == [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in prompts]
    assert distill.generate_answers(config, tmp_path, prompts)["shards"] == 0  # kept as is
    with pytest.raises(FileNotFoundError, match="no prompt set"):
        distill.prompt_set(str(tmp_path / "missing.txt"))


def test_eagle3_layers_refuse_a_target_too_shallow_for_distinct_defaults():
    from specd_tools.distill import eagle3_layers

    assert eagle3_layers(30) == (2, 15, 27)  # SmolLM2: the head shipped reads these
    with pytest.raises(ValueError, match="aux_layers: a 2-layer target"):
        eagle3_layers(2)  # (2, 1, -1) before: a negative capture layer
