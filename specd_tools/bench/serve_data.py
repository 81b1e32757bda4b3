"""Workloads for `specd bench serve`: a custom JSONL file, MT-Bench's 80 questions, random
prompts of a given token length, or the repeated-structure workload; and the client-side
tokenizer the bench may use.

Each loader returns `BenchPrompt`s; `sample_prompts` picks ``--num-prompts`` of them with
``--seed``. Errors name the flag, the file, the line and the field, so a user can fix them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATASETS = ("custom", "mt-bench", "random", "structured", "json-schema")

#: MT-Bench's questions, shipped with attribution (`specd_tools/data/mt_bench/NOTICE.md`).
MT_BENCH_FILE = Path(__file__).parents[1] / "data" / "mt_bench" / "question.jsonl"

#: `random` without a tokenizer draws words from this list: one word is about one token for
#: common BPE vocabularies (each is a single token in GPT-2's and SmolLM2's), so
#: ``--input-len`` is then approximate.
FALLBACK_WORDS = tuple(
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when "
    "if so no will more can out other do time up what about into than them only some could "
    "these may then first any like now my over such our man me even most made after also "
    "did many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three".split()
)


@dataclass(frozen=True)
class BenchPrompt:
    """One request's prompt.

    Attributes:
        prompt: the user message (str), sent as one chat message.
        category: the task category (str), or None when the dataset has none.
        prompt_len: the prompt's token count before any chat template, when known
            (``random`` with a tokenizer); None otherwise.
        schema: a JSON Schema the answer is constrained to (sent as ``response_format``;
            ``json-schema``), or None.
    """

    prompt: str
    category: str | None = None
    prompt_len: int | None = None
    schema: dict | None = field(default=None, hash=False)


def load_custom(path: str | Path) -> list[BenchPrompt]:
    """``--dataset-path`` JSONL: one object per line with a non-empty ``prompt`` string and an
    optional ``category`` string; blank lines are skipped.

    Raises:
        ValueError: the file is missing or empty, or a line is not a JSON object or lacks a
            valid field; the message names ``--dataset-path``, the file, the 1-based line and
            the field.
    """
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--dataset-path {path}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"--dataset-path {path}: not UTF-8 text ({exc.reason})") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--dataset-path {path}, line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            got = "missing" if "prompt" not in row else f"got {prompt!r:.40}"
            raise ValueError(f'{where}: field "prompt" must be a non-empty string ({got})')
        category = row.get("category")
        if category is not None and not isinstance(category, str):
            raise ValueError(f'{where}: field "category" must be a string, got {category!r:.40}')
        prompts.append(BenchPrompt(prompt, category or None))
    if not prompts:
        raise ValueError(f"--dataset-path {path}: no prompts (the file is empty)")
    return prompts


def load_mt_bench() -> list[BenchPrompt]:
    """MT-Bench's 80 questions (first turns), in file order, with their categories."""
    prompts = []
    for line in MT_BENCH_FILE.read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            prompts.append(BenchPrompt(row["turns"][0], row["category"]))
    return prompts


def structured_prompts(num: int, seed: int) -> list[BenchPrompt]:
    """``num`` prompts of the repeated-structure workload
    (`specd_tools.workloads.structured`), in order (the kinds in turn, so a drafter's
    cross-request cache warms as an agent's traffic would), each kind as its category."""
    from specd_tools.workloads.structured import structured_requests

    return [BenchPrompt(text, kind) for kind, text in structured_requests(num, seed)]


def json_schema_prompts(num: int, seed: int) -> list[BenchPrompt]:
    """``num`` extraction prompts with the JSON schema their answer must match
    (`specd_tools.workloads.structured.json_schema_requests`), the kinds in turn."""
    from specd_tools.workloads.structured import json_schema_requests

    return [BenchPrompt(text, kind, schema=schema)
            for kind, text, schema in json_schema_requests(num, seed)]


