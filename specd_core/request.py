"""Per-request decode state and the verification step: the bookkeeping every loop drives.

Draft a block with any `Drafter`, verify the anchor plus the whole block in one batched
target forward, apply the rejection rule (`specd_core.rule`) position by position, commit
the accepted prefix plus one more token (the residual resample on rejection, or the bonus
token when every draft was accepted), and roll the target's KV cache back to the committed
length at absolute positions.

`DecodeRequest` is the one implementation of that bookkeeping: the in-process path and the
distributed service both drive it, so a fix lands once and the losslessness tests cover both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from .draft import DraftBlock
from .grammar import BlockPlan, GrammarMatcher
from .logprobs import RowLogprobs, TokenLogprob, check_top_count
from .rule import TargetRows, target_rows
from .sampling import Sampler, SamplingParams

FinishReason = Literal["length", "stop"]
#: The most tokens one verified block may hold when the grammar forces them
#: (`DecodeRequest.plan_block`).
MAX_FORCED_DRAFT = 16


@dataclass(frozen=True)
class SpeculativeOptions:
    """Everything a decode needs beyond the model, the prompt and the drafter.

    Attributes:
        max_new_tokens: the most tokens to generate (>= 0).
        start_pos: absolute position of the first prompt token in the KV cache: 0 for a fresh
            cache, ``cache.seq_len`` when resuming a warm one. Every position and rollback
            length inside the loop is absolute.
        sampling: how the target would sample without speculation; the output is distributed
            exactly as that.
        seed: seed of the request's own generator; ``None`` for fresh entropy.
        stop_token_ids: tokens (EOS among them) that end the output; the stop token is
            emitted.
        stop_strings: strings that end the output at the end of the token completing them.
        detokenize: ids -> text, required when ``stop_strings`` is set.
        logprobs: record each generated token's raw log probability with this many top
            alternatives (0-20, `specd_core.logprobs`); None records none.
        prompt_logprobs: the same for every prompt token after the first; None: none.
            ``max_new_tokens`` 0 then scores the prompt without generating.
        grammar: a compiled constraint (`specd_core.grammar.Grammar`: anything with a
            ``matcher()`` giving a fresh `GrammarMatcher`), or None. Each request makes its
            own matcher; the output ends ("stop") where the grammar ends.

    Raises:
        ValueError: naming the bad field.
    """

    max_new_tokens: int
    start_pos: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    detokenize: Callable[[Sequence[int]], str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: object | None = None

    def __post_init__(self) -> None:
        if self.grammar is not None and not callable(getattr(self.grammar, "matcher", None)):
            raise ValueError(f"grammar must be a compiled Grammar, got {self.grammar!r:.60}")
        check_top_count("logprobs", self.logprobs)
        check_top_count("prompt_logprobs", self.prompt_logprobs)
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {self.start_pos}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {self.stop_strings!r}")
        if self.stop_strings and self.detokenize is None:
            raise ValueError("stop_strings need a detokenize function to match against text")


@dataclass
class SpeculativeDecodeResult:
    """The output and the counters that make the saving observable (names follow vLLM's
    ``spec_decode_*`` metrics; acceptance length = tokens per verification step)."""

    generated_tokens: list[int] = field(default_factory=list)
    #: Target forward calls: the prefill counts one, each verification step one more.
    forward_calls: int = 0
    #: Always ``len(generated_tokens)``; kept so ``tokens_generated / forward_calls`` reads off.
    tokens_generated: int = 0
    #: Verification steps: forward calls after the prefill.
    verification_steps: int = 0
    #: Draft tokens the target evaluated; positions after a rejection (or a stop) are not.
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    #: Per draft position (0 = first after the anchor): times reached, times accepted.
    evaluated_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    #: Constrained requests: draft positions the grammar forced (drafted with ``q = delta``,
    #: always accepted; counted in ``drafted_tokens`` and ``accepted_tokens`` too) and drafter
    #: tokens the grammar refused (rejected by the rule; counted in ``drafted_tokens``).
    forced_tokens: int = 0
    grammar_rejected_tokens: int = 0

    def tokens_per_call(self) -> float:
        """Tokens per forward call, prefill included; 0.0 for an empty run."""
        return self.tokens_generated / self.forward_calls if self.forward_calls else 0.0

    def acceptance_length(self) -> float | None:
        """Tokens per verification step (the published metric); ``None`` when nothing was
        verified, since 0 would read as "speculation hurt" rather than "did not run"."""
        if self.verification_steps == 0:
            return None
        return self.tokens_generated / self.verification_steps

    def accept_rate(self) -> float | None:
        """Accepted / evaluated draft tokens over all positions; ``None`` when none drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    def accept_rate_per_position(self) -> list[float]:
        """Accept rate at each draft position, conditional on reaching it (0.0 if never)."""
        return [
            ok / seen if seen else 0.0
            for seen, ok in zip(self.evaluated_at_position, self.accepted_at_position,
                                strict=True)
        ]

    def record_position(self, position: int, accepted: bool) -> None:
        """Counts one evaluated draft position."""
        if len(self.evaluated_at_position) <= position:
            grow = position + 1 - len(self.evaluated_at_position)
            self.evaluated_at_position.extend([0] * grow)
            self.accepted_at_position.extend([0] * grow)
        self.evaluated_at_position[position] += 1
        self.drafted_tokens += 1
        if accepted:
            self.accepted_at_position[position] += 1
            self.accepted_tokens += 1

    def to_dict(self) -> dict:
        """Every field and derived metric, JSON-ready. The keys say what they hold, in the
        API's words: ``token_ids`` (the generated ids), ``completion_tokens`` (their count)."""
        return {
            "token_ids": list(self.generated_tokens),
            "finish_reason": self.finish_reason,
            "completion_tokens": self.tokens_generated,
            "forward_calls": self.forward_calls,
            "verification_steps": self.verification_steps,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "evaluated_at_position": list(self.evaluated_at_position),
            "accepted_at_position": list(self.accepted_at_position),
            "tokens_per_call": self.tokens_per_call(),
            "acceptance_length": self.acceptance_length(),
            "accept_rate": self.accept_rate(),
            "accept_rate_per_position": self.accept_rate_per_position(),
            "forced_tokens": self.forced_tokens,
            "grammar_rejected_tokens": self.grammar_rejected_tokens,
        }


