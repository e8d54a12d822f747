"""Hadamard matrices, the fast Walsh-Hadamard transform and rotations folded into a Llama model (QuaRot's R1, R2, R4).

References: H Hᵀ = n I exactly (integers); the FWHT against the dense matmul (float64, atol 1e-12); a rotated float
model against the original's logits (fp32 round-off: rel 1e-5 on the tiny model, 1e-4 on SmolLM2, the issue's bound).
"""
import copy

import pytest
import torch

import quantlab
from quantlab.core.lifecycle import quantize
from quantlab.core.registry import make_config
from quantlab.eval import perplexity
from quantlab.models.data import eval_windows, load_token_ids
from quantlab.runs import runner
from quantlab.runs.experiment import parse_experiment
from quantlab.transforms.hadamard import factor_order, hadamard_matrix, hadamard_transform, random_orthogonal
from quantlab.transforms.rotation import OnlineHadamard, RotationConfig, has_online_rotation, rotate_model

ORDERS = [1, 2, 4, 12, 20, 24, 28, 36, 40, 44, 60, 64, 72, 96, 576, 1536]


@pytest.mark.parametrize("n", ORDERS)
def test_hadamard_matrix_is_exact(n):
    h = hadamard_matrix(n)
    assert h.dtype == torch.int64 and set(h.unique().tolist()) <= {-1, 1}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.int64))


def test_the_model_sizes_factor_as_quarot_does():
    assert factor_order(576) == (16, 36)  # SmolLM2 hidden size: Paley II, q = 17
    assert factor_order(1536) == (128, 12)  # its intermediate size: Paley I, q = 11
    assert factor_order(64) == (64, 1)


@pytest.mark.parametrize("n", [6, 9, 52, 3 * 64])
def test_orders_without_a_construction_fail_naming_the_order(n):
    if n == 3 * 64:  # 192 = 16 * 12 works: the error list must not contain false negatives
        assert factor_order(n) == (16, 12)
        return
    with pytest.raises(ValueError, match=rf"no Hadamard construction for order {n}: .*supported orders near {n}: "):
        factor_order(n)


