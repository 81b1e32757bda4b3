"""The ``specd bench`` command: its flags (`add_bench_parser`, with the ``serve`` and
``long-prompts`` sub-commands) and the run (`cmd_bench`: `specd_tools.bench.core` in process,
`specd_tools.bench.service` for ``--service`` and ``--default-path``)."""

from __future__ import annotations

import argparse
import os
import sys

from drafter_worker.registry import (
    DEFAULT_NGRAM_SIZE,
    LOOKUP_ADAPTIVE_DRAFT_LEN,
    LOOKUP_DRAFT_LEN,
)

from ..flags import AUTH_HELP, MODEL_HELP, csv, ints, positive_int, show_defaults


def add_bench_parser(sub) -> None:
    """Adds ``bench`` (and its ``serve`` and ``long-prompts`` sub-commands) to ``sub``, the
    ``specd`` parser's sub-commands."""
    bench = sub.add_parser(
        "bench", help="benchmark specd (plain, fixed, adaptive) against HF transformers, or a "
                      "running service (--service)")
    bench.add_argument("--out", default="bench-out", help="report directory (default bench-out)")
    bench.add_argument("--model", default=None, help=MODEL_HELP + " or a tiny-random spec")
    bench.add_argument("--workloads", type=csv, default=None, metavar="A,B",
                       help="comma-separated (default all: code_edit,summarise,chat,"
                            "open_question)")
    bench.add_argument("--drafters", type=csv, default=("prompt-lookup",), metavar="A,B",
                       help="drafter names for the speculative systems (default prompt-lookup)")
    bench.add_argument("--drafter-path", default=None,
                       help="EAGLE head for the eagle drafters (default: the shipped head); "
                            "EAGLE-3 head directory for the eagle3 drafters")
    bench.add_argument("--max-new-tokens", type=int, default=None,
                       help="per generation (default 128; --default-path 160)")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--draft-len", type=int, default=LOOKUP_DRAFT_LEN,
                       help="fixed draft length (specd fixed and HF prompt_lookup_num_tokens)")
    bench.add_argument("--adaptive-max-draft-len", type=int, default=LOOKUP_ADAPTIVE_DRAFT_LEN,
                       help="the most drafts the adaptive systems may choose")
    bench.add_argument("--ngram-size", type=int, default=DEFAULT_NGRAM_SIZE)
    bench.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    bench.add_argument("--no-bare", action="store_true",
                       help="skip the bare-forward overhead reference")
    bench.add_argument("--no-plots", action="store_true", help="JSON and Markdown only")
    bench.add_argument("--threads", type=int, default=None, help="torch threads")
    bench.add_argument("--default-path", action="store_true",
                       help="time the default user path (the embedded service 'specd "
                            "generate' starts) beside transformers plain and prompt lookup, "
                            "after the forward timing (default workloads code_edit,"
                            "open_question)")
    bench.add_argument("--target-threads", type=positive_int, default=None, metavar="N",
                       help="--default-path: 'specd generate --threads'")
    bench.add_argument("--forward-ks", type=csv, default=("1", "2", "4", "8", "32"),
                       metavar="1,2,4,8,32",
                       help="forward timing block sizes, specd vs transformers ('' skips it)")
    bench.add_argument("--forward-cache-lens", type=csv, default=("300", "2000"),
                       metavar="300,2000", help="forward timing: cached tokens")
    bench.add_argument("--forward-repeats", type=int, default=15,
                       help="forward timing: timed calls per system and size")
    bench.add_argument("--no-thread-check", action="store_true",
                       help="--default-path: skip timing 1 vs 2 threads beside a busy process")
    bench.add_argument("--service", default=None, metavar="HOST:PORT",
                       help="benchmark a running 'specd serve' instead")
    bench.add_argument("--concurrency", type=csv, default=("1", "4", "8", "16"),
                       metavar="1,4,8,16", help="--service: concurrent streams per level")
    bench.add_argument("--auth-token", default=os.environ.get("SPECD_AUTH_TOKEN"),
                       help=AUTH_HELP.format(what=" for --service"))
    bench.add_argument("--tls-ca", default=None)
    bench.set_defaults(func=cmd_bench)
    # `specd bench serve ...`: an optional sub-command, so plain `specd bench ...` is unchanged.
    from .long_prompts import add_long_prompts_parser
    from .serve_cli import add_serve_parser

    modes = bench.add_subparsers(dest="bench_mode", metavar="{serve,long-prompts}",
                                 title="load-test an OpenAI-compatible server, or long prompts")
    show_defaults(add_serve_parser(modes))
    show_defaults(add_long_prompts_parser(modes))


def cmd_bench(args: argparse.Namespace) -> int:
    """``specd bench`` (no sub-command): runs, prints the Markdown report, writes ``--out``.

    Raises:
        ValueError: a bad flag (names it), or matplotlib missing without ``--no-plots``.
    """
    from .load import busy_warning, load_average
    from .report import markdown, service_markdown, write_report

    load_before = load_average()

    def progress(line: str) -> None:
        print(f"[bench] {line}", file=sys.stderr, flush=True)

    import importlib.util

    # Fail before a long run, not after it.
    if not args.no_plots and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("the plots need matplotlib: pip install 'specd[bench]' (or --no-plots)")

    if args.service is not None:
        from .service import ServiceBenchConfig, run_service_bench

        try:
            levels = tuple(int(c) for c in args.concurrency)
        except ValueError:
            raise ValueError(f"--concurrency must be integers, got {args.concurrency}") from None
        report = run_service_bench(ServiceBenchConfig(
            service=args.service, workloads=args.workloads,
            max_new_tokens=args.max_new_tokens or 128, repeats=args.repeats,
            concurrency=levels, auth_token=args.auth_token, tls_ca=args.tls_ca,
            model=args.model), progress)
        text = service_markdown(report)
    else:
        ks, lens = ints("forward-ks", args.forward_ks), ints("forward-cache-lens",
                                                               args.forward_cache_lens)
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        if args.default_path:
            from .default_path import DefaultPathConfig, run_default_path_bench
            from .report import default_path_markdown

            report = run_default_path_bench(DefaultPathConfig(
                model=args.model, workloads=args.workloads or ("code_edit", "open_question"),
                max_new_tokens=args.max_new_tokens or 160, repeats=args.repeats,
                prompt_lookup=args.draft_len, target_threads=args.target_threads,
                forward_ks=ks, forward_cache_lens=lens,
                forward_repeats=args.forward_repeats,
                thread_check=not args.no_thread_check), progress)
            text = default_path_markdown(report)
        else:
            from .core import BenchConfig, run_bench

            report = run_bench(BenchConfig(
                model=args.model, workloads=args.workloads, drafters=args.drafters,
                max_new_tokens=args.max_new_tokens or 128, repeats=args.repeats,
                draft_len=args.draft_len, adaptive_max_draft_len=args.adaptive_max_draft_len,
                ngram_size=args.ngram_size, hf=not args.no_hf, bare=not args.no_bare,
                threads=args.threads, drafter_path=args.drafter_path, forward_ks=ks,
                forward_cache_lens=lens, forward_repeats=args.forward_repeats), progress)
            text = markdown(report)
    paths = write_report(report, args.out, plots=not args.no_plots)
    print(text)
    if (warning := busy_warning(load_before, load_average())) is not None:
        print(f"warning: {warning}", flush=True)
    progress("wrote " + ", ".join(str(p) for p in paths))
    return 0
