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


@pytest.fixture(scope="module")
def float_export(tiny_model_dir, tmp_path_factory):
    """The tiny float model exported once (each export takes seconds): (model, ids, directory, session, summary)."""
    model = quantlab.load_model(str(tiny_model_dir), device="cpu")[0]
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    directory = tmp_path_factory.mktemp("float_export")
    ort_model, summary = ort_backend.export_onnxruntime(model, directory / "model.onnx", ids)
    return model, ids, directory, ort_model, summary


def test_a_float_model_exports_as_the_ort_fp32_baseline_and_reloads(float_export):
    """No QuantLinear: every linear an fp32 MatMul; the exported file reloads with load_ort (same logits)."""
    _, ids, directory, ort_model, summary = float_export
    assert summary["backend_kernels"] == "" and summary["backend_note"].startswith("float model")
    assert summary["export_parity_logits_rel_rms"] <= 1e-5
    assert torch.equal(ort_backend.load_ort(directory)(ids).logits, ort_model(ids).logits)


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


def test_memprobe_loads_an_exported_graph_in_a_fresh_session(float_export):
    """The speed report's memory column for ORT rows: a child process loads directory/model.onnx and runs one
    prefill + decode pass; its peak RSS is at least what it held once loaded (reference: its own VmRSS)."""
    from quantlab.eval.memprobe import measure_peak_memory

    row = measure_peak_memory({"onnx_dir": str(float_export[2]), "batch": 1, "prefill_tokens": 8,
                               "decode_tokens": 2, "threads": 1})
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


def test_op_times_sums_the_kernels_of_the_runs_it_keeps(tmp_path):
    """ort_profile.op_times on a written profile (ORT's JSON event list): kernels are summed per op type (or per
    `key`) over the runs after skip_runs, in time order; a kernel outside every kept run, and fence events, do not
    count; category sorts ORT's nodes into parts by op type and node name."""
    import json

    from quantlab.backends.ort_profile import category, op_times

    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(name, op, ts, dur, inputs=None):
        return {"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": dur,
                "args": {"op_name": op, "input_type_shape": inputs or [{"float": [1]}]}}

    events = [run(200, 100), run(0, 100), run(400, 100),  # out of order on purpose: sorted by ts
              node("node_matmul_nbits", "MatMulNBits", 10, 30), node("node_matmul_nbits", "MatMulNBits", 210, 20),
              node("node_linear", "MatMul", 240, 5), node("node_MatMul_1/MatMulScaleFusion/", "FusedMatMul", 250, 4),
              node("node_Softmax_2", "Softmax", 255, 1), node("node_cat_3", "Concat", 260, 7),
              node("node_Concat_4", "Concat", 270, 1, [{"int64": [1]}]), node("node_Mul_5", "Mul", 410, 3),
              node("node_Mul_6", "Mul", 350, 9),  # between runs: not counted
              {"cat": "Node", "name": "node_Mul_5_fence_before", "ts": 409, "dur": 1, "args": {"op_name": "Mul"}}]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(events))
    every = op_times(path)
    assert every["runs"] == 3 and every["run_us"] == 300 and every["kernel_us"] == 30 + 20 + 5 + 4 + 1 + 7 + 1 + 3
    assert every["ops"]["MatMulNBits"] == (50, 2) and every["ops"]["Mul"] == (3, 1) and "Mul" in every["ops"]
    last_two = op_times(path, skip_runs=1)  # the first run in time (ts 0) is left out
    assert last_two["runs"] == 2 and last_two["ops"]["MatMulNBits"] == (20, 1) and last_two["run_us"] == 200
    parts = op_times(path, skip_runs=1, key=category)["ops"]
    assert parts == {"linear": (25, 2), "attention": (5, 2), "concat": (7, 1), "other": (4, 2)}
    with pytest.raises(ValueError, match="none left after skipping 3"):
        op_times(path, skip_runs=3)


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
    ops = pd.read_csv(out.with_name("profile_ops.csv"))  # ORT's profile of the real graph, per decode step:
    assert set(ops.config) == {"ort-int4-g64"} and "MatMulNBits" in md
    calls = ops.groupby("part").calls_per_step.sum()
    assert ops.set_index("op").calls_per_step["MatMulNBits"] == 14  # one a quantized linear
    assert calls["linear"] == 14 + 1 and calls["attention"] == 2 * 3  # + the float lm_head; q·kᵀ, softmax, ·v a layer


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


def test_the_exported_graph_copies_no_kv_cache_per_layer(float_export, tiny_model):
    """No Expand in the exported graph takes the KV cache (transformers' own attention repeats each layer's cache
    for its query heads: the updated cache's Concat -> Unsqueeze -> Expand), its logits still match the model, and
    the model keeps its own attention afterwards."""
    import onnx

    model, _, directory, _, summary = float_export
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny model is GQA
    assert summary["export_parity_ok"] and summary["export_parity_logits_rel_rms"] <= 1e-5
    assert model.config._attn_implementation == tiny_model[0].config._attn_implementation
    graph = onnx.load(str(directory / "model.onnx"), load_external_data=False).graph
    producer = {out: n for n in graph.node for out in n.output}
    caches = {o.name for o in graph.output if o.name.startswith("present_")}

    def reaches_cache(name: str, hops: int) -> bool:
        if name in caches:
            return True
        n = producer.get(name)
        return hops > 0 and n is not None and any(reaches_cache(i, hops - 1) for i in n.input)

    expands = [n for n in graph.node if n.op_type == "Expand"]
    assert not [n.name for n in expands if reaches_cache(n.input[0], 3)]
