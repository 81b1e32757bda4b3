"""Grammar-constrained decoding that stays lossless under speculation.

A request may carry a constraint (`GrammarSpec`: a JSON schema, any JSON object, a regex, a
choice of strings, or a Lark grammar). It is compiled once per (constraint, tokenizer)
(`GrammarCompiler`, an `llguidance` grammar; bounded LRU cache) and each request, each of its
``n`` choices, gets its own `GrammarMatcher`.

The rule's inputs change, never the rule (notes in ``docs/structured-outputs.md``): at verified
position ``j`` the target's logits are masked by the grammar state ``s_j`` after the block's
earlier draft tokens, so the row the rule sees is ``p'_j = normalize(p_j * M(s_j))`` (the mask is
applied to the raw logits, before penalties, temperature and top-k/top-p/min-p, as vLLM does;
`apply_token_bitmask`). Then the ordinary rule runs on ``p'``: a draft token the grammar forbids
has ``p'(d) = 0`` and is rejected with the residual ``norm(max(0, p' - q))`` (never cut from the
block: for a sampled ``q`` cutting would be biased). The bonus row uses the mask after the whole
block. The matcher's persistent state advances only by committed tokens: masks for a block are
computed by consuming its valid draft prefix and rolling it back (`GrammarMatcher.block_masks`).
The output is then distributed exactly as non-speculative constrained decoding (token-identical
when greedy): "lossless" relative to locally masked sampling, as every server defines it (the
grammar-conditional law would need the probability of a valid completion; Park et al. 2024,
arXiv 2405.21047).

The grammar as a drafter (`GrammarMatcher.draft`): where the grammar allows exactly one token,
``p'`` is a point mass, so drafting that token (``q = delta``) is always accepted. Forced tokens
are chained into every draft block at token level (never forced text re-tokenized, which would
change the distribution: SGLang's jump-forward, removed in sgl-project/sglang#4032).

Bitmasks are int32 ``[rows, ceil(vocab / 32)]``, bit ``t % 32`` of word ``t // 32`` set when
token ``t`` is allowed, ``vocab`` the width of the model's logits (padded vocabulary included),
as llguidance and xgrammar lay them out.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .draft import DraftBlock, DraftDist

__all__ = ["GRAMMAR_KINDS", "Grammar", "GrammarCompiler", "GrammarError", "GrammarMatcher",
           "GrammarSpec", "apply_token_bitmask", "bitmask_allows", "bitmask_width",
           "grammar_tokenizer"]

#: The constraint kinds a `GrammarSpec` holds.
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
#: JSON separators by default: one space after ``,`` and ``:`` and no other whitespace, so a
#: model cannot loop on whitespace until ``max_tokens`` (vllm-project/vllm#38696), while the
#: text keeps the spacing models usually write.
DEFAULT_JSON_SEPARATORS = (", ", ": ")
#: The most choices, regex / grammar characters and schema bytes one constraint may carry.
MAX_CHOICES = 1024
MAX_GRAMMAR_BYTES = 256 * 1024


class GrammarError(ValueError):
    """A constraint that cannot be compiled, or a request its constraint leaves no way on
    (no allowed token, a committed token the grammar refuses). The message names the problem
    in the client's terms, after the request field it came from (``"<field>: ..."``).

    Attributes:
        field: that field (``response_format``, ``tools``, ``constraint``, ...), or None.
    """

    @property
    def field(self) -> str | None:
        head, sep, _ = str(self).partition(": ")
        return head if sep and re.fullmatch(r"[a-z_]+", head) else None


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row for logits ``vocab_size`` wide."""
    return (int(vocab_size) + 31) // 32


