"""experiments/referee (issue 30): the scripts parse, export_windows.py writes quantlab's own calibration draw (never
from the test split), and the stdlib / numpy helpers the peer venvs share behave. No peer venv is needed here."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import py_compile
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

REFEREE = REPO / "experiments" / "referee"
SCRIPTS = sorted(REFEREE.glob("*.py"))
SHELL = sorted(REFEREE.glob("*.sh"))


def _script(name: str):
    """experiments/referee/<name>.py as a module; the sys.path entry a peer script adds for peer_common is undone."""
    path, modules = list(sys.path), set(sys.modules)
    try:
        spec = importlib.util.spec_from_file_location(f"referee_{name}", REFEREE / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path
        for added in set(sys.modules) - modules - {f"referee_{name}"}:
            del sys.modules[added]


def _tiny_experiment(tmp_path, model_dir, seed: int = 3, split: str = "validation"):
    sample = model_dir / "sample.txt"
    path = tmp_path / "tiny.toml"
    path.write_text(f'name = "tiny"\nmodel = "{model_dir}"\nseed = {seed}\n'
                    f'[eval]\ndataset = "{sample}"\nseq_len = 32\nmax_windows = 2\n'
                    f'[calibration]\ndataset = "{sample}"\nsplit = "{split}"\nnum_samples = 4\nseq_len = 32\n'
                    f'[[run]]\nname = "fp32"\nmethod = "none"\n')
    return path


def _quantlab_draw(experiment, cache_dir, seed=None, protocol=None) -> torch.Tensor:
    from quantlab.runs.context import EvalContext
    from quantlab.runs.experiment import load_experiment

    ctx = EvalContext(load_experiment(experiment), torch.device("cpu"), None, cache_dir, progress=False)
    return ctx.calibration(seed, protocol)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_compile(script, tmp_path):
    assert py_compile.compile(str(script), cfile=str(tmp_path / "out.pyc"), doraise=True)  # raises if it fails


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def test_export_equals_quantlabs_calibration_draw(tiny_model_dir, tmp_path):
    experiment, out = _tiny_experiment(tmp_path, tiny_model_dir), tmp_path / "windows"
    assert _script("export_windows").main(["--out", str(out), "--experiment", str(experiment),
                                           "--cache-dir", str(tmp_path / "cache")]) == 0
    ids = np.load(out / "windows.npy", allow_pickle=False)
    meta = json.loads((out / "windows.json").read_text())
    expected = _quantlab_draw(experiment, tmp_path / "cache")  # EvalContext.calibration(): seed 3, 4 x 32
    assert ids.dtype == np.int64 and torch.equal(torch.from_numpy(ids), expected)  # exact: the same ids
    assert meta["model_dir"] == str(tiny_model_dir.resolve()) and meta["seed"] == 3 and meta["shape"] == [4, 32]
    assert meta["calibration"]["split"] == "validation" and meta["source"] == "file:sample.txt"
    assert meta["ids_sha256"] == hashlib.sha256(ids.tobytes()).hexdigest()


def test_export_flags_override_the_experiment(tiny_model_dir, tmp_path):
    from quantlab.runs.protocols import CalibrationProtocol

    experiment, out = _tiny_experiment(tmp_path, tiny_model_dir), tmp_path / "windows"
    assert _script("export_windows").main(["--out", str(out), "--experiment", str(experiment), "--seed", "5",
                                           "--num-samples", "2", "--cache-dir", str(tmp_path / "cache")]) == 0
    protocol = CalibrationProtocol(dataset=str(tiny_model_dir / "sample.txt"), num_samples=2, seq_len=32)
    expected = _quantlab_draw(experiment, tmp_path / "cache", seed=5, protocol=protocol)
    assert torch.equal(torch.from_numpy(np.load(out / "windows.npy")), expected)


def test_export_refuses_the_test_split(tiny_model_dir, tmp_path, capsys):
    experiment, out = _tiny_experiment(tmp_path, tiny_model_dir), tmp_path / "windows"
    export = _script("export_windows")
    assert export.main(["--out", str(out), "--experiment", str(experiment), "--split", "test"]) == 2
    assert "never calibrate on the evaluation split" in capsys.readouterr().err
    bad = _tiny_experiment(tmp_path, tiny_model_dir, split="test")  # the file's own [calibration] split
    assert export.main(["--out", str(out), "--experiment", str(bad)]) == 2
    assert "never calibrate" in capsys.readouterr().err and not out.exists()


def test_peer_load_windows_checks_the_recorded_sha(tiny_model_dir, tmp_path):
    out = tmp_path / "windows"
    _script("export_windows").main(["--out", str(out), "--experiment", str(_tiny_experiment(tmp_path, tiny_model_dir)),
                                    "--cache-dir", str(tmp_path / "cache")])
    common = _script("peer_common")
    ids, meta = common.load_windows(out)
    assert ids.shape == (4, 32) and meta["model_dir"] == str(tiny_model_dir.resolve())
    np.save(out / "windows.npy", ids[::-1].copy(), allow_pickle=False)  # same shape and dtype, other ids
    with pytest.raises(ValueError, match=r"windows\.npy .* does not match windows\.json"):
        common.load_windows(out)


def test_staged_output_leaves_nothing_when_the_block_fails(tmp_path):
    common = _script("peer_common")
    with pytest.raises(RuntimeError), common.staged_output(tmp_path / "ckpt") as tmp:
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    with common.staged_output(tmp_path / "ckpt") as tmp:
        (tmp / "model.safetensors").write_bytes(b"whole")
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == b"whole"
    with pytest.raises(FileExistsError, match="exists; remove it"), common.staged_output(tmp_path / "ckpt"):
        pass


def test_checkpoints_csv_upserts_one_row_per_build(tmp_path):
    folder = tmp_path / "llmcompressor-gptq-w4a16-g64"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"codes")
    settings = {"peer": "llm-compressor", "recipe": "gptq-w4a16-g64", "wall_s": 12.5, "model_dir": "/m",
                "versions": {"llmcompressor": "0.14.0", "compressed-tensors": "0.19.0", "transformers": "5.17.0",
                             "torch": "2.13.0+cpu"},
                "windows": {"ids_sha256": "ab", "shape": [32, 512], "seed": 0, "source": "local:wiki.valid.tokens"}}
    (folder / "referee_settings.json").write_text(json.dumps(settings))
    record = _script("checkpoints_csv").record
    csv_path = tmp_path / "checkpoints.csv"
    record([folder], csv_path)
    settings["wall_s"] = 13.0
    (folder / "referee_settings.json").write_text(json.dumps(settings))
    rows = record([folder], csv_path)  # recorded again: replaced, not added
    assert len(rows) == 1 and rows[0]["wall_s"] == 13.0 and rows[0]["peer_version"] == "0.14.0"
    assert rows[0]["safetensors_sha256"] == "model.safetensors:" + hashlib.sha256(b"codes").hexdigest()
    assert csv_path.read_text().count("\n") == 2
    (folder / "model.safetensors").write_bytes(b"other codes")  # rebuilt elsewhere: its own row, the first kept
    rows = record([folder], csv_path)
    assert [r["safetensors_sha256"].split(":")[1] for r in rows] == sorted(
        hashlib.sha256(b).hexdigest() for b in (b"codes", b"other codes"))
    assert csv_path.read_text().count("\n") == 3


def test_run_peers_names_are_the_peers_recipes():
    """Every run run_peers.sh lists is a recipe its peer script knows (checkpoint folder = <peer>-<recipe>)."""
    runs = re.search(r"^RUNS=\(([^)]*)\)", (REFEREE / "run_peers.sh").read_text(), re.MULTILINE).group(1).split()
    known = {f"llmcompressor-{r}" for r in _script("peer_llmcompressor").RECIPES}
    known |= {f"autoround-{r}" for r in _script("peer_autoround").RECIPES}
    assert runs and set(runs) <= known, set(runs) - known


@pytest.mark.parametrize("experiment", ["referee_smollm2", "referee_smollm2_full"])
def test_the_referee_experiment_scores_checkpoints_run_peers_builds(experiment):
    """Every `method = "checkpoint"` run of the referee's experiments reads a folder run_peers.sh writes
    (~/.cache/quantlab/referee/<run>), under the run's own name, and the peers' windows are the experiment's
    calibration (32 x 512 of the WikiText-2 validation split, seed 0: experiments/smollm2_ptq.toml's)."""
    from quantlab.runs.experiment import load_experiment

    runs = set(re.search(r"^RUNS=\(([^)]*)\)", (REFEREE / "run_peers.sh").read_text(), re.MULTILINE).group(1).split())
    exp = load_experiment(REPO / "experiments" / f"{experiment}.toml")
    scored = [r for r in exp.runs if r.to_dict()["method"] == "checkpoint"]
    assert scored
    for r in scored:
        path = r.to_dict()["path"]
        assert path == f"~/.cache/quantlab/referee/{r.name}" and r.name in runs, (r.name, path)
    ptq = load_experiment(REPO / "experiments" / "smollm2_ptq.toml")
    assert (exp.calibration, exp.seed) == (ptq.calibration, ptq.seed)


def test_the_whole_split_referee_scores_the_same_checkpoints_and_calibrated_methods():
    """referee_smollm2_full scores every peer checkpoint referee_smollm2 scores, and quantlab's GPTQ, AWQ,
    SmoothQuant and importance matrix on the same three calibration draws (the leaderboard's noise floor)."""
    from quantlab.runs.experiment import load_experiment

    sample, full = (load_experiment(REPO / "experiments" / f"{n}.toml") for n in ("referee_smollm2", "referee_smollm2_full"))
    peers = [{r.name for r in e.runs if r.to_dict()["method"] == "checkpoint"} for e in (sample, full)]
    assert peers[0] == peers[1]
    drawn = ("gptq-w4-g64", "awq-w4-g64", "smoothquant-a0.5-w8a8", "gguf-q4-k-m-imatrix")
    names = {r.name for r in full.runs}
    assert {f"{m}-seed{s}" for m in drawn for s in range(3)} <= names
    assert full.eval.max_windows is None and full.eval.max_tokens is None  # the whole split
