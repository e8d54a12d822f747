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
Every expanded run is validated like a [[run]] before anything loads; the first run (first_run) is validated
before the grid expands, so what all runs share fails at once, and a grid may hold at most MAX_SWEEP_RUNS runs.
"""
from __future__ import annotations

import collections
import itertools
import math
from typing import Any

LIST_FIELDS = ("include", "exclude", "overrides", "clip_ratios", "datasets", "mix")  # take a list as one value
ABBREVIATIONS = {"bits": "w", "group_size": "g", "act_bits": "a"}
BOOL_LABELS = {"symmetric": ("sym", "asym"), "act_symmetric": ("act-sym", "act-asym")}  # (true, false)
# a grid's runs are each validated, planned and listed (and usually evaluated): 10,000 is far past any grid one
# evaluates, and still expands and validates in seconds; a larger one is almost surely a typo'd axis
MAX_SWEEP_RUNS = 10_000


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


def _check(table: dict, where: str) -> tuple[dict, str | None, list]:
    """The checks a sweep table passes before any expansion: (its fields less `name`, the name prefix, its axes)."""
    body = dict(table)
    if "method" not in body:
        raise ValueError(f"{where}: needs a 'method' (one, or a list of methods to sweep)")
    prefix = body.pop("name", None) or (body["method"] if isinstance(body["method"], str) else None)
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ValueError(f"{where}: name must be a non-empty string, got {prefix!r}")
    axes = _axes(body)
    for path, values in axes:
        if not values:
            raise ValueError(f"{where}: {'.'.join(path)} = [] sweeps over nothing; give at least one value")
    if not axes:
        raise ValueError(f"{where}: no field holds a list of values, so there is nothing to sweep; "
                         f"write it as a [[run]] (or list the values: bits = [3, 4])")
    return body, prefix, axes


def _combination(body: dict, prefix: str | None, axes: list, labels: list, combo: tuple) -> dict:
    """One run table: `body` with axis k at its value combo[k]; each nested table on an axis's path copied once."""
    run, copied, parts = dict(body), {()}, [prefix] if prefix else []
    for (path, values), axis_labels, i in zip(axes, labels, combo):
        node = run
        for depth in range(1, len(path)):
            if path[:depth] not in copied:  # copy, never mutate the caller's nested table
                node[path[depth - 1]] = dict(node[path[depth - 1]])
                copied.add(path[:depth])
            node = node[path[depth - 1]]
        node[path[-1]] = values[i]
        parts.append(axis_labels[i])
    return {"name": "-".join(parts), **run}


def first_run(table: dict, where: str) -> dict:
    """The sweep's first run table (every axis at its first value), built without expanding the grid: parse it
    to fail at once on what every run shares (unknown keys, a bad method, a bad extra) however large the grid.

    >>> first_run({"method": "rtn", "bits": [3, 4], "bitz": 1}, "sweep #1")   # {"name": "rtn-w3", ...}
    """
    body, prefix, axes = _check(table, where)
    labels = [[_label(path, values[0], 0)] for path, values in axes]
    return _combination(body, prefix, axes, labels, (0,) * len(axes))


def expand_sweep(table: dict, where: str) -> list[dict]:
    """One sweep table -> its run tables (name filled in), in row-major order of the axes as written.

    Linear in the grid's size, which may not pass MAX_SWEEP_RUNS (checked before anything expands).

    >>> expand_sweep({"method": "rtn", "bits": [3, 4]}, "sweep #1")   # names rtn-w3, rtn-w4
    """
    body, prefix, axes = _check(table, where)
    size = math.prod(len(values) for _, values in axes)
    if size > MAX_SWEEP_RUNS:
        shape = " x ".join(f"{'.'.join(path)} {len(values)}" for path, values in axes)
        raise ValueError(f"{where}: the grid has {size:,} runs ({shape}), more than the {MAX_SWEEP_RUNS:,} a sweep "
                         f"may expand to; trim an axis or split it into several [[sweep]] tables")
    labels = [[_label(path, v, i) for i, v in enumerate(values)] for path, values in axes]
    runs = [_combination(body, prefix, axes, labels, combo)
            for combo in itertools.product(*(range(len(values)) for _, values in axes))]
    counts = collections.Counter(r["name"] for r in runs)
    dupes = sorted(n for n, c in counts.items() if c > 1)
    if dupes:
        raise ValueError(f"{where}: the grid gives duplicate run name(s) {', '.join(dupes)}")
    return runs
