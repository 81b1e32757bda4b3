"""The ``specd bench serve`` command: its flags (`add_serve_parser`), their checks
(`config_from_args`) and the run (`cmd_bench_serve`: `specd_tools.bench.serve` against one
server, or `specd_tools.bench.serve_compare` against specd and a peer in turn)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..flags import positive_int
from .serve import GOODPUT_KEYS, RANDOM_NUM_PROMPTS, ServeBenchConfig, bench_endpoint
from .serve_compare import DEFAULT_PEER_CMD, DEFAULT_SPECD_CMD, LLAMA_SERVER_CMD, PEERS
from .serve_data import DATASETS
from .serve_report import format_run, sweep_table, write_plots

#: ``specd bench serve --help``'s description: the metric definitions, in plain text.
DESCRIPTION = """\
Load-tests an OpenAI-compatible server with streamed chat completions and reports what
vllm bench serve reports, under the same names (--result-json).

Per request: TTFT is the time from sending it to the first chunk with content. TPOT is
(E2EL - TTFT) / (output tokens - 1), the time per output token after the first. ITL is each
gap between consecutive content chunks. E2EL is the time to the end of the stream. Token
counts come from the server's usage (stream_options.include_usage), else from --tokenizer.

TPOT and ITL differ on a speculative server: it sends all the tokens one verification step
accepts in one chunk, so an ITL gap is the time per step and covers several tokens, while
TPOT is the time per token. They agree only when every chunk carries one token."""




def parse_rates(text: str) -> tuple[float, ...]:
    """``--request-rate``: a comma-separated list of requests per second (> 0) or ``inf``.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    rates = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected requests per second (a number > 0, or inf), got {part!r}") from None
        if not rate > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {part!r}")
        rates.append(rate)
    if not rates:
        raise argparse.ArgumentTypeError("give at least one rate")
    return tuple(rates)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``--goodput ttft:MS tpot:MS e2el:MS`` (any subset) as ``{"ttft": ms, ...}``.

    Raises:
        ValueError: a malformed item, an unknown key or a value that is not a number >= 0
            (names ``--goodput``).
    """
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: expected KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_KEYS)}, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: expected milliseconds, got {value!r}") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"--goodput {key}: expected a finite number >= 0, got {value!r}")
        slos[key] = ms
    return slos


def parse_concurrencies(text: str) -> tuple[int, ...]:
    """``--max-concurrency``: a comma-separated list of integers >= 1.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    values = tuple(positive_int(p.strip()) for p in text.split(","))
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value




