"""`--executor ray`: a local Ray runs the grid with rows equal to the local executor's, failures keep the other
rows and resume only what is missing, a killed worker is retried with its row written once, and the bad inputs
fail clearly. Ray and its workers start in ~10 s, so these are marked slow."""
from __future__ import annotations

import contextlib
import http.server
import json
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from quantlab.reporting.results import read_rows
from quantlab.runs.experiment import parse_experiment
from quantlab.runs.runner import run_experiment

TIMING = ("_s", "timestamp", "device_name", "eval_batch_size", "peak_rss_mib",
          "load_avg_1m_start", "load_avg_1m_end")  # measured: may differ between executors


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    tests_dir = str(Path(__file__).parent)
    path = os.pathsep.join([tests_dir, str(Path(__file__).parents[1]), *sys.path])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def _grid(model_dir, tmp_path, extra_runs=(), **execution):
    text = (model_dir / "sample.txt")
    return parse_experiment({
        "name": "grid", "model": str(model_dir), "device": "cpu", "execution": {"num_cpus": 1, **execution},
        "eval": {"dataset": str(text), "seq_len": 32, "max_windows": 3, "kl_windows": 2, "latency": False},
        "calibration": {"dataset": str(text), "split": "validation", "num_samples": 2, "seq_len": 32},
        "run": [{"name": "fp32", "method": "none"}, *extra_runs],
        "sweep": [{"method": "rtn", "bits": [4, 8], "group_size": [32]}, {"method": "gptq", "bits": [4], "group_size": 32}],
    })


def _metrics(rows):
    return {r["run"]: {k: v for k, v in r.items() if not any(k.endswith(t) or k == t for t in TIMING)} for r in rows}


@pytest.mark.slow
def test_ray_rows_equal_the_local_executors(ray_local, tiny_model_dir, tmp_path):
    import torch

    exp = _grid(tiny_model_dir, tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tasks' num_cpus = 1: the same threads, so the same float reductions
    try:
        run_experiment(exp, tmp_path / "local", progress=False)
    finally:
        torch.set_num_threads(threads)
    run_experiment(exp, tmp_path / "ray", progress=False, executor="ray")
    local, ray_rows = read_rows(tmp_path / "local/grid.results.jsonl"), read_rows(tmp_path / "ray/grid.results.jsonl")
    assert sorted(r["run"] for r in ray_rows) == ["fp32", "gptq-w4", "rtn-w4-g32", "rtn-w8-g32"]
    assert _metrics(ray_rows) == _metrics(local)  # every metric, the window NLLs, the run keys
    report = (tmp_path / "ray/grid.csv").read_text().splitlines()
    assert [line.split(",")[0] for line in report[1:]] == [r.name for r in exp.runs]  # the file's run order


@pytest.mark.slow
def test_a_failing_run_keeps_the_others_and_a_rerun_resumes_only_it(ray_local, tiny_model_dir, tmp_path, caplog):
    bad = {"name": "bad-override", "method": "rtn", "bits": 4, "overrides": [{"pattern": "no.such.layer", "bits": 8}]}
    exp = _grid(tiny_model_dir, tmp_path, extra_runs=[bad])
    with pytest.raises(RuntimeError, match=r"1 run\(s\) failed .*bad-override: ValueError: override pattern "
                                           r"'no.such.layer' matches no quantized layer"):
        run_experiment(exp, tmp_path, progress=False, executor="ray")
    rows = read_rows(tmp_path / "grid.results.jsonl")
    assert sorted(r["run"] for r in rows) == ["fp32", "gptq-w4", "rtn-w4-g32", "rtn-w8-g32"]
    caplog.clear()
    with caplog.at_level("INFO", logger="quantlab.runs.runner"), pytest.raises(RuntimeError, match="bad-override"):
        run_experiment(exp, tmp_path, progress=False, executor="ray")
    assert "5 runs, 4 already done, 1 to run" in caplog.text
    assert len(read_rows(tmp_path / "grid.results.jsonl")) == 4


@pytest.mark.slow
def test_a_killed_worker_is_retried_and_its_row_written_once(ray_local, tiny_model_dir, tmp_path):
    marker = tmp_path / "died-once"
    run = {"name": "dies-once", "method": "die_once", "bits": 4, "group_size": 32, "marker": str(marker)}
    sys.path.insert(0, str(Path(__file__).parent))
    import ray_helpers  # noqa: F401  (registers die_once in this process too, for validation)

    exp = _grid(tiny_model_dir, tmp_path, extra_runs=[run], max_retries=2)
    run_experiment(exp, tmp_path, progress=False, executor="ray")
    assert marker.exists()  # the first attempt died
    rows = read_rows(tmp_path / "grid.results.jsonl")
    assert [r["run"] for r in rows].count("dies-once") == 1 and len(rows) == 5
    died = next(r for r in rows if r["run"] == "dies-once")
    assert json.loads(died["config"])["method"] == "die_once" and died["ppl"] > 0


def test_bad_execution_inputs_fail_clearly(tiny_model_dir, tmp_path, monkeypatch):
    from quantlab.runs import ray_executor

    with pytest.raises(ValueError, match=r"execution.max_retries must be an integer >= 0, got -1"):
        _grid(tiny_model_dir, tmp_path, max_retries=-1)
    with pytest.raises(ValueError, match=r"qat_processes = 2 applies to runs that train \(qat\), and no run here"):
        _grid(tiny_model_dir, tmp_path, qat_processes=2)
    exp = _grid(tiny_model_dir, tmp_path)
    with pytest.raises(ValueError, match=r"unknown executor 'dask'; known: local, ray"):
        run_experiment(exp, tmp_path, executor="dask")
    with pytest.raises(ValueError, match=r"--address '1.2.3.4:1' needs --executor ray"):
        run_experiment(exp, tmp_path, address="1.2.3.4:1")
    with pytest.raises(ConnectionError, match=r"cannot reach the Ray cluster at '127.0.0.1:9'"):
        ray_executor.check_reachable("127.0.0.1:9", timeout_s=2)  # nothing listens on the discard port
    with pytest.raises(ValueError, match=r"--address 'nohost' is not 'auto' or host:port"):
        ray_executor.check_reachable("nohost")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'quantlab\[ray\]'"):
        run_experiment(exp, tmp_path, executor="ray")
    assert not (tmp_path / "grid.results.jsonl").exists()  # nothing was run or written


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_a_four_run_smollm2_grid_on_ray_equals_the_local_run(ray_local, wikitext_dir, tmp_path):
    """The issue's check on the real model: a 4-run [[sweep]] (plus the baseline), one 128-token window each."""
    import torch

    exp = parse_experiment({
        "name": "smol_grid", "model": "smollm2-135m", "device": "cpu", "execution": {"num_cpus": 1},
        "eval": {"seq_len": 128, "max_windows": 1, "kl_windows": 1, "latency": False},
        "run": [{"name": "fp32", "method": "none"}],
        "sweep": [{"method": "rtn", "bits": [3, 4], "group_size": [64, 128], "symmetric": False}]})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_experiment(exp, tmp_path / "local", data_dir=wikitext_dir, progress=False)
    finally:
        torch.set_num_threads(threads)
    run_experiment(exp, tmp_path / "ray", data_dir=wikitext_dir, progress=False, executor="ray")
    local = read_rows(tmp_path / "local/smol_grid.results.jsonl")
    ray_rows = read_rows(tmp_path / "ray/smol_grid.results.jsonl")
    assert len(ray_rows) == 5 and _metrics(ray_rows) == _metrics(local)
    assert {r["run"] for r in ray_rows} >= {"rtn-w3-g64", "rtn-w4-g128"}


@pytest.mark.slow
def test_a_plugin_method_beside_the_experiment_file_runs_on_ray_workers(ray_local, tiny_model_dir, tmp_path):
    """The workers unpickle the run's config of an outside method: its folder reaches them (runtime_env PYTHONPATH),
    and its row equals the local executor's."""
    from quantlab.runs.experiment import load_experiment

    (tmp_path / "plug_ray_half.py").write_text(
        "from dataclasses import dataclass\nimport quantlab\nfrom quantlab.methods.rtn import RTN\n\n"
        "@dataclass(frozen=True)\nclass C(quantlab.RTNConfig):\n    pass\n\n"
        "@quantlab.register_method\nclass M(RTN):\n    name = 'plug_ray_half'\n    config_cls = C\n")
    (tmp_path / "exp.toml").write_text(
        f'name = "plugged"\nmodel = "{tiny_model_dir}"\ndevice = "cpu"\nplugins = ["plug_ray_half"]\n'
        f'[eval]\ndataset = "{tiny_model_dir / "sample.txt"}"\nseq_len = 32\nmax_windows = 2\nlatency = false\n'
        '[[run]]\nname = "outside"\nmethod = "plug_ray_half"\nbits = 4\ngroup_size = 16\n')
    exp = load_experiment(tmp_path / "exp.toml")
    run_experiment(exp, tmp_path / "local", progress=False)
    run_experiment(exp, tmp_path / "ray", progress=False, executor="ray")
    local, ray_rows = (read_rows(tmp_path / d / "plugged.results.jsonl") for d in ("local", "ray"))
    assert [r["method"] for r in ray_rows] == ["plug_ray_half"] and _metrics(ray_rows) == _metrics(local)


class _QuietHTTPHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):  # it answers Ray's probe with an HTTP error: keep that out of the test output
        pass


