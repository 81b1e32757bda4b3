"""The drafter worker as a service: the stateful servicer, the async client over
a real loopback port, health/reflection, and the ``python -m drafter_worker`` entry point."""

from __future__ import annotations

import asyncio
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from drafter_worker.client import DrafterClient, DrafterUnavailable, ProposeJob
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from drafter_worker.registry import build_drafter
from drafter_worker.server import SERVICE_NAME, DrafterServicer, grpc_options, start_drafter_server
from drafter_worker.wire import block_from_proto, block_to_proto
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd_core.draft import DraftBlock, propose_ahead
from specd_core.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]

# Guards against a hung RPC stalling the suite; never reached by a passing test.
_SAFETY_S = 60


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, _SAFETY_S))


def lookup(ngram_size: int = 2, max_draft_len: int = 6) -> PromptLookupSpeculator:
    return PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=max_draft_len)


def repetitive(rng: random.Random, n: int, vocab: int = 4) -> list[int]:
    """A small-vocabulary history: n-gram matches, hence non-empty proposals, are common."""
    return [rng.randrange(vocab) for _ in range(n)]


class RecordingDrafter:
    """Records the hidden rows it is given; proposes the last token once."""

    wants_hidden = True

    def __init__(self):
        self.seen_hidden: list[torch.Tensor | None] = []

    def propose(self, history, target_hidden, max_len):
        self.seen_hidden.append(target_hidden)
        return DraftBlock.deterministic([history[-1]])


