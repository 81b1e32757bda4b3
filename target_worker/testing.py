"""Test doubles for running the service end to end without the real model.

``load_model("tiny-random")`` or ``load_model("tiny-random:vocab=64,seed=0,layers=2")``
returns a tiny random `Decoder` (`ModelConfig.tiny_test`; ``dense=1`` swaps its MoE FFN for a
dense SwiGLU) and a `TinyTokenizer` (``ascii=1``: one that spells printable ASCII, for
structured-output tests whose JSON needs braces and quotes). Neither is a
language model: the output is deterministic noise, which is all a plumbing test needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .config import ModelConfig
from .model import Decoder

__all__ = [
    "TINY_RANDOM",
    "TinyTokenizer",
    "is_tiny_random_spec",
    "load_tiny_random",
    "tiny_random_config",
]

#: Model source prefix routed here by `target_worker.load_model`.
TINY_RANDOM = "tiny-random"
_DEFAULTS = {"vocab": 64, "seed": 0, "layers": 2, "dense": 0, "ascii": 0}
#: The characters an ``ascii`` `TinyTokenizer` spells: printable ASCII, space to ``~``.
_ASCII = "".join(chr(c) for c in range(0x20, 0x7F))


class TinyTokenizer:
    """A deterministic character-level tokenizer (test double with the slice of the Hugging
    Face tokenizer API the service uses).

    Each character ``c`` encodes to ``ord(c) % (vocab_size - 1) + 1``, so encoding never
    produces ``eos_token_id`` (0); each id decodes to the printable character
    ``chr(0x41 + id % 58)`` ("A".."z"), so text grows by one character per token. Encoding
    is not the inverse of decoding.

    With ``ascii=True`` id ``i > 0`` decodes to printable ASCII character ``(i - 1) % 95``
    (space to ``~``) and encoding inverts that for those characters (others map as above),
    so a model with ``vocab_size >= 96`` can spell JSON.

    Raises:
        ValueError: ``vocab_size < 2``.
    """

    eos_token_id = 0
    bos_token_id = None
    pad_token_id = None

    def __init__(self, vocab_size: int, ascii: bool = False) -> None:
        if vocab_size < 2:
            raise ValueError(f"TinyTokenizer needs vocab_size >= 2, got {vocab_size}")
        self.vocab_size = vocab_size
        self.ascii = ascii

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids in ``[1, vocab_size)``, one per character (no special tokens added)."""
        if self.ascii:
            return [(_ASCII.index(c) % (self.vocab_size - 1) if c in _ASCII
                     else ord(c) % (self.vocab_size - 1)) + 1 for c in text]
        return [ord(c) % (self.vocab_size - 1) + 1 for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """One character per id; ``skip_special_tokens`` drops the EOS id."""
        if self.ascii:
            return "".join("" if int(i) == self.eos_token_id and skip_special_tokens
                           else _ASCII[(int(i) - 1) % 95] if int(i) else "A" for i in ids)
        return "".join(
            chr(0x41 + int(i) % 58)
            for i in ids
            if not (skip_special_tokens and int(i) == self.eos_token_id)
        )

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: Sequence[dict] | None = None,
        continue_final_message: bool = False,
    ) -> str | list[int]:
        """``"role: content\\n"`` per message (after ``"tools: <names>\\n"`` when ``tools``
        are given), then ``"assistant: "`` when ``add_generation_prompt``; the last message
        without its ``"\\n"`` when ``continue_final_message``; token ids instead of text
        when ``tokenize``."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if continue_final_message:
            text = text[:-1]
        if tools:
            names = ", ".join(t.get("function", {}).get("name", "") for t in tools)
            text = f"tools: {names}\n" + text
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}


def is_tiny_random_spec(source: object) -> bool:
    """Whether ``source`` names the tiny random test model (``tiny-random[:k=v,...]``)."""
    return isinstance(source, str) and (
        source == TINY_RANDOM or source.startswith(TINY_RANDOM + ":")
    )


def load_tiny_random(spec: str = TINY_RANDOM) -> tuple[Decoder, TinyTokenizer]:
    """``(Decoder.random(config, seed), TinyTokenizer(vocab))`` for
    ``spec = "tiny-random[:vocab=V,seed=S,layers=L,dense=D]"``, config as `tiny_random_config`.

    Raises:
        As `tiny_random_config`.
    """
    config, seed = tiny_random_config(spec)
    return (Decoder.random(config, seed=seed),
            TinyTokenizer(config.vocab_size, ascii=bool(_ascii(spec))))


def _ascii(spec: str) -> int:
    return int(dict(p.strip().split("=", 1) for p in spec[len(TINY_RANDOM) + 1:].split(",")
                    if "=" in p).get("ascii", "0").strip())


def tiny_random_config(spec: str = TINY_RANDOM) -> tuple[ModelConfig, int]:
    """``(ModelConfig.tiny_test(vocab, n_layers=layers), seed)`` for
    ``spec = "tiny-random[:vocab=V,seed=S,layers=L,dense=D]"`` (defaults vocab 64, seed 0,
    layers 2, dense 0; any subset, any order). ``dense=1`` drops the MoE (dense SwiGLU FFN of
    ``ffn_dim`` 32). Reads no weights.

    Raises:
        ValueError: not such a spec, an unknown or repeated key, a non-integer value,
            ``vocab < 2``, ``layers < 1``, ``seed < 0`` or ``dense`` not 0/1.
    """
    if not is_tiny_random_spec(spec):
        raise ValueError(f"not a tiny-random model spec: {spec!r}")
    options = dict(_DEFAULTS)
    given: set[str] = set()
    params = spec[len(TINY_RANDOM) + 1 :]
    for part in params.split(",") if params else []:
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _DEFAULTS:
            raise ValueError(
                f"bad tiny-random option {part!r} in {spec!r}: expected key=value with key in "
                f"{sorted(_DEFAULTS)}"
            )
        if key in given:
            raise ValueError(f"tiny-random option {key!r} given twice in {spec!r}")
        given.add(key)
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"tiny-random option {key}={value!r} is not an integer") from None
    if (options["vocab"] < 2 or options["layers"] < 1 or options["seed"] < 0
            or options["dense"] not in (0, 1) or options["ascii"] not in (0, 1)):
        raise ValueError(
            f"tiny-random needs vocab >= 2, layers >= 1, seed >= 0, dense and ascii 0 or 1: "
            f"{options}"
        )
    config = ModelConfig.tiny_test(options["vocab"], n_layers=options["layers"])
    if options["dense"]:
        config = replace(config, moe=None)
    return config, options["seed"]
