"""The target's dense building blocks: linear layers (batch-invariant when planned),
RMSNorm and the SwiGLU FFN. Split from `target_worker.model`, which re-exports them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .invariant import invariant_linear, pointwise

__all__ = ["FAST_LINEAR_MIN_ROWS", "Linear", "RMSNorm", "SwiGLU", "fast_linear", "swiglu"]


#: Fewest rows `fast_linear` computes in the ``weight @ x.T`` order: below it ``F.linear`` is
#: faster. Measured (``python scripts/linear_paths.py``, torch 2.13.0 CPU, this 2-core
#: machine, SmolLM2's shapes, 1 and 2 threads): at 1-6 rows ``F.linear`` took 0.3-0.6x the
#: time (the LM head at 1 row: 8.1 ms against 20.0 ms), from 8 rows the other order 0.6-0.9x.
FAST_LINEAR_MIN_ROWS = 8


def fast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [n, in]``, ``weight [out, in]``; returns ``[n, out]``
    (any other rank of ``x`` goes to ``F.linear``).

    A weight a batch-invariant decoder planned (`Decoder.make_batch_invariant`) is
    multiplied by its plan (`target_worker.invariant.invariant_linear`): each row's result is
    bitwise the same whatever the other rows. Any other weight (drafters, training) takes
    the fastest order: for ``FAST_LINEAR_MIN_ROWS <= n <= 64`` rows on the CPU
    ``(weight @ x.T).T``, which MKL runs faster than ``F.linear`` there (the result is then a
    non-contiguous view), else ``F.linear``.
    """
    y = invariant_linear(x, weight, bias)
    if y is not None:
        return y
    n = x.shape[0]
    if not FAST_LINEAR_MIN_ROWS <= n <= 64 or x.device.type != "cpu" or x.dim() != 2:
        return F.linear(x, weight, bias)
    x = x.contiguous()  # a row-major x makes x.T the operand layout MKL handles fast
    y = (weight @ x.T).T
    return y if bias is None else y + bias


class Linear(nn.Linear):
    """``nn.Linear`` computed with :func:`fast_linear` (same weight layout ``[out, in]``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fast_linear(x, self.weight, self.bias)


def _linear(in_features: int, out_features: int, bias: bool = False) -> Linear:
    # Uninitialised: weights come from Decoder.random or a checkpoint, so skip Kaiming init.
    return torch.nn.utils.skip_init(Linear, in_features, out_features, bias=bias)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension (weight ``[dim]``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Spelled out: F.rms_norm dispatches to a slower composite on CPU for one-row inputs.
        if x.dtype != torch.float32:  # bf16 (GPU shards): normalise in float32, as HF does
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True).add_(self.eps))
            return y.to(x.dtype) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(self.eps)) * self.weight


def swiglu(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ffn: int
) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` for ``x [n, hidden]`` (or ``[B, T, hidden]``),
    ``w_gate_up [2*ffn, hidden]`` (gate rows first), ``w_down [hidden, ffn]``: the dense FFN,
    each MoE expert and the EAGLE head's FFN."""
    gate, up = fast_linear(x, w_gate_up).split(ffn, dim=-1)
    return fast_linear(pointwise(F.silu, gate).mul_(up), w_down)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one ``[2*ffn, hidden]`` matmul.

    ``w_gate_up.weight`` rows ``[0, ffn)`` are the gate projection, ``[ffn, 2*ffn)`` the up one.
    """

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.ffn = ffn
        self.w_gate_up = _linear(hidden, 2 * ffn)
        self.w_down = _linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.w_gate_up.weight, self.w_down.weight, self.ffn)
