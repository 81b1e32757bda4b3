"""The fixed-tile Triton matmul (`target_worker.triton_linear`) without a GPU: under
``TRITON_INTERPRET=1`` its indexing, masks and arithmetic (float32; the interpreter has no
bfloat16 arithmetic and multiplies tiles with numpy, so a GPU's bits are not checked here:
`scripts/gpu_check.py` probes those), and its compile for an H200 (sm_90) in both dtypes.
Skipped where triton is not installed (it is optional)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import target_worker.invariant as inv

ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernel_is_never_planned_off_cuda():
    kernel = next(k for k in inv.LINEAR_KERNELS if k.name == "triton")
    with pytest.raises(RuntimeError, match="CUDA only"):
        kernel.prepare(torch.zeros(4, 4))


INTERPRETED = """
import torch
from target_worker.triton_linear import triton_linear
gen = torch.Generator().manual_seed(0)
# M, N, K none a multiple of the tile (16, 64, 64): every mask is exercised.
w = torch.randn(200, 150, generator=gen, dtype=torch.float64)
x = torch.randn(37, 150, generator=gen, dtype=torch.float64)
b = torch.randn(200, generator=gen, dtype=torch.float64)
y = triton_linear(x.float(), w.float(), b.float())
ref = x @ w.T + b
err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
assert y.shape == (37, 200) and y.dtype == torch.float32, (y.shape, y.dtype)
assert err < 1e-5, err
# A call of any rows gives its rows the bits of a longer call's (same tile positions).
for n in (1, 5, 16, 17, 33):
    assert torch.equal(triton_linear(x[:n].float(), w.float(), b.float()), y[:n]), n
print("ok")
"""


def test_interpreted_kernel_computes_x_w_t_with_masked_edges_and_prefix_rows_equal():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True,
                          timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_kernel_compiles_for_an_h200_in_bfloat16_and_float32():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from target_worker import triton_linear as tlm

    signature = {name: "i32" for name in ("M", "N", "sxm", "sxk", "swn", "swk", "sym", "syn")}
    for dtype, precision, uses_mma in (("bf16", "tf32", True), ("fp32", "ieee", False)):
        src = triton.compiler.ASTSource(
            fn=tlm._linear_kernel,
            signature={"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "y_ptr": f"*{dtype}",
                       **signature, **dict.fromkeys(
                           ("K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "PRECISION"), "constexpr")},
            constexprs={"K": 576, "BLOCK_M": tlm.BLOCK_M, "BLOCK_N": tlm.BLOCK_N,
                        "BLOCK_K": tlm.BLOCK_K, "PRECISION": precision})
        try:
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
        except RuntimeError as exc:  # no ptxas / LLVM backend in this triton build
            pytest.skip(f"triton cannot compile for sm_90 here: {exc}")
        assert compiled.metadata.shared <= 228 * 1024
        # bfloat16 runs on the tensor cores; float32 in IEEE (never TF32) does not.
        assert ("mma" in compiled.asm["ptx"]) == uses_mma, dtype
