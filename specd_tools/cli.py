"""specd command line.

'specd generate "PROMPT"' runs one request through the service (an embedded one unless
--server; --in-process skips Ray and gRPC); 'specd serve' runs the service (gRPC, and the
OpenAI HTTP API with --http-port); 'specd status' shows a running one; 'specd scale' changes
its replica and drafter counts."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence

from drafter_worker.registry import (
    DRAFTERS,
    EAGLE_MAX_DRAFT_LEN,
    build_drafter,
    check_drafter,
    default_draft_len,
    drafter_spec,
)
from drafter_worker.suffix import DEFAULT_CACHE_REQUESTS
from specd_core.request import SpeculativeOptions
from specd_core.text import TextStream, encode_prompt

from .bench.cli import add_bench_parser
from .flags import AUTH_HELP, MODEL_HELP, port, positive_int, show_defaults
from .generate import (
    PIPELINE_CHOICES,
    GenerateOptions,
    constraint_spec,
    embedded_service_config,
    generate_request,
    in_process_fallback_threads,
    in_process_threads,
    pipeline_setting,
    prefill_config,
    server_flags_refused,
)

#: `specd serve --shutdown-grace` default, seconds: long enough for a typical answer
#: (128 tokens at ~10 tok/s on a 2-core CPU take ~13 s).
SHUTDOWN_GRACE_S = 30.0


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


class StartupReport:
    """Prints each start-up phase to stderr with its time (`Service.start`'s ``progress``),
    with a progress bar over the workers (replicas + drafters) while they start, then the
    total time. A context manager: the bar is closed however the start ends."""

    def __init__(self):
        self.began = time.monotonic()
        self.bar = None

    def __call__(self, message: str, done: int, total: int) -> None:
        from tqdm import tqdm

        if self.bar is None and total:
            # disable=None: no bar when stderr is not a terminal (the lines still print).
            self.bar = tqdm(total=total, desc="[specd] workers ready", unit="worker",
                            file=sys.stderr, leave=False, disable=None)
        line = f"[specd] {message}"
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(done - self.bar.n)
        else:
            print(line, file=sys.stderr, flush=True)

    def __enter__(self) -> StartupReport:
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        if self.bar is not None:
            self.bar.close()
        if exc_type is None:
            print(f"[specd] ready in {time.monotonic() - self.began:.1f} s", file=sys.stderr,
                  flush=True)


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    d = GenerateOptions
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 disables")
    p.add_argument("--top-p", type=float, default=d.top_p)
    p.add_argument("--min-p", type=float, default=d.min_p)
    p.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty)
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty)
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty)
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the request's generator (default: fresh entropy)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop string (repeatable)")


def _report(args, text: str, result, prompt_tokens: int, seconds: float) -> None:
    """Prints the JSON object (``--json``, which holds every counter: no metrics line), or
    the metrics line to stderr after the streamed text."""
    if args.json:
        print(json.dumps({
            "text": text,
            "prompt_tokens": prompt_tokens,
            "seconds": seconds,
            "tokens_per_second": result.tokens_generated / seconds if seconds else 0.0,
            "drafter": args.drafter,
            **result.to_dict(),  # token_ids, completion_tokens, finish_reason, counters
        }), flush=True)
    else:
        print(metrics_line(result, seconds), file=sys.stderr)


def _generate_in_process(args: argparse.Namespace, options: GenerateOptions) -> int:
    from coordinator.speculative import speculative_decode_with
    from target_worker.loader import load_model

    o = options
    sampling = o.sampling()
    check_drafter(o.drafter, o.ngram_size, o.max_draft_len, o.drafter_path,
                  o.suffix_cache_requests)
    # In process the drafter runs on the loop's thread: nothing overlaps the forward, so
    # "auto" is the serial step (measuring would only spend pipelined windows finding that).
    pipelined = pipeline_setting(o) is True
    import torch

    torch.set_num_threads(o.target_threads or in_process_threads())
    print(f"[specd] loading {o.model or 'the default model (SmolLM2-135M-Instruct)'}...",
          file=sys.stderr, flush=True)
    decoder, tokenizer = load_model(o.model, o.dtype)
    # Built after the model: an EAGLE head shares the target's embedding and LM head.
    head = drafter_spec(o.drafter).has_head
    drafter = build_drafter(
        o.drafter, o.ngram_size, o.max_draft_len, target=decoder,
        drafter_path=o.drafter_path,
        stop_token_ids=[t for t in (tokenizer.eos_token_id,) if t is not None],
        suffix_cache_requests=o.suffix_cache_requests,
    ) if head else build_drafter(o.drafter, o.ngram_size, o.max_draft_len,
                                 suffix_cache_requests=o.suffix_cache_requests)
    prompt = encode_prompt(tokenizer, o.prompt, o.raw)
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    spec = constraint_spec(o)
    grammar = None
    if spec is not None:
        from specd_core.grammar import GrammarCompiler, GrammarError

        try:
            grammar = GrammarCompiler(tokenizer, decoder.config.vocab_size).compile(spec)
        except GrammarError as exc:
            raise ValueError(str(exc)) from None
    options = SpeculativeOptions(
        max_new_tokens=o.max_new_tokens, sampling=sampling, seed=o.seed,
        stop_token_ids=stops, stop_strings=tuple(o.stop),
        detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        grammar=grammar,
    )
    stream = TextStream(tokenizer)
    parts: list[str] = []

    def on_tokens(tokens: list[int]) -> None:
        delta = stream.push(tokens)
        parts.append(delta)
        if not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()

    adaptive = None
    if drafter is not None and not o.no_adaptive:
        from coordinator.adaptive import AdaptiveDraftLength, calibrate_for

        # Silent otherwise: ~1 s on a quiet 2-core machine, 10-25 s beside busy processes.
        print("[specd] timing the model's forward for adaptive drafting...", file=sys.stderr,
              flush=True)
        adaptive = AdaptiveDraftLength(calibrate_for(decoder))
    fallback = None if o.target_threads else in_process_fallback_threads()
    _make_batch_invariant(decoder, fallback)
    start = time.perf_counter()
    result = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter, options,
                                     on_tokens=on_tokens, adaptive=adaptive,
                                     pipeline=pipelined,
                                     fallback_threads=fallback)
    seconds = time.perf_counter() - start
    tail = stream.flush()  # never ends inside a UTF-8 character
    if not args.json:
        print(tail)
    _report(args, "".join(parts) + tail, result, len(prompt), seconds)
    return 0


def _make_batch_invariant(decoder, fallback_threads: int | None) -> None:
    """Plans ``decoder``'s batch-invariant matmuls for this process's threads (and
    ``fallback_threads``), as `target_worker.engine.TargetEngine` would (which then finds
    them made), but before the clock of the metrics line starts and with a line on stderr
    when that means checking this machine's kernels (the first start on a machine, or after
    a torch upgrade: ~15 s on 2 cores, `target_worker.invariant`)."""
    import torch

    from target_worker.invariant import announce_checks, verdict_path

    threads = torch.get_num_threads()
    counts = (threads,) if fallback_threads is None else (threads, fallback_threads)

    def announce() -> None:
        print(f"[specd] checking this machine's matmul kernels for batch invariance (once per "
              f"machine and torch build, ~15 s on 2 cores; verdicts kept in {verdict_path()})"
              "...", file=sys.stderr, flush=True)

    with announce_checks(announce):
        decoder.make_batch_invariant(counts)


def _generate_via_service(args: argparse.Namespace, options: GenerateOptions) -> int:
    import signal

    import grpc

    from coordinator.service import Service

    from .client import result_from_final, stream_generate

    o = options
    o.sampling()  # validates before any service starts
    check_drafter(o.drafter, o.ngram_size, o.max_draft_len, o.drafter_path,
                  o.suffix_cache_requests)
    service = None
    address = args.server
    drafter = ""  # the embedded service runs --drafter itself
    if address is not None:
        given = getattr(args, "given", set())
        # A running server has its drafter: --drafter asks for it (the server refuses
        # another), else the request takes the server's; --max-draft-len caps it only when
        # given (this client's default for --drafter is not the server's).
        if "drafter" in given and o.drafter != "none":
            drafter = o.drafter
        if "max_draft_len" not in given:
            o = dataclasses.replace(o, max_draft_len=None)
    if address is None:
        service = Service(embedded_service_config(o))
        print("[specd] starting an embedded service (Ray + gRPC)...", file=sys.stderr,
              flush=True)
        with StartupReport() as report:
            address = service.start(progress=report)
    try:
        request = generate_request(o, o.sampling(), drafter)
        start = time.perf_counter()
        tokens: list[int] = []
        text_parts: list[str] = []
        final = None
        call = stream_generate(address, request, auth_token=args.auth_token,
                               tls_ca=args.tls_ca)
        # gRPC's blocking iteration does not return to Python for signals: Ctrl-C cancels
        # the call instead, which ends the iteration with CANCELLED.
        signal.signal(signal.SIGINT, lambda *_: call.cancel())
        try:
            for chunk in call:
                tokens.extend(chunk.token_ids)
                text_parts.append(chunk.text)
                if not args.json:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                if chunk.finish_reason:
                    final = chunk
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                print(file=sys.stderr)
                raise KeyboardInterrupt from None
            raise
        seconds = time.perf_counter() - start
        if not args.json:
            print()
        result = result_from_final(final, tokens)
        _report(args, "".join(text_parts), result, final.usage.prompt_tokens, seconds)
    finally:
        if service is not None:
            service.stop()
    return 0


def _warn_oversubscribed(args: argparse.Namespace) -> None:
    """One stderr line when --threads exceeds this machine's usable cores (torch's OpenMP
    threads then wait on each other: 64 threads on 2 cores ran at 0.5 tok/s)."""
    from coordinator.config import usable_cpus

    threads, cpus = getattr(args, "target_threads", None), usable_cpus()
    remote = getattr(args, "server", None) is not None or getattr(args, "address", None)
    if threads is not None and threads > cpus and not remote:
        print(f"[specd] warning: --threads {threads} is more than this machine's {cpus} usable "
              "cores; torch's threads then wait on each other (see docs/service.md, threads)",
              file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    _warn_oversubscribed(args)
    if args.in_process and args.server is not None:
        raise ValueError("--in-process and --server exclude each other: --in-process runs the "
                         "model in this process, --server asks a running service")
    if args.server is not None:
        server_flags_refused(getattr(args, "given", set()),
                             lambda dest: _FLAG_OF.get(dest, f"--{dest.replace('_', '-')}"))
    options = GenerateOptions.from_args(args)
    if args.in_process:
        return _generate_in_process(args, options)
    return _generate_via_service(args, options)


def _admin_token_from_env() -> str | None:
    """``specd status``/``scale``'s token by default: they need the admin's (Status and Scale
    are admin calls), so $SPECD_ADMIN_TOKEN first, else $SPECD_AUTH_TOKEN."""
    return os.environ.get("SPECD_ADMIN_TOKEN") or os.environ.get("SPECD_AUTH_TOKEN")


def _serve_tokens(args) -> tuple[str, ...] | None:
    """``specd serve``'s tenant tokens: every --auth-token, else $SPECD_AUTH_TOKEN."""
    if args.auth_token:
        return tuple(args.auth_token)
    env = os.environ.get("SPECD_AUTH_TOKEN")
    return (env,) if env else None


