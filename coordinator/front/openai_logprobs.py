"""Log probabilities in OpenAI's shapes, for `coordinator.front.http_api`: chat ``logprobs``
(`chat_logprobs`, with each token's bytes) and completions ``logprobs`` (`completion_logprobs`),
from the target's `specd_core.logprobs.TokenLogprob` records."""

from __future__ import annotations


def _token_texts(tokenizer, ids: list[int]) -> dict[int, str]:
    """Each distinct id of ``ids`` -> its text decoded alone (special tokens kept, as vLLM
    shows them; a token holding part of a UTF-8 character decodes to U+FFFD)."""
    distinct = list(dict.fromkeys(ids))
    batch = getattr(tokenizer, "batch_decode", None)
    if batch is not None:
        texts = batch([[i] for i in distinct], skip_special_tokens=False)
    else:
        texts = [tokenizer.decode([i]) for i in distinct]
    return dict(zip(distinct, texts, strict=True))


def _gpt2_byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's ``bytes_to_unicode``) inverted: the printable
    character standing for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars, extra = dict(zip(printable, printable, strict=True)), 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


_BYTE_DECODER = _gpt2_byte_decoder()


def _token_bytes(tokenizer, texts: dict[int, str]) -> dict[int, list[int]]:
    """Each token's bytes (OpenAI chat's ``bytes``): for a byte-level BPE tokenizer (a
    Hugging Face fast tokenizer whose decoder is ``ByteLevel``, as SmolLM2's) the bytes its
    vocabulary entry stands for, so tokens that split a character still join into its UTF-8
    (each alone decodes to U+FFFD); otherwise, and for added or special tokens, the UTF-8
    of the token's text (vLLM's choice)."""
    out = {t: list(text.encode("utf-8")) for t, text in texts.items()}
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel":
        return out
    try:
        added = set(tokenizer.get_added_vocab().values())
        pieces = tokenizer.convert_ids_to_tokens(list(texts))
    except Exception:  # a tokenizer without those: text bytes
        return out
    for t, piece in zip(texts, pieces, strict=True):
        if t not in added and piece and all(c in _BYTE_DECODER for c in piece):
            out[t] = [_BYTE_DECODER[c] for c in piece]
    return out


def chat_logprobs(tokenizer, records: list) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}],
    "refusal": None}`` for `TokenLogprob` ``records`` (``bytes``: `_token_bytes`)."""
    texts = _token_texts(tokenizer, [t for r in records for t in (r.token, *(a for a, _ in
                                                                              r.top))])
    raw = _token_bytes(tokenizer, texts)

    def entry(token: int, logprob: float) -> dict:
        return {"token": texts[token], "logprob": logprob, "bytes": raw[token]}

    return {"content": [{**entry(r.token, r.logprob),
                         "top_logprobs": [entry(t, v) for t, v in r.top]} for r in records],
            "refusal": None}


def completion_logprobs(tokenizer, ids: list[int], records: list, offset: int
                         ) -> tuple[dict, int]:
    """OpenAI completions ``logprobs`` for tokens ``ids`` (``records[i]`` is ``ids[i]``'s
    `TokenLogprob`, None for the first prompt token: its value and alternatives are null)
    whose text starts at character ``offset`` of the choice's text: ``{tokens,
    token_logprobs, top_logprobs, text_offset}``; ``top_logprobs[i]`` maps token text to
    value for the ``k`` alternatives plus the token itself (OpenAI's "up to logprobs + 1").
    Also returns the offset after the last token."""
    texts = _token_texts(tokenizer, [*ids, *(t for r in records if r is not None
                                             for t, _ in r.top)])
    tokens, values, tops, offsets = [], [], [], []
    for token, r in zip(ids, records, strict=True):
        text = texts[token]
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if r is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(r.logprob)
        top: dict[str, float] = {}
        for t, v in r.top:
            top.setdefault(texts[t], v)
        top.setdefault(text, r.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}, offset


__all__ = ["chat_logprobs", "completion_logprobs"]
