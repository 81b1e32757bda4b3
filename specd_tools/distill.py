"""Self-distillation data for drafter heads: conversations the target writes itself, with the
target's hidden states, generated in large batches and stored compactly, resumable.

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned
LLMs with Nothing", arXiv 2406.08464): an instruction-tuned model given only its chat
template's opening up to the user header writes a plausible user turn. Here the target samples
that turn at temperature 1 from its own template (system prompt included, as served), the turn
is decoded and rendered again through the template (so the answer's prompt is tokenized as a
served request's would be), and the target answers greedily: the answers are what the target
serves at temperature 0, which a drafter for it must predict.

Every generated position keeps the residual streams a drafter reads (EAGLE-3's layers ``(2,
N // 2, N - 3)`` by default) and the last layer's output before the final norm (its norm and
the LM head give the target's next-token distribution, so nothing vocabulary-sized is stored),
as captured by `target_worker.model.Decoder.set_capture_layers`: bfloat16, ``4 * H`` values
per position (4.6 KB for SmolLM2).

Generation runs the target's own layers (its weights, norms, projections, RoPE and FFN) over a
batch of sequences padded into one KV cache with ``scaled_dot_product_attention``: one call
per layer for the whole batch. The serving engine attends per request, exactly and
batch-invariantly (`target_worker.model.Attention`), which costs ~10 ms per sequence per step
on the 2-core CPU at 64 sequences; data generation needs neither property (a row computed in
another batch differs in its last bits, which training does not see) and runs several times
faster this way (``python -m specd_tools.distill --bench``).

Storage: ``shard-NNNNN.safetensors`` files, each a batch of conversations (``tokens`` int32,
``offsets`` int64, ``prompt_lens`` int32, ``features`` bfloat16 ``[positions, layers, H]``
where a conversation of ``T`` tokens has ``T - 1`` feature rows, one per fed token) with the
recipe in the metadata. A shard is written whole (to a temporary name, then renamed), so an
interrupted run loses at most the batch in progress and a rerun continues after the last
shard: conversation ``i``'s user turn is drawn from a generator seeded by ``(seed, i)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from target_worker.model import Decoder, apply_rope, rope_tables

log = logging.getLogger(__name__)

#: A shard file name's pattern (its index, zero-padded).
SHARD = "shard-{:05d}.safetensors"


def eagle3_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default target layers for an ``n_layers``-layer target: the residual stream
    entering layers 2, N // 2 and N - 3 (SafeAILab/EAGLE, vLLM and SGLang agree).

    Raises:
        ValueError: a target with fewer than 7 layers (`default_aux_layers`).
    """
    from drafter_worker.eagle3 import default_aux_layers

    return default_aux_layers(n_layers)


