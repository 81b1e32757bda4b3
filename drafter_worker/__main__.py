"""``python -m drafter_worker``: serve one drafter over gRPC until SIGINT or SIGTERM.

Prints ``drafter listening on HOST:PORT`` (one line, flushed) once bound; on a signal it
stops accepting calls, lets in-flight ones finish (grace period) and exits with status 0.

The shared secret callers must send comes from $SPECD_DRAFTER_SECRET (an environment
variable, not a flag: flags show in `ps`). Without it the worker answers any local process,
so it then listens on loopback only (a warning is logged; a non-loopback --host is refused).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from .registry import (
    DEFAULT_DRAFTER,
    DEFAULT_NGRAM_SIZE,
    EAGLE_MAX_DRAFT_LEN,
    LOOKUP_DRAFT_LEN,
    SERVED_DRAFTERS,
    SUFFIX_DRAFT_LEN,
    build_drafter,
)
from .server import SECRET_ENV, start_drafter_server
from .sessions import SessionLimits

#: Seconds in-flight calls get to finish after a stop signal.
_GRACE_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m drafter_worker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    limits = SessionLimits()
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one")
    parser.add_argument("--host", default="127.0.0.1",
                        help=f"interface to bind (0.0.0.0: all; needs ${SECRET_ENV})")
    parser.add_argument("--max-history", type=int, default=limits.max_history,
                        help="most tokens of one request's history: the target model's "
                             "context length (default %(default)s, SmolLM2's)")
    parser.add_argument("--max-sessions", type=int, default=limits.max_sessions,
                        help="most request ids held; the least recently used go first "
                             "(default %(default)s)")
    parser.add_argument("--idle-timeout", type=float, default=limits.idle_timeout_s,
                        metavar="SECONDS",
                        help="forget a request id this long after its last call "
                             "(default %(default)s)")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, choices=SERVED_DRAFTERS,
                        help="(default %(default)s)")
    parser.add_argument("--ngram-size", type=int, default=DEFAULT_NGRAM_SIZE)
    parser.add_argument("--max-draft-len", type=int, default=None,
                        help=f"default: {LOOKUP_DRAFT_LEN} for prompt lookup, "
                             f"{SUFFIX_DRAFT_LEN} for the suffix drafters, "
                             f"{EAGLE_MAX_DRAFT_LEN} for EAGLE")
    parser.add_argument("--suffix-cache-requests", type=int, default=None, metavar="N",
                        help="suffix drafters: previous outputs the global cache keeps (all "
                             "partitions together and each; 0: none, within-request only)")
    parser.add_argument("--model", default=None,
                        help="EAGLE: the target .gguf whose embeddings it uses (default SmolLM2)")
    parser.add_argument("--drafter-path", default=None,
                        help="EAGLE: head file (default: the head shipped for SmolLM2); "
                             "EAGLE-3: head directory or a file inside it")
    return parser.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    """Runs the server until SIGINT/SIGTERM, then stops it gracefully."""
    limits = SessionLimits(max_history=args.max_history, max_sessions=args.max_sessions,
                           idle_timeout_s=args.idle_timeout)
    secret = os.environ.get(SECRET_ENV) or None
    drafter = build_drafter(args.drafter, args.ngram_size, args.max_draft_len,
                            model=args.model, drafter_path=args.drafter_path,
                            suffix_cache_requests=args.suffix_cache_requests)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server, port = await start_drafter_server(drafter, args.host, args.port, secret=secret,
                                              limits=limits)
    print(f"drafter listening on {args.host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop(_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        asyncio.run(serve(args))
    except (ValueError, RuntimeError) as e:  # bad sizes or an unbindable address
        print(f"drafter_worker: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
