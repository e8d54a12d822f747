"""experiments/smollm2_speed.py states measured facts about the machine, never who else used it."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "smollm2_speed.py"
CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
"""


def _script():
    spec = importlib.util.spec_from_file_location("smollm2_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_facts_read_model_and_flags():
    speed = _script()
    facts = speed.cpu_facts(CPUINFO)
    assert facts["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts["cpu_avx512"] == "avx512_bf16 avx512_vnni avx512f" and facts["cpu_amx"] == "amx_bf16 amx_int8 amx_tile"
    assert speed.cpu_facts("model name : Old CPU\nflags : sse2 avx2\n")["cpu_avx512"] == "none"
    here = speed.cpu_facts()
    assert here["logical_cpus"] >= 1 and here["cpu_model"]
    from quantlab.runs.envinfo import cpu_isa
    assert cpu_isa(facts) == "amx" and cpu_isa(speed.cpu_facts("model name : EPYC\nflags : sse2 avx avx2 fma f16c\n")) \
        == "avx2"
    assert cpu_isa(speed.cpu_facts("model name : Old CPU\nflags : sse2\n")) == "none"
    assert cpu_isa(speed.cpu_facts("model name : Zen 4\nflags : avx2 avx512f\n")) == "avx512"


def test_report_text_is_measured_facts_only():
    speed = _script()
    row = {"config": "fp32", "batch_size": 1, "device_name": "cpu", "torch": "2.x", "cpu_model": "Some CPU",
           "logical_cpus": 2, "cpu_avx512": "avx512f", "cpu_amx": "none", "loadavg_1m_start": 1.5,
           "loadavg_1m_end": float("nan")}
    text = speed._markdown(pd.DataFrame([row]), 512, 64, 3, 1, 600.0)
    assert ("**Machine.** CPU `Some CPU`, 2 logical CPUs, 1 benchmark thread(s). AVX-512: avx512f. AMX: none "
            "(/proc/cpuinfo flags). Load average (1 min) at start 1.50, at end n/a.") in text
    for word in ("shared", "engineer", "jobs"):
        assert word not in text.lower()


def test_ort_ratios_and_parity_failures_come_from_the_rows():
    """The ORT paragraph: time ratios against the same scheme in PyTorch / torchao at each batch, and the names of
    ORT configurations whose logits parity failed its gate, all computed from rows."""
    speed = _script()
    rows = [{"config": "int8-wo", "batch_size": 1, "backend": "torchao", "decode_ms_per_token_p50": 30.0,
             "prefill_ms_p50": 1200.0, "export_parity_ok": True},
            {"config": "ort-int8", "batch_size": 1, "backend": "onnxruntime", "decode_ms_per_token_p50": 15.0,
             "prefill_ms_p50": 400.0, "export_parity_ok": True, "export_parity_logits_rel_rms": 0.03,
             "export_parity_tol": 0.05},
            {"config": "ort-int4-g32", "batch_size": 1, "backend": "onnxruntime", "decode_ms_per_token_p50": 14.0,
             "prefill_ms_p50": 500.0, "export_parity_ok": False, "export_parity_logits_rel_rms": 0.1,
             "export_parity_tol": 0.05}]
    df = pd.DataFrame(rows)
    assert "batch 1: `ort-int8` vs `int8-wo` decode 2.00x, prefill 3.00x." in speed._ratios_text(df)
    text = speed._ort_parity_text(df[df["backend"] == "onnxruntime"])
    assert text.startswith("1 of 2 ORT configurations passed") and "`ort-int4-g32` (rel RMS 1.0e-01 > 5e-02)" in text
