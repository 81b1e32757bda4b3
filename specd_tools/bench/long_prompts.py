"""``specd bench long-prompts``: time to first token beside transformers, the stall a short
stream sees while another client's long prompt is prefilled (chunked vs whole prompts), and the
second turn of a conversation with prefix reuse, in one run.

1. TTFT per prompt length (a long document, ``--document``, by default this repository's
   README, cut to length, plus "Summarize the text above", chat-templated): transformers'
   forward over the ids (its defaults: SDPA, torch's default threads) against specd's
   in-process prefill (`speculative_decode_with`, 1 new token, no drafter, `specd generate
   --in-process`'s default threads). Rounds alternate the two; medians.
2. Stall: an embedded service (the defaults a user gets, then the same with
   ``max_batched_tokens=None``: whole prompts) streams a short greedy request while another
   client sends a ``--stall-tokens`` prompt: the short stream's median chunk gap before, its
   longest gap after the long prompt arrived, and the long prompt's own TTFT.
3. Second turn: a ~``--turn-tokens`` conversation's first turn, then the same conversation
   plus the answer and a new question: both TTFTs and the prefix positions reused.

    specd bench long-prompts --model /tmp/smollm2-hf
    specd bench long-prompts --model /tmp/smollm2-hf --lengths 1000,2000 --rounds 1 \\
        --skip-service

Needs a quiet machine: every figure is a wall time. ``--model`` must be a Hugging Face
directory (transformers loads the same weights); `benchmarks/hf_vs_gguf.py --convert DIR`
writes one for the default model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc

from specd.v1 import generation_pb2, generation_pb2_grpc

#: The default long document: the repository's README (an editable install has it).
DOCUMENT = Path(__file__).resolve().parents[2] / "README.md"
ASK = "\n\nSummarize the text above in three sentences."


def long_prompt(tokenizer, document: str, n_tokens: int, ask: str = ASK, start: int = 0
                ) -> tuple[str, list[int]]:
    """A chat-templated prompt of about ``n_tokens`` ids: ``document`` from its token
    ``start`` on (wrapping round), cut to fit, then ``ask``. Returns (the user message text,
    the templated ids)."""
    from specd_core.text import encode_prompt

    doc_ids = tokenizer(document, add_special_tokens=False)["input_ids"]
    doc_ids = doc_ids[start:] + doc_ids[:start]
    while len(doc_ids) < n_tokens:
        doc_ids = doc_ids + doc_ids
    overhead = len(encode_prompt(tokenizer, ask, raw=False))
    text = tokenizer.decode(doc_ids[:max(1, n_tokens - overhead)]) + ask
    return text, encode_prompt(tokenizer, text, raw=False)


def ttft_table(model: str, document: str, lengths: list[int], rounds: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from coordinator.step.speculative import speculative_decode_with
    from specd_core.request import SpeculativeOptions
    from specd_tools.generate import in_process_fallback_threads, in_process_threads
    from target_worker.loader import load_model

    default_threads = torch.get_num_threads()
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    decoder, tokenizer = load_model(model)
    specd_threads, fallback_threads = in_process_threads(), in_process_fallback_threads()
    prompts = {n: long_prompt(tokenizer, document, n)[1] for n in lengths}

    def run_hf(ids):
        torch.set_num_threads(default_threads)
        with torch.inference_mode():
            start = time.perf_counter()
            hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            return time.perf_counter() - start

    def run_specd(ids):
        torch.set_num_threads(specd_threads)
        start = time.perf_counter()
        speculative_decode_with(decoder, ids, decoder.new_cache(), None,
                                SpeculativeOptions(max_new_tokens=1),
                                fallback_threads=fallback_threads)
        return time.perf_counter() - start

    times = {(n, who): [] for n in lengths for who in ("hf", "specd")}
    run_specd(prompts[lengths[0]][:64])  # warm-up both
    run_hf(prompts[lengths[0]][:64])
    for rnd in range(rounds):
        for n in lengths:
            order = (("hf", run_hf), ("specd", run_specd))
            for who, fn in order if rnd % 2 == 0 else order[::-1]:
                times[n, who].append(fn(prompts[n]))
    print(f"\nTTFT (one prompt, no other load), median of {rounds}; transformers "
          f"{default_threads} threads, specd in-process {specd_threads} (or "
          f"{fallback_threads} where that measured cheaper)")
    print(f"{'tokens':>7} {'transformers s':>15} {'specd s':>9} {'specd/hf':>9} "
          f"{'specd tok/s':>12}")
    for n in lengths:
        hf_s, sp_s = (statistics.median(times[n, w]) for w in ("hf", "specd"))
        print(f"{len(prompts[n]):>7} {hf_s:>15.3f} {sp_s:>9.3f} {sp_s / hf_s:>8.2f}x "
              f"{len(prompts[n]) / sp_s:>12.0f}")


def _chat(messages, max_new: int, ignore_eos: bool = False):
    req = generation_pb2.GenerateRequest(max_new_tokens=max_new, ignore_eos=ignore_eos)
    for role, content in messages:
        req.chat.messages.add(role=role, content=content)
    return req


def _timed_stream(address: str, req, stamps: list[float], tokens: list[int]) -> None:
    with grpc.insecure_channel(address) as channel:
        for chunk in generation_pb2_grpc.GenerationStub(channel).Generate(req, timeout=3600):
            stamps.append(time.perf_counter())
            tokens.extend(chunk.token_ids)


def stall(address: str, long_text: str, short_new: int) -> dict:
    """A short greedy stream, then another client's long prompt once it streams: the short
    stream's gaps before/after and the long prompt's TTFT, seconds."""
    stamps: list[float] = []
    short = threading.Thread(target=_timed_stream, args=(
        address, _chat([("user", "List the numbers from 1 to 1000, separated by commas.")],
                       short_new, ignore_eos=True), stamps, []))
    short.start()
    deadline = time.monotonic() + 600
    while len(stamps) < 20 and time.monotonic() < deadline and short.is_alive():
        time.sleep(0.01)
    sent = time.perf_counter()
    long_stamps: list[float] = []
    _timed_stream(address, _chat([("user", long_text)], 1), long_stamps, [])
    ttft = long_stamps[0] - sent
    short.join()
    before = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b <= sent]
    during = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > sent]
    return {"gap_before": statistics.median(before) if before else float("nan"),
            "max_gap_during": max(during) if during else float("nan"),
            "long_ttft": ttft,
            "short_chunks_during_prefill": sum(1 for s in stamps if sent < s <= long_stamps[0])}


def second_turn(address: str, service, text: str) -> dict:
    def ttft(messages, max_new):
        stamps, tokens = [], []
        sent = time.perf_counter()
        _timed_stream(address, _chat(messages, max_new), stamps, tokens)
        return stamps[0] - sent, tokens

    first = [("user", text)]
    t1, answer_ids = ttft(first, 48)
    answer = service_tokenizer_decode(service, answer_ids)
    before = _prefix(service)
    t2, _ = ttft([*first, ("assistant", answer), ("user", "Name three key terms in it.")], 16)
    after = _prefix(service)
    return {"first": t1, "second": t2, "reused": after - before}


def service_tokenizer_decode(service, ids: list[int]) -> str:
    from coordinator.cluster.actor import load_tokenizer_for

    tokenizer = getattr(service, "_bench_tokenizer", None)
    if tokenizer is None:
        tokenizer = service._bench_tokenizer = load_tokenizer_for(service.config.model)
    return tokenizer.decode(ids, skip_special_tokens=True)


def _prefix(service) -> int:
    return sum(r.get("prefix_hit_tokens", 0) for r in service.status()["replicas"])


def service_tables(model: str, document: str, stall_tokens: int, turn_tokens: int,
                   short_new: int, budgets: list[int]) -> None:
    from coordinator.cluster.actor import load_tokenizer_for
    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service, init_embedded_ray

    tokenizer = load_tokenizer_for(model)
    long_text = long_prompt(tokenizer, document, stall_tokens)[0]
    # Another part of the document: the stall test's prompt must not warm this one's prefix.
    turn_text = long_prompt(tokenizer, document, turn_tokens, "\n\nWhat is this text about?",
                            start=len(tokenizer(document)["input_ids"]) // 2)[0]
    init_embedded_ray()
    default = ServiceConfig.max_batched_tokens
    rows = {}
    for budget in [default, *(b for b in budgets if b != default),
                   *([None] if stall_tokens else [])]:
        name = ("whole prompts" if budget is None else
                f"budget {budget}" + (" (default)" if budget == default else ""))
        service = Service(ServiceConfig(model=model, port=0, max_batched_tokens=budget))
        service.start()
        try:
            _timed_stream(service.address, _chat([("user", "Hi")], 4), [], [])  # warm-up
            rows[name] = stall(service.address, long_text, short_new) if stall_tokens else {}
            if budget == default:
                rows[name].update(second_turn(service.address, service, turn_text))
        finally:
            service.stop()
    chunked = rows[f"budget {default} (default)"]
    if stall_tokens:
        stall_table(rows, stall_tokens)
    print(f"\nSecond turn of a ~{turn_tokens}-token conversation (chunked service): first "
          f"turn TTFT {chunked['first']:.2f} s, second {chunked['second']:.2f} s "
          f"({chunked['second'] / chunked['first']:.2f}x), {chunked['reused']} prompt "
          f"positions reused")


def stall_table(rows: dict, stall_tokens: int) -> None:
    whole = rows["whole prompts"]
    print(f"\nA short greedy stream while another client sends a {stall_tokens}-token prompt")
    print(f"{'service':20} {'gap before ms':>14} {'max gap during s':>17} "
          f"{'long TTFT s':>12} {'vs whole':>9} {'short chunks during':>20}")
    for name, r in rows.items():
        print(f"{name:20} {r['gap_before'] * 1e3:>14.0f} {r['max_gap_during']:>17.2f} "
              f"{r['long_ttft']:>12.2f} {r['long_ttft'] / whole['long_ttft']:>8.2f}x "
              f"{r['short_chunks_during_prefill']:>20}")


def add_long_prompts_parser(modes) -> argparse.ArgumentParser:
    """Adds ``long-prompts`` to ``specd bench``'s sub-commands (``modes``, an argparse
    subparsers action) and returns its parser."""
    p = modes.add_parser("long-prompts", help="time to first token beside transformers, the "
                         "stall a long prompt causes, a second turn's prefix reuse",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a Hugging Face model directory (transformers loads the same weights)")
    p.add_argument("--document", default=None, metavar="FILE",
                   help="the long text prompts are cut from (default: the repository README)")
    p.add_argument("--lengths", default="1000,2000,4000,6000",
                   help="TTFT table: prompt lengths in tokens, comma separated")
    p.add_argument("--rounds", type=int, default=2, help="TTFT table: rounds (median)")
    p.add_argument("--stall-tokens", type=int, default=6500,
                   help="the long prompt sent beside a short stream; 0 skips the stall table")
    p.add_argument("--turn-tokens", type=int, default=3000,
                   help="the first turn of the two-turn conversation")
    p.add_argument("--short-new-tokens", type=int, default=600,
                   help="the short stream's length (it must outlast the long prefill)")
    p.add_argument("--budgets", default="",
                   help="more --max-batched-tokens values to compare with the default and "
                        "with whole prompts, comma separated")
    p.add_argument("--skip-ttft", action="store_true", help="no TTFT table")
    p.add_argument("--skip-service", action="store_true", help="no service tables")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Runs what ``args`` (`add_long_prompts_parser`) asks; prints the tables."""
    document = Path(args.document) if args.document else DOCUMENT
    if not document.is_file():
        raise ValueError(f"--document: no such file {str(document)!r} (the default is the "
                         "repository README, absent from a non-editable install)")
    text = document.read_text()
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
        budgets = [int(b) for b in args.budgets.split(",") if b]
    except ValueError:
        raise ValueError("--lengths and --budgets take integers, comma separated") from None
    if not args.skip_ttft:
        ttft_table(args.model, text, lengths, args.rounds)
    if not args.skip_service:
        service_tables(args.model, text, args.stall_tokens, args.turn_tokens,
                       args.short_new_tokens, budgets)
    sys.stdout.flush()
    return 0
