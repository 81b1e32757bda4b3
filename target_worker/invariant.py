"""Batch-invariant kernels for the target's forward, and the start-up check that proves them.

Speculative decoding is lossless only if the target computes a row the same whatever else
is in its step: a verify block of k rows, another request's rows, a prompt chunk of any size,
a prefix cached by an earlier request. A matmul library does not promise that: it picks its
reduction order by the call's shape and thread count (measured on this repository's CPU,
MKL's float32 GEMM gives a row other last bits at 1, 2-3 and 5-11 rows than at 4 or 12+,
and its two-thread split differs again; a one-row sum over a 49152-wide row splits across
threads where a many-row sum does not). In bfloat16 the drift changed most greedy outputs.

So every matmul of the target runs through a *plan* chosen here (after Thinking Machines'
"Defeating Nondeterminism in LLM Inference", He et al. 2025, which makes GPU kernels batch
invariant by fixing their tiling; here the kernels are the libraries', so their invariance is
measured instead of assumed):

- a call of ``n`` rows is zero-padded up to the least of `CALL_ROWS` that is at least
  ``max(n, plan.min_rows)`` (calls above ``plan.max_rows``, the largest size proven, are
  split into chunks of it), so a kernel only ever sees row counts the check has proven;
- the kernel and ``min_rows`` are the first of a preference list (`LINEAR_KERNELS`,
  `BMM_KERNELS`; ``min_rows`` 1, 2, 4, 8, 16) for which `check_linear` / `check_bmm`
  find every row count from ``min_rows`` up to at least `MIN_PROVEN_ROWS` giving *every*
  row bitwise equal to that row computed alone (a kernel may change its order past some
  size: oneDNN's bfloat16 GEMM on an AMX CPU does above 32 rows, in about one output in
  10^4, which rounding to bfloat16 hides from a few probe rows); bfloat16 and float16 on
  the CPU take only kernels of one call shape (`REDUCED_LINEAR_KERNELS`,
  `FIXED_BMM_KERNELS`: their libraries' paths round apart on some data only, which no
  check on random rows can rule out); calls below the least size that is also equal
  across the thread counts the engine may use run on one thread
  (`InvariancePlan.threaded_rows`).
  The last kernel of each list, one call per row, is invariant by construction (every
  call has the same shape); it is what is left when nothing faster passes, never a
  non-invariant one.

Pointwise ops with a transcendental (exp, SiLU) give an element other bits on their scalar
tail than on their vector body, and a multi-threaded call puts tails where the thread split
falls: `pointwise` runs such a call on one thread unless the split falls on whole vector
groups, so each row is always cut the same way.

Verdicts are kept in ``batch_invariance.json`` under `target_worker.disk_cache.cache_dir`,
keyed by everything they depend on (torch build, CPU or GPU, kernel, shape, dtype, thread
counts), so a machine checks each weight shape once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "CALL_ROWS",
    "announce_checks",
    "verdict_path",
    "GRAIN",
    "InvariancePlan",
    "MIN_PROVEN_ROWS",
    "call_rows",
    "check_bmm",
    "check_linear",
    "bmm_function",
    "invariant_bmm",
    "invariant_linear",
    "one_thread",
    "torch_threads",
    "plan_bmm",
    "plan_linear",
    "planned",
    "prepare_linear",
    "pointwise",
]

#: Row counts a planned kernel is ever called with: a call is padded with zero rows to the
#: least of these at least its rows (waste: < 25% above 16 rows), and a call above the
#: largest is split into chunks of it. Every one of them is checked (`check_linear`).
CALL_ROWS = (*range(1, 17), 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192,
             224, 256)

#: ATen's ``at::internal::GRAIN_SIZE``: an elementwise op or a reduction over fewer
#: elements runs on one thread whatever ``torch.get_num_threads()`` says.
GRAIN = 32768

#: Bump when a kernel, the check or `CALL_ROWS` changes: older verdicts are then ignored.
_CHECK_VERSION = 2

#: The fewest rows a kernel must be proven up to (from its ``min_rows``) to be used: a
#: kernel that changes its order at fewer rows loses to the next one (the "tiles" kernel
#: runs every call at 8 rows).
MIN_PROVEN_ROWS = 16


def call_rows(n: int) -> int:
    """The row count a call of ``n`` rows is padded to: the least of `CALL_ROWS` >= ``n``.

    Raises:
        ValueError: ``n`` outside ``[1, CALL_ROWS[-1]]``.
    """
    if not 1 <= n <= CALL_ROWS[-1]:
        raise ValueError(f"row count must be in [1, {CALL_ROWS[-1]}], got {n}")
    for size in CALL_ROWS:
        if size >= n:
            return size
    raise AssertionError("unreachable")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the body with ``count`` torch threads (on the calling thread), then restores
    the count it had."""
    threads = torch.get_num_threads()
    if threads == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def one_thread() -> contextlib.AbstractContextManager:
    """`torch_threads` (1): ops run whole on the calling thread, never split."""
    return torch_threads(1)


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` (exp, SiLU) over ``x`` (contiguous, or a 2-D view
    with contiguous rows), computed so an element's bits never depend on the tensor's size.

    ATen runs an elementwise op over ``[0, numel)`` in ``min(threads, ceil(numel /
    GRAIN))`` chunks of ``ceil(numel / chunks)`` elements, each vectorised from its start
    with a scalar tail at its end; the scalar code (``std::exp``) may round an element
    otherwise than the vector code (Sleef). So the op keeps every thread only where each
    chunk boundary falls on a multiple of 64 elements (and, for a strided view, rows are a
    multiple of 64 long), where the vector groups are those of a one-thread run; otherwise
    it runs on one thread. A row is then cut the same way whatever the number of rows."""
    if x.device.type != "cpu" or x.numel() <= GRAIN:
        return fn(x)
    threads = torch.get_num_threads()
    chunks = min(threads, -(-x.numel() // GRAIN))
    aligned = -(-x.numel() // chunks) % 64 == 0 and (x.is_contiguous() or x.shape[-1] % 64 == 0)
    if aligned:
        return fn(x)
    with one_thread():
        return fn(x)


# --- kernels -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kernel:
    """One way to compute ``x @ weight.T (+ bias)``: ``prepare(weight)`` makes what
    ``run(x, prepared, weight, bias)`` multiplies (a packed copy, or None)."""

    name: str
    prepare: Callable[[torch.Tensor], object]
    run: Callable[[torch.Tensor, object, torch.Tensor, torch.Tensor | None], torch.Tensor]
    #: Called with one row at a time whatever the call's rows: invariant by construction.
    per_row: bool = False


def _onednn_prepare(weight: torch.Tensor) -> object:
    # oneDNN's blocked weight layout (what Inductor's CPU freezing uses for bf16): a fixed
    # reduction order per output, whatever the rows; 1.5-2x faster than MKL's GEMM for
    # 2-64 rows here (SmolLM2, `scripts/linear_paths.py`).
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        raise RuntimeError("oneDNN is CPU-only")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), CALL_ROWS[-1])


def _onednn_run(x, packed, weight, bias):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


#: Rows of every call the "onednn-tiles" kernel makes.
ONEDNN_TILE_ROWS = 32


def _onednn_tiles_run(x, packed, weight, bias):
    return _tiles(lambda a: _onednn_run(a, packed, weight, bias), x, 0, ONEDNN_TILE_ROWS)


def _aten_run(x, _prepared, weight, bias):
    return F.linear(x, weight, bias)


#: Rows of each call the "tiles" kernels make: every call has exactly this many (the last
#: zero-padded), so a kernel that changes its reduction order with the row count (MKL's
#: GEMM, bf16 GEMMs from 16 rows on an AVX512-BF16 CPU) is only ever run at one shape.
TILE_ROWS = 8


def _tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dim: int,
           rows: int = TILE_ROWS) -> torch.Tensor:
    n = x.shape[dim]
    parts = [_padded_call(fn, x.narrow(dim, lo, min(rows, n - lo)), rows)
             for lo in range(0, n, rows)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _tiles_run(x, _prepared, weight, bias):
    return _tiles(lambda a: F.linear(a, weight, bias), x, 0)


def _rows_run(x, _prepared, weight, bias):
    return torch.cat([F.linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])


def _triton_prepare(weight: torch.Tensor) -> object:
    # The fixed-tile Triton matmul (`target_worker.triton_linear`): CUDA only, triton optional.
    if weight.device.type != "cuda":
        raise RuntimeError("the Triton matmul is planned on CUDA only")
    from .triton_linear import prepare

    return prepare(weight)


def _triton_run(x, _prepared, weight, bias):
    from .triton_linear import triton_linear

    return triton_linear(x, weight, bias)


#: Linear kernels in order of preference (fastest first, measured on SmolLM2's shapes; the
#: Triton one, CUDA only, where cuBLAS fails the check).
LINEAR_KERNELS = (
    _Kernel("onednn", _onednn_prepare, _onednn_run),
    _Kernel("aten", lambda w: None, _aten_run),
    _Kernel("triton", _triton_prepare, _triton_run),
    _Kernel("tiles", lambda w: None, _tiles_run),
    _Kernel("rows", lambda w: None, _rows_run, per_row=True),
)
#: The same for bfloat16 and float16 weights on the CPU. There oneDNN's GEMM (an AMX or
#: AVX512-BF16 path) takes another path by the call's rows, and the paths round apart on
#: some data only: above 32 rows about one output in 10^4 on random rows, and at 32 rows
#: against one a row of real activations (products near the denormal range) where random
#: rows agreed. So no variable-size reduced-precision GEMM is planned: oneDNN runs every
#: call at `ONEDNN_TILE_ROWS` rows (zero-padded), one shape, one path.
REDUCED_LINEAR_KERNELS = (
    _Kernel("onednn-tiles", _onednn_prepare, _onednn_tiles_run),
    _Kernel("tiles", lambda w: None, _tiles_run),
    _Kernel("rows", lambda w: None, _rows_run, per_row=True),
)


def _bmm_aten(a, b, out=None):
    return torch.bmm(a, b, out=out)


def _bmm_tiles(a, b, out=None):
    y = _tiles(lambda t: torch.bmm(t, b), a, 1, 2 * TILE_ROWS)
    return y if out is None else out.copy_(y)


def _bmm_fixed(a, b, out=None):
    """``bmm`` as calls of one shape only, ``[1, 16, k] @ [1, k, n]`` (each batch entry and
    each 16-row tile alone, the last tile zero-padded): invariant by construction. The plain
    ``bmm`` of a bfloat16 (and float16) CPU build changes its path with the whole call's size
    (batch entries times rows), so its bits for a row depend on how many key blocks and
    query rows share the call: measured on an AMX CPU, one row in a few hundred."""
    count, m, rows = a.shape[0], a.shape[1], 2 * TILE_ROWS
    padded = -(-m // rows) * rows
    if padded != m:
        a = torch.cat([a, a.new_zeros(count, padded - m, a.shape[2])], dim=1)
    y = torch.empty(count, padded, b.shape[2], dtype=torch.result_type(a, b), device=a.device)
    for i in range(count):
        for lo in range(0, padded, rows):
            torch.bmm(a[i:i + 1, lo:lo + rows], b[i:i + 1], out=y[i:i + 1, lo:lo + rows])
    y = y[:, :m]
    return y if out is None else out.copy_(y)


def _bmm_rows(a, b, out=None):
    y = torch.cat([torch.bmm(a[:, i : i + 1], b) for i in range(a.shape[1])], dim=1)
    return y if out is None else out.copy_(y)


#: Batched-matmul kernels (attention) in order of preference: ``(name, fn(a, b, out=None),
#: per_row)``.
BMM_KERNELS = (("aten", _bmm_aten, False), ("tiles", _bmm_tiles, False),
               ("rows", _bmm_rows, True))
#: Reduced-precision attention on the CPU: plain ``bmm`` changes its path with the call's
#: whole size (`_bmm_fixed`), which no check over a few batch counts can cover, so only a
#: kernel of one call shape is planned.
FIXED_BMM_KERNELS = (("fixed", _bmm_fixed, False), ("rows", _bmm_rows, True))

#: ``min_rows`` tried per kernel, least padding first.
_MIN_ROWS = (1, 2, 4, 8, 16)
#: Call sizes a verdict read from disk is spot-checked at (with its ``min_rows``): a verify
#: block of 8 drafts, a batched step, a full call. A stale or edited file costs a full check.
QUICK_ROWS = (9, 64, 256)


@dataclass(frozen=True)
class InvariancePlan:
    """How one kind of call runs batch-invariantly: the kernel (a name from
    `LINEAR_KERNELS` or `BMM_KERNELS`), the fewest rows it is called with (fewer are
    zero-padded), and the fewest padded rows that may run on every thread: smaller calls
    run on one thread (libraries split a few rows across threads differently from many;
    ``threaded_rows`` None: every call on one thread)."""

    kernel: str
    min_rows: int
    threaded_rows: int | None = 1
    #: The largest call proven (one of `CALL_ROWS`): larger ones are split into its chunks.
    max_rows: int = CALL_ROWS[-1]

    def padded_rows(self, n: int) -> int:
        """Rows a call of ``1 <= n <= max_rows`` rows is run with."""
        return call_rows(max(n, self.min_rows))

    def threads_for(self, rows: int) -> int | None:
        """1 when a call of ``rows`` padded rows must run on one thread, else None."""
        return None if self.threaded_rows is not None and rows >= self.threaded_rows else 1


# --- the check -----------------------------------------------------------------------------


def _padded_call(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int
                 ) -> torch.Tensor:
    """``fn`` on ``x [n, ...]`` zero-padded to ``rows`` rows along dim ``-2`` (dim 0 for 2-D)."""
    dim = 0 if x.dim() == 2 else 1
    n = x.shape[dim]
    if n == rows:
        return fn(x)
    shape = list(x.shape)
    shape[dim] = rows
    buf = x.new_zeros(shape)
    buf.narrow(dim, 0, n).copy_(x)
    return fn(buf).narrow(dim, 0, n)


def _run_check(fn: Callable[[torch.Tensor], torch.Tensor], make: Callable[[int], torch.Tensor],
               min_rows: int, threads: Sequence[int], per_row: bool, quick: bool = False,
               max_rows: int | None = None) -> tuple[int, bool]:
    """The calls of ``fn`` (rows along dim 0, or dim 1 for a batched 3-D input) in which
    every row has the same bits as that row computed alone (zero-padded to ``min_rows``'s
    call size): ``(proven, same)``, ``proven`` the largest of `CALL_ROWS` (up to
    ``max_rows``) such that every size from ``min_rows``'s up to it passes at each thread
    count (0: not even the first), ``same`` whether the rows alone are equal across the
    thread counts. ``make(n)`` draws ``n`` random input rows. ``quick``: only a few call
    sizes (`QUICK_ROWS`, and ``max_rows``), the spot check of a verdict read from disk."""
    top = CALL_ROWS[-1] if max_rows is None else max_rows
    first = call_rows(min_rows)
    # One call per row: only determinism is left to check.
    sizes = [first, top] if per_row else [s for s in CALL_ROWS if first <= s <= top]
    if quick:
        sizes = sorted({s for s in sizes if s in (first, top) or s in QUICK_ROWS})
    sizes = sorted(set(sizes))
    pool = make(sizes[-1])
    dim = 0 if pool.dim() == 2 else 1
    proven, refs = sizes[-1], []
    for count in threads:
        with torch_threads(count):
            ref = torch.cat([_padded_call(fn, pool.narrow(dim, i, 1), first)
                             for i in range(sizes[-1])], dim=dim)
            refs.append(ref)
            for size in sizes:
                if size > proven:
                    break
                if not torch.equal(fn(pool.narrow(dim, 0, size).contiguous()),
                                   ref.narrow(dim, 0, size)):
                    passed = [s for s in sizes if s < size]
                    proven = passed[-1] if passed else 0
                    break
    same = all(torch.equal(refs[0], r) for r in refs[1:])
    return proven, same


@cache
def _fingerprint() -> str:
    """What a verdict depends on besides the call: the torch build and the processor."""
    parts = [torch.__version__, torch.__config__.show()]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            parts.append(f"{torch.cuda.get_device_name(i)} {torch.cuda.get_device_capability(i)}")
    try:
        with open("/proc/cpuinfo") as f:
            info = [line for line in f if line.startswith(("model name", "flags"))][:2]
        parts.extend(info)
    except OSError:
        import platform

        parts.append(platform.processor())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


_LOCK = threading.Lock()
#: key -> InvariancePlan, for this process (the disk file is read once).
_VERDICTS: dict[str, InvariancePlan] = {}
#: Keys whose verdict this process decided or spot-checked (`_spot_check`).
_CONFIRMED: set[str] = set()
_DISK_LOADED = False
#: Callbacks `announce_checks` registered: each is called once, before the next full check.
_ANNOUNCE: list[Callable[[], None]] = []


@contextlib.contextmanager
def announce_checks(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``callback()`` runs once (on the checking thread), just before the
    first full check: a verdict neither on disk nor decided in this process, or one whose
    spot check failed. A start that finds every verdict stored (~1 s of spot checks for
    SmolLM2) never calls it, so a caller can say what the first start on a machine spends
    its time on (~15 s on 2 cores) without printing it every time."""
    with _LOCK:
        _ANNOUNCE.append(callback)
    try:
        yield
    finally:
        with _LOCK:
            if callback in _ANNOUNCE:
                _ANNOUNCE.remove(callback)


def verdict_path() -> Path:
    """The file the verdicts are kept in (``batch_invariance.json`` under
    `target_worker.disk_cache.cache_dir`)."""
    return _verdict_path()


def _verdict_path() -> Path:
    from .disk_cache import cache_dir

    return cache_dir() / "batch_invariance.json"


def _load_disk() -> None:
    global _DISK_LOADED
    if _DISK_LOADED:
        return
    _DISK_LOADED = True
    if os.environ.get("SPECD_INVARIANCE_CACHE", "1") == "0":
        return
    try:
        stored = json.loads(_verdict_path().read_text())
    except (OSError, ValueError):
        return
    for key, value in stored.items() if isinstance(stored, dict) else ():
        try:
            _VERDICTS.setdefault(key, InvariancePlan(**value))
        except TypeError:
            continue


def _save_disk(key: str, plan: InvariancePlan) -> None:
    if os.environ.get("SPECD_INVARIANCE_CACHE", "1") == "0":
        return
    path = _verdict_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            stored = {}
        stored[key] = {"kernel": plan.kernel, "min_rows": plan.min_rows,
                       "threaded_rows": plan.threaded_rows, "max_rows": plan.max_rows}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stored, indent=0, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs the check again next start


def _decide(key: str, candidates: Sequence[tuple[str, bool, Callable[[int, tuple[int, ...]],
                                                                     tuple[bool, bool]]]],
            threads: tuple[int, ...]) -> InvariancePlan:
    """The first candidate ``(kernel, per_row, check(min_rows, threads))`` that passes: its
    least ``min_rows`` invariant on one thread, and the least invariant at every one of
    ``threads`` and across them (``threaded_rows``; None when none is, then every call runs
    on one thread). A size proven on one thread and a larger one proven across thread
    counts (one thread among them) link up: both hold at the larger size on one thread."""
    with _LOCK:
        _load_disk()
        counts = tuple(dict.fromkeys((1, *threads)))
        plan = _VERDICTS.get(key)
        if plan is not None:
            if key in _CONFIRMED or _spot_check(plan, candidates, counts):
                _CONFIRMED.add(key)
                return plan
            logging.getLogger(__name__).warning(
                "batch invariance: the stored verdict %s for %s failed its spot check; "
                "checking again", plan, key)
            del _VERDICTS[key]
        while _ANNOUNCE:  # under _LOCK
            _ANNOUNCE.pop(0)()

        def least(per_row, check, counts, below=None):
            """``(min_rows, proven)``: the least ``min_rows`` proven up to at least
            `MIN_PROVEN_ROWS` (or every size, for a kernel of one call per row), or None."""
            for min_rows in (1,) if per_row else _MIN_ROWS:
                if below is not None and min_rows > below:
                    return None
                try:
                    proven, same = check(min_rows, counts)
                except RuntimeError:
                    return None  # the kernel cannot run this call here
                enough = proven == CALL_ROWS[-1] if per_row else proven >= max(
                    MIN_PROVEN_ROWS, call_rows(min_rows))
                if enough and same:
                    return min_rows, proven
            return None

        plan = None
        for name, per_row, check in candidates:
            every = least(per_row, check, counts) if counts != (1,) else None
            alone = least(per_row, check, (1,), below=every and every[0])
            if alone is None and every is None:
                continue
            tops = [found[1] for found in (alone, every) if found is not None]
            plan = InvariancePlan(name, (alone or every)[0],
                                  every[0] if every is not None else (
                                      1 if counts == (1,) else None),
                                  max_rows=min(tops))
            break
        if plan is None:
            raise RuntimeError(f"no batch-invariant kernel for {key}: even one row per call "
                               "gave other bits (a non-deterministic kernel?)")
        _VERDICTS[key] = plan
        _CONFIRMED.add(key)
        _save_disk(key, plan)
        return plan


def _spot_check(plan: InvariancePlan, candidates, counts: tuple[int, ...]) -> bool:
    """Whether a verdict read from disk names a kernel of ``candidates`` with sane row counts
    and passes the check at `QUICK_ROWS` (one thread at its ``min_rows``; every thread count
    at its ``threaded_rows``): a file from another build, or edited, is never trusted."""
    found = [(per_row, check) for name, per_row, check in candidates if name == plan.kernel]
    if not found:
        return False
    per_row, check = found[0]
    allowed = (1,) if per_row else _MIN_ROWS
    if not (isinstance(plan.min_rows, int) and plan.min_rows in allowed
            and (plan.threaded_rows is None or (isinstance(plan.threaded_rows, int)
                                                and plan.threaded_rows in _MIN_ROWS))
            and plan.max_rows in CALL_ROWS and plan.max_rows >= call_rows(plan.min_rows)):
        return False
    try:
        proven, same = check(plan.min_rows, (1,), True, plan.max_rows)
        if proven == plan.max_rows and same and plan.threaded_rows is not None \
                and counts != (1,):
            proven, same = check(plan.threaded_rows, counts, True, plan.max_rows)
    except RuntimeError:
        return False
    return proven == plan.max_rows and same


def _scale_rows(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def check_linear(kernel: _Kernel, weight: torch.Tensor, bias: torch.Tensor | None,
                 min_rows: int, threads: Sequence[int], quick: bool = False,
                 max_rows: int | None = None) -> tuple[int, bool]:
    """`_run_check` of ``kernel`` multiplying ``weight [out, in]`` (+ ``bias``) at
    ``min_rows``: ``(largest call size proven at each of threads, rows alone equal across
    them)``.

    Raises:
        RuntimeError: the kernel cannot run on this weight here (e.g. oneDNN's bf16 packing
            on a CPU without AVX512-BF16/AVX-NE-CONVERT).
    """
    gen = torch.Generator().manual_seed(0)
    prepared = kernel.prepare(weight)
    k_in = weight.shape[1]

    def fn(x):
        return kernel.run(x.contiguous(), prepared, weight, bias)

    def make(n):
        return _scale_rows(gen, (n, k_in), weight.dtype, weight.device)

    return _run_check(fn, make, min_rows, threads, kernel.per_row, quick, max_rows)


def _key(*parts) -> str:
    return "|".join(str(p) for p in (_CHECK_VERSION, _fingerprint(), *parts))


def plan_linear(weight: torch.Tensor, bias: torch.Tensor | None, threads: Sequence[int]
                ) -> InvariancePlan:
    """The plan for multiplying weights of ``weight``'s shape, dtype and device (checked
    once per machine: `check_linear`, verdicts kept on disk)."""
    threads = tuple(dict.fromkeys(int(t) for t in threads))
    key = _key("linear", tuple(weight.shape), weight.dtype, weight.device.type,
               bias is not None, threads)
    kernels = LINEAR_KERNELS
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        kernels = REDUCED_LINEAR_KERNELS
    candidates = [
        (k.name, k.per_row,
         lambda m, counts, quick=False, top=None, k=k: check_linear(k, weight, bias, m,
                                                                    counts, quick, top))
        for k in kernels
    ]
    return _decide(key, candidates, threads)


def check_bmm(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], per_row: bool,
              batch: int, k: int, n: int, b_transposed: bool, dtype: torch.dtype,
              device: torch.device, min_rows: int, threads: Sequence[int],
              quick: bool = False, max_rows: int | None = None) -> tuple[int, bool]:
    """`_run_check` of ``fn(a [batch, m, k], b [batch, k, n])`` over the rows ``m`` of
    ``a``, with ``b`` a transposed view of ``[batch, n, k]`` when ``b_transposed`` (the
    layout attention multiplies keys in), checked at three batch counts: the least proven
    size over them, and whether each was the same across thread counts."""
    gen = torch.Generator().manual_seed(1)
    for count in (batch, 3 * batch, 17 * batch):
        if b_transposed:
            b = _scale_rows(gen, (count, n, k), dtype, device).transpose(1, 2)
        else:
            b = _scale_rows(gen, (count, k, n), dtype, device)

        def make(m, count=count):
            return _scale_rows(gen, (count, m, k), dtype, device)

        proven, same = _run_check(lambda a, b=b: fn(a, b), make, min_rows, threads, per_row,
                                  quick, max_rows)
        if not (proven and same):
            return proven, same
        max_rows = proven
    return max_rows, True


def plan_bmm(batch: int, k: int, n: int, b_transposed: bool, dtype: torch.dtype,
             device: torch.device, threads: Sequence[int]) -> InvariancePlan:
    """The plan for ``bmm(a [b, m, k], b [b, k, n])`` over any ``m`` and batch count
    (`check_bmm`; ``batch`` is the smallest batch count used)."""
    threads = tuple(dict.fromkeys(int(t) for t in threads))
    device = torch.device(device)
    key = _key("bmm", batch, k, n, b_transposed, dtype, device.type, threads)
    kernels = BMM_KERNELS
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        kernels = FIXED_BMM_KERNELS
    candidates = [
        (name, per_row,
         lambda m, counts, quick=False, top=None, fn=fn, per_row=per_row: check_bmm(
             fn, per_row, batch, k, n, b_transposed, dtype, device, m, counts, quick, top))
        for name, fn, per_row in kernels
    ]
    return _decide(key, candidates, threads)


# --- planned calls -------------------------------------------------------------------------

#: weight -> (plan, prepared operand, (weight._version, weight.data_ptr())): weights a
#: planned decoder multiplies (`prepare_linear`). A weight changed since is prepared again.
_PLANNED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_KERNELS = {k.name: k for k in (*LINEAR_KERNELS, *REDUCED_LINEAR_KERNELS)}
_BMMS = {name: fn for name, fn, _ in (*BMM_KERNELS, *FIXED_BMM_KERNELS)}


def _weight_key(weight: torch.Tensor) -> tuple[int, int]:
    return weight._version, weight.data_ptr()


def prepare_linear(weight: torch.Tensor, plan: InvariancePlan) -> None:
    """Makes `invariant_linear` multiply ``weight`` by ``plan`` from now on (nothing to do
    when it already does, on the weight as it is)."""
    entry = _PLANNED.get(weight)
    if entry is not None and entry[0] == plan and entry[2] == _weight_key(weight):
        return
    _PLANNED[weight] = (plan, _KERNELS[plan.kernel].prepare(weight), _weight_key(weight))


def planned(weight: torch.Tensor) -> InvariancePlan | None:
    """The plan `invariant_linear` uses for ``weight``, or None (then it is plain
    ``F.linear``, not proven invariant)."""
    entry = _PLANNED.get(weight)
    return None if entry is None else entry[0]


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """``x [n, in] @ weight.T + bias`` by ``weight``'s plan (`prepare_linear`): each output
    row bitwise the same whatever the other rows of ``x``. Returns None when ``weight`` has
    no plan (the caller multiplies it its own way)."""
    entry = _PLANNED.get(weight)
    if entry is None or x.dim() != 2:
        return None
    plan, prepared, key = entry
    if key != _weight_key(weight):  # changed in place or given new data: prepare again
        prepare_linear(weight, plan)
        plan, prepared, _ = _PLANNED[weight]
    kernel = _KERNELS[plan.kernel]
    return _chunked(lambda a: kernel.run(a, prepared, weight, bias), x.contiguous(), plan)


def bmm_function(plan: InvariancePlan | None
                 ) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``fn(a, b, out=None)``, the batched matmul of ``plan`` (`plan_bmm`; ``torch.bmm``
    without one). The caller gives it ``a`` with ``plan.padded_rows`` rows, on the threads
    ``plan.threads_for`` says."""
    return _bmm_aten if plan is None else _BMMS[plan.kernel]


def invariant_bmm(a: torch.Tensor, b: torch.Tensor, plan: InvariancePlan | None
                  ) -> torch.Tensor:
    """``bmm(a [batch, m, k], b [batch, k, n])`` by ``plan`` (`plan_bmm`): each row of
    every batch entry bitwise the same whatever ``m``; plain ``bmm`` without a plan."""
    if plan is None:
        return torch.bmm(a, b)
    fn = _BMMS[plan.kernel]
    return _chunked(lambda x: fn(x, b), a, plan)


def _chunked(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, plan: InvariancePlan
             ) -> torch.Tensor:
    """``fn`` over the rows of ``x`` (dim 0 of a 2-D, dim 1 of a 3-D tensor) in proven call
    sizes (`InvariancePlan.padded_rows`; above its ``max_rows``, chunks of it)."""
    dim = 0 if x.dim() == 2 else 1
    n, top = x.shape[dim], plan.max_rows
    if n <= top:
        rows = plan.padded_rows(n)
        if plan.threads_for(rows) == 1:
            with one_thread():
                return _padded_call(fn, x, rows)
        return _padded_call(fn, x, rows)
    return torch.cat([_chunked(fn, x.narrow(dim, lo, min(top, n - lo)), plan)
                      for lo in range(0, n, top)], dim=dim)
