"""The CPU anchors of the speed benchmark (quantlab/eval/floor.py, quantlab/runs/bench.py): the measured read
bandwidth and its bytes, the weight bytes a decode step reads counted by hand on the tiny Llama, and a llama.cpp
configuration through the side-by-side pipeline next to torch fp32.

Tiny Llama (tests/conftest.py): hidden 64, intermediate 96, 2 layers, 4 heads / 2 KV heads (head_dim 16), vocab 300,
tied embeddings. Per layer the linears hold q 64x64 + k 32x64 + v 32x64 + o 64x64 + gate, up, down 3 x 96x64 =
30720 weights, plus two norms of 64; one final norm of 64; the embedding / head table 300 x 64.
"""
from __future__ import annotations

import pytest
import torch

from quantlab.eval.floor import MIB, decode_weight_bytes, kv_read_bytes, measure_dram_bandwidth

H, V, L, LINEAR = 64, 300, 2, 30720
NORMS = L * 2 * H + H  # weights of every RMSNorm


def test_bandwidth_is_positive_and_counts_the_array_it_read():
    """An 8 MiB + 3 B request reads 8 MiB (whole float32 elements); GB/s = those bytes / the fastest pass, exactly."""
    bw = measure_dram_bandwidth(nbytes=8 * MIB + 3, repeats=3)
    assert bw["dram_bandwidth_bytes"] == 8 * MIB
    assert bw["dram_bandwidth_gbs"] > 0 and bw["dram_bandwidth_gbs"] >= bw["dram_bandwidth_gbs_median"]
    assert bw["dram_bandwidth_gbs"] == 8 * MIB / bw["dram_bandwidth_best_s"] / 1e9  # exact: the same arithmetic
    assert "8 MiB" in bw["dram_bandwidth_method"] and "fastest of 3 passes" in bw["dram_bandwidth_method"]
    with pytest.raises(ValueError, match="repeats must be >= 1, got 0"):
        measure_dram_bandwidth(nbytes=MIB, repeats=0)


def test_fp32_bytes_per_step_by_hand_tied_head_once(tiny_model):
    """fp32: every linear and norm, and the tied table once (as the head, read whole). Untied: the head whole plus
    one row of the embedding. Exact."""
    model, _ = tiny_model
    read = decode_weight_bytes(model)
    assert read == {"decode_weight_bytes": 4 * (L * LINEAR + NORMS + V * H), "decode_head_bytes": 4 * V * H}
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untie
    assert decode_weight_bytes(model)["decode_weight_bytes"] == 4 * (L * LINEAR + NORMS + V * H + H)


def test_int4_g32_bytes_per_step_by_hand(tiny_model):
    """int4 g32 asymmetric (RTN, frozen): per weight half a byte of codes, per group of 32 an fp16 scale and a uint8
    zero; norms and the tied fp32 table (the head stays float) as before. Exact."""
    import quantlab

    model, _ = tiny_model
    quantlab.quantize(model, quantlab.RTNConfig(bits=4, group_size=32, symmetric=False))
    assert model.model.layers[0].self_attn.q_proj.scale.dtype == torch.float16
    codes, scales, zeros = LINEAR // 2, LINEAR // 32 * 2, LINEAR // 32
    assert decode_weight_bytes(model) == {"decode_weight_bytes": L * (codes + scales + zeros) + 4 * (NORMS + V * H),
                                          "decode_head_bytes": 4 * V * H}


def test_kv_read_bytes_by_hand(tiny_model):
    model, _ = tiny_model  # 2 layers x (K, V) x 2 KV heads x 16 dims
    assert kv_read_bytes(model.config, 10.5, batch=3, element_bytes=2) == 2 * 2 * 2 * 16 * 10.5 * 3 * 2


