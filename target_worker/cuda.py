"""The target on a CUDA device: the cuBLAS settings batch invariance needs, and the explicit
check that a row decoded alone (M = 1) has the bits it has inside a verify block (M = k + 1).

On a GPU the matmul library picks its kernel, tiling and split-K by the call's shape, so a
row's bits can depend on how many rows share its call. vLLM's batch-invariant mode keeps
cuBLAS(Lt) on Hopper with split-K and reduced-precision reductions off
(``vllm/model_executor/layers/batch_invariant.py``; PyTorch PR #164766 for the split-K
switch): `configure_cublas` applies those settings. What such a mode leaves unguarded is the
axis speculation needs, the same row at M = 1 and inside M = k + 1 (vLLM RFC #54506), so
`decode_verify_mismatches` checks it on the model itself, and `Decoder.make_batch_invariant`
runs it on a CUDA decoder (the per-weight start-up check of `target_worker.invariant` runs
there too, over the device's kernels and every padded row count of `CALL_ROWS`).

Nothing here needs a GPU to import or to test: the check runs on any device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

__all__ = ["CUBLAS_ENV", "configure_cublas", "cublas_settings", "decode_verify_mismatches"]

#: Environment cuBLAS reads when a process creates its first handle / workspace: one fixed
#: workspace size for cuBLAS (``:16:8``, also what ``torch.use_deterministic_algorithms``
#: asks for) and a 1-byte cuBLASLt workspace, so no kernel that needs a larger one (split-K
#: reductions among them) is ever chosen.
CUBLAS_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def configure_cublas() -> dict:
    """Applies the batch-invariant cuBLAS settings to this process: `CUBLAS_ENV` (effective
    only if set before the process's first CUDA matmul: loading a model onto a GPU with
    `target_worker.loader` calls this first), TF32 off for matmuls and cuDNN,
    reduced-precision reductions and split-K off for bfloat16 and float16 GEMMs, cuBLASLt
    preferred where this torch build has it. Idempotent; reads and changes no GPU clock.

    Returns:
        `cublas_settings` after the change, with ``"late"`` True when CUDA was already
        initialised (the environment may then not have reached cuBLAS: start the process
        with it set instead).
    """
    late = torch.cuda.is_available() and torch.cuda.is_initialized()
    for name, value in CUBLAS_ENV.items():
        os.environ[name] = value
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in ("allow_bf16_reduced_precision_reduction",
                 "allow_fp16_reduced_precision_reduction"):
        try:  # (reduced precision, split-K): the tuple form of torch >= 2.10 (PR #164766)
            setattr(torch.backends.cuda.matmul, name, (False, False))
        except (TypeError, ValueError, RuntimeError):
            setattr(torch.backends.cuda.matmul, name, False)
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except RuntimeError as exc:  # a build without cuBLASLt (a CPU build): nothing to prefer
        logging.getLogger(__name__).debug("cuBLASLt not preferred: %s", exc)
    settings = cublas_settings()
    settings["late"] = late
    return settings


def cublas_settings() -> dict:
    """The settings `configure_cublas` controls, as this process has them now (strings and
    booleans, for a report)."""
    m = torch.backends.cuda.matmul
    try:
        library = str(torch.backends.cuda.preferred_blas_library())
    except RuntimeError as exc:
        library = f"unknown ({exc})"
    return {
        **{name: os.environ.get(name) for name in CUBLAS_ENV},
        "allow_tf32": bool(m.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "allow_bf16_reduced_precision_reduction": repr(
            m.allow_bf16_reduced_precision_reduction),
        "allow_fp16_reduced_precision_reduction": repr(
            m.allow_fp16_reduced_precision_reduction),
        "preferred_blas_library": library,
    }


def decode_verify_mismatches(decoder, ks: Sequence[int] = (1, 4, 8, 16),
                             starts: Sequence[int] = (3, 250), seed: int = 0) -> list[str]:
    """Checks one sequence's rows computed one token at a time (M = 1: decode) against the
    same rows computed as one block (M = k + 1: verify), bitwise, for each ``k`` in ``ks``
    and each context length in ``starts`` (the defaults put blocks across the first
    256-position key block boundary), on ``decoder``'s device and dtype.

    The context is prefilled once per start (random token ids from ``seed``), then each block
    is fed at the context's end into a copy of that cache and token by token into another.

    Returns:
        One line per mismatch naming ``k``, the start and the first differing row (empty:
        every row equal). Raises nothing for a mismatch: the caller decides.
    """
    c = decoder.config
    gen = torch.Generator().manual_seed(seed)
    found = []
    for start in starts:
        if start + max(ks) + 1 > c.max_seq_len:
            continue
        context = torch.randint(0, c.vocab_size, (start,), generator=gen).tolist()
        base = decoder.new_cache(capacity=min(c.max_seq_len, start + max(ks) + 1))
        decoder.forward_batch(context, 0, base)
        for k in ks:
            block = torch.randint(0, c.vocab_size, (k + 1,), generator=gen).tolist()
            verify_cache, decode_cache = base.clone(), base.clone()
            together = decoder.forward_batch(block, start, verify_cache).clone()
            for i, token in enumerate(block):
                alone = decoder.forward_batch([token], start + i, decode_cache)[0]
                if not torch.equal(alone, together[i]):
                    diff = (alone - together[i]).abs().max().item()
                    found.append(f"k={k} start={start}: row {i} differs (max |diff| {diff:.3g})")
                    break
    return found