class RecordingServicer(DrafterServicer):
    """Keeps every ProposeRequest it receives, to inspect what travelled on the wire."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.requests: list[drafter_pb2.ProposeRequest] = []

    def propose_batch(self, request):
        self.requests.append(drafter_pb2.ProposeRequest.FromString(request.SerializeToString()))
        return super().propose_batch(request)


async def serve(servicer: DrafterServicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server(options=grpc_options())
    drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def item(rid: str, known: int, append, max_len: int = 6) -> drafter_pb2.ProposeItem:
    return drafter_pb2.ProposeItem(request_id=rid, known=known, append=list(append),
                                   max_len=max_len)


# --- servicer -------------------------------------------------------------------------------


def test_servicer_proposals_equal_from_scratch_under_random_appends_resyncs_and_reuse():
    rng = random.Random(0)
    drafter = lookup()
    servicer = DrafterServicer(drafter)
    truth: dict[str, list[int]] = {}  # what the servicer should hold per id
    non_empty = resyncs = 0
    for _ in range(400):
        rid = f"r{rng.randrange(4)}"
        max_len = rng.randrange(0, 8)
        action = rng.random()
        if rid not in truth or action < 0.1:  # new or reused id: known = 0, whole history
            history = repetitive(rng, rng.randrange(1, 30))
            req_item, expect_resync = item(rid, 0, history, max_len), False
        elif action < 0.2:  # a caller whose `known` is wrong
            wrong = rng.choice([k for k in range(1, len(truth[rid]) + 3) if k != len(truth[rid])])
            history = truth[rid] + repetitive(rng, 2)
            req_item, expect_resync = item(rid, wrong, history[wrong:], max_len), True
        elif action < 0.25:
            servicer.release_ids([rid])
            truth.pop(rid)
            continue
        else:  # the normal step: the delta since the last call
            history = truth[rid] + repetitive(rng, rng.randrange(0, 4))
            req_item = item(rid, len(truth[rid]), history[len(truth[rid]):], max_len)
            expect_resync = False
        (result,) = servicer.propose_batch(drafter_pb2.ProposeRequest(items=[req_item])).results
        assert result.resync == expect_resync
        if expect_resync:
            assert not result.block.tokens
            assert servicer.history(rid) is None
            truth.pop(rid)
            resyncs += 1
            continue
        truth[rid] = history
        assert servicer.history(rid) == history
        got = block_from_proto(result.block)
        assert got == lookup().propose(history, None, max_len)
        non_empty += not got.is_empty()
    # Unknown ids with known > 0 also resync.
    (result,) = servicer.propose_batch(
        drafter_pb2.ProposeRequest(items=[item("never-seen", 3, [1])])).results
    assert result.resync
    assert non_empty > 50 and resyncs > 10  # the walk exercised both paths


class FlakyDrafter:
    """Prompt lookup, except that it raises when the anchor is 99."""

    def propose(self, history, target_hidden, max_len):
        if history[-1] == 99:
            raise RuntimeError("boom")
        return lookup().propose(history, target_hidden, max_len)


def test_item_level_problems_get_empty_blocks_without_failing_the_others():
    servicer = DrafterServicer(FlakyDrafter())
    good = [1, 2, 3, 1, 2]
    bad_hidden = item("h", 0, good)
    bad_hidden.hidden.CopyFrom(drafter_pb2.Tensor(dtype="float32", shape=[2], data=b"x"))
    request = drafter_pb2.ProposeRequest(items=[
        item("a", 0, good),
        item("empty", 0, []),
        item("raises", 0, [1, 99]),
        bad_hidden,
        item("zero", 0, good, max_len=0),
        item("b", 0, good),
    ])
    results = servicer.propose_batch(request).results
    want = list(lookup().propose(good, None, 6).tokens)
    assert want  # the good items have something to propose
    assert [list(r.block.tokens) for r in results] == [want, [], [], [], [], want]
    assert not any(r.resync for r in results)
    # A drafter failure does not lose the committed history; a bad item drops its state.
    assert servicer.history("raises") == [1, 99]
    assert servicer.history("h") is None and servicer.history("empty") is None


class GreedyFixed:
    """Ignores max_len: proposes five tokens always."""

    def propose(self, history, target_hidden, max_len):
        return DraftBlock.deterministic([7, 7, 7, 7, 7])


def test_servicer_truncates_to_max_len_and_info_defaults():
    servicer = DrafterServicer(GreedyFixed())
    results = servicer.propose_batch(drafter_pb2.ProposeRequest(
        items=[item("a", 0, [1], max_len=2), item("b", 0, [1], max_len=0)])).results
    assert [list(r.block.tokens) for r in results] == [[7, 7], []]
    info = run(servicer.Info(drafter_pb2.InfoRequest(), None))
    assert (info.name, info.wants_hidden, info.max_draft_len) == ("GreedyFixed", True, 0)


def test_build_drafter():
    d = build_drafter("prompt-lookup", ngram_size=4, max_draft_len=7)
    assert isinstance(d, PromptLookupSpeculator)
    assert (d.ngram_size, d.max_draft_len) == (4, 7)
    with pytest.raises(ValueError, match="'nope'.*prompt-lookup"):
        build_drafter("nope")


# --- client + server over loopback ----------------------------------------------------------


def test_client_sends_deltas_and_proposals_equal_from_scratch():
    rng = random.Random(1)

    async def main():
        servicer = RecordingServicer(lookup())
        server, address = await serve(servicer)
        histories = {f"r{i}": repetitive(rng, 10) for i in range(3)}
        try:
            async with DrafterClient(address, timeout_s=5) as client:
                for step in range(6):
                    jobs = [ProposeJob(rid, list(h), max_len=step % 5) for rid, h in
                            histories.items()]
                    sent_before = {rid: client.known(rid) for rid in histories}
                    blocks = await client.propose(jobs)
                    for job, block in zip(jobs, blocks, strict=True):
                        assert block == lookup().propose(job.history, None, job.max_len)
                        assert client.known(job.request_id) == len(job.history)
                    wire_items = servicer.requests[-1].items
                    for w in wire_items:
                        assert w.known == sent_before[w.request_id]
                        assert list(w.append) == histories[w.request_id][w.known:]
                        assert not w.HasField("hidden") and not w.HasField("sampling")
                    for h in histories.values():
                        h.extend(repetitive(rng, rng.randrange(1, 4)))
                # After the first step only deltas travel.
                assert all(w.known > 0 for req in servicer.requests[1:] for w in req.items)
                # forget: the next call resends everything (known = 0).
                client.forget("r0")
                await client.propose([ProposeJob("r0", histories["r0"], 3)])
                assert servicer.requests[-1].items[0].known == 0
                await client.release(["r0", "r1"])
                assert servicer.history("r0") is None and servicer.history("r1") is None
                assert servicer.history("r2") is not None
                assert client.stats["calls"] == 7 and client.stats["errors"] == 0
                assert client.stats["latency_s"] > 0
        finally:
            await server.stop(None)

    run(main())


def test_client_sends_sampling_and_validates_jobs():
    async def main():
        servicer = RecordingServicer(lookup())
        server, address = await serve(servicer)
        try:
            async with DrafterClient(address, timeout_s=5) as client:
                params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
                await client.propose([ProposeJob("a", [1, 2], 3, sampling=params, seed=-1)])
                s = servicer.requests[-1].items[0].sampling
                assert (s.top_k, s.seed) == (20, 2 ** 64 - 1)
                assert s.temperature == pytest.approx(0.7) and s.top_p == pytest.approx(0.9)
                with pytest.raises(ValueError, match="twice"):
                    await client.propose([ProposeJob("b", [1], 1), ProposeJob("b", [1], 1)])
                with pytest.raises(ValueError, match="max_len"):
                    await client.propose([ProposeJob("b", [1], -1)])
                assert client.known("b") == 0 and len(servicer.requests) == 1
                assert await client.propose([]) == []
        finally:
            await server.stop(None)

    run(main())


class LongBlockServicer(DrafterServicer):
    """A misbehaving worker: answers five tokens whatever max_len was asked."""

    def propose_batch(self, request):
        response = drafter_pb2.ProposeResponse()
        for _ in request.items:
            response.results.add().block.CopyFrom(
                block_to_proto(DraftBlock.deterministic([4, 4, 4, 4, 4])))
        return response


def test_client_never_returns_more_than_max_len():
    async def main():
        server, address = await serve(LongBlockServicer(lookup()))
        try:
            async with DrafterClient(address, timeout_s=5) as client:
                blocks = await client.propose(
                    [ProposeJob("a", [1], 2), ProposeJob("b", [1], 0), ProposeJob("c", [1], 9)])
                assert [len(b) for b in blocks] == [2, 0, 5]
        finally:
            await server.stop(None)

    run(main())


def test_client_recovers_via_resync_after_server_restart():
    rng = random.Random(2)
    history = repetitive(rng, 12)

    async def main():
        server, port = await start_drafter_server(lookup(), port=0)
        address = f"127.0.0.1:{port}"
        async with DrafterClient(address, timeout_s=5) as client:
            for _ in range(3):
                (block,) = await client.propose([ProposeJob("r", history, 4)])
                assert block == lookup().propose(history, None, 4)
                history.extend(repetitive(rng, 2))
            await server.stop(None)
            # A new worker on the same port, holding a different view of "r" (2 tokens).
            server, _ = await start_drafter_server(lookup(), port=port)
            try:
                async with DrafterClient(address, timeout_s=5) as other:
                    await other.propose([ProposeJob("r", [3, 3], 4)])
                fresh = repetitive(rng, 9)
                blocks = await client.propose(
                    [ProposeJob("r", history, 4), ProposeJob("new", fresh, 4)])
                assert blocks[0].is_empty() and client.known("r") == 0
                assert blocks[1] == lookup().propose(fresh, None, 4)
                history.extend(repetitive(rng, 2))
                (block,) = await client.propose([ProposeJob("r", history, 4)])
                assert block == lookup().propose(history, None, 4)
                assert client.known("r") == len(history)
            finally:
                await server.stop(None)

    run(main())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dead_server_raises_drafter_unavailable_and_forgets_ids():
    history = [1, 2, 3, 1, 2, 3, 1]

    async def main():
        server, port = await start_drafter_server(lookup())
        # A generous deadline: a refused connection fails at once, well before it.
        async with DrafterClient(f"127.0.0.1:{port}", timeout_s=5) as client:
            await client.propose([ProposeJob("r", history, 3)])
            assert client.known("r") == len(history)
            await server.stop(None)
            with pytest.raises(DrafterUnavailable, match="UNAVAILABLE"):
                await client.propose([ProposeJob("r", history + [2], 3)])
            assert client.known("r") == 0
            await client.release(["r"])  # best effort: must not raise
            assert (client.stats["calls"], client.stats["errors"]) == (2, 1)
        # A port nobody ever listened on.
        async with DrafterClient(f"127.0.0.1:{free_port()}", timeout_s=5) as client:
            with pytest.raises(DrafterUnavailable):
                await client.info()

    run(main())


class GatedDrafter:
    """Prompt lookup that answers only while `gate` is set (it waits otherwise)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()

    def propose(self, history, target_hidden, max_len):
        self.gate.wait(_SAFETY_S)
        return lookup().propose(history, target_hidden, max_len)


