"""oneDNN evaluation GEMMs (quantlab/eval/gemm.py): the same linear to fp32 round-off, restored after, only where
it applies; perplexity with either GEMM agrees to 1e-6 relative."""
import pytest
import torch
import torch.nn.functional as F

from quantlab.eval import gemm
from quantlab.eval.gemm import onednn_available, onednn_linear, resolve_gemm
from quantlab.eval.perplexity import perplexity

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear")


def test_onednn_linear_matches_aten_and_is_restored():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, 96, generator=gen), torch.randn(80, 96, generator=gen), torch.randn(80, generator=gen)
    ref, aten = F.linear(x, w, b), F.linear
    with torch.no_grad(), onednn_linear():
        assert F.linear is not aten  # patched while inside
        out = F.linear(x, w, b)
        bf16 = F.linear(x.bfloat16(), w.bfloat16())  # other dtypes: the aten path, unchanged
    assert ((out - ref).norm() / ref.norm()).item() < 1e-6
    torch.testing.assert_close(bf16, F.linear(x.bfloat16(), w.bfloat16()), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), onednn_linear():
        raise RuntimeError("boom")
    assert F.linear is aten  # restored, on error too


def test_perplexity_with_either_gemm_agrees(tiny_model):
    model, _ = tiny_model
    windows = torch.randint(0, 300, (3, 32), generator=torch.Generator().manual_seed(0))
    a = perplexity(model, windows, progress=False, gemm="aten")
    o = perplexity(model, windows, progress=False, gemm="onednn")
    assert a["eval_gemm"] == "aten" and o["eval_gemm"] == "onednn"
    assert o["ppl"] == pytest.approx(a["ppl"], rel=1e-6)
    assert perplexity(model, windows, progress=False)["eval_gemm"] == resolve_gemm("auto", torch.device("cpu"))


def test_unknown_gemm_is_named():
    with pytest.raises(ValueError, match="gemm 'mkl' unknown; known: auto, aten, onednn"):
        resolve_gemm("mkl", torch.device("cpu"))
    assert resolve_gemm("auto", torch.device("cuda")) == "aten"


@pytest.mark.parametrize("vendor, expected", [("AuthenticAMD", "onednn"), ("GenuineIntel", "aten"), ("", "aten")])
def test_auto_takes_onednn_on_amd_cpus_only(monkeypatch, vendor, expected):
    monkeypatch.setattr(gemm, "cpu_vendor", lambda: vendor)
    assert resolve_gemm("auto", torch.device("cpu")) == expected
    assert resolve_gemm("auto", torch.device("cuda")) == "aten"
    assert resolve_gemm("onednn", torch.device("cpu")) == "onednn"  # asked for by name: taken on any vendor


def test_cpu_vendor_reads_this_machines_cpuinfo():
    from pathlib import Path
    info = Path("/proc/cpuinfo")
    lines = [ln for ln in info.read_text().splitlines() if ln.startswith("vendor_id")] if info.exists() else []
    assert gemm.cpu_vendor() == (lines[0].split(":", 1)[1].strip() if lines else "")
