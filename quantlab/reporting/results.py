"""Results files: one JSON row per line, appended as each run finishes.

The one reader and writer of `*.results.jsonl` (and of the sensitivity cache, same format):
the runner appends, the sensitivity sweep caches, `quantlab report` and `compare` read.
`results_lock` keeps a second process from running the same experiment at the same time.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from datetime import UTC, datetime
from pathlib import Path

from ..util.checks import read_utf8

log = logging.getLogger(__name__)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in read_utf8(path).splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a crash: that run is simply redone
                log.warning("ignoring a truncated line in %s", path)
    return rows


def refuse_links(path: Path, what: str) -> None:
    """A ValueError naming `path` when a symlink, or anything but a regular file, is there (nothing there: fine).

    Results and lock files are written in place: following a link would write outside the reports folder."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        return
    if stat.S_ISLNK(mode):
        kind = f"a symlink (to {os.readlink(path)})"
    else:
        kind = "a folder, not a regular file" if stat.S_ISDIR(mode) else "not a regular file"
    raise ValueError(f"{what} {path} is {kind}; it must be a regular file (quantlab never writes through a link): "
                     f"remove it and run again")


def _open_no_follow(path: Path, flags: int, what: str) -> int:
    """os.open that refuses a symlink or non-regular file at `path` (naming it) instead of writing through it."""
    try:  # O_NONBLOCK: a FIFO or device there must not block the open
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):  # a link, a folder, a FIFO without reader
            raise
        refuse_links(path, what)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        refuse_links(path, what)
    return fd


def append_row(path: Path, row: dict) -> None:
    """One JSON line, flushed at once: a crash keeps every finished row. A symlink at `path` is refused."""
    fd = _open_no_follow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "results file")
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


def drop_rows(path: Path, run_keys: set[str]) -> int:
    """Rewrite the results file without the rows of `run_keys` (their runs are then redone); the other rows stay
    byte for byte, the file replaced in one rename. Returns how many rows went. Call it holding results_lock."""
    if not path.exists():
        return 0
    lines = read_utf8(path).splitlines(keepends=True)
    kept = [line for line in lines if not line.strip() or _row_key(line) not in run_keys]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(path.name + ".tmp")
    fd = _open_no_follow(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "results file")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _row_key(line: str) -> str | None:
    try:
        return json.loads(line).get("run_key")
    except json.JSONDecodeError:  # a line cut short by a crash stays: read_rows skips it
        return None


# ---- one writer per results file ---------------------------------------------------------

LOCK_SUFFIX = ".lock"


class ResultsLocked(RuntimeError):
    """Another live process holds the results file's lock."""


def _holder_text(path: Path) -> tuple[dict, str]:
    """(holder dict, description) from a lock file's contents (empty while the holder is writing them)."""
    try:
        holder = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        holder = {}
    if not isinstance(holder, dict) or "pid" not in holder:
        return {}, "another process (it has not written its PID yet)"
    return holder, f"PID {holder['pid']} on {holder.get('host', '?')} since {holder.get('started', '?')}"


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists but not ours, or unreadable: assume alive
    return True


def _try_lock(lock: Path) -> int | None:
    """An fd holding flock(LOCK_EX) on `lock` (the file that is still at that path), or None if held."""
    while True:
        fd = _open_no_follow(lock, os.O_RDWR | os.O_CREAT, "lock file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:  # the holder before us may have unlinked the file between our open and flock: retry on the new one
            if os.fstat(fd).st_ino == os.lstat(lock).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


@contextlib.contextmanager
def results_lock(results: str | Path, wait: bool = False, timeout_s: float | None = None, poll_s: float = 1.0,
                 report_every_s: float = 60.0):
    """Hold `<results>.lock` for the block: one writer per results file.

    The lock is an flock on the file (the kernel drops it when the holder dies, even by SIGKILL); the
    file names its holder (PID, host, start time) for the message the next process prints. A lock file
    left by a dead process is logged and taken over. Released on success, error and Ctrl-C. A symlink (or
    anything but a regular file) at the lock or results path is refused, naming it: never written through.

    wait=False: raise ResultsLocked at once, naming the holder. wait=True: poll every poll_s seconds,
    logging who holds it every report_every_s, and raise ResultsLocked after timeout_s (None: no limit).

    >>> with results_lock(Path("reports/x.results.jsonl")):
    ...     append_row(Path("reports/x.results.jsonl"), row)
    """
    lock = Path(str(results) + LOCK_SUFFIX)
    refuse_links(Path(results), "results file")  # checked before anything runs, not at the first row
    fd = _acquire(lock, wait, timeout_s, poll_s, report_every_s)
    try:
        yield lock
    finally:
        try:
            lock.unlink()  # while still holding it: a waiter that opened the old file sees it vanish, retries
        except FileNotFoundError:
            pass
        os.close(fd)


def _acquire(lock: Path, wait: bool, timeout_s: float | None, poll_s: float, report_every_s: float) -> int:
    """The locked fd, with our PID, host and start time written into the lock file."""
    start, last_report = time.monotonic(), None
    while (fd := _try_lock(lock)) is None:
        _, who = _holder_text(lock)
        waited = time.monotonic() - start
        if not wait:
            raise ResultsLocked(
                f"{lock.name[:-len(LOCK_SUFFIX)]} is being written by {who} (lock file {lock}); wait for it to "
                "finish, or run again with --wait to start as soon as it is free")
        if timeout_s is not None and waited >= timeout_s:
            raise ResultsLocked(f"gave up after waiting {waited:.0f} s for {lock}: still held by {who}")
        if last_report is None or time.monotonic() - last_report >= report_every_s:
            log.info("waiting for %s, held by %s", lock, who)
            last_report = time.monotonic()
        time.sleep(poll_s if timeout_s is None else max(0.0, min(poll_s, timeout_s - waited)))
    _take_over_if_stale(lock)
    stamp = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": datetime.now(UTC).isoformat(timespec="seconds")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(stamp).encode(), 0)
    return fd


def _take_over_if_stale(lock: Path) -> None:
    """We hold the flock; a holder still named in the file crashed without removing it: say so."""
    holder, who = _holder_text(lock)
    if not holder:
        return
    here = holder.get("host") == socket.gethostname()
    state = "no longer running" if here and not _pid_alive(holder["pid"]) else "no longer holding it"
    log.warning("taking over the stale lock %s left by %s (%s)", lock, who, state)


def select_rows(rows: list[dict], meta: dict | None, where: str) -> list[dict]:
    """The rows a report shows: the sidecar's run keys in order, else the latest row per run name."""
    if meta is None:
        latest = {}
        for row in rows:
            latest.pop(row["run"], None)
            latest[row["run"]] = row
        order = list(dict.fromkeys(r["run"] for r in rows))
        return [latest[name] for name in order]
    by_key = {r["run_key"]: r for r in rows}  # a rerun of the same key appends: the last one wins
    missing = [k for k in meta["run_keys"] if k not in by_key]
    if missing:
        raise ValueError(f"{where}: the sidecar lists run key(s) {', '.join(missing)} that the results file lacks: "
                         "the sidecar belongs to another results file")
    return [by_key[k] for k in meta["run_keys"]]