def test_deadline_raises_drafter_unavailable_then_the_next_call_resends_everything():
    drafter = GatedDrafter()
    history = [1, 2, 3, 1, 2, 3, 1, 2, 3]

    async def main():
        servicer = RecordingServicer(drafter)
        server, address = await serve(servicer)
        try:
            async with DrafterClient(address, timeout_s=0.2) as client:
                await client.propose([ProposeJob("r", history[:5], 3)])
                assert client.known("r") == 5
                drafter.gate.clear()
                with pytest.raises(DrafterUnavailable, match="DEADLINE_EXCEEDED"):
                    await client.propose([ProposeJob("r", history[:7], 3)])
                # The worker applies the timed-out call later; the client cannot know that.
                assert client.known("r") == 0
                drafter.gate.set()
                client.timeout_s = 5.0
                (block,) = await client.propose([ProposeJob("r", history, 3)])
                assert block == lookup().propose(history, None, 3) and not block.is_empty()
                assert servicer.requests[-1].items[0].known == 0
        finally:
            drafter.gate.set()
            await server.stop(None)

    run(main())


class SlowIngestDrafter(RecordingDrafter):
    """A model drafter whose every call takes `SECONDS` (as ingesting a long prompt's rows
    does), longer than the client's base deadline in the test below."""

    SECONDS = 0.3

    def propose(self, history, target_hidden, max_len):
        threading.Event().wait(self.SECONDS)  # the work itself, not a wait for a race
        return super().propose(history, target_hidden, max_len)