def cmd_serve(args: argparse.Namespace) -> int:
    """``specd serve``: starts the service and serves until Ctrl-C or SIGTERM (then drains for
    up to ``--shutdown-grace`` seconds; returns 0), or until the coordinator actor dies
    (one error line; returns 1, so a process supervisor restarts it)."""
    import signal
    import threading

    from coordinator.config import ServiceConfig
    from coordinator.service import Service

    _warn_oversubscribed(args)
    service = Service(ServiceConfig(
        model=args.model, dtype=args.dtype, host=args.host, port=args.port,
        address=args.address,
        drafter=args.drafter, ngram_size=args.ngram_size, max_draft_len=args.max_draft_len,
        drafter_path=args.drafter_path, suffix_cache_requests=args.suffix_cache_requests,
        max_active=args.max_active, target_threads=args.target_threads,
        tp=args.tp, target_replicas=args.target_replicas, drafters=args.drafters,
        metrics_port=args.metrics_port, adaptive=not args.no_adaptive,
        target_timeout_s=args.target_timeout,
        target_resource=args.target_resource, drafter_resource=args.drafter_resource,
        channel_tls=args.channel_tls,
        tls_cert=args.tls_cert, tls_key=args.tls_key,
        auth_token=_serve_tokens(args), admin_token=args.admin_token or None,
        auth_tokens_file=args.auth_tokens_file,
        max_prompt_bytes=args.max_prompt_bytes, pipeline=pipeline_setting(args),
        http_port=args.http_port,
        http_max_connections_per_peer=args.http_max_connections_per_peer,
        **prefill_config(args),
    ))
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace must be >= 0, got {args.shutdown_grace}")
    from ray.exceptions import RayActorError

    stop = threading.Event()
    died = False
    serving = False  # "shutting down: in-flight streams" only once something was served
    try:
        print("[specd] starting the service...", file=sys.stderr, flush=True)
        try:
            with StartupReport() as report:
                address = service.start(progress=report)
            serving = True
            # Installed after Ray starts: ray.init replaces the process's SIGTERM handler.
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            print(f"[specd] serving specd.v1.Generation on {address} (Ctrl-C to stop)",
                  flush=True)
            if args.metrics_port is not None:
                print(f"[specd] Prometheus metrics on http://{service.metrics_address}/metrics",
                      flush=True)
            if args.http_port is not None:
                scheme = "https" if args.tls_cert else "http"
                print(f"[specd] serving the OpenAI API on {scheme}://{service.http_address}/v1",
                      flush=True)
            # The coordinator is not replicated: if it dies, exit non-zero so a process
            # supervisor restarts the service, rather than serve a dead address forever.
            while not stop.wait(COORDINATOR_CHECK_S):
                if not service.coordinator_alive():
                    died = True
                    break
        except RayActorError:  # died while starting, or asked for its addresses
            died = True
        if died:
            print("[specd] error: the coordinator actor died; the service has stopped",
                  file=sys.stderr, flush=True)
            return 1
    except KeyboardInterrupt:
        pass
    finally:
        if serving and not died:  # a dead coordinator has nothing in flight to wait for
            print(f"[specd] shutting down: in-flight streams get up to "
                  f"{args.shutdown_grace:g} s", file=sys.stderr, flush=True)
        service.stop(grace_s=0.0 if died else args.shutdown_grace)
    return 0


