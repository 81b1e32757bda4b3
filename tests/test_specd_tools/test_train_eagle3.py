"""EAGLE-3 training (`specd_tools.train_eagle3`) on the tiny model: the held-out acceptance it
selects checkpoints by is what greedy chain drafting with the head's own sessions gives, the
saved head is the best one and loads as a published-layout head, and training learns."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hf_checkpoints import build_checkpoint, train_tokenizer

from drafter_worker.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, load_eagle3
from specd_tools import distill
from specd_tools.distill import DistillConfig
from specd_tools.train_eagle3 import (
    Conversations,
    Eagle3TrainConfig,
    acceptance,
    choose_draft_vocab,
    train,
)
from target_worker.loader import load_model

K = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny 8-layer Llama with a chat template, 12 self-distilled conversations and
    greedy answers to 4 given prompts."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("eagle3-train")
    model = build_checkpoint(root / "llama", "llama",
                             {"num_hidden_layers": 8, "tie_word_embeddings": False}, None,
                             train_tokenizer())
    config = DistillConfig(model=str(model), dtype="float32", batch=6, user_min_words=1,
                           user_max_tokens=16, max_new_tokens=24, seed=2)
    distill.generate(config, root / "train", 12)
    distill.generate_answers(config, root / "val", ["def add(a, b):", "The quick brown fox",
                                                    "for i in range(10):", "Hugging Face"])
    return model, root / "train", root / "val"


def _replay(drafter: Eagle3Drafter, convs: Conversations) -> tuple[int, int]:
    """(steps, tokens) of greedy decoding with ``K``-token chains from ``drafter``'s own
    sessions over the stored answers (the target's greedy ones: a draft is accepted while
    it equals the stored token)."""
    steps = tokens = 0
    for t, p, f in zip(convs.tokens, convs.prompt_lens, convs.features, strict=True):
        rows = f[:, :-1].float().reshape(f.shape[0], -1)
        end = f.shape[0]  # the last stored token is never fed: drafts may reach it
        session = drafter.session()
        n = p + 1  # history: the prompt and the prefill's first answer token
        seen = 0
        while n < end + 1:
            block = session.propose(t[:n].tolist(), rows[seen: n - 1], K)
            seen = n - 1
            truth = t[n: n + K].tolist()
            acc = 0
            while acc < min(len(block), len(truth)) and block.tokens[acc] == truth[acc]:
                acc += 1
            steps += 1
            tokens += acc + 1
            n += acc + 1
    return steps, tokens


def test_held_out_acceptance_is_what_greedy_chain_drafting_gives(data):
    model, _, val_dir = data
    decoder, _ = load_model(str(model), "float32")
    val = Conversations.load(val_dir, 512)
    both = Conversations.load(f"{data[1]}{os.pathsep}{val_dir}", 512)
    assert len(both) == len(Conversations.load(data[1], 512)) + len(val)
    assert torch.equal(both.tokens[-1], val.tokens[-1])
    ids = choose_draft_vocab(val, 40, decoder.config.vocab_size)
    head = Eagle3Head.random(Eagle3Config.for_target(decoder.config, ids.numel()), seed=3,
                             draft_vocab=ids)
    head.set_target_embedding(decoder.embed_tokens.weight)
    # Teach the head something so that chains of 1, 2 and 3 accepted drafts all occur.
    with torch.no_grad():
        head.lm_head.weight.copy_(decoder.lm_head.weight[head.vocab_ids])
    got = acceptance(head, val, K)
    # float32 drafting weights: `acceptance` replays the trainer's float32 head.
    steps, tokens = _replay(Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=K,
                                          dtype="float32"), val)
    assert (got["steps"], got["tokens"]) == (steps, tokens)
    assert got["acceptance_length"] == pytest.approx(tokens / steps)
    assert got["steps"] > 0 and 1.0 <= got["acceptance_length"] <= K + 1


def test_training_learns_and_saves_the_best_head_in_a_published_layout(data, tmp_path):
    model, train_dir, _ = data
    cfg = Eagle3TrainConfig(out=str(tmp_path / "head"), data_dir=str(train_dir),
                            val_dir=str(train_dir), model=str(model), draft_vocab=64,
                            ttt_steps=2, epochs=45, batch_tokens=2048, lr=1e-2,
                            warmup_steps=5, eval_every=15, threads=1)
    summary = train(cfg, progress=False)
    evals = summary["history"]["eval"]
    assert evals[0]["step"] == 0 and len(evals) >= 3
    # Fitting its own data: acceptance rises well above the untrained head's.
    # (measured: 1.01 untrained, 2.46 after 40 steps)
    assert summary["best"]["acceptance_length"] > evals[0]["acceptance_length"] + 0.5
    decoder, _ = load_model(str(model), "float32")
    head, info = load_eagle3(tmp_path / "head", decoder.config)
    assert info["layout"] == "speculators" and info["embedding"] == "target"
    head.set_target_embedding(decoder.embed_tokens.weight)
    # The saved head is the best checkpoint (float16 on disk: counts may move by a hair).
    again = acceptance(head, Conversations.load(train_dir, 512), K)
    assert again["acceptance_length"] == pytest.approx(summary["best"]["acceptance_length"],
                                                       abs=0.05)
    assert (tmp_path / "head" / "training.png").is_file()
    recipe = summary["recipe"]
    assert recipe["ttt_steps"] == 2 and summary["data"]["train_conversations"] > 0
    # Training continues from a saved head: its draft vocabulary and weights to start with.
    more = train(dataclasses.replace(cfg, out=str(tmp_path / "more"), init=str(tmp_path / "head"),
                                     epochs=2, eval_every=100), progress=False)
    assert more["history"]["eval"][0]["acceptance_length"] == pytest.approx(
        again["acceptance_length"], abs=0.05)
    assert torch.equal(load_eagle3(tmp_path / "more", decoder.config)[0].vocab_ids,
                       head.vocab_ids)
    # Another target's shape is refused before anything is trained.
    with pytest.raises(ValueError, match="3 aux layers"):
        train(dataclasses.replace(cfg, model="tiny-random", out=str(tmp_path / "x")),
              progress=False)


def test_config_refuses_out_of_range_values():
    with pytest.raises(ValueError, match="step_decay"):
        Eagle3TrainConfig(out="o", data_dir="d", val_dir="v", step_decay=0)
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3TrainConfig(out="o", data_dir="d", val_dir="v", ttt_steps=0)


def test_the_cli_generates_conversations_and_held_out_answers_then_trains(data, tmp_path,
                                                                          capsys):
    import json

    from specd_tools import cli

    model, _, _ = data
    prompts = tmp_path / "held.txt"
    prompts.write_text("def add(a, b):\nThe quick brown fox\n")
    argv = ["train-drafter", "--arch", "eagle3", "--model", str(model), "--out",
            str(tmp_path / "head"), "--data-dir", str(tmp_path / "convs"), "--conversations",
            "64", "--gen-dtype", "float32", "--val-prompts", str(prompts), "--epochs", "2",
            "--draft-vocab", "32", "--threads", "1", "--eval-every", "5"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["data"]["val_conversations"] == 2 and out["data"]["train_conversations"] >= 1
    assert len(distill.shards(tmp_path / "convs")) == 1  # one batch of 64
    assert len(distill.shards(tmp_path / "convs-val")) == 1
    decoder, _ = load_model(str(model), "float32")
    assert load_eagle3(tmp_path / "head", decoder.config)[0].config.draft_vocab_size == 32
    # A flag of the other trainer is refused by name.
    for bad, flag in (([*argv, "--chat-repeat", "2"], "--chat-repeat"),
                      (["train-drafter", "--out", "x.safetensors", "--ttt-steps", "2"],
                       "--ttt-steps")):
        with pytest.raises(SystemExit) as exc:
            cli.main(bad)
        assert exc.value.code == 2 and flag in capsys.readouterr().err
