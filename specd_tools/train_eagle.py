"""Training an EAGLE head offline on this machine (``specd train-drafter``).

Data, all available offline with no downloads:

- self-distillation: the target's own greedy answers to the prompts in
  `specd_tools.data.train_prompts` (through its chat template), generated in packed
  batches (`Decoder.forward_packed`, one KV cache per answer);
- English prose from the Python standard library (the reference's topic pages, then
  docstrings; see `stdlib_texts`), in fixed windows, one prefill each.

The target's final-norm hidden states come out of those same forwards and are cached to disk
(float16) with the tokens: answers per prompt (so more prompts cost only the new answers),
prose per recipe. The target's next-token distribution is ``softmax(lm_head(h))``, so it is
recomputed from the cached hidden states rather than stored. On the 2-core CPU a
self-distilled token costs ~11 ms and a prose token ~3 ms; a training pass over a token
~1 ms, so answers are re-used several times per epoch (``chat_repeat``).

Loss (EAGLE-1, arXiv 2401.15077, section 4.2): smooth-L1 between predicted and true next
features plus ``ce_weight`` x cross-entropy of the head's distribution against the
target's, both over the draft vocabulary; uniform noise on input features (as in EAGLE)
makes the head robust to its own prediction errors when drafting autoregressively.
``unroll`` > 1 also trains the later drafting steps on the head's own predicted features
(EAGLE-3's training-time test, `EagleHead.forward_unrolled`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from drafter_worker.eagle import EagleConfig, EagleDrafter, EagleHead

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    """Everything that defines a training run (recorded next to the head).

    Raises:
        ValueError: naming a non-positive size or a fraction outside [0, 1).
    """

    out: str
    model: str | None = None
    data_dir: str = "eagle-data"
    max_prompts: int = 0  # 0: all of `train_prompts.prompts()`
    max_new_tokens: int = 192
    gen_batch: int = 48
    stdlib_tokens: int = 40_000
    seq_len: int = 256
    draft_vocab: int = 8192
    ffn_dim: int = 0  # 0: the target's
    epochs: int = 8
    batch_size: int = 8
    chat_repeat: int = 1  # times each training answer appears per epoch (prose: once)
    unroll: int = 1  # drafting steps replayed in training (1: EAGLE-1's teacher forcing)
    lr: float = 1e-3
    ce_weight: float = 0.1
    noise: float = 0.2
    heldout_fraction: float = 0.08
    eval_positions: int = 1200
    eval_k: int = 5
    time_budget_s: float = 0.0  # 0: no limit; else stop training after this many seconds
    threads: int = 2
    seed: int = 0
    plot: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "gen_batch", "seq_len", "draft_vocab", "epochs",
                     "batch_size", "chat_repeat", "unroll", "eval_k", "threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("max_prompts", "stdlib_tokens", "ffn_dim", "eval_positions"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


# ---- data ----------------------------------------------------------------------------------


def stdlib_texts(limit_chars: int) -> list[str]:
    """English prose from the Python standard library, up to ``limit_chars`` characters.

    In order: the Python reference's topic pages (``pydoc_data.topics``), then the docstrings
    of the standard library's modules, classes and functions (``ast``, sorted by path; test
    suites, ``site-packages``, ``idlelib``, ``lib2to3`` and ``tkinter`` skipped; docstrings
    under 200 characters skipped), then, if still short, the modules' raw source. Prose comes
    first because chat answers are prose; code is what prompt lookup already drafts well.
    """
    import ast

    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    total = 0

    def add(text: str) -> bool:
        nonlocal total
        out.append(text)
        total += len(text)
        return total >= limit_chars

    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip it
        topics = {}
    for key in sorted(topics):
        if add(topics[key]):
            return out
    sources = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("test", "site-packages", "idlelib", "lib2to3", "tkinter")) \
                or "/test" in rel:
            continue
        try:
            sources.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
    for text in sources:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                 ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200 and add(doc):
                    return out
    for text in sources:
        if add(text):
            break
    return out


@torch.inference_mode()
def self_distill(decoder, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 batch: int, eos: int | None, progress: bool = True
                 ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The target's greedy answers, with the hidden states computed on the way.

    Answers stop after ``eos`` or ``max_new_tokens``; batches of ``batch`` answers share one
    packed forward per step (`Decoder.forward_packed`, one KV cache each).

    Returns:
        ``(sequences, hidden)``: ``prompt + answer`` minus its last token (which was never
        fed to the target), and float16 ``[len(sequence), H]`` final-norm hidden states.
    """
    from tqdm import tqdm

    seqs_out: list[list[int]] = []
    hidden_out: list[torch.Tensor] = []
    bar = tqdm(total=len(prompts), desc="self-distil", unit="answer", disable=not progress)
    for lo in range(0, len(prompts), batch):
        group = [list(p) for p in prompts[lo: lo + batch]]
        caches = [decoder.new_cache(capacity=min(512, decoder.config.max_seq_len))
                  for _ in group]
        outs = decoder.forward_packed([(p, 0, c) for p, c in zip(group, caches, strict=True)],
                                      last_logits_only=[True] * len(group))
        seqs = [list(p) for p in group]
        rows: list[list[torch.Tensor]] = [[h.half().clone()] for _, h in outs]
        live = []
        for i, (logits, _) in enumerate(outs):
            seqs[i].append(int(logits[-1].argmax()))
            live.append(i)
        for _ in range(max_new_tokens - 1):
            live = [i for i in live if seqs[i][-1] != eos]
            if not live:
                break
            outs = decoder.forward_packed(
                [([seqs[i][-1]], caches[i].seq_len, caches[i]) for i in live])
            for i, (logits, h) in zip(live, outs, strict=True):
                seqs[i].append(int(logits[-1].argmax()))
                rows[i].append(h.half().clone())
        for seq, r in zip(seqs, rows, strict=True):
            seqs_out.append(seq[:-1])
            hidden_out.append(torch.cat(r))
        bar.update(len(group))
    bar.close()
    return seqs_out, hidden_out


