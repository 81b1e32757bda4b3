"""Tensor-parallel (TP) target replicas on Ray.

A replica of degree S is S rank actors (`TPRank`) in one STRICT_PACK placement group (one
node), joined by a torch.distributed process group: gloo on CPU, NCCL when each rank has a GPU
(``num_gpus=1``, weights in bfloat16). Each rank holds one `target_worker.sharded.ShardedDecoder`
shard (read slice by slice from the weights file) and a `TargetEngine` over it, so each rank's
KV caches hold only its KV heads.

Rank 0 is the replica: the handle `create_target_replica` returns. It exposes the methods of
`target_worker.actor.TargetActor` (``allocate, free, prefill, verify, rollback, status,
model_info``) with the same semantics and return types; each call runs on every rank (rank 0
submits it to the others, then runs its own part, and the forwards meet in the collectives)
and returns rank 0's result. Slot ids, rollbacks and validation errors agree across ranks
because every rank's engine sees the same calls in the same order; a bad item raises the same
ValueError on every rank before any collective. Rank 0 creates the other ranks, so they share
its fate (killing it kills them).

Usage (Ray initialised)::

    validate_tp(None, 3)                     # SmolLM2: 9 heads, 3 KV heads -> fine
    replica = create_target_replica(None, tp=3, num_threads=1)
    slot = ray.get(replica.allocate.remote())
    ...
    destroy_target_replica(replica)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch

from specd_core.step import PrefillItem, StepOutput, VerifyItem, payload_bytes

from .actor import ComputeThread, TargetActor, on_compute_thread
from .disk_cache import ensure_weights_cache, safetensors_config
from .engine import DEFAULT_PREFIX_CACHE_TOKENS, TargetEngine
from .hf import HFSource, read_hf_config
from .loader import DTYPES, load_decoder, model_config, model_path, resolve_dtype
from .sharded import SafetensorsSource, ShardedDecoder, StateDictSource, tp_errors
from .testing import is_tiny_random_spec, load_tiny_random, tiny_random_config

__all__ = [
    "TPRank",
    "create_target_replica",
    "destroy_target_replica",
    "load_shard",
    "validate_tp",
]

#: CPU reserved per rank bundle: placement only (Ray refuses all-zero bundles); the rank's
#: real CPU use is ``num_threads`` torch threads.
CPU_PER_RANK = 0.001
#: How long a collective (or the rendezvous) may wait for the other ranks.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
_STEP_KEYS = ("seconds", "forward_seconds", "tokens", "bytes_in", "bytes_out", "fanout_bytes",
              "collective_bytes")

# Placement groups of the replicas this process created, by actor id (for destroy).
_PLACEMENT_GROUPS: dict[str, object] = {}


def validate_tp(model: str | None, tp: int) -> None:
    """Checks that ``tp`` ranks can split ``model`` (reads its config only, no weights).

    Args:
        model: a `target_worker.load_model` source (None: the default SmolLM2).
        tp: tensor-parallel degree.

    Raises:
        ValueError: ``tp`` is not a positive int, or it does not divide the attention heads,
            the KV heads, the FFN size (dense) or the experts / shared-expert FFN size (MoE);
            the message names each number, e.g. SmolLM2 with tp=2: "attention heads (9) is
            not divisible by tp=2". Also a bad ``model`` source (as `load_model`).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    config = model_config(model)
    errors = tp_errors(config, tp)
    if errors:
        name = "the default model" if model is None else repr(model)
        raise ValueError(f"tensor parallel tp={tp} cannot split {name}: " + "; ".join(errors))


