"""`quantlab run FILE --executor ray [--address ADDR]`: each pending run is one Ray task.

A task loads the model by name on its worker (each node converts / reads its own model cache, or the cache dir
points at shared storage), builds the run's windows there (tokenized text is cached on the node's disk, so
once per node, not once per run), quantizes, evaluates and returns its row. The experiment itself goes through
Ray's object store once. The driver stays the only writer of results.jsonl: it appends rows as they arrive, in
any order (the report keeps the experiment's run order), so resume and --force behave as with the local
executor. Failures:
- a run that raises on a worker comes back as that run's error (not retried: it would raise again), and the
  other runs go on;
- a worker process that dies is retried by Ray up to `[execution] max_retries` times; its row appears once,
  since only the driver writes rows and only from a task's return value;
- Ctrl-C on the driver cancels the pending tasks and keeps every finished row.

Per-run resources come from `[execution]`: num_cpus (torch threads on the worker), num_gpus, max_retries.
Plugins (`plugins = [...]`, util/plugins.py) found beside the experiment file reach the workers through their
PYTHONPATH (runtime_env), which serves a local Ray or nodes sharing that folder; on other clusters install them.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from ..util.plugins import plugin_folders

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


class RayUnavailable(ConnectionError, RuntimeError):
    """Ray cannot be reached at the address given (a RuntimeError too: the CLI prints it in one line)."""


class RayMissing(ImportError, RuntimeError):
    """Ray is not installed (a RuntimeError too: the CLI prints it in one line)."""


def import_ray():
    try:
        import ray
    except ImportError:
        raise RayMissing("--executor ray needs Ray, which is not installed: pip install 'quantlab[ray]' "
                         "(bash scripts/setup.sh installs it)") from None
    return ray


# An HTTP/2 client's first bytes: the connection preface, then an empty SETTINGS frame. Ray's GCS and Ray Client
# servers are gRPC, so HTTP/2, and must answer with their own SETTINGS frame (RFC 9113 3.4) -- or, with
# RAY_USE_TLS, a TLS record. Anything else (an HTTP/1 page, silence) is not Ray: ray.init would retry for minutes.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS, TLS_RECORDS = 4, (0x15, 0x16)  # frame type at byte 3; TLS alert / handshake record types


def _probe(host: str, port: int, timeout_s: float) -> bytes:
    """The first bytes (up to 9) the service at host:port answers the HTTP/2 preface with; b"" if it hangs up.
    OSError when nothing listens; TimeoutError when it listens but stays silent."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(HTTP2_PREFACE)
        reply = b""
        while len(reply) < 9 and (chunk := sock.recv(9 - len(reply))):
            reply += chunk
        return reply


def _speaks_ray(reply: bytes) -> bool:
    """Whether a probe's reply could come from Ray: a gRPC server's SETTINGS frame, or TLS."""
    return (len(reply) == 9 and reply[3] == HTTP2_SETTINGS) or (reply[:1] != b"" and reply[0] in TLS_RECORDS)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail within ~2 x timeout_s, naming the address, when nothing Ray answers there: nothing listens, or a
    service that is not Ray (an HTTP server, a silent listener). Ray itself would retry for minutes, printing
    gRPC warnings. "auto" (the cluster started on this machine by `ray start --head`) is left to Ray.

    >>> check_reachable("127.0.0.1:1")   # RayUnavailable: cannot reach the Ray cluster at '127.0.0.1:1' ..."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is not a number, or out of range
        host = port = None
    if not host or not port:
        raise ValueError(f"--address {address!r} is not 'auto' or host:port (e.g. the address `ray start --head` "
                         f"prints, 10.0.0.5:6379, or ray://10.0.0.5:10001)")
    where = f"the Ray cluster at {address!r} ({host}:{port})"
    hint = "use the address `ray start --head` printed (host:6379, or ray://host:10001 for Ray Client)"
    try:
        reply = _probe(host, port, timeout_s)
    except TimeoutError:
        raise RayUnavailable(f"cannot reach {where}: it accepts connections but stays silent for {timeout_s:g} s; "
                             f"nothing Ray answers there: {hint}") from None
    except OSError as e:
        raise RayUnavailable(f"cannot reach {where}: {e.strerror or e}; nothing Ray answers there: is `ray start "
                             f"--head` running there, and is the port open?") from None
    if not _speaks_ray(reply):
        raise RayUnavailable(f"cannot reach {where}: a service that is not Ray listens there (it answered "
                             f"{reply!r}); nothing Ray answers there: {hint}")


def connect(address: str | None):
    """ray.init on the cluster at `address`, or a local instance when None; reuses an already started Ray.
    Returns (ray, started_here)."""
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    if address is not None:
        check_reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    except ConnectionError as e:
        raise RayUnavailable(f"cannot connect to the Ray cluster at {address!r}: {e}") from None
    return ray, True


def _remote_run(exp, run, data_dir, cache_dir, threads: int) -> dict:
    """On a worker: the whole run, returned as {"row": ...} or {"error": "..."} (never raises for the run's own
    failures, so Ray retries only dead workers)."""
    import torch

    from ..models.loading import resolve_device
    from .context import EvalContext
    from .envinfo import environment
    from .evaluate import evaluate_run, result_row

    torch.set_num_threads(max(1, threads))
    device = resolve_device(exp.device)
    try:
        ctx = EvalContext(exp, device, data_dir, cache_dir, progress=False)
        metrics = evaluate_run(ctx, run)
        return {"row": result_row(ctx, run, metrics, environment(device))}
    except Exception as e:  # noqa: BLE001 - the run's own failure: reported, not retried
        return {"error": f"{type(e).__name__}: {e}"}


def run_pending_ray(exp, pending: list, results: Path, data_dir, cache_dir, address: str | None) -> list[str]:
    """Submit every pending run, append rows as they come back; returns "name: error" per failed run."""
    from ..reporting.results import append_row

    ray, started = connect(address)
    ex = exp.execution
    options = {"num_cpus": ex.num_cpus, "num_gpus": ex.num_gpus, "max_retries": ex.max_retries}
    folders = plugin_folders()
    if folders:  # the run's configs unpickle on the worker: plugins beside the experiment file must import
        path = os.pathsep.join(folders + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        options["runtime_env"] = {"env_vars": {"PYTHONPATH": path}}
    task = ray.remote(_remote_run).options(**options)
    exp_ref = ray.put(exp)  # once, not once per task
    threads = max(1, int(ex.num_cpus))
    refs = {task.remote(exp_ref, run, data_dir, cache_dir, threads): run for run in pending}
    failures, t0, finished = [], time.perf_counter(), 0
    try:
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            run = refs.pop(done[0])
            finished += 1
            try:
                out = ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - the worker died more than max_retries times, or the task was lost
                out = {"error": f"{type(e).__name__} after {ex.max_retries} retries: {str(e).splitlines()[0]}"}
            if "row" in out:
                append_row(results, out["row"])
                log.info("[%d/%d] %s done (%.0f s since start)", finished, len(pending), run.name,
                         time.perf_counter() - t0)
            else:
                log.error("run %r failed: %s", run.name, out["error"])
                failures.append(f"{run.name}: {out['error']}")
    except KeyboardInterrupt:
        for ref in refs:
            ray.cancel(ref, force=True)
        log.warning("interrupted: cancelled %d pending run(s); %d finished row(s) kept in %s",
                    len(refs), finished - len(failures), results)
        raise
    finally:
        if started:
            ray.shutdown()
    return failures
