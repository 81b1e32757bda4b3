"""``specd`` command line: ``specd generate "PROMPT"`` runs speculative decoding in-process."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from .sampling import SamplingParams
from .speculative import SpeculativeOptions, speculative_decode_with

DRAFTERS = ("prompt-lookup", "none")


class TextStream:
    """Incremental detokenization: prints only text that can no longer change (holds back a
    trailing partial UTF-8 character, like transformers' ``TextStreamer``)."""

    def __init__(self, tokenizer, out=sys.stdout):
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self.printed = 0

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def push(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        text = self.text()
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def close(self) -> str:
        text = self.text()
        self.out.write(text[self.printed:] + "\n")
        self.out.flush()
        return text


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Token ids for ``prompt``: through the model's chat template unless ``raw``."""
    if raw:
        return list(tokenizer.encode(prompt, add_special_tokens=True))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_drafter(name: str, ngram_size: int, max_draft_len: int):
    """The drafter named on the command line (``None`` for plain decoding).

    Raises:
        ValueError: an unknown name or invalid sizes.
    """
    from drafter_worker import PromptLookupSpeculator

    if name == "none":
        return None
    if name == "prompt-lookup":
        return PromptLookupSpeculator(ngram_size, max_draft_len)
    raise ValueError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")


def metrics_line(result, seconds: float) -> str:
    """One human-readable line of counters for stderr."""
    rate = result.tokens_generated / seconds if seconds > 0 else 0.0
    length = result.acceptance_length()
    accept = result.accept_rate()
    per_pos = " ".join(f"{r:.2f}" for r in result.accept_rate_per_position()) or "-"
    return (
        f"[specd] new_tokens={result.tokens_generated} forward_calls={result.forward_calls} "
        f"acceptance_length={'-' if length is None else f'{length:.2f}'} "
        f"accept_rate={'-' if accept is None else f'{accept:.2f}'} "
        f"accept_rate_per_position=[{per_pos}] "
        f"tok/s={rate:.1f} finish={result.finish_reason}"
    )


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from target_worker import load_model

    sampling = sampling_from_args(args)
    drafter = build_drafter(args.drafter, args.ngram_size, args.max_draft_len)
    decoder, tokenizer = load_model(args.model)
    prompt = encode_prompt(tokenizer, args.prompt, args.raw)
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    options = SpeculativeOptions(
        max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
        stop_token_ids=stops, stop_strings=tuple(args.stop),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    stream = None if args.json else TextStream(tokenizer)
    start = time.perf_counter()
    result = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter, options,
                                     on_tokens=stream.push if stream else None)
    seconds = time.perf_counter() - start
    text = stream.close() if stream else tokenizer.decode(result.generated_tokens,
                                                          skip_special_tokens=True)
    if args.json:
        payload = {
            "text": text,
            "prompt_tokens": len(prompt),
            "seconds": seconds,
            "tokens_per_second": result.tokens_generated / seconds if seconds else 0.0,
            "drafter": args.drafter,
            **result.to_dict(),
        }
        print(json.dumps(payload))
    print(metrics_line(result, seconds), file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion in-process")
    gen.add_argument("prompt")
    _add_sampling_flags(gen)
    gen.add_argument("--drafter", choices=DRAFTERS, default="prompt-lookup")
    gen.add_argument("--ngram-size", type=int, default=3)
    gen.add_argument("--max-draft-len", type=int, default=10)
    gen.add_argument("--model", default=None,
                     help="path to a Llama-family .gguf (default: SmolLM2-135M-Instruct)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"specd: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
