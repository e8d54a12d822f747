"""ONNX Runtime backend: MatMulNBits packing, the exported graph's parity with the simulated model, decode with
past_key_values, float fallbacks named, clear errors. References: the simulated QuantLinear (exact where the
same dequantized weights meet; a stated tolerance where ORT sums in another order or in int32)."""
from __future__ import annotations

import copy

import pytest
import torch

import quantlab
from quantlab.backends import ort as ort_backend
from quantlab.backends.ort_pack import block_size_for, dequantize_matmul_nbits, pack_matmul_nbits
from quantlab.core.lifecycle import quant_linears
from quantlab.core.packing import unpack
from quantlab.core.qlinear import QuantLinear, WeightSpec


def _frozen_layer(k: int, n: int, spec: WeightSpec, seed: int = 0) -> QuantLinear:
    gen = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=False)
    linear.weight.data = torch.randn(n, k, generator=gen)
    layer = QuantLinear.from_linear(linear, spec)
    quantlab.core.lifecycle.freeze_all(torch.nn.Sequential(layer))
    return layer


@pytest.mark.parametrize("bits,group_size,symmetric,k", [
    (4, 32, False, 128), (4, 64, True, 192), (4, 128, False, 576), (4, None, False, 96), (8, None, True, 576),
    (8, 64, False, 80), (4, 16, True, 40)])
def test_matmul_nbits_packing_round_trips_quantlab_codes_exactly(bits, group_size, symmetric, k):
    """pack -> MatMulNBits' own dequantization formula == the frozen layer's dequantized weight (atol 0),
    including per-channel (scales repeated per block) and K not a multiple of the block (padded)."""
    layer = _frozen_layer(k, 24, WeightSpec(bits=bits, group_size=group_size, symmetric=symmetric))
    codes = unpack(layer.qweight, bits, 24 * k).view(24, k)
    packed, scales, zeros, block = pack_matmul_nbits(codes, layer.scale, None if symmetric else layer.zero_u,
                                                     bits, group_size)
    assert block == block_size_for(group_size, k) and packed.shape == (24, -(-k // block), block * bits // 8)
    w = dequantize_matmul_nbits(packed, scales, zeros, k, 24, bits, block)
    assert torch.equal(w, layer.quantized_weight(torch.float32))


def test_ort_linear_eager_forward_equals_the_simulated_layer():
    layer = _frozen_layer(128, 32, WeightSpec(bits=4, group_size=32, symmetric=False))
    x = torch.randn(3, 5, 128)
    assert torch.equal(ort_backend.OrtLinearNBits(layer, 0)(x), layer(x))


def _quantized_tiny(tiny_model, config: dict):
    model = copy.deepcopy(tiny_model[0])
    quantlab.quantize(model, quantlab.make_config(config))
    return model


def _cpu_has_vnni() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


# W8A8 through MatMulInteger: on CPUs with VNNI measured < 1e-2 relative RMS on the tiny model; on an AVX2-only
# AMD EPYC (no VNNI) ORT runs another int8 kernel and this test measured 0.059, so there the production gate's 1e-1
# (PARITY_RMS_TOLERANCE["a8w8"]) applies
A8W8_TOL = 1e-2 if _cpu_has_vnni() else ort_backend.PARITY_RMS_TOLERANCE["a8w8"]


@pytest.mark.parametrize("config,kernel,tol", [
    ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}, "matmul_nbits", 1e-5),
    ({"method": "rtn", "bits": 8}, "matmul_nbits", 1e-5),
    ({"method": "dynamic"}, "a8w8", A8W8_TOL),
])
def test_ort_export_matches_the_simulated_model_and_decodes_with_its_cache(tiny_model, tmp_path, config, kernel,
                                                                           tol):
    """Logits of the ORT session vs the simulated model on the same ids: relative RMS <= tol (weight-only: the
    same dequantized weights in another fp32 summation order; W8A8: the same codes, int32 sums). Decoding one
    token on the returned past_key_values equals the full forward's last position (1e-5)."""
    model = _quantized_tiny(tiny_model, config)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ort_model, summary = ort_backend.export_onnxruntime(model, tmp_path / "m.onnx", ids)
    assert summary["backend"] == "onnxruntime" and summary["backend_kernels"] == f"{kernel}:14"
    assert summary["export_parity_ok"] and summary["export_parity_logits_rel_rms"] <= tol
    first = ort_model(ids[:, :16], use_cache=True, logits_to_keep=1)
    assert first.logits.shape == (2, 1, 300)
    step = ort_model(ids[:, 16:17], use_cache=True, past_key_values=first.past_key_values)
    full = ort_model(ids[:, :17]).logits[:, -1]
    assert step.past_key_values.get_seq_length() == 17
    torch.testing.assert_close(step.logits[:, -1], full, rtol=0, atol=1e-5)


