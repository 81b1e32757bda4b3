"""The specd commands' work: `cmd_generate` (one request: an embedded service, a running one
with --server, or --in-process), `cmd_serve`, `cmd_status`, `cmd_scale` and
`cmd_train_drafter`. Their flags are `specd_tools.cli`'s parser."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time

from drafter_worker.registry import build_drafter, check_drafter, drafter_spec
from specd_core.request import SpeculativeOptions
from specd_core.text import TextStream, encode_prompt

from .flags import FLAG_OF
from .generate import (
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
    from coordinator.step.speculative import speculative_decode_with
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
        from coordinator.step.adaptive import AdaptiveDraftLength, calibrate_for

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

    from coordinator.cluster.service import Service

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
    from coordinator.cluster.config import usable_cpus

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
                             lambda dest: FLAG_OF.get(dest, f"--{dest.replace('_', '-')}"))
    options = GenerateOptions.from_args(args)
    if args.in_process:
        return _generate_in_process(args, options)
    return _generate_via_service(args, options)


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

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service

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
        tool_call_parser=args.tool_call_parser,
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
