"""The run lock: a fast, early failure for a second run, never a pipeline stuck for good."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from cdc_join.errors import ConcurrentRunError
from cdc_join.run.runlog import OTHER_HOST_STALE_S, UNKNOWN_OWNER_STALE_S, _acquire


def _lock(tmp_path, holder: dict | None, *, age_s: float = 0.0) -> str:
    path = tmp_path / "lock"
    path.write_text("" if holder is None else json.dumps(holder))
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return str(path)


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _taken_by_us(path: str) -> bool:
    return json.loads(open(path).read())["pid"] == os.getpid()


def test_a_live_holder_on_this_host_keeps_the_lock(tmp_path):
    path = _lock(tmp_path, {"pid": os.getppid(), "host": socket.gethostname(), "since": time.time()})
    with pytest.raises(ConcurrentRunError, match="another run of this pipeline holds"):
        _acquire(path)


@pytest.mark.parametrize("pid", ["gone", "ours"])
def test_a_lock_of_a_process_that_is_gone_is_taken_over(tmp_path, pid):
    # "ours": a container restarted with the same pid (1, say) finds its predecessor's lock.
    holder_pid = _gone_pid() if pid == "gone" else os.getpid()
    path = _lock(tmp_path, {"pid": holder_pid, "host": socket.gethostname(), "since": time.time() - 5})
    _acquire(path)
    assert _taken_by_us(path)


def test_a_lock_without_an_owner_is_taken_over_once_it_is_old(tmp_path):
    # A run killed between creating the file and writing its owner.
    with pytest.raises(ConcurrentRunError, match="owner unknown"):
        _acquire(_lock(tmp_path, None))
    path = _lock(tmp_path, None, age_s=UNKNOWN_OWNER_STALE_S + 5)
    _acquire(path)
    assert _taken_by_us(path)


def test_a_lock_of_another_host_is_honoured_for_hours_then_taken_over(tmp_path):
    recent = {"pid": 1, "host": "gone-cluster-driver", "since": time.time() - 3600}
    with pytest.raises(ConcurrentRunError, match="gone-cluster-driver"):
        _acquire(_lock(tmp_path, recent))
    path = _lock(tmp_path, {**recent, "since": time.time() - OTHER_HOST_STALE_S - 60})
    _acquire(path)
    assert _taken_by_us(path)


def test_a_lock_this_process_holds_is_not_taken_over_by_its_second_run(tmp_path):
    from cdc_join.run.runlog import _HELD

    path = _lock(tmp_path, {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    _HELD.add(path)  # a run in another thread of this process holds it
    try:
        with pytest.raises(ConcurrentRunError):
            _acquire(path)
    finally:
        _HELD.discard(path)
