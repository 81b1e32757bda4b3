"""`specd_core.logprobs`: rows of raw log probabilities, the tokens a row can commit, and the
per-request records `DecodeRequest` keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd_core.draft import DraftBlock
from specd_core.logprobs import (
    MAX_TOP_LOGPROBS,
    check_top_count,
    commit_candidates,
    row_logprobs,
)
from specd_core.request import DecodeRequest, SpeculativeOptions
from specd_core.rule import GreedyRows, ProbRows, SparseProbRows, target_rows
from specd_core.sampling import SamplingParams


def logits(n: int = 3, vocab: int = 11, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_values_and_top_alternatives_are_the_raw_log_softmax():
    x = logits()
    lp = torch.log_softmax(x, -1)
    rows = row_logprobs(x, 4, [np.array([2, 2, 7]), np.array([0]), np.array([], dtype=np.int64)])
    assert len(rows) == 3
    assert rows.value(0, 7) == pytest.approx(float(lp[0, 7]))
    assert rows.value(1, 0) == pytest.approx(float(lp[1, 0]))
    top = torch.topk(lp, 4, dim=-1)
    assert rows.top_ids.tolist() == top.indices.tolist()
    assert np.allclose(rows.top_logprobs, top.values.numpy())
    # A listed alternative is readable too; anything else is a caller's bug.
    best = int(top.indices[2, 0])
    assert rows.value(2, best) == pytest.approx(float(top.values[2, 0]))
    with pytest.raises(KeyError, match="row 1"):
        rows.value(1, next(t for t in range(11) if t not in (0, *top.indices[1].tolist())))
    record = rows.record(0, 7, 2)
    assert record.token == 7 and len(record.top) == 2
    assert record.top[0] == (int(top.indices[0, 0]), pytest.approx(float(top.values[0, 0])))


def test_full_rows_answer_every_token_and_k_zero_lists_no_alternatives():
    x = logits()
    rows = row_logprobs(x, 0, [np.array([], dtype=np.int64)] * 3, full=True)
    lp = torch.log_softmax(x, -1)
    assert rows.top_ids.shape == (3, 0)
    assert all(rows.value(i, t) == pytest.approx(float(lp[i, t]))
               for i in range(3) for t in range(11))
    assert rows.record(1, 4, 0).top == ()


def test_commit_candidates_are_what_the_rule_can_commit():
    x = logits()
    greedy = target_rows(x, SamplingParams(), [1], 1)
    ids, full = commit_candidates(greedy, [5, 6])
    assert not full and [list(r) for r in ids] == [
        [greedy.argmax[0], 5], [greedy.argmax[1], 6], [greedy.argmax[2]]]
    sparse = SparseProbRows.from_dense(
        target_rows(x, SamplingParams(temperature=1.0, top_k=3), [1], 1).probs)
    ids, full = commit_candidates(sparse, [9])
    assert not full and sorted(set(ids[0].tolist())) == sorted({*sparse.row(0)[0].tolist(), 9})
    dense = target_rows(x, SamplingParams(temperature=1.0), [1], 1)
    assert isinstance(dense, ProbRows) and commit_candidates(dense)[1]
    assert isinstance(greedy, GreedyRows)


def test_top_counts_are_bounded():
    assert check_top_count("logprobs", None) is None
    assert check_top_count("logprobs", MAX_TOP_LOGPROBS) == MAX_TOP_LOGPROBS
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 1.0, True):
        with pytest.raises(ValueError, match="^logprobs"):
            check_top_count("logprobs", bad)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SpeculativeOptions(max_new_tokens=1, prompt_logprobs=21)


def test_decode_request_records_each_committed_tokens_row_in_order():
    """Accepted drafts read their own rows, the resample or bonus token the row after them,
    and a request that asked gets an error rather than silently missing values."""
    x = logits(4, 11, seed=1)
    lp = torch.log_softmax(x, -1)
    req = DecodeRequest([1, 2, 3], SpeculativeOptions(max_new_tokens=10, logprobs=1))
    first = target_rows(x[:1], SamplingParams(), [1, 2, 3], 3)
    req.on_prefill(first, None, row_logprobs(x[:1], 1, commit_candidates(first)[0]))
    anchor = req.generated[0]
    assert req.token_logprobs[0].logprob == pytest.approx(float(lp[0, anchor]))
    rows = target_rows(x[1:], SamplingParams(), [anchor], 3)
    draft = DraftBlock.deterministic([rows.argmax[0], (rows.argmax[1] + 1) % 11])  # 1 accepted
    lp_rows = row_logprobs(x[1:], 1, commit_candidates(rows, draft.tokens)[0])
    req.on_verify(draft, rows, None, lp_rows)
    assert req.generated[1:] == [rows.argmax[0], rows.argmax[1]]
    assert [r.logprob for r in req.token_logprobs[1:]] == pytest.approx(
        [float(lp[1, rows.argmax[0]]), float(lp[2, rows.argmax[1]])])
    with pytest.raises(ValueError, match="log probabilities"):
        req.on_verify(DraftBlock.empty(), GreedyRows((1,)), None, None)