@pytest.mark.parametrize("n", [8, 12, 96, 576, 1536])
def test_fwht_equals_the_dense_matmul(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    dense = x @ hadamard_matrix(n).to(torch.float64) / n ** 0.5
    torch.testing.assert_close(hadamard_transform(x), dense, rtol=0, atol=1e-12)
    signs = torch.tensor([1.0, -1.0]).repeat(n // 2).to(torch.float64)
    torch.testing.assert_close(hadamard_transform(x, signs), (x * signs) @ hadamard_matrix(n).to(x) / n ** 0.5,
                               rtol=0, atol=1e-12)
    # orthonormal: the norm of every row is kept
    torch.testing.assert_close(hadamard_transform(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)


def test_random_orthogonal_is_orthogonal_and_seeded():
    q = random_orthogonal(48, seed=3)
    torch.testing.assert_close(q @ q.T, torch.eye(48, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, random_orthogonal(48, seed=3)) and not torch.equal(q, random_orthogonal(48, seed=4))


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("cfg", [RotationConfig(), RotationConfig(kind="random", seed=5),
                                 RotationConfig(r2=False, r4=False), RotationConfig(r2=True, r4=False)])
def test_rotated_tiny_model_computes_the_same_logits(tiny_model, cfg):
    model, _ = tiny_model
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = _logits(model, ids)
    rot = copy.deepcopy(model)
    facts = rotate_model(rot, cfg)
    out = _logits(rot, ids)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert facts["rotation_untied_head"] and rot.config.tie_word_embeddings is False
    assert rot.lm_head.weight is not rot.model.embed_tokens.weight
    # the weights really changed (a rotation that did nothing would also pass the logits check)
    assert not torch.allclose(rot.model.layers[0].self_attn.q_proj.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(rot.model.layers[0].input_layernorm.weight, torch.ones(64))
    assert has_online_rotation(rot.model.layers[0].mlp.down_proj) == cfg.r4


def test_online_hadamard_survives_quantization_and_freezing(tiny_model):
    model, _ = tiny_model
    rotate_model(model, RotationConfig())
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(1))
    quantize(model, make_config({"method": "dynamic", "act_bits": 4,
                                 "base": {"method": "rtn", "bits": 4, "group_size": 16}}))
    down = model.model.layers[1].mlp.down_proj
    assert type(down).__name__ == "QuantLinear" and has_online_rotation(down)
    seen = {}
    down.act_quant.register_forward_hook(lambda m, a, out: seen.setdefault("x", a[0]))
    pre = {}
    h = down.register_forward_pre_hook(lambda m, a: pre.update(x=a[0]), prepend=True)
    _logits(model, ids)
    h.remove()
    # the activation quantizer sees the rotated input, not the raw one
    torch.testing.assert_close(seen["x"], hadamard_transform(pre["x"]), rtol=0, atol=0)


def test_rotation_errors_are_clear(tiny_model_dir, tiny_model):
    model, _ = tiny_model
    with pytest.raises(ValueError, match="unknown rotation kind 'haar'; known: hadamard, random"):
        RotationConfig(kind="haar")
    q = copy.deepcopy(model)
    quantize(q, make_config({"method": "rtn", "bits": 8}))
    with pytest.raises(ValueError, match="rotate the float model before quantizing it"):
        rotate_model(q, RotationConfig())
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="model_type 'bert' has no rotation facts .*supported: llama, mistral, qwen2"):
        rotate_model(bert, RotationConfig())
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=36, intermediate_size=72, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2))  # head_dim 18: no Hadamard
    with pytest.raises(ValueError, match="rotation: head_dim = 18: no Hadamard construction for order 18"):
        rotate_model(odd, RotationConfig())
    rotate_model(odd, RotationConfig(r2=False))  # 36 (Paley II) and 72 (2 x 36) are fine
    with pytest.raises(ValueError, match="already rotated"):
        rotate_model(odd, RotationConfig(r2=False))


def _tiny_experiment(model_dir, runs, **extra):
    eval_table = {"dataset": str(model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3, "kl_windows": 2,
                  "latency": False}
    return parse_experiment({"name": "rot", "model": str(model_dir), "device": "cpu", "eval": eval_table,
                             "run": runs, **extra})


def test_experiment_runs_rotate_and_say_so(tiny_model_dir, tmp_path):
    runs = [{"name": "fp32", "method": "none"},
            {"name": "fp32-rot", "method": "none", "rotation": {"kind": "hadamard", "seed": 1}},
            {"name": "w4a4-rot", "method": "dynamic", "act_bits": 4, "base": {"method": "rtn", "bits": 4},
             "rotation": {}}]
    exp = _tiny_experiment(tiny_model_dir, runs)
    keys = [runner.run_key(exp, r, torch.device("cpu")) for r in exp.runs]
    assert len(set(keys)) == 3
    plain = _tiny_experiment(tiny_model_dir, runs[:1])
    assert runner.run_key(plain, plain.runs[0], torch.device("cpu")) == keys[0]  # no rotation: the key is unchanged
    df = runner.run_experiment(exp, tmp_path, progress=False)
    by = df.set_index("run")
    assert by.loc["fp32-rot", "ppl"] == pytest.approx(by.loc["fp32", "ppl"], rel=1e-5)
    assert by.loc["fp32-rot", "rotation"] == "rot hadamard R1+R2+R4+o_proj online" and bool(by.loc["fp32-rot", "rotation_untied_head"])
    assert by.loc["w4a4-rot", "scheme"] == "w4 channel sym + a4 dynamic + rot hadamard R1+R2+R4+o_proj online"
    # the untied head is counted: the rotated float model holds one more vocab x hidden matrix
    assert by.loc["fp32-rot", "weight_bytes"] == by.loc["fp32", "weight_bytes"] + 300 * 64 * 4


@pytest.mark.parametrize("run,match", [
    ({"method": "awq", "rotation": {}}, "does not compose with awq"),
    ({"method": "smoothquant", "smooth_linear_inputs": True, "rotation": {}}, "does not compose with smoothquant"),
    ({"method": "rtn", "rotation": {"kind": "hadamard", "sed": 1}}, r"rotation: unknown key\(s\) 'sed'; valid: kind"),
    ({"method": "rtn", "rotation": "hadamard"}, "rotation must be a table"),
    ({"method": "rtn", "bits": 8, "backend": "torchao", "rotation": {}},
     r"backend 'torchao' does not run the online Hadamard of a rotation with r4 = true, o_proj_hadamard = true .*; use backend = \"simulated\""),
])
def test_bad_rotation_runs_fail_before_loading(tiny_model_dir, run, match):
    with pytest.raises(ValueError, match=match):
        _tiny_experiment(tiny_model_dir, [{"name": "a", **run}])


def test_rotation_without_online_hadamards_composes_with_awq(tiny_model_dir):
    with pytest.raises(ValueError, match="o_proj_hadamard = true .* does not compose with awq"):
        _tiny_experiment(tiny_model_dir, [{"name": "a", "method": "awq", "rotation": {"r4": False}}])
    exp = _tiny_experiment(tiny_model_dir, [{"name": "a", "method": "awq",
                                             "rotation": {"r4": False, "o_proj_hadamard": False}}])
    assert exp.runs[0].extra("rotation") == RotationConfig(r4=False, o_proj_hadamard=False)


@pytest.mark.parametrize("cfg", [RotationConfig(), RotationConfig(o_proj_hadamard=False), RotationConfig(r4=False),
                                 RotationConfig(scope="online")])
def test_rotation_tables_round_trip(cfg):
    from quantlab.core.extras import get_extra

    extra = get_extra("rotation")
    assert extra.parse(extra.to_dict(cfg)) == cfg and extra.parse_stored(extra.to_dict(cfg)) == cfg


def test_o_proj_hadamard_mixes_the_attention_output_across_heads(tiny_model):
    """o_proj's input is rotated by the full Hadamard online (every output channel of the hook depends on every
    head), its weight folded so the float logits stay; without the option only R2's per-head blocks act."""
    model, _ = tiny_model
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = _logits(model, ids)
    for on in (True, False):
        rot = copy.deepcopy(model)
        facts = rotate_model(rot, RotationConfig(o_proj_hadamard=on))
        o = rot.model.layers[0].self_attn.o_proj
        assert has_online_rotation(o) is on and facts["rotation_online_layers"] == 2 * (1 + int(on))
        out = _logits(rot, ids)
        assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    x = torch.zeros(1, 1, 64)
    x[..., 3] = 1.0  # one channel of head 0
    mixed = OnlineHadamard()(o, (x,))[0]
    assert (mixed.abs() > 0).all()  # reaches all 4 heads' channels


@pytest.mark.slow
@pytest.mark.needs_model("smollm2-135m")
def test_rotated_smollm2_keeps_its_logits_and_rescues_w4a4(wikitext_dir):
    model, tok = quantlab.load_model("smollm2-135m", device="cpu")
    ids, _ = load_token_ids("wikitext2", "test", tok, data_dir=wikitext_dir)
    windows = eval_windows(ids, 256, max_windows=2)
    ref = _logits(model, windows)
    rot = copy.deepcopy(model)
    rotate_model(rot, RotationConfig())
    out = _logits(rot, windows)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()  # the bound, fp32
    _o_proj_input_error_drops_with_the_cross_head_hadamard(model, rot, windows[:1, :128])
    w4a4 = {"method": "dynamic", "act_bits": 4, "base": {"method": "rtn", "bits": 4, "group_size": 64}}
    ppl = {}
    for name, m in (("plain", model), ("rotated", rot)):
        quantize(m, make_config(w4a4))
        ppl[name] = perplexity(m, windows, progress=False)["ppl"]
    # measured 2 x 256 tokens: ~9850 without rotation, ~150 with (fp32 ~31)
    assert ppl["rotated"] < ppl["plain"] / 5, ppl
    assert isinstance(next(iter(rot.model.layers[0].mlp.down_proj._forward_pre_hooks.values())), OnlineHadamard)


def _o_proj_input_error_drops_with_the_cross_head_hadamard(model, rot, window):
    """QuaRot completed: mixing o_proj's input across heads spreads the few outlier heads' energy, so per-token int4
    rounding of that input loses less than with R2's within-head rotation alone (all 30 layers, 128 real tokens;
    measured 0.020 against 0.036)."""
    from quantlab.core.primitives import fake_quantize, qparams

    per_head = copy.deepcopy(model)
    rotate_model(per_head, RotationConfig(o_proj_hadamard=False))
    err = {}
    for name, m in (("per_head", per_head), ("cross_head", rot)):
        seen = []
        hooks = [b.self_attn.o_proj.register_forward_pre_hook(lambda mod, a: seen.append(a[0].reshape(-1, 576)))
                 for b in m.model.layers]  # after the rotation's own hook: what an activation quantizer sees
        _logits(m, window)
        for h in hooks:
            h.remove()
        x = torch.cat(seen)
        q = fake_quantize(x, qparams(x, 4, None, True), 4, None, ste=False)  # per-token symmetric int4 (W4A4's)
        err[name] = float((q - x).pow(2).sum() / x.pow(2).sum())
    assert err["cross_head"] < 0.9 * err["per_head"], err


def test_experiment_runs_quantize_the_kv_cache(tiny_model_dir, tmp_path):
    """A run's kv_cache table: kv16 is the float model exactly; kv4 changes ppl and holds fewer cache bytes; the
    shared float model (the KL reference) keeps its own attention."""
    runs = [{"name": "fp32", "method": "none"},
            {"name": "kv16", "method": "none", "kv_cache": {"bits": 16}},
            {"name": "kv4", "method": "none", "kv_cache": {"bits": 4}},
            {"name": "w4a4-rot-kv4", "method": "dynamic", "act_bits": 4, "base": {"method": "rtn", "bits": 4},
             "rotation": {}, "kv_cache": {"bits": 4, "rotate_k": True}}]
    exp = _tiny_experiment(tiny_model_dir, runs)
    exp = parse_experiment({"name": "kv", "model": str(tiny_model_dir), "device": "cpu", "run": runs,
                            "eval": {"dataset": str(tiny_model_dir / "sample.txt"), "seq_len": 32, "max_windows": 3,
                                     "kl_windows": 2, "prefill_tokens": 8, "decode_tokens": 2, "latency_repeats": 1}})
    df = runner.run_experiment(exp, tmp_path, progress=False).set_index("run")
    assert df.loc["kv16", "ppl"] == df.loc["fp32", "ppl"] and df.loc["kv16", "kl_mean"] == 0
    assert df.loc["kv4", "ppl"] != df.loc["fp32", "ppl"] and df.loc["kv4", "kl_mean"] > 0
    assert df.loc["kv4", "kv_cache"] == "kv4 ghead asym" and df.loc["kv4", "scheme"] == "float32 + kv4 ghead asym"
    assert df.loc["kv4", "kv_cache_mib"] < df.loc["kv4", "kv_cache_float_mib"]
    assert df.loc["w4a4-rot-kv4", "scheme"] == "w4 channel sym + a4 dynamic + rot hadamard R1+R2+R4+o_proj online + kv4 ghead asym rotk"
    with pytest.raises(ValueError, match=r"kv_cache: unknown key\(s\) 'bitz'"):
        _tiny_experiment(tiny_model_dir, [{"name": "a", "method": "none", "kv_cache": {"bitz": 4}}])


def test_online_scope_rotates_a_post_ln_bert_exactly():
    """BERT cannot fold R1 (post-LN); scope "online" rotates every linear's input at run time instead."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    bert = BertModel(BertConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                vocab_size=100)).eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = bert(ids).last_hidden_state
    facts = rotate_model(bert, RotationConfig(scope="online"))
    assert facts["rotation_online_layers"] == 2 * 6 + 1  # q, k, v, attn out, intermediate, output; + pooler
    with torch.inference_mode():
        out = bert(ids).last_hidden_state
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    with pytest.raises(ValueError, match="scope 'online' .* kind 'random' is not supported"):
        RotationConfig(scope="online", kind="random")


def test_online_hadamard_tames_outlier_channels_for_4_bit_activations():
    """The mechanism on one linear: inputs with 3 outlier channels (x30), per-token int4 activations. The rotated
    layer's output error against float must be at least 1.5x lower (measured 2.0x: 0.154 vs 0.075)."""
    torch.manual_seed(0)

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 32)

        def forward(self, x):
            return self.proj(x)

    plain = One()
    x = torch.randn(256, 64)
    x[:, :3] *= 30
    with torch.no_grad():
        ref = plain(x)
    rot = copy.deepcopy(plain)
    rotate_model(rot, RotationConfig(scope="online"))
    a4 = make_config({"method": "dynamic", "act_bits": 4, "base": {"method": "rtn", "bits": 8}})
    err = {}
    for name, m in (("plain", plain), ("rotated", rot)):
        quantize(m, a4)
        with torch.no_grad():
            err[name] = float((m(x) - ref).norm() / ref.norm())
    assert err["rotated"] * 1.5 < err["plain"], err


def test_online_scope_refuses_smoothing_methods(tiny_model_dir):
    with pytest.raises(ValueError, match="scope 'online' .* does not compose with smoothquant"):
        _tiny_experiment(tiny_model_dir, [{"name": "a", "method": "smoothquant", "rotation": {"scope": "online"}}])


def test_scheme_names_rotation_scope_and_kv_rotation():
    """The scheme column tells apart what changes the numbers: rotation scope, KV bits, the K Hadamard."""
    from quantlab.reporting.report import scheme

    base = {"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}
    # a stored residual rotation without o_proj_hadamard ran before it existed: without it
    assert scheme({**base, "rotation": {"kind": "hadamard"}}, "float32") == "w4 g64 asym + rot hadamard R1+R2+R4"
    assert scheme({**base, "rotation": {"kind": "random", "r4": False}}, "float32") == "w4 g64 asym + rot random R1+R2"
    assert scheme({**base, "rotation": {"kind": "hadamard", "o_proj_hadamard": True}},
                  "float32") == "w4 g64 asym + rot hadamard R1+R2+R4+o_proj online"
    assert scheme({**base, "rotation": {"scope": "online"}}, "float32") == "w4 g64 asym + rot online hadamard (every linear input)"
    assert scheme({"method": "none", "kv_cache": {"bits": 4}}, "float32") == "float32 + kv4 ghead asym"
    assert scheme({"method": "none", "kv_cache": {"bits": 4, "rotate_k": True}}, "float32") == "float32 + kv4 ghead asym rotk"
    assert scheme({"method": "none", "kv_cache": {"bits": 16}}, "float32") == "float32 + kv16"