def random_prompts(num: int, input_len: int, seed: int, tokenizer: Any = None) -> list[BenchPrompt]:
    """``num`` prompts of random tokens.

    With a ``tokenizer`` (``encode``/``decode`` and ``vocab_size``), token ids are drawn
    uniformly from the tokens that decode to text on their own (no special tokens, no partial
    UTF-8 bytes), decoded, and re-encoded until the text is exactly ``input_len`` tokens
    (``prompt_len``; at most 20 tries, then the closest length is kept, as merged text does
    not always re-encode to the same tokens). Without one, ``input_len`` words of
    `FALLBACK_WORDS` (about that many tokens; ``prompt_len`` None).

    Raises:
        ValueError: ``input_len < 1`` (names ``--input-len``); a tokenizer none of whose
            tokens decodes to text (names ``--tokenizer``).
    """
    if input_len < 1:
        raise ValueError(f"--input-len must be >= 1, got {input_len}")
    rng = random.Random(seed)
    if tokenizer is None:
        return [BenchPrompt(" ".join(rng.choice(FALLBACK_WORDS) for _ in range(input_len)))
                for _ in range(num)]
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    special.update(t for t in (getattr(tokenizer, "eos_token_id", None),
                               getattr(tokenizer, "bos_token_id", None)) if t is not None)
    # Tokens that decode to text on their own: a byte-level token of half a UTF-8 character
    # decodes to U+FFFD, which re-encodes to other tokens, so the length would not hold.
    vocab = [i for i in range(_vocab_size(tokenizer)) if i not in special
             and (piece := tokenizer.decode([i])) and "\ufffd" not in piece]
    if not vocab:
        raise ValueError("--tokenizer: no token of its vocabulary decodes to text")

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    prompts = []
    for _ in range(num):
        ids = [rng.choice(vocab) for _ in range(input_len)]
        best: tuple[int, str, int] | None = None  # (distance, text, length)
        for _try in range(20):
            text = tokenizer.decode(ids)
            got = encode(text)
            if best is None or abs(len(got) - input_len) < best[0]:
                best = (abs(len(got) - input_len), text, len(got))
            if len(got) == input_len:
                break
            ids = (got[:input_len] if len(got) > input_len
                   else got + [rng.choice(vocab) for _ in range(input_len - len(got))])
        prompts.append(BenchPrompt(best[1], prompt_len=best[2]))
    return prompts


def _vocab_size(tokenizer: Any) -> int:
    size = getattr(tokenizer, "vocab_size", None)
    try:
        size = max(int(size or 0), len(tokenizer))  # len counts added tokens too
    except TypeError:  # no __len__ (test tokenizers)
        pass
    if not size:
        raise ValueError("--tokenizer: the tokenizer has no vocab_size")
    return int(size)


def sample_prompts(prompts: list[BenchPrompt], num: int | None, seed: int) -> list[BenchPrompt]:
    """``num`` prompts drawn with ``seed``: each category's prompts shuffled, then taken in turn
    from every category (so 16 of MT-Bench's are 2 of each of its 8), cycling when ``num``
    exceeds the dataset; a dataset of one category (or none) is just shuffled. ``num`` None
    takes every prompt once, in dataset order.

    Raises:
        ValueError: ``num < 1`` (names ``--num-prompts``).
    """
    if num is None:
        return list(prompts)
    if num < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {num}")
    rng = random.Random(seed)
    groups: dict[str | None, list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    for group in groups.values():
        rng.shuffle(group)
    order = [g[i] for i in range(max(map(len, groups.values()))) for g in groups.values()
             if i < len(g)]
    return [order[i % len(order)] for i in range(num)]


def load_bench_tokenizer(source: str) -> Any:
    """A client-side tokenizer from what ``specd --model`` accepts: a Hugging Face directory,
    a ``.gguf`` file (its embedded tokenizer) or a ``tiny-random`` spec.

    Raises:
        ValueError: ``source`` is none of those, or does not load (names ``--tokenizer``).
    """
    from target_worker.testing import TinyTokenizer, is_tiny_random_spec, tiny_random_config

    if is_tiny_random_spec(source):
        return TinyTokenizer(tiny_random_config(source)[0].vocab_size)
    path = Path(source)
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        raise ValueError(f"--tokenizer {source!r}: expected a Hugging Face model directory, a "
                         ".gguf file or a tiny-random spec")
    from target_worker.loader import load_tokenizer

    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {source!r}: {exc}") from None


def tokenizer_source_for(model_id: str) -> str | None:
    """The model id a server reports, as a `load_bench_tokenizer` source when it names one on
    this machine (``specd serve`` and ``transformers serve`` report the ``--model`` they were
    given); else None."""
    from target_worker.testing import is_tiny_random_spec

    if is_tiny_random_spec(model_id):
        return model_id
    path = Path(model_id)
    if path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf"):
        return model_id
    return None