#: How often `specd serve` checks that its coordinator actor is alive, seconds.
COORDINATOR_CHECK_S = 5.0

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion (embedded service, a running "
                                          "server, or --in-process)")
    gen.add_argument("prompt")
    _add_sampling_flags(gen)
    _add_drafter_flags(gen)
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    _add_dtype_flag(gen)
    gen.add_argument("--server", default=None, metavar="HOST:PORT",
                     help="use a running 'specd serve' instead of starting one")
    gen.add_argument("--in-process", action="store_true",
                     help="run the core loop in this process (no Ray, no gRPC)")
    gen.add_argument("--auth-token", default=os.environ.get("SPECD_AUTH_TOKEN"),
                     help=AUTH_HELP.format(what=" for --server"))
    gen.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify a TLS server")
    gen.add_argument("--threads", "--target-threads", dest="target_threads",
                     type=positive_int, default=None, metavar="N",
                     help="torch threads of the target model, every step (default: this "
                          "machine's cores, falling back to one fewer where that measures "
                          "cheaper, as beside a busy process; refused with --server, as are "
                          "the other flags that configure a service)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--raw", action="store_true", help="no chat template")
    constrain = gen.add_mutually_exclusive_group()
    constrain.add_argument("--json-schema", default=None, metavar="FILE",
                           help="structured output: the answer is JSON matching this JSON "
                                "Schema file, lossless with speculation (default: none)")
    constrain.add_argument("--regex", default=None, metavar="PATTERN",
                           help="structured output: the whole answer matches this regex "
                                "(default: none)")
    gen.set_defaults(func=cmd_generate)

    serve = sub.add_parser("serve", help="run the service: Ray actors + the gRPC API")
    serve.add_argument("--host", default="127.0.0.1",
                       help="API listen address (default loopback only)")
    serve.add_argument("--port", type=port, default=50051)
    serve.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                       help="join this Ray cluster (default: an embedded local Ray)")
    serve.add_argument("--model", default=None, help=MODEL_HELP)
    _add_dtype_flag(serve)
    _add_drafter_flags(serve)
    serve.add_argument("--max-active", type=int, default=32,
                       help="requests decoding at once, per target replica")
    serve.add_argument("--threads", "--target-threads", dest="target_threads",
                       type=positive_int, default=None, metavar="N",
                       help="torch threads per target rank, every step (default: this "
                            "machine's cores divided among all replicas x tp ranks, falling "
                            "back to one core fewer so divided where that measures cheaper)")
    _add_scale_flags(serve)
    serve.add_argument("--target-resource", default=None, metavar="NAME",
                       help="place every target rank on Ray nodes offering the custom "
                            "resource NAME (1 per rank, offered by ray start --resources "
                            "'{\"NAME\": N}'); default: where Ray's GPU/CPU accounting "
                            "puts them")
    serve.add_argument("--drafter-resource", default=None, metavar="NAME",
                       help="place every drafter worker on Ray nodes offering the custom "
                            "resource NAME (1 per worker)")
    serve.add_argument("--channel-tls", choices=("auto", "on", "off"), default="auto",
                       help="TLS on the per-step channels (target replica sockets, drafter "
                            "gRPC) with a certificate generated for this service: auto = on "
                            "with --address (a cluster), off for the embedded loopback-only "
                            "service")
    serve.add_argument("--target-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="the most a target call (prefill or verify of a batch) may take "
                            "before its replica counts as stalled: its requests fail, it is "
                            "re-created. Each call's own deadline is 10x its cost predicted "
                            "from the replica's measured steps (at least 10 s), capped by "
                            "this (default 600; a replica whose process dies is found at "
                            "once)")
    serve.add_argument("--http-port", type=port, default=None, metavar="PORT",
                       help="also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                            "/v1/completions, /v1/models, /health, /metrics) on --host:PORT, "
                            "with the same auth token and TLS (0 picks a port; default: off)")
    serve.add_argument("--http-max-connections-per-peer", type=int, default=64, metavar="N",
                       help="HTTP connections one client IP address may hold at once (of "
                            "256 in all); one more is answered 429 and closed. 0: no "
                            "per-peer cap (behind a reverse proxy every client has its "
                            "address)")
    serve.add_argument("--metrics-port", type=port, default=None, metavar="PORT",
                       help="serve Prometheus /metrics on --host:PORT (0 picks one; default: off)")
    serve.add_argument("--max-prompt-bytes", type=int, default=None, metavar="BYTES",
                       help="refuse prompts (text, or all chat contents) over BYTES of UTF-8 "
                            "before tokenizing (default: the context length x the longest "
                            "token's bytes, which keeps the whole context reachable)")
    serve.add_argument("--tls-cert", default=None, metavar="CERT.pem",
                       help="TLS certificate for the gRPC and HTTP APIs (default: no TLS)")
    serve.add_argument("--tls-key", default=None, metavar="KEY.pem",
                       help="the certificate's private key (with --tls-cert)")
    serve.add_argument("--auth-token", action="append", default=None, metavar="TOKEN",
                       help="a bearer token every call must carry one of: repeat it for "
                            "several tenants (named key1, key2, ... in order; each has its "
                            "own cross-request caches); the only token is also the admin's "
                            "(default $SPECD_AUTH_TOKEN); a value given here is visible to "
                            "every local user in ps and /proc: prefer the environment "
                            "variable or --auth-tokens-file")
    serve.add_argument("--admin-token", default=os.environ.get("SPECD_ADMIN_TOKEN"),
                       metavar="TOKEN",
                       help="the admin's bearer token: Status, Scale and /metrics need it "
                            "when there are several tenants (default $SPECD_ADMIN_TOKEN)")
    serve.add_argument("--auth-tokens-file", default=None, metavar="FILE",
                       help="tenants' tokens, one '<tenant> <token> [admin]' line each "
                            "(# comments); re-read when it changes")
    serve.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                       metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, refuse new calls (UNAVAILABLE) and let "
                            "in-flight streams finish for up to this long before cancelling "
                            "them (default %(default)g)")
    serve.set_defaults(func=cmd_serve)

    scale = sub.add_parser("scale", help="change a running service's target replicas and "
                                         "drafter workers (removed replicas drain first)")
    scale.add_argument("--target-replicas", type=int, default=None, metavar="M")
    scale.add_argument("--drafters", type=int, default=None, metavar="N")
    scale.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    scale.add_argument("--auth-token", default=_admin_token_from_env(),
                       help="the admin's bearer token (default $SPECD_ADMIN_TOKEN, else "
                            "$SPECD_AUTH_TOKEN); a value given here is visible to every local user "
                            "in ps and /proc: prefer the environment variables")
    scale.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify a TLS server")
    scale.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                       help="give up waiting after this long (the scale still completes)")
    scale.set_defaults(func=cmd_scale)
    status = sub.add_parser("status", help="show a running service's replicas, drafters, "
                                           "requests, tok/s and acceptance")
    status.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT",
                        help="the service's gRPC address")
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    status.add_argument("--auth-token", default=_admin_token_from_env(),
                        help="the admin's bearer token (default $SPECD_ADMIN_TOKEN, else "
                             "$SPECD_AUTH_TOKEN); a value given here is visible to every local "
                             "user in ps and /proc: prefer the environment variables")
    status.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify a TLS server")
    status.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="give up waiting for the answer after this long")
    status.set_defaults(func=cmd_status)
    add_bench_parser(sub)
    _add_train_drafter_parser(sub)
    for p in (parser, *sub.choices.values()):
        show_defaults(p)
    return parser


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the Status RPC's answer as tables (or JSON)."""
    import grpc

    from .client import (
        get_status,
        no_server_message,
        status_dict,
        status_table,
        unauthenticated_message,
    )

    try:
        status = get_status(args.server, args.auth_token, args.tls_ca, args.timeout)
    except grpc.RpcError as exc:
        message = no_server_message(args.server, exc) or unauthenticated_message(exc)
        if message is None and exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                              grpc.StatusCode.DEADLINE_EXCEEDED):
            message = (f"no specd service answered at {args.server} ({exc.code().name}); "
                       f"start one with 'specd serve' or give its address with --server "
                       f"HOST:PORT")
        if message is not None:
            raise RuntimeError(message) from None
        raise
    print(json.dumps(status_dict(status), indent=2) if args.json else status_table(status))
    return 0


