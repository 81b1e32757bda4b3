"""Does one client's constraints stall another tenant's streams? (issue 39's attack.) Run it
against a `specd serve` with both APIs:

    specd serve --model tiny-random:vocab=128,ascii=1 --port 50051 --http-port 8000 &
    python scripts/constraint_stall_probe.py --url http://127.0.0.1:8000 --grpc 127.0.0.1:50051

Per API (HTTP, then gRPC), the victim runs ``--streams`` unconstrained streamed requests in a
loop; ``--rounds`` times, it runs alone for ``--seconds`` (quiet), then while an attacker sends
``--attacks``
distinct heavy constraints (default regexes ``y{2000000+i}``, a counted repetition whose
automaton explodes), ``--concurrency`` at a time (with ``--sustain`` it goes on with new
distinct ones until ``--seconds`` have passed). It prints, per phase, the victim's finished
streams per second and its longest gap between two chunks of one stream (or before the
first), over the quiet window and over exactly the attack's span, and the attacker's
answers (status counts, slowest seconds, constraints sent). Targets (issue 39): under attack
>= 80% of the quiet rate, longest gap <= 2x quiet. Run both phases in the same conditions:
on a shared machine the absolute numbers move, the ratio is what counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import threading
import time

try:  # the openai client's HTTP library (renamed httpx2 in its newer releases)
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx


class Victim:
    """``streams`` loops of streamed unconstrained requests; per finished stream its end
    time, and the longest gap seen between chunks (from the request's start)."""

    def __init__(self, send, streams: int):
        self.send, self.streams = send, streams
        self.done: list[float] = []
        self.gaps: list[tuple[float, float]] = []  # (time, gap)
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, daemon=True)
                         for _ in range(streams)]

    def start(self) -> Victim:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            last = time.perf_counter()
            try:
                for _ in self.send():
                    now = time.perf_counter()
                    self.gaps.append((now, now - last))
                    last = now
                self.done.append(time.perf_counter())
            except Exception:  # counted, not fatal: the probe measures what gets through
                self.errors += 1

    def spans(self, spans: list[tuple[float, float]]) -> dict:
        """The figures over several windows together: seconds, finished streams and chunks
        per second, longest gap."""
        total = sum(t1 - t0 for t0, t1 in spans)
        n = sum(any(t0 <= t <= t1 for t0, t1 in spans) for t in self.done)
        inside = [g for t, g in self.gaps if any(t0 <= t <= t1 for t0, t1 in spans)]
        return {"seconds": round(total, 2), "streams_per_s": round(n / max(total, 1e-9), 2),
                "chunks_per_s": round(len(inside) / max(total, 1e-9), 1),
                "longest_gap_s": round(max(inside, default=float("nan")), 3)}


def http_sender(http, model: str, max_tokens: int):
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}

    def send():
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield line
    return send


def grpc_sender(stub, pb2, max_tokens: int):
    req = pb2.GenerateRequest(text="Tell me a story.", max_new_tokens=max_tokens)

    def send():
        yield from stub.Generate(req, timeout=120)
    return send


def attack(send_one, n: int, concurrency: int, seconds: float
           ) -> tuple[collections.Counter, float, int]:
    """Sends distinct constraints, ``concurrency`` at a time, until ``n`` are answered and
    ``seconds`` have passed: (answers by status, slowest answer seconds, constraints sent)."""
    statuses: collections.Counter = collections.Counter()
    slowest = [0.0]
    lock = threading.Lock()
    sent = [0]
    until = time.perf_counter() + seconds

    def worker() -> None:
        while True:
            with lock:
                if sent[0] >= n and time.perf_counter() >= until:
                    return
                i = sent[0]
                sent[0] += 1
            began = time.perf_counter()
            status = send_one(i)
            with lock:
                statuses[status] += 1
                slowest[0] = max(slowest[0], time.perf_counter() - began)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statuses, slowest[0], sent[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--grpc", default="127.0.0.1:50051")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--attacks", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--regex", default="y{%d}",
                   help="%%d gets a base (random per run and API, 2000000 to 3000000) + i")
    p.add_argument("--apis", default="http,grpc")
    p.add_argument("--rounds", type=int, default=5,
                   help="quiet window then attack, this many times (figures pooled)")
    p.add_argument("--sustain", action="store_true",
                   help="the attacker goes on with new distinct constraints until --seconds "
                        "have passed (default: exactly --attacks constraints)")
    p.add_argument("--warmup", type=float, default=3.0,
                   help="seconds the victim runs before the quiet window (first-use costs)")
    args = p.parse_args()
    http = httpx.Client(base_url=args.url, timeout=120,
                        limits=httpx.Limits(max_connections=args.streams + args.concurrency + 2))
    model = http.get("/v1/models").json()["data"][0]["id"]
    for k, api in enumerate(args.apis.split(",")):
        # Constraints of this run's own (none in the server's compile cache): each API's.
        base = 2000000 + 2000 * random.randrange(500) + 1000 * k
        if api == "http":
            send = http_sender(http, model, args.max_tokens)

            def send_one(i: int, base=base) -> str:
                body = {"model": model, "max_tokens": 8, "messages": [
                    {"role": "user", "content": "x"}], "structured_outputs": {
                    "regex": args.regex % (base + i)}}
                return str(http.post("/v1/chat/completions", json=body).status_code)
        else:
            import grpc

            from specd.v1 import generation_pb2, generation_pb2_grpc

            channel = grpc.insecure_channel(args.grpc)
            stub = generation_pb2_grpc.GenerationStub(channel)
            send = grpc_sender(stub, generation_pb2, args.max_tokens)

            def send_one(i: int, stub=stub, pb2=generation_pb2, base=base) -> str:
                req = pb2.GenerateRequest(text="x", max_new_tokens=8)
                req.constraint.regex = args.regex % (base + i)
                try:
                    stub.GenerateUnary(req, timeout=120)
                    return "OK"
                except grpc.RpcError as exc:
                    return exc.code().name
        victim = Victim(send, args.streams).start()
        quiet_spans, loud_spans, answers = [], [], collections.Counter()
        try:
            time.sleep(args.warmup)  # first-use costs out of the quiet window
            for r in range(args.rounds):  # quiet and attack alternate: the same conditions
                t0 = time.perf_counter()
                time.sleep(args.seconds)  # a measuring window, not a wait for a race
                t1 = time.perf_counter()
                got = attack(lambda i, r=r: send_one(r * args.attacks + i), args.attacks,
                             args.concurrency, args.seconds if args.sustain else 0.0)
                quiet_spans.append((t0, t1))
                loud_spans.append((t1, time.perf_counter()))
                answers.update(got[0])
        finally:
            victim.stop()
        quiet, loud = victim.spans(quiet_spans), victim.spans(loud_spans)
        print(json.dumps({"api": api, "rounds": args.rounds, "quiet": quiet, "attack": loud,
                          "attacker_answers": dict(answers)}), flush=True)
        print(json.dumps({"api": api, "rate_ratio": round(
            loud["streams_per_s"] / max(quiet["streams_per_s"], 1e-9), 3),
            "chunk_rate_ratio": round(loud["chunks_per_s"] / max(quiet["chunks_per_s"], 1e-9),
                                      3),
            "gap_ratio": round(loud["longest_gap_s"] / max(quiet["longest_gap_s"], 1e-9), 2),
            "victim_errors": victim.errors}), flush=True)

if __name__ == "__main__":
    main()