def load_shard(
    model: str | None,
    rank: int,
    tp: int,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    vocab_parallel: bool = True,
) -> ShardedDecoder:
    """Rank ``rank``'s `ShardedDecoder` of ``model``, reading only its slices: from the float32
    safetensors weights cache of a GGUF file (converted first if absent, once per machine),
    from a Hugging Face directory's own safetensors (in place), or from the tiny random test
    model's state dict.

    Raises:
        ValueError: a bad source or a ``tp`` that does not divide the model.
    """
    if is_tiny_random_spec(model):
        config, _ = tiny_random_config(model)
        source = StateDictSource(load_tiny_random(model)[0].state_dict())
    elif (path := model_path(model)).is_dir():
        config, arch = read_hf_config(path)
        source = HFSource(path, config, arch)
    else:
        cached = ensure_weights_cache(path)
        config, source = safetensors_config(cached), SafetensorsSource(cached)
    return ShardedDecoder.load(config, source, rank, tp, vocab_parallel=vocab_parallel,
                               device=device, dtype=dtype)


class TPRank(TargetActor):
    """One rank of a tensor-parallel target replica (a plain class; `create_target_replica`
    wraps it with ``ray.remote``). Rank 0 creates ranks ``1..tp-1`` in ``placement_group``
    and answers for the replica.

    Args:
        model: a `load_model` source.
        max_slots: the most requests held at once.
        num_threads: torch intra-op threads of this rank's process.
        rank: this rank (0 for the replica handle).
        tp: number of ranks.
        placement_group: the replica's placement group (bundle ``i`` hosts rank ``i``), or None
            when ``tp == 1``.
        use_gpu: compute on this rank's GPU (NCCL, ``dtype`` default bfloat16).
        dtype: one of `target_worker.loader.DTYPES`; None or ``"auto"`` picks bfloat16 on GPU
            and on CPUs where it measured faster (AMX, Arm BF16), else float32
            (`target_worker.loader.resolve_dtype`).
        vocab_parallel: split embeddings / LM head by vocabulary (see `target_worker.sharded`).

    Raises:
        ValueError: bad arguments or a ``tp`` the model cannot be split by.
    """

    def __init__(
        self,
        model: str | None = None,
        max_slots: int = 64,
        num_threads: int = 2,
        rank: int = 0,
        tp: int = 1,
        placement_group=None,
        use_gpu: bool = False,
        dtype: str | None = None,
        vocab_parallel: bool = True,
        prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
        fallback_threads: int | None = None,
    ):
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
        dtype = None if dtype == "auto" else dtype
        self.model, self.rank, self.tp, self.use_gpu = model, rank, tp, use_gpu
        self.placement_group = placement_group
        self.followers: list = []
        self._store = None
        self._compute = ComputeThread()
        self._compute.run(self._load_rank, max_slots, num_threads, placement_group, dtype,
                          vocab_parallel, prefix_cache_tokens, fallback_threads)

    def _load_rank(self, max_slots, num_threads, placement_group, dtype, vocab_parallel,
                   prefix_cache_tokens, fallback_threads) -> None:
        model, rank, tp, use_gpu = self.model, self.rank, self.tp, self.use_gpu
        torch.set_num_threads(num_threads)
        if rank == 0 and tp > 1:
            self._start_followers(model, max_slots, num_threads, placement_group, use_gpu,
                                  dtype, vocab_parallel, prefix_cache_tokens, fallback_threads)
        if tp == 1 and not use_gpu:
            decoder = load_decoder(model, dtype)  # exactly the single-process target
        else:
            torch_dtype = resolve_dtype(dtype, "cuda" if use_gpu else "cpu")
            decoder = load_shard(model, rank, tp, "cuda" if use_gpu else "cpu", torch_dtype,
                                 vocab_parallel)
        # Every rank keeps the same warm slots: each makes the same reuse choices.
        self.engine = TargetEngine(decoder, max_slots=max_slots,
                                   prefix_cache_tokens=prefix_cache_tokens,
                                   fallback_threads=fallback_threads)
        self._step = dict.fromkeys(_STEP_KEYS, 0)
        self._step["steps"] = 0
        self._last_step: dict = {}
        if rank == 0 and tp > 1:
            self._rendezvous()

    # --- set-up -----------------------------------------------------------------------------

    def _start_followers(self, model, max_slots, num_threads, pg, use_gpu, dtype, vp,
                         prefix_cache_tokens, fallback_threads) -> None:
        import ray
        import torch.distributed as dist
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # All ranks share one node (STRICT_PACK): the rendezvous store stays on loopback.
        self._store = dist.TCPStore("127.0.0.1", 0, self.tp, is_master=True,
                                    wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        cls = ray.remote(TPRank)
        for r in range(1, self.tp):
            self.followers.append(cls.options(
                num_cpus=CPU_PER_RANK, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r),
            ).remote(model, max_slots, num_threads, r, self.tp, None, use_gpu, dtype, vp,
                     prefix_cache_tokens, fallback_threads))

    def _rendezvous(self) -> None:
        import ray

        # Followers load their shards meanwhile; wait for that first, so a failed load raises
        # here instead of leaving rank 0 in the rendezvous until the timeout.
        ray.get([f.ready.remote() for f in self.followers])
        joins = [f.join.remote(self._store.port) for f in self.followers]
        self.join(self._store.port)
        ray.get(joins)

    @on_compute_thread
    def join(self, port: int) -> None:
        """Joins the replica's process group (rank 0 hosts the store on ``port``)."""
        import torch.distributed as dist

        store = self._store
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, self.tp, is_master=False,
                                  timeout=COLLECTIVE_TIMEOUT)
        dist.init_process_group("nccl" if self.use_gpu else "gloo", store=store,
                                rank=self.rank, world_size=self.tp, timeout=COLLECTIVE_TIMEOUT)

    def ready(self) -> bool:
        """True once constructed (a call waits for the actor's construction)."""
        return True

    def placement(self):
        """The replica's placement group (rank 0; None for tp=1 or another rank)."""
        return self.placement_group

    def members(self) -> list:
        """Handles of ranks ``1..tp-1`` (rank 0 only; empty elsewhere)."""
        return list(self.followers)

    @on_compute_thread
    def follow(self, method: str, *args):
        """Runs an engine call as a rank other than 0: an allocated slot id, else None."""
        result = getattr(self.engine, method)(*args)
        return result if method in ("allocate", "allocate_prefix") else None

    # --- the TargetActor surface ------------------------------------------------------------

    def _all(self, method: str, *args):
        """``engine.<method>(*args)`` on every rank; rank 0's result, or rank 0's error."""
        import ray

        refs = [f.follow.remote(method, *args) for f in self.followers]
        mine, error = None, None
        try:
            mine = getattr(self.engine, method)(*args)
        except Exception as exc:  # raised again below, once the other ranks are done
            error = exc
        if refs:
            ray.wait(refs, num_returns=len(refs))
        for r, ref in enumerate(refs, start=1):
            try:
                theirs = ray.get(ref)
            except Exception as exc:
                if error is None:
                    raise RuntimeError(
                        f"tensor-parallel rank {r} failed on {method} where rank 0 did not: "
                        f"{exc}"
                    ) from exc
                continue
            if method in ("allocate", "allocate_prefix") and error is None and theirs != mine:
                raise RuntimeError(f"rank {r} allocated slot {theirs}, rank 0 slot {mine}")
        if error is not None:
            raise error
        return mine

    def _step_call(self, method: str, items: Sequence) -> list[StepOutput]:
        t0 = time.perf_counter()
        forward0 = self.engine.stats["forward_seconds"]
        comm0 = getattr(self.engine.decoder, "comm_bytes", 0)
        outputs = self._all(method, items)
        bytes_in = payload_bytes(items)
        last = {
            "seconds": time.perf_counter() - t0,
            "forward_seconds": self.engine.stats["forward_seconds"] - forward0,
            "tokens": sum(len(item.tokens) for item in items),
            "bytes_in": bytes_in,
            "bytes_out": payload_bytes(outputs),
            "fanout_bytes": bytes_in * len(self.followers),
            "collective_bytes": getattr(self.engine.decoder, "comm_bytes", 0) - comm0,
        }
        self._last_step = last
        for key in _STEP_KEYS:
            self._step[key] += last[key]
        self._step["steps"] += 1
        return outputs

    @on_compute_thread
    def allocate(self) -> int:
        """A free slot id (the same on every rank). Raises RuntimeError when all are in use."""
        return self._all("allocate")

    @on_compute_thread
    def allocate_prefix(self, tokens: list[int], partition: str = "") -> tuple[int, int]:
        """``(slot, reused positions)`` looked up in ``partition``, the same on every rank
        (`TargetEngine.allocate_prefix`)."""
        return self._all("allocate_prefix", tokens, partition)

    @on_compute_thread
    def free(self, slot: int) -> None:
        """Releases ``slot`` on every rank. Raises ValueError for an unknown slot."""
        self._all("free", slot)

    @on_compute_thread
    def prefill(self, items: Sequence[PrefillItem]) -> list[StepOutput]:
        """See `TargetEngine.prefill` (rank 0's outputs)."""
        return self._step_call("prefill", items)

    @on_compute_thread
    def verify(self, items: Sequence[VerifyItem]) -> list[StepOutput]:
        """See `TargetEngine.verify` (rank 0's outputs)."""
        return self._step_call("verify", items)

    @on_compute_thread
    def rollback(self, slot: int, length: int) -> None:
        """See `TargetEngine.rollback` (every rank)."""
        self._all("rollback", slot, length)

    def status(self) -> dict:
        """`TargetActor.status` plus:

        - ``tp``: int, the number of ranks;
        - ``step``: totals over prefill/verify calls: ``steps`` (calls), ``seconds`` (wall
          time of the calls in rank 0, float s), ``forward_seconds`` (inside the decoder),
          ``tokens`` (tokens fed), ``bytes_in`` / ``bytes_out`` (`payload_bytes` of the items /
          outputs crossing the replica's boundary), ``fanout_bytes`` (items sent on from rank
          0 to the other ranks), ``collective_bytes`` (bytes rank 0 sent into all-reduces and
          the logits gather);
        - ``last_step``: the same keys (but ``steps``) for the latest call, ``{}`` before one.

        ``stats["warm_bytes"]`` counts every rank's shard (rank 0's times ``tp``: each holds
        ``n_kv_heads / tp`` heads of the same positions).
        """
        status = super().status()
        status["stats"]["warm_bytes"] = status["stats"].get("warm_bytes", 0) * self.tp
        status["tp"] = self.tp
        status["step"] = dict(self._step)
        status["last_step"] = dict(self._last_step)
        return status

    def model_info(self) -> dict:
        """`TargetActor.model_info` plus ``tp`` (int)."""
        return {**super().model_info(), "tp": self.tp}