def _add_scale_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per target replica")
    p.add_argument("--target-replicas", type=int, default=1, metavar="M",
                   help="target replicas (data parallel)")
    p.add_argument("--drafters", type=int, default=1, metavar="N",
                   help="drafter workers (--drafter none runs none: more than 1 is "
                        "refused)")


def cmd_scale(args: argparse.Namespace) -> int:
    """Calls the Scale RPC and prints the counts now serving and what changed."""
    from specd.v1 import generation_pb2, generation_pb2_grpc

    from .client import open_channel

    if args.target_replicas is None and args.drafters is None:
        raise ValueError("give --target-replicas and/or --drafters")
    request = generation_pb2.ScaleRequest()
    if args.target_replicas is not None:
        request.target_replicas = args.target_replicas
    if args.drafters is not None:
        request.drafters = args.drafters
    metadata = [("authorization", f"Bearer {args.auth_token}")] if args.auth_token else None
    with open_channel(args.server, args.tls_ca) as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).Scale(
            request, metadata=metadata, timeout=args.timeout)
    print(f"[specd] target_replicas={reply.target_replicas} drafters={reply.drafters} "
          f"added=[{' '.join(reply.added)}] removed=[{' '.join(reply.removed)}]")
    return 0


def _add_train_drafter_parser(sub) -> None:
    from specd_tools.train_eagle import TrainConfig

    d = TrainConfig(out="")
    tr = sub.add_parser("train-drafter", help="train an EAGLE drafter head for a target, "
                                              "offline on this machine")
    tr.add_argument("--arch", choices=("eagle", "eagle3"), default="eagle",
                    help="eagle: the EAGLE-1 head (a .safetensors file); eagle3: an EAGLE-3 "
                         "head (a directory in the speculators layout) trained on "
                         "self-distilled conversations (the 'EAGLE-3 training' flags)")
    tr.add_argument("--out", required=True, help="eagle: head file to write (.safetensors; a "
                                                 ".json recipe and a .png of the curves go "
                                                 "next to it); eagle3: the head's directory")
    tr.add_argument("--model", default=None, help=MODEL_HELP)
    tr.add_argument("--data-dir", default=d.data_dir,
                    help="cache of the target's hidden states (reused when the recipe matches)")
    tr.add_argument("--max-prompts", type=int, default=d.max_prompts,
                    help="self-distillation prompts to use (0: all)")
    tr.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                    help="longest self-distilled answer")
    tr.add_argument("--gen-batch", type=int, default=d.gen_batch,
                    help="answers generated together in one packed forward")
    tr.add_argument("--stdlib-tokens", type=int, default=d.stdlib_tokens,
                    help="tokens of Python standard-library prose to add (reference topics, "
                         "then docstrings, then source; 0: none)")
    tr.add_argument("--seq-len", type=int, default=d.seq_len)
    tr.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                    help="rows of the head's restricted LM head (most frequent tokens)")
    tr.add_argument("--ffn-dim", type=int, default=d.ffn_dim, help="0: the target's")
    tr.add_argument("--epochs", type=int, default=d.epochs)
    tr.add_argument("--batch-size", type=int, default=d.batch_size)
    tr.add_argument("--chat-repeat", type=int, default=d.chat_repeat,
                    help="times each self-distilled answer is seen per epoch (prose: once)")
    tr.add_argument("--unroll", type=int, default=d.unroll,
                    help="drafting steps replayed per position in training (EAGLE-3's "
                         "training-time test; 1: plain teacher forcing)")
    tr.add_argument("--lr", type=float, default=d.lr)
    tr.add_argument("--ce-weight", type=float, default=d.ce_weight,
                    help="weight of the cross-entropy against the target's distribution "
                         "(the feature regression has weight 1)")
    tr.add_argument("--noise", type=float, default=d.noise,
                    help="width of the uniform noise added to input features")
    tr.add_argument("--time-budget-min", type=float, default=0.0,
                    help="stop training after this many minutes (0: no limit)")
    tr.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    tr.add_argument("--seed", type=int, default=d.seed)
    tr.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib)")
    from specd_tools.train_eagle3 import Eagle3TrainConfig

    e3 = Eagle3TrainConfig(out="", data_dir="", val_dir="")
    g = tr.add_argument_group("EAGLE-3 training (--arch eagle3; --data-dir, --epochs, --lr, "
                              "--draft-vocab, --threads, --seed and --time-budget-min apply)")
    g.add_argument("--conversations", type=int, default=1024,
                   help="self-distilled conversations to have in --data-dir (generated, or "
                        "continued after its last shard, before training)")
    g.add_argument("--gen-dtype", default="bfloat16",
                   help="the target's dtype while generating conversations")
    g.add_argument("--val-dir", default=None,
                   help="held-out conversations (default: DATA_DIR-val, the target's answers "
                        "to --val-prompts, made if missing)")
    g.add_argument("--val-prompts", default="train-prompts",
                   help="held-out prompts: mt-bench, train-prompts or a file, one per line")
    g.add_argument("--ttt-steps", type=int, default=e3.ttt_steps,
                   help="unrolled drafting steps (EAGLE-3's training-time test)")
    g.add_argument("--batch-tokens", type=int, default=e3.batch_tokens)
    g.add_argument("--eval-every", type=int, default=e3.eval_every)
    g.add_argument("--eval-k", type=int, default=e3.eval_k,
                   help="drafts per step in the held-out acceptance")
    g.add_argument("--init", default=None, help="a head directory to continue from")
    tr.set_defaults(func=cmd_train_drafter,
                    train_defaults={a.dest: a.default for a in tr._actions})


