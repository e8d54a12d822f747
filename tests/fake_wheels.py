"""Fake model wheels for the alias tests: importlib.util.find_spec answers for a GGUF alias' chunk packages from
directories under a temporary folder, holding the bytes a test chooses (nothing is installed or imported)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path


def fake_wheels(monkeypatch, root: Path, alias, contents: list[bytes] | None = None, absent=()) -> dict[str, Path]:
    """{package: its directory} for every chunk of `alias`, chunk i holding contents[i] (default: its package name);
    packages named in `absent` are not found."""
    contents = contents if contents is not None else [c.package.encode() for c in alias.chunks]
    dirs = {}
    for chunk, data in zip(alias.chunks, contents, strict=True):
        path = root / chunk.package / chunk.path
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        dirs[chunk.package] = root / chunk.package
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in absent:
            return None
        if name in dirs:
            return types.SimpleNamespace(submodule_search_locations=[str(dirs[name])])
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return dirs