def test_layers_without_an_ort_kernel_stay_float_and_are_named(tiny_model, tmp_path):
    model = _quantized_tiny(tiny_model, {"method": "rtn", "bits": 3, "group_size": 32})
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    _, summary = ort_backend.export_onnxruntime(model, tmp_path / "m.onnx", ids)
    assert summary["backend"] == "onnxruntime+float" and summary["ort_float_layers"] == 14
    assert "w3: MatMulNBits takes 4 or 8 bits (14 layers)" in summary["backend_note"]
    assert summary["export_parity_logits_rel_rms"] <= 1e-5  # the float fallback is the dequantized weight


def test_ort_missing_names_the_extra(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(ort_backend, "ort_available", lambda: False)
    model = _quantized_tiny(tiny_model, {"method": "rtn", "bits": 4, "group_size": 32})
    with pytest.raises(ImportError, match=r"quantlab\[ort\]"):
        ort_backend.export_onnxruntime(model, tmp_path / "m.onnx")


def test_a_float_model_exports_as_the_ort_fp32_baseline_and_reloads(tiny_model, tmp_path):
    """No QuantLinear: every linear an fp32 MatMul; the exported file reloads with load_ort (same logits)."""
    model = copy.deepcopy(tiny_model[0])
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(2))
    ort_model, summary = ort_backend.export_onnxruntime(model, tmp_path / "model.onnx", ids)
    assert summary["backend_kernels"] == "" and summary["backend_note"].startswith("float model")
    assert summary["export_parity_logits_rel_rms"] <= 1e-5
    assert torch.equal(ort_backend.load_ort(tmp_path)(ids).logits, ort_model(ids).logits)


def test_ort_export_rejects_bad_input(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="exports float32 models"):
        ort_backend.export_onnxruntime(copy.deepcopy(tiny_model[0]).to(torch.bfloat16), tmp_path / "m.onnx")
    model = _quantized_tiny(tiny_model, {"method": "rtn", "bits": 4, "group_size": 32})
    with pytest.raises(ValueError, match=r"accuracy_level must be one of \(0, 4\), got 2"):
        ort_backend.export_onnxruntime(model, tmp_path / "m.onnx", accuracy_level=2)
    assert {n for n, m in quant_linears(model).items()} and all(isinstance(m, QuantLinear)
                                                               for m in quant_linears(model).values())


def test_an_experiment_run_evaluates_in_onnxruntime(tiny_model_dir, tmp_path):
    """backend = "onnxruntime" in an experiment file: perplexity and latency run in the ORT session; its ppl
    equals the simulated run's to 1e-5 relative (the same dequantized weights, another summation order)."""
    from quantlab.reporting.results import read_rows
    from quantlab.runs.experiment import parse_experiment
    from quantlab.runs.runner import run_experiment

    w4 = {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}
    runs = [{"name": "w4", **w4}, {"name": "w4-ort", **w4, "backend": "onnxruntime"}]
    exp = parse_experiment({"name": "tiny_ort", "model": str(tiny_model_dir), "device": "cpu",
                            "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3,
                                     "kl_windows": 2, "latency": True, "prefill_tokens": 8, "decode_tokens": 2,
                                     "latency_repeats": 1}, "run": runs})
    run_experiment(exp, tmp_path, cache_dir=tmp_path / "cache", progress=False)
    rows = {r["run"]: r for r in read_rows(tmp_path / "tiny_ort.results.jsonl")}
    assert rows["w4-ort"]["backend"] == "onnxruntime" and rows["w4-ort"]["export_parity_ok"]
    assert rows["w4-ort"]["ppl"] == pytest.approx(rows["w4"]["ppl"], rel=1e-5)
    assert rows["w4-ort"]["decode_ms_per_token_p50"] > 0
    assert (tmp_path / "cache" / "onnx").exists()


