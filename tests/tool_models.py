"""A tiny target model scripted to write tool calls (`scripted_decoder`), and a drafter
that proposes broken JSON (`BrokenJsonDrafter`), for the ``tool_choice: "auto"`` tests.

The scripted model is the tiny random model (``tiny-random:...,ascii=1``) with a bias added
to its logits: at each position it favours the character that continues a script, the
script being the first of ``scripts`` whose key occurs in the context (a tool answer in
the prompt, say), and the continued part the longest end of the context that begins the
script (after the whole script: EOS), else the continuation of the context's last
characters where they occur in the script. Its rows depend only on the tokens before them, as a
model's do, so batching, caching and speculation leave them alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd_core.draft import DraftBlock, DrafterCapabilities
from target_worker.model import Decoder, KvCache


class _ScriptCache(KvCache):
    """A KV cache that also remembers the token ids at its positions."""

    history: list[int]

    def prefix_copy(self, n: int, capacity: int | None = None) -> KvCache:
        new = super().prefix_copy(n, capacity)
        new.__class__ = _ScriptCache
        new.history = self.history[:n]
        return new


class ScriptedDecoder(Decoder):
    """See the module docstring; build one with `scripted_decoder`."""

    scripts: list[tuple[str, str]]
    tokenizer: object
    bias: float

    def new_cache(self, capacity: int | None = None) -> KvCache:
        cache = super().new_cache(capacity)
        cache.__class__ = _ScriptCache
        cache.history = []
        return cache

    def _next_char(self, context: str) -> str | None:
        """The script's next character after ``context`` (None: EOS)."""
        script = next((s for key, s in self.scripts if key in context), self.scripts[-1][1])
        for k in range(min(len(script), len(context)), 0, -1):  # the output so far
            if context.endswith(script[:k]):
                return script[k] if k < len(script) else None
        # Else where the output's last characters occur in the script (a call's arguments
        # alone, as a forced named call writes them), else its start.
        for n in range(min(24, len(context)), 3, -1):
            at = script.find(context[-n:])
            if at >= 0:
                return script[at + n] if at + n < len(script) else None
        return script[0]

    def _forward_packed(self, segments, last_logits_only):
        results = super()._forward_packed(segments, last_logits_only)
        with torch.inference_mode():
            for (tokens, start, cache), last, (logits, _) in zip(
                    segments, last_logits_only, results, strict=True):
                ids = [int(t) for t in tokens]
                cache.history = cache.history[:start] + ids
                rows = [len(ids) - 1] if last else range(len(ids))
                for row, r in enumerate(rows):
                    context = self.tokenizer.decode(cache.history[:start + r + 1])
                    nxt = self._next_char(context)
                    token = (self.tokenizer.eos_token_id if nxt is None
                             else self.tokenizer.encode(nxt)[0])
                    logits[row, token] += self.bias
        return results


def scripted_decoder(decoder: Decoder, tokenizer, scripts: Sequence[tuple[str, str]],
                     bias: float = 30.0) -> ScriptedDecoder:
    """``decoder`` (a tiny random model; changed in place) scripted: ``scripts`` are
    ``(key, script)`` pairs, the first whose key is in the context used (the last one when
    none is). ``bias``: logits added to the scripted token (30: greedy and T=1 both follow
    the script)."""
    decoder.__class__ = ScriptedDecoder
    decoder.scripts = list(scripts)
    decoder.tokenizer = tokenizer
    decoder.bias = bias
    return decoder


class BrokenJsonDrafter:
    """Drafts from ``text`` (a tool call whose JSON is broken) as prompt lookup drafts from
    the prompt: after the longest end of the output (up to 16 characters) found in
    ``text``, its next ``k`` characters, else its first ``k``; a drafter sure of a broken
    call, whose drafts the grammar refuses where the target has a choice."""

    def __init__(self, tokenizer, text: str, k: int = 6):
        self.tokenizer, self.text, self.k = tokenizer, text, k
        self.capabilities = DrafterCapabilities(wants_hidden=False, max_draft_len=k,
                                                samples=False)

    def propose(self, history, target_hidden, max_len):
        context = self.tokenizer.decode(list(history))
        at = 0
        for n in range(min(16, len(context)), 0, -1):
            found = self.text.find(context[-n:])
            if found >= 0:
                at = found + n
                break
        piece = self.text[at:at + min(self.k, max_len)]
        return DraftBlock.deterministic(self.tokenizer.encode(piece))
