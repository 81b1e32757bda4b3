"""Multi-process tensor-parallel runs without Ray: ``torch.multiprocessing`` spawns one process
per rank, joined by a gloo group over a file store; rank 0 saves what it computed.

`engine_script` is the workload: raw packed forwards, then prefill + verify + rollback steps
through a `TargetEngine`, greedy and sampling slots side by side. Run it on a plain `Decoder`
for the reference. `RayTarget` puts a Ray-actor replica behind the scheduler's `Target` interface.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from specd_core.rule import GreedyRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem
from target_worker.engine import TargetEngine
from target_worker.sharded import (
    SafetensorsSource,
    ShardedDecoder,
    StateDictSource,
    rank_parameter_counts,
)
from target_worker.testing import load_tiny_random, tiny_random_config

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8)


def _shared(value, decoder):
    """Rank 0's ``value`` on every rank (a plain or tp=1 decoder: itself)."""
    if getattr(decoder, "tp", 1) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def engine_script(decoder, vocab: int, steps: int = 8) -> dict:
    """Rank 0's (or a plain decoder's) results; other ranks make the same calls and get Nones.

    Slot 0 decodes greedily with speculative verification: each step verifies
    ``[anchor, *draft]`` (draft: the last 3 generated tokens, some of which the model accepts
    on these repetitive tiny models), keeps the accepted prefix, rolls the slot back to the
    committed length and continues from the target's token. Rank 0 decides and broadcasts,
    as the coordinator would. Slot 1 samples (full probability rows) in the same batches.
    """
    out: dict = {}
    a, b = [3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]
    ca, cb = decoder.new_cache(), decoder.new_cache()
    first = decoder.forward_packed([(a, 0, ca), (b, 0, cb)])
    second = decoder.forward_packed([(a[:5], 8, ca), ([8], 3, cb)])
    out["logits"] = [lg for lg, _ in first + second]
    out["hidden"] = [h.clone() for _, h in first + second]
    out["cache_kv_heads"] = ca.n_kv_heads

    engine = TargetEngine(decoder, max_slots=4)
    s0, s1 = engine.allocate(), engine.allocate()
    prompt = [5, 6, 7, 8, 5, 6]
    pre = engine.prefill([PrefillItem(s0, prompt, GREEDY, want_hidden=True),
                          PrefillItem(s1, [9, 10, 11], SAMPLED)])
    out["prefill"] = pre
    anchor = _shared(pre[0].rows.argmax[0] if pre[0] is not None else None, decoder)
    generated, pos, len1, verify_out, accepted = [], len(prompt), 3, [], 0
    for step in range(steps):
        draft = (generated[-3:] + [1, 2, 3])[:3]
        items = [VerifyItem(s0, pos, [anchor, *draft], GREEDY, want_hidden=step % 2 == 0),
                 VerifyItem(s1, len1, [(11 * step + 1) % vocab, step % vocab], SAMPLED)]
        res = engine.verify(items)
        verify_out.append(res)
        decision = None
        if res[0] is not None:
            best = res[0].rows.argmax
            k = 0
            while k < len(draft) and draft[k] == best[k]:
                k += 1
            decision = (k, best[k])
        k, next_anchor = _shared(decision, decoder)
        accepted += k
        generated += [anchor, *draft[:k]]
        pos += 1 + k
        engine.rollback(s0, pos)  # drop the rejected draft positions
        len1 += 1
        engine.rollback(s1, len1)
        anchor = next_anchor
    out["verify"] = verify_out
    out["greedy_tokens"] = generated + [anchor]
    out["accepted"] = accepted
    # Chunked prefill: a prompt in two chunks of unequal length, the
    # second beside a verify block; then the same prompt again, reusing the warm slot.
    long = [(7 * i + 2) % vocab for i in range(80)]
    s2 = engine.allocate()
    chunked = [engine.step([PrefillItem(s2, long[:70], GREEDY, want_hidden=True, last=False)]),
               engine.step([PrefillItem(s2, long[70:], GREEDY, want_hidden=True, offset=70),
                            VerifyItem(s1, len1, [1, 2], SAMPLED)])]
    engine.free(s2)
    s2, reused = engine.allocate_prefix(long)
    chunked.append(engine.step([PrefillItem(s2, long[reused:], GREEDY, offset=reused)]))
    out["chunked"], out["reused"] = chunked, reused
    # Hidden layers (EAGLE-3's capture): every rank's engine captures what the items ask.
    layers = tuple(sorted({0, 1, decoder.config.n_layers}))
    s3 = engine.allocate()
    out["capture_layers"] = layers
    out["captured"] = [
        engine.step([PrefillItem(s3, a, GREEDY, want_hidden=True, hidden_layers=layers)]),
        engine.step([VerifyItem(s3, len(a), [1, 2], GREEDY, want_hidden=True,
                                hidden_layers=layers),
                     VerifyItem(s1, len1 + 1, [3], SAMPLED)])]
    engine.free(s0)
    engine.free(s1)
    engine.free(s2)
    engine.free(s3)
    return out


