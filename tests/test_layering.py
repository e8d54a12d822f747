"""The package's layering, as docs/architecture.md writes it down: no forbidden arrow between rooms, no import
circle between modules, no private name crossing modules, no room missing from the table.

Imports are read from the source (ast), those inside functions included: a lazy import is still an arrow.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "quantlab"
ROOT_ROOMS = ("__init__", "__main__")  # the package root may import every room


def layering_table(text: str) -> dict[str, set[str] | None]:
    """{room: rooms it may import} from the fenced block between the layering markers; None = any room."""
    block = re.search(r"<!-- layering: begin -->\s*```text\n(.*?)```\s*<!-- layering: end -->", text, re.S)
    assert block, "docs/architecture.md lost its layering block"
    table = {}
    for line in block.group(1).splitlines():
        room, _, allowed = line.partition(":")
        allowed = allowed.split()
        table[room.strip()] = None if allowed == ["*"] else {a for a in allowed if a != "-"}
    return table


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def imports(path: Path, mods: dict[str, Path]):
    """(target module, imported names, line) for every quantlab import in the file, resolved to a module: a name
    that is a submodule (`from . import blocks`) points at it, any other name at the module it is taken from."""
    me = next(m for m, p in mods.items() if p == path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("quantlab"):
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub, [], node.lineno) if sub in mods else (target, [alias.name], node.lineno)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("quantlab"):
                    yield alias.name, [], node.lineno


def module_aliases(path: Path, mods: dict[str, Path]) -> dict[str, str]:
    """Names bound to quantlab modules in the file (`from ..calibration import blocks` -> {"blocks": ...})."""
    out = {}
    for target, names, _ in imports(path, mods):
        if not names and target in mods:
            out[target.rpartition(".")[2]] = target
    return out


def test_the_layering_table_names_every_room():
    table = layering_table((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    rooms = {room(m) for m in modules()} - set(ROOT_ROOMS)
    assert rooms - set(table) == set(), "rooms missing from docs/architecture.md's layering table"
    assert set(table) - rooms == set(), "the layering table names rooms that do not exist"
    for name, allowed in table.items():
        assert allowed is None or allowed <= set(table), f"{name} may import unknown rooms {allowed - set(table)}"


def forbidden_arrows(table: dict, package: Path = PACKAGE) -> list[str]:
    mods, bad = modules(package), []
    for mod, path in mods.items():
        here = room(mod)
        if here in ROOT_ROOMS or table[here] is None:
            continue
        for target, _, line in imports(path, mods):
            there = room(target)
            if there != here and (there in ROOT_ROOMS or there not in table[here]):
                bad.append(f"{path.relative_to(package.parent)}:{line}: {here} -> {there} ({target})")
    return bad


def test_no_room_imports_a_room_above_it():
    table = layering_table((REPO / "docs" / "architecture.md").read_text(encoding="utf-8"))
    bad = forbidden_arrows(table)
    assert bad == [], "imports the layering table forbids:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_circle_between_modules():
    mods = modules()
    graph = {m: {t for t, _, _ in imports(p, mods) if t in mods and t != m} for m, p in mods.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    """The reference for the test above: a -> b -> c -> a is one circle, d stands alone."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def private_crossings(package: Path = PACKAGE) -> list[str]:
    """`from x import _name` and `module._name` on an imported quantlab module."""
    mods, bad = modules(package), []
    for mod, path in mods.items():
        where = path.relative_to(package.parent)
        for target, names, line in imports(path, mods):
            bad += [f"{where}:{line}: {n} from {target}" for n in names if n.startswith("_") and not n.startswith("__")]
        aliases = module_aliases(path, mods)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                bad.append(f"{where}:{node.lineno}: {node.value.id}.{node.attr}")
    return bad


def test_no_private_name_crosses_modules():
    bad = private_crossings()
    assert bad == [], "private names used across modules:\n" + "\n".join(bad)


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    package = tmp_path / "quantlab"
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text, encoding="utf-8")
    return package


def test_the_checks_see_what_they_refuse(tmp_path):
    """The reference for the three checks above, on a fake package: util importing runs is a forbidden arrow; a
    private name imported, or read off an imported module, is a crossing; a -> b -> a is a circle."""
    package = _fake_package(tmp_path, {
        "util/__init__.py": "", "util/a.py": "from ..runs import runner\n",
        "runs/__init__.py": "", "runs/runner.py": "from ..calibration import blocks\nblocks._merge([])\n"
                                                "from .other import _Context\n",
        "runs/other.py": "from . import runner\n", "calibration/__init__.py": "", "calibration/blocks.py": "",
    })
    table = {"util": set(), "runs": {"util", "calibration"}, "calibration": {"util"}}
    assert forbidden_arrows(table, package) == ["quantlab/util/a.py:1: util -> runs (quantlab.runs.runner)"]
    assert private_crossings(package) == ["quantlab/runs/runner.py:3: _Context from quantlab.runs.other",
                                          "quantlab/runs/runner.py:2: blocks._merge"]
    mods = modules(package)
    graph = {m: {t for t, _, _ in imports(p, mods) if t in mods and t != m} for m, p in mods.items()}
    assert _cycles(graph) == [["quantlab.runs.other", "quantlab.runs.runner"]]
