"""A generation request as the service takes it, whatever the API (`GenerationRequest`), and
the checks of its fields that need no tokenizer: caps on what a client controls (stop lists,
prompt bytes, `default_max_prompt_bytes`), sampling values (`sampling_params`), alternatives
counts, chat roles (`check_chat_role`), a draft cap (`check_max_draft_len`).
`coordinator.front.gateway.Gateway` parses and admits it. A bad field raises
`coordinator.step.errors.RequestInvalid` naming it by its gRPC path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from specd_core.grammar import GrammarSpec
from specd_core.logprobs import MAX_TOP_LOGPROBS
from specd_core.sampling import SamplingParamError, SamplingParams

from ..step.errors import RequestInvalid, literal

#: Bytes per token assumed for a tokenizer that does not list its vocabulary (a guess).
FALLBACK_TOKEN_BYTES = 64


def default_max_prompt_bytes(tokenizer, max_seq_len: int) -> int:
    """The prompt-size cap (UTF-8 bytes of prompt text or chat contents) that still admits
    every prompt of up to ``max_seq_len`` tokens: ``max_seq_len`` x the longest vocabulary
    entry in UTF-8 bytes. No token covers more text than that, so a longer prompt would
    tokenize into more than ``max_seq_len`` tokens and be refused anyway, after tokenizing.
    (Vocabulary entries are written in the tokenizer's alphabet: byte-level BPE's ``Ġ`` is two
    UTF-8 bytes for one byte of text, so the bound errs towards admitting.) For SmolLM2
    (context 8192, longest entry 162 bytes) it is ~1.3 MB.

    A tokenizer without ``get_vocab`` gets `FALLBACK_TOKEN_BYTES` per token.
    """
    get_vocab = getattr(tokenizer, "get_vocab", None)
    longest = FALLBACK_TOKEN_BYTES
    if get_vocab is not None:
        longest = max((len(t.encode("utf-8")) for t in get_vocab()), default=longest)
    return max_seq_len * max(longest, 4)  # one UTF-8 character is up to 4 bytes


def text_bytes(texts: Sequence[str], cap: int) -> int:
    """UTF-8 size of ``texts``, or some value > ``cap`` as soon as it is known to exceed it
    (without encoding a huge string: a character is 1 to 4 bytes)."""
    chars = sum(len(t) for t in texts)
    if chars > cap:
        return chars
    if 4 * chars <= cap:
        return chars  # a lower bound, enough to know it fits
    return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)


#: Most stop strings per request, and UTF-8 bytes per stop string: each step checks every
#: string against the output's tail, so an unbounded list slows the whole batch down.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_BYTES = 1024
#: Most stop token ids per request.
MAX_STOP_TOKEN_IDS = 1024

#: Chat roles the service takes, over either API (OpenAI's; ``developer`` is its newer name
#: for ``system``).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_chat_role(role: str, where: str) -> None:
    """Raises `RequestInvalid` naming ``where`` (the front end's path of the field, e.g.
    ``chat.messages[0].role`` over gRPC, ``messages[0].role`` over HTTP) unless ``role`` is
    one of `CHAT_ROLES` (an empty role included)."""
    if role not in CHAT_ROLES:
        shown = repr(role) if len(role) <= 40 else f"{role[:40]!r}... ({len(role)} characters)"
        raise RequestInvalid("{field}: " + literal(f"{shown} is not a chat role; expected one "
                                                   f"of {', '.join(CHAT_ROLES)}"), where)


def check_max_draft_len(value: int | None, where: str = "speculation.max_draft_len") -> None:
    """Raises `RequestInvalid` naming ``where`` unless ``value`` (a request's cap on drafts
    per step) is None or an integer >= 1, as ``specd generate/serve --max-draft-len`` takes
    it: a cap of 0 would be a second way to turn drafting off, which
    ``speculation.enabled: false`` says (values above the drafter's own cap mean its cap)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < 1):
        raise RequestInvalid(f"{{field}}: must be >= 1, got {value!r} (to decode without "
                             "drafts, set speculation.enabled to false)", where)


#: The sampling fields that are floats (float32 on the gRPC wire); ``top_k`` is an integer.
SAMPLING_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")


@dataclass
class GenerationRequest:
    """One generation request as a client wrote it, whatever the API: the fields of
    ``specd.v1.GenerateRequest`` (see ``protos/``) as plain values, unset optional fields
    None. Exactly one of ``text``, ``chat`` and ``token_ids`` is the prompt.

    Attributes:
        text: a raw-text prompt (tokenized as is, no chat template).
        chat: chat messages, ``{"role", "content"}`` plus ``"name"`` when set, rendered with
            the model's chat template.
        token_ids: a prompt already tokenized.
        max_new_tokens: tokens to generate; 0 is unset (`Gateway.parse` says what it means).
        sampling: the sampling fields the client set (`SAMPLING_FLOATS` and ``top_k``), by
            name; unset ones take `SamplingParams` defaults.
        seed, stop, stop_token_ids, ignore_eos: as in the proto.
        include_stop_str_in_output: False cuts the text before a stop string; None (unset)
            and True keep it (the gRPC API's default).
        logprobs, prompt_logprobs: alternatives per position to report, or None for none.
        speculate: the client's ``speculation.enabled`` (None: unset, on).
        max_draft_len: the client's cap on draft length, or None.
        drafter: the drafter the client asked for ("" or the service's; "none" disables).
        constraint: the output's constraint (`specd_core.grammar.GrammarSpec`: a JSON schema,
            regex, choice or grammar), or None; `Gateway.parse` compiles it.
        tools: OpenAI function definitions given to the chat template (``tools``), or None.
        tool_choice: ``"auto"``: the model may call ``tools`` in its own format, each
            started call constrained by the lazy grammar (`coordinator.front.tool_calls`); None:
            no calls parsed (a forced call is a ``constraint``).
        parallel_tool_calls: with ``"auto"``, several calls allowed (else at most one).
        add_generation_prompt, continue_final_message: how a chat prompt ends
            (`specd_core.text.encode_chat`).
    """

    text: str | None = None
    chat: list[dict[str, str]] | None = None
    token_ids: Sequence[int] | None = None
    max_new_tokens: int = 0
    sampling: dict[str, float | int] = field(default_factory=dict)
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    speculate: bool | None = None
    max_draft_len: int | None = None
    drafter: str = ""
    constraint: GrammarSpec | None = None
    tools: list[dict] | None = None
    tool_choice: str | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def prompt_kind(self) -> str | None:
        """``"text"``, ``"chat"`` or ``"token_ids"``: which field holds the prompt (None:
        none does)."""
        for kind in ("text", "chat", "token_ids"):
            if getattr(self, kind) is not None:
                return kind
        return None

    def trimmed_stops(self) -> tuple[str, ...]:
        """The stop strings to cut the text before: the request's when it set
        ``include_stop_str_in_output`` false, else none (the gRPC API's default keeps them)."""
        if self.include_stop_str_in_output is False:
            return tuple(self.stop)
        return ()


def check_stops(request: GenerationRequest) -> None:
    """Raises `RequestInvalid` naming ``stop`` / ``stop_token_ids`` when over their caps or
    a stop string is empty."""
    if len(request.stop) > MAX_STOP_STRINGS:
        raise RequestInvalid(f"{{field}}: {len(request.stop)} stop strings, at most "
                             f"{MAX_STOP_STRINGS} are allowed", "stop")
    for i, stop in enumerate(request.stop):
        if not stop:
            raise RequestInvalid("{field}: stop strings must be non-empty", "stop")
        if text_bytes([stop], MAX_STOP_STRING_BYTES) > MAX_STOP_STRING_BYTES:
            raise RequestInvalid(f"{{field}}[{i}]: longer than {MAX_STOP_STRING_BYTES} bytes",
                                 "stop")
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestInvalid(f"{{field}}: {len(request.stop_token_ids)} ids, at most "
                             f"{MAX_STOP_TOKEN_IDS} are allowed", "stop_token_ids")


def sampling_params(values: dict[str, float | int]) -> SamplingParams:
    """`SamplingParams` from the fields a client set (``values``: `SAMPLING_FLOATS` and
    ``top_k`` by name), unset fields taking their defaults; ``top_k`` -1 (vLLM's "off") is
    0.

    Each float is taken as float32 (what the gRPC API carries) and written back as the shortest
    decimal that round-trips it (0.01 arrives over gRPC as 0.0099999998): the value the client
    wrote, so a request means the same over either API as in process, and documented bounds
    such as repetition_penalty >= 0.01 hold as written.

    Raises:
        RequestInvalid: naming the out-of-range field (``sampling.<name>``).
    """
    kwargs: dict[str, float | int] = {}
    if values.get("top_k") == -1:
        # vLLM's "off" (its OpenAI server's long-standing default), taken over either API
        # and by `specd generate --top-k`; specd's own spelling is 0.
        values = {**values, "top_k": 0}
    with np.errstate(over="ignore"):  # a float beyond float32's range is inf, as on the wire
        for name, value in values.items():
            kwargs[name] = (float(np.format_float_positional(np.float32(value), unique=True))
                            if name in SAMPLING_FLOATS else value)
    try:
        return SamplingParams(**kwargs)
    except SamplingParamError as exc:
        raise RequestInvalid("{field}=" + literal(f"{exc.value!r}: {exc.why}"),
                             f"sampling.{exc.field}") from exc


def top_count(request: GenerationRequest, name: str) -> int | None:
    """``request.<name>`` (a top-alternatives count) or None when unset.

    Raises:
        RequestInvalid: over `MAX_TOP_LOGPROBS`.
    """
    value = getattr(request, name)
    if value is not None and value > MAX_TOP_LOGPROBS:
        raise RequestInvalid(f"{{field}}: must be in [0, {MAX_TOP_LOGPROBS}], got {value}",
                             name)
    return value


__all__ = [
    "FALLBACK_TOKEN_BYTES",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_BYTES",
    "MAX_STOP_TOKEN_IDS",
    "CHAT_ROLES",
    "SAMPLING_FLOATS",
    "GenerationRequest",
    "check_chat_role",
    "check_max_draft_len",
    "check_stops",
    "default_max_prompt_bytes",
    "sampling_params",
    "text_bytes",
    "top_count",
]
