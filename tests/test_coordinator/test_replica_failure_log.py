"""A replica that dies is one readable log line (which replica, what happened, what its
requests get, that it is re-created), Ray's raw report (pid, address, actor id) only at
DEBUG."""

from __future__ import annotations

import logging

import grpc
import pytest
from polling import wait_until
from service_harness import LocalService, run_in_thread
from test_service import REPEATING, request, stream_tokens
from test_supervision import INTERNALS, dying_replica, on_loop, replica_states

from coordinator.cluster.failures import death_summary


def test_a_dead_replica_is_one_clear_error_line_and_the_raw_report_is_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="coordinator")
    svc = LocalService(replicas=1, drafters=1, max_active=4, restart_delay_s=0.01).start()
    try:
        dying = dying_replica(svc)
        stream = run_in_thread(stream_tokens, svc, request(REPEATING, max_new=30))
        wait_until(dying.reached.is_set, what="a verify in flight")
        on_loop(svc, dying.release.set)  # the replica dies under the stream
        with pytest.raises(grpc.RpcError):
            stream.result(timeout=30)
        wait_until(lambda: replica_states(svc) == {"replica-0": "serving"}, what="restarted")
    finally:
        svc.stop()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR
               and r.name == "coordinator.cluster.replica"]
    assert line.startswith("replica replica-0 is out of service: a verify call failed: its "
                           "Ray actor died (RayActorError); 1 request(s) in flight failed"), line
    assert line.endswith("re-creating it") and "\n" not in line
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    for token in INTERNALS[:3]:  # Ray's pid, node address, actor id: DEBUG only
        assert not any(token in text for text in shown), (token, shown)
    raw = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG
           and "4242" in r.getMessage()]
    assert raw, "Ray's raw report is kept at DEBUG"
    assert any("replica replica-0 restarted" in r.getMessage() for r in caplog.records)


def test_death_summary_names_the_kind_never_rays_report():
    import ray.exceptions

    from coordinator.step.errors import ReplicaFailed

    raw = ray.exceptions.ActorDiedError()
    assert death_summary(raw) == "its Ray actor died (ActorDiedError)"
    wrapped = RuntimeError("a task failed")
    wrapped.__cause__ = raw
    assert death_summary(wrapped) == "its Ray actor died (ActorDiedError)"
    assert death_summary(ReplicaFailed("stalled: idle\nmore")) == "stalled: idle"