#: `train-drafter` flags only the EAGLE-1 trainer reads.
_EAGLE1_ONLY = ("max_prompts", "max_new_tokens", "gen_batch", "stdlib_tokens", "seq_len",
                "ffn_dim", "batch_size", "chat_repeat", "unroll", "ce_weight", "noise")
#: `train-drafter` flags only the EAGLE-3 trainer reads.
_EAGLE3_ONLY = ("conversations", "gen_dtype", "val_dir", "val_prompts", "ttt_steps",
                "batch_tokens", "eval_every", "eval_k", "init")


def cmd_train_eagle3(args: argparse.Namespace, parser_defaults: dict) -> int:
    """``specd train-drafter --arch eagle3``: self-distilled conversations (made or
    continued), held-out answers (made if missing), then training (`specd_tools.train_eagle3`).
    """
    from specd_tools import distill
    from specd_tools.train_eagle3 import Eagle3TrainConfig, train

    changed = [n for n in _EAGLE1_ONLY if getattr(args, n) != parser_defaults[n]]
    if changed:
        raise ValueError(f"--arch eagle3 does not use "
                         f"{', '.join('--' + n.replace('_', '-') for n in changed)}")
    gen = distill.DistillConfig(model=args.model, dtype=args.gen_dtype, seed=args.seed)
    val_dir = args.val_dir or f"{args.data_dir.rstrip('/')}-val"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    made = distill.generate(gen, args.data_dir, args.conversations, args.threads)
    held = distill.generate_answers(gen, val_dir, distill.prompt_set(args.val_prompts),
                                    args.threads)
    cfg = Eagle3TrainConfig(
        out=args.out, data_dir=args.data_dir, val_dir=val_dir, model=args.model,
        init=args.init, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps,
        epochs=float(args.epochs), batch_tokens=args.batch_tokens, lr=args.lr,
        eval_every=args.eval_every, eval_k=args.eval_k,
        time_budget_s=args.time_budget_min * 60, threads=args.threads, seed=args.seed,
        extra={"command": "specd " + " ".join(sys.argv[1:]), "generated": made,
               "held_out_generated": held})
    summary = train(cfg)
    print(json.dumps({"out": args.out, "best": summary["best"], "data": summary["data"],
                      "seconds": summary["seconds"]}, indent=2))
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from specd_tools.train_eagle import TrainConfig, train

    defaults = args.train_defaults
    if args.arch == "eagle3":
        return cmd_train_eagle3(args, defaults)
    changed = [n for n in _EAGLE3_ONLY if getattr(args, n) != defaults[n]]
    if changed:
        raise ValueError(f"--arch eagle does not use "
                         f"{', '.join('--' + n.replace('_', '-') for n in changed)}")

    cfg = TrainConfig(
        out=args.out, model=args.model, data_dir=args.data_dir, max_prompts=args.max_prompts,
        max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
        stdlib_tokens=args.stdlib_tokens,
        seq_len=args.seq_len, draft_vocab=args.draft_vocab, ffn_dim=args.ffn_dim,
        epochs=args.epochs, batch_size=args.batch_size, chat_repeat=args.chat_repeat,
        unroll=args.unroll, lr=args.lr, ce_weight=args.ce_weight, noise=args.noise,
        time_budget_s=args.time_budget_min * 60, threads=args.threads, seed=args.seed,
        plot=not args.no_plot,
        extra={"command": "specd " + " ".join(sys.argv[1:])},
    )
    summary = train(cfg)
    last = summary["epochs"][-1] if summary["epochs"] else {}
    print(json.dumps({"out": args.out, "timings_s": summary["timings_s"],
                      "data": summary["data"], "final_epoch": last}, indent=2))
    return 0