def _tiny_source_gguf(path, config):
    """A GGUF that lends export_gguf a 300-token tokenizer and the hyperparameters llama.cpp requires."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    tokens = ["<unk>", "<s>", "<0x0A>"] + [f"t{i}" for i in range(3, config.vocab_size)]
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([2, 3, 6] + [1] * (len(tokens) - 3))  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llamacpp_config_runs_side_by_side_with_torch(tiny_model, tmp_path):
    """A llama.cpp BenchConfig (F32 and Q8_0 GGUFs of the tiny model) through prepare, interleaved_latency,
    speed_table and add_floor next to torch fp32, at batch 1 and 2. The F32 file's bytes per step equal torch fp32's
    hand count; Q8_0 stores 34 bytes per block of 32 weights, its token embedding too (llama.cpp's recipe)."""
    from ci_policy import missing

    from quantlab.backends.llamacpp import llamacpp_available
    from quantlab.runs.bench import BenchConfig, add_floor, interleaved_latency, prepare, speed_table

    if not llamacpp_available():
        missing("llama-cpp-python (the llamacpp extra)", "pip install 'quantlab[llamacpp]'")
    model, _ = tiny_model
    source = _tiny_source_gguf(tmp_path / "source.gguf", model.config)
    probe = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfgs = [BenchConfig("fp32"), BenchConfig("llamacpp-f32", backend="llama.cpp"),
                BenchConfig("llamacpp-q8_0", {"method": "gguf", "type": "Q8_0"}, backend="llama.cpp")]
        models = {c.name: prepare(c, model, probe, tmp_path / c.name, source_gguf=source) for c in cfgs}
        rows = interleaved_latency(models, [(1, 8, 3), (2, 8, 3)], rounds=1, progress=False)
    finally:
        torch.set_num_threads(threads)
    df = add_floor(speed_table(rows, "fp32"), 20.0, model.config).set_index(["config", "batch_size"])
    assert len(df) == 6 and (df["decode_ms_per_token_p50"] > 0).all() and (df["prefill_ms_p50"] > 0).all()
    f32, q8 = df.loc[("llamacpp-f32", 1)], df.loc[("llamacpp-q8_0", 2)]
    assert f32["backend"] == "llama.cpp" and f32["cpu_threads"] == 1 and f32["llamacpp_parity_logits_rel_rms"] < 1e-3
    assert f32["decode_weight_bytes"] == df.loc[("fp32", 1), "decode_weight_bytes"] == 4 * (L * LINEAR + NORMS + V * H)
    assert q8["decode_weight_bytes"] == (L * LINEAR + V * H) * 34 // 32 + 4 * NORMS
    assert f32["kv_element_bytes"] == 2 and df.loc[("fp32", 1), "kv_element_bytes"] == 4
    assert f32["floor_ms_per_token"] == f32["decode_weight_bytes"] / 20e6  # bytes / (20 GB/s in bytes per ms)
    assert q8["decode_vs_floor"] == q8["decode_ms_per_token_p50"] / q8["floor_ms_per_token"]


def test_findings_come_from_the_rows():
    """The report's findings: speed-ups against fp32 and distances from the floor computed from rows through
    speed_table and add_floor (100 MiB read per step at 20 GB/s: a floor of 5.24288 ms), the machine named."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from quantlab.runs.bench import add_floor, speed_table

    spec = importlib.util.spec_from_file_location(
        "smollm2_speed", Path(__file__).resolve().parents[1] / "experiments" / "smollm2_speed.py")
    speed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speed)
    machine = {"cpu_model": "Some CPU", "cpu_simd": "avx2 fma", "cpu_avx512": "none", "cpu_amx": "none",
               "loadavg_1m_start": 0.5, "loadavg_1m_end": 0.7, "dram_bandwidth_method": "torch.sum ...",
               "dram_bandwidth_gbs_start": 19.0, "dram_bandwidth_gbs_end": 20.0, "llamacpp_cpu_features": "AVX2 FMA"}
    rows = [{"config": c, "backend": be, "batch_size": b, "prefill_tokens": 512, "decode_tokens": 64,
             "prefill_ms_p50": 100.0, "weight_mib": 100.0, "decode_ms_per_token_p50": ms, "decode_weight_bytes": wb,
             "decode_head_bytes": 2**20, "kv_element_bytes": 2, **machine}
            for c, be, wb, per_batch in (("fp32", "float", 400 * MIB, {1: 40.0, 8: 80.0}),
                                         ("llamacpp-q4_0", "llama.cpp", 100 * MIB, {1: 8.0, 8: 20.0}))
            for b, ms in per_batch.items()]
    config = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30)
    text = speed.findings_text(add_floor(speed_table(rows, "fp32"), 20.0, config))
    assert "CPU `Some CPU`; instruction sets (/proc/cpuinfo): avx2 fma, AVX-512: none" in text
    assert "the llama.cpp build uses AVX2 FMA. Load average (1 min) 0.50 at start, 0.70 at end" in text
    assert ("- `llamacpp-q4_0` (llama.cpp, 100.0 MiB read per step, of it 1.0 MiB output head): batch 1: decode "
            "5.00x fp32, 1.53x its floor of 5.24 ms/token") in text
    assert "batch 8: decode 4.00x fp32, 3.81x its floor" in text  # 20 / 5.24288
    assert "- Batch 1: fastest decode `llamacpp-q4_0` (5.00x fp32, 8.00 ms/token)" in text
    assert speed.findings_text(speed_table(rows, "fp32")) == ""  # rows without floor columns: no findings
