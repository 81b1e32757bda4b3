"""STUB (replace at merge): the tensor-parallel target replica API, tp=1 only.

The "tp" branch provides the real module (S ranks per replica, placement groups,
torch.distributed). This stub has the same signatures so the coordinator's replica code and
its tests run before that lands.
"""

from __future__ import annotations

__all__ = ["create_target_replica", "destroy_target_replica", "validate_tp"]


def validate_tp(model: str | None, tp: int) -> None:
    """Checks that ``model`` can be split ``tp`` ways.

    Raises:
        ValueError: ``tp`` < 1.
        NotImplementedError: ``tp`` > 1 (this stub).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if tp > 1:
        raise NotImplementedError("tensor parallel (tp > 1) is not in this build")


def create_target_replica(model: str | None, tp: int = 1, max_slots: int = 64,
                          num_threads: int = 2, use_gpu: bool | None = None):
    """One target replica as a Ray actor handle with `TargetActor`'s remote methods."""
    import ray

    from .actor import TargetActor

    validate_tp(model, tp)
    return ray.remote(num_cpus=0)(TargetActor).remote(model, max_slots=max_slots,
                                                      num_threads=num_threads)


def destroy_target_replica(handle) -> None:
    """Kills the replica's actor(s)."""
    import ray

    ray.kill(handle)
