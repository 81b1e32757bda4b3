"""Per-step cost of a drafter `Propose` over gRPC (the persistent ProposeStream the service
uses): 8 requests each committing 5 tokens per step, with and without their float16 hidden
rows of width 576 (what EAGLE receives, SmolLM2's width), against prompt lookup (which ignores
the rows: only transport and decoding are timed, not EAGLE's head).

    python benchmarks/propose_step.py            # a server subprocess on 127.0.0.1
    python benchmarks/propose_step.py --tls      # inside TLS

Across namespaces: ``benchmarks/cross_node.sh --bench propose`` (``--serve HOST`` prints the
port and serves until stdin closes; ``--connect HOST:PORT`` times it; ``--tls-dir DIR`` shares
the certificate). Prints per case the median and p90 round trip in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafter_worker.client import DrafterClient, ProposeJob  # noqa: E402
from drafter_worker.prompt_lookup import PromptLookupSpeculator  # noqa: E402
from drafter_worker.server import start_drafter_server  # noqa: E402
from target_worker.tls import CHANNEL_HOSTNAME, generate_certificate  # noqa: E402

SECRET = "a-secret-of-some-length"


async def serve(host: str, tls_dir: str | None) -> None:
    pair = None
    if tls_dir:
        pair = generate_certificate()
        (Path(tls_dir) / "cert.pem").write_bytes(pair[0])
    server, port = await start_drafter_server(PromptLookupSpeculator(3, 10), host,
                                              secret=SECRET, tls=pair)
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop(None)


async def time_cases(address: str, steps: int, tls_dir: str | None) -> None:
    credentials = None
    if tls_dir:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(Path(tls_dir) / "cert.pem").read_bytes())
    for name, hidden in (("8 requests x 5 tokens", False),
                         ("8 x 5 + float16 hidden rows", True)):
        client = DrafterClient(address, timeout_s=10, hidden_dtype="float16", secret=SECRET,
                               channel_credentials=credentials,
                               tls_server_name=CHANNEL_HOSTNAME if credentials else None)
        histories = {f"r{i}": [1, 2, 3, 4, 5] * 20 for i in range(8)}
        times = []
        for step in range(steps + 1):
            jobs = []
            for rid, history in histories.items():
                history.extend([(step + k) % 50 for k in range(5)])
                rows = torch.randn(5 if step else len(history) - 1, 576) if hidden else None
                jobs.append(ProposeJob(rid, list(history), 10, hidden=rows))
            t0 = time.perf_counter()
            await client.propose(jobs)
            if step:  # the first call sends whole histories
                times.append(time.perf_counter() - t0)
            if step % 40 == 39:  # keep histories short: time transport, not lookups
                for rid in histories:
                    histories[rid] = [1, 2, 3, 4, 5] * 20
                    client.forget(rid)
        await client.close()
        times.sort()
        print(f"{name:30s} median {statistics.median(times) * 1e6:8.1f} us  "
              f"p90 {times[int(0.9 * len(times))] * 1e6:8.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--serve", metavar="HOST")
    parser.add_argument("--connect", metavar="HOST:PORT")
    parser.add_argument("--tls-dir")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.serve:
        asyncio.run(serve(args.serve, args.tls_dir))
        return
    if args.connect:
        asyncio.run(time_cases(args.connect, args.steps, args.tls_dir))
        return
    with tempfile.TemporaryDirectory() as tmp:
        tls_dir = tmp if args.tls else None
        extra = ["--tls-dir", tmp] if tls_dir else []
        server = subprocess.Popen([sys.executable, __file__, "--serve", "127.0.0.1", *extra],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            port = int(server.stdout.readline())
            asyncio.run(time_cases(f"127.0.0.1:{port}", args.steps, tls_dir))
        finally:
            server.stdin.close()
            server.wait(30)


if __name__ == "__main__":
    main()
