"""The engine's warm prefix cache under traffic (`TargetEngine.allocate_prefix` / `free`): a
request sharing only an opening copies it out and leaves the long entry warm (the issue's
fragility case: 190 reused positions, not 2), a copy is bitwise the source and never changes
it (every dtype), partitions never see each other's entries, a freed slot replaces the entry
it extends, and eviction by recency keeps the warm positions within their bound."""

from __future__ import annotations

import pytest
import torch
from drafters import tiny_decoder

from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem
from target_worker.engine import TargetEngine
from target_worker.model import KEY_BLOCK, KvCache

GREEDY = SamplingParams()
OPENING = [1, 2, 3]  # what every request shares (a chat template's opening)
X = OPENING + [(7 * i + 5) % 60 + 4 for i in range(188)]  # 191 tokens


def prefilled(engine: TargetEngine, tokens: list[int], partition: str = "") -> tuple[int, int]:
    """Allocates ``tokens`` in ``partition`` and computes what was not reused."""
    slot, reused = engine.allocate_prefix(tokens, partition)
    engine.step([PrefillItem(slot=slot, tokens=tokens[reused:], sampling=GREEDY,
                             offset=reused)])
    return slot, reused


def kv(engine: TargetEngine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of the warm entry holding exactly ``tokens``."""
    (warm,) = [w for w in engine._warm.values() if w.tokens == tokens]
    return warm.cache.keys(), warm.cache.values()


def test_a_request_sharing_only_the_opening_leaves_the_long_entry_for_its_owner():
    engine = TargetEngine(tiny_decoder(64), max_slots=2)
    slot, _ = prefilled(engine, X)
    engine.free(slot)  # warm: X's 191 positions
    # Y shares three tokens: it gets a copy of them, X's entry stays whole.
    y = OPENING + [60, 61, 62, 63]
    slot, reused = prefilled(engine, y)
    assert reused == len(OPENING) and engine.stats["prefix_copies"] == 1
    engine.free(slot)
    # X's next turn reuses all it computed (the old engine: 3, Y had cut the entry down).
    slot, reused = engine.allocate_prefix(X + [9, 9, 9])
    assert reused == len(X) == 191
    assert engine.stats["prefix_hits"] == 2
    assert engine.stats["prefix_hit_tokens"] == len(OPENING) + len(X)
    engine.free(slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_copy_is_bitwise_the_shared_span_and_never_changes_the_warm_entry(dtype):
    engine = TargetEngine(tiny_decoder(64).to(dtype), max_slots=2)
    slot, _ = prefilled(engine, X)
    engine.free(slot)
    keys, values = (t.clone() for t in kv(engine, X))
    assert keys.dtype == dtype
    y = X[:50] + [60, 61] * 20
    slot, reused = prefilled(engine, y)  # writes 40 positions after the copied 50
    assert reused == 50
    copy = engine._slots[slot].cache
    assert copy.k.dtype == dtype and copy.seq_len == len(y)
    assert torch.equal(copy.keys(0, 50), keys[:, :, :50])
    assert torch.equal(copy.values(0, 50), values[:, :, :50])
    after_k, after_v = kv(engine, X)
    assert torch.equal(after_k, keys) and torch.equal(after_v, values)  # bitwise unchanged
    engine.free(slot)
    assert torch.equal(kv(engine, X)[0], keys)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_prefix_copy_spans_blocks_and_keeps_dtype_and_device(dtype):
    cache = KvCache(2, 2, 4, 2 * KEY_BLOCK, 4 * KEY_BLOCK, dtype=dtype)
    n = KEY_BLOCK + 44
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # as a forward writes it
        for layer in range(2):
            cache.write(layer, 0, torch.randn(n, 2, 4, generator=gen).to(dtype),
                        torch.randn(n, 2, 4, generator=gen).to(dtype))
    cache.advance(n)
    keys, values = cache.keys(), cache.values()
    copy = cache.prefix_copy(KEY_BLOCK + 3)
    assert copy.seq_len == KEY_BLOCK + 3 and copy.capacity == cache.capacity
    assert copy.k.dtype == dtype and copy.k.device == cache.k.device
    assert torch.equal(copy.keys(), keys[:, :, :KEY_BLOCK + 3])
    assert torch.equal(copy.values(), values[:, :, :KEY_BLOCK + 3])
    with torch.inference_mode():
        copy.write(0, 0, torch.zeros(KEY_BLOCK + 3, 2, 4, dtype=dtype),
                   torch.zeros(KEY_BLOCK + 3, 2, 4, dtype=dtype))
    assert torch.equal(cache.keys(), keys)  # its own storage
    assert cache.position_bytes == 2 * 2 * 2 * 4 * keys.element_size()
    with pytest.raises(ValueError, match="prefix_copy length"):
        cache.prefix_copy(n + 1)
    with pytest.raises(ValueError, match="capacity"):
        cache.prefix_copy(10, capacity=5)


def test_an_entry_in_one_partition_is_never_reused_by_another():
    engine = TargetEngine(tiny_decoder(64), max_slots=2)
    slot, _ = prefilled(engine, X, partition="a")
    engine.free(slot)
    assert engine.warm_entries() == [("a", X)]
    for partition in ("b", "", "a "):
        slot, reused = engine.allocate_prefix(X + [5], partition)
        assert reused == 0, partition
        engine.free(slot)
    slot, reused = engine.allocate_prefix(X + [5], "a")
    assert reused == len(X)
    engine.free(slot)
    # A plain slot goes warm in the partition it was allocated in, too.
    z = [50] * 20
    slot = engine.allocate("b")
    engine.step([PrefillItem(slot=slot, tokens=z, sampling=GREEDY)])
    engine.free(slot)
    assert ("b", z) in engine.warm_entries()
    slot, reused = engine.allocate_prefix(z + [4], "a")
    assert reused == 0
    engine.free(slot)
    slot, reused = engine.allocate_prefix(z + [4], "b")
    assert reused == 20
    engine.free(slot)
    with pytest.raises(TypeError, match="partition"):
        engine.allocate_prefix(X, None)
    with pytest.raises(TypeError, match="partition"):
        engine.allocate(3)


def test_memory_goes_to_distinct_content():
    engine = TargetEngine(tiny_decoder(64), max_slots=3)
    short = X[:40]
    slot, _ = prefilled(engine, short)
    engine.free(slot)
    # Taken (wholly a prefix of the prompt): no copy; freed, it holds a superset again.
    slot, reused = prefilled(engine, X[:100])
    assert reused == 40 and engine.stats["prefix_copies"] == 0
    assert engine.warm_entries() == []
    engine.free(slot)
    assert engine.warm_entries() == [("", X[:100])]
    # A freed slot extending a warm entry replaces it (one entry, not two).
    a = engine.allocate()
    engine.step([PrefillItem(slot=a, tokens=X[:150], sampling=GREEDY)])
    engine.free(a)
    assert engine.warm_entries() == [("", X[:150])] and engine.warm_positions == 150
    # A freed slot a warm entry already holds is not kept twice.
    b = engine.allocate()
    engine.step([PrefillItem(slot=b, tokens=X[:60], sampling=GREEDY)])
    engine.free(b)
    assert engine.warm_entries() == [("", X[:150])] and engine.warm_positions == 150
    # ... but in another partition it is distinct content.
    c = engine.allocate("p")
    engine.step([PrefillItem(slot=c, tokens=X[:60], sampling=GREEDY)])
    engine.free(c)
    assert engine.warm_positions == 210
    per = engine.decoder.new_cache().position_bytes
    assert engine.warm_bytes == 210 * per
    assert engine.stats["warm_bytes"] == 210 * per
    assert engine.stats["warm_positions"] == 210 and engine.stats["warm_entries"] == 2


def test_eviction_goes_by_recency_and_keeps_the_warm_positions_within_the_bound():
    engine = TargetEngine(tiny_decoder(64), max_slots=2, prefix_cache_tokens=30)
    prompts = {name: [base] + [(base * 7 + i) % 50 + 10 for i in range(9)]
               for name, base in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}
    for name in "abc":
        slot, _ = prefilled(engine, prompts[name])
        engine.free(slot)
        assert engine.warm_positions <= 30
    assert engine.warm_positions == 30
    # Reusing a's opening (a copy) makes a the most recently used ...
    slot, reused = prefilled(engine, prompts["a"][:4] + [63, 63])
    assert reused == 4 and engine.stats["prefix_copies"] == 1
    # ... so freeing this 6-position slot evicts b (the least recently used), not a.
    engine.free(slot)
    assert engine.warm_positions <= 30
    held = [tokens for _, tokens in engine.warm_entries()]
    assert prompts["a"] in held and prompts["b"] not in held and prompts["c"] in held
    slot, _ = prefilled(engine, prompts["d"])
    engine.free(slot)
    assert engine.warm_positions <= 30
    held = [tokens for _, tokens in engine.warm_entries()]
    assert held[-1] == prompts["d"] and prompts["a"] in held
    # One longer than the whole bound is never kept.
    slot, _ = prefilled(engine, X[:31])
    engine.free(slot)
    assert X[:31] not in [tokens for _, tokens in engine.warm_entries()]
    assert engine.warm_positions <= 30