def bitmask_allows(mask: np.ndarray, token: int) -> bool:
    """Whether bitmask row ``mask`` (int32 ``[words]``) allows ``token``."""
    token = int(token)
    if token < 0 or token >= 32 * mask.shape[-1]:
        return False
    return bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _allowed_ids(mask: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids a bitmask row allows, ``< vocab_size``, increasing (int64)."""
    bits = np.unpackbits(mask.astype("<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def _single_allowed(mask: np.ndarray, vocab_size: int) -> int | None:
    """The one token a bitmask row allows, or None when it allows none or several (a scan
    of the words, not of every bit)."""
    words = np.flatnonzero(mask)
    if words.size != 1:
        return None
    word = int(mask[words[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = int(words[0]) * 32 + word.bit_length() - 1
    return token if token < vocab_size else None


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | np.ndarray) -> torch.Tensor:
    """``logits`` with every token the mask forbids at ``-inf``.

    Args:
        logits: float ``[n, vocab]`` target logits, ``vocab`` the model's width.
        bitmask: int32 ``[n, bitmask_width(vocab)]``; a row of all ones (``-1`` words) leaves
            its logits as they are, and so does a row that allows nothing: such a row is
            never reached by the rule (it follows a draft token the grammar refuses, or the
            end of the grammar), and the coordinator refuses a reachable empty row before the
            step (`GrammarMatcher.draft`), so no row becomes NaN.

    Returns:
        A new float tensor ``[n, vocab]`` (``logits`` itself when no row is masked).

    Raises:
        ValueError: a bitmask of another shape or dtype.
    """
    mask = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else np.asarray(bitmask)
    n, vocab = logits.shape
    if mask.dtype != np.int32 or mask.shape != (n, bitmask_width(vocab)):
        raise ValueError(f"grammar bitmask must be int32 [{n}, {bitmask_width(vocab)}] for "
                         f"logits [{n}, {vocab}], got {mask.dtype} {list(mask.shape)}")
    # Unpacked with numpy (one pass, no torch threads: ~30 us for 5 rows of 49,152).
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<i4").view(np.uint8), axis=1,
                         bitorder="little")[:, :vocab].view(bool)
    keep = bits.all(axis=1) | ~bits.any(axis=1)  # all allowed, or none (never reached)
    if keep.all():
        return logits
    bits[keep] = True
    return torch.where(torch.from_numpy(bits), logits,
                       torch.tensor(float("-inf"), dtype=logits.dtype))


@dataclass(frozen=True)
class GrammarSpec:
    """A client's constraint on the output, before compiling.

    Attributes:
        kind: one of `GRAMMAR_KINDS`: ``json_schema`` (``value`` a JSON Schema, a dict),
            ``json_object`` (any JSON object; ``value`` None), ``regex`` (``value`` a
            pattern, Rust regex syntax, anchored at both ends), ``choice`` (``value`` a
            non-empty list of strings: the output is exactly one of them), ``lark``
            (``value`` a Lark grammar, llguidance's dialect, with ``start``).
        value: as above.
        separators: JSON ``(item, key)`` separators; None: `DEFAULT_JSON_SEPARATORS`.
        whitespace_pattern: a regex for the whitespace JSON may hold between tokens (then
            ``separators`` are ``,`` and ``:`` around it); None: no free whitespace.
        field: the request field it came from, named in errors (``response_format``,
            ``structured_outputs``, ``tools``).

    Raises:
        GrammarError: a kind not listed or a value of the wrong type.
    """

    kind: str
    value: Any = None
    separators: tuple[str, str] | None = None
    whitespace_pattern: str | None = None
    field: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"{self.field}: unknown constraint {self.kind!r}; expected one "
                               f"of {', '.join(GRAMMAR_KINDS)}")
        ok = {"json_schema": lambda v: isinstance(v, dict | bool),
              "json_object": lambda v: v is None,
              "regex": lambda v: isinstance(v, str) and v != "",
              "lark": lambda v: isinstance(v, str) and v != "",
              "choice": lambda v: (isinstance(v, list | tuple) and 0 < len(v) <= MAX_CHOICES
                                   and all(isinstance(s, str) and s for s in v))}[self.kind]
        if not ok(self.value):
            what = {"json_schema": "a JSON Schema object", "json_object": "nothing",
                    "regex": "a non-empty pattern", "lark": "a non-empty grammar",
                    "choice": f"1 to {MAX_CHOICES} non-empty strings"}[self.kind]
            raise GrammarError(f"{self.field}: {self.kind} needs {what}, got {self.value!r:.80}")
        if isinstance(self.value, list):
            object.__setattr__(self, "value", tuple(self.value))

    def key(self) -> str:
        """A canonical string for caching (equal constraints, equal keys)."""
        return json.dumps([self.kind, self.value, self.separators, self.whitespace_pattern],
                          sort_keys=True, separators=(",", ":"))

    def llguidance_grammar(self) -> str:
        """The llguidance grammar (its JSON form) this constraint compiles to.

        Raises:
            GrammarError: over `MAX_GRAMMAR_BYTES`, or a schema that is not JSON.
        """
        import llguidance

        if len(self.key()) > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"{self.field}: the constraint is over {MAX_GRAMMAR_BYTES} "
                               "bytes")
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(s, ensure_ascii=False) for s in self.value))
        schema = {"type": "object"} if self.kind == "json_object" else self.value
        if self.whitespace_pattern is not None:
            options = {"whitespace_flexible": True, "whitespace_pattern": self.whitespace_pattern}
        else:
            item, key = self.separators or DEFAULT_JSON_SEPARATORS
            options = {"whitespace_flexible": False, "item_separator": item,
                       "key_separator": key}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{self.field}: invalid JSON schema: {exc}") from None


#: GPT-2's byte-level alphabet (printable stand-ins for bytes), inverted: a byte-level BPE
#: token's text, as ``convert_ids_to_tokens`` spells it, back to its bytes.
def _byte_level_decoder() -> dict[str, int]:
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _token_bytes(tokenizer, token: int) -> bytes:
    """The bytes token ``token`` spells. ``decode([token])`` where it is whole text; where
    it is part of a UTF-8 character (decode gives U+FFFD), the token's own piece read as a
    byte-level BPE piece (GPT-2's alphabet) or a SentencePiece byte fallback (``<0xE2>``)."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text.encode("utf-8")
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    piece = convert(token) if convert is not None else None
    if isinstance(piece, str) and piece:
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        if all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode("utf-8")


class _ByteTokens:
    """llguidance's tokenizer protocol (`llguidance.TokenizerWrapper`'s attributes) for a
    tokenizer that is not a Hugging Face fast tokenizer: each id's bytes are what it spells
    (`_token_bytes`), the EOS id is special. Encoding (llguidance tokenizes forced text with
    it, to force tokens) is greedy, longest piece first, and stops before the first byte no
    token spells: it never returns tokens whose bytes are not the text's (a skipped byte
    would force a token the grammar then refuses)."""

    def __init__(self, tokenizer, vocab_size: int, eos: int | None):
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self.special_token_ids = [] if eos is None else [eos]
        self.is_tokenizer_wrapper = True
        self.tokens = []
        for i in range(vocab_size):
            piece = b"" if i == eos else _token_bytes(tokenizer, i)
            self.tokens.append(piece or b"<|special_%d|>" % i)
        self._by_bytes: dict[bytes, int] = {}
        for i, piece in enumerate(self.tokens):
            if i != eos:
                self._by_bytes.setdefault(piece, i)
        self._longest = max((len(p) for p in self._by_bytes), default=1)

    def __call__(self, text) -> list[int]:
        data = text if isinstance(text, bytes) else str(text).encode("utf-8")
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                token = self._by_bytes.get(data[i:i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                break  # a byte no token spells: the tokens so far spell a prefix
        return out


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_id: int | None = None):
    """An ``llguidance.LLTokenizer`` for ``tokenizer`` whose masks are ``vocab_size`` wide
    (the model's logits, padded vocabulary included; ids past the tokenizer's are never
    allowed).

    A Hugging Face fast tokenizer goes through ``llguidance.hf.from_tokenizer`` (~1 s: build
    it once per tokenizer, `GrammarCompiler` does); any other (the tiny test model's) is
    described token by token from ``decode([id])``.

    Args:
        eos_token_id: the token that ends a constrained output where the grammar accepts;
            None: the tokenizer's ``eos_token_id``.

    Raises:
        GrammarError: the tokenizer has no EOS token.
    """
    import llguidance

    eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise GrammarError("structured output needs a tokenizer with an EOS token")
    # A tokenizer made by transformers means transformers is imported already: importing it
    # here for the isinstance check would hold the GIL ~0.7 s, stalling the event loop, at a
    # server's first constraint.
    transformers = sys.modules.get("transformers")
    fast = getattr(transformers, "PreTrainedTokenizerFast", None) if transformers else None
    if fast is not None and isinstance(tokenizer, fast):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=int(eos))
    return llguidance.LLTokenizer(_ByteTokens(tokenizer, vocab_size, int(eos)),
                                  n_vocab=vocab_size, eos_token=int(eos))


def _reason(error: str) -> str:
    """llguidance's error in one line: its first line, and, where that line only introduces
    a multi-line report ("regex parse error:" over a caret drawing), the report's own
    ``error: ...`` line ("regex parse error: unclosed character class")."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    first = lines[0]
    if first.endswith(":"):
        detail = next((line for line in lines[1:] if line.startswith("error:")), None)
        if detail is not None:
            first = f"{first} {detail.removeprefix('error:').strip()}"
    return first


#: llguidance's resource limits for every constraint (`parser_limits`): the lexer's initial
#: fuel is a twentieth of llguidance's default (1,000,000), so a regex whose automaton
#: explodes (a counted repetition such as ``y{20000}``) fails within ~15 ms of its first mask,
#: at admission (`Grammar`), instead of building for up to 1.3 s on the scheduler's step and
#: then failing; what passes costs at most a few ms per mask (``y{10000}``: ~3 ms, measured
#: on 2 shared cores). A 1,000-value enum and a 300-property schema stay well inside it. The
#: per-step limits keep llguidance's defaults.
INITIAL_LEXER_FUEL = 50_000
#: Tokens the admission probe walks (`Grammar`), and its wall-clock budget in seconds.
PROBE_TOKENS = 64
PROBE_SECONDS = 0.5
_KIND_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
               "choice": "choice", "lark": "grammar"}


def parser_limits():
    """The ``llguidance.LLParserLimits`` every grammar here is validated and matched under
    (`INITIAL_LEXER_FUEL`; ``verbose_errors`` off: an error names the problem, not the
    parser's state)."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=INITIAL_LEXER_FUEL,
                                     verbose_errors=False)


class Grammar:
    """A compiled constraint for one tokenizer: immutable and shared by every request using
    it; `matcher` gives each request (each choice) its own state.

    Compiling also probes the constraint (`probe`) the way generation will use it, so that
    what can be known before generating is refused here, at admission, and never
    mid-stream: a constraint the model's tokenizer cannot begin to spell, one whose forced
    text never ends (a required recursive ``$ref``, a grammar rule that only recurses) and
    one the matcher cannot hold (llguidance's lexer or parser limits, `parser_limits`). The
    probe's masks also warm llguidance's lexer cache, which every request's matcher shares,
    so the scheduler's first masks are cheap.

    Raises:
        GrammarError: the grammar is invalid for llguidance, or the probe found it cannot
            be generated (the message says why and names ``spec.field``).
    """

    def __init__(self, spec: GrammarSpec, ll_tokenizer, vocab_size: int):
        import llguidance

        self.spec = spec
        self.vocab_size = int(vocab_size)
        self.width = bitmask_width(vocab_size)
        self.eos_token_id = int(ll_tokenizer.eos_token)
        what = f"{spec.field}: unsupported {spec.kind.replace('_', ' ')}"
        grammar = spec.llguidance_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer,
                                                      limits=parser_limits())
        if error:
            raise GrammarError(f"{what}: {_reason(error)}")
        # Building the matcher drops the GIL (up to ~1 s for huge grammars): done once here,
        # off the event loop; requests deep-copy it.
        self._template = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0,
                                              limits=parser_limits())
        if self._template.is_error():
            raise GrammarError(f"{what}: {_reason(self._template.get_error())}")
        self.probe()

    def probe(self, max_tokens: int = PROBE_TOKENS, max_seconds: float = PROBE_SECONDS) -> int:
        """Walks one output from the grammar's start, as generation would, on a copy: at
        each step the mask, then its lowest allowed id (the forced token where the grammar
        forces one; never EOS). Stops at a complete output (EOS allowed), after
        ``max_tokens`` tokens or ``max_seconds`` (a walk that did not fail by then proves
        nothing either way). Every mask is computed natively without the GIL.

        Returns:
            The tokens walked.

        Raises:
            GrammarError: the first mask allows no token (the tokenizer cannot spell the
                constraint's start), or the matcher failed on the way (a limit, or forced
                text that never ends).
        """
        m = self.matcher()
        deadline = time.monotonic() + max_seconds
        walked = 0
        field = self.spec.field
        kind = _KIND_NAMES[self.spec.kind]

        def failed(error: str) -> GrammarError:
            error = error.removeprefix(f"{field}: ").removeprefix("the grammar failed: ")
            if "ff_tokens" in error:  # forced text that never ends: no finite output
                return GrammarError(f"{field}: the {kind} admits no finite output (its "
                                    f"forced text never ends: {error})")
            return GrammarError(f"{field}: the {kind} is beyond the matcher's limits: {error}")

        while walked < max_tokens and time.monotonic() < deadline:
            row = np.zeros(self.width, dtype=np.int32)
            try:
                m._fill(row)
            except GrammarError as exc:
                raise failed(str(exc)) from None
            if not row.any():
                if walked == 0:
                    raise GrammarError(f"{field}: this model's tokenizer cannot spell the start"
                                       f" of any output the {kind} allows")
                raise GrammarError(f"{field}: the {kind} leads to an output no token of this "
                                   "model's tokenizer continues")
            if m.stopped or bitmask_allows(row, self.eos_token_id):
                return walked
            # The lowest allowed id: the forced token where there is one. (Masks only:
            # llguidance computes them without the GIL; its compute_ff_tokens holds it.)
            if not m._m.consume_token(int(_allowed_ids(row, self.vocab_size)[0])):
                raise failed(_reason(m._m.get_error()))
            walked += 1
        return walked

    def matcher(self) -> GrammarMatcher:
        """A fresh per-request matcher at the grammar's start."""
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size, self.eos_token_id,
                              self.spec.field)