@contextlib.contextmanager
def _listener(kind: str):
    """host:port where nothing listens ("closed": bound, not listening, so refused), an HTTP server answers
    ("http"), or a TCP listener accepts and never replies ("silent")."""
    if kind == "http":
        server = http.server.HTTPServer(("127.0.0.1", 0), _QuietHTTPHandler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()
            server.server_close()
        return
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    if kind == "silent":
        sock.listen()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


@pytest.mark.parametrize("kind", ["closed", "http", "silent"])
def test_an_address_where_nothing_ray_answers_fails_fast_naming_it(kind):
    from quantlab.runs import ray_executor

    with _listener(kind) as address:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=rf"at '{address}' .*nothing Ray answers there"):
            ray_executor.check_reachable(address, timeout_s=1)
        assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("kind", ["closed", "http"])
def test_cli_address_where_nothing_ray_answers_is_one_line_before_ray_loads(kind, tiny_model_dir, tmp_path, capsys,
                                                                           monkeypatch):
    from quantlab.cli import main
    from quantlab.runs import ray_executor

    def no_ray():
        raise AssertionError("Ray must not even load for an address nothing Ray answers at")

    monkeypatch.setattr(ray_executor, "import_ray", no_ray)
    exp_file = tmp_path / "x.toml"
    exp_file.write_text(f'name = "x"\nmodel = "{tiny_model_dir}"\n[[run]]\nname = "fp32"\nmethod = "none"\n')
    logger = logging.getLogger("quantlab")
    level = logger.level
    try:
        with _listener(kind) as address:
            argv = ["run", str(exp_file), "--executor", "ray", "--address", address,
                    "--reports-dir", str(tmp_path / "reports")]
            assert main(argv) == 1
    finally:
        logger.setLevel(level)
    err = capsys.readouterr().err
    assert err.startswith("quantlab: error: ") and err.count("\n") == 1, err
    assert f"'{address}'" in err and "nothing Ray answers there" in err and "Traceback" not in err
    assert not (tmp_path / "reports").exists()  # nothing written
