"""torchao export: kernel choice, per-layer kernel parity and logits parity vs the simulated model,
fallback to simulated with a reason, and the runner's backend key."""
from __future__ import annotations

import copy

import pytest
import torch

import quantlab
from quantlab.backends import PARITY_TOLERANCE, export_model, export_torchao, logits_diff, plan_export
from quantlab.backends.modules import Int8DynamicLinear, TorchaoLinear
from quantlab.backends.torchao import layer_parity
from quantlab.core.lifecycle import quant_linears
from quantlab.eval import weight_stats

# Logits of the exported tiny model vs the simulated one (same dtype), max |diff| / max |ref|.
# int8 weight-only and W8A8: the same integer codes summed in another order in fp32. W8A8 can still
# flip an activation code where a value sits on a rounding boundary, hence 1e-3 rather than 1e-5.
# int4: bf16 tinygemm vs bf16 dequantized matmul.
LOGITS_TOLERANCE = {"int8_weight_only": 1e-5, "int8_dynamic": 1e-3, "int4_cpu": 3e-2}

CPU_SCHEMES = [
    ("int8_weight_only", {"method": "rtn", "bits": 8}),
    ("int8_dynamic", {"method": "dynamic"}),
    ("int8_dynamic", {"method": "dynamic", "act_symmetric": False}),
    ("int4_cpu", {"method": "rtn", "bits": 4, "group_size": 32}),
    ("int4_cpu", {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}),
]


def _ids(b=2, t=24, seed=0):
    return torch.randint(0, 300, (b, t), generator=torch.Generator().manual_seed(seed))


def _quantized(tiny_model_dir, spec):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(model, quantlab.make_config(spec))
    return model


@pytest.mark.parametrize("kernel,spec", CPU_SCHEMES, ids=lambda v: v if isinstance(v, str) else str(v))
def test_export_parity_per_cpu_kernel(tiny_model_dir, kernel, spec):
    model = _quantized(tiny_model_dir, spec)
    reference = copy.deepcopy(model)
    summary = export_model(model, "torchao", _ids())
    assert summary["backend"] == "torchao" and summary["backend_kernels"] == f"{kernel}:14"
    assert not quant_linears(model), "every layer was exported"
    assert summary["export_parity_ok"] and summary["export_parity_layer_max_rel"] <= PARITY_TOLERANCE[kernel]
    # independent recomputation of the logits parity, in the export dtype
    from quantlab.backends.torchao import cast_float_parts

    cast_float_parts(reference, getattr(torch, summary["export_dtype"]))
    d = logits_diff(model, reference, _ids(seed=1))
    assert d["export_parity_logits_max_rel"] <= LOGITS_TOLERANCE[kernel]
    assert summary["export_dtype"] == ("bfloat16" if kernel == "int4_cpu" else "float32")


def test_int8_dynamic_layer_is_exact_in_integer_codes(tiny_model_dir):
    """One W8A8 layer: torchao's int8 GEMM on quantlab's activation codes vs the fake-quant forward (fp32)."""
    model = _quantized(tiny_model_dir, {"method": "dynamic"})
    layer = quant_linears(model)["model.layers.0.mlp.down_proj"]
    exported = Int8DynamicLinear(layer, torch.float32)
    x = torch.randn(3, 5, layer.in_features)
    with torch.inference_mode():
        ref, out = layer(x), exported(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_layer_parity_catches_a_wrong_kernel(tiny_model_dir):
    """The gate is not vacuous: corrupting one exported layer's scale fails its tolerance."""
    model = _quantized(tiny_model_dir, {"method": "rtn", "bits": 8})
    reference = copy.deepcopy(model)
    export_torchao(model)
    name = "model.layers.1.self_attn.o_proj"
    model.get_submodule(name).weight.scale.mul_(1.05)
    errors = layer_parity(model, reference)
    assert errors[name] > 0.04 and max(v for k, v in errors.items() if k != name) <= PARITY_TOLERANCE["int8_weight_only"]


@pytest.mark.parametrize("spec,reason", [
    ({"method": "rtn", "bits": 3, "group_size": 32}, "no torchao kernel for 3-bit"),
    ({"method": "rtn", "bits": 8, "group_size": 32}, "per-channel only"),
    ({"method": "rtn", "bits": 8, "symmetric": False}, "symmetric weights"),
    ({"method": "rtn", "bits": 4}, "group size 32, 64 or 128"),
    ({"method": "dynamic", "act_bits": 4}, "only int8 activation kernels"),
])
def test_scheme_without_kernel_stays_simulated_with_reason(tiny_model_dir, spec, reason):
    model = _quantized(tiny_model_dir, spec)
    ids = _ids()
    with torch.inference_mode():
        before = model(ids).logits
    summary = export_model(model, "torchao", ids)
    assert summary["backend"] == "simulated" and summary["exported_layers"] == 0
    assert reason in summary["backend_note"] and "(14 layers)" in summary["backend_note"]
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)  # untouched


def test_partial_export_keeps_remaining_layers_simulated(tiny_model_dir):
    """g64: q/k/v/o/gate/up (in 64) export to int4; down_proj (in 96) stays simulated, the row says so."""
    model = _quantized(tiny_model_dir, {"method": "rtn", "bits": 4, "group_size": 64})
    plan = plan_export(model)
    assert plan["model.layers.0.mlp.down_proj"].kernel is None
    summary = export_model(model, "torchao", _ids())
    assert summary["backend"] == "torchao+simulated" and summary["exported_layers"] == 12
    assert summary["simulated_layers"] == 2 and "in_features 96" in summary["backend_note"]
    assert summary["export_parity_ok"]


