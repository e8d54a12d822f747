"""The command line as a user meets it: -q silences every bar, -v shows a failed run's traceback, a second
`quantlab run` of the same experiment fails (or --waits), bad names and non-UTF-8 files fail clearly,
`quantlab mixed` keeps the experiment file's comments."""
import json
import logging
import os
import re
import time

import pytest

from quantlab import get_method
from quantlab.cli import main
from quantlab.reporting.results import results_lock
from quantlab.runs.experiment import load_experiment

BAR = re.compile(r"\d+%\||it/s\]|s/it\]")  # what a tqdm bar prints


@pytest.fixture()
def exp_file(tiny_model_dir, tmp_path):
    sample = tiny_model_dir / "sample.txt"
    path = tmp_path / "tiny.toml"
    path.write_text(f"""name = "tiny_cli"
model = "{tiny_model_dir}"
device = "cpu"
[eval]
dataset = "{sample}"
seq_len = 32
max_windows = 2
kl_windows = 1
latency = false
[calibration]
dataset = "{sample}"
num_samples = 2
seq_len = 32
[[run]]
name = "fp32"
method = "none"
[[run]]
name = "gptq-w4"
method = "gptq"
bits = 4
group_size = 16
""")
    return path


@pytest.fixture()
def quantlab_log_level():
    """main() sets the quantlab logger's level (-v); put it back for the other tests."""
    logger = logging.getLogger("quantlab")
    level = logger.level
    yield
    logger.setLevel(level)


def test_quiet_run_prints_no_progress_bar(exp_file, tmp_path, capfd, quantlab_log_level):
    """Reference: the same run without -q prints bars (so the check can fail); with -q, none at all."""
    assert main(["run", str(exp_file), "--reports-dir", str(tmp_path / "loud")]) == 0
    assert BAR.search(capfd.readouterr().err)
    assert main(["-q", "run", str(exp_file), "--reports-dir", str(tmp_path / "quiet")]) == 0
    out, err = capfd.readouterr()
    assert "wrote" in out and not BAR.search(err) and "\r" not in err, err


def test_failed_run_one_line_traceback_only_with_verbose(exp_file, tmp_path, capsys, caplog, monkeypatch,
                                                        quantlab_log_level):
    def boom(model, config):
        raise RuntimeError("simulated failure in prepare")

    monkeypatch.setattr(get_method("gptq"), "prepare", boom)
    for verbose in (False, True):
        caplog.clear()
        argv = ["-q", *(["-v"] if verbose else []), "run", str(exp_file), "--reports-dir", str(tmp_path / str(verbose))]
        assert main(argv) == 1
        failed = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert [r.getMessage() for r in failed] == ["run 'gptq-w4' failed: RuntimeError: simulated failure in prepare"]
        assert failed[0].exc_info is None  # the one line carries no traceback
        assert ("Traceback (most recent call last)" in caplog.text) == verbose
        assert ('in boom\n    raise RuntimeError("simulated failure in prepare")' in caplog.text) == verbose
        assert "quantlab: error: 1 run(s) failed (finished rows kept in" in capsys.readouterr().err


def test_second_run_fails_at_once_and_wait_waits(exp_file, tmp_path, capsys, lock_held_elsewhere):
    reports = tmp_path / "reports"
    reports.mkdir()
    results = reports / "tiny_cli.results.jsonl"
    with results_lock(results):
        assert main(["-q", "run", str(exp_file), "--reports-dir", str(reports)]) == 1
        err = capsys.readouterr().err
        assert f"tiny_cli.results.jsonl is being written by PID {os.getpid()}" in err and "--wait" in err
        assert main(["-q", "run", str(exp_file), "--reports-dir", str(reports), "--wait", "--wait-timeout", "0.1"]) == 1
        assert "gave up after waiting" in capsys.readouterr().err
    assert not results.exists()  # nothing ran

    with lock_held_elsewhere(results, 1.0) as released_at:
        assert main(["-q", "run", str(exp_file), "--reports-dir", str(reports), "--wait"]) == 0
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["run"] for r in rows] == ["fp32", "gptq-w4"]  # each run once
    assert min(r["timestamp"] for r in rows) >= time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(released_at[0] - 1))