def add_serve_parser(modes) -> argparse.ArgumentParser:
    """Adds ``serve`` to ``specd bench``'s sub-commands (``modes``, an argparse subparsers
    action) and returns its parser."""
    p = modes.add_parser(
        "serve", help="load-test any OpenAI-compatible server (specd serve --http-port, "
                      "transformers serve, vLLM, llama.cpp); --compare: specd against a peer",
        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, metavar="URL",
                   help="the server's API root, e.g. http://127.0.0.1:8000/v1 (required "
                        "unless --compare)")
    p.add_argument("--model", default=None,
                   help="model id to request (default: the server's first in /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="bearer token (default $OPENAI_API_KEY, else none)")
    p.add_argument("--dataset-name", choices=DATASETS, default="mt-bench",
                   help="custom: --dataset-path JSONL; mt-bench: MT-Bench's 80 questions "
                        "(first turns, 8 categories); random: --input-len random tokens; "
                        "structured: requests whose answers share a form (JSON, SQL, "
                        "functions, tool calls), in order; json-schema: extraction prompts "
                        "each with a JSON schema its answer is constrained to "
                        "(response_format), checked (default mt-bench)")
    p.add_argument("--dataset-path", default=None, metavar="FILE",
                   help='--dataset-name custom: JSONL, {"prompt": str, "category": str '
                        "(optional)} per line")
    p.add_argument("--num-prompts", type=positive_int, default=None, metavar="N",
                   help="requests per run, drawn with --seed (cycling when N exceeds the "
                        f"dataset) (default: every prompt once; random, structured, json-schema: "
                        f"{RANDOM_NUM_PROMPTS})")
    p.add_argument("--input-len", type=positive_int, default=128, metavar="TOKENS",
                   help="--dataset-name random: prompt tokens (before the chat template) by "
                        "--tokenizer; without a tokenizer that many common words")
    p.add_argument("--tokenizer", default=None, metavar="DIR|FILE.gguf|tiny-random",
                   help="client-side tokenizer for random prompts, and for token counts when "
                        "the server sends no usage (default: the served model when its id is "
                        "a local directory, .gguf or tiny-random spec)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds prompt sampling and arrival times")
    p.add_argument("--request-rate", type=parse_rates, default=(math.inf,), metavar="R[,R...]",
                   help="requests per second, Poisson arrivals (inf: all at once); a list "
                        "runs each in turn (a sweep) (default: inf)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="shape of the gamma distribution of the gaps between arrivals: 1 is "
                        "Poisson, below 1 burstier, above 1 more regular")
    p.add_argument("--max-concurrency", type=parse_concurrencies, default=None,
                   metavar="C[,C...]",
                   help="at most C requests in flight; a list runs each in turn, every "
                        "--request-rate at each (default: no cap)")
    p.add_argument("--output-len", type=positive_int, default=128, metavar="N",
                   help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true (an extra body field specd and vLLM take), so "
                        "every request generates --output-len tokens")
    p.add_argument("--extra-body", type=parse_extra_body, default={}, metavar="JSON",
                   help="a JSON object merged into every request's body, e.g. "
                        "'{\"speculation\": {\"enabled\": false}}' to measure one specd server "
                        "without drafting on the same prompts")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for request_goodput: any of ttft:MS tpot:MS e2el:MS")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="uncounted requests before each server's runs (the first checks the "
                        "endpoint; 0: none)")
    p.add_argument("--request-timeout", type=_positive_float, default=600.0, metavar="S",
                   help="seconds before a request counts as failed")
    p.add_argument("--result-json", default=None, metavar="FILE",
                   help="write the results (one object per run, vLLM's keys) as JSON")
    p.add_argument("--plot-dir", default=None, metavar="DIR",
                   help="write latency_cdf.png (and sweep.png for a rate list) there")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    from target_worker.loader import DTYPES

    c = p.add_argument_group("--compare: specd serve against a peer server, in turn")
    c.add_argument("--compare", default=None, metavar="MODEL",
                   help="start 'specd serve --http-port' and the peer on this model (a "
                        "directory, or a GGUF file for llama.cpp) one after the other and run "
                        "the workload against each")
    c.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="both servers' weights/compute dtype, the {dtype} of their commands "
                        "(auto: what specd serve picks on this machine, given to the peer "
                        "by name) (default: auto)")
    c.add_argument("--peer", choices=sorted(PEERS), default="transformers",
                   help="the peer: transformers serve, or llama.cpp's llama-server "
                        "($LLAMA_SERVER, scripts/build_llama_server.sh's build, or on PATH) "
                        "(default: %(default)s)")
    c.add_argument("--peer-cmd", default=None, metavar="CMD",
                   help="the peer's command, instead of --peer's; {port}, {model}, {dtype}, "
                        "{python}, {threads} and {llama_server} are filled in (transformers: "
                        f"{DEFAULT_PEER_CMD}; llama.cpp: {LLAMA_SERVER_CMD})")
    c.add_argument("--specd-cmd", default=DEFAULT_SPECD_CMD, metavar="CMD",
                   help="specd's command, as --peer-cmd (default: %(default)s)")
    c.add_argument("--rounds", type=positive_int, default=2,
                   help="rounds; each starts both servers in turn, alternating which first")
    c.add_argument("--server-timeout", type=_positive_float, default=600.0, metavar="S",
                   help="seconds a server may take to list its model at /v1/models")
    c.add_argument("--stop-timeout", type=_positive_float, default=30.0, metavar="S",
                   help="seconds between SIGTERM to a server's process group and SIGKILL")
    c.add_argument("--log-dir", default=None, metavar="DIR",
                   help="keep each server start's output here (default: a temp dir, "
                        "removed unless a start fails)")
    p.set_defaults(func=cmd_bench_serve)
    return p


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The `ServeBenchConfig` of ``specd bench serve``'s flags.

    Raises:
        ValueError: a bad flag or combination (names the flag).
    """
    import os

    if args.compare is None and not args.base_url:
        raise ValueError("--base-url URL is required (the server's .../v1), or --compare "
                         "MODEL_DIR")
    if args.compare is not None and args.base_url:
        raise ValueError("--base-url and --compare exclude each other: --compare starts its "
                         "own servers")
    if not 0 <= args.temperature < math.inf:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.dataset_name == "custom" and not args.dataset_path:
        raise ValueError("--dataset-path FILE is required with --dataset-name custom")
    return ServeBenchConfig(
        base_url=(args.base_url or "").rstrip("/"), model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        dataset_name=args.dataset_name, dataset_path=args.dataset_path,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        seed=args.seed, rates=tuple(args.request_rate), burstiness=args.burstiness,
        concurrencies=tuple(args.max_concurrency or (None,)), temperature=args.temperature,
        ignore_eos=args.ignore_eos, extra_body=args.extra_body,
        goodput=parse_goodput(args.goodput or ()),
        tokenizer=args.tokenizer, warmup=args.warmup, request_timeout=args.request_timeout,
        progress_bar=not args.disable_tqdm)


def parse_extra_body(text: str) -> dict:
    """``--extra-body``'s JSON object.

    Raises:
        argparse.ArgumentTypeError: not JSON, or not an object (names the flag).
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object, got {text!r}")
    return value


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """``specd bench serve``: runs, prints the tables (and `busy_warning` when the machine
    was busy), writes ``--result-json`` and plots."""
    from .load import busy_warning, load_average

    load_before = load_average()
    cfg = config_from_args(args)
    if args.plot_dir:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:  # fail before a long run
            raise ValueError("--plot-dir needs matplotlib: pip install 'specd[bench]'")

    def progress(line: str) -> None:
        print(f"[bench serve] {line}", file=sys.stderr, flush=True)

    if args.compare is not None:
        from .serve_compare import CompareConfig, format_compare, run_compare

        result = run_compare(cfg, CompareConfig(
            model_dir=args.compare, peer_cmd=args.peer_cmd or PEERS[args.peer],
            specd_cmd=args.specd_cmd,
            dtype=args.dtype, rounds=args.rounds, server_timeout=args.server_timeout,
            stop_timeout=args.stop_timeout, log_dir=args.log_dir), progress)
        print(format_compare(result))
        records = [r for s in result["servers"].values() for r in s["runs"]]
        payload: Any = result
    else:
        result = asyncio.run(bench_endpoint(cfg, "server", progress))
        records = result["runs"]
        for record in records:
            print(format_run(record))
        if len(records) > 1:
            print(sweep_table(records))
        payload = records[0] if len(records) == 1 else records
    if (warning := busy_warning(load_before, load_average())) is not None:
        print(f"warning: {warning}", flush=True)
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2) + "\n")
        progress(f"wrote {path}")
    if args.plot_dir:
        paths = write_plots(records, args.plot_dir)
        progress("wrote " + ", ".join(str(p) for p in paths))
    return 0