@dataclass
class BlockPlan:
    """A draft block after the grammar had its say (`GrammarMatcher.draft`).

    Attributes:
        block: the block to verify.
        masks: int32 ``[len(block) + 1, width]``, row ``j`` the mask for verified row ``j``.
        forced: per block position, whether the grammar forced it (drafted with ``q = delta``).
        invalid: the position of a drafter token the grammar refuses (the block's last), or
            None.
    """

    block: DraftBlock
    masks: np.ndarray
    forced: list[bool] = field(default_factory=list)
    invalid: int | None = None


class GrammarMatcher:
    """One request's grammar state (an ``llguidance.LLMatcher``), advanced by committed tokens
    only. Not thread-safe: one owner, the request's scheduler.

    Args:
        matcher: the ``LLMatcher``, at the state the request's committed output reached.
        vocab_size: the model's logits width.
        eos_token_id: the token that ends the output where the grammar accepts.
        field: the request field the constraint came from (named in errors).
    """

    def __init__(self, matcher, vocab_size: int, eos_token_id: int, field: str):
        self._m = matcher
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self.eos_token_id = eos_token_id
        self.field = field

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same state (for a branch, or a choice of its own)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.eos_token_id,
                              self.field)

    @property
    def stopped(self) -> bool:
        """True once the grammar ended (EOS committed where it accepts, or nothing can follow)."""
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        """Whether the committed output is a complete match (EOS would be allowed)."""
        return bool(self._m.is_accepting())

    def _fill(self, out: np.ndarray) -> None:
        if self._m.is_stopped() and not self._m.is_error():
            out[:] = 0  # the grammar ended: only EOS may follow
            out[self.eos_token_id >> 5] = np.int32(np.uint32(1 << (self.eos_token_id & 31)))
            return
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_error():
            first = _reason(self._m.get_error())
            if first.startswith("NoExtension") or str(self._m.stop_reason()).startswith(
                    "NoExtension"):
                out[:] = 0  # nothing this tokenizer can spell continues the output
                return
            raise GrammarError(f"{self.field}: the grammar failed: {first}")

    def mask(self) -> np.ndarray:
        """The mask at the committed state, int32 ``[width]``.

        Raises:
            GrammarError: the state allows no token (the request cannot go on).
        """
        row = np.zeros(self.width, dtype=np.int32)
        self._fill(row)
        if not row.any():
            raise GrammarError(f"{self.field}: the constraint allows no token after the "
                               "output so far")
        return row

    def block_masks(self, tokens: Sequence[int]) -> np.ndarray:
        """Masks for a verified block ``[anchor, *tokens]``: int32 ``[len(tokens) + 1,
        width]``, row ``j`` the mask after the committed output and ``tokens[:j]``. Rows past
        the first refused token (or past the grammar's end) are all ones: the rule never
        reaches them. The committed state is unchanged on return.

        Raises:
            GrammarError: row 0 (always reached) allows no token.
        """
        masks = self.draft(DraftBlock.deterministic(tokens), len(tokens), force=False).masks
        pad = np.full((len(tokens) + 1 - masks.shape[0], self.width), -1, dtype=np.int32)
        return np.concatenate([masks, pad]) if pad.shape[0] else masks

    def draft(self, proposal: DraftBlock, budget: int, force: bool = True) -> BlockPlan:
        """The block to verify and its masks: the drafter's ``proposal`` with the grammar's
        forced tokens chained in (``force``), at most ``budget`` tokens.

        Walking the positions from the committed state: where the mask allows exactly one
        token ``t`` (``force``), ``t`` is drafted with ``q = delta_t`` (always accepted); the
        proposal stays in use only while it agrees with what was drafted (its later tokens
        were drawn for that prefix), so a proposal token equal to ``t`` is passed over. Where
        the grammar leaves a choice, the proposal's next token is drafted with its own
        ``q``; a token the mask refuses ends the block there, kept in it as a draft the rule
        rejects (its residual ``norm(max(0, p' - q))``, exact for a sampled ``q``). The block
        ends at the budget, at the proposal's end when nothing is forced, or where the
        grammar ends. The committed state is unchanged: the walk runs on a copy (~2 us:
        llguidance shares the parser's tables), so a draft that puts the grammar in its
        sticky error state cannot reach the committed one.

        Raises:
            GrammarError: the committed state allows no token.
        """
        walker = self.fork()
        tokens: list[int] = []
        dists: list[DraftDist] = []
        forced: list[bool] = []
        rows: list[np.ndarray] = []
        invalid = None
        at, aligned = 0, True
        while True:
            row = np.zeros(self.width, dtype=np.int32)
            walker._fill(row)
            if walker.stopped:  # the grammar ended: EOS only (the request ends here)
                rows.append(row)
                break
            if not row.any():
                if not rows:
                    raise GrammarError(f"{self.field}: the constraint allows no token after "
                                       "the output so far")
                row[:] = -1  # a dead end after a draft: refused when committed
                rows.append(row)
                break
            rows.append(row)
            if len(tokens) >= budget:
                break
            t = _single_allowed(row, self.vocab_size) if force else None
            if t is not None:
                tokens.append(t)
                dists.append(DraftDist.deterministic(t))
                forced.append(True)
                if aligned and at < len(proposal) and proposal.tokens[at] == t:
                    at += 1
                else:
                    aligned = False
            elif aligned and at < len(proposal):
                t = proposal.tokens[at]
                tokens.append(t)
                dists.append(proposal.dists[at])
                forced.append(False)
                at += 1
                if not bitmask_allows(row, t):
                    invalid = len(tokens) - 1
                    rows.append(np.full(self.width, -1, dtype=np.int32))
                    break
            else:
                break
            if not walker._m.consume_token(t):
                raise GrammarError(f"{self.field}: the grammar failed: {walker._m.get_error()}")
        return BlockPlan(DraftBlock(tokens, dists), np.stack(rows[: len(tokens) + 1]), forced,
                         invalid)

    def commit(self, token: int) -> None:
        """Advances the committed state by ``token``.

        Raises:
            GrammarError: the grammar refuses it (a row the coordinator could not constrain:
                the request fails alone).
        """
        token = int(token)
        if self._m.is_stopped():  # only EOS may follow the grammar's end
            ok = token == self.eos_token_id and self._m.consume_token(token)
        else:
            ok = self._m.validate_tokens([token]) == 1 and self._m.consume_token(token)
        if not ok:
            # A token the mask let through and the matcher refused: a bug (every row the
            # rule samples is masked), or the matcher hit a limit on this path.
            why = _reason(self._m.get_error()) if self._m.is_error() else ""
            raise GrammarError(f"{self.field}: token {token} does not fit the constraint"
                               + (f" (the matcher failed: {why})" if why else
                                  " (the output so far leaves no valid continuation)"))


