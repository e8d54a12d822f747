"""One writer per results file: a second holder fails naming the first's PID, --wait waits, a lock left by
a killed process is taken over, and the lock goes on success, error and Ctrl-C."""
import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest

from quantlab.reporting.results import ResultsLocked, results_lock

HOLDER = """
import sys, time
from quantlab.reporting.results import results_lock
with results_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_second_acquisition_fails_naming_the_pid(tmp_path):
    results = tmp_path / "exp.results.jsonl"
    with results_lock(results) as lock:
        assert lock.name == "exp.results.jsonl.lock"
        holder = json.loads(lock.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["started"]
        with pytest.raises(ResultsLocked, match=rf"exp\.results\.jsonl is being written by PID {os.getpid()} on "
                                                rf"{socket.gethostname()} since .*; wait for it to finish, or run "
                                                r"again with --wait"):
            with results_lock(results):
                pass
    assert not lock.exists()  # released and removed
    with results_lock(results):  # free again
        pass


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_released_on_error_and_ctrl_c(tmp_path, exc):
    results = tmp_path / "exp.results.jsonl"
    with pytest.raises(type(exc)):
        with results_lock(results):
            raise exc
    assert not (tmp_path / "exp.results.jsonl.lock").exists()
    with results_lock(results):
        pass


def test_wait_blocks_until_the_holder_releases(tmp_path, lock_held_elsewhere):
    results = tmp_path / "exp.results.jsonl"
    with lock_held_elsewhere(results, 0.5) as released_at, results_lock(results, wait=True, poll_s=0.02):
        acquired_at = time.time()
    assert acquired_at >= released_at[0]  # never while the other one held it


def test_wait_gives_up_after_the_timeout_naming_the_holder(tmp_path):
    results = tmp_path / "exp.results.jsonl"
    with results_lock(results):
        t0 = time.monotonic()
        with pytest.raises(ResultsLocked, match=rf"gave up after waiting \d+ s for .*exp\.results\.jsonl\.lock: still "
                                                rf"held by PID {os.getpid()}"):
            with results_lock(results, wait=True, timeout_s=0.2, poll_s=0.05):
                pass
        assert 0.2 <= time.monotonic() - t0 < 5


def test_stale_lock_of_a_dead_pid_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / "exp.results.jsonl.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "2024-01-01T00:00:00+00:00"}))
    with caplog.at_level(logging.WARNING, logger="quantlab.reporting.results"):
        with results_lock(tmp_path / "exp.results.jsonl"):
            assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"taking over the stale lock {lock} left by PID {dead.pid} on {socket.gethostname()}" in caplog.text
    assert "(no longer running)" in caplog.text


def test_lock_of_a_killed_process(tmp_path, caplog):
    """Another process holds it (we fail naming its PID); once it is killed (SIGKILL: no cleanup) we take over."""
    results = tmp_path / "exp.results.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(results)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd())
    try:
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(ResultsLocked, match=rf"being written by PID {proc.pid} on "):
            with results_lock(results):
                pass
    finally:
        proc.kill()
        proc.wait()
    assert (tmp_path / "exp.results.jsonl.lock").exists()  # left behind
    with caplog.at_level(logging.WARNING, logger="quantlab.reporting.results"):
        with results_lock(results):
            pass
    assert f"left by PID {proc.pid}" in caplog.text and "(no longer running)" in caplog.text
