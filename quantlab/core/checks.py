"""Shared validation: the one integer check and the one dtype table every config and protocol uses.

>>> check_int("bits", 4, 2, 8)            # passes
>>> check_int("seq_len", 0, 1)            # ValueError: seq_len must be an integer >= 1, got 0
>>> resolve_dtype("bfloat16"), dtype_bytes("float16")
(torch.bfloat16, 2)
"""
from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def check_int(field: str, value, lo: int | None = None, hi: int | None = None, allow_none: bool = False) -> None:
    """Raise a ValueError naming `field` unless value is an int (not a bool) within [lo, hi] (None: unbounded)."""
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (lo is None or value >= lo) and (hi is None or value <= hi):
        return
    if lo is not None and hi is not None:
        want = f"an integer in {lo}..{hi}"
    elif lo is not None:
        want = f"an integer >= {lo}"
    elif hi is not None:
        want = f"an integer <= {hi}"
    else:
        want = "an integer"
    raise ValueError(f"{field} must be {want}{' or omitted' if allow_none else ''}, got {value!r}")


def check_dtype(field: str, name, known=DTYPES) -> str:
    """`name` if it is a key of the dtype table (or of `known`, a subset of its names), else a ValueError."""
    if name not in known:
        raise ValueError(f"unknown {field} {name!r}; known: {', '.join(known)}")
    return name


def resolve_dtype(dtype: str | torch.dtype, field: str = "dtype") -> torch.dtype:
    """A dtype name of the table (or a torch.dtype) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    return DTYPES[check_dtype(field, dtype)]


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name of the table."""
    return resolve_dtype(name).itemsize
