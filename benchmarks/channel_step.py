"""Per-step cost of the replica channel: a verify round trip with a canned answer (no model),
so only the transport is timed: framing, encoding, the frame tags and, with ``--tls``,
encryption.

    python benchmarks/channel_step.py                      # this checkout's channel, loopback
    python benchmarks/channel_step.py --tls                # inside TLS
    git show d6b159e:target_worker/channel.py > /tmp/old_channel.py
    python benchmarks/channel_step.py --channel /tmp/old_channel.py   # another version's

Across two hosts (or network namespaces, `benchmarks/cross_node.sh`): ``--serve HOST`` on one
prints the port and serves until its stdin closes; ``--connect HOST:PORT`` on the other times
the cases (``--tls-dir DIR``: the server writes ``DIR/cert.pem`` and ``DIR/key.pem``, the
client trusts that certificate).

Cases: 8 greedy requests drafting 4 tokens (rows: 5 argmax ints each), the same with float32
hidden rows of width 576 (SmolLM2; what an EAGLE drafter asks for), and one sampling request
with dense float32 rows over a 49152-token vocabulary. Prints, per case, the median and p90
round trip in microseconds, the bytes sent and received per step (frames as written, headers
and tags included) and the first call's time (connect and handshake).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specd_core.rule import GreedyRows, ProbRows  # noqa: E402
from specd_core.sampling import SamplingParams  # noqa: E402
from specd_core.step import StepOutput, VerifyItem  # noqa: E402

SECRET = "a-secret-of-some-length"


def load_channel(path: str | None):
    if path is None:
        from target_worker import channel

        return channel
    import target_worker  # noqa: F401  (the package, for relative imports)

    spec = importlib.util.spec_from_file_location("target_worker._channel_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


GREEDY = SamplingParams()
HIDDEN = [torch.randn(5, 576) for _ in range(8)]  # distinct: pickle would send one shared once
DENSE = torch.softmax(torch.randn(5, 49152), -1)


def cases() -> dict[str, list]:
    items = [VerifyItem(slot=i, start_pos=300 + i, tokens=[11, 12, 13, 14, 15], sampling=GREEDY)
             for i in range(8)]
    return {
        "greedy 8x5": items,
        "greedy 8x5 + hidden": [VerifyItem(i.slot, i.start_pos, i.tokens, GREEDY, True)
                                for i in items],
        "sampling 1x5 dense rows": [VerifyItem(0, 300, [11, 12, 13, 14, 15],
                                               SamplingParams(temperature=0.7))],
    }


def answer(method: str, args: tuple) -> list:
    """The canned outputs for a case's items (what a replica would return)."""
    (items,) = args
    if not items[0].sampling.greedy:
        return [StepOutput(ProbRows(DENSE), None) for _ in items]
    want = items[0].want_hidden
    return [StepOutput(GreedyRows((1, 2, 3, 4, 5)), HIDDEN[i] if want else None)
            for i in range(len(items))]


class CountingTarget:
    """Wraps a `ChannelTarget`'s stream writer/reader to count the bytes of each call."""

    def __init__(self, target):
        self.target = target
        self.sent = self.received = 0

    def hook(self):
        writer, reader = self.target._writer, self.target._reader
        if getattr(writer, "_counted", False):
            return
        write, writelines, readexactly = writer.write, writer.writelines, reader.readexactly

        def count_write(data):
            self.sent += len(data)
            write(data)

        def count_writelines(chunks):
            chunks = list(chunks)
            self.sent += sum(memoryview(c).nbytes for c in chunks)
            writelines(chunks)

        async def count_read(n):
            self.received += n
            return await readexactly(n)

        writer.write, writer.writelines, reader.readexactly = (count_write, count_writelines,
                                                               count_read)
        writer._counted = True


async def time_cases(channel, address: str, steps: int, client_tls) -> None:
    kwargs = {"tls": client_tls} if client_tls is not None else {}
    for name, items in cases().items():
        target = channel.ChannelTarget(address, SECRET, **kwargs)
        t0 = time.perf_counter()
        await target.verify(items)
        first = time.perf_counter() - t0
        counter = CountingTarget(target)
        counter.hook()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            await target.verify(items)
            times.append(time.perf_counter() - t0)
        await target.close()
        times.sort()
        print(f"{name:24s} median {statistics.median(times) * 1e6:8.1f} us  "
              f"p90 {times[int(0.9 * len(times))] * 1e6:8.1f} us  "
              f"bytes/step {counter.sent / steps:8.0f} out {counter.received / steps:8.0f} "
              f"back  first call {first * 1e3:6.2f} ms", flush=True)


def start_server(channel, host: str, server_tls):
    kwargs = {"tls": server_tls} if server_tls is not None else {}
    return channel.ChannelServer(answer, ["verify"], SECRET, host, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--channel", help="a channel.py file to time instead of this one's")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tls", action="store_true", help="inside TLS (a fresh self-signed "
                        "certificate; this checkout's channel only)")
    parser.add_argument("--serve", metavar="HOST", help="only serve on HOST; print the port")
    parser.add_argument("--connect", metavar="HOST:PORT", help="only time a --serve server")
    parser.add_argument("--tls-dir", help="where --serve writes (and --connect reads) the "
                        "certificate; implies --tls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    channel = load_channel(args.channel)
    server_tls = client_tls = None
    if args.tls or args.tls_dir:
        from target_worker.tls import client_context, generate_certificate, server_context

        if args.connect:
            cert = (Path(args.tls_dir) / "cert.pem").read_bytes()
        else:
            cert, key = generate_certificate()
            server_tls = server_context(cert, key)
            if args.tls_dir:
                (Path(args.tls_dir) / "cert.pem").write_bytes(cert)
        client_tls = client_context(cert)
    if args.serve:
        server = start_server(channel, args.serve, server_tls)
        print(server.port, flush=True)
        sys.stdin.read()  # until the caller closes it
        server.close()
        return
    if args.connect:
        asyncio.run(time_cases(channel, args.connect, args.steps, client_tls))
        return
    server = start_server(channel, "127.0.0.1", server_tls)
    try:
        asyncio.run(time_cases(channel, f"127.0.0.1:{server.port}", args.steps, client_tls))
    finally:
        server.close()


if __name__ == "__main__":
    main()
