"""A pytest plugin (tests/conftest.py loads it): a test that hangs on a mount fails, and
cleans up, within its time limit.

pytest-timeout's thread method ends a test past its limit by ending the whole process,
fixtures and all, which would leave the test's mount behind. So at nine tenths of the limit
(the `timeout` marker, else the `timeout` ini value) this plugin first kills the daemons
that the test's `running_mount` calls hold and unmounts their mount points lazily
(testkit.mounts.abort_all): a read blocked on a stopped or stuck daemon then fails with an
error, the test fails, and its fixtures clean up as usual. pytest-timeout stays the last
resort at the full limit.
"""
from __future__ import annotations

import sys
import threading

import pytest

from testkit import mounts

SHARE = 0.9  # of the test's limit, when the guard acts


def limit_of(item) -> float:
    """The test's pytest-timeout limit in seconds (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0)
    else:
        try:
            value = item.config.getini("timeout")
        except ValueError:  # (no pytest-timeout)
            value = 0
    try:
        return float(value or 0)
    except (TypeError, ValueError):
        return 0.0


def _abort(name: str, limit: float) -> None:
    ended = mounts.abort_all()
    if ended:
        print(f"\ntestkit.guard: {name} passed {SHARE:.0%} of its {limit:g} s limit: killed the "
              f"daemons of {', '.join(ended)} and unmounted them", file=sys.stderr, flush=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = limit_of(item)
    timer = None
    if limit > 0:
        timer = threading.Timer(SHARE * limit, _abort, args=(item.nodeid, limit))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
