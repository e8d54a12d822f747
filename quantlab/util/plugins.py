"""Plugins: outside code that registers methods, formats, observers or run extras before an experiment is validated.

Two ways in:
- an experiment file lists modules: `plugins = ["my_method"]`. A module found beside the file (my_method.py, or a
  package folder my_method/) is imported from there; any other name must be importable (installed, on PYTHONPATH);
- an installed package advertises modules in the `quantlab.plugins` entry-point group
  (`[project.entry-points."quantlab.plugins"] my_method = "my_pkg.my_method"`); every experiment loads them.

Importing a plugin runs its `@quantlab.register_method` (and register_format / register_observer /
register_extra) decorators. A plugin that fails to import, or registers a name already taken, fails with one line
naming the plugin and where it was listed. A module already imported is not imported again.

    load_plugins(["stochastic_rounding"], search_dir=Path("experiments"), where="experiments/sr.toml")
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path

ENTRY_POINT_GROUP = "quantlab.plugins"
_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_installed: list[str] | None = None  # names of the entry points loaded in this process
_loaded: dict[str, str | None] = {}  # module -> the folder it was found in (None: importable as installed)


class PluginError(ValueError):
    """A plugin could not be loaded: it failed to import, or registered a name already taken."""


def check_plugin_names(names, where: str) -> tuple[str, ...]:
    """`plugins` must be a list of module names ("my_method", "my_pkg.methods"), not paths."""
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(f"{where}: plugins must be a list of module names, e.g. plugins = [\"my_method\"], "
                         f"got {names!r}")
    for name in names:
        if not isinstance(name, str) or not _MODULE_NAME.match(name) or name.endswith(".py"):
            raise ValueError(f"{where}: plugin {name!r} is not a module name (letters, digits, '_' and dots, e.g. "
                             f"\"my_method\" for my_method.py beside the experiment file; no paths, no .py)")
    return tuple(names)


def _import(name: str, search_dir: Path | None, where: str, source: str):
    top = name.partition(".")[0]
    beside = () if search_dir is None else (search_dir / f"{top}.py", search_dir / top / "__init__.py")
    if any(f.is_file() for f in beside):
        folder = str(search_dir.resolve())
        if folder not in sys.path:
            sys.path.insert(0, folder)  # kept: configs of the plugin's classes must unpickle later in this process
    try:
        return importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - any failure of the plugin's own code is reported as the plugin's
        detail = str(e).splitlines()[0] if str(e) else ""
        raise PluginError(f"{where}: plugin {name!r} ({source}) failed to load: {type(e).__name__}: {detail}") from e


def load_plugins(names, search_dir: str | Path | None = None, where: str = "experiment") -> list[str]:
    """Import each module of `names` (searched first in `search_dir`, the experiment file's folder); returns them.

    >>> load_plugins(["stochastic_rounding"], search_dir="docs/examples", where="docs/examples/sr.toml")
    ['stochastic_rounding']
    """
    names = check_plugin_names(names, where)
    folder = None if search_dir is None else Path(search_dir)
    source = f"listed in plugins{'' if folder is None else f', searched first in {folder}'}"
    for name in names:
        module = _import(name, folder, where, source)
        top = Path(getattr(module, "__file__", "") or "").resolve()
        found = folder is not None and folder.resolve() in top.parents
        _loaded.setdefault(name, str(folder.resolve()) if found else None)
    return list(names)


def loaded_plugins() -> list[tuple[str, str | None]]:
    """(module, folder it was loaded from or None) of every plugin load_plugins imported in this process: what a
    fresh process (a memory probe, a Ray worker) must load again to rebuild the same configs."""
    return list(_loaded.items())


def plugin_folders() -> list[str]:
    """The folders plugins were found in, for a child's PYTHONPATH."""
    return sorted({folder for _, folder in _loaded.items() if folder})


def load_installed_plugins() -> list[str]:
    """Import every module of the `quantlab.plugins` entry-point group, once per process; returns their names."""
    global _installed
    if _installed is not None:
        return _installed
    loaded = []
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = getattr(ep.dist, "name", None) or "an installed package"
        try:
            ep.load()
        except Exception as e:  # noqa: BLE001
            detail = str(e).splitlines()[0] if str(e) else ""
            raise PluginError(f"plugin {ep.name!r} = {ep.value!r} (entry point group {ENTRY_POINT_GROUP!r} of {dist}) "
                              f"failed to load: {type(e).__name__}: {detail}") from e
        loaded.append(ep.name)
    _installed = loaded
    return loaded
