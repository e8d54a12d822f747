"""Every code block of the README and of docs/ runs as a test.

Fences and what is done with them (in page order, in one temporary folder per page, which is the working directory):
- a block with a title (```python title="my_method.py"```, any language) is written to that file first, so the
  page's other blocks can use it (a plugin module beside its experiment file);
- ```python: executed, the page's blocks in one namespace, as a reader pasting them in order would;
- ```toml: validated as an experiment file: a titled one is loaded from its file (plugins beside it), an untitled
  fragment (a [[run]], an [eval] table) is completed with a name, a model and a baseline run, then parsed;
- ```bash: each `quantlab ...` command is parsed by the real argument parser (a renamed flag fails), and run in
  process when the fence says so (```bash run```); `python3 experiments/X.py` and `bash scripts/X` must name files
  that exist;
- ```text: output shown to the reader, not run.

Model aliases become a tiny random Llama of the same interface (2 layers, 4096 positions, a BPE tokenizer) where the
real model would take minutes: the code paths are the same, the numbers are not the ones a reader gets. The plugin
page's walk-through also runs on the real SmolLM2 (slow).
"""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
TINY_ALIASES = ("smollm2-135m", "gemma3-270m")  # decoders the tiny Llama stands in for
RUNNABLE_LANGS = {"python", "toml", "bash"}
SHOWN_LANGS = {"text", "console"}


def blocks(page: Path) -> list[tuple[str, dict, str]]:
    """(language, attributes, code) of every fenced block of a page."""
    out = []
    for match in FENCE.finditer(page.read_text(encoding="utf-8")):
        info, code = match.group(1).strip(), match.group(2)
        lang, _, rest = info.partition(" ")
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', rest))
        attrs |= {word: "" for word in re.sub(r'\w+="[^"]*"', " ", rest).split()}  # bare flags: ```bash run
        out.append((lang, attrs, code))
    return out


def test_every_block_says_what_it_is():
    """A fence without a language cannot be checked: each is python, toml, bash (run or parsed) or text (shown)."""
    bad = [f"{p.relative_to(REPO)}: ```{lang}" for p in PAGES for lang, _, _ in blocks(p)
           if lang not in RUNNABLE_LANGS | SHOWN_LANGS]
    assert bad == [], "code blocks without a checkable language:\n" + "\n".join(bad)


@pytest.fixture(scope="module")
def docs_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama of tests/conftest.py with 4096 positions, so the docs' seq_len 512 / 2048 examples fit."""
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("docs-tiny-llama"), max_positions=4096)


@contextlib.contextmanager
def tiny_models(monkeypatch, model_dir: Path):
    """The decoder aliases load the tiny Llama (weights and config), wherever the code asks for them."""
    from quantlab.models import loading

    real = loading.resolve_model_path
    # a new dict, not delitem: restoring puts the very same (ordered) table back
    monkeypatch.setattr(loading, "ALIASES", {k: v for k, v in loading.ALIASES.items() if k not in TINY_ALIASES})
    monkeypatch.setattr(loading, "resolve_model_path",
                        lambda name, cache_dir=None: str(model_dir) if name in TINY_ALIASES else real(name, cache_dir))
    yield


def check_toml(code: str, attrs: dict, folder: Path, where: str) -> None:
    from quantlab.runs.experiment import load_experiment, parse_experiment

    if attrs.get("title", "").endswith("pyproject.toml"):  # packaging: the entry-point group must be quantlab's
        from quantlab.util.plugins import ENTRY_POINT_GROUP

        groups = tomllib.loads(code)["project"]["entry-points"]
        assert list(groups) == [ENTRY_POINT_GROUP], f"{where}: entry-point groups {list(groups)}"
        assert all(re.fullmatch(r"[\w.]+(:[\w.]+)?", v) for v in groups[ENTRY_POINT_GROUP].values()), where
        return
    if "title" in attrs:
        load_experiment(folder / attrs["title"])
        return
    data = tomllib.loads(code)
    if "model" not in data:  # a fragment: an [eval] table, some [[run]]s
        data = {"name": "docs_fragment", "model": "smollm2-135m"} | data
    if "run" not in data and "sweep" not in data:
        data["run"] = [{"name": "fp32", "method": "none"}]
    parse_experiment(data, where=where, plugin_dir=folder)


