"""Out-of-domain evaluation: the pystdlib code domain, `[eval] datasets` (several domains in one pass), mixed-domain
calibration, per-run calibration, per-domain paired findings ({a vs b@domain}) and old single-domain results."""
import hashlib
import dataclasses
import json
import shutil
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import torch

from quantlab.models import pystdlib
from quantlab.models.data import DATASETS, load_text, split_counts
from quantlab.reporting.findings import FindingsError
from quantlab.reporting.regenerate import regenerate_report
from quantlab.runs import runner
from quantlab.runs.experiment import CalibrationProtocol, EvalProtocol, parse_experiment
from quantlab.runs.tomlwrite import experiment_toml

REPO = Path(__file__).resolve().parents[1]
RUNS = [{"name": "fp32", "method": "none"}, {"name": "rtn", "method": "rtn", "bits": 3, "group_size": 32},
        {"name": "gptq", "method": "gptq", "bits": 3, "group_size": 32, "symmetric": False}]


@pytest.fixture()
def small_stdlib(tmp_path, monkeypatch):
    """A stand-in standard library: 16 real stdlib modules (so the tiny model's tokenizer is fast), plus files the
    domain must leave out; pystdlib reads it instead of the interpreter's."""
    real = pystdlib.stdlib_root()
    root = tmp_path / "stdlib"
    for name in ["abc.py", "bisect.py", "colorsys.py", "copyreg.py", "fnmatch.py", "genericpath.py", "glob.py",
                 "keyword.py", "numbers.py", "opcode.py", "operator.py", "queue.py", "sched.py", "shlex.py",
                 "stat.py", "struct.py"]:
        (root / Path(name).parent).mkdir(parents=True, exist_ok=True)
        shutil.copy(real / name, root / name)
    for excluded in ["site-packages/pkg/mod.py", "test/test_x.py", "json/tests/t.py", "encodings/cp1.py"]:
        (root / excluded).parent.mkdir(parents=True, exist_ok=True)
        (root / excluded).write_text("EXCLUDED = True\n")
    (root / "json").joinpath("__init__.py").write_text("# json package\n")
    monkeypatch.setattr(pystdlib, "stdlib_root", lambda: root)
    return root


def test_pystdlib_is_deterministic_and_its_parts_are_disjoint():
    pystdlib._text.cache_clear()
    text, source = load_text("pystdlib", "test")
    pystdlib._text.cache_clear()  # read the files again: the same text and the same hashes
    assert load_text("pystdlib", "test") == (text, source)
    test, calib, every = pystdlib.pystdlib_files("test"), pystdlib.pystdlib_files("validation"), pystdlib.all_files()
    assert not set(test) & set(calib) and sorted(test + calib) == every and test == sorted(test)
    assert 0.15 < len(calib) / len(every) < 0.35  # about one file in 4 calibrates
    assert f"{len(test)} files" in source and f"{len(text)} chars" in source and "files sha256 " in source
    assert not any(set(f.split("/")[:-1]) & pystdlib.EXCLUDED_DIRS for f in every)
    assert "pystdlib" in DATASETS


def test_pystdlib_calibration_part_holds_no_test_file(small_stdlib):
    files = pystdlib.all_files()
    assert "json/__init__.py" in files and not any("EXCLUDED" in (small_stdlib / f).read_text() for f in files)
    test, calib = pystdlib.pystdlib_files("test"), pystdlib.pystdlib_files("validation")
    assert test and calib and not set(test) & set(calib)
    text, _ = load_text("pystdlib", "validation")  # the calibration text is the calibration part, joined
    assert text == "\n\n".join((small_stdlib / f).read_text() for f in calib)
    assert all((small_stdlib / f).read_text() not in text for f in test)
    # the relative path alone decides, by the documented rule (sha256 of the path, one in CALIBRATION_EVERY)
    reference = {f: "validation" if int(hashlib.sha256(f.encode()).hexdigest()[:8], 16)
                 % pystdlib.CALIBRATION_EVERY == 0 else "test" for f in files}
    assert {f: pystdlib.split_of(f) for f in files} == reference
    with pytest.raises(ValueError, match="never calibrate on the evaluation split"):
        CalibrationProtocol(datasets=("wikitext2", "pystdlib"), split="test")


