"""Data-parallel QAT with torch.distributed: `[execution] qat_processes = N` (or `processes=N` to train()).

The calling process becomes rank 0 and spawns ranks 1..N-1, each with its own copy of the prepared model,
the teacher and the training windows. Every rank wraps the model in DistributedDataParallel (gloo on CPU,
nccl on CUDA: rank r on cuda:r) and takes its shard of each step's seeded windows (window i of the global
batch goes to rank i mod N), so the global batch, the averaged gradient and every optimizer step are those of
one process with the same batch_size (within fp32 all-reduce round-off). Rank 0 alone writes checkpoints, and
its model is the one the run converts and evaluates; ranks 1..N-1 exit when training ends. Resume reads the
same checkpoint on every rank.

    train(model, windows, settings, teacher, processes=2)     # 2 CPU processes, batch_size split between them
"""
from __future__ import annotations

import copy
import datetime
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(minutes=30)  # a rank that dies makes the others fail after this, not hang forever


def rank_world() -> tuple[int, int]:
    """(rank, world size) of the current process group, (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_mean(value: float) -> float:
    """The mean of a float over the ranks (the value itself without a process group)."""
    world = rank_world()[1]
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world


def shard(indices: list[int]) -> list[int]:
    """This rank's part of a global batch's window indices."""
    rank, world = rank_world()
    return indices[rank::world]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world: int, port: int, cuda: bool) -> None:
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=TIMEOUT)


def _child(rank: int, world: int, port: int, cuda: bool, train_fn: Callable, args: tuple, kwargs: dict) -> None:
    model, data, settings, teacher = args
    # spawn hands CPU tensors over in shared memory: without a private copy, every rank's optimizer step would
    # land on rank 0's parameters too (the teacher and the windows are only read, so they stay shared)
    model = copy.deepcopy(model)
    if cuda:
        torch.cuda.set_device(rank)
        model, teacher = model.to(f"cuda:{rank}"), None if teacher is None else teacher.to(f"cuda:{rank}")
    _init(rank, world, port, cuda)
    try:
        train_fn(model, data, settings, teacher, **kwargs)
    finally:
        dist.destroy_process_group()


def run_data_parallel(processes: int, train_fn: Callable, model, data, settings, teacher, **kwargs) -> dict:
    """train_fn on `processes` ranks (this process is rank 0); returns rank 0's result."""
    if processes > 1 and settings.batch_size % processes:
        raise ValueError(f"qat_processes = {processes} must divide batch_size = {settings.batch_size} (each rank "
                         f"takes batch_size / qat_processes windows of every micro-batch)")
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda and torch.cuda.device_count() < processes:
        raise ValueError(f"qat_processes = {processes} on CUDA needs {processes} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    port = _free_port()
    ctx = mp.get_context("spawn")
    child_kwargs = {**kwargs, "progress": False}
    # handing tensors to spawned processes moves their storage into shared memory: give the children copies, so
    # the caller's model and teacher (a run's float reference, checked for in-place changes) stay as they were
    payload = (copy.deepcopy(model), data, settings, None if teacher is None else copy.deepcopy(teacher))
    procs = [ctx.Process(target=_child, args=(r, processes, port, cuda, train_fn, payload, child_kwargs), daemon=True)
             for r in range(1, processes)]
    for p in procs:
        p.start()
    _init(0, processes, port, cuda)
    try:
        stats = train_fn(model, data, settings, teacher, **kwargs)
    finally:
        dist.destroy_process_group()
        for p in procs:
            p.join(timeout=60)
    failed = [r for r, p in enumerate(procs, 1) if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"QAT rank(s) {failed} exited with an error (exit codes "
                           f"{[procs[r - 1].exitcode for r in failed]}); rank 0's result is not used")
    return {**stats, "train_processes": processes}
