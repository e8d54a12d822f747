"""Shared validation: the one integer check, the one dtype table and the one name rule (names become
file names) that every config and protocol uses; text files read as UTF-8, naming the file when not.

>>> check_int("bits", 4, 2, 8)            # passes
>>> check_int("seq_len", 0, 1)            # ValueError: seq_len must be an integer >= 1, got 0
>>> resolve_dtype("bfloat16"), dtype_bytes("float16")
(torch.bfloat16, 2)
"""
from __future__ import annotations

from pathlib import Path

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


NAME_RULE = ("a non-empty name without '/', '\\' or control characters that does not start with '.' "
             "(it becomes part of file names)")


def check_choice(field: str, value, known) -> None:
    """Raise ValueError naming `value` and the `known` ones unless value is one of them."""
    if value not in known:
        raise ValueError(f"unknown {field} {value!r}; known: {', '.join(known)}")


def check_name(field: str, name) -> str:
    """`name` if it is safe as part of a file name (experiment, run, report prefixes), else a ValueError.

    Rejects path separators (a name "../../x" would write two directories up), a leading "." ("." / ".."
    and hidden files), control characters and empty names.

    >>> check_name("experiment name", "smollm2_quickstart")   # passes
    >>> check_name("run name", "../x")    # ValueError: run name '../x' contains '/'; it must be a non-empty name ...
    """
    if not isinstance(name, str) or not name.strip():
        problem = "is empty" if isinstance(name, str) else f"is of type {type(name).__name__}, not a string"
    elif "/" in name or "\\" in name:
        problem = "contains '/'" if "/" in name else "contains '\\'"
    elif name.startswith("."):
        problem = "starts with '.'"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "contains a control character"
    else:
        return name
    raise ValueError(f"{field} {name!r} {problem}; it must be {NAME_RULE}")


def utf8_error(path, error: UnicodeDecodeError) -> ValueError:
    """A ValueError naming the file and the codec's complaint, for a text file that is not UTF-8."""
    return ValueError(f"{path}: not a UTF-8 text file ({error}); save it as UTF-8")


def read_utf8(path) -> str:
    """The file's text; a file that is not UTF-8 fails naming itself and the bad byte's position.

    >>> read_utf8("experiments/smollm2_quickstart.toml")[:6]
    'name ='
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise utf8_error(path, e) from None