def test_bad_domain_names_fail_naming_the_known_ones(tiny_model_dir):
    with pytest.raises(ValueError, match=r"eval.datasets: unknown dataset 'pystdlb'; known: pystdlib, wikitext2"):
        EvalProtocol(datasets=["wikitext2", "pystdlb"])
    with pytest.raises(ValueError, match=r"calibration.datasets: unknown dataset 'wikitext'; known: pystdlib"):
        CalibrationProtocol(datasets=["wikitext"])
    with pytest.raises(ValueError, match="named twice"):
        EvalProtocol(datasets=["pystdlib", "pystdlib"])
    with pytest.raises(ValueError, match="disagree"):
        EvalProtocol(dataset="pystdlib", datasets=["wikitext2"])
    with pytest.raises(ValueError, match="one positive weight per dataset"):
        CalibrationProtocol(datasets=["wikitext2", "pystdlib"], mix=[1])
    with pytest.raises(FindingsError, match=r"unknown domain 'pystdlb'; known: wikitext2, pystdlib"):
        _experiment(tiny_model_dir, eval={"datasets": ["wikitext2", "pystdlib"]}, findings="{rtn vs fp32@pystdlb}")
    with pytest.raises(ValueError, match="applies to runs that calibrate or train; rtn"):
        _experiment(tiny_model_dir, run=[{**RUNS[1], "calibration": {"num_samples": 8}}])


def test_the_parts_follow_the_paths_not_the_folder_or_the_contents(small_stdlib, tmp_path, monkeypatch):
    """The same relative paths under another root, every file's text changed, split exactly as before."""
    files = pystdlib.all_files()
    other = tmp_path / "other-stdlib"
    for f in files:
        (other / f).parent.mkdir(parents=True, exist_ok=True)
        (other / f).write_text(f"# changed {f}\n" + (small_stdlib / f).read_text()[::-1])
    before = {s: pystdlib.pystdlib_files(s) for s in ("test", "validation")}
    monkeypatch.setattr(pystdlib, "stdlib_root", lambda: other)
    assert {s: pystdlib.pystdlib_files(s) for s in ("test", "validation")} == before
    assert before["test"] and before["validation"]


def test_split_counts():
    assert split_counts(32, [1, 1]) == [16, 16] and split_counts(10, [2, 1]) == [7, 3]
    assert split_counts(5, [1, 1]) == [3, 2] and sum(split_counts(128, [0.3, 0.7, 1])) == 128


def _experiment(model_dir, **top):
    sample = str(model_dir / "sample.txt")
    data = {"name": "tiny_domains", "model": str(model_dir), "device": "cpu", "run": RUNS,
            "eval": {"dataset": sample, "seq_len": 32, "max_windows": 3, "kl_windows": 2, "latency": False},
            "calibration": {"dataset": sample, "num_samples": 4, "seq_len": 32}}
    for k, v in top.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and k in data else v
    if "datasets" in data["eval"]:
        data["eval"].pop("dataset")
    return parse_experiment(data)


FINDINGS = "code: {gptq vs rtn@stdlib} ({gptq vs rtn@stdlib:verdict}); main {gptq vs rtn} = {gptq vs rtn@sample}; " \
           "{gptq:ppl_stdlib} {gptq:ppl_stdlib_ci} {gptq:ppl_stdlib_delta_ci}"


