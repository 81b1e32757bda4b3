"""CUDA graphs of the target's decode and verify steps, one per padded row bucket.

A small model on a big GPU is launch-bound: SmolLM2-135M's step is ~1,000 kernel launches
against ~0.06 ms of weight reads on an H200. Replaying a captured CUDA graph launches them
all at once (nano-vllm captures decode per batch bucket; gpt-fast decode at 1 row and verify
at k + 1 separately). Here one sequence's step of ``m`` tokens runs as the graph of its row
bucket ``R >= m`` (`row_bucket`; the rows after ``m`` are padding whose results are dropped)
and its key-block bucket ``J`` (`block_bucket`: a power of two of `KEY_BLOCK` blocks at
least the step's last position needs): every shape inside is then fixed, and the step's
token ids and first position live in device buffers the replay reads.

The captured forward (`static_forward`) is the decoder's own layers, fed device-side
positions: RoPE rows gathered from the tables, keys and values written at those positions
(`KvCache.write_at`), attention over ``J`` whole blocks with the keys after each row masked.
Every row's logits are then bitwise those of the eager forward of the ``m`` tokens when the
decoder is batch invariant (`Decoder.make_batch_invariant`): the padded rows change no other
row (the planned kernels are row-invariant over the padded call sizes), and the blocks past
the last position add exact zeros to the attention sums (`_tree_sum`), which needs finite
values there: the graph's cache starts zeroed. `scripts/gpu_check.py` checks replay against
eager bitwise on the device; on the CPU `GraphedDecoder` runs `static_forward` eagerly
(``capture=False``), which the tests compare with the decoder's forward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import QueryChunk, Rows, Segment
from .kv_cache import KEY_BLOCK, KvCache

__all__ = ["GRAPH_ROWS", "GraphedDecoder", "block_bucket", "graphable", "row_bucket",
           "static_forward"]

#: Row buckets captured by default: every step of up to 16 drafts plus the anchor.
GRAPH_ROWS = tuple(range(1, 18))


def row_bucket(m: int, buckets: Sequence[int] = GRAPH_ROWS) -> int | None:
    """The least of ``buckets`` at least ``m`` (a step of ``m >= 1`` tokens runs padded to
    it), or None when ``m`` is above them all (the step runs eagerly).

    Raises:
        ValueError: ``m < 1``.
    """
    if m < 1:
        raise ValueError(f"a step feeds at least one token, got {m}")
    fits = [b for b in buckets if b >= m]
    return min(fits) if fits else None


def block_bucket(end: int, capacity: int) -> int:
    """Key blocks a graph reads for a step whose last position is ``end - 1``: the least
    power of two of `KEY_BLOCK` blocks holding ``end`` positions, at most the cache's
    ``capacity // KEY_BLOCK`` blocks (graphs then number ``log2`` of the context, not one
    per block).

    Raises:
        ValueError: ``end`` outside ``[1, capacity]``.
    """
    if not 1 <= end <= capacity:
        raise ValueError(f"end must be in [1, capacity={capacity}], got {end}")
    need = -(-end // KEY_BLOCK)
    return min(1 << (need - 1).bit_length(), capacity // KEY_BLOCK)


def graphable(decoder) -> str | None:
    """Why ``decoder``'s steps cannot run as `static_forward` (None: they can): mixture of
    experts (its routing reads token counts on the host), a tensor-parallel shard (its
    all-reduces), the native CPU forward, or no batch-invariant attention plans."""
    from .model import Decoder

    if type(decoder) is not Decoder:
        return f"{type(decoder).__name__} is not a plain Decoder"
    if decoder.config.moe is not None:
        return "mixture-of-experts routing syncs with the host"
    if decoder._native_wanted:
        return "the native forward runs on the CPU"
    if decoder._attention_plans is None:
        return "not batch invariant (make_batch_invariant first)"
    return None


def static_forward(decoder, tokens: torch.Tensor, positions: torch.Tensor, cache: KvCache,
                   blocks: int) -> torch.Tensor:
    """Logits of one sequence's ``R`` rows, every shape fixed by ``(R, blocks)``: what a CUDA
    graph captures.

    Args:
        decoder: a `graphable` decoder.
        tokens: long ``[R]`` on the decoder's device.
        positions: long ``[R]``, distinct, on the device: the rows' absolute positions; each
            row attends to the cache's keys at positions up to its own.
        cache: written at ``positions`` (its ``seq_len`` is the caller's to set).
        blocks: key blocks read; every row's position must be below ``blocks *
            KEY_BLOCK`` for its result to be meaningful (padding rows may lie beyond).

    Returns:
        float32 logits ``[R, vocab_size]`` on the device.
    """
    rows_n = tokens.shape[0]
    plans = decoder._attention_plans
    group = decoder.config.n_heads // decoder.config.n_kv_heads
    folded = group * rows_n
    padded = plans.padded_rows(folded)
    # Row r of the folded layout is token r % R; the padded rows see what the last one sees.
    q_pos = torch.cat([positions.repeat(group), positions[-1:].expand(padded - folded)])
    keys = torch.arange(blocks * KEY_BLOCK, device=tokens.device)
    masked = keys.view(-1, 1, 1, KEY_BLOCK) > q_pos[None, None, :, None]
    chunk = QueryChunk(0, rows_n, 0, blocks, padded, masked)
    segment = Segment(0, rows_n, 0, cache, [chunk], positions)
    rows = Rows(decoder._cos[positions][:, None, :], decoder._sin[positions][:, None, :],
                [segment], plans)
    x = decoder.embed_tokens(tokens)
    for i, layer in enumerate(decoder.layers):
        x = layer(x, i, rows)
    return decoder._logits(decoder.norm(x))


class GraphedDecoder:
    """One sequence over ``decoder``, its decode and verify steps replayed from CUDA graphs.

    Owns a zeroed `KvCache` of fixed ``capacity`` (its tensors never move, as the graphs
    read them in place). `prefill` runs the decoder's eager forward; `step` feeds ``m``
    tokens at the cache's end through the graph of ``(row_bucket(m), block_bucket(end))``,
    capturing it at first use (all graphs share one memory pool), or eagerly when ``m`` is
    above every bucket or the padded rows would pass the capacity.

    Args:
        decoder: a `graphable` decoder (batch invariant; on CUDA to capture).
        capacity: the cache's positions (default the model's context), whole key blocks.
        buckets: the row buckets (`row_bucket`).
        capture: capture and replay graphs (needs CUDA); False runs `static_forward`
            eagerly, the same arithmetic, for the CPU and for graph-vs-eager checks.

    Raises:
        ValueError: the decoder is not `graphable`, or ``capture`` off CUDA.
    """

    def __init__(self, decoder, capacity: int | None = None,
                 buckets: Sequence[int] = GRAPH_ROWS, capture: bool = True) -> None:
        why = graphable(decoder)
        if why is not None:
            raise ValueError(f"decoder steps cannot be graphed: {why}")
        if capture and decoder.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA decoder, this one is on {decoder.device}")
        c = decoder.config
        capacity = c.max_seq_len if capacity is None else capacity
        capacity = min(-(-capacity // KEY_BLOCK) * KEY_BLOCK, c.max_seq_len)
        self.decoder, self.buckets, self.capture = decoder, tuple(sorted(buckets)), capture
        self.cache = decoder.new_cache(capacity)
        with torch.inference_mode():
            self.cache.k.zero_()  # blocks past a step's end must hold finite values
            self.cache.v.zero_()
        device = decoder.device
        self._tokens = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        self._start = torch.zeros((), dtype=torch.long, device=device)
        self._offsets = torch.arange(self.buckets[-1], device=device)
        decoder._rope(0, self.cache.capacity)  # the tables, built before any capture
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def graph_keys(self) -> list[tuple[int, int]]:
        """``(rows, blocks)`` of every graph captured so far."""
        return sorted(self._graphs)

    def prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feeds ``tokens`` at the cache's end eagerly; float32 logits ``[n, vocab]``.

        Raises:
            ValueError: as `Decoder.forward_batch`, or past the cache's capacity.
        """
        self._check_room(len(tokens))
        return self.decoder.forward_batch(tokens, self.cache.seq_len, self.cache)

    def _check_room(self, n: int) -> None:
        # The cache never grows: the graphs read its tensors where they are.
        if self.cache.seq_len + n > self.cache.capacity:
            raise ValueError(f"{self.cache.seq_len} + {n} positions exceed the graphed "
                             f"cache's capacity of {self.cache.capacity}")

    def rollback(self, length: int) -> None:
        """Keeps the cache's first ``length`` positions (`KvCache.truncate`)."""
        self.cache.truncate(length)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Feeds ``tokens`` (a decode step or a verify block) at the cache's end.

        Returns:
            float32 logits ``[m, vocab]`` on the device: a view of the graph's output
            buffer, overwritten by the next step of its bucket (clone to keep it).

        Raises:
            ValueError: as `Decoder.forward_batch`, or past the cache's capacity (checked
                before anything runs).
        """
        m, start = len(tokens), self.cache.seq_len
        idx = self.decoder._check_segment(tokens, start, self.cache)
        self._check_room(m)
        rows = row_bucket(m, self.buckets)
        if rows is None or start + rows > self.cache.capacity:
            return self.decoder.forward_batch(idx, start, self.cache)
        blocks = block_bucket(start + m, self.cache.capacity)
        self._tokens[:m].copy_(idx, non_blocking=True)
        self._tokens[m:rows].fill_(idx[-1])  # padding: any valid id
        self._start.fill_(start)
        if not self.capture:
            out = self._body(rows, blocks)
        else:
            graph, out = self._graphs.get((rows, blocks)) or self._capture(rows, blocks)
            graph.replay()
        self.cache._seq_len = start + m
        return out[:m]

    def _body(self, rows: int, blocks: int) -> torch.Tensor:
        positions = self._start + self._offsets[:rows]
        return static_forward(self.decoder, self._tokens[:rows], positions, self.cache, blocks)

    def _capture(self, rows: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm-up on a side stream first (lazy initialisations must not be captured); it
        # writes this very step's keys and values, which the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._body(rows, blocks)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._body(rows, blocks)
        self._pool = graph.pool()
        self._graphs[(rows, blocks)] = (graph, out)
        return graph, out