def commands(code: str) -> list[str]:
    """Shell lines of a block, continuation lines joined, comments and blank lines dropped."""
    text = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in text.splitlines():
        line = line.split(" #")[0].strip() if not line.lstrip().startswith("#") else ""
        out += [part.strip() for part in re.split(r"\s&&\s", line) if part.strip()]
    return out


def check_bash(code: str, attrs: dict, folder: Path, where: str) -> None:
    from quantlab.cli import build_parser, main

    for command in commands(code):
        argv = shlex.split(command)
        if argv[:3] == ["python3", "-m", "quantlab"]:
            argv = ["quantlab", *argv[3:]]
        if argv[0] == "quantlab":
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{where}: `{command}`: the argument parser refuses it")
            if "run" in attrs:
                assert main(argv[1:]) == 0, f"{where}: `{command}` failed"
        elif argv[0] in ("python3", "bash") and len(argv) > 1 and not argv[1].startswith("-"):
            assert (REPO / argv[1]).exists() or (folder / argv[1]).exists(), f"{where}: {argv[1]} does not exist"


def run_page(page: Path, folder: Path) -> None:
    """Write the page's titled blocks, then check or run every block in order."""
    from conftest import registries_restored

    with registries_restored():
        sys.path.insert(0, str(folder))  # the page's own files import as a reader's would, from where they lie
        _run_blocks(page, folder)


def _run_blocks(page: Path, folder: Path) -> None:
    found = blocks(page)
    for _, attrs, code in found:
        if "title" in attrs:
            (folder / attrs["title"]).write_text(code, encoding="utf-8")
    module = types.ModuleType("docs_page_" + re.sub(r"\W", "_", page.stem))  # dataclasses look their module up
    module.__file__ = str(folder / "page.py")  # so registries_restored drops it with the page's own modules
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for i, (lang, attrs, code) in enumerate(found, 1):
        where = f"{page.relative_to(REPO)} block {i} ({lang})"
        if lang == "toml":
            check_toml(code, attrs, folder, where)
        elif lang == "python" and "title" not in attrs:
            exec(compile(code, where, "exec"), namespace)  # noqa: S102 - the documentation's own code
        elif lang == "bash":
            check_bash(code, attrs, folder, where)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_page_code_runs(page, tmp_path, monkeypatch, docs_model_dir, wikitext_dir):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTLAB_DATA_DIR", str(wikitext_dir))
    threads = torch.get_num_threads()
    try:
        with tiny_models(monkeypatch, docs_model_dir):
            run_page(page, tmp_path)
    finally:
        torch.set_num_threads(threads)  # a page may set threads; the next test gets the suite's


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_the_plugin_walkthrough_runs_on_smollm2(tmp_path, monkeypatch, wikitext_dir):
    """docs/plugins.md's method, TOML and command on the real SmolLM2: the outside method's rows are in the report."""
    import pandas as pd

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QUANTLAB_DATA_DIR", str(wikitext_dir))
    run_page(REPO / "docs" / "plugins.md", tmp_path)
    df = pd.read_csv(next(tmp_path.rglob("stochastic_rounding.csv")))
    rows, rtn = df[df["method"] == "stochastic_rounding"], df[df["method"] == "rtn"]
    assert len(rows) == 2 and (rows["bits"] == 4).all() and rows["ppl"].notna().all()
    assert (rows["kl_mean"] > rtn["kl_mean"].iloc[0]).all()  # what the page says: unbiased, yet farther than RTN
    assert os.environ.get("QUANTLAB_DATA_DIR") == str(wikitext_dir)


def test_the_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`, as .ci/run runs it: a broken link, a page left out of the nav or a bad anchor fails."""
    import subprocess
    import sys

    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e '.[docs]') is not installed")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
