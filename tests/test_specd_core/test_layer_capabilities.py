"""`DrafterCapabilities.hidden_layers` (which target rows a hidden-conditioned drafter reads)
and the request's hidden-row log, which keeps those rows whatever their magnitude."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd_core.draft import DraftBlock, DrafterCapabilities, drafter_capabilities
from specd_core.request import FLOAT16_MAX, DecodeRequest, SpeculativeOptions
from specd_core.rule import GreedyRows


def test_hidden_layers_are_validated_and_stored_sorted():
    assert DrafterCapabilities().hidden_layers == ()
    caps = DrafterCapabilities(hidden_layers=[27, 2, np.int64(15)])
    assert caps.hidden_layers == (2, 15, 27) and all(type(i) is int for i in caps.hidden_layers)
    for bad, match in [((1, 1), "repeats"), ((-1,), "-1"), ((True,), "True"), ((1.5,), "1.5"),
                       (3, "sequence"), (("2",), "'2'")]:
        with pytest.raises(ValueError, match=match):
            DrafterCapabilities(hidden_layers=bad)
    with pytest.raises(ValueError, match="needs wants_hidden"):
        DrafterCapabilities(wants_hidden=False, hidden_layers=(2,))


def test_a_drafter_declaring_no_capabilities_has_its_hidden_layers_attribute_read():
    class Layered:
        hidden_layers = (4, 1, 2)

        def propose(self, history, target_hidden, max_len):
            raise AssertionError

    class Plain:
        def propose(self, history, target_hidden, max_len):
            raise AssertionError

    assert drafter_capabilities(Layered()).hidden_layers == (1, 2, 4)
    assert drafter_capabilities(Layered()).wants_hidden
    assert drafter_capabilities(Plain()).hidden_layers == ()
    declared = type("Declared", (), {"capabilities": DrafterCapabilities(hidden_layers=(3,)),
                                     "hidden_layers": (9,)})()
    assert drafter_capabilities(declared).hidden_layers == (3,)  # the object wins


def test_a_float16_log_turns_float32_for_a_row_beyond_float16s_range():
    """Residual streams are un-normed: a row holding a finite value past 65504 must not be
    kept as inf. The log widens once, keeping the rows it held; rows within range (or
    already inf) leave a float16 log as it is."""
    req = DecodeRequest([1, 2, 3], SpeculativeOptions(max_new_tokens=8),
                        hidden_dtype=torch.float16)
    prompt = torch.randn(3, 6)
    prompt[1, 2] = 60000.0
    req.on_prefill(GreedyRows((5,)), prompt)
    assert req.hidden_log().dtype == torch.float16
    assert torch.equal(req.hidden_log(), prompt.half())
    assert float(req.hidden_log().abs().max()) <= FLOAT16_MAX
    massive = torch.randn(1, 6)
    massive[0, 4] = 70000.0
    req.on_verify(DraftBlock.empty(), GreedyRows((6,)), massive)
    log = req.hidden_log()
    assert log.dtype == torch.float32 and log.shape == (4, 6)
    assert torch.equal(log[:3], prompt.half().float()) and torch.equal(log[3:], massive)
    # A row already inf (the target's own overflow) is no reason to widen.
    other = DecodeRequest([1, 2], SpeculativeOptions(max_new_tokens=8),
                          hidden_dtype=torch.float16)
    other.on_prefill(GreedyRows((5,)), torch.full((2, 6), float("inf")))
    assert other.hidden_log().dtype == torch.float16