def test_each_domain_gives_exactly_the_single_domain_numbers(tiny_model_dir, small_stdlib, tmp_path):
    code = tmp_path / "stdlib.txt"  # the code domain as a text file too, so both paths are covered
    code.write_text(load_text("pystdlib", "test")[0])
    multi = _experiment(tiny_model_dir, eval={"datasets": [str(tiny_model_dir / "sample.txt"), "pystdlib", str(code)]},
                        findings=FINDINGS)
    df = runner.run_experiment(multi, tmp_path / "multi", progress=False).set_index("run")
    assert json.loads(df.loc["fp32", "eval_domains"]) == ["sample", "pystdlib", "stdlib"]
    assert "pystdlib test part of" in df.loc["fp32", "eval_source_pystdlib"]
    for label, dataset in [("sample", str(tiny_model_dir / "sample.txt")), ("pystdlib", "pystdlib"),
                           ("stdlib", str(code))]:
        single = runner.run_experiment(_experiment(tiny_model_dir, name=f"single_{label}", eval={"dataset": dataset}),
                                       tmp_path / "single", progress=False).set_index("run")
        for run in ("fp32", "rtn", "gptq"):  # exact: the same windows through the same code
            assert df.loc[run, f"ppl_{label}"] == single.loc[run, "ppl"]
            assert df.loc[run, f"window_nll_{label}"] == single.loc[run, "window_nll"]
            assert df.loc[run, f"kl_mean_{label}"] == single.loc[run, "kl_mean"]
            assert df.loc[run, f"ppl_{label}_ci_high"] == single.loc[run, "ppl_ci_high"]
            assert df.loc[run, f"ppl_{label}_delta_ci_low"] == single.loc[run, "ppl_delta_ci_low"]
    assert df.loc["gptq", "ppl"] == df.loc["gptq", "ppl_sample"]  # the main domain fills the usual columns
    assert df.loc["gptq", "ppl_pystdlib"] == df.loc["gptq", "ppl_stdlib"]  # the same text, as a file
    md = (tmp_path / "multi" / "tiny_domains.md").read_text()
    assert "| ppl stdlib ↓ |" in md and "Δppl % pystdlib 95% CI (paired)" in md and "| ppl sample ↓ |" not in md
    assert "evaluated on 3 domains in one pass" in md and "pystdlib `test` (pystdlib test part of" in md
    findings = md.split("## Findings")[1].split("\n\n")[2]
    main, per_domain = findings.split("main ")[1].split(";")[0].split(" = ")
    assert main == per_domain and "%" in findings.split("code: ")[1].split(" (")[0]
    assert "[" in findings.split(";")[-1]  # ppl_stdlib_ci and ppl_stdlib_delta_ci render as intervals
    # regenerated from the rows alone, byte for byte
    regenerate_report(tmp_path / "multi" / "tiny_domains.results.jsonl", tmp_path / "again")
    assert (tmp_path / "again" / "tiny_domains.md").read_text() == md


def test_run_keys_mixed_calibration_and_per_run_calibration(tiny_model_dir, small_stdlib, tmp_path):
    cpu = torch.device("cpu")
    plain = _experiment(tiny_model_dir)
    multi = _experiment(tiny_model_dir, eval={"datasets": [str(tiny_model_dir / "sample.txt"), "pystdlib"]})
    assert all(runner.run_key(plain, a, cpu) != runner.run_key(multi, b, cpu) for a, b in zip(plain.runs, multi.runs))
    mixed = {"name": "gptq-mixed", "method": "gptq", "bits": 3, "group_size": 32, "symmetric": False,
             "calibration": {"datasets": [str(tiny_model_dir / "sample.txt"), "pystdlib"], "mix": [1, 3]}}
    same = {**RUNS[2], "name": "gptq", "calibration": {"num_samples": 4}}  # what the file says anyway
    exp = _experiment(tiny_model_dir, run=[RUNS[0], same, mixed])
    assert runner.run_key(exp, exp.runs[1], cpu) == runner.run_key(plain, plain.runs[2], cpu)
    assert exp.runs[2].calibration.mix == (1, 3) and exp.runs[2].calibration.num_samples == 4
    text = experiment_toml(exp)  # round trip: the run's calibration table is written back
    assert parse_experiment(tomllib.loads(text)) == exp and "calibration = { datasets = [" in text
    df = runner.run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert df.loc["gptq-mixed", "calib_source"].startswith("sample (1 windows): file:sample.txt; pystdlib (3 windows)")
    assert df.loc["gptq", "calib_source"] == "file:sample.txt"
    md = (tmp_path / "tiny_domains.md").read_text()  # the protocol names the run with its own calibration
    assert "of file:sample.txt (never the test split). gptq-mixed: 4 windows of 32 tokens of sample (1 windows)" in md
    ctx = runner.EvalContext(exp, cpu, None, None, progress=False)  # the mixed draw is each dataset's own draw
    windows = ctx.calibration(0, exp.runs[2].calibration)
    sample_only = ctx.calibration(0, dataclasses.replace(exp.calibration, num_samples=1))
    assert windows.shape == (4, 32) and torch.equal(windows[:1], sample_only)