def _cluster_has_gpu() -> bool:
    import ray

    return ray.cluster_resources().get("GPU", 0) >= 1


def create_target_replica(
    model: str | None,
    tp: int = 1,
    max_slots: int = 64,
    num_threads: int = 2,
    use_gpu: bool | None = None,
    *,
    dtype: str | None = None,
    vocab_parallel: bool = True,
    placement_timeout_s: float = 600.0,
    prefix_cache_tokens: int = DEFAULT_PREFIX_CACHE_TOKENS,
    fallback_threads: int | None = None,
    resource: str | None = None,
):
    """Starts a target replica of ``tp`` ranks; returns its Ray actor handle (rank 0).

    Validates ``tp`` against the model's config before any actor starts. For ``tp > 1`` it
    reserves a STRICT_PACK placement group of ``tp`` bundles (one node; ``{"GPU": 1}`` each
    with GPUs) and waits until it is placed. The handle answers like
    `target_worker.actor.TargetActor` (plus ``status()["tp"]``, step metrics and ``ready()``);
    calls wait for the ranks to load. Call with Ray initialised (a driver or an actor).

    Args:
        model: a `load_model` source (None: the default SmolLM2).
        tp: tensor-parallel degree.
        max_slots: the most requests held at once.
        num_threads: torch threads per rank (so ``tp * num_threads`` per replica).
        use_gpu: one GPU per rank, bfloat16 weights, NCCL; None: when the cluster has GPUs.
        dtype: override the weights/compute dtype (one of `target_worker.loader.DTYPES`).
        vocab_parallel: split embeddings / LM head by vocabulary (else replicated).
        placement_timeout_s: how long to wait for the placement group.
        prefix_cache_tokens: positions freed slots keep warm for prefix reuse on every rank
            (0: none; `target_worker.engine.TargetEngine`).
        fallback_threads: torch threads a rank's step runs on instead of ``num_threads`` where
            they measure cheaper (`TargetEngine`; None: always ``num_threads``).
        resource: a Ray custom resource every rank needs 1 of (``ray start --resources
            '{"NAME": N}'`` on the nodes meant for targets), or None: ranks go where the
            GPU/CPU accounting puts them. With ``tp > 1`` each bundle asks for it, so one
            node must offer ``tp`` of it. A replica that fits no live node waits (its
            `ray.get` calls wait) until one joins.

    Raises:
        ValueError: ``tp`` does not fit the model (`validate_tp`), or a bad argument.
        RuntimeError: the placement group was not placed in time (e.g. no node with ``tp``
            GPUs).
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    validate_tp(model, tp)
    if isinstance(max_slots, bool) or not isinstance(max_slots, int) or max_slots < 1:
        raise ValueError(f"max_slots must be a positive int, got {max_slots!r}")
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
    if use_gpu is None:
        use_gpu = _cluster_has_gpu()
    if resource is not None and (not isinstance(resource, str) or not resource):
        raise ValueError(f"resource must be a non-empty name, got {resource!r}")
    gpus = 1 if use_gpu else 0
    options = {"num_cpus": CPU_PER_RANK, "num_gpus": gpus}
    if resource is not None:
        options["resources"] = {resource: 1}
    pg = None
    if tp > 1:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": CPU_PER_RANK, **({"GPU": 1} if use_gpu else {}),
                  **({resource: 1} if resource is not None else {})}
        pg = placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK")
        try:
            ray.get(pg.ready(), timeout=placement_timeout_s)
        except Exception as exc:
            remove_placement_group(pg)
            raise RuntimeError(
                f"could not place {tp} tensor-parallel ranks ({bundle} each) on one node "
                f"within {placement_timeout_s} s: {exc}"
            ) from exc
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, 0)
        options.pop("resources", None)  # the bundle holds it
    handle = ray.remote(TPRank).options(**options).remote(
        model, max_slots, num_threads, 0, tp, pg, use_gpu, dtype, vocab_parallel,
        prefix_cache_tokens, fallback_threads)
    if pg is not None:
        _PLACEMENT_GROUPS[handle._actor_id.hex()] = pg
    return handle


def destroy_target_replica(handle) -> None:
    """Kills a replica's ranks and removes its placement group; a second call does nothing.

    Rank 0 owns the other ranks, so killing it kills them; removing the placement group
    also kills whatever still runs in it.
    """
    import ray
    from ray.util.placement_group import remove_placement_group

    pg = _PLACEMENT_GROUPS.pop(handle._actor_id.hex(), None)
    if pg is None:  # created by another process: ask the replica (briefly)
        try:
            pg = ray.get(handle.placement.remote(), timeout=5)
        except Exception:  # dead, busy, or not a TPRank
            pg = None
    try:
        ray.kill(handle)
    except Exception:  # already gone
        pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # already removed
            pass