def test_a_call_carrying_hidden_rows_gets_time_to_ingest_them():
    # The deadline is timeout_s plus ROW_DEADLINE_S per row carried: a prompt's 2000 rows
    # get 2 s more, so the slow ingest answers; the same slowness on a step without rows
    # misses the base deadline (before, the first call of every long prompt to the EAGLE-3
    # drafter timed out, and so did each resend to the drafters that replaced it).
    from drafter_worker.client import ROW_DEADLINE_S

    drafter = SlowIngestDrafter()
    history = list(range(2001))

    async def main():
        server, port = await start_drafter_server(drafter)
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=0.05,
                                     hidden_dtype="float16") as client:
                job = ProposeJob("r", history, 2, hidden_log=torch.randn(2000, 8))
                (request,) = client._pack(client._items(job))
                assert client.deadline_s(request) == pytest.approx(0.05 + 2000 * ROW_DEADLINE_S)
                (block,) = await client.propose([job])
                assert list(block.tokens) == [history[-1]] and client.known("r") == len(history)
                # The next step carries one row: back to about the base deadline.
                step = ProposeJob("r", [*history, 7], 2, hidden_log=torch.randn(2001, 8))
                with pytest.raises(DrafterUnavailable, match="DEADLINE_EXCEEDED"):
                    await client.propose([step])
        finally:
            await server.stop(None)

    run(main())
    assert drafter.seen_hidden[0].shape == (2000, 8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_hidden_rows_arrive_intact(dtype):
    drafter = RecordingDrafter()
    rows = [torch.randn(5, 16), None, torch.randn(1, 16)]

    async def main():
        server, port = await start_drafter_server(drafter)
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=5,
                                     hidden_dtype=dtype) as client:
                info = await client.info()
                assert info.wants_hidden and info.name == "RecordingDrafter"
                history = [1, 2, 3, 4, 5]
                for hidden in rows:
                    await client.propose([ProposeJob("r", list(history), 2, hidden=hidden)])
                    history.append(6)
        finally:
            await server.stop(None)

    run(main())
    assert len(drafter.seen_hidden) == len(rows)
    for sent, got in zip(rows, drafter.seen_hidden, strict=True):
        if sent is None:
            assert got is None
        elif dtype == "float32":
            assert torch.equal(got, sent)
        else:
            assert got.dtype == torch.float32
            assert torch.equal(got, sent.to(getattr(torch, dtype)).float())
            assert torch.allclose(got, sent, rtol=2.0 ** -7, atol=0)


