"""The coordinator's async client for a drafter worker (``specd.v1.Drafter`` over grpc.aio).

The client remembers, per request id, how many history tokens the worker holds and sends
only the rest. Whenever it cannot be sure what the worker holds (an RPC error, a timeout,
a cancelled call, a ``resync`` answer) it forgets the id, and the next call resends the
whole history, so a proposal is always the drafter's proposal for the true history.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import torch

from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd_core.draft import DraftBlock
from specd_core.request import FLOAT16_MAX

from . import wire
from .server import MAX_MESSAGE_BYTES, SECRET_METADATA_KEY, grpc_options
from .sessions import MAX_PARTITION_CHARS

if TYPE_CHECKING:  # annotation only: importing coordinator here would load the target model code
    from specd_core.sampling import SamplingParams

log = logging.getLogger(__name__)

_UINT64_MASK = (1 << 64) - 1

#: The most bytes one ProposeRequest carries (`DrafterClient` ``max_message_bytes``): half
#: gRPC's limit (`MAX_MESSAGE_BYTES`), so a message never nears it. A step's items are a few
#: KB; what exceeds this is a resend of long histories' hidden rows (a drafter restarted or
#: new to its requests resyncs all of them at once: SmolLM2 with 3 layers, 8192 positions x
#: 3 x 576 x 2 B = 28 MB each), which goes as several messages (`DrafterClient.propose`).
PROPOSE_MESSAGE_BYTES = MAX_MESSAGE_BYTES // 2

#: Seconds a Propose's deadline grows per hidden row it carries. A model drafter ingests
#: every row it is sent before it drafts, so a prompt's rows (or a resend's) take longer
#: than a step's: the EAGLE-3 head for SmolLM2 ingests a 4400-row prompt in ~0.7 s on one
#: CPU thread (~0.16 ms a row), beside a fixed 1 s deadline meant for a step of a few rows,
#: which it missed (before its fused attention, 2.5 s) and then, resent whole to each
#: replacement drafter, kept missing. 1 ms a row leaves ~6x for a busy machine or a larger
#: head, and a hung worker is still found within ``timeout_s`` on every ordinary step.
ROW_DEADLINE_S = 1e-3

#: Bytes an item's framing adds per appended token at most (a varint int32 token id).
_TOKEN_BYTES = 5
#: Bytes of an item's hidden tensor header (dtype, a 2-D shape), the length prefixes of its
#: fields and of the item in its request, at most.
_FRAME_BYTES = 64


@dataclass(frozen=True)
class ProposeJob:
    """One request's drafting job for one step.

    Attributes:
        request_id: the request's id; must be unique within one `DrafterClient.propose`.
        history: the full committed history, prompt first, last entry the pending anchor.
            Append-only between calls for the same id (call `DrafterClient.forget` before
            reusing an id for another history).
        max_len: the most draft tokens wanted, >= 0.
        hidden: float32 ``[rows, width]`` target hidden rows committed since this id's
            previous call (see `Drafter`; ``width`` is ``hidden_size``, or
            ``len(hidden_layers) * hidden_size`` for a drafter reading layers), or None;
            send only if the drafter wants it.
        sampling: the request's sampling parameters (temperature, top-k, top-p travel), or
            None to send none.
        seed: the request's seed (sent modulo 2**64, only together with ``sampling``).
        hidden_log: instead of ``hidden``: every committed hidden row of the request
            ``[len(history) - 1, width]`` (row i = history position i). The client
            sends the rows the worker lacks: those since its last call, or all of them when
            it resends the whole history (a new id, a resync, an error), so a drafter with
            per-request state never misses a row.
        ahead: a run-ahead job (`specd_core.draft.propose_ahead`): the block answered starts
            with the drafter's guess of the token committed after ``history + assumed``;
            ``max_len`` counts it.
        assumed: with ``ahead``, the block being verified now, after ``history``; the worker
            stores only ``history``.
        partition: the request's partition of the worker's cross-request state (an opaque
            string of at most `sessions.MAX_PARTITION_CHARS` characters: the coordinator's
            tenant and ``cache_salt``; "" shared): a suffix drafter drafts only from previous
            outputs remembered in it. Sent with every job, the same for every job of an id.
    """

    request_id: str
    history: Sequence[int]
    max_len: int
    hidden: torch.Tensor | None = None
    sampling: SamplingParams | None = None
    seed: int = 0
    hidden_log: torch.Tensor | None = None
    ahead: bool = False
    assumed: Sequence[int] = ()
    partition: str = ""

    def delta(self, known: int) -> tuple[int, Sequence[int], torch.Tensor | None]:
        """What to send a worker that holds ``known`` history tokens of this id:
        ``(known, tokens to append, hidden rows)``; ``known`` drops to 0 (a full resend) when
        it exceeds the history (the id was reused for a shorter one).

        Raises:
            ValueError: a ``hidden_log`` without one row per history position but the last.
        """
        if known > len(self.history):
            known = 0
        rows = self.hidden
        if self.hidden_log is not None:
            if self.hidden_log.shape[0] != len(self.history) - 1:
                raise ValueError(
                    f"request {self.request_id!r}: hidden_log has {self.hidden_log.shape[0]} "
                    f"rows for a {len(self.history)}-token history (expected one per "
                    "position but the last)")
            # Rows for the positions from the worker's anchor (known - 1) on.
            rows = self.hidden_log[max(known - 1, 0):]
        return known, self.history[known:], rows


def check_jobs(jobs: Sequence[ProposeJob]) -> list[str]:
    """The jobs' request ids, after checking one call may carry them.

    Raises:
        ValueError: a request id twice, a negative ``max_len``, or a partition that is not a
            str of at most `sessions.MAX_PARTITION_CHARS` characters.
    """
    ids = [job.request_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise ValueError("propose: a request id appears twice in one call")
    for job in jobs:
        if job.max_len < 0:
            raise ValueError(f"request {job.request_id!r}: max_len {job.max_len} < 0")
        if not isinstance(job.partition, str) or len(job.partition) > MAX_PARTITION_CHARS:
            raise ValueError(f"request {job.request_id!r}: partition must be a str of at "
                             f"most {MAX_PARTITION_CHARS} characters, got "
                             f"{type(job.partition).__name__} {str(job.partition)[:40]!r}")
    return ids


@dataclass(frozen=True)
class DrafterInfo:
    """What the worker serves: its drafter's type name, whether it uses hidden rows, its
    longest proposal (0 if it does not say), whether it keeps a cache across requests
    that wants finished outputs (`remember`), and which hidden rows it reads
    (`specd_core.draft.DrafterCapabilities.hidden_layers`: ``()`` the final-norm rows,
    else the target layers whose entering residual streams it reads, ascending)."""

    name: str
    wants_hidden: bool
    max_draft_len: int
    remembers_outputs: bool = False
    hidden_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class DrafterStats:
    """A worker's own counters since it started (the ``Stats`` RPC). The ``cache_*`` fields
    describe its cross-request cache (suffix decoding's global tree), when ``has_cache``:
    outputs and tokens held, tree nodes, approximate bytes, outputs evicted. ``proposals``:
    proposals made (one per request step drafted); ``global_hits``: those drafted from
    previous requests' outputs; ``cache_partitions``: partitions holding an output (their
    number only). All 0 for a drafter without a cache or counters."""

    has_cache: bool = False
    cache_outputs: int = 0
    cache_tokens: int = 0
    cache_nodes: int = 0
    cache_bytes: int = 0
    cache_evicted: int = 0
    proposals: int = 0
    global_hits: int = 0
    cache_partitions: int = 0

    @property
    def global_hit_rate(self) -> float:
        """Global hits per proposal (0 before any proposal)."""
        return self.global_hits / self.proposals if self.proposals else 0.0


class DrafterUnavailable(Exception):
    """The drafter worker did not answer (connection failure, deadline, server error) or
    answered malformed data."""


class DrafterClient:
    """Async client for one drafter worker.

    Not safe for concurrent `propose` calls that share request ids; distinct ids may be
    in flight concurrently.

    Args:
        address: the worker's ``host:port``.
        timeout_s: deadline of every RPC, in seconds (> 0).
        hidden_dtype: the wire dtype of hidden rows ("float32", "float16", "bfloat16").
        channel_credentials: ``grpc.ChannelCredentials`` for TLS, or None for plaintext.
        tls_server_name: the name to check the worker's certificate against instead of the
            address's host (``grpc.ssl_target_name_override``; `target_worker.tls`).
        secret: the worker's shared secret, sent as `SECRET_METADATA_KEY` metadata on every
            call; None sends none (a worker started without one).
        stream: send proposals over one persistent ``ProposeStream`` (a round trip costs
            ~0.15-0.2 ms on loopback here against ~0.45-0.5 ms per unary ``Propose``);
            False: a unary call each. The deadline is ``timeout_s`` per proposal either way,
            plus `ROW_DEADLINE_S` per hidden row the message carries (`deadline_s`).
        max_message_bytes: the most bytes one ``ProposeRequest`` carries (default
            `PROPOSE_MESSAGE_BYTES`); a call whose items exceed it goes as several requests,
            in order, each with its own deadline, and a single item above it (a long
            history's hidden rows resent) is split into items of the same id that continue
            each other, all but the last with ``max_len`` 0 (ingest only).

    Attributes:
        stats: ``{"calls": int, "errors": int, "latency_s": float}``: `propose` calls made,
            of which failed, and their summed wall time in seconds.

    Hidden rows travel in ``hidden_dtype``, except that a float16 wire sends a tensor
    holding a finite value beyond float16's range (65504: un-normed residual streams carry
    massive activations, up to ~28,000 on SmolLM2) as float32 rather than as inf.

    Raises:
        ValueError: a non-positive timeout or ``max_message_bytes``, or an unknown
            ``hidden_dtype``.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 1.0,
        hidden_dtype: str = "float32",
        channel_credentials: grpc.ChannelCredentials | None = None,
        secret: str | None = None,
        stream: bool = True,
        tls_server_name: str | None = None,
        max_message_bytes: int = PROPOSE_MESSAGE_BYTES,
    ):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or \
                not 0 < max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ValueError(f"max_message_bytes must be an int in [1, {MAX_MESSAGE_BYTES}], "
                             f"got {max_message_bytes!r}")
        self.max_message_bytes = max_message_bytes
        if hidden_dtype not in wire.DTYPES:
            raise ValueError(
                f"unknown hidden_dtype {hidden_dtype!r}; expected one of {', '.join(wire.DTYPES)}"
            )
        self.address = address
        self.timeout_s = float(timeout_s)
        self.hidden_dtype = hidden_dtype
        self._credentials = channel_credentials
        self._tls_server_name = tls_server_name
        self._metadata = None if secret is None else ((SECRET_METADATA_KEY, secret),)
        self._channel: grpc.aio.Channel | None = None
        self._stub: drafter_pb2_grpc.DrafterStub | None = None
        # request id -> number of history tokens the worker holds for it.
        self._known: dict[str, int] = {}
        self.stats: dict = {"calls": 0, "errors": 0, "latency_s": 0.0}
        self.stream = stream
        self._stream = None
        self._stream_lock: asyncio.Lock | None = None

    def _get_stub(self) -> drafter_pb2_grpc.DrafterStub:
        # Created on first use, inside the event loop that will drive it.
        if self._stub is None:
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=grpc_options())
            else:
                options = grpc_options()
                if self._tls_server_name is not None:
                    options.append(("grpc.ssl_target_name_override", self._tls_server_name))
                self._channel = grpc.aio.secure_channel(
                    self.address, self._credentials, options=options
                )
            self._stub = drafter_pb2_grpc.DrafterStub(self._channel)
        return self._stub

    def known(self, request_id: str) -> int:
        """How many history tokens the client believes the worker holds for the id."""
        return self._known.get(request_id, 0)

    def forget(self, request_id: str) -> None:
        """Local only: the id's next `propose` sends its whole history."""
        self._known.pop(request_id, None)

    async def info(self) -> DrafterInfo:
        """The worker's `DrafterInfo`.

        Raises:
            DrafterUnavailable: the RPC failed or timed out.
        """
        try:
            reply = await self._get_stub().Info(drafter_pb2.InfoRequest(), timeout=self.timeout_s,
                                                metadata=self._metadata)
        except grpc.RpcError as e:
            raise DrafterUnavailable(f"drafter {self.address}: Info failed: {_describe(e)}") from e
        return DrafterInfo(reply.name, reply.wants_hidden, reply.max_draft_len,
                           reply.remembers_outputs, tuple(reply.hidden_layers))

    async def drafter_stats(self) -> DrafterStats:
        """The worker's `DrafterStats` (its drafter's counters and cache size).

        Raises:
            DrafterUnavailable: the RPC failed or timed out (UNIMPLEMENTED from a worker
                older than the ``Stats`` RPC).
        """
        try:
            reply = await self._get_stub().Stats(drafter_pb2.StatsRequest(),
                                                 timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise DrafterUnavailable(f"drafter {self.address}: Stats failed: {_describe(e)}"
                                     ) from e
        return DrafterStats(reply.has_cache, reply.cache_outputs, reply.cache_tokens,
                            reply.cache_nodes, reply.cache_bytes, reply.cache_evicted,
                            reply.proposals, reply.global_hits, reply.cache_partitions)

    def _items(self, job: ProposeJob) -> list[drafter_pb2.ProposeItem]:
        """``job`` as the items to send: one, or, when its hidden rows would make it larger
        than ``max_message_bytes``, consecutive items of its id that each continue the last
        (see the class), so the worker ingests exactly what one item would give it."""
        known, append, rows = job.delta(self._known.get(job.request_id, 0))
        item = self._item(job, known, append, rows)
        end = known + len(append)
        if rows is None or item.ByteSize() <= self.max_message_bytes or len(append) < 2 or \
                rows.shape[0] != len(append) - (known == 0):
            return [item]
        # Tokens per item: what fits beside the item's other fields (and _FRAME_BYTES of the
        # hidden tensor's dtype and shape, the length prefixes, the request's framing).
        fixed = self._item(job, known, (), None).ByteSize() + _FRAME_BYTES
        per_token = len(item.hidden.data) // max(1, rows.shape[0]) + _TOKEN_BYTES
        step = max(1, (self.max_message_bytes - fixed) // per_token)
        base = max(known - 1, 0)  # the position of rows[0]
        items = []
        for lo in range(known, end, step):
            hi = min(lo + step, end)
            last = hi == end
            part = rows[max(lo - 1, 0) - base: hi - 1 - base]
            items.append(self._item(job, lo, job.history[lo:hi], part,
                                    max_len=job.max_len if last else 0, ahead=last))
        return items

    def _item(self, job: ProposeJob, known: int, append: Sequence[int],
              rows: torch.Tensor | None, max_len: int | None = None,
              ahead: bool = True) -> drafter_pb2.ProposeItem:
        """One item of ``job``: ``append`` after ``known`` held tokens with ``rows``;
        ``max_len`` (default the job's) and the run-ahead fields only when ``ahead``."""
        run_ahead = job.ahead and ahead
        item = drafter_pb2.ProposeItem(
            request_id=job.request_id,
            known=known,
            append=[int(t) for t in append],
            max_len=job.max_len if max_len is None else max_len,
            ahead=run_ahead,
            assumed=[int(t) for t in job.assumed] if run_ahead else (),
            partition=job.partition,
        )
        if rows is not None:
            item.hidden.CopyFrom(wire.tensor_to_proto(rows, self._wire_dtype(rows)))
        if job.sampling is not None:
            item.sampling.CopyFrom(
                drafter_pb2.DraftSampling(
                    temperature=job.sampling.temperature,
                    top_k=job.sampling.top_k,
                    top_p=job.sampling.top_p,
                    seed=job.seed & _UINT64_MASK,
                )
            )
        return item

    def _wire_dtype(self, rows: torch.Tensor) -> str:
        """``hidden_dtype``, or float32 for rows a float16 wire cannot hold (a finite value
        beyond 65504; rows already float16 always fit)."""
        if self.hidden_dtype != "float16" or rows.dtype == torch.float16 or not rows.numel():
            return self.hidden_dtype
        peak = float(rows.abs().amax())
        return "float32" if FLOAT16_MAX < peak < math.inf else "float16"

    async def propose(self, jobs: Sequence[ProposeJob]) -> list[DraftBlock]:
        """One draft block per job, in order, each at most ``job.max_len`` long.

        A job the worker answers with ``resync`` (its view of the history was not what this
        client assumed) gets an empty block; its next call resends the whole history.

        Raises:
            ValueError: a negative ``max_len``, a repeated request id, a token id outside
                int32, or bad hidden rows; nothing is sent and no state changes.
            DrafterUnavailable: the RPC failed, timed out, or answered the wrong number of
                results. Every job's id is forgotten (the worker may or may not have
                applied the call).
        """
        if not jobs:
            return []
        ids = check_jobs(jobs)
        parts = [self._items(job) for job in jobs]
        requests = self._pack([item for items in parts for item in items])
        # Forget first: a call that fails or is cancelled anywhere below leaves the ids
        # unknown, so their next call resends everything.
        for rid in ids:
            self._known.pop(rid, None)
        self.stats["calls"] += 1
        start = time.perf_counter()
        replies = []
        try:
            for request in requests:  # in order: a later item may continue an earlier one
                if self.stream:
                    reply = await self._over_stream(request)
                else:
                    reply = await self._get_stub().Propose(
                        request, timeout=self.deadline_s(request), metadata=self._metadata)
                replies.append(reply)
                if len(reply.results) != len(request.items):
                    break
        except (grpc.RpcError, DrafterUnavailable) as e:
            self.stats["errors"] += 1
            raise DrafterUnavailable(
                f"drafter {self.address}: Propose failed: {_describe(e)}"
            ) from e
        finally:
            self.stats["latency_s"] += time.perf_counter() - start
        results = []
        for request, reply in zip(requests, replies, strict=False):
            if len(reply.results) != len(request.items):
                self.stats["errors"] += 1
                raise DrafterUnavailable(f"drafter {self.address}: {len(reply.results)} "
                                         f"results for {len(request.items)} jobs")
            results.extend(reply.results)
        blocks, at = [], 0
        for job, items in zip(jobs, parts, strict=True):
            mine, at = results[at:at + len(items)], at + len(items)
            result = mine[-1]
            if any(r.resync for r in mine):
                blocks.append(DraftBlock.empty())
                continue
            self._known[job.request_id] = len(job.history)
            try:
                block = wire.block_from_proto(result.block)
            except ValueError:
                # The worker's view is intact; only this proposal is unusable.
                log.exception("drafter %s: malformed block for request %r", self.address,
                              job.request_id)
                block = DraftBlock.empty()
            if len(block) > job.max_len:
                block.truncate(job.max_len)
            blocks.append(block)
        return blocks

    def _pack(self, items: list[drafter_pb2.ProposeItem]) -> list[drafter_pb2.ProposeRequest]:
        """``items`` in order, as few ``ProposeRequest`` s as keep each within
        ``max_message_bytes`` (an item larger than that alone goes alone)."""
        requests, current, size = [], [], 0
        for item in items:
            n = item.ByteSize() + 6  # the item's tag and length prefix in its request
            if current and size + n > self.max_message_bytes:
                requests.append(drafter_pb2.ProposeRequest(items=current))
                current, size = [], 0
            current.append(item)
            size += n
        requests.append(drafter_pb2.ProposeRequest(items=current))
        return requests

    def deadline_s(self, request: drafter_pb2.ProposeRequest) -> float:
        """Seconds ``request`` may take: ``timeout_s`` plus `ROW_DEADLINE_S` per hidden row
        its items carry (the rows the worker must ingest before it drafts)."""
        rows = sum(item.hidden.shape[0] for item in request.items
                   if item.HasField("hidden") and item.hidden.shape)
        return self.timeout_s + ROW_DEADLINE_S * rows

    async def _over_stream(self, request: drafter_pb2.ProposeRequest
                           ) -> drafter_pb2.ProposeResponse:
        """One request/response on the persistent ``ProposeStream``, opened on first use.
        A stream that fails is cancelled and dropped, so a late answer can never be read as
        another call's. A stream that had worked and fails (a restarted worker) is retried
        once on a new one: safe, since a proposal applied twice only asks for a resync.

        Raises:
            DrafterUnavailable: no answer within `deadline_s` (DEADLINE_EXCEEDED), or the
                stream failed (the gRPC status named).
        """
        if self._stream_lock is None:
            self._stream_lock = asyncio.Lock()
        deadline = self.deadline_s(request)
        async with self._stream_lock:
            try:
                async with asyncio.timeout(deadline):
                    for attempt in range(2):
                        fresh = self._stream is None or self._stream.done()
                        if fresh:
                            self._stream = self._get_stub().ProposeStream(
                                metadata=self._metadata)
                        stream = self._stream
                        try:
                            await stream.write(request)
                            reply = await stream.read()
                        except (grpc.RpcError, grpc.aio.UsageError,
                                asyncio.InvalidStateError) as e:
                            self._drop_stream()
                            if fresh or attempt:
                                raise DrafterUnavailable(_describe(e)) from e
                            continue
                        if reply is grpc.aio.EOF:
                            self._drop_stream()
                            if fresh or attempt:
                                raise DrafterUnavailable("the stream ended")
                            continue
                        return reply
            except TimeoutError as e:
                self._drop_stream()
                raise DrafterUnavailable(
                    f"DEADLINE_EXCEEDED: no answer within {deadline:.3g} s") from e
            except asyncio.CancelledError:
                self._drop_stream()
                raise
        raise DrafterUnavailable("the stream ended")  # pragma: no cover - loop returns

    def _drop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream.cancel()

    async def release(self, request_ids: Sequence[str]) -> None:
        """Tells the worker to forget the ids (and forgets them locally). Best effort: errors
        are logged, never raised."""
        if not request_ids:
            return
        for rid in request_ids:
            self._known.pop(rid, None)
        try:
            await self._get_stub().Release(
                drafter_pb2.ReleaseRequest(request_ids=list(request_ids)), timeout=self.timeout_s,
                metadata=self._metadata)
        except Exception as e:  # best effort: a lost release only leaks worker memory
            log.warning("drafter %s: Release failed: %s", self.address, _describe(e))

    async def remember(self, outputs: Sequence[Sequence[int]],
                       partitions: Sequence[str] | None = None) -> None:
        """Sends finished requests' outputs (token ids, each after its prompt's last tokens)
        to the worker's cross-request cache (a ``Release`` with ``outputs`` and no ids),
        output ``i`` for partition ``partitions[i]`` (None: all shared, ""). Best effort:
        errors are logged, never raised (a lost output only costs drafts).

        Raises:
            ValueError: ``partitions`` not one per output (nothing is sent).
        """
        if partitions is None:
            partitions = [""] * len(outputs)
        elif len(partitions) != len(outputs):
            raise ValueError(f"remember: {len(partitions)} partitions for {len(outputs)} "
                             "outputs (one each)")
        if not outputs:
            return
        request = drafter_pb2.ReleaseRequest(outputs=[
            drafter_pb2.TokenSequence(tokens=[int(t) for t in out], partition=str(partition))
            for out, partition in zip(outputs, partitions, strict=True)])
        try:
            await self._get_stub().Release(request, timeout=self.timeout_s,
                                           metadata=self._metadata)
        except Exception as e:
            log.warning("drafter %s: Release (outputs) failed: %s", self.address, _describe(e))

    async def close(self) -> None:
        """Closes the channel; a later call opens a new one."""
        self._drop_stream()
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> DrafterClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, DrafterUnavailable):
        return str(e)
    return repr(e)
