"""`[[sweep]]` tables: the cartesian product of listed field values, expanded into `[[run]]` tables.

A sweep is a run table in which some fields hold a list of values: each such field is an axis, and every
combination becomes one run, named by the sweep's `name` (default: the method) and the values it takes.
Nested tables sweep too (`base = {method = "rtn", bits = [3, 4]}`). Fields whose value is itself a list
(include, exclude, overrides) sweep only when given a list of lists; `seeds` keeps its meaning (each run
repeats per seed), so it composes with the grid.

    [[sweep]]
    method = "gptq"
    bits = [3, 4]
    group_size = [64, 128]
    seeds = [0, 1]           # -> gptq-w3-g64-seed0, gptq-w3-g64-seed1, ..., gptq-w4-g128-seed1: 8 runs

Names: bits -> w<b>, group_size -> g<n> ("channel" for per-channel, written "channel"), act_bits -> a<b>,
symmetric -> sym / asym, another true / false field -> <field> / no-<field>,
any other field -> <field><value>, a list value -> <field><its 1-based position>; a nested field carries its
table's name (base.bits -> base-w3).
Every expanded run is validated like a [[run]] before anything loads.
"""
from __future__ import annotations

import itertools
from typing import Any

LIST_FIELDS = ("include", "exclude", "overrides", "clip_ratios", "datasets", "mix")  # take a list as one value
ABBREVIATIONS = {"bits": "w", "group_size": "g", "act_bits": "a"}
BOOL_LABELS = {"symmetric": ("sym", "asym"), "act_symmetric": ("act-sym", "act-asym")}  # (true, false)


def _axes(table: dict, prefix: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], list]]:
    """(path, values) for every swept field of a (nested) table."""
    axes = []
    for key, value in table.items():
        path = prefix + (key,)
        if key == "seeds" and not prefix:
            continue
        if isinstance(value, dict):
            axes += _axes(value, path)
        elif isinstance(value, list):
            takes_list = key in LIST_FIELDS
            if takes_list and not all(isinstance(v, list) for v in value):
                continue  # one list value, not an axis
            axes.append((path, value))
    return axes


def _set(table: dict, path: tuple[str, ...], value: Any) -> dict:
    out = dict(table)
    if len(path) == 1:
        out[path[0]] = value
    else:
        out[path[0]] = _set(out[path[0]], path[1:], value)
    return out


def _label(path: tuple[str, ...], value: Any, index: int) -> str:
    key = path[-1]
    if isinstance(value, bool):
        name = key.replace("_", "-")
        text = BOOL_LABELS[key][not value] if key in BOOL_LABELS else (name if value else f"no-{name}")
    elif key == "group_size" and value in (None, "channel"):
        text = "channel"
    elif isinstance(value, (list, dict)):  # e.g. exclude = [[...], [...]]: the value's position, 1-based
        text = f"{key.replace('_', '-')}{index + 1}"
    elif key in ABBREVIATIONS:
        text = f"{ABBREVIATIONS[key]}{value}"
    elif isinstance(value, str) and key in ("method", "format", "act_format", "observer"):
        text = value.replace("_", "-")
    else:
        text = f"{key.replace('_', '-')}{value}"
    return "-".join([*path[:-1], text])


def expand_sweep(table: dict, where: str) -> list[dict]:
    """One sweep table -> its run tables (name filled in), in row-major order of the axes as written.

    >>> expand_sweep({"method": "rtn", "bits": [3, 4]}, "sweep #1")   # names rtn-w3, rtn-w4
    """
    table = dict(table)
    if "method" not in table:
        raise ValueError(f"{where}: needs a 'method' (one, or a list of methods to sweep)")
    prefix = table.pop("name", None) or (table["method"] if isinstance(table["method"], str) else None)
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ValueError(f"{where}: name must be a non-empty string, got {prefix!r}")
    axes = _axes(table)
    for path, values in axes:
        if not values:
            raise ValueError(f"{where}: {'.'.join(path)} = [] sweeps over nothing; give at least one value")
    if not axes:
        raise ValueError(f"{where}: no field holds a list of values, so there is nothing to sweep; "
                         f"write it as a [[run]] (or list the values: bits = [3, 4])")
    runs = []
    for combo in itertools.product(*(range(len(values)) for _, values in axes)):
        run, labels = table, [prefix] if prefix else []
        for (path, values), i in zip(axes, combo):
            run = _set(run, path, values[i])
            labels.append(_label(path, values[i], i))
        name = "-".join(labels)
        runs.append({"name": name, **run})
    names = [r["name"] for r in runs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{where}: the grid gives duplicate run name(s) {', '.join(dupes)}")
    return runs