def test_health_and_reflection():
    async def main():
        server, port = await start_drafter_server(lookup())
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                for service in ("", SERVICE_NAME):
                    reply = await health.Check(health_pb2.HealthCheckRequest(service=service),
                                               timeout=5)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND

                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                call = stub.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
                replies = [r async for r in call]
                names = {s.name for s in replies[0].list_services_response.service}
                assert {"specd.v1.Drafter", "grpc.health.v1.Health"} <= names
        finally:
            await server.stop(None)

    run(main())


def test_actor_class_serves_without_ray():
    from drafter_worker.actor import DrafterActor, _DrafterActor

    assert hasattr(DrafterActor, "remote")

    async def main():
        actor = _DrafterActor("prompt-lookup", ngram_size=2, max_draft_len=4)
        address = await actor.start()
        assert await actor.start() == address == actor.address()
        async with DrafterClient(address, timeout_s=5) as client:
            info = await client.info()
            assert (info.name, info.wants_hidden, info.max_draft_len) == (
                "PromptLookupSpeculator", False, 4)
        await actor.stop()
        assert actor.address() is None

    run(main())


# --- python -m drafter_worker ---------------------------------------------------------------


def test_module_entry_point_serves_and_stops_cleanly_on_sigterm():
    proc = subprocess.Popen(
        [sys.executable, "-m", "drafter_worker", "--port", "0", "--max-draft-len", "5"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], _SAFETY_S)
        assert ready, "no listening line"
        line = proc.stdout.readline()
        match = re.fullmatch(r"drafter listening on 127\.0\.0\.1:(\d+)\n", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")

        async def ask():
            async with DrafterClient(f"127.0.0.1:{match.group(1)}", timeout_s=10) as client:
                return await client.info()

        info = run(ask())
        assert (info.name, info.max_draft_len) == ("SuffixDrafter", 5)  # the default drafter
        proc.send_signal(signal.SIGTERM)
        # The handler stops the server gracefully and returns normally: status 0 (not the
        # -15 an unhandled SIGTERM would give).
        assert proc.wait(timeout=_SAFETY_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


class CountingServicer(RecordingServicer):
    """Counts calls of each RPC."""

    def __init__(self, drafter):
        super().__init__(drafter)
        self.unary = self.streams = 0

    async def Propose(self, request, context):  # noqa: N802
        self.unary += 1
        return await super().Propose(request, context)

    async def ProposeStream(self, request_iterator, context):  # noqa: N802
        self.streams += 1
        async for reply in super().ProposeStream(request_iterator, context):
            yield reply


def test_the_persistent_stream_answers_as_unary_calls_do_over_one_stream():
    history = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 2]

    async def main():
        results = {}
        for stream in (True, False):
            servicer = CountingServicer(lookup())
            server, address = await serve(servicer)
            try:
                async with DrafterClient(address, timeout_s=5, stream=stream) as client:
                    got = []
                    for end in range(4, len(history) + 1):
                        got.append(await client.propose([ProposeJob("r", history[:end], 3),
                                                         ProposeJob("s", history[:end], 2)]))
                    # A run-ahead job: drafted after history + assumed, stored without it.
                    ahead = await client.propose([ProposeJob("r", history, 3, ahead=True,
                                                             assumed=(3,))])
                    got.append(ahead)
                    assert servicer.history("r") == history
                results[stream] = (got, servicer.unary, servicer.streams)
            finally:
                await server.stop(None)
        return results

    results = run(main())
    assert results[True][0] == results[False][0]
    assert results[True][1:] == (0, 1)  # every proposal over one stream
    assert results[False][1:] == (len(results[False][0]) * 1, 0)
    ahead = results[True][0][-1][0]
    assert ahead == propose_ahead(lookup(), [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 1, 2], None, (3,), 3)


# --- hidden layers (EAGLE-3's residual streams) ---------------------------------------------


def test_info_reports_the_drafters_hidden_layers_over_grpc_and_in_process():
    from drafters import LayeredRecorder

    from drafter_worker.local import LocalDrafter

    async def main():
        for layers in [(4, 1, 2), ()]:
            drafter = LayeredRecorder(layers)
            server, port = await start_drafter_server(drafter)
            try:
                async with DrafterClient(f"127.0.0.1:{port}", timeout_s=5) as client:
                    remote = await client.info()
            finally:
                await server.stop(None)
            local = await LocalDrafter(drafter).info()
            assert remote == local
            assert (remote.wants_hidden, remote.hidden_layers) == (True, tuple(sorted(layers)))
        server, port = await start_drafter_server(lookup())
        try:
            async with DrafterClient(f"127.0.0.1:{port}", timeout_s=5) as client:
                assert (await client.info()).hidden_layers == ()
        finally:
            await server.stop(None)

    run(main())


def test_a_float16_wire_sends_rows_beyond_its_range_as_float32():
    """Un-normed residual streams carry massive activations (SmolLM2's first position:
    ~28,000); float16 would make a value past 65504 inf, so such a tensor goes as float32
    and arrives exact, while one within range still halves its bytes."""
    drafter = RecordingServicer(RecordingDrafter())
    within = torch.randn(4, 16)
    within[0, 3] = 60000.0
    beyond = torch.randn(1, 16)
    beyond[0, 5] = -70000.0

    async def main():
        server, address = await serve(drafter)
        try:
            async with DrafterClient(address, timeout_s=5, hidden_dtype="float16") as client:
                await client.propose([ProposeJob("r", [1, 2, 3, 4, 5], 2, hidden=within)])
                await client.propose([ProposeJob("r", [1, 2, 3, 4, 5, 6], 2, hidden=beyond)])
        finally:
            await server.stop(None)

    run(main())
    sent = [r.items[0].hidden.dtype for r in drafter.requests]
    assert sent == ["float16", "float32"]
    seen = drafter.drafter.seen_hidden
    assert torch.equal(seen[0], within.half().float()) and seen[0][0, 3] == 60000.0
    assert torch.equal(seen[1], beyond)


def _layered_history(n: int, layers=(1, 2, 4)):
    """A tiny 5-layer decoder's ``n``-token history and its captured rows (float32
    ``[n - 1, 3 * 16]``), its context raised so the history is long."""
    from dataclasses import replace

    from target_worker.config import ModelConfig
    from target_worker.model import Decoder

    config = replace(ModelConfig.tiny_test(64, n_layers=5), max_seq_len=2048)
    decoder = Decoder.random(config, seed=1)
    rng = random.Random(3)
    history = [rng.randrange(64) for _ in range(n)]
    decoder.set_capture_layers(layers)
    rows = decoder.forward_batch_with_hidden(history[:-1], 0, decoder.new_cache(),
                                             last_logits_only=True)[1]
    return history, rows


@pytest.mark.parametrize("known", [0, 200], ids=["resync", "long-append"])
def test_a_long_history_resend_with_three_layers_is_split_under_the_message_budget(known):
    """A full resend of a long history's 3-layer rows larger than ``max_message_bytes`` goes
    as items of the same id continuing each other over several requests, each within the
    budget; the worker ends holding every row (float16-exact) and answers the last item's
    proposal; the next step is one small message again."""
    from drafters import LayeredRecorder

    history, rows = _layered_history(1500)
    drafter = LayeredRecorder((1, 2, 4))
    servicer = RecordingServicer(drafter)
    budget = 16 * 1024

    async def main():
        server, address = await serve(servicer)
        try:
            async with DrafterClient(address, timeout_s=10, hidden_dtype="float16",
                                     max_message_bytes=budget) as client:
                if known:
                    await client.propose([ProposeJob("r", history[:known], 0,
                                                     hidden_log=rows[:known - 1])])
                before = len(servicer.requests)
                (block,) = await client.propose([ProposeJob("r", history, 4,
                                                            hidden_log=rows)])
                split = servicer.requests[before:]
                assert client.known("r") == len(history)
                nxt = history + [7]
                more = torch.cat([rows, torch.randn(1, rows.shape[1])])
                await client.propose([ProposeJob("r", nxt, 4, hidden_log=more)])
                return block, split, servicer.requests[-1]
        finally:
            await server.stop(None)

    block, split, last = run(main())
    assert len(split) > 5
    assert all(r.ByteSize() <= budget for r in split)
    items = [i for r in split for i in r.items]
    assert [i.known for i in items][0] == known
    for a, b in zip(items, items[1:], strict=False):  # each continues the last
        assert b.known == a.known + len(a.append)
    assert [i.max_len for i in items] == [0] * (len(items) - 1) + [4]
    assert {i.hidden.dtype for i in items} == {"float16"}
    assert block == lookup(2, 4).propose(history, None, 4)
    (session,) = drafter.sessions
    assert session.tokens == history + [7]
    assert torch.equal(session.rows[:len(history) - 1], rows.half().float())
    assert len(last.items) == 1 and last.items[0].known == len(history)


def test_resyncs_of_several_smollm2_sized_histories_fit_grpcs_limit():
    """Three requests resent whole at once (a restarted drafter), SmolLM2-sized: 8192
    positions x 3 layers x 576 x float16 = 28 MB each, 85 MB together, past gRPC's 64 MB
    message limit, go as requests within the default budget and arrive whole."""
    from drafter_worker.client import PROPOSE_MESSAGE_BYTES
    from drafter_worker.server import MAX_MESSAGE_BYTES

    drafter = RecordingDrafter()
    servicer = RecordingServicer(drafter)
    servicer.propose_batch = lambda request, inner=servicer.propose_batch: (
        servicer.requests.append(request.ByteSize()) or
        DrafterServicer.propose_batch(servicer, request))
    n, width = 8192, 3 * 576
    gen = torch.Generator().manual_seed(0)
    logs = [torch.randn(n - 1, width, generator=gen).half() for _ in range(3)]

    async def main():
        server, address = await serve(servicer)
        try:
            async with DrafterClient(address, timeout_s=60, hidden_dtype="float16") as client:
                jobs = [ProposeJob(f"r{i}", [1 + i] * n, 2, hidden_log=log)
                        for i, log in enumerate(logs)]
                return await client.propose(jobs)
        finally:
            await server.stop(None)

    blocks = run(main())
    assert len(blocks) == 3
    assert sum(servicer.requests) > MAX_MESSAGE_BYTES
    assert len(servicer.requests) == 3
    assert all(size <= PROPOSE_MESSAGE_BYTES for size in servicer.requests)
    assert [tuple(h.shape) for h in drafter.seen_hidden] == [(n - 1, width)] * 3
    for got, sent in zip(drafter.seen_hidden, logs, strict=True):
        assert torch.equal(got, sent.float())