@pytest.mark.parametrize("extra,message", [
    ({"kv_cache": {"bits": 8}}, "does not export a quantized KV cache"),
    ({"embedding": {"bits": 8}}, "does not export a quantized embedding"),
])
def test_ort_runs_that_cannot_export_fail_before_loading(tiny_model_dir, extra, message):
    from quantlab.runs.experiment import parse_experiment

    runs = [{"name": "w4", "method": "rtn", "bits": 4, "backend": "onnxruntime", **extra}]
    with pytest.raises(ValueError, match=message):
        parse_experiment({"name": "bad", "model": str(tiny_model_dir), "run": runs})
    with pytest.raises(ValueError, match="exports float32 models; dtype is 'bfloat16'"):
        parse_experiment({"name": "bad", "model": str(tiny_model_dir), "dtype": "bfloat16",
                          "run": [{"name": "w4", "method": "rtn", "bits": 4, "backend": "onnxruntime"}]})


def test_memprobe_loads_an_exported_graph_in_a_fresh_session(tiny_model, tmp_path):
    """The speed report's memory column for ORT rows: a child process loads directory/model.onnx and runs one
    prefill + decode pass; its peak RSS is at least what it held once loaded (reference: its own VmRSS)."""
    from quantlab.eval.memprobe import measure_peak_memory

    model = _quantized_tiny(tiny_model, {"method": "rtn", "bits": 4, "group_size": 32})
    ort_backend.export_onnxruntime(model, tmp_path / "model.onnx")
    row = measure_peak_memory({"onnx_dir": str(tmp_path), "batch": 1, "prefill_tokens": 8, "decode_tokens": 2,
                               "threads": 1})
    assert row["backend"] == "onnxruntime" and row["decode_tokens"] == 2
    assert row["peak_rss_mib"] >= row["loaded_rss_mib"] > 0


def test_a_graph_this_onnxruntime_cannot_run_names_the_op_and_the_fix(tmp_path):
    """An op ORT does not implement (here com.microsoft::NoSuchKernel, the stand-in for an op or opset newer than
    the installed onnxruntime): the error names the file, ORT's message (the op) and the upgrade."""
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("NoSuchKernel", ["x"], ["y"], domain="com.microsoft")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                      helper.make_opsetid("com.microsoft", 1)]), tmp_path / "m.onnx")
    with pytest.raises(RuntimeError, match=r"cannot load .*m\.onnx.*NoSuchKernel.*pip install -U 'quantlab\[ort\]'"):
        ort_backend.OrtCausalLM(tmp_path / "m.onnx", config=None)


def test_lora_adapters_beside_the_codes_do_not_export(tiny_model_dir):
    from quantlab.runs.experiment import parse_experiment

    runs = [{"name": "lora", "method": "lora", "base": {"method": "rtn", "bits": 4, "group_size": 32},
             "backend": "onnxruntime"}]
    with pytest.raises(ValueError, match="not the float adapters lora keeps beside them"):
        parse_experiment({"name": "bad", "model": str(tiny_model_dir), "run": runs})


def test_ort_profile_counts_each_decode_steps_kernels(tiny_model, tmp_path):
    """A session loaded with `profile` records ORT's per-node profile; op_times, skipping the prefill, sees the
    three decode steps and exactly one MatMulNBits kernel per quantized linear per step (14 each), and the
    kernels' time is inside the runs' time."""
    from quantlab.backends.ort_profile import category, op_times

    model = _quantized_tiny(tiny_model, {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False})
    _, summary = ort_backend.export_onnxruntime(model, tmp_path / "model.onnx")
    ort_model = ort_backend.load_ort(tmp_path, threads=1, profile=tmp_path / "prof")
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    out = ort_model(ids[:, :16], use_cache=True, logits_to_keep=1)
    for t in range(16, 19):
        out = ort_model(ids[:, t:t + 1], use_cache=True, past_key_values=out.past_key_values, logits_to_keep=1)
    path = ort_model.session.end_profiling()
    decode, every = op_times(path, skip_runs=1), op_times(path)
    assert (decode["runs"], every["runs"]) == (3, 4)
    assert decode["ops"]["MatMulNBits"][1] == 3 * summary["exported_layers"] == 3 * 14
    assert every["ops"]["MatMulNBits"][1] == 4 * 14
    assert 0 < decode["kernel_us"] <= decode["run_us"] and decode["run_us"] < every["run_us"]
    assert decode["kernel_us"] == sum(us for us, _ in decode["ops"].values())
    parts = op_times(path, skip_runs=1, key=category)["ops"]
    assert set(parts) == {"linear", "attention", "concat", "other"}
    assert parts["linear"][1] == 3 * (14 + 1)  # and the float lm_head, once a step
    assert parts["attention"][1] == 3 * 2 * 3  # per layer: q·kᵀ, softmax, ·v
    assert sum(us for us, _ in parts.values()) == decode["kernel_us"]
    with pytest.raises(ValueError, match="none left after skipping 4"):
        op_times(path, skip_runs=4)


