"""Waiting on a condition with a deadline (never a sleep that waits out a race)."""

from __future__ import annotations

import time

import pytest


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition"):
    """Polls ``condition()`` every 10 ms until it is truthy and returns that value; fails the
    test naming ``what`` once ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not reached within {timeout_s} s")
        time.sleep(0.01)
