"""A target actor runs every torch call on its one `ComputeThread`, whichever thread calls
(Ray's method thread, the channel's connection threads), and errors reach the caller."""

from __future__ import annotations

import threading

import pytest
import torch

from specd_core.sampling import SamplingParams
from specd_core.step import PrefillItem, VerifyItem
from target_worker.actor import ComputeThread, TargetActor
from target_worker.tp import TPRank

MODEL = "tiny-random:vocab=32,seed=0,layers=2"


def _spy_forwards(actor) -> list[int]:
    idents: list[int] = []
    forward = actor.engine.decoder.forward_packed

    def spy(segments, last):
        idents.append(threading.get_ident())
        return forward(segments, last)

    actor.engine.decoder.forward_packed = spy
    return idents


@pytest.mark.parametrize("cls", [TargetActor, TPRank])
def test_steps_from_any_thread_run_on_the_thread_that_loaded_the_model(cls):
    loaded_on = []
    name = "_load_rank" if cls is TPRank else "_load"
    real_load = getattr(cls, name)

    def load(self, *args):
        loaded_on.append(threading.get_ident())
        return real_load(self, *args)

    setattr(cls, name, load)
    try:
        actor = cls(MODEL, max_slots=2, num_threads=1)
    finally:
        setattr(cls, name, real_load)
    idents = _spy_forwards(actor)
    params = SamplingParams(temperature=0.0)

    def request(results: list) -> None:
        slot = actor.allocate()
        (out,) = actor.prefill([PrefillItem(slot, [1, 2, 3], params)])
        first = int(out.rows.argmax[0])
        (out,) = actor.verify([VerifyItem(slot, 3, [first, 5], params)])
        results.append((first, [int(t) for t in out.rows.argmax]))
        actor.free(slot)

    here: list = []
    request(here)
    there: list = []
    caller = threading.Thread(target=request, args=(there,))
    caller.start()
    caller.join(timeout=60)
    assert not caller.is_alive() and len(here) == len(there) == 1
    assert loaded_on and loaded_on[0] != threading.get_ident()
    assert len(idents) == 4 and set(idents) == {loaded_on[0]}  # 2 prefills, 2 verifies
    assert here == there  # the same request gives the same greedy rows from either thread


def test_an_engine_error_is_raised_in_the_calling_thread():
    actor = TargetActor(MODEL, max_slots=1, num_threads=1)
    with pytest.raises(ValueError, match="slot"):
        actor.free(12345)
    slot = actor.allocate()
    with pytest.raises(RuntimeError):
        actor.allocate()  # every slot in use
    actor.free(slot)


def test_a_bad_model_fails_the_construction_with_the_loaders_error():
    with pytest.raises(ValueError, match="nonsense"):
        TargetActor("tiny-random:nonsense=1", max_slots=1, num_threads=1)


def test_the_compute_thread_runs_nested_calls_directly_and_returns_results():
    compute = ComputeThread()
    outer = compute.run(lambda: (threading.get_ident(),
                                 compute.run(threading.get_ident)))
    assert outer[0] == outer[1] != threading.get_ident()
    assert compute.run(torch.get_num_threads) >= 1