@dataclass(frozen=True)
class DistillConfig:
    """What a data set is made of (recorded in every shard; a rerun must match it).

    Attributes:
        model: the target (`target_worker.loader.load_model` source; None: SmolLM2).
        dtype: the target's compute dtype while generating.
        layers: captured layers (`Decoder.set_capture_layers` convention; the last is
            ``n_layers``, the stream before the final norm).
        seed: conversation ``i`` draws its user turn from ``Generator(seed * 2**32 + i)``.
        user_max_tokens: a user turn longer than this is dropped (not ended by the
            template's end-of-turn token).
        user_min_words: a shorter user turn is dropped.
        max_new_tokens: the answer's cap.
        batch: sequences generated together.
    """

    model: str | None = None
    dtype: str = "bfloat16"
    layers: tuple[int, ...] = ()
    seed: int = 0
    user_max_tokens: int = 96
    user_min_words: int = 3
    max_new_tokens: int = 320
    batch: int = 64

    def __post_init__(self) -> None:
        for name in ("user_max_tokens", "user_min_words", "max_new_tokens", "batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


# ---- the batched forward --------------------------------------------------------------------


class BatchForward:
    """The target's layers over ``B`` sequences in one padded KV cache.

    Each sequence has its own length; new tokens are fed one per sequence per step (or a
    whole prompt per sequence, right-aligned, in `prefill`). Attention is one
    ``scaled_dot_product_attention`` per layer with a boolean mask of each row's own keys.

    Args:
        decoder: the target (any dtype; its modules compute, unplanned).
        batch: sequences.
        capacity: positions per sequence.
    """

    def __init__(self, decoder: Decoder, batch: int, capacity: int):
        c = self.config = decoder.config
        self.decoder = decoder
        self.batch = batch
        self.capacity = capacity
        dtype = decoder.dtype
        shape = (c.n_layers, batch, c.n_kv_heads, capacity, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        #: Per row: the cache slot of each row's next key, and which slots hold its keys.
        self.length = torch.zeros(batch, dtype=torch.long)
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool)
        self.pos = torch.zeros(batch, dtype=torch.long)  # absolute position of the next token
        cos, sin = rope_tables(c.head_dim, c.rope_theta, capacity, c.rope_scaling)
        self.cos, self.sin = cos.to(dtype), sin.to(dtype)

    def keep(self, rows: torch.Tensor) -> None:
        """Keeps only the sequences ``rows`` (int64 indices, in their new order): finished
        sequences stop costing compute."""
        self.k, self.v = self.k[:, rows], self.v[:, rows]
        self.length, self.valid, self.pos = self.length[rows], self.valid[rows], self.pos[rows]
        self.batch = int(rows.numel())

    @torch.inference_mode()
    def feed(self, tokens: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feeds ``tokens`` int64 ``[B, n]`` (row ``b``'s real tokens are the last
        ``real[b]`` of its ``n``; earlier entries are padding and write no key).

        Returns:
            ``(logits float32 [B, vocab] of each row's last fed token, captured float32 [B,
            n, len(layers) * H] or None)`` (`Decoder.capture_layers` chooses the rows).

        Raises:
            ValueError: a row would pass the cache's capacity.
        """
        d = self.decoder
        c = self.config
        b, n = tokens.shape
        if int((self.length + n).max()) > self.capacity:
            raise ValueError(f"a sequence would exceed the batch cache's {self.capacity} "
                             "positions")
        cols = torch.arange(n)
        is_real = cols[None, :] >= (n - real)[:, None]  # [B, n]
        # Absolute positions of the real tokens (padding takes position 0; masked anyway).
        offs = (cols[None, :] - (n - real)[:, None]).clamp(min=0)
        positions = self.pos[:, None] + offs
        slots = self.length[:, None] + offs  # cache slot of each real token
        h, kvh, hd = c.n_heads, c.n_kv_heads, c.head_dim
        cos = self.cos[positions.clamp(max=self.capacity - 1)][:, :, None, :]  # [B, n, 1, d]
        sin = self.sin[positions.clamp(max=self.capacity - 1)][:, :, None, :]
        # The new keys' slots become visible; row i sees slots < its own slot + 1.
        bi = torch.arange(b)[:, None].expand(b, n)
        real_b, real_s = bi[is_real], slots[is_real]
        self.valid[real_b, real_s] = True
        key_ok = self.valid[:, None, :] & (torch.arange(self.capacity)[None, None, :]
                                           <= slots[:, :, None])  # [B, n, cap]
        key_ok &= is_real[:, :, None] | (torch.arange(self.capacity) == 0)[None, None, :]
        upto = int((self.length + n).max())  # no row has a key beyond this slot
        g = h // kvh
        # [B, 1, g * n, upto]: query head j of a KV group is folded into rows j * n .. j * n + n.
        hidden = ~key_ok[:, None, :, :upto].expand(b, g, n, upto).reshape(b, 1, g * n, upto)
        x = d.embed_tokens(tokens.reshape(-1)).view(b, n, -1)
        captured = []
        capture = d.capture_layers
        for i, layer in enumerate(d.layers):
            if i in capture:
                captured.append(x)
            att = layer.attn
            qkv = att.wqkv(layer.attn_norm(x).reshape(b * n, -1)).view(b, n, h + 2 * kvh, hd)
            qk = apply_rope(qkv[:, :, : h + kvh], cos, sin)
            k_new, v_new = qk[:, :, h:], qkv[:, :, h + kvh:]
            self.k[i, real_b, :, real_s] = k_new[is_real]
            self.v[i, real_b, :, real_s] = v_new[is_real]
            # Grouped-query attention without repeating K/V: [B, kvh, g * n, d] queries.
            q = qk[:, :, :h].reshape(b, n, kvh, g, hd).permute(0, 2, 3, 1, 4)
            q = q.reshape(b, kvh, g * n, hd)
            scores = torch.matmul(q, self.k[i, :, :, :upto].transpose(-1, -2)).float()
            scores.mul_(att.scale).masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, -1).to(q.dtype)
            o = torch.matmul(probs, self.v[i, :, :, :upto])  # [B, kvh, g * n, d]
            o = o.view(b, kvh, g, n, hd).permute(0, 3, 1, 2, 4).reshape(b * n, h * hd)
            x = x + att.wo(o).view(b, n, -1)
            x = x + layer.ffn(layer.ffn_norm(x).reshape(b * n, -1)).view(b, n, -1)
        if len(d.layers) in capture:
            captured.append(x)
        self.length += n
        self.pos += real
        last = d.norm(x[:, -1])
        logits = d.lm_head(last).float()
        feats = torch.cat(captured, -1).float() if captured else None
        return logits, feats


# ---- conversations --------------------------------------------------------------------------


def magpie_prefix(tokenizer) -> tuple[list[int], list[int]]:
    """``(prefix, assistant_header)``: the chat template's tokens before a user turn's text
    (system prompt and user header) and between its end-of-turn and the assistant's text.

    Raises:
        ValueError: a template that does not render a user message as one span.
    """
    from specd_core.text import encode_chat

    marker = "\u2063MAGPIE\u2063"
    ids = encode_chat(tokenizer, [{"role": "user", "content": marker}])
    text = tokenizer.decode(ids)
    at = text.find(marker)
    if at < 0:
        raise ValueError("the chat template did not render the user message")
    prefix = list(tokenizer.encode(text[:at], add_special_tokens=False))
    return prefix, list(tokenizer.encode(text[at + len(marker):], add_special_tokens=False))


@dataclass
class Conversation:
    """One generated conversation: ``tokens`` (prompt then answer), ``prompt_len``, and the
    captured rows ``features`` ``[len(tokens) - 1, layers * H]`` (one per fed token)."""

    index: int
    user: str
    tokens: list[int]
    prompt_len: int
    features: torch.Tensor


def _sample_rows(logits: torch.Tensor, gens: Sequence[torch.Generator]) -> torch.Tensor:
    probs = torch.softmax(logits.double(), -1)
    return torch.stack([torch.multinomial(probs[i], 1, generator=g)[0]
                        for i, g in enumerate(gens)])


def user_turns(decoder: Decoder, tokenizer, config: DistillConfig, first: int, count: int
               ) -> list[tuple[int, str]]:
    """Samples user turns for conversations ``first .. first + count - 1`` at temperature 1,
    ``config.batch`` at a time from the shared template prefix; returns ``(index, text)`` for
    the turns kept (ended by the end-of-turn token within ``user_max_tokens``, at least
    ``user_min_words`` words)."""
    prefix, _ = magpie_prefix(tokenizer)
    eos = int(tokenizer.eos_token_id)
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    out = []
    saved = decoder.capture_layers
    decoder.capture_layers = ()
    try:
        for lo in range(first, first + count, config.batch):
            idx = list(range(lo, min(first + count, lo + config.batch)))
            b = len(idx)
            fwd = BatchForward(decoder, b, len(prefix) + config.user_max_tokens + 1)
            gens = [torch.Generator().manual_seed(config.seed * (1 << 32) + i) for i in idx]
            tokens = torch.tensor([prefix] * b)
            logits, _ = fwd.feed(tokens, torch.full((b,), len(prefix)))
            texts: list[list[int]] = [[] for _ in idx]
            done = torch.zeros(b, dtype=torch.bool)
            live = list(range(b))  # batch row -> sequence
            for _ in range(config.user_max_tokens):
                nxt = _sample_rows(logits, [gens[r] for r in live])
                for j, r in enumerate(live):
                    if done[r]:  # finished, still in the batch until it is compacted
                        continue
                    if int(nxt[j]) == eos:
                        done[r] = True
                    else:
                        texts[r].append(int(nxt[j]))
                if bool(done.all()):
                    break
                going = [j for j, r in enumerate(live) if not done[r]]
                if len(going) <= 3 * len(live) // 4:
                    fwd.keep(torch.tensor(going))
                    nxt, logits = nxt[going], None
                    live = [live[j] for j in going]
                logits, _ = fwd.feed(nxt[:, None], torch.ones(len(live), dtype=torch.long))
            for r, i in enumerate(idx):
                # A turn must end by the end-of-turn token and hold no other special token
                # (a sampled "<|im_start|>" would put a second turn inside the user text).
                if not done[r] or special.intersection(texts[r]):
                    continue
                text = tokenizer.decode(texts[r]).strip()
                if len(text.split()) >= config.user_min_words:
                    out.append((i, text))
    finally:
        decoder.capture_layers = saved
    return out


def answer(decoder: Decoder, tokenizer, config: DistillConfig,
           turns: Sequence[tuple[int, str]]) -> list[Conversation]:
    """The target's greedy answers to ``turns`` (``(index, user text)``), ``config.batch``
    at a time, with every fed position's captured rows."""
    from specd_core.text import encode_chat

    eos = int(tokenizer.eos_token_id)
    out = []
    for lo in range(0, len(turns), config.batch):
        part = turns[lo: lo + config.batch]
        prompts = [encode_chat(tokenizer, [{"role": "user", "content": t}]) for _, t in part]
        b, n = len(part), max(len(p) for p in prompts)
        fwd = BatchForward(decoder, b, n + config.max_new_tokens + 1)
        padded = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
        real = torch.tensor([len(p) for p in prompts])
        logits, feats = fwd.feed(padded, real)
        rows = [[feats[r, n - len(p):].to(torch.bfloat16)] for r, p in enumerate(prompts)]
        answers: list[list[int]] = [[] for _ in part]
        done = torch.zeros(b, dtype=torch.bool)
        live = list(range(b))  # batch row -> sequence
        for step in range(config.max_new_tokens):
            nxt = logits.argmax(-1)
            for j, r in enumerate(live):
                if done[r]:  # finished, still in the batch until it is compacted
                    continue
                answers[r].append(int(nxt[j]))
                if int(nxt[j]) == eos:
                    done[r] = True
            if bool(done.all()) or step == config.max_new_tokens - 1:
                break
            going = [j for j, r in enumerate(live) if not done[r]]
            if len(going) <= 3 * len(live) // 4:  # drop finished sequences from the batch
                fwd.keep(torch.tensor(going))
                nxt = nxt[going]
                live = [live[j] for j in going]
            logits, feats = fwd.feed(nxt[:, None], torch.ones(len(live), dtype=torch.long))
            for j, r in enumerate(live):
                if not done[r]:  # it fed its last answer token: keep that position's rows
                    rows[r].append(feats[j].to(torch.bfloat16))
        for r, (i, text) in enumerate(part):
            tokens = prompts[r] + answers[r]
            f = torch.cat(rows[r])[: len(tokens) - 1]
            out.append(Conversation(i, text, tokens, len(prompts[r]), f))
    return out


# ---- storage --------------------------------------------------------------------------------


def _recipe(config: DistillConfig) -> dict:
    return {**asdict(config), "layers": list(config.layers), "format": 1}


def write_shard(path: Path, conversations: Sequence[Conversation], config: DistillConfig,
                first: int, last: int, layers: int) -> None:
    """Writes ``conversations`` (from conversations ``first .. last`` tried) as one shard,
    atomically."""
    from safetensors.torch import save_file

    tokens = [torch.tensor(c.tokens, dtype=torch.int32) for c in conversations]
    lens = torch.tensor([0] + [len(t) for t in tokens], dtype=torch.int64)
    feats = torch.cat([c.features for c in conversations]) if conversations else \
        torch.zeros(0, layers, 0, dtype=torch.bfloat16)
    state = {
        "tokens": torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int32),
        "offsets": torch.cumsum(lens, 0),
        "prompt_lens": torch.tensor([c.prompt_len for c in conversations], dtype=torch.int32),
        "indices": torch.tensor([c.index for c in conversations], dtype=torch.int64),
        "features": feats.reshape(feats.shape[0], layers, -1).contiguous(),
    }
    meta = {"recipe": json.dumps(_recipe(config)), "first": str(first), "last": str(last),
            "users": json.dumps([c.user for c in conversations])}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata=meta)
    os.replace(tmp, path)


