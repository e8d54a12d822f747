"""Every arch-table family through the same lifecycle, on tiny random models built here (no download):
GPT-2 (transformers Conv1D, weights (in, out)), OPT and Qwen2. RTN freezes to its fake-quant forward exactly;
GPTQ and AWQ beat RTN on the same data; SmoothQuant's folding keeps the float logits; save/load is bitwise;
an architecture without a table entry fails, naming it, before any work."""
import pytest
import torch
from torch import nn

import quantlab
from quantlab import AWQConfig, GPTQConfig, RTNConfig, SmoothQuantConfig
from quantlab.backends.serialize import load_quantized, save_quantized
from quantlab.core.lifecycle import linearize_conv1d, quant_linears, select_linears
from quantlab.core.registry import LayerSelection, get_method
from quantlab.methods.smoothquant import collect_smoothing_stats, smooth
from quantlab.models.arch import arch_for, find_blocks
from quantlab.transforms.rotation import RotationConfig, rotate_model

VOCAB, ARCHS = 128, ("gpt2", "opt", "qwen2")
# the last MLP linear of block 0 per family: kept float in the save/load test (a Conv1D left unquantized)
LAST_MLP_0 = {"gpt2": "transformer.h.0.mlp.c_proj", "opt": "model.decoder.layers.0.fc2",
              "qwen2": "model.layers.0.mlp.down_proj"}


def _tiny(kind: str, seed: int = 0) -> nn.Module:
    """A 2-block random model (hidden 64); norms get random weights/biases so folding is really exercised."""
    from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                           bos_token_id=0, eos_token_id=0))
    elif kind == "opt":
        model = OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                         num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64))
    else:
        raise ValueError(kind)
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__ and getattr(m, "weight", None) is not None:
                m.weight.copy_(1 + 0.3 * torch.randn_like(m.weight))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.1 * torch.randn_like(m.bias))
    return model.eval()


def _ids(n: int, seed: int, t: int = 32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, t), generator=gen) for _ in range(n)]


CALIB, HELD_OUT = _ids(8, seed=1), torch.cat(_ids(4, seed=2))


def _logits(model, ids=HELD_OUT):
    with torch.no_grad():
        return model(ids).logits


def _mse(a, b) -> float:
    return float((a - b).pow(2).mean())


def test_gpt2_conv1d_becomes_an_exactly_equal_linear():
    model = _tiny("gpt2")
    ref = _logits(model)
    names = linearize_conv1d(model)
    assert len(names) == 8 and "transformer.h.1.attn.c_attn" in names
    c_attn = model.get_submodule("transformer.h.0.attn.c_attn")
    assert type(c_attn) is nn.Linear and c_attn.weight.shape == (192, 64)  # (out, in): q, k, v rows
    assert torch.equal(_logits(model), ref)  # same operand layout as Conv1D's addmm: bitwise
    assert linearize_conv1d(model) == []  # idempotent
    chosen = [n for n, _ in select_linears(_tiny("gpt2"), LayerSelection(include=("*.attn.*",)))]
    assert chosen == [f"transformer.h.{i}.attn.{n}" for i in range(2) for n in ("c_attn", "c_proj")]


@pytest.mark.parametrize("kind", ARCHS)
def test_find_blocks(kind):
    model = _tiny(kind)
    expected = {"gpt2": "transformer.h", "opt": "model.decoder.layers", "qwen2": "model.layers"}[kind]
    assert find_blocks(model) is model.get_submodule(expected)
    assert find_blocks(model.base_model) is model.get_submodule(expected)  # the bare base model too


@pytest.mark.parametrize("kind", ARCHS)
def test_rtn_frozen_equals_fake_quant(kind):
    model, cfg = _tiny(kind), RTNConfig(bits=4, group_size=32)
    method = get_method(cfg)
    method.prepare(model, cfg)
    assert len(quant_linears(model)) == {"gpt2": 8, "opt": 12, "qwen2": 14}[kind]  # lm_head excluded
    fake = _logits(model)
    method.convert(model, cfg)
    assert all(m.frozen for m in quant_linears(model).values())
    assert torch.equal(_logits(model), fake)  # reference: the fake-quant forward, atol = 0


@pytest.mark.parametrize("kind", ARCHS)
def test_gptq_and_awq_beat_rtn(kind):
    """Reference: the float model's logits on held-out windows; GPTQ and AWQ (same w4 g32 grid, same
    calibration windows) give a smaller logit MSE than RTN."""
    ref = _logits(_tiny(kind))
    err = {}
    for name, cfg in [("rtn", RTNConfig(bits=4, group_size=32)), ("gptq", GPTQConfig(bits=4, group_size=32)),
                      ("awq", AWQConfig(base=RTNConfig(bits=4, group_size=32), n_grid=10, clip_grid=10))]:
        model = _tiny(kind)
        quantlab.quantize(model, cfg, calibration=CALIB, progress=False)
        err[name] = _mse(_logits(model), ref)
    assert err["gptq"] < err["rtn"], err
    assert err["awq"] < err["rtn"], err


