"""Incremental detokenization for streaming."""

from __future__ import annotations

from collections.abc import Sequence

try:
    from jinja2.exceptions import TemplateError, TemplateSyntaxError
except ImportError:  # without Jinja no chat template can raise its errors
    class TemplateError(Exception):
        pass

    class TemplateSyntaxError(TemplateError):
        pass


def encode_chat(tokenizer, messages: Sequence[dict[str, str]],
                tools: Sequence[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> list[int]:
    """Token ids of ``messages`` rendered with the model's chat template, ending where the
    assistant's turn begins (the template adds the special tokens itself). ``tools``
    (OpenAI function definitions) go to the template as its ``tools`` variable, for a
    template that renders them (one that does not ignores them).

    ``add_generation_prompt`` False ends after the last message (no assistant turn
    opened); ``continue_final_message`` leaves the last message open for the model to
    continue (a partly written assistant turn), as transformers' and vLLM's options of
    those names do.

    Raises:
        ValueError: the template refused the messages (a Jinja ``TemplateError``, e.g. roles
            that do not alternate as it requires); the message is the template's own; or
            both ``add_generation_prompt`` and ``continue_final_message``.
    """
    extra: dict = {"tools": list(tools)} if tools else {}
    if continue_final_message:
        if add_generation_prompt:
            raise ValueError("chat: add_generation_prompt and continue_final_message cannot "
                             "both be true")
        extra["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(messages,
                                             add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **extra)
    except TemplateSyntaxError:  # the template itself is broken: not the client's fault
        raise
    except TemplateError as exc:  # raise_exception(...) inside the template
        raise ValueError(f"chat: the model's chat template refused the messages: {exc}") \
            from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids for one user ``prompt``: through the chat template unless ``raw``."""
    if raw:
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}])


class TextStream:
    """Turns a growing token list into text deltas that never change once returned: a
    trailing partial UTF-8 character (decoded as U+FFFD) is held back until completed, as in
    transformers' ``TextStreamer``. Special tokens are skipped."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.sent = 0

    def text(self) -> str:
        """The whole text so far."""
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> str:
        """Adds tokens; returns the new stable text (possibly "")."""
        self.tokens.extend(int(t) for t in tokens)
        text = self.text()
        if text.endswith("\ufffd"):
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta

    def flush(self) -> str:
        """Everything not yet returned, at the end of the output: a trailing partial UTF-8
        character (the length limit cut a multi-byte character's tokens) is dropped, so the
        text never ends in U+FFFD. (A genuine trailing U+FFFD is dropped too: the decoded
        text cannot tell them apart.)"""
        text = self.text().rstrip("\ufffd")
        delta, self.sent = text[self.sent:], max(self.sent, len(text))
        return delta
