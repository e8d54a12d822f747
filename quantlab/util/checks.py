"""Shared validation: the one integer check, the one dtype table and the one name rule (names become
file names) that every config and protocol uses, the reports folder check; text files read as UTF-8, naming the
file when not.

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


NAME_MAX_BYTES = 200  # file systems cap a file name at 255 bytes; <name>_full.ppl_vs_decode_latency.png must fit
BIDI_CONTROLS = frozenset(map(chr, [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]))  # LRE..RLO, LRI..PDI
NAME_RULE = ("a non-empty name without '/', '\\' or control characters (bidirectional ones U+202A-U+202E and "
             f"U+2066-U+2069 included) of at most {NAME_MAX_BYTES} UTF-8 bytes that does not start with '.' "
             "(it becomes part of file names)")


def check_choice(field: str, value, known) -> None:
    """Raise ValueError naming `value` and the `known` ones unless value is one of them."""
    if value not in known:
        raise ValueError(f"unknown {field} {value!r}; known: {', '.join(known)}")


def check_name(field: str, name) -> str:
    """`name` if it is safe as part of a file name (experiment, run, report prefixes), else a ValueError.

    Rejects path separators (a name "../../x" would write two directories up), a leading "." ("." / ".."
    and hidden files), control characters, bidirectional controls (they make a file name display as another:
    "report<U+202E>gpj.exe" shows as "reportexe.jpg"), names longer than NAME_MAX_BYTES (derived file names
    would pass the file system's 255-byte limit) and empty names.

    >>> check_name("experiment name", "smollm2_quickstart")   # passes
    >>> check_name("run name", "../x")    # ValueError: run name '../x' contains '/'; it must be a non-empty name ...
    """
    shown = repr(name)
    if not isinstance(name, str) or not name.strip():
        problem = "is empty" if isinstance(name, str) else f"is of type {type(name).__name__}, not a string"
    elif "/" in name or "\\" in name:
        problem = "contains '/'" if "/" in name else "contains '\\'"
    elif name.startswith("."):
        problem = "starts with '.'"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        problem = "contains a control character"
    elif bidi := next((c for c in name if c in BIDI_CONTROLS), None):
        problem = f"contains the bidirectional control character U+{ord(bidi):04X}"
    elif (size := len(name.encode("utf-8", "surrogatepass"))) > NAME_MAX_BYTES:
        shown, problem = f"{name[:40]!r}...", f"is {size} UTF-8 bytes long"  # its start is enough to find it
    else:
        return name
    raise ValueError(f"{field} {shown} {problem}; it must be {NAME_RULE}")


def check_reports_dir(path, field: str = "--reports-dir") -> Path:
    """`path` as a Path if it is, or can be made, a folder for reports; else a ValueError naming it: empty (""
    would silently mean the current folder), or it or one of its parents is a file.

    >>> check_reports_dir("reports")
    PosixPath('reports')
    """
    if path is None or not str(path).strip():
        raise ValueError(f"{field} is empty; give the folder to write the reports in (default: reports)")
    path = Path(path)
    for p in (path, *path.parents):
        if p.is_dir():
            break
        if p.exists() or p.is_symlink():  # a file, or a link to nothing
            what = "a file, not a folder" if p.is_file() else "not a folder"
            where = "" if p == path else f": {str(p)!r}"
            raise ValueError(f"{field} {str(path)!r}{where} is {what}")
    return path


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
