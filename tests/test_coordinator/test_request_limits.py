"""Request fields whose size a client controls are capped (one request must not slow every
stream beside it), and sampling values mean over gRPC what they mean in process."""

from __future__ import annotations

import grpc
import pytest
from service_harness import LocalService
from test_service import request, solo

from coordinator.front.generation_request import (
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from coordinator.front.grpc_api import sampling_from_proto
from specd.v1 import generation_pb2
from specd_core.sampling import SamplingParams


@pytest.fixture(scope="module")
def service():
    svc = LocalService().start()
    yield svc
    svc.stop()


def refused(service, req) -> str:
    channel, stub = service.stub()
    with channel, pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    return err.value.details()


def test_stop_lists_over_their_caps_are_refused_naming_the_field(service):
    many = request([1, 2, 3], max_new=4)
    many.stop.extend(f"s{i}" for i in range(MAX_STOP_STRINGS + 1))
    assert refused(service, many).startswith("stop: ")
    long = request([1, 2, 3], max_new=4)
    long.stop.extend(["ok", "x" * (MAX_STOP_STRING_BYTES + 1)])
    assert refused(service, long).startswith("stop[1]: ")
    ids = request([1, 2, 3], max_new=4)
    ids.stop_token_ids.extend([1] * (MAX_STOP_TOKEN_IDS + 1))
    assert refused(service, ids).startswith("stop_token_ids: ")
    within = request([1, 2, 3], max_new=4)
    within.stop.extend(f"s{i}" for i in range(MAX_STOP_STRINGS))
    channel, stub = service.stub()
    with channel:
        assert len(stub.GenerateUnary(within, timeout=30).token_ids) == 4


def test_float32_fields_carry_the_value_the_client_wrote():
    msg = generation_pb2.SamplingParams(temperature=0.7, repetition_penalty=0.01, top_p=0.9)
    assert msg.repetition_penalty != 0.01  # float32 on the wire
    assert sampling_from_proto(msg) == SamplingParams(temperature=0.7, repetition_penalty=0.01,
                                                      top_p=0.9)


def test_the_documented_lower_bound_and_a_seeded_sample_agree_with_in_process(service):
    req = request([3, 4, 5, 3, 4], max_new=16, seed=7, temperature=0.7,
                  repetition_penalty=0.01)
    channel, stub = service.stub()
    with channel:
        served = list(stub.GenerateUnary(req, timeout=30).token_ids)
    reference = solo(service, req)
    assert served == reference