@torch.inference_mode()
def target_hidden(decoder, sequences: Sequence[Sequence[int]], progress: bool = True
                  ) -> list[torch.Tensor]:
    """float16 ``[len(seq), H]`` final-norm hidden states of each sequence (one forward)."""
    from tqdm import tqdm

    out = []
    for seq in tqdm(sequences, desc="target hidden", unit="seq", disable=not progress):
        _, hidden = decoder.forward_batch_with_hidden(list(seq), 0, decoder.new_cache(
            capacity=len(seq)), last_logits_only=True)
        out.append(hidden.half().clone())
    return out


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def distill_answers(cfg: TrainConfig, decoder, tokenizer, model_id: str,
                    prompts: Sequence[Sequence[int]], progress: bool = True
                    ) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """`self_distill` with a per-answer disk cache under ``cfg.data_dir``.

    The cache maps each prompt's token ids (for this model and answer length) to its answer
    and hidden rows, and is written after every batch: adding prompts generates only the new
    ones, and an interrupted run resumes.

    Returns:
        ``(sequences, hidden, seconds)`` in the order of ``prompts``; ``seconds`` is what
        generating these answers took (each batch's time shared among its answers), cached
        or not.
    """
    max_new = min(cfg.max_new_tokens, cfg.seq_len // 2)
    path = Path(cfg.data_dir) / f"answers-{_key(model_id, max_new, 'v4')}.pt"
    store: dict = torch.load(path) if path.is_file() else {}
    keys = [_key(list(p)) for p in prompts]
    todo = [i for i, k in enumerate(keys) if k not in store]
    if store:
        log.info("answer cache %s: %d of %d prompts cached", path, len(prompts) - len(todo),
                 len(prompts))
    eos = getattr(tokenizer, "eos_token_id", None)
    for lo in range(0, len(todo), cfg.gen_batch):
        group = todo[lo: lo + cfg.gen_batch]
        t0 = time.perf_counter()
        seqs, hidden = self_distill(decoder, [prompts[i] for i in group], max_new,
                                    cfg.gen_batch, eos, progress)
        share = (time.perf_counter() - t0) / len(group)
        for i, seq, hid in zip(group, seqs, hidden, strict=True):
            store[keys[i]] = (seq, hid, share)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(store, path)
    return ([store[k][0] for k in keys], [store[k][1] for k in keys],
            sum(store[k][2] for k in keys))


def build_dataset(cfg: TrainConfig, decoder, tokenizer, model_id: str,
                  progress: bool = True) -> dict:
    """Tokens and target hidden states of the training data, cached under ``cfg.data_dir``
    (answers per prompt, see `distill_answers`; the standard-library windows per recipe).

    Returns:
        ``{"sequences": list[list[int]], "hidden": list[fp16 Tensor [len, H]],
        "kinds": list[str] ("chat" | "stdlib"), "prompt_lens": list[int], "stats": dict}``.
    """
    from specd_core.text import encode_prompt

    from .data.train_prompts import prompts as train_prompts

    texts = train_prompts()
    if cfg.max_prompts and cfg.max_prompts < len(texts):
        # An even spread over the list (subjects and templates), not its head.
        texts = [texts[i * len(texts) // cfg.max_prompts] for i in range(cfg.max_prompts)]
    encoded = [encode_prompt(tokenizer, t, raw=False)[: cfg.seq_len // 2] for t in texts]
    chats, chat_hidden, gen_s = distill_answers(cfg, decoder, tokenizer, model_id, encoded,
                                                progress)
    seqs, kinds, prompt_lens = list(chats), ["chat"] * len(chats), [len(p) for p in encoded]
    t1 = time.perf_counter()
    hidden_s = 0.0
    std_seqs: list[list[int]] = []
    std_hidden: list[torch.Tensor] = []
    if cfg.stdlib_tokens:
        path = Path(cfg.data_dir) / (
            f"stdlib-{_key(model_id, cfg.stdlib_tokens, cfg.seq_len, 'v4')}.pt")
        if path.is_file():
            std_seqs, std_hidden, hidden_s = torch.load(path)
        else:
            budget = cfg.stdlib_tokens
            for text in stdlib_texts(limit_chars=cfg.stdlib_tokens * 5):
                ids = list(tokenizer.encode(text, add_special_tokens=False))
                for lo in range(0, max(len(ids) - 16, 1), cfg.seq_len):
                    window = ids[lo: lo + cfg.seq_len]
                    if len(window) < 16:
                        break
                    std_seqs.append(window)
                    budget -= len(window)
                    if budget <= 0:
                        break
                if budget <= 0:
                    break
            std_hidden = target_hidden(decoder, std_seqs, progress)
            hidden_s = time.perf_counter() - t1
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save((std_seqs, std_hidden, hidden_s), path)
    seqs += std_seqs
    kinds += ["stdlib"] * len(std_seqs)
    prompt_lens += [0] * len(std_seqs)
    stats = {
        "chat_sequences": len(chats),
        "chat_answer_tokens": sum(len(s) - p for s, p in zip(chats, prompt_lens, strict=False)),
        "stdlib_sequences": len(std_seqs),
        "stdlib_tokens": sum(len(s) for s in std_seqs),
        "total_tokens": sum(len(s) for s in seqs),
        "self_distill_s": round(gen_s, 1),
        "hidden_s": round(hidden_s, 1),
    }
    return {"sequences": seqs, "hidden": chat_hidden + std_hidden, "kinds": kinds,
            "prompt_lens": prompt_lens, "stats": stats}


def choose_draft_vocab(sequences: Sequence[Sequence[int]], size: int, vocab_size: int,
                       always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``sequences`` (ties by id), plus ``always``
    (e.g. EOS); padded with the lowest unused ids when the data has fewer distinct tokens.
    Returns int64 ``[min(size, vocab_size)]``, sorted."""
    size = min(size, vocab_size)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for seq in sequences:
        counts += torch.bincount(torch.as_tensor(list(seq), dtype=torch.long),
                                 minlength=vocab_size)
    for t in always:
        counts[int(t)] = counts.max() + 1
    # Stable order: by count descending, then id ascending.
    order = sorted(range(vocab_size), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


# ---- training ------------------------------------------------------------------------------


def _batches(items: list[int], batch_size: int, rng: random.Random) -> list[list[int]]:
    items = list(items)
    rng.shuffle(items)
    return [items[i: i + batch_size] for i in range(0, len(items), batch_size)]


def _pad(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros((len(tensors), length, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
    for i, t in enumerate(tensors):
        out[i, : t.shape[0]] = t
    return out


def train_step(head: EagleHead, embed: torch.Tensor, lm_sub: torch.Tensor,
               seqs: list[list[int]], hidden: list[torch.Tensor], noise: float,
               ce_weight: float, gen: torch.Generator | None = None, unroll: int = 1) -> dict:
    """Losses of one batch (no optimiser step).

    ``unroll`` > 1 adds drafting's later steps (`EagleHead.forward_unrolled`); the loss is
    the mean over passes, pass ``j`` scored at positions ``>= j``.

    Returns:
        ``{"loss": tensor with grad, "feature", "ce", "top1": floats of pass 0,
        "top1_per_pass": [unroll floats]}`` (``top1`` = how often the head's argmax over the
        draft vocabulary equals the target's).
    """
    length = max(len(s) for s in seqs)
    tokens = _pad([torch.as_tensor(s, dtype=torch.long) for s in seqs], length)
    feats = _pad([h.float() for h in hidden], length)
    mask = _pad([torch.ones(len(s)) for s in seqs], length)[:, 1:]  # valid (t, t+1) pairs
    inputs = feats[:, :-1]
    if noise > 0:
        inputs = inputs + (torch.rand(inputs.shape, generator=gen) - 0.5) * noise
    preds = head.forward_unrolled(inputs, embed[tokens[:, 1:]].float(), unroll)
    target = feats[:, 1:]
    with torch.no_grad():
        target_logits = target @ lm_sub.T
        p = torch.softmax(target_logits, -1)
        target_top = target_logits.argmax(-1)
    total = torch.zeros(())
    stats: dict = {"top1_per_pass": []}
    for j, pred in enumerate(preds):
        m = mask.clone()
        m[:, :j] = 0  # pass j needs an anchor j positions back
        denom = m.sum().clamp(min=1)
        feature = (F.smooth_l1_loss(pred, target, reduction="none").mean(-1) * m).sum() / denom
        logits = pred @ lm_sub.T
        ce = (-(p * torch.log_softmax(logits, -1)).sum(-1) * m).sum() / denom
        top1 = float(((logits.argmax(-1) == target_top).float() * m).sum() / denom)
        total = total + feature + ce_weight * ce
        stats["top1_per_pass"].append(top1)
        if j == 0:
            stats.update(feature=float(feature.detach()), ce=float(ce.detach()), top1=top1)
    stats["loss"] = total / len(preds)
    return stats


@torch.inference_mode()
def evaluate_acceptance(drafter: EagleDrafter, seqs: Sequence[Sequence[int]],
                        hidden: Sequence[torch.Tensor], starts: Sequence[int], k: int,
                        max_positions: int) -> dict:
    """Greedy acceptance on held-out target answers (which are the target's greedy output, so
    a drafted token is accepted exactly when it equals the next answer token).

    For up to ``max_positions / len(seqs)`` positions ``p`` spread evenly over each answer
    (from ``starts[i]``), the drafter sees the history up
    to ``p`` with its hidden rows, incrementally as in decoding, and drafts ``k`` tokens.

    Returns:
        ``{"acceptance_length": 1 + mean accepted prefix, "accept_rate_per_position":
        [k floats, conditional on reaching the position], "positions": int}``.
    """
    reached = [0] * k
    accepted = [0] * k
    total_prefix, positions = 0, 0
    per_seq = max(1, max_positions // max(1, len(seqs)))
    for seq, hid, start in zip(seqs, hidden, starts, strict=True):
        session = drafter.session()
        last = len(seq) - 1
        span = list(range(max(start, 1), last))
        stride = max(1, len(span) // per_seq)
        ends = span[::stride][:per_seq]  # spread over the whole answer
        prev = 0
        for p in ends:  # history seq[: p + 1], anchor seq[p]; rows for positions < p
            rows = hid[prev:p].float() if prev else hid[:p].float()
            block = session.propose(seq[: p + 1], rows, k)
            prev = p
            n = 0
            for i, token in enumerate(block.tokens):
                if p + 1 + i > last:
                    break
                reached[i] += 1
                if token != seq[p + 1 + i]:
                    break
                accepted[i] += 1
                n += 1
            total_prefix += n
            positions += 1
    return {
        "acceptance_length": 1 + total_prefix / positions if positions else None,
        "accept_rate_per_position": [a / r if r else 0.0 for a, r in zip(accepted, reached,
                                                                         strict=True)],
        "positions": positions,
    }


def train(cfg: TrainConfig, decoder=None, tokenizer=None, progress: bool = True) -> dict:
    """Builds (or reuses) the dataset, trains a head, evaluates it every epoch, saves it.

    Writes ``cfg.out`` (float16 safetensors head), ``cfg.out`` with ``.json`` (the recipe,
    data statistics, timings and per-epoch metrics) and, with ``cfg.plot``, a ``.png`` of the
    curves.

    Args:
        decoder, tokenizer: the target (default: `target_worker.load_model(cfg.model)`).

    Returns:
        The JSON sidecar's content.
    """
    from tqdm import tqdm

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    if decoder is None:
        from target_worker.loader import load_model

        decoder, tokenizer = load_model(cfg.model)
    model_id = str(cfg.model or "SmolLM2-135M-Instruct (default)")
    data = build_dataset(cfg, decoder, tokenizer, model_id, progress)
    t_data = time.perf_counter() - t_start
    seqs, hidden, kinds = data["sequences"], data["hidden"], data["kinds"]
    # Held out: the last chat answers (prompts never trained on).
    chat_ids = [i for i, k in enumerate(kinds) if k == "chat"]
    n_held = int(round(len(chat_ids) * cfg.heldout_fraction))
    held = chat_ids[len(chat_ids) - n_held:] if n_held else []
    held_set = set(held)
    train_ids = [i for i in range(len(seqs)) if i not in held_set]
    # Self-distilled answers are the drafting domain but scarce (generation is ~17x dearer
    # per token than a prose prefill): they are seen chat_repeat times per epoch.
    epoch_ids = [i for i in train_ids for _ in range(cfg.chat_repeat if kinds[i] == "chat"
                                                     else 1)]
    eos = getattr(tokenizer, "eos_token_id", None)
    vocab = choose_draft_vocab([seqs[i] for i in train_ids], cfg.draft_vocab,
                               decoder.config.vocab_size, always=[eos] if eos is not None else [])
    econf = EagleConfig.for_target(decoder.config, cfg.draft_vocab, cfg.ffn_dim or None)
    head = EagleHead.random(econf, seed=cfg.seed, draft_vocab=vocab)
    embed = decoder.embed_tokens.weight.detach()
    lm_sub = decoder.lm_head.weight.detach()[vocab].float().contiguous()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    steps_per_epoch = math.ceil(len(epoch_ids) / cfg.batch_size)
    total_steps = steps_per_epoch * cfg.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=total_steps,
                                                pct_start=0.05, anneal_strategy="cos")
    history: dict = {"step_loss": [], "epochs": []}
    covered = torch.zeros(decoder.config.vocab_size, dtype=torch.bool)
    covered[vocab] = True
    held_tokens = [t for i in held for t in seqs[i][data["prompt_lens"][i]:]]
    coverage = (float(covered[torch.tensor(held_tokens)].float().mean())
                if held_tokens else None)

    def run_eval() -> dict:
        head.eval()
        drafter = EagleDrafter(head, embed, decoder.lm_head.weight, max_draft_len=cfg.eval_k,
                               stop_token_ids=[eos] if eos is not None else [])
        return evaluate_acceptance(drafter, [seqs[i] for i in held], [hidden[i] for i in held],
                                   [data["prompt_lens"][i] for i in held], cfg.eval_k,
                                   cfg.eval_positions)

    t_train = time.perf_counter()
    stopped_early = False
    for epoch in range(cfg.epochs):
        head.train()
        bar = tqdm(_batches(epoch_ids, cfg.batch_size, rng), desc=f"epoch {epoch + 1}",
                   unit="batch", disable=not progress)
        sums = {"loss": 0.0, "feature": 0.0, "ce": 0.0, "top1": 0.0}
        n = 0
        for batch in bar:
            out = train_step(head, embed, lm_sub, [seqs[i] for i in batch],
                             [hidden[i] for i in batch], cfg.noise, cfg.ce_weight, gen,
                             cfg.unroll)
            opt.zero_grad(set_to_none=True)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            if sched.last_epoch + 1 < total_steps:
                sched.step()
            loss = float(out["loss"].detach())
            history["step_loss"].append(loss)
            for key in sums:
                sums[key] += loss if key == "loss" else out[key]
            n += 1
            bar.set_postfix(loss=f"{loss:.3f}", top1=f"{out['top1']:.2f}")
            if cfg.time_budget_s and time.perf_counter() - t_train > cfg.time_budget_s:
                stopped_early = True
                break
        bar.close()
        metrics = {k: v / max(n, 1) for k, v in sums.items()}
        metrics["epoch"] = epoch + 1
        metrics["elapsed_s"] = round(time.perf_counter() - t_train, 1)
        if held:
            metrics["eval"] = run_eval()
        history["epochs"].append(metrics)
        log.info("epoch %d: %s", epoch + 1, json.dumps(metrics))
        if progress:
            ev = metrics.get("eval") or {}
            al = ev.get("acceptance_length")
            print(f"[train-drafter] epoch {epoch + 1}: loss={metrics['loss']:.4f} "
                  f"top1={metrics['top1']:.3f} held-out acceptance_length="
                  f"{'-' if al is None else f'{al:.2f}'} per-position="
                  f"{[round(x, 2) for x in ev.get('accept_rate_per_position', [])]}",
                  flush=True)
        if stopped_early:
            break
    train_s = time.perf_counter() - t_train
    sidecar = {
        "config": asdict(cfg),
        "eagle_config": asdict(econf),
        "model": model_id,
        "data": data["stats"],
        "train_sequences": len(train_ids),
        "sequences_per_epoch": len(epoch_ids),
        "heldout_sequences": len(held),
        "heldout_token_coverage_by_draft_vocab": coverage,
        "timings_s": {"data": round(t_data, 1), "train": round(train_s, 1),
                      "total": round(time.perf_counter() - t_start, 1)},
        "stopped_by_time_budget": stopped_early,
        "torch_threads": cfg.threads,
        "epochs": history["epochs"],
        "step_loss": [round(x, 5) for x in history["step_loss"]],
    }
    out = Path(cfg.out)
    head.eval()
    head.save(out, metadata={k: sidecar[k] for k in ("model", "data", "timings_s")})
    out.with_suffix(".json").write_text(json.dumps(sidecar, indent=2) + "\n")
    if cfg.plot:
        try:
            plot_curves(history, out.with_suffix(".png"))
        except ImportError:
            log.warning("matplotlib is not installed: no PNG (pip install 'specd[train]')")
    return sidecar


def plot_curves(history: dict, path: Path) -> None:
    """PNG: training loss per step (left), held-out acceptance length per epoch (right).

    Raises:
        ImportError: matplotlib is missing (the ``train`` extra).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(history["step_loss"], lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("loss (smooth L1 + w * CE)")
    a.set_yscale("log")
    a.set_title("training loss")
    epochs = [e["epoch"] for e in history["epochs"] if e.get("eval")]
    if epochs:
        b.plot(epochs, [e["eval"]["acceptance_length"] for e in history["epochs"]
                        if e.get("eval")], marker="o", label="acceptance length (k=5)")
        b.plot(epochs, [1 + e["top1"] for e in history["epochs"] if e.get("eval")],
               marker="s", label="1 + train top-1")
        b.set_xlabel("epoch")
        b.set_title("held-out greedy acceptance")
        b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