def _add_dtype_flag(p: argparse.ArgumentParser) -> None:
    from target_worker.loader import DTYPES

    p.add_argument("--dtype", choices=DTYPES, default=GenerateOptions.dtype,
                   help="target weights/compute dtype (default auto: bfloat16 on GPU and "
                        "on CPUs with AVX512-BF16/AMX/Arm BF16, else float32); norms, "
                        "softmax and probabilities stay float32")


def _add_drafter_flags(p: argparse.ArgumentParser) -> None:
    """The speculation and prefill flags of ``generate`` and ``serve`` (their defaults:
    `GenerateOptions`')."""
    d = GenerateOptions
    p.add_argument("--drafter", choices=DRAFTERS, default=d.drafter)
    p.add_argument("--ngram-size", type=int, default=d.ngram_size)
    lookup = drafter_spec("prompt-lookup")
    p.add_argument("--max-draft-len", type=int, default=None,
                   help=f"most drafts per step (default: the cap adaptive chooses under, "
                        f"{lookup.adaptive_draft_len} for prompt lookup; with --no-adaptive "
                        f"{lookup.draft_len} for prompt lookup; "
                        f"{drafter_spec('suffix').adaptive_draft_len} / "
                        f"{drafter_spec('suffix').draft_len} for suffix decoding; "
                        f"{EAGLE_MAX_DRAFT_LEN} for EAGLE)")
    p.add_argument("--no-adaptive", "--fixed-draft-len", dest="no_adaptive",
                   action="store_true",
                   help="draft --max-draft-len every step instead of choosing the length "
                        "(0 included) from measured step cost and running acceptance")
    schedule = p.add_mutually_exclusive_group()
    schedule.add_argument("--pipeline", choices=PIPELINE_CHOICES, default=d.pipeline,
                          help="the service's step schedule: 'on' drafts the next block while "
                               "the target verifies this one, 'off' is the serial step "
                               "(propose, then verify), 'auto' (default) measures both on each "
                               "replica as it runs and keeps the faster (--in-process: auto is "
                               "off, nothing overlaps there); the tokens are the same")
    schedule.add_argument("--no-pipeline", action="store_true",
                          help="the same as --pipeline off")
    p.add_argument("--max-batched-tokens", type=int, default=d.max_batched_tokens,
                   metavar="N",
                   help="tokens one replica step feeds at most: verify blocks first, then "
                        "chunks of waiting prompts (chunked prefill); 0: every prompt whole "
                        "in one step")
    p.add_argument("--max-partial-prefills", type=int, default=d.max_partial_prefills,
                   metavar="N",
                   help="prompts a replica may hold partly computed at once")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="never reuse a finished request's KV cache for a prompt that starts "
                        "with its tokens (and keep none warm)")
    p.add_argument("--drafter-path", default=None, metavar="PATH",
                   help="EAGLE head file for --drafter eagle / eagle+lookup (default: the head "
                        "shipped for SmolLM2; train one with 'specd train-drafter'); EAGLE-3 "
                        "head directory (EAGLE, speculators or SpecForge layout) for --drafter "
                        "eagle3 / eagle3+suffix (default: the head shipped for SmolLM2; train "
                        "one with 'specd train-drafter --arch eagle3')")
    p.add_argument("--suffix-cache-requests", type=int, default=None, metavar="N",
                   help="--drafter suffix / suffix+lookup: previous outputs each drafter "
                        "worker's global cache keeps, in all partitions (tenant, cache_salt) "
                        "together and in each, FIFO; 0 keeps none: suffix drafting within "
                        f"each request only (default {DEFAULT_CACHE_REQUESTS})")


