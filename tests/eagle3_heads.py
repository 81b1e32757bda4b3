"""Tiny EAGLE-3 heads for the served-path tests: a head trained for a few seconds on a tiny
random target's own greedy continuations, so that its drafts are accepted some of the time
(a random head's almost never are), saved in the speculators layout (`Eagle3Head.save`)."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F
from drafters import plain_decode

from drafter_worker.eagle3 import Eagle3Config, Eagle3Head
from target_worker.testing import load_tiny_random

#: The tiny target: 8 layers, so EAGLE-3's default layers (2, 4, 5) are distinct.
TINY = "tiny-random:vocab=64,seed=0,layers=8"


def greedy_corpus(decoder, n: int, prompt_len: int, new: int, seed: int) -> torch.Tensor:
    """int64 ``[n, prompt_len + new]``: random prompts and the target's greedy continuations."""
    rng = random.Random(seed)
    vocab = decoder.config.vocab_size
    seqs = []
    for _ in range(n):
        prompt = [rng.randrange(1, vocab) for _ in range(prompt_len)]
        seqs.append(prompt + plain_decode(decoder, prompt, new))
    return torch.tensor(seqs)


def trained_head(model: str = TINY, steps: int = 80, seed: int = 0) -> Eagle3Head:
    """An EAGLE-3 head (full draft vocabulary) for ``model`` trained with teacher forcing and
    one unrolled step (`Eagle3Head.forward_unrolled`) to predict the target's greedy tokens
    on 8 random prompts; a pure function of its arguments on one torch thread."""
    decoder, _ = load_tiny_random(model)
    config = Eagle3Config.for_target(decoder.config, draft_vocab_size=decoder.config.vocab_size)
    torch.manual_seed(seed)
    head = Eagle3Head.random(config, seed=seed)
    head.set_target_embedding(decoder.embed_tokens.weight)
    seqs = greedy_corpus(decoder, 8, 8, 24, seed)
    decoder.set_capture_layers(config.aux_layers)
    try:
        rows = torch.stack([decoder.forward_batch_with_hidden(s.tolist(), 0,
                                                              decoder.new_cache())[1]
                            for s in seqs]).clone()
    finally:
        decoder.set_capture_layers(())
    t = seqs.shape[1] - 2
    aux, next_ids = rows[:, :t], seqs[:, 1:t + 1]
    params = [p for name, p in head.named_parameters() if "embed" not in name]
    opt = torch.optim.Adam(params, lr=1e-2)
    for _ in range(steps):
        outs = head.forward_unrolled(aux, next_ids, 2)
        loss = 0.0
        for j, out in enumerate(outs):  # step j at position p predicts token p + 2 + j
            logits = head.draft_logits(out)[:, : t - j]
            loss = loss + 0.8 ** j * F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), seqs[:, 2 + j:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def save_trained_head(directory: Path, model: str = TINY) -> Path:
    """`trained_head` saved in float32 at ``directory``; returns the directory."""
    return trained_head(model).save(directory, dtype=torch.float32)


def save_random_head(directory: Path, model: str = TINY, *, hidden_size: int | None = None,
                     vocab_size: int | None = None, aux_layers=None) -> Path:
    """A random head for ``model`` with its own embeddings, optionally of another
    ``hidden_size`` (both its own width and the rows' width) or ``vocab_size``, or reading
    other ``aux_layers`` (a head that does not fit the target)."""
    decoder, _ = load_tiny_random(model)
    c = decoder.config
    fields = {}
    if hidden_size is not None:
        fields.update(hidden_size=hidden_size, target_hidden_size=hidden_size)
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    if aux_layers is not None:
        fields["aux_layers"] = tuple(aux_layers)
    config = Eagle3Config.for_target(c, draft_vocab_size=min(c.vocab_size, 32), **fields)
    return Eagle3Head.random(config, seed=1, own_embedding=True).save(directory)