class _StopStrings:
    """Finds a stop string completed by the newest token, also across step boundaries."""

    def __init__(self, stops: tuple[str, ...], detokenize: Callable[[Sequence[int]], str]):
        self.stops = stops
        self.detokenize = detokenize
        # Every token decodes to >= 1 character in practice; slack covers byte-level pieces.
        self.window = max(len(s) for s in stops) + 8

    def completed(self, generated: Sequence[int]) -> bool:
        tail = generated[-self.window:]
        text = self.detokenize(tail)
        before = self.detokenize(tail[:-1])
        new_from = 0
        for a, b in zip(before, text, strict=False):
            if a != b:
                break
            new_from += 1
        # An occurrence that ends inside the newest token's characters.
        return any(s in text[max(0, new_from - len(s) + 1):] for s in self.stops)


class DecodeRequest:
    """One request's decode state and its step function.

    Drive it as: ``prefill_tokens`` -> target forward -> `on_prefill`; then while not
    `finished`: `draft_budget` -> drafter -> `verify_tokens(draft)` -> target forward at
    absolute position `cache_len` -> `on_verify` (returns the KV length to keep) -> roll the
    cache back to it.

    Invariant after every step: the target cache holds ``start_pos`` + prompt + every
    generated token except the last, which is the pending anchor fed by the next step.
    """

    def __init__(self, prompt_tokens: Sequence[int], options: SpeculativeOptions,
                 hidden_dtype: torch.dtype = torch.float32):
        self.options = options
        self.history: list[int] = [int(t) for t in prompt_tokens]
        if not self.history:
            raise ValueError("prompt must not be empty")
        self.num_prompt_tokens = len(self.history)
        self.result = SpeculativeDecodeResult()
        self.rng = Sampler(options.seed)
        self.pending: int | None = None
        #: Absolute KV length committed in the target cache (the pending anchor's position).
        self.cache_len = options.start_pos
        # Every committed hidden row, row i = history position i (the pending anchor has
        # none yet): kept whole so a drafter that lost its state can be sent all of them.
        self._hidden_log = _RowLog(hidden_dtype)
        self._hidden_taken = 0
        #: Per generated token, its `TokenLogprob` (when ``options.logprobs`` is set).
        self.token_logprobs: list[TokenLogprob] = []
        #: Per prompt position, its `TokenLogprob` once its chunk is computed (when
        #: ``options.prompt_logprobs`` is set); position 0 stays None (nothing precedes it).
        self.prompt_logprobs: list[TokenLogprob | None] = (
            [None] * self.num_prompt_tokens if options.prompt_logprobs is not None else [])
        self._stop_ids = frozenset(options.stop_token_ids)
        self._stop_strings = (
            _StopStrings(options.stop_strings, options.detokenize)
            if options.stop_strings else None
        )
        #: This request's own grammar state (None: unconstrained); advanced by committed
        #: tokens only.
        self.grammar: GrammarMatcher | None = (
            None if options.grammar is None else options.grammar.matcher())
        #: The grammar's plan for the block being verified (`plan_block`).
        self._plan: BlockPlan | None = None
        self._first_mask: np.ndarray | None = None
        if options.max_new_tokens == 0:
            self.result.finish_reason = "length"

    @property
    def finished(self) -> bool:
        return self.result.finish_reason is not None

    @property
    def generated(self) -> list[int]:
        return self.result.generated_tokens

    @property
    def sampling(self) -> SamplingParams:
        return self.options.sampling

    def prefill_tokens(self) -> list[int]:
        return self.history[: self.num_prompt_tokens]

    def rows(self, logits: torch.Tensor, block: Sequence[int] = ()) -> TargetRows:
        """What the rule needs from target logits ``[n, vocab]`` following ``history``."""
        return target_rows(logits, self.sampling, self.history, self.num_prompt_tokens, block)

    def draft_budget(self) -> int:
        """Most draft tokens worth verifying now. One short of the remaining budget on
        purpose: the run's last token is always committed as an anchor, so the cache ends in
        one state whether the budget runs out on an anchor or mid-block."""
        return max(0, self.options.max_new_tokens - len(self.generated) - 1)

    def take_hidden(self) -> torch.Tensor | None:
        """Target hidden rows ``[rows, width]`` committed since the last call (what
        `Drafter.propose` gets; ``width`` is ``hidden_size``, or ``len(hidden_layers) *
        hidden_size`` for a drafter reading layers), float32; ``None`` when the target
        returned none."""
        log = self._hidden_log.view()
        if log is None or log.shape[0] == self._hidden_taken:
            return None
        rows = log[self._hidden_taken:].float()
        self._hidden_taken = log.shape[0]
        return rows

    def hidden_log(self) -> torch.Tensor | None:
        """Every committed hidden row, ``[len(history) - 1, width]`` (as `take_hidden`) in
        this request's ``hidden_dtype``, or float32 once a row held a value float16 cannot
        (`_RowLog`); row i belongs to history position i; a view, valid until the next step.
        ``None`` when the target returned none."""
        return self._hidden_log.view()

    def prefill_mask(self) -> np.ndarray | None:
        """The grammar bitmask for the prompt's last row (the first generated token), int32
        ``[1, width]``; None when unconstrained.

        Raises:
            GrammarError: the constraint allows no first token.
        """
        if self.grammar is None:
            return None
        if self._first_mask is None:
            self._first_mask = self.grammar.mask()[None, :]
        return self._first_mask

    def plan_block(self, draft: DraftBlock, force: bool = True,
                   max_forced: int = MAX_FORCED_DRAFT) -> tuple[DraftBlock, np.ndarray | None]:
        """The block to verify after ``draft`` (the drafter's proposal) and its grammar
        bitmasks, int32 ``[len(block) + 1, width]`` (None when unconstrained: the block is
        ``draft``). Constrained, the grammar's forced tokens are chained in when ``force``
        (`GrammarMatcher.draft`; at most ``max(len(draft), max_forced)`` tokens, within
        `draft_budget`) and the block ends at a drafter token the grammar refuses, kept for
        the rule to reject. Call it once per step, before `verify_tokens`.

        Raises:
            GrammarError: the constraint allows no next token.
        """
        self._plan = None
        if self.grammar is None:
            return draft, None
        budget = min(self.draft_budget(), max(len(draft), max_forced if force else 0))
        if len(draft) > budget:  # sliced, not truncated: the drafter may keep its block
            draft = DraftBlock(draft.tokens[:budget], draft.dists[:budget])
        self._plan = self.grammar.draft(draft, budget, force)
        return self._plan.block, self._plan.masks

    def verify_tokens(self, draft: DraftBlock) -> list[int]:
        """The batch to feed at absolute position `cache_len`: anchor + draft tokens."""
        if self.finished or self.pending is None:
            raise RuntimeError("verify_tokens on a request that is not decoding")
        return [self.pending, *draft.tokens]

    def on_prompt_logprobs(self, offset: int, logprobs: RowLogprobs) -> None:
        """Records the prompt log probabilities of a chunk fed at prompt ``offset``: its row
        ``j`` scores prompt position ``offset + j + 1`` (rows past the prompt, the last
        chunk's generating row, are left to `on_prefill`). Recording a position again (a
        prompt computed anew on another replica) overwrites it.

        Raises:
            KeyError: a row does not list its prompt token.
        """
        k = self.options.prompt_logprobs
        if k is None:
            return
        for j in range(min(len(logprobs), self.num_prompt_tokens - offset - 1)):
            pos = offset + j + 1
            self.prompt_logprobs[pos] = logprobs.record(j, self.history[pos], k)

    def on_prefill(self, rows: TargetRows, hidden: torch.Tensor | None = None,
                   logprobs: RowLogprobs | None = None) -> None:
        """Consumes the prompt's forward: ``rows`` for the last prompt position (1 row),
        ``hidden`` ``[len(prompt), hidden_size]``, ``logprobs`` the last chunk's (its last
        row is the generating one). Samples and emits the first token (none when
        ``max_new_tokens`` is 0: a prompt scored, not continued)."""
        self.result.forward_calls += 1
        self.cache_len = self.options.start_pos + self.num_prompt_tokens
        if hidden is not None:
            self._hidden_log.append(hidden)
        if self.finished:
            return
        token = rows.sample(len(rows) - 1, self.rng)
        self._record(logprobs, -1, token)
        self._commit_anchor(token)

    def _record(self, logprobs: RowLogprobs | None, row: int, token: int) -> None:
        """Records ``token``'s log probability at ``row`` (negative: from the end) when
        this request keeps them."""
        k = self.options.logprobs
        if k is None:
            return
        if logprobs is None:
            raise ValueError("the target returned no log probabilities for a request that "
                             "asked for them")
        self.token_logprobs.append(logprobs.record(row % len(logprobs), token, k))

    def on_verify(
        self, draft: DraftBlock, rows: TargetRows, hidden: torch.Tensor | None = None,
        logprobs: RowLogprobs | None = None,
    ) -> int:
        """Applies the rule to a verified block and commits the result.

        Args:
            draft: the block fed after the anchor (``len <= draft_budget()``).
            rows: target output for the ``len(draft) + 1`` fed positions.
            hidden: float32 ``[len(draft) + 1, hidden_size]`` target hidden rows, or None.
            logprobs: the block's raw log probabilities (``len(draft) + 1`` rows), required
                when the request records them.

        Returns:
            The absolute KV length to keep; the caller truncates the target cache to it.

        Raises:
            ValueError: a draft longer than the budget, rows of the wrong length, or no
                ``logprobs`` for a request that records them.
        """
        if len(draft) > self.draft_budget():
            raise ValueError(f"draft of {len(draft)} exceeds the budget {self.draft_budget()}")
        if len(rows) != len(draft) + 1:
            raise ValueError(f"expected {len(draft) + 1} target rows, got {len(rows)}")
        if self.options.logprobs is not None and (logprobs is None
                                                  or len(logprobs) != len(rows)):
            raise ValueError(f"expected {len(rows)} rows of log probabilities, got "
                             f"{None if logprobs is None else len(logprobs)}")
        result = self.result
        result.forward_calls += 1
        result.verification_steps += 1
        anchor_pos = self.cache_len
        accepted = 0
        replacement: int | None = None
        plan, self._plan = self._plan, None
        if plan is not None and plan.block is not draft:
            plan = None
        for i, (token, dist) in enumerate(zip(draft.tokens, draft.dists, strict=True)):
            replacement = rows.judge(i, token, dist, self.rng)
            result.record_position(i, replacement is None)
            if plan is not None:
                result.forced_tokens += plan.forced[i]
                result.grammar_rejected_tokens += plan.invalid == i
            if replacement is not None:
                break
            accepted += 1
            self._record(logprobs, i, token)
            if self._emit(token):
                # A stop inside the block: nothing after it is emitted or counted, and the
                # cache keeps everything but this last emitted token.
                self.cache_len = anchor_pos + accepted
                return self.cache_len
        self.cache_len = anchor_pos + 1 + accepted
        if hidden is not None:
            self._hidden_log.append(hidden[: accepted + 1])
        if replacement is None:  # every draft accepted: the last row's bonus token
            replacement = rows.sample(accepted, self.rng)
        self._record(logprobs, accepted, replacement)
        self._commit_anchor(replacement)
        return self.cache_len

    def _emit(self, token: int) -> bool:
        """Appends an output token; returns True when it ends the request.

        Raises:
            GrammarError: the request's grammar refuses ``token``.
        """
        if self.grammar is not None:
            self.grammar.commit(token)
        self.generated.append(token)
        self.history.append(token)
        self.result.tokens_generated = len(self.generated)
        if token in self._stop_ids or (self.grammar is not None and self.grammar.stopped) or (
            self._stop_strings is not None and self._stop_strings.completed(self.generated)
        ):
            self.result.finish_reason = "stop"
        elif len(self.generated) >= self.options.max_new_tokens:
            self.result.finish_reason = "length"
        return self.finished

    def _commit_anchor(self, token: int) -> None:
        self.pending = token
        if self._emit(token):
            self.pending = None