def test_weight_stats_of_exported_models_count_real_kernel_bytes(tiny_model_dir):
    stats = {}
    for kernel, spec in CPU_SCHEMES[:1] + CPU_SCHEMES[3:4]:
        model = _quantized(tiny_model_dir, spec)
        export_torchao(model)
        layers = [m for m in model.modules() if isinstance(m, TorchaoLinear)]
        numel = sum(m.in_features * m.out_features for m in layers)
        stats[kernel] = weight_stats(model)["quant_layer_bytes"] / numel
    # int8: 1 byte + an fp32 scale per output row (448 rows and 30,720 weights per decoder layer);
    # int4 g32: 0.5 byte + a bf16 scale and a bf16 zero per 32 weights
    assert stats["int8_weight_only"] == pytest.approx(1 + 4 * 448 / 30720)
    assert stats["int4_cpu"] == pytest.approx(0.5 + 4 / 32)


def test_bad_backend_name_fails_loudly(tiny_model_dir):
    model = _quantized(tiny_model_dir, {"method": "rtn", "bits": 8})
    with pytest.raises(ValueError, match="unknown backend 'tao'; known: simulated, torchao, auto"):
        export_model(model, "tao")
    with pytest.raises(ValueError, match="unknown backend"):
        quantlab.parse_experiment({"model": "x", "run": [{"name": "a", "method": "rtn", "backend": "tao"}]})


def test_backend_key_leaves_default_run_keys_unchanged():
    from quantlab.runs.runner import run_key

    def exp(run):
        return quantlab.parse_experiment({"model": "x", "run": [run]})

    plain = exp({"name": "a", "method": "rtn", "bits": 8})
    explicit = exp({"name": "a", "method": "rtn", "bits": 8, "backend": "simulated"})
    torchao = exp({"name": "a", "method": "rtn", "bits": 8, "backend": "torchao"})
    key = lambda e: run_key(e, e.runs[0], torch.device("cpu"))  # noqa: E731
    assert key(plain) == key(explicit) != key(torchao)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,spec", [
    ("int8_weight_only", {"method": "rtn", "bits": 8}),
    ("int8_dynamic", {"method": "dynamic"}),
    ("int4_cuda", {"method": "rtn", "bits": 4, "group_size": 32}),
])
def test_export_parity_on_cuda(tiny_model_dir, kernel, spec):
    model, _ = quantlab.load_model(str(tiny_model_dir), device="cuda")
    quantlab.quantize(model, quantlab.make_config(spec))
    summary = export_model(model, "torchao", _ids().cuda())
    assert summary["backend_kernels"] == f"{kernel}:14" and summary["export_parity_ok"]


def test_runner_exports_runs_with_a_backend_and_says_so(tiny_model_dir, tmp_path):
    from quantlab.runs.runner import run_experiment

    runs = [{"name": "fp32", "method": "none", "backend": "torchao"},
            {"name": "w8-sim", "method": "rtn", "bits": 8},
            {"name": "w8-torchao", "method": "rtn", "bits": 8, "backend": "torchao"},
            {"name": "w3-auto", "method": "rtn", "bits": 3, "group_size": 32, "backend": "auto"}]
    exp = quantlab.parse_experiment({
        "name": "tiny_backends", "model": str(tiny_model_dir), "device": "cpu", "run": runs,
        "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 2, "kl_windows": 1,
                 "prefill_tokens": 8, "decode_tokens": 2, "latency_repeats": 1}})
    df = run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert df.loc["fp32", "backend"] == "float"
    assert df.loc["w8-sim", "backend"].startswith("simulated")
    assert df.loc["w8-torchao", "backend"] == "torchao" and bool(df.loc["w8-torchao", "export_parity_ok"])
    assert df.loc["w3-auto", "backend"] == "simulated" and "3-bit" in df.loc["w3-auto", "backend_note"]
    # the same codes, real kernels: perplexity agrees with the simulated run to fp32 rounding
    assert df.loc["w8-torchao", "ppl"] == pytest.approx(df.loc["w8-sim", "ppl"], rel=1e-4)
    assert "| torchao |" in (tmp_path / "tiny_backends.md").read_text()


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
@pytest.mark.parametrize("kernel,spec", [
    ("int8_weight_only", {"method": "rtn", "bits": 8}),
    ("int8_dynamic", {"method": "dynamic"}),
    ("int4_cpu", {"method": "rtn", "bits": 4, "group_size": 64}),
])
def test_smollm2_export_parity(kernel, spec):
    """SmolLM2-135M: all 210 linears exported, each within its kernel tolerance of the simulated layer."""
    model, _ = quantlab.load_model("smollm2-135m", device="cpu")
    quantlab.quantize(model, quantlab.make_config(spec))
    summary = export_model(model, "torchao", _ids(1, 32).clamp_max(299))
    assert summary["backend_kernels"] == f"{kernel}:210" and summary["export_parity_ok"]
    assert summary["export_parity_layer_max_rel"] <= PARITY_TOLERANCE[kernel]
