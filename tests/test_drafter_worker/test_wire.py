"""The drafter worker's wire format (`drafter_worker.wire`): tensors and draft blocks to and
from their protobuf messages."""

from __future__ import annotations

import pytest
import torch

from drafter_worker.wire import block_from_proto, block_to_proto, tensor_from_proto, tensor_to_proto
from specd.v1 import drafter_pb2
from specd_core.draft import DraftBlock, DraftDist


def test_float32_tensor_round_trip_is_exact_and_little_endian_row_major():
    t = torch.randn(3, 5, 7)
    t[0, 0, 0] = float("inf")
    msg = tensor_to_proto(t)
    assert msg.dtype == "float32" and list(msg.shape) == [3, 5, 7]
    back = tensor_from_proto(msg)
    assert back.dtype == torch.float32 and back.shape == t.shape
    assert torch.equal(back, t)
    one = tensor_to_proto(torch.tensor([[1.0, 2.0]]))
    assert one.data == b"\x00\x00\x80\x3f" + b"\x00\x00\x00\x40"
    empty = tensor_from_proto(tensor_to_proto(torch.zeros(0, 4)))
    assert empty.shape == (0, 4)


@pytest.mark.parametrize("dtype, torch_dtype, rel", [
    ("float16", torch.float16, 2.0 ** -11), ("bfloat16", torch.bfloat16, 2.0 ** -8),
])
def test_half_precision_round_trip_loses_only_the_cast(dtype, torch_dtype, rel):
    t = torch.randn(4, 64) * 10
    msg = tensor_to_proto(t, dtype)
    assert len(msg.data) == t.numel() * 2
    back = tensor_from_proto(msg)
    assert back.dtype == torch.float32
    assert torch.equal(back, t.to(torch_dtype).float())
    assert torch.allclose(back, t, rtol=rel, atol=0)


def test_bad_dtype_and_size_mismatch_raise_value_error_naming_them():
    with pytest.raises(ValueError, match="float64"):
        tensor_to_proto(torch.zeros(2), "float64")
    with pytest.raises(ValueError, match="int8"):
        tensor_from_proto(drafter_pb2.Tensor(dtype="int8", shape=[1], data=b"\x00"))
    with pytest.raises(ValueError, match="size mismatch"):
        tensor_from_proto(drafter_pb2.Tensor(dtype="float32", shape=[2, 3], data=bytes(20)))


def test_block_round_trip_keeps_tokens_and_sparse_dists():
    block = DraftBlock(
        [5, 2], [DraftDist([(5, 0.7), (1, 0.2), (9, 0.1)]), DraftDist.deterministic(2)]
    )
    back = block_from_proto(block_to_proto(block))
    assert back.tokens == (5, 2)
    for got, want in zip(back.dists, block.dists, strict=True):
        assert [t for t, _ in got.support()] == [t for t, _ in want.support()]
        for (_, p), (_, q) in zip(got.support(), want.support(), strict=True):
            assert p == pytest.approx(q, rel=1e-7)
    assert block_from_proto(block_to_proto(DraftBlock.empty())).is_empty()
    bad = drafter_pb2.DraftBlock(tokens=[1], dists=[drafter_pb2.DraftDist(tokens=[1, 2],
                                                                          probs=[1.0])])
    with pytest.raises(ValueError, match="2 tokens but 1 probs"):
        block_from_proto(bad)