@pytest.mark.parametrize("kind", ARCHS)
def test_smoothquant_fold_keeps_float_logits(kind):
    """Every group that folds on a float model (norm and linear producers; GPT-2's explicit groups need
    QuantLinear consumers and are skipped here) leaves the logits within 1e-5 of the unsmoothed model."""
    model = _tiny(kind)
    ref = _logits(model)
    get_method("smoothquant").prepare(model, SmoothQuantConfig())  # GPT-2: Conv1D -> nn.Linear
    stats = collect_smoothing_stats(model, CALIB, progress=False, linear_inputs=True)
    chosen = smooth(model, stats, alpha=0.5, linear_inputs=True)
    # gpt2: ln_1 -> c_attn, ln_2 -> c_fc; opt: + v -> out_proj, fc1 -> fc2; qwen2 (GQA, no v -> o): + up -> down
    assert len(chosen) == {"gpt2": 4, "opt": 8, "qwen2": 6}[kind]
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-5)


def test_gpt2_smoothquant_w8a8_runs_with_explicit_groups():
    model = _tiny("gpt2")
    summary = quantlab.quantize(model, SmoothQuantConfig(smooth_linear_inputs=True), calibration=CALIB,
                                progress=False)
    assert summary["diagnostics"]["smoothquant_groups"] == 8  # 2 norm-folded + 2 explicit per block
    assert quant_linears(model)["transformer.h.0.mlp.c_proj"].input_scale is not None
    assert _mse(_logits(model), _logits(_tiny("gpt2"))) < 1e-3


@pytest.mark.parametrize("kind", ARCHS)
def test_save_load_round_trip(kind, tmp_path):
    """Bitwise logits after load; one MLP linear left float (for GPT-2, a Conv1D never selected)."""
    model, cfg = _tiny(kind), RTNConfig(bits=4, group_size=32, exclude=("lm_head", LAST_MLP_0[kind]))
    quantlab.quantize(model, cfg, progress=False)
    path = save_quantized(model, tmp_path / kind, cfg, base_model_id=f"tiny-{kind}")
    loaded = load_quantized(path, base_model_id=f"tiny-{kind}")
    assert set(quant_linears(loaded)) == set(quant_linears(model))
    assert type(loaded.get_submodule(LAST_MLP_0[kind])) is nn.Linear
    assert torch.equal(_logits(loaded), _logits(model))


def test_loaded_gpt2_exports_to_torchao(tmp_path):
    from quantlab.backends import export_model

    model, cfg = _tiny("gpt2"), RTNConfig(bits=4, group_size=32)
    quantlab.quantize(model, cfg, progress=False)
    loaded = load_quantized(save_quantized(model, tmp_path / "gpt2", cfg, base_model_id="tiny-gpt2"))
    summary = export_model(loaded, "torchao", HELD_OUT[:1])
    assert summary["backend"] == "torchao" and summary["export_parity_ok"] and summary["exported_layers"] == 8


def test_gpt2_online_rotation_rotates_conv1d_layers():
    model = _tiny("gpt2")
    ref = _logits(model)
    facts = rotate_model(model, RotationConfig(scope="online"))
    assert facts["rotation_online_layers"] == 8
    torch.testing.assert_close(_logits(model), ref, rtol=0, atol=1e-4)  # float64 fold, fp32 Hadamard: round-off
    with pytest.raises(ValueError, match=r"model_type 'gpt2' has no rotation facts.*supported: .*llama"):
        rotate_model(_tiny("gpt2"), RotationConfig())


def _unknown_arch() -> nn.Module:
    model = _tiny("gpt2")
    model.config.model_type = "gpt9"
    return model


def _untouchable():
    raise AssertionError("calibration data read before the architecture was checked")
    yield  # pragma: no cover


@pytest.mark.parametrize("method,config", [("awq", AWQConfig()), ("smoothquant", SmoothQuantConfig())])
def test_missing_arch_entry_fails_first_naming_it(method, config):
    model = _unknown_arch()
    with pytest.raises(ValueError, match=rf"^{method}: model_type 'gpt9' has no architecture entry; "
                                         rf"supported: .*gpt2.*opt.*qwen2"):
        quantlab.quantize(model, config, calibration=_untouchable(), progress=False)
    assert not quant_linears(model)
    assert type(model.get_submodule("transformer.h.0.attn.c_attn")).__name__ == "Conv1D"  # untouched
    with pytest.raises(ValueError, match=r"model_type 'gpt9' has no rotation facts"):
        rotate_model(model, RotationConfig())
    with pytest.raises(ValueError, match=r"^model_type 'gpt9' has no architecture entry"):
        arch_for(model)