def test_names_that_would_escape_the_reports_dir_fail_before_loading(exp_file, tmp_path, capsys, monkeypatch):
    from quantlab.models import loading

    monkeypatch.setattr(loading, "load_model", None)  # nothing may load
    exp_file.write_text(exp_file.read_text().replace('name = "tiny_cli"', 'name = "../../x"'))
    assert main(["run", str(exp_file), "--reports-dir", str(tmp_path)]) == 1
    assert "experiment name '../../x' contains '/'" in capsys.readouterr().err
    assert main(["sensitivity", "some-model", "--name", "../up", "--reports-dir", str(tmp_path)]) == 1
    assert "--name '../up' contains '/'; it must be a non-empty name" in capsys.readouterr().err
    assert main(["sensitivity", "/models/..", "--reports-dir", str(tmp_path)]) == 1
    assert "output name (from the model path; set one with --name) '..' starts with '.'" in capsys.readouterr().err
    exp_file.write_text(exp_file.read_text().replace('name = "../../x"', 'name = "tiny_cli"'))
    assert main(["mixed", str(exp_file), "--target-bits", "3", "--prefix", "../"]) == 1
    assert "run name (--prefix '../') '../3b' contains '/'" in capsys.readouterr().err


def test_a_name_too_long_for_a_file_name_fails_in_validation(exp_file, tmp_path, capsys, monkeypatch):
    from quantlab.runs import runner

    monkeypatch.setattr(runner, "EvalContext", None)  # nothing may load
    text = exp_file.read_text()
    exp_file.write_text(text.replace('name = "tiny_cli"', f'name = "{"x" * 240}"'))
    assert main(["run", str(exp_file), "--dry-run", "--reports-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{exp_file}: experiment name 'xxxx" in err, err
    assert "is 240 UTF-8 bytes long; it must be" in err and "at most 200 UTF-8 bytes" in err
    exp_file.write_text(text.replace('name = "tiny_cli"', f'name = "{"x" * 198}"'))  # fits, but not with _full
    assert main(["run", str(exp_file), "--full", "--dry-run", "--reports-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--full" in err and "203 UTF-8 bytes" in err and "at most 195" in err, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("dry_run", [False, True])
def test_reports_dir_that_is_a_file_or_empty_fails_in_one_line(exp_file, tmp_path, capsys, monkeypatch, dry_run):
    from quantlab.runs import runner

    monkeypatch.setattr(runner, "EvalContext", None)  # nothing may load
    monkeypatch.chdir(tmp_path)  # "" must not mean this folder
    (tmp_path / "afile").write_text("keep\n")
    extra = ["--dry-run"] if dry_run else []
    assert main(["run", str(exp_file), "--reports-dir", str(tmp_path / "afile"), *extra]) == 1
    err = capsys.readouterr().err
    assert err == f"quantlab: error: --reports-dir {str(tmp_path / 'afile')!r} is a file, not a folder\n", err
    assert main(["run", str(exp_file), "--reports-dir", str(tmp_path / "afile" / "sub"), *extra]) == 1
    assert f"{str(tmp_path / 'afile')!r} is a file, not a folder" in capsys.readouterr().err
    assert main(["run", str(exp_file), "--reports-dir", "", *extra]) == 1
    err = capsys.readouterr().err
    assert err.startswith("quantlab: error: --reports-dir is empty;") and err.count("\n") == 1, err
    assert (tmp_path / "afile").read_text() == "keep\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "afile", "tiny.toml"]


def test_symlinks_at_the_lock_or_results_path_fail_in_one_line(exp_file, tmp_path, capsys, monkeypatch):
    from quantlab.runs import runner

    monkeypatch.setattr(runner, "EvalContext", None)  # refused before anything loads
    reports, outside = tmp_path / "reports", tmp_path / "outside.txt"
    reports.mkdir()
    outside.write_text("precious\n")
    for name in ("tiny_cli.results.jsonl.lock", "tiny_cli.results.jsonl"):
        (reports / name).symlink_to(outside)
        assert main(["-q", "run", str(exp_file), "--reports-dir", str(reports)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("quantlab: error: ") and f"{reports / name} is a symlink" in err, err
        assert err.count("\n") == 1 and outside.read_text() == "precious\n"
        (reports / name).unlink()
    assert sorted(p.name for p in reports.iterdir()) == []


def test_non_utf8_files_fail_naming_the_file(exp_file, tmp_path, capsys):
    latin1 = "unit,candidate\nlayer,Gr\u00fc\u00dfe\n".encode("latin-1")
    (tmp_path / "sens.csv").write_bytes(latin1)
    assert main(["mixed", str(exp_file), "--target-bits", "3", "--sensitivity", str(tmp_path / "sens.csv")]) == 1
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sens.csv'}: not a UTF-8 text file ('utf-8' codec can't decode byte 0xfc in position 23" in err
    (tmp_path / "b.csv").write_text("run,ppl\nfp32,1.0\n")
    assert main(["compare", str(tmp_path / "sens.csv"), str(tmp_path / "b.csv")]) == 1
    assert f"{tmp_path / 'sens.csv'}: not a UTF-8 text file" in capsys.readouterr().err
    (tmp_path / "x.results.jsonl").write_bytes(b'{"run": "caf\xe9"}\n')
    assert main(["report", str(tmp_path / "x.results.jsonl")]) == 1
    assert f"{tmp_path / 'x.results.jsonl'}: not a UTF-8 text file ('utf-8' codec can't decode byte 0xe9" in (
        capsys.readouterr().err)


MIXED_FILE = """\
# Mixed precision for the tiny model
# (a second header line)
name = "tiny_mixed"   # report name
model = "m"
description = "mixed"  # what this is

# the protocol
[eval]
seq_len = 32        # short windows
max_windows = 2

# the baseline, compared against
[[run]]
name = "fp32"
method = "none"   # float

# an old mixed run, replaced in place
[[run]]
name = "mixed-5.6b"
# inside the stale run: goes with it
method = "rtn"
bits = 3

# a hand-written run after it
[[run]]
name = "w8"
method = "rtn"
bits    = 8     # odd spacing kept
# last comment
"""


def _sensitivity_csv(path):
    """Three layers x two candidates (2 and 8 bits), as `quantlab sensitivity` writes them; layer 0 is the
    sensitive one."""
    cands = {"w2": {"method": "rtn", "bits": 2, "group_size": 32}, "w8": {"method": "rtn", "bits": 8}}
    lines = ["unit,candidate,granularity,params,quant_bytes,kl_mean,config"]
    for i, kl in ((0, (0.5, 0.01)), (1, (0.1, 0.02)), (2, (0.1, 0.02))):
        for (cand, cfg), k, size in zip(cands.items(), kl, (300, 1100)):
            config = '"' + json.dumps(cfg).replace('"', '""') + '"'
            lines.append(f"model.layers.{i}.mlp.down_proj,{cand},layer,1000,{size},{k},{config}")
    path.write_text("\n".join(lines) + "\n")


def test_mixed_keeps_every_comment_and_the_formatting(tmp_path, capsys):
    exp, sens = tmp_path / "tiny_mixed.toml", tmp_path / "s.csv"
    exp.write_text(MIXED_FILE)
    _sensitivity_csv(sens)
    assert main(["mixed", str(exp), "--target-bits", "5.6", "4", "--sensitivity", str(sens)]) == 0
    text = exp.read_text()
    before, after = MIXED_FILE.split('name = "mixed-5.6b"\n')
    assert text.startswith(before + 'name = "mixed-5.6b"\nmethod = "rtn"\n')  # everything before it, byte for byte
    tail = after[after.index("\n# a hand-written run after it"):]
    assert tail in text  # the comment about the next run, that run and the last comment, as written
    assert "inside the stale run" not in text and text.count("[[run]]") == 4
    assert text.endswith(tail + '\n[[run]]\nname = "mixed-4b"\nmethod = "rtn"\nbits = 2\ngroup_size = 32\n')
    exp_loaded = load_experiment(exp)
    assert [r.name for r in exp_loaded.runs] == ["fp32", "mixed-5.6b", "w8", "mixed-4b"]
    w8 = exp_loaded.runs[2].config
    assert w8.bits == 8 and not w8.overrides
    plan = {o.pattern: o.bits for o in exp_loaded.runs[1].config.overrides}
    assert exp_loaded.runs[1].config.bits == 2 and plan == {"model.layers.0.mlp.down_proj": 8}  # the costlier KL
    assert "wrote" in capsys.readouterr().out


def test_export_runs_from_the_command_line_and_writes_what_the_library_writes(exp_file, tmp_path, capsys):
    """`quantlab export --format compressed-tensors` (the command once parsed but had nothing to call): exit 0, the
    one-line summary, and the bytes export_run writes for the same run (reference; the export is deterministic). An
    unknown run fails in one line, before anything loads. The GGUF form: tests/test_gguf.py."""
    from quantlab.runs.export import export_run

    cli, lib = tmp_path / "cli", tmp_path / "lib"
    assert main(["-q", "export", str(exp_file), str(cli), "--run", "gptq-w4", "--format", "compressed-tensors"]) == 0
    assert re.match(rf"wrote {re.escape(str(cli))} \(.* MiB\): \d+ w4 g16 sym \(pack-quantized\); left float: lm_head",
                    capsys.readouterr().out)
    export_run(load_experiment(exp_file), "gptq-w4", lib, "compressed-tensors", progress=False)
    assert sorted(p.name for p in cli.iterdir()) == sorted(p.name for p in lib.iterdir())
    files = list(lib.glob("*.safetensors"))
    assert files
    for path in files:
        assert (cli / path.name).read_bytes() == path.read_bytes()
    assert main(["-q", "export", str(exp_file), str(tmp_path / "x"), "--run", "nope"]) == 1
    assert "has no run 'nope'; its runs: fp32, gptq-w4" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