def _lower_priority() -> None:
    """Lowers the calling thread's CPU priority by 10 nice levels (Linux: a thread is a task
    with its own nice value), so compiling yields the CPU to the scheduler and the streams;
    a no-op where that is not possible."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + 10))
    except (AttributeError, OSError):
        pass


class GrammarCompiler:
    """Compiles `GrammarSpec` s for one tokenizer, with a bounded LRU cache by
    `GrammarSpec.key` (thread-safe: the service compiles in worker threads, off its event
    loop). The llguidance tokenizer is built on first use (~1 s for a Hugging Face one).

    Refusals are cached too (the same bounded size): a client repeating a constraint that
    failed gets the same `GrammarError` without a second compile. Compiles (each with its
    admission probe, `Grammar.probe`) run on ``max_concurrent`` threads of their own, 10 nice
    levels below the process (`_lower_priority`), the callers waiting: however many
    constraints arrive together, compiling holds at most that many cores, and yields them to
    the scheduler and the other requests' streams.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's logits width.
        max_entries: compiled grammars (and, apart, refusals) kept (least recently used
            dropped first).
        max_concurrent: compiles running at once.
    """

    def __init__(self, tokenizer, vocab_size: int, max_entries: int = 128,
                 max_concurrent: int = 1):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.max_entries = max_entries
        self._ll = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles run on these threads, at a lower CPU priority than the rest of the process.
        self._pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="specd-compile",
                                        initializer=_lower_priority)
        #: Compiles done / answered from the cache / refusals answered from the cache.
        self.compiled = 0
        self.hits = 0
        self.refused_hits = 0

    def ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                self._ll = grammar_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll

    def _cached(self, key: str, field: str) -> Grammar | None:
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return hit
            refused = self._refused.get(key)
            if refused is not None:
                self._refused.move_to_end(key)
                self.refused_hits += 1
                error = GrammarError(f"{field}: {refused}")
                error.cached = True  # answered without compiling (costs the client nothing)
                raise error
        return None

    def _keep(self, table: OrderedDict, key: str, value) -> None:
        with self._lock:
            table[key] = value
            table.move_to_end(key)
            while len(table) > self.max_entries:
                table.popitem(last=False)

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled `Grammar` for ``spec`` (cached; blocking: call it off the event
        loop).

        Raises:
            GrammarError: an invalid or unsupported constraint, or one generation cannot
                meet, naming ``spec.field`` (cached as well).
        """
        key = spec.key()
        hit = self._cached(key, spec.field)
        if hit is not None:
            return hit
        ll = self.ll_tokenizer()
        grammar = self._pool.submit(self._compile, spec, key, ll).result()
        if not isinstance(grammar, Grammar):  # a refusal (raised here, in the caller's thread)
            raise grammar
        return grammar

    def _compile(self, spec: GrammarSpec, key: str, ll) -> Grammar | GrammarError:
        """On a compile thread: the grammar (kept in the cache) or its refusal (kept too)."""
        try:
            hit = self._cached(key, spec.field)  # compiled while this one waited
            if hit is not None:
                return hit
            grammar = Grammar(spec, ll, self.vocab_size)
        except GrammarError as exc:
            if not getattr(exc, "cached", False):
                # Kept without the field: the same constraint may come in another one.
                self._keep(self._refused, key, str(exc).removeprefix(f"{spec.field}: "))
            return exc
        with self._lock:
            self.compiled += 1
        self._keep(self._cache, key, grammar)
        return grammar
