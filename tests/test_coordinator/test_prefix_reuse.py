"""Prefix reuse through the scheduler under many users: 8 users in multi-turn chat sharing an
opening, arriving staggered (one user's second turn beside others' first), reuse at least 90%
of what their second turns could reuse; the same tokens with and without reuse (greedy and
seeded) although requests copied spans out of other users' entries; and partitions (the
request's ``partition``) never reusing each other's entries."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.step.plan import ChunkPolicy
from coordinator.step.scheduler import Scheduler
from coordinator.step.targets import LocalTarget
from drafter_worker.local import LocalDrafter
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams
from target_worker.engine import TargetEngine
from target_worker.loader import load_model

MODEL = "tiny-random:vocab=64,seed=0,layers=2"
OPENING = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # a chat template's opening
USERS = 8
LAG = 3  # a user's second turn arrives with the first turn of the user LAG after it


class AllocationRecorder(LocalTarget):
    """Records each ``allocate_prefix`` call's tokens, partition and reused positions."""

    def __init__(self, engine):
        super().__init__(engine)
        self.allocations: list[tuple[tuple[int, ...], str, int]] = []

    async def allocate_prefix(self, tokens, partition=""):
        slot, reused = await super().allocate_prefix(tokens, partition)
        self.allocations.append((tuple(tokens), partition, reused))
        return slot, reused


def question(user: int, turn: int) -> list[int]:
    return [(user * 13 + turn * 7 + i * 5) % 50 + 13 for i in range(8)]


def chat(reuse: bool, sampling: SamplingParams):
    """Rounds of concurrent requests: round r brings user r's first turn and user r - LAG's
    second (the first turn's prompt + its output + a new question). Returns the outputs by
    (user, turn), the second turns' prompts, the first turns' prompts and outputs, the
    recorder and the engine."""
    engine = TargetEngine(load_model(MODEL)[0], max_slots=USERS)
    target = AllocationRecorder(engine)
    outputs, prompts = {}, {}

    async def go():
        sched = Scheduler(target, LocalDrafter(PromptLookupSpeculator(2, 4)),
                          max_active=USERS, adaptive=False, chunking=ChunkPolicy(32),
                          prefix_caching=reuse)
        for r in range(USERS + LAG):
            reqs = {}
            for user, turn in ((r, 1), (r - LAG, 2)):
                if not 0 <= user < USERS:
                    continue
                if turn == 1:
                    prompt = OPENING + question(user, 1)
                else:
                    prompt = prompts[user, 1] + outputs[user, 1] + question(user, 2)
                prompts[user, turn] = prompt
                opts = SpeculativeOptions(max_new_tokens=12, sampling=sampling,
                                          seed=None if sampling.temperature == 0
                                          else 100 * user + turn)
                reqs[user, turn] = sched.submit(prompt, opts)
            await sched.run_until_idle()
            for key, req in reqs.items():
                outputs[key] = req.decode.generated

    asyncio.run(go())
    return outputs, prompts, target, engine


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)],
                         ids=["greedy", "seeded"])
def test_eight_users_second_turns_reuse_their_history_and_change_no_token(sampling):
    outputs, prompts, target, engine = chat(True, sampling)
    reused = {(tokens, partition): n for tokens, partition, n in target.allocations}
    # What a second turn can reuse: its first turn's prompt and output but the last output
    # token (never fed), at most all but the new prompt's last position.
    reusable = sum(min(len(prompts[u, 1]) + len(outputs[u, 1]) - 1, len(prompts[u, 2]) - 1)
                   for u in range(USERS))
    second = sum(reused[tuple(prompts[u, 2]), ""] for u in range(USERS))
    assert second >= 0.9 * reusable, (second, reusable)
    # Later users' first turns found other users' entries sharing the opening: copied out.
    assert all(reused[tuple(prompts[u, 1]), ""] >= len(OPENING) for u in range(1, USERS))
    assert engine.stats["prefix_copies"] >= USERS - 1
    assert engine.warm_positions <= engine.prefix_cache_tokens
    # Lossless: the same tokens as without reuse.
    plain, _, plain_target, plain_engine = chat(False, sampling)
    assert plain_target.allocations == [] and plain_engine.stats["prefix_hits"] == 0
    assert outputs == plain


def test_a_requests_partition_never_reuses_another_partitions_entry():
    engine = TargetEngine(load_model(MODEL)[0], max_slots=2)
    target = AllocationRecorder(engine)
    first = OPENING + question(0, 1)
    opts = SpeculativeOptions(max_new_tokens=8)

    async def go():
        sched = Scheduler(target, None, max_active=2, adaptive=False)
        results = {}
        for partition in ("tenant-a", "tenant-b", "", "tenant-a"):
            req = sched.submit(first, opts)
            req.partition = partition
            await sched.run_until_idle()
            results.setdefault(partition, []).append(req.decode.generated)
        # A request that scores its prompt looks nothing up, but its slot goes warm in its
        # own partition, never in the shared one.
        scoring = sched.submit(question(5, 5) * 2, SpeculativeOptions(max_new_tokens=2,
                                                                       prompt_logprobs=1))
        scoring.partition = "tenant-c"
        await sched.run_until_idle()
        return results

    results = asyncio.run(go())
    assert [r for _, _, r in target.allocations[:4]] == [0, 0, 0, len(first) - 1]
    assert [p for _, p, _ in target.allocations[:4]] == ["tenant-a", "tenant-b", "",
                                                          "tenant-a"]
    assert results["tenant-a"][0] == results["tenant-a"][1] == results["tenant-b"][0]
    assert target.allocations[4] == ((), "tenant-c", 0)
    held = {partition for partition, _ in engine.warm_entries()}
    assert held == {"tenant-a", "tenant-b", "", "tenant-c"}
    assert [t for p, t in engine.warm_entries() if p == "tenant-c"][0][:16] == \
        question(5, 5) * 2