def test_old_single_domain_results_still_report(tmp_path):
    results = REPO / "reports" / "smollm2_ptq.results.jsonl"
    regenerate_report(results, tmp_path)
    assert (tmp_path / "smollm2_ptq.md").read_text() == (REPO / "reports" / "smollm2_ptq.md").read_text()
    df = pd.read_csv(tmp_path / "smollm2_ptq.csv")
    assert not any(c.startswith("window_nll_") for c in df.columns)


def test_a_domain_the_rows_lack_fails_naming_theirs(tmp_path):
    from quantlab.reporting.report import write_report

    rows = [json.loads(line) for line in (REPO / "reports" / "smollm2_ptq.results.jsonl").read_text().splitlines()]
    with pytest.raises(FindingsError, match=r"not evaluated on domain 'pystdlib'; its domains: none"):
        write_report("x", rows, tmp_path, findings="{gptq-w4-g64 vs rtn-w4-g64@pystdlib}")


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_on_wikitext_and_code(tmp_path, wikitext_dir):
    """SmolLM2 reads code more easily than WikiText (measured at 512 x 1 window: ppl 9.13 vs 21.98), and RTN w3 g64
    costs it perplexity on both; the code domain goes through the real tokenizer."""
    exp = parse_experiment({
        "name": "smol_domains", "model": "smollm2-135m", "device": "cpu",
        "eval": {"datasets": ["wikitext2", "pystdlib"], "seq_len": 256, "max_windows": 2, "kl_windows": 0,
                 "latency": False},
        "run": [RUNS[0], {"name": "rtn", "method": "rtn", "bits": 3, "group_size": 64, "symmetric": False}],
        "findings": "{rtn vs fp32@pystdlib:verdict}"})
    df = runner.run_experiment(exp, tmp_path, data_dir=wikitext_dir, progress=False).set_index("run")
    assert 2 < df.loc["fp32", "ppl_pystdlib"] < df.loc["fp32", "ppl_wikitext2"]
    for d in ("wikitext2", "pystdlib"):
        assert df.loc["rtn", f"ppl_{d}"] > df.loc["fp32", f"ppl_{d}"]
    assert "higher than" in (tmp_path / "smol_domains.md").read_text()


def test_spread_windows_in_an_experiment(tiny_model_dir, tmp_path):
    """[eval] windows = "spread": the row says so, the protocol line says so, the key of a default run is as before."""
    first = _experiment(tiny_model_dir, run=RUNS[:2])
    spread = _experiment(tiny_model_dir, run=RUNS[:2], eval={"windows": "spread"})
    dev = torch.device("cpu")
    assert runner.run_key(first, first.runs[0], dev) != runner.run_key(spread, spread.runs[0], dev)
    assert runner.run_key(first, first.runs[0], dev) == runner.run_key(
        _experiment(tiny_model_dir, run=RUNS[:2], eval={"windows": "first"}), first.runs[0], dev)
    df = runner.run_experiment(spread, tmp_path, progress=False).set_index("run")
    assert df.loc["fp32", "eval_window_order"] == "spread"
    assert "spread evenly over the split" in (tmp_path / "tiny_domains.md").read_text()
    ref = runner.run_experiment(first, tmp_path / "first", progress=False).set_index("run")
    assert "eval_window_order" not in ref and df.loc["fp32", "eval_windows"] == ref.loc["fp32", "eval_windows"]
    assert df.loc["fp32", "window_nll"] != ref.loc["fp32", "window_nll"]  # other windows (the sample has more than 3)
    with pytest.raises(ValueError, match="eval.windows 'random' unknown; known: first, spread"):
        EvalProtocol(windows="random")
