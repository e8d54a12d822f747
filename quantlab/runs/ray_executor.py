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
"""
from __future__ import annotations

import logging
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--executor ray needs Ray, which is not installed: pip install 'quantlab[ray]' "
                          "(bash scripts/setup.sh installs it)") from None
    return ray


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail within timeout_s, naming the address, when nothing listens there (Ray itself may wait much longer).

    "auto" (the cluster started on this machine by `ray start --head`) is left to Ray, which fails fast."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise ValueError(f"--address {address!r} is not 'auto' or host:port (e.g. the address `ray start --head` "
                         f"prints, 10.0.0.5:6379, or ray://10.0.0.5:10001)")
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as e:
        raise ConnectionError(f"cannot reach the Ray cluster at {address!r} ({host}:{port}): {e}; is `ray start "
                              f"--head` running there, and is the port open?") from None


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
        raise ConnectionError(f"cannot connect to the Ray cluster at {address!r}: {e}") from None
    return ray, True


def _remote_run(exp, run, data_dir, cache_dir, threads: int) -> dict:
    """On a worker: the whole run, returned as {"row": ...} or {"error": "..."} (never raises for the run's own
    failures, so Ray retries only dead workers)."""
    import torch

    from ..models.loading import resolve_device
    from .envinfo import environment
    from .evaluate import EvalContext, evaluate_run, result_row

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
    task = ray.remote(_remote_run).options(num_cpus=ex.num_cpus, num_gpus=ex.num_gpus, max_retries=ex.max_retries)
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