def shards(data_dir: str | os.PathLike) -> list[Path]:
    """The complete shard files in ``data_dir``, in order."""
    return sorted(Path(data_dir).glob("shard-*.safetensors"))


def read_shard(path: str | os.PathLike) -> dict:
    """A shard's tensors and metadata: ``{"tokens", "offsets", "prompt_lens", "indices",
    "features", "recipe", "first", "last", "users"}``."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    out = dict(load_file(str(path)))
    out["recipe"] = json.loads(meta["recipe"])
    out["first"], out["last"] = int(meta["first"]), int(meta["last"])
    out["users"] = json.loads(meta["users"])
    return out


def iter_conversations(data_dir: str | os.PathLike) -> Iterator[tuple[torch.Tensor, int,
                                                                      torch.Tensor]]:
    """``(tokens int64 [T], prompt_len, features bfloat16 [T - 1, layers, H])`` for every
    stored conversation, shard by shard."""
    for path in shards(data_dir):
        s = read_shard(path)
        off = s["offsets"].tolist()
        row = 0
        for j in range(len(off) - 1):
            t = s["tokens"][off[j]: off[j + 1]].long()
            n = t.numel() - 1
            yield t, int(s["prompt_lens"][j]), s["features"][row: row + n]
            row += n


def generate(config: DistillConfig, data_dir: str | os.PathLike, conversations: int,
             threads: int | None = None) -> dict:
    """Generates until ``data_dir`` holds shards covering ``conversations`` tried
    conversations (kept ones are fewer: dropped user turns), resuming after the last shard.

    Returns:
        Counts: ``{"shards", "tried", "kept", "tokens", "answer_tokens", "seconds"}`` of this
        run.

    Raises:
        ValueError: ``data_dir`` holds shards of another recipe.
    """
    from target_worker.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    existing = shards(data)
    decoder, tokenizer = load_model(config.model, config.dtype)
    layers = tuple(config.layers) or (*eagle3_layers(decoder.config.n_layers),
                                      decoder.config.n_layers)
    config = DistillConfig(**{**asdict(config), "layers": layers})
    start = 0
    if existing:
        last = read_shard(existing[-1])
        if last["recipe"] != _recipe(config):
            raise ValueError(f"{data} holds data of another recipe: {last['recipe']}")
        start = last["last"] + 1
    decoder.set_capture_layers(layers)
    began = time.perf_counter()
    stats = {"shards": 0, "tried": 0, "kept": 0, "tokens": 0, "answer_tokens": 0}
    index = len(existing)
    per_shard = config.batch
    while start < conversations:
        count = min(per_shard, conversations - start)
        turns = user_turns(decoder, tokenizer, config, start, count)
        convs = answer(decoder, tokenizer, config, turns)
        write_shard(data / SHARD.format(index), convs, config, start, start + count - 1,
                    len(layers))
        index += 1
        stats["shards"] += 1
        stats["tried"] += count
        stats["kept"] += len(convs)
        stats["tokens"] += sum(len(c.tokens) for c in convs)
        stats["answer_tokens"] += sum(len(c.tokens) - c.prompt_len for c in convs)
        elapsed = time.perf_counter() - began
        log.info("shard %d: %d/%d kept, %d answer tokens (%.0f tok/s overall)", index - 1,
                 len(convs), count, stats["answer_tokens"], stats["tokens"] / elapsed)
        start += count
    stats["seconds"] = round(time.perf_counter() - began, 1)
    return stats


def generate_answers(config: DistillConfig, data_dir: str | os.PathLike,
                     prompts: Sequence[str], threads: int | None = None) -> dict:
    """The target's greedy answers to given user ``prompts`` (an evaluation set: MT-Bench's
    first turns, say), stored as `generate` stores conversations (conversation ``i`` is
    prompt ``i``); a directory that already holds shards is left as it is.

    Returns:
        ``{"shards", "kept", "tokens", "answer_tokens", "seconds"}``.
    """
    from target_worker.loader import load_model

    if threads:
        torch.set_num_threads(threads)
    data = Path(data_dir)
    data.mkdir(parents=True, exist_ok=True)
    if shards(data):
        return {"shards": 0, "kept": 0, "tokens": 0, "answer_tokens": 0, "seconds": 0.0}
    decoder, tokenizer = load_model(config.model, config.dtype)
    layers = tuple(config.layers) or (*eagle3_layers(decoder.config.n_layers),
                                      decoder.config.n_layers)
    config = DistillConfig(**{**asdict(config), "layers": layers})
    decoder.set_capture_layers(layers)
    began = time.perf_counter()
    stats = {"shards": 0, "kept": 0, "tokens": 0, "answer_tokens": 0}
    for lo in range(0, len(prompts), config.batch):
        turns = list(enumerate(prompts))[lo: lo + config.batch]
        convs = answer(decoder, tokenizer, config, turns)
        write_shard(data / SHARD.format(stats["shards"]), convs, config, lo,
                    lo + len(turns) - 1, len(layers))
        stats["shards"] += 1
        stats["kept"] += len(convs)
        stats["tokens"] += sum(len(c.tokens) for c in convs)
        stats["answer_tokens"] += sum(len(c.tokens) - c.prompt_len for c in convs)
    stats["seconds"] = round(time.perf_counter() - began, 1)
    return stats


def prompt_set(name: str) -> list[str]:
    """User prompts by name: ``mt-bench`` (MT-Bench's 80 first turns), ``train-prompts``
    (`specd_tools.data.train_prompts`), or a file with one prompt per line.

    Raises:
        FileNotFoundError: neither a known name nor a file.
    """
    if name == "mt-bench":
        from specd_tools.bench.serve_data import load_mt_bench

        return [p.prompt for p in load_mt_bench()]
    if name == "train-prompts":
        from specd_tools.data.train_prompts import prompts

        return prompts()
    path = Path(name)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt set {name!r} (mt-bench, train-prompts or a file)")
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specd_tools.distill",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--conversations", type=int, default=1024)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompts", default=None, metavar="SET",
                   help="answer these user prompts instead of Magpie turns: mt-bench, "
                        "train-prompts or a file with one per line")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    config = DistillConfig(model=args.model, dtype=args.dtype, seed=args.seed,
                           max_new_tokens=args.max_new_tokens, batch=args.batch)
    if args.prompts:
        stats = generate_answers(config, args.data_dir, prompt_set(args.prompts), args.threads)
    else:
        stats = generate(config, args.data_dir, args.conversations, args.threads)
    print(json.dumps(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
