"""A fixed-tile Triton matmul for ``x @ weight.T``: batch invariant by construction on a GPU.

Every call, whatever its rows, runs the same kernel with the same tile shape (`BLOCK_M` x
`BLOCK_N` outputs per program, the reduction over ``K`` in `BLOCK_K` steps in one fixed
order, float32 accumulation, no split-K), so an output element is the same sequence of
operations whether its row is computed alone or among others: the tiling that Thinking
Machines' "Defeating Nondeterminism in LLM Inference" (He et al. 2025) and vLLM's
batch-invariant mode (``vllm/model_executor/layers/batch_invariant.py``) fix. Rows past ``M``
are masked loads of zeros. float32 inputs multiply in IEEE float32 (``input_precision=
"ieee"``), never silently through TF32 (the defect of batch_invariant_ops #23).

It is a candidate of the start-up check (`target_worker.invariant.LINEAR_KERNELS`, after
cuBLAS): used on a CUDA device only where cuBLAS fails the check for a weight's shape and
this kernel passes it (the check decides, as for every kernel: vLLM #55131 reports a
Triton matmul losing invariance at some K). Triton is optional: without it, or off CUDA,
`prepare` raises RuntimeError and the check moves on. ``TRITON_INTERPRET=1`` (set before
triton is imported) runs the kernel on CPU tensors, which checks its indexing and masks,
not a GPU's bits (tests/test_target_worker/test_triton_linear.py).
"""

from __future__ import annotations

import os

import torch

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "available", "prepare", "triton_linear"]

#: The one tile shape: rows, outputs and reduction step per program.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64

try:  # optional: torch's CUDA wheels bring triton, CPU builds usually do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run on ``device`` here: triton imports, and the device is CUDA
    (or any device under ``TRITON_INTERPRET=1``)."""
    return triton is not None and (torch.device(device).type == "cuda" or _interpreting())


if triton is not None:

    @triton.jit
    def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, sxm, sxk, swn, swk, sym, syn,
                       K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        # K is a compile-time constant: one compile per weight width (a handful per model),
        # a reduction loop of a fixed trip count.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn,
                 acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def prepare(weight: torch.Tensor) -> None:
    """`target_worker.invariant`'s prepare step: nothing to pack, but refuses where the
    kernel cannot run.

    Raises:
        RuntimeError: triton missing, or ``weight`` not on CUDA (outside the interpreter).
    """
    if not available(weight.device):
        raise RuntimeError("the Triton matmul needs triton and a CUDA device")


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T (+ bias)`` in ``x``'s dtype, ``[M, N]``, by the fixed-tile
    kernel (float32 accumulation).

    Raises:
        RuntimeError: as `prepare`.
    """
    prepare(weight)
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _linear_kernel[grid](x, weight, y, m, n, *x.stride(), *weight.stride(), *y.stride(),
                         K=k, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                         PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return y if bias is None else y + bias
