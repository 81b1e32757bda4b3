"""`payload_bytes`: a step's size counted from its structure, without serialising it."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from specd_core.rule import GreedyRows, SparseProbRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, StepOutput, VerifyItem, payload_bytes


def test_every_member_counts_by_the_documented_sizes():
    item = VerifyItem(slot=3, start_pos=500, tokens=list(range(11)),
                      sampling=SamplingParams(temperature=0.7), want_hidden=True)
    sampling = 8 * len(dataclasses.fields(SamplingParams))
    # slot, start_pos, tokens, sampling, want_hidden, logprobs (None), mask (None)
    assert payload_bytes([item]) == 8 + 8 + 8 * 11 + sampling + 1 + 1 + 1
    prefill = PrefillItem(slot=1, tokens=[5] * 300, sampling=SamplingParams())
    # slot, start_pos, offset, tokens, sampling, want_hidden, last, the three log
    # probability fields (None) and the mask (None)
    assert (payload_bytes([item, prefill])
            == payload_bytes(item) + 8 + 8 + 8 + 8 * 300 + sampling + 1 + 1 + 3 + 1)
    # A grammar mask counts its bytes: int32 [rows, words].
    masked = dataclasses.replace(item, mask=np.zeros((12, 2), dtype=np.int32))
    assert payload_bytes(masked) == payload_bytes(item) - 1 + 12 * 2 * 4
    hidden = torch.zeros(11, 16)
    out = StepOutput(GreedyRows(tuple(range(11))), hidden)
    assert payload_bytes(out) == 8 * 11 + 11 * 16 * 4 + 1
    assert payload_bytes(StepOutput(GreedyRows((1,)), None)) == 8 + 1 + 1
    sparse = SparseProbRows(np.array([0, 2], dtype=np.int64), np.array([4, 9], dtype=np.int32),
                            np.array([0.25, 0.75], dtype=np.float32), 49152)
    assert payload_bytes(sparse) == 16 + 8 + 8 + 8
    with pytest.raises(TypeError, match="object"):
        payload_bytes(object())


def test_a_rows_heavy_step_counts_within_two_percent_of_its_pickled_size():
    gen = torch.Generator().manual_seed(0)
    outs = [StepOutput(GreedyRows(tuple(range(11))), torch.randn(11, 576, generator=gen))
            for _ in range(4)]
    pickled = len(pickle.dumps(outs, protocol=5))
    assert 0.98 * pickled <= payload_bytes(outs) <= pickled
