"""Batch generation over a JSONL file: the ``ray job submit`` entry point.

    python -m specd_tools.batch --input prompts.jsonl --output results.jsonl

Each input line is an object with a unique ``id`` and either ``prompt`` (a user message, sent
through the chat template) or ``messages`` (a chat), plus optional ``max_new_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``. Each output line carries the ``id``,
the text, token ids, finish reason, usage and speculation counters. Results are appended as
they finish, so a rerun skips the ids already in the output (resumable).

Inside a Ray job (``RAY_ADDRESS`` set) the service joins that cluster; otherwise it embeds a
local Ray. ``--server HOST:PORT`` uses a running ``specd serve`` instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from tqdm import tqdm

from specd.v1 import generation_pb2, generation_pb2_grpc

from .client import open_channel


def read_jobs(path: Path) -> list[dict]:
    """Parses the input JSONL.

    Raises:
        ValueError: a line that is not an object with an ``id`` and a prompt, or a duplicate id.
    """
    jobs, seen = [], set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            job = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
        if not isinstance(job, dict) or "id" not in job:
            raise ValueError(f"{path}:{number}: each line needs an 'id'")
        if "prompt" not in job and "messages" not in job:
            raise ValueError(f"{path}:{number}: needs 'prompt' or 'messages'")
        if str(job["id"]) in seen:
            raise ValueError(f"{path}:{number}: duplicate id {job['id']!r}")
        seen.add(str(job["id"]))
        jobs.append(job)
    return jobs


def finished_ids(path: Path) -> set[str]:
    """Ids already written to the output (a partial last line from a crash is ignored)."""
    if not path.exists():
        return set()
    done = set()
    for line in path.read_text().splitlines():
        try:
            done.add(str(json.loads(line)["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def _drop_partial_line(path: Path) -> None:
    """Cuts a last line left unfinished by a crash, so appended records start on a new line."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def to_request(job: dict, default_max_new_tokens: int) -> generation_pb2.GenerateRequest:
    request = generation_pb2.GenerateRequest(
        max_new_tokens=int(job.get("max_new_tokens", default_max_new_tokens)),
        stop=list(job.get("stop", [])),
    )
    for field in ("temperature", "top_k", "top_p"):
        if field in job:
            setattr(request.sampling, field, job[field])
    if "seed" in job:
        request.seed = int(job["seed"])
    messages = job.get("messages") or [{"role": "user", "content": job["prompt"]}]
    for m in messages:
        request.chat.messages.add(role=m["role"], content=m["content"])
    return request


def to_record(job_id, result: generation_pb2.GenerateResult) -> dict:
    spec = result.speculation
    return {
        "id": job_id,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": result.finish_reason,
        "usage": {"prompt_tokens": result.usage.prompt_tokens,
                  "completion_tokens": result.usage.completion_tokens},
        "speculation": {"forward_calls": spec.forward_calls,
                        "acceptance_length": spec.acceptance_length,
                        "accept_rate": spec.accept_rate,
                        "drafter_failures": spec.drafter_failures},
    }


def run_batch(address: str, jobs: Sequence[dict], output: Path, concurrency: int = 8,
              max_new_tokens: int = 128, auth_token: str | None = None) -> int:
    """Sends every job not yet in ``output``; appends one line per finished job. Returns the
    number of jobs run."""
    _drop_partial_line(output)
    done = finished_ids(output)
    todo = [j for j in jobs if str(j["id"]) not in done]
    lock = threading.Lock()
    metadata = [("authorization", f"Bearer {auth_token}")] if auth_token else None
    with open_channel(address) as channel, output.open("a") as out, \
            ThreadPoolExecutor(max_workers=concurrency) as pool:
        stub = generation_pb2_grpc.GenerationStub(channel)
        futures = {pool.submit(stub.GenerateUnary, to_request(j, max_new_tokens),
                               metadata=metadata): j for j in todo}
        with tqdm(total=len(jobs), initial=len(jobs) - len(todo), unit="prompt",
                  file=sys.stderr) as bar:
            for future in as_completed(futures):
                record = to_record(futures[future]["id"], future.result())
                with lock:
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                bar.update(1)
    return len(todo)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd_tools.batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--server", default=None, metavar="HOST:PORT")
    parser.add_argument("--model", default=None,
                        help="a .gguf file or a Hugging Face model directory")
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--drafter", default=None,
                        help="the embedded service's drafter (default: the service's, "
                             "suffix+lookup); ignored with --server")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--auth-token", default=os.environ.get("SPECD_AUTH_TOKEN"))
    parser.add_argument("--target-resource", default=None, metavar="NAME",
                        help="place target ranks on nodes offering this Ray custom resource "
                             "(as specd serve --target-resource)")
    parser.add_argument("--drafter-resource", default=None, metavar="NAME",
                        help="place drafter workers on nodes offering this resource")
    args = parser.parse_args(argv)
    try:
        jobs = read_jobs(args.input)
    except (OSError, ValueError) as exc:
        parser.exit(2, f"error: {exc}\n")
    service = None
    address = args.server
    if address is None:
        from coordinator.cluster.config import ServiceConfig
        from coordinator.cluster.service import Service

        ray_address = "auto" if os.environ.get("RAY_ADDRESS") else None
        service = Service(ServiceConfig(model=args.model, port=0, address=ray_address,
                                        max_active=args.concurrency,
                                        **({"drafter": args.drafter} if args.drafter else {}),
                                        dtype=args.dtype,
                                        target_resource=args.target_resource,
                                        drafter_resource=args.drafter_resource))
        address = service.start()
    try:
        ran = run_batch(address, jobs, args.output, args.concurrency, args.max_new_tokens,
                        args.auth_token)
    finally:
        if service is not None:
            service.stop()
    print(f"{ran} generated, {len(jobs) - ran} already in {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
