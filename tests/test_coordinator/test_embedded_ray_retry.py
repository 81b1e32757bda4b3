"""A failed embedded Ray start (`coordinator.cluster.service.init_embedded_ray`) leaves none of the
processes it started, and only Ray's startup timeout is retried.

`ray.init` is replaced by a fake that starts a real child through Ray's ``ConsolePopen`` (the
hook the embedded start wraps) and then fails as Ray does, so the test owns every process it
checks and no Ray runs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import ray
from ray._private import services

from coordinator.cluster.service import init_embedded_ray

TIMEOUT = Exception("The current node timed out during startup. This could happen because "
                    "some of the raylet failed to startup or the GCS has become overloaded.")


class FakeInit:
    """Each call starts one sleeping child via ``services.ConsolePopen`` (as Ray starts its
    GCS), then raises the next of ``errors`` (None: returns)."""

    def __init__(self, errors):
        self.errors = list(errors)
        self.children: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.children.append(services.ConsolePopen([sys.executable, "-c",
                                                    "import time; time.sleep(600)"]))
        error = self.errors.pop(0)
        if error is not None:
            raise error


@pytest.fixture
def fake_init(monkeypatch):
    made = []

    def make(errors):
        fake = FakeInit(errors)
        made.append(fake)
        monkeypatch.setattr(ray, "init", fake)
        monkeypatch.setattr(ray, "shutdown", lambda: None)  # another test's Ray may be up
        return fake

    yield make
    for fake in made:  # the one the successful start left, and any the code under test missed
        for child in fake.children:
            child.kill()
            child.wait()


def test_a_startup_timeout_kills_what_the_failed_start_began_and_starts_again(fake_init):
    fake = fake_init([TIMEOUT, None])
    init_embedded_ray(attempts=2)
    assert len(fake.children) == 2, "the start was not retried"
    first, second = fake.children
    assert first.returncode is not None, "the failed start's process was not killed and reaped"
    assert second.poll() is None, "the successful start's process was killed"


def test_the_last_startup_timeout_is_raised_and_leaves_no_process(fake_init):
    fake = fake_init([TIMEOUT, TIMEOUT])
    with pytest.raises(Exception, match="timed out during startup"):
        init_embedded_ray(attempts=2)
    assert len(fake.children) == 2
    for child in fake.children:
        assert child.returncode is not None, f"process {child.pid} of a failed start survived"


def test_another_start_error_is_raised_at_once_and_leaves_no_process(fake_init):
    fake = fake_init([RuntimeError("port 6379 in use"), None])
    with pytest.raises(RuntimeError, match="port 6379 in use"):
        init_embedded_ray(attempts=3)
    assert len(fake.children) == 1, "an error other than the startup timeout was retried"
    assert fake.children[0].returncode is not None


def test_attempts_below_one_are_refused():
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        init_embedded_ray(attempts=0)
