"""Every test function asserts something: an `assert`, `pytest.raises`, an assert_* / fnmatch_lines call,
or a call to a helper of its own file that does. A test that only runs code passes whatever it computes."""
import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CHECK_CALLS = {"raises", "warns", "fail", "fnmatch_lines", "assert_outcomes"}


def _called_name(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _checks_directly(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _called_name(node) or ""
            if name in CHECK_CALLS or name.startswith("assert"):
                return True
    return False


def _checking_functions(tree: ast.Module) -> set[str]:
    """Names of the file's functions (and nested ones) that check, directly or through each other."""
    funcs = {n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    checking = {name for name, fn in funcs.items() if _checks_directly(fn)}
    changed = True
    while changed:  # a helper that calls a checking helper checks too
        changed = False
        for name, fn in funcs.items():
            calls = {_called_name(c) for c in ast.walk(fn) if isinstance(c, ast.Call)}
            if name not in checking and calls & checking:
                checking.add(name)
                changed = True
    return checking


def _test_files():
    return sorted(TESTS.glob("test_*.py"))


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: p.name)
def test_every_test_function_asserts(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    tests = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
    checking = _checking_functions(tree)
    assert tests, f"{path.name} defines no test function"
    assert not [t for t in tests if t not in checking], f"{path.name}: test functions that assert nothing"


def test_the_scan_tells_asserting_from_silent_tests():
    tree = ast.parse(
        "def _helper(x):\n    assert x\n"
        "def test_helper():\n    _helper(1)\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        f()\n"
        "def test_close():\n    torch.testing.assert_close(a, b)\n"
        "def test_silent():\n    f()\n    x = 1 == 2\n"
    )
    checking = _checking_functions(tree)
    assert {"test_helper", "test_raises", "test_close"} <= checking and "test_silent" not in checking
