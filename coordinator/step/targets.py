"""The target as the step loop drives it: the `Target` interface (a replica's step socket,
`target_worker.channel.ChannelTarget`, implements it) and the in-process adapters over a
`target_worker.engine.TargetEngine` (`LocalTarget`, and `CacheTarget` over a caller's
cache)."""

from __future__ import annotations

from typing import Protocol


class Target(Protocol):
    """What the scheduler needs from a target replica: the service's
    `target_worker.channel.ChannelTarget` (the replica's step socket) or a
    `target_worker.engine.TargetEngine` wrapped by `LocalTarget` (the tests also drive a Ray
    actor handle through `tests/tp_harness.RayTarget`)."""

    async def allocate(self) -> int: ...
    async def allocate_prefix(self, tokens: list[int], partition: str = ""
                              ) -> tuple[int, int]: ...
    async def free(self, slot: int) -> None: ...
    async def prefill(self, items: list) -> list: ...
    async def verify(self, items: list) -> list: ...


class LocalTarget:
    """An in-process `TargetEngine` behind the async `Target` interface."""

    def __init__(self, engine):
        self.engine = engine

    async def allocate(self) -> int:
        return self.engine.allocate()

    async def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        return self.engine.allocate_prefix(tokens, partition)

    async def free(self, slot: int) -> None:
        self.engine.free(slot)

    async def prefill(self, items: list) -> list:
        return self.engine.prefill(items)

    async def verify(self, items: list) -> list:
        return self.engine.verify(items)


class CacheTarget(LocalTarget):
    """A `TargetEngine` whose one request runs in a caller's `KvCache` (`TargetEngine.adopt`):
    the in-process path, where the cache may be warm (a prefill at its length continues it).
    Freeing the slot leaves the cache to its owner."""

    def __init__(self, engine, cache):
        super().__init__(engine)
        self.cache = cache

    async def allocate(self) -> int:
        return self.engine.adopt(self.cache)

    async def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        return self.engine.adopt(self.cache), 0