#: The largest finite float16 (65504): a hidden row beyond it would be stored as inf.
FLOAT16_MAX = torch.finfo(torch.float16).max


class _RowLog:
    """An append-only ``[rows, width]`` tensor with amortised O(1) appends (capacity
    doubles), so keeping every hidden row of a long request costs no quadratic copying.

    A float16 log turns float32 (once, copying what it holds) when a row holds a finite
    value beyond float16's range (`FLOAT16_MAX`) instead of storing it as inf: residual
    streams are un-normed, and a target's massive activations (its first position: up to
    28,000 on SmolLM2 at layers 15 and 27, ``scripts/residual_magnitudes.py``) come within
    a few times of that range."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._buf: torch.Tensor | None = None
        self._len = 0

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self.dtype == torch.float16 and rows.dtype != torch.float16 and n and \
                FLOAT16_MAX < float(rows.abs().amax()) < math.inf:
            self.dtype = torch.float32
            if self._buf is not None:
                self._buf = self._buf.float()
        if self._buf is None:
            self._buf = torch.empty((max(2 * n, 64), rows.shape[1]), dtype=self.dtype)
        elif self._len + n > self._buf.shape[0]:
            grown = torch.empty((max(2 * self._buf.shape[0], self._len + n),
                                 self._buf.shape[1]), dtype=self.dtype)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len: self._len + n] = rows
        self._len += n

    def view(self) -> torch.Tensor | None:
        return None if self._buf is None else self._buf[: self._len]


def check_context(decoder_max_seq_len: int, options: SpeculativeOptions, prompt_len: int) -> None:
    """Raises ValueError when prompt + max_new_tokens cannot fit the model's context."""
    needed = options.start_pos + prompt_len + max(options.max_new_tokens - 1, 0)
    if needed > decoder_max_seq_len:
        raise ValueError(
            f"start_pos {options.start_pos} + prompt {prompt_len} + max_new_tokens "
            f"{options.max_new_tokens} exceeds the model's context of {decoder_max_seq_len}"
        )
