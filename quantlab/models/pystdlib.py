"""`pystdlib`: source code as a second evaluation domain every machine has, the running Python's standard library.

What it is (stated in every row's source, so two machines with different Pythons are told apart):
- the `.py` files under `sysconfig.get_paths()["stdlib"]`, sorted by their path relative to that directory
  (POSIX form), each read as UTF-8 (PEP 3120 makes that the default source encoding), joined with "\\n\\n";
- left out: any file under a directory named in EXCLUDED_DIRS. Installed packages (site-packages) are not the
  standard library; test suites (test, tests, idle_test) and the GUI / tool packages (idlelib, tkinter,
  turtledemo, ensurepip) are what distributions split into packages of their own, and lib2to3 / distutils are gone
  from newer Pythons, so without them two machines' lists differ less; pydoc_data (one generated English string)
  and encodings (generated codec tables, mostly) are not code a person writes;
- a fixed split by file: a file is in the calibration part ("validation") when the first 8 hex digits of the
  sha256 of its relative path, read as an integer, are divisible by 4 (about a quarter of the files), else in the
  "test" part. A file's part depends on its path only, never on which other files a Python has, and no text is in
  both parts: calibration on `pystdlib` never sees the evaluated code.

    text, source = pystdlib_text("test")        # source: "pystdlib test: 458 files, ..., files sha256 ..."
    files = pystdlib_files("validation")        # the calibration part's paths, relative, sorted
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from functools import lru_cache
from pathlib import Path

from ..util.checks import check_choice, read_utf8

EXCLUDED_DIRS = frozenset({
    "site-packages", "dist-packages", "__pycache__",  # installed packages, bytecode
    "test", "tests", "idle_test",  # test suites (often a separate distribution package)
    "idlelib", "tkinter", "turtledemo", "ensurepip",  # split out by distributions
    "lib2to3", "distutils",  # removed in Python 3.13 / 3.12
    "pydoc_data", "encodings",  # generated text and codec tables
})
SPLITS = ("test", "validation")  # "validation" is the calibration part
JOIN = "\n\n"
CALIBRATION_EVERY = 4  # about one file in 4 is in the calibration part


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """"validation" (calibration part) or "test", from the file's relative path alone."""
    digest = hashlib.sha256(relpath.encode("utf-8")).hexdigest()
    return "validation" if int(digest[:8], 16) % CALIBRATION_EVERY == 0 else "test"


def all_files(root: str | Path | None = None) -> list[str]:
    """Every kept `.py` file of the standard library (both parts), relative POSIX paths, sorted."""
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"pystdlib: the standard-library directory {str(root)!r} does not exist")
    out = []
    for folder, dirs, files in os.walk(root):  # excluded folders are pruned, never walked (site-packages is big)
        dirs[:] = [d for d in dirs if d not in EXCLUDED_DIRS]
        rel = Path(folder).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py") and (Path(folder) / f).is_file()]
    return sorted(out)


def pystdlib_files(split: str, root: str | Path | None = None) -> list[str]:
    """The relative paths of one part ("test" or "validation" = calibration), sorted."""
    check_choice("pystdlib split", split, SPLITS)
    return [f for f in all_files(root) if split_of(f) == split]


@lru_cache(maxsize=4)
def _text(split: str, root: str) -> tuple[str, str]:
    files = pystdlib_files(split, root)
    if not files:
        raise FileNotFoundError(f"pystdlib: no .py files of the {split!r} part under {root!r}")
    text = JOIN.join(read_utf8(Path(root) / f) for f in files)
    files_sha = hashlib.sha256("\n".join(files).encode("utf-8")).hexdigest()[:16]
    text_sha = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    version = ".".join(map(str, sys.version_info[:3]))
    source = (f"pystdlib {split} part of {root} ({sys.implementation.name} {version}): {len(files)} files in sorted "
              f"path order joined with \\n\\n, {len(text)} chars, files sha256 {files_sha}, text sha256 {text_sha}")
    return text, source


def pystdlib_text(split: str, root: str | Path | None = None) -> tuple[str, str]:
    """(text, source description) of one part. Read once per process (the files are the interpreter's own)."""
    check_choice("pystdlib split", split, SPLITS)
    return _text(split, str(stdlib_root() if root is None else Path(root)))
