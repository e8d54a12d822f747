"""One writer per results file: a second holder fails naming the first's PID, --wait waits, a lock left by
a killed process is taken over, and the lock goes on success, error and Ctrl-C."""
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from quantlab.reporting.results import ResultsLocked, append_row, results_lock

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


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_at_the_lock_path_is_refused_and_its_target_untouched(tmp_path, dangling):
    reports, outside = tmp_path / "reports", tmp_path / "outside.txt"
    reports.mkdir()
    if not dangling:
        outside.write_text("precious\n")
    lock = reports / "exp.results.jsonl.lock"
    lock.symlink_to(outside)
    with pytest.raises(ValueError, match=rf"lock file {re.escape(str(lock))} is a symlink \(to .*outside\.txt\); "
                                         r".*remove it"):
        with results_lock(reports / "exp.results.jsonl"):
            pass
    assert (outside.read_text() == "precious\n") if not dangling else not outside.exists()  # never followed
    assert lock.is_symlink() and sorted(p.name for p in reports.iterdir()) == [lock.name]  # left as it was


@pytest.mark.parametrize("make,kind", [(os.mkdir, "a folder, not a regular file"), (os.mkfifo, "not a regular file")])
def test_anything_but_a_regular_file_at_the_lock_path_is_refused(tmp_path, make, kind):
    lock = tmp_path / "exp.results.jsonl.lock"
    make(lock)  # a FIFO there made the lock hang for good
    with pytest.raises(ValueError, match=rf"lock file {re.escape(str(lock))} is {kind}; .*remove it"):
        with results_lock(tmp_path / "exp.results.jsonl"):
            pass
    assert lock.exists()


def test_a_symlink_at_the_results_path_is_refused(tmp_path):
    reports, outside = tmp_path / "reports", tmp_path / "outside.jsonl"
    reports.mkdir()
    outside.write_text("precious\n")
    results = reports / "exp.results.jsonl"
    results.symlink_to(outside)
    match = rf"results file {re.escape(str(results))} is a symlink \(to .*outside\.jsonl\); .*remove it"
    with pytest.raises(ValueError, match=match):
        with results_lock(results):
            pass
    with pytest.raises(ValueError, match=match):
        append_row(results, {"run": "x"})
    assert outside.read_text() == "precious\n" and not (reports / "exp.results.jsonl.lock").exists()