def test_the_decode_profile_script_splits_each_step_into_its_parts(tiny_model_dir, tmp_path):
    """experiments/profile_ort_decode.py end to end on the tiny model: a row per configuration, batch and part; ORT's
    profile sees its linears, attention, the KV cache's concat and the rest, PyTorch's hooks its linears, attention
    and the rest; ORT's op types are counted per step; the CPU is named."""
    import importlib.util
    import math

    import pandas as pd
    from conftest import REPO

    spec = importlib.util.spec_from_file_location("profile_ort_decode", REPO / "experiments" / "profile_ort_decode.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "profile.csv"
    assert script.main(["--model", str(tiny_model_dir), "--prefill", "8", "--decode", "3", "--warmup", "1",
                        "--batches", "2", "--threads", str(torch.get_num_threads()), "--out", str(out),
                        "--configs", "fp32", "ort-int4-g64"]) == 0  # ORT fp32: one more export, the same code
    df = pd.read_csv(out)
    assert len(df) == 2 * len(script.PARTS)
    assert set(df.config) == {"fp32", "ort-int4-g64"} and set(df.part) == set(script.PARTS)
    seen = df.set_index(["config", "part"]).ms_per_step
    assert all(seen[("ort-int4-g64", part)] > 0 for part in ("linear", "attention", "concat", "other"))
    assert all(seen[("fp32", part)] > 0 for part in ("linear", "attention", "other"))  # timed by hooks: its concat
    assert math.isnan(seen[("fp32", "concat")]) and math.isnan(seen[("fp32", "outside kernels")])  # is in attention
    assert df.cpu_model.notna().all() and df.loadavg_1m_start.notna().all()
    md = out.with_suffix(".md").read_text()
    assert "| 2 | ort-int4-g64 |" in md and "## Findings" in md and "**Batch 2.**" in md
    ops = pd.read_csv(out.with_name("profile_ops.csv"))  # ORT int4: one MatMulNBits a quantized linear, each step
    assert set(ops.config) == {"ort-int4-g64"}
    assert ops.set_index("op").calls_per_step["MatMulNBits"] == 14 and "MatMulNBits" in md


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 2), (9, 3), (4, 4)])
def test_grouped_attention_is_eager_attention_without_repeating_the_cache(q_heads, kv_heads):
    """ort_attention.grouped_attention against transformers' eager attention (repeat_kv, then the same ops) on one
    query step and on a prefill with an additive mask: equal to 1e-6 (another summation order at most)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from quantlab.backends.ort_attention import grouped_attention

    gen = torch.Generator().manual_seed(q_heads)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = q_heads // kv_heads, False
    for t, s in ((1, 7), (5, 5)):
        q = torch.randn(2, q_heads, t, 8, generator=gen)
        k, v = torch.randn(2, kv_heads, s, 8, generator=gen), torch.randn(2, kv_heads, s, 8, generator=gen)
        mask = torch.where(torch.rand(2, 1, t, s, generator=gen) < 0.3, torch.finfo(torch.float32).min, 0.0)
        mask[..., -1] = 0.0  # every query sees one key
        got, _ = grouped_attention(module, q, k, v, mask, scaling=0.3)
        want, _ = eager_attention_forward(module, q, k, v, mask, scaling=0.3)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_the_exported_graph_copies_no_kv_cache_per_layer(tmp_path):
    """The graph's Expand nodes do not grow with the layers (transformers' own attention repeats each layer's KV
    heads with an Expand), its logits still match the model, and the model keeps its own attention afterwards."""
    import onnx
    from transformers import LlamaConfig, LlamaForCausalLM

    expands = {}
    for layers in (1, 2):
        cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
        _, summary = ort_backend.export_onnxruntime(model, tmp_path / f"{layers}" / "model.onnx", ids)
        assert summary["export_parity_ok"] and summary["export_parity_logits_rel_rms"] <= 1e-5
        assert model.config._attn_implementation == "sdpa"
        graph = onnx.load(str(tmp_path / f"{layers}" / "model.onnx"), load_external_data=False).graph
        expands[layers] = sum(n.op_type == "Expand" for n in graph.node)
    assert expands[1] == expands[2], expands