#: Configuration names whose flag is not the name with dashes.
_FLAG_OF = {"target_timeout_s": "--target-timeout", "target_threads": "--threads",
            "num_threads": "--threads"}


def user_flags(message: str, parser: argparse.ArgumentParser,
               args: argparse.Namespace) -> str:
    """``message`` with the internal names it starts a clause with (a config field such as
    ``target_replicas:``, ``SamplingParams.top_p=``) replaced by the command's flag
    (``--target-replicas``, ``--top-p``), so an error names what the user typed; a name
    already written as a flag (``--seed must ...``) is left as it is."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
               None)
    command = sub.choices.get(args.command) if sub is not None else None
    flags = dict(_FLAG_OF)
    for action in command._actions if command is not None else ():
        longest = max(action.option_strings, key=len, default=None)
        if longest and longest.startswith("--"):
            flags.setdefault(action.dest, f"--{action.dest.replace('_', '-')}"
                             if f"--{action.dest.replace('_', '-')}" in action.option_strings
                             else longest)

    def flag(m: re.Match) -> str:
        return flags.get(m.group(2), m.group(0))

    # (?<![-./]): a name already written as a flag ("--seed must ...") stays as it is, and
    # so does the end of a path or file name ("HEAD/config.json: not readable JSON").
    return re.sub(r"(?<![-./])(SamplingParams\.|sampling\.|\b)([a-z][a-z0-9_]*)(?=[:=]| must)",
                  flag, message)


def given_flags(parser: argparse.ArgumentParser, argv: Sequence[str],
                command: str) -> set[str]:
    """The destinations of the options ``argv`` sets for ``command`` (a subcommand of
    ``parser``), whatever their value: a flag left at its default is not among them, one
    given with the default's value is."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parser_of = sub.choices[command]
    rest = list(argv)[list(argv).index(command) + 1:]
    saved = {action: action.default for action in parser_of._actions}
    try:
        for action in saved:
            action.default = argparse.SUPPRESS  # an option not given stays out of the result
        given, _ = parser_of.parse_known_args(rest)
    finally:
        for action, default in saved.items():
            action.default = default
    return set(vars(given)) - set(parser_of._defaults)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "generate":  # which flags it was given decides what --server takes
        args.given = given_flags(parser, argv, args.command)
    if getattr(args, "max_draft_len", 0) is None:
        args.max_draft_len = default_draft_len(args.drafter, adaptive=not args.no_adaptive)
    # Keep stderr to specd's own lines: Ray's start-up notices are not for this terminal.
    logging.getLogger("ray").setLevel(logging.ERROR)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad flags, a missing or unreadable model file
        parser.exit(2, f"specd: error: {user_flags(str(exc), parser, args)}\n")
    except RuntimeError as exc:  # e.g. the model fetch failed its checksum
        parser.exit(1, f"specd: error: {exc}\n")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        import grpc

        if isinstance(exc, grpc.RpcError):
            from .client import no_server_message, unauthenticated_message

            server = getattr(args, "server", None)  # None: generate's embedded service
            message = (no_server_message(server, exc) if server else None) or \
                unauthenticated_message(exc)
            parser.exit(1, f"specd: error: {message}\n" if message else
                           f"specd: error: {exc.code().name}: "
                           f"{user_flags(exc.details() or '', parser, args)}\n")
        raise


if __name__ == "__main__":
    sys.exit(main())