def rows_of(output):
    """Comparable form of a StepOutput's rows: argmax tuple or float probs tensor."""
    rows = output.rows
    if isinstance(rows, GreedyRows):
        return rows.argmax
    return rows.probs if hasattr(rows, "probs") and rows.probs.dim() == 2 else rows.to_dense()


def _rank_main(rank, tp, store, spec, weights, vocab_parallel, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=tp)
    try:
        if spec is not None and Path(spec).is_dir():  # a HF checkpoint: the production reader
            from target_worker.tp import load_shard

            shard = load_shard(spec, rank, tp, vocab_parallel=vocab_parallel)
            config = shard.config
            result = engine_script(shard, config.vocab_size)
            result["param_counts"] = rank_parameter_counts(shard)
            torch.save(result, Path(out_dir) / f"rank{rank}.pt")
            return
        config, _ = tiny_random_config(spec) if weights is None else (None, None)
        if weights is None:
            source = StateDictSource(load_tiny_random(spec)[0].state_dict())
        else:
            from target_worker.disk_cache import safetensors_config

            config, source = safetensors_config(weights), SafetensorsSource(weights)
        shard = ShardedDecoder.load(config, source, rank, tp, vocab_parallel=vocab_parallel)
        del source
        result = engine_script(shard, config.vocab_size)
        result["param_counts"] = rank_parameter_counts(shard)
        result["comm_bytes"] = shard.comm_bytes
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_tp(tp: int, spec: str, out_dir: str | os.PathLike, weights: str | None = None,
           vocab_parallel: bool = True, timeout_s: float = 300.0) -> list[dict]:
    """Runs `engine_script` on ``tp`` gloo ranks; returns every rank's saved results."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    store = out_dir / "store"
    store.unlink(missing_ok=True)  # a stale file store would hang the rendezvous
    # fork: the children inherit the imported torch (a spawn re-imports it, ~5-8 s per rank
    # on this machine); each child sets one intra-op thread before any parallel work.
    context = mp.start_processes(
        _rank_main, args=(tp, str(store), spec, weights, vocab_parallel, str(out_dir)),
        nprocs=tp, join=False, start_method="fork")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            raise TimeoutError(f"tensor-parallel ranks did not finish within {timeout_s} s")
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(tp)]


class RayTarget:
    """A `target_worker.actor.TargetActor` Ray actor handle behind the `Target` interface."""

    def __init__(self, handle):
        self.handle = handle

    async def allocate(self) -> int:
        return await self.handle.allocate.remote()

    async def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        return tuple(await self.handle.allocate_prefix.remote(tokens, partition))

    async def free(self, slot: int) -> None:
        await self.handle.free.remote(slot)

    async def prefill(self, items: list) -> list:
        return await self.handle.prefill.remote(items)

    async def verify(self, items: list) -> list:
        return await self.handle.verify.remote(items)
