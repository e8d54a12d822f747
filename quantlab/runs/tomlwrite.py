"""A minimal TOML writer for experiment files (stdlib tomllib only reads), and replace_runs, which edits
an existing file's [[run]] tables in place with tomlkit so that its comments and formatting survive.

Covers what experiments hold: strings (multi-line ones as \"\"\" blocks), ints, floats,
bools, lists, inline tables, [tables] and [[arrays of tables]]. None values are left
out (TOML has no null): only write None where it is the field's default.

>>> text = experiment_toml(load_experiment("experiments/smollm2_quickstart.toml"))
>>> parse_experiment(tomllib.loads(text)) == load_experiment("experiments/smollm2_quickstart.toml")
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from ..core.extras import extras_to_dict
from ..core.registry import field_defaults, get_method

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k, ensure_ascii=False)


def _string(s: str, multiline: bool) -> str:
    if multiline and "\n" in s and not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", s):
        return '"""\n' + s.replace("\\", "\\\\").replace('"""', '""\\"') + '"""'
    return json.dumps(s, ensure_ascii=False)  # JSON's escapes are all valid in a TOML basic string


def value(v: Any, multiline: bool = False) -> str:
    """One TOML value (inline form)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _string(v, multiline)
    if isinstance(v, dict):
        items = [f"{_key(k)} = {value(x)}" for k, x in v.items() if x is not None]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, dict) for x in v):  # arrays of inline tables: one per line
            return "[\n" + "".join(f"  {value(x)},\n" for x in v) + "]"
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise TypeError(f"cannot write {type(v).__name__} {v!r} as TOML")


def _pairs(table: dict) -> list[str]:
    return [f"{_key(k)} = {value(v, multiline=True)}" for k, v in table.items() if v is not None]


def dumps(data: dict) -> str:
    """A dict -> TOML text: top-level keys, then [tables] (dict values), then [[arrays]] (lists of dicts
    at the top level); dicts inside those become inline tables."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and not _is_table_array(v)}
    parts = ["\n".join(_pairs(scalars))] if scalars else []
    for k, v in data.items():
        if isinstance(v, dict):
            parts.append("\n".join([f"[{_key(k)}]", *_pairs(v)]))
    for k, v in data.items():
        if _is_table_array(v):
            parts += ["\n".join([f"[[{_key(k)}]]", *_pairs(item)]) for item in v]
    return "\n\n".join(parts) + "\n"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def compact_config(config: Any) -> dict:
    """{"method": ..., bits, fields that differ from their defaults}; nested configs likewise, overrides as tables."""
    out, defaults = {"method": get_method(config).name}, field_defaults(type(config))
    for f in dataclasses.fields(config):
        v = getattr(config, f.name)
        if f.name in defaults and v == defaults[f.name] and f.name != "bits":  # bits: always said, for the reader
            continue
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            v = compact_config(v)
        elif isinstance(v, tuple):
            v = [x.to_dict() if hasattr(x, "to_dict") else x for x in v]
        out[f.name] = v
    return out


def experiment_dict(exp) -> dict:
    """An Experiment -> the dict its TOML file holds (defaults left out)."""
    data: dict[str, Any] = {"name": exp.name, "model": exp.model}
    top = field_defaults(type(exp))
    for k in ("plugins", "reference", "dtype", "device", "seed", "description", "findings"):
        if getattr(exp, k) != top.get(k):
            data[k] = getattr(exp, k)
    for k in ("eval", "calibration", "execution"):
        proto, defaults = getattr(exp, k), field_defaults(type(getattr(exp, k)))
        table = {f.name: getattr(proto, f.name) for f in dataclasses.fields(proto)
                 if getattr(proto, f.name) != defaults.get(f.name)}
        if table:
            data[k] = table
    if exp.seeds is not None:
        data["seeds"] = list(exp.seeds)
    data["run"] = []
    for r in exp.runs:  # runs expanded from `seeds` fold back into one table with its seeds list
        backend = {"backend": r.backend} if r.backend != "simulated" else {}
        backend |= extras_to_dict(r.extras)
        if r.calibration is not None:  # the run's own calibration: the fields that differ from the file's
            backend["calibration"] = {f.name: getattr(r.calibration, f.name) for f in dataclasses.fields(r.calibration)
                                      if getattr(r.calibration, f.name) != getattr(exp.calibration, f.name)}
        if r.seed is None:
            data["run"].append({"name": r.name, **compact_config(r.config), **backend})
        elif data["run"] and data["run"][-1]["name"] == r.group and "seeds" in data["run"][-1]:
            data["run"][-1]["seeds"].append(r.seed)
        else:
            data["run"].append({"name": r.group, **compact_config(r.config), **backend, "seeds": [r.seed]})
    return data


def experiment_toml(exp, header: str = "") -> str:
    """TOML text for an Experiment; `header` (comment lines) goes first."""
    return (header.rstrip("\n") + "\n" if header else "") + dumps(experiment_dict(exp))


# ---- editing a file in place (tomlkit): comments, key order and formatting are kept ----------

def _toml_item(v: Any):
    """A plain value -> a tomlkit item: dicts inline, lists of dicts one inline table per line."""
    import tomlkit

    if isinstance(v, dict):
        table = tomlkit.inline_table()
        table.update({k: _toml_item(x) for k, x in v.items() if x is not None})
        return table
    if isinstance(v, (list, tuple)):
        array = tomlkit.array()
        array.extend(_toml_item(x) for x in v)
        if v and all(isinstance(x, dict) for x in v):
            array.multiline(True)
        return array
    return tomlkit.item(v)


def _run_table(run: dict, keep: list, indent: str):
    """A [[run]] table from a dict, `indent` before its header; `keep`: trailing items (comments, blank
    lines) of the table it replaces."""
    import tomlkit

    table = tomlkit.table()
    for k, v in run.items():
        if v is not None:
            table.add(k, _toml_item(v))
    for item in keep:
        table.add(item)
    table.trivia.indent = indent
    return table


def replace_runs(text: str, runs: list[dict], where: str = "experiment") -> str:
    """The experiment file `text` with `runs` as [[run]] tables: a run whose name is already there
    replaces that table where it stands, the others are appended. Everything else is kept as written:
    comments (between tables, inline, in the header), key order, formatting. The comments inside a
    replaced table go with it; those after its last key (about the next table) stay.

    >>> replace_runs(Path("exp.toml").read_text(), [mixed_run_table("mixed-4b", plan)])
    """
    import tomlkit
    from tomlkit.items import AoT

    try:
        doc = tomlkit.parse(text if text.endswith("\n") or not text else text + "\n")
    except tomlkit.exceptions.ParseError as e:
        raise ValueError(f"{where}: invalid TOML: {e}") from None
    if "run" not in doc:
        doc.append("run", tomlkit.aot())
    tables = doc["run"]
    if not isinstance(tables, AoT):
        raise ValueError(f"{where}: write the runs as [[run]] tables to have runs added (found 'run' as "
                         f"{type(tables).__name__})")
    index = {t.get("name"): i for i, t in enumerate(tables)}
    for run in runs:
        if run["name"] in index:
            old = tables[index[run["name"]]]
            body = old.value.body
            last_key = max((i for i, (k, _) in enumerate(body) if k is not None), default=-1)
            keep = [item for _, item in body[last_key + 1:]]
            tables[index[run["name"]]] = _run_table(run, keep, old.trivia.indent)
        else:
            tables.append(_run_table(run, [], "\n"))  # a blank line before each new table
            index[run["name"]] = len(tables) - 1
    return tomlkit.dumps(doc)
