"""The channel's data format: every step type round-trips bit-exactly, and a message that does
not follow the format (another version, a wrong type or size, trailing bytes, msgpack
extensions, a pickle) is refused before anything is built from it."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
import torch

from specd_core.rule import GreedyRows, ProbRows, SparseProbRows
from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, StepOutput, VerifyItem
from target_worker.engine import SlotsExhausted
from target_worker.step_codec import (
    WIRE_VERSION,
    WireError,
    decode_call,
    decode_reply,
    encode_call,
    encode_error,
    encode_result,
)


def joined(chunks) -> bytes:
    return b"".join(bytes(memoryview(c)) for c in chunks)


def message(payload, buffers=(), version=WIRE_VERSION, sizes=None) -> bytes:
    header = msgpack.packb([version, payload, list(sizes if sizes is not None else
                                                   [len(b) for b in buffers])])
    return len(header).to_bytes(4, "little") + header + b"".join(buffers)


SAMPLING = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05,
                          repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5)


def test_calls_round_trip():
    prefill = [PrefillItem(slot=2, tokens=[1, 2, 3], sampling=SAMPLING, want_hidden=True,
                           start_pos=4, offset=1, last=False),
               PrefillItem(slot=0, tokens=[np.int64(9)], sampling=SamplingParams())]
    verify = [VerifyItem(slot=1, start_pos=7, tokens=[5, 6], sampling=SAMPLING,
                         want_hidden=True)]
    assert decode_call(joined(encode_call("prefill", (prefill,)))) == (
        "prefill", ([prefill[0], PrefillItem(0, [9], SamplingParams())],))
    assert decode_call(joined(encode_call("verify", (verify,)))) == ("verify", (verify,))
    # One step mixes verify blocks and prompt chunks (chunked prefill).
    mixed = [verify[0], prefill[0]]
    assert decode_call(joined(encode_call("verify", (mixed,)))) == ("verify", (mixed,))
    assert decode_call(joined(encode_call("allocate", ()))) == ("allocate", ())
    # The partition travels; a call without one asks in the shared partition ("").
    assert decode_call(joined(encode_call("allocate_prefix", ([1, 2], "tenant-a")))) == (
        "allocate_prefix", ([1, 2], "tenant-a"))
    assert decode_call(joined(encode_call("allocate_prefix", ([1, 2],)))) == (
        "allocate_prefix", ([1, 2], ""))
    assert decode_call(joined(encode_call("free", (3,)))) == ("free", (3,))
    assert decode_call(joined(encode_call("shutdown", ()))) == ("shutdown", ())


def test_grammar_masks_round_trip_and_bad_masks_are_refused():
    mask = np.array([[-1, 5], [7, 0]], dtype=np.int32)
    items = [VerifyItem(slot=1, start_pos=7, tokens=[5, 6], sampling=SAMPLING, mask=mask),
             PrefillItem(slot=2, tokens=[1], sampling=SAMPLING, mask=mask[:1])]
    _, (decoded,) = decode_call(joined(encode_call("verify", (items,))))
    assert decoded == items
    np.testing.assert_array_equal(decoded[0].mask, mask)
    np.testing.assert_array_equal(decoded[1].mask, mask[:1])
    assert decoded[0].mask.dtype == np.int32
    no_mask = decode_call(joined(encode_call("verify", ([VerifyItem(1, 7, [5], SAMPLING)],))))
    assert no_mask[1][0][0].mask is None
    bad = [1, 1, 7, [5], VERIFY[4], False, None, ["int64", [1, 2], 0], []]
    with pytest.raises(WireError, match="int32"):
        decode_call(message(["verify", [bad]], [np.zeros(2, "<i8").tobytes()]))


def test_hidden_layers_travel_with_every_item_and_bad_ones_are_refused():
    """Which residual streams a step's hidden rows are travels with its items (a per-step
    field: no replica keeps a setting); only a list of ints decodes."""
    items = [VerifyItem(slot=1, start_pos=7, tokens=[5, 6], sampling=SAMPLING, want_hidden=True,
                        hidden_layers=(1, 2, 4)),
             PrefillItem(slot=2, tokens=[1, 3], sampling=SAMPLING, want_hidden=True,
                         hidden_layers=(0, 5)),
             VerifyItem(slot=3, start_pos=2, tokens=[4], sampling=SAMPLING)]
    _, (decoded,) = decode_call(joined(encode_call("verify", (items,))))
    assert decoded == items
    assert [d.hidden_layers for d in decoded] == [(1, 2, 4), (0, 5), ()]
    full = [1, 1, 7, [5], VERIFY[4], True, None, None]
    for layers in ([1.0], [True], "1", None, [[1]]):
        with pytest.raises(WireError, match="hidden_layers|fields"):
            decode_call(message(["verify", [[*full, layers]]]))
    assert decode_call(message(["verify", [[*full, [2, 4]]]]))[1][0][0].hidden_layers == (2, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_outputs_round_trip_bit_exactly(dtype):
    dense = torch.softmax(torch.randn(3, 50), -1)
    sparse = SparseProbRows.from_dense(torch.where(dense > 0.03, dense, 0.0))
    outputs = [StepOutput(GreedyRows((1, 2, 3)), torch.randn(3, 8).to(dtype)),
               StepOutput(ProbRows(dense), None),
               StepOutput(sparse, torch.empty(0, 8, dtype=dtype)),
               StepOutput(None, None)]
    got = decode_reply("verify", joined(encode_result("verify", outputs)))
    assert got[0].rows == outputs[0].rows and got[0].hidden.dtype == dtype
    assert got[0].hidden.equal(outputs[0].hidden)
    assert got[1].rows.probs.equal(dense) and got[1].hidden is None
    for name in ("offsets", "token_ids", "probs"):
        a, b = getattr(got[2].rows, name), getattr(sparse, name)
        assert a.dtype == b.dtype and np.array_equal(a, b) and a.flags.writeable
    assert got[2].rows.vocab_size == 50 and got[2].hidden.shape == (0, 8)
    assert got[3] == StepOutput(None, None)
    assert decode_reply("allocate_prefix", joined(encode_result("allocate_prefix", (3, 0)))) \
        == (3, 0)
    assert decode_reply("free", joined(encode_result("free", None))) is None


def test_log_probabilities_round_trip_and_bad_shapes_are_refused():
    from specd_core.logprobs import RowLogprobs

    items = [PrefillItem(slot=0, tokens=[1, 2], sampling=SAMPLING, logprobs=2,
                         prompt_logprobs=3, next_token=7, last=False),
             VerifyItem(slot=1, start_pos=3, tokens=[4], sampling=SAMPLING, logprobs=0)]
    assert decode_call(joined(encode_call("verify", (items,)))) == ("verify", (items,))
    lp = RowLogprobs(np.array([[3, 1], [0, 2]], np.int32),
                     np.array([[-0.1, -2.0], [-0.5, -1.5]], np.float32),
                     np.array([0, 1, 3], np.int64), np.array([3, 0, 4], np.int32),
                     np.array([-0.1, -0.5, -4.0], np.float32))
    dense = RowLogprobs(lp.top_ids, lp.top_logprobs, lp.offsets, lp.token_ids, lp.logprobs,
                        np.log(np.full((2, 5), 0.2, np.float32)))
    got = decode_reply("verify", joined(encode_result("verify", [
        StepOutput(GreedyRows((3, 0)), None, lp), StepOutput(None, None, dense)])))
    for a, b in ((got[0].logprobs, lp), (got[1].logprobs, dense)):
        for name in ("top_ids", "top_logprobs", "offsets", "token_ids", "logprobs"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert got[0].logprobs.full is None and np.array_equal(got[1].logprobs.full, dense.full)
    # Offsets past the listed tokens: refused, never indexed.
    bad = RowLogprobs(lp.top_ids, lp.top_logprobs, np.array([0, 1, 9], np.int64),
                      lp.token_ids, lp.logprobs)
    with pytest.raises(WireError, match="inconsistent"):
        decode_reply("verify", joined(encode_result("verify", [StepOutput(None, None, bad)])))


def test_errors_arrive_as_their_type_or_runtime_error():
    with pytest.raises(SlotsExhausted, match="all 4"):
        decode_reply("allocate", joined(encode_error(SlotsExhausted("all 4 slots"))))
    with pytest.raises(ValueError, match="bad slot"):
        decode_reply("verify", joined(encode_error(ValueError("bad slot"))))

    class Custom(KeyError):
        pass

    with pytest.raises(KeyError, match="Custom"):  # the nearest listed base, named
        decode_reply("free", joined(encode_error(Custom("x"))))
    with pytest.raises(RuntimeError, match="SystemExit"):
        decode_reply("free", message([0, "SystemExit", "bye"]))


def test_encoding_refuses_what_the_format_does_not_carry():
    with pytest.raises(TypeError):
        encode_call("verify", ([{"slot": 1}],))
    with pytest.raises(TypeError):
        encode_result("verify", [StepOutput(GreedyRows((1,)), torch.zeros(2, dtype=torch.float64))])
    with pytest.raises(TypeError):
        encode_result("allocate", "0")
    with pytest.raises(ValueError):
        encode_call("free", ())
    with pytest.raises(ValueError):
        encode_call("shutdown", (1,))
    with pytest.raises(TypeError, match="partition"):
        encode_call("allocate_prefix", ([1], 7))
    with pytest.raises(ValueError):
        encode_call("allocate_prefix", ([1], "a", "b"))


VERIFY = [1, 1, 7, [5, 6], [0.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0], False]


@pytest.mark.parametrize("body", [
    message(["verify", [VERIFY]], version=2),                        # another version
    message(["verify", [VERIFY]]) + b"x",                             # trailing bytes
    message(["verify", [[1, True, 7, [5], VERIFY[4], False]]]),       # a bool slot
    message(["verify", [[1, 1, 7, [5.0], VERIFY[4], False]]]),        # a float token
    message(["verify", [[1, 1, 7, [5], VERIFY[4], 0]]]),              # an int want_hidden
    message(["verify", [[1, 1, 7, [5], [0.0, 0, 1.0, 0.0, 1.0, 0.0], False]]]),  # 6 fields
    message(["verify", [[1, 1, 7, [5], [-1.0, 0, 1.0, 0.0, 1.0, 0.0, 0.0], False]]]),  # temp
    message(["verify", [[1, 1, 7, [5], [0.0, False, 1.0, 0.0, 1.0, 0.0, 0.0], False]]]),
    message(["verify", [VERIFY[:5]]]),                                 # a missing field
    message(["verify", [[2, *VERIFY[1:]]]]),                           # an unknown kind
    message(["verify", [[True, *VERIFY[1:]]]]),                        # a bool kind
    message(["verify", {"items": []}]),                               # a map
    message(["allocate", 1]),                                         # args for allocate
    message(["allocate_prefix", [1, 2]]),                             # no partition
    message(["allocate_prefix", [1, 2], 5]),                          # an int partition
    message(["allocate_prefix", [1, 2], None]),                       # a None partition
    message(["allocate_prefix", [1, 2], "a", "b"]),                   # a third argument
    message(["allocate_prefix", [1.0, 2], "a"]),                      # a float token
    message(["shutdown", 1]),                                         # args for unknown
    message([7]),                                                     # no method name
    b"\x00\x00",                                                      # no header length
    (10).to_bytes(4, "little") + b"\xc1" * 10,                        # not msgpack
    message(["free", msgpack.ExtType(1, b"x")]),                      # an extension type
    message(["free", 1], sizes=[5]),                                  # buffers beyond it
    pickle.dumps(("allocate", ())),                                   # a pickle
])
def test_malformed_calls_are_refused(body):
    with pytest.raises(WireError):
        decode_call(body)


TENSOR_OK = ["float32", [2, 2], 0]


@pytest.mark.parametrize("rows,buffers", [
    ([1, ["float64", [2, 2], 0]], [b"\0" * 32]),                      # a dtype not carried
    ([1, ["float32", [2, 3], 0]], [b"\0" * 16]),                      # size != shape
    ([1, ["float32", [-1, 4], 0]], [b"\0" * 16]),                     # negative dim
    ([1, ["float32", [2, 2], 1]], [b"\0" * 16]),                      # no such buffer
    ([1, ["float32", [16], 0]], [b"\0" * 64]),                        # not 2-D probs
    ([2, ["int64", [2], 0], ["int32", [1], 1], ["float32", [1], 2], 10],
     [np.array([0, 3], "<i8").tobytes(), np.array([1], "<i4").tobytes(),
      np.array([1.0], "<f4").tobytes()]),                             # offsets past the ids
    ([9, 1], []),                                                     # unknown rows kind
])
def test_malformed_outputs_are_refused(rows, buffers):
    with pytest.raises(WireError):
        decode_reply("verify", message([1, [[rows, None]]], buffers))
