"""quantlab's AWQ as it was before it was made reference-exact (version 1, commit f67e5e4), frozen here as a
test oracle: the `awq` variants scale_loss="linear", clip="minmax", clip_qk=true, block_inputs="quantized"
must reproduce it bit for bit. It runs live on the machine running the tests, so the comparison does not
depend on how another CPU or library version rounds.

Version 1, per block (blocks in order, each fed the *quantized* outputs of the block before it): one float
forward collects each linear input's Gram XᵀX and mean|X|; per smoothing group the α of {0, 1/n, ...} whose
s = mean|X|^α minimises Σ_consumers ‖W X − Q(W·s)(X / s)‖² is folded in; then every quantized linear
(q/k included) gets the per-(row, group) min/max shrink r ∈ {1, …, 1 − clip_max_shrink} of least group
output error, pinned as fixed qparams only when the whole layer's output error does not grow.
Only quantlab's primitives, observers, block capture and scale folding are shared with the code under test.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from quantlab.calibration.blocks import capture_block_inputs, run_block
from quantlab.calibration.smoothing import apply_scale, group_applies
from quantlab.core.observers import HessianObserver
from quantlab.core.primitives import fake_quantize, grouped, n_groups, qparams_from_range
from quantlab.core.qlinear import QuantLinear
from quantlab.models.arch import arch_for, find_blocks


def _fq(w, spec, p=None):
    return fake_quantize(w, spec.qparams(w) if p is None else p, spec.bits, spec.group_size, ste=False)


def _err(delta_w, gram):
    return ((delta_w @ gram) * delta_w).sum()


def _scale(x_mean_abs, alpha):
    s = x_mean_abs.float().pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _search_scale(weights, x_mean_abs, gram, specs, n_grid):
    best_loss, best_s = math.inf, None
    for k in range(n_grid):
        s = _scale(x_mean_abs, k / n_grid)
        loss = torch.zeros(())
        for w, spec in zip(weights, specs):
            w = w.detach().float()
            loss = loss + _err(w - _fq(w * s, spec) / s, gram)
        if float(loss) < best_loss:
            best_loss, best_s = float(loss), s
    return best_s


def _diagonal_blocks(gram, group_size):
    k = gram.shape[0]
    g = k if group_size is None else group_size
    ng = n_groups(k, group_size)
    padded = nn.functional.pad(gram, (0, ng * g - k, 0, ng * g - k)).view(ng, g, ng, g)
    idx = torch.arange(ng)
    return padded[idx, :, idx, :]


def _search_clip(w, gram, spec, ratios):
    w = w.detach().float()
    wg = grouped(w, spec.group_size)
    xmin, xmax = wg.amin(-1), wg.amax(-1)
    blocks = _diagonal_blocks(gram.float(), spec.group_size)

    def clipped(ratio):
        return qparams_from_range(xmin * ratio, xmax * ratio, spec.bits, spec.symmetric, spec.torch_scale_dtype)

    best_err, best_ratio = torch.full_like(xmin, math.inf), torch.ones_like(xmin)
    for ratio in ratios:
        delta = grouped(w - _fq(w, spec, clipped(ratio)), spec.group_size).transpose(0, 1)
        err = (torch.bmm(delta, blocks) * delta).sum(-1).transpose(0, 1)
        better = err < best_err
        best_err, best_ratio = torch.where(better, err, best_err), torch.where(better, ratio, best_ratio)
    if bool((best_ratio == 1).all()):
        return None
    p = clipped(best_ratio)
    return p if _err(w - _fq(w, spec, p), gram) <= _err(w - _fq(w, spec), gram) else None


def _block_v1(block, groups, inputs, kwargs, clip_ratios, n_grid):
    layers = {n: m for n, m in block.named_modules() if isinstance(m, QuantLinear) and not m.frozen}
    usable = [g for g in groups if all(c in layers for c in g.consumers) and group_applies(block, g)]
    owners = {n: n for n in layers}
    for g in usable:
        owners.update({c: g.consumers[0] for c in g.consumers})
    keys = list(dict.fromkeys(owners.values()))
    grams, abs_sum, rows = {k: HessianObserver() for k in keys}, {}, {}

    def observe(module, args, name):
        x = args[0] if module.input_scale is None else args[0] / module.input_scale.to(args[0].dtype)
        grams[name].update(x)
        flat = x.detach().reshape(-1, x.shape[-1]).float()
        abs_sum[name] = flat.abs().sum(0) + abs_sum.get(name, 0)
        rows[name] = rows.get(name, 0) + flat.shape[0]

    handles = [layers[n].register_forward_pre_hook(lambda m, a, n=n: observe(m, a, n)) for n in keys]
    before = {n: m.quant_enabled for n, m in layers.items()}
    for m in layers.values():
        m.quant_enabled = False
    run_block(block, inputs, kwargs)
    for n, m in layers.items():
        m.quant_enabled = before[n]
    for h in handles:
        h.remove()
    gram = {k: obs.compute() for k, obs in grams.items()}

    divisors = {}
    for g in usable:
        key, consumers = g.consumers[0], [layers[c] for c in g.consumers]
        s = _search_scale([c.weight for c in consumers], abs_sum[key] / rows[key], gram[key],
                          [c.spec for c in consumers], n_grid)
        apply_scale(block, g, s)
        divisors.update({c: s for c in g.consumers})
    for name, layer in layers.items():
        g = gram[owners[name]]
        if name in divisors:
            g = g / torch.outer(divisors[name], divisors[name])
        layer.fixed_qparams = _search_clip(layer.weight, g, layer.spec, clip_ratios)


@torch.no_grad()
def awq_v1_calibrate(model, batches, n_grid=20, clip_grid=20, clip_max_shrink=0.5):
    """Version 1's calibrate on a model whose linears rtn's prepare already swapped for QuantLinear."""
    clip_ratios = [1 - i / clip_grid for i in range(math.floor(clip_max_shrink * clip_grid + 1e-9) + 1)]
    groups = arch_for(model)["groups"]
    model.eval()
    inputs, kwargs = capture_block_inputs(model, batches)
    for block in find_blocks(model):
        _block_v1(block, groups, inputs, kwargs, clip_ratios, n_grid)
        inputs = run_block(block, inputs, kwargs)  # the quantized block's outputs feed the next one


# ---- the cases the variants are checked on --------------------------------------------------------

# name -> (model builder key, awq config fields without the legacy switches, calibration (n, t, vocab))
CASES = {
    "llama-gqa-w3g32-asym": ("llama_gqa", {"base": {"method": "rtn", "bits": 3, "group_size": 32,
                                                     "symmetric": False}}, (4, 24, 300)),
    "llama-mha-w4g32-sym-grid10": ("llama_mha", {"base": {"method": "rtn", "bits": 4, "group_size": 32},
                                                 "n_grid": 10, "clip_grid": 10, "clip_max_shrink": 0.3},
                                   (4, 24, 300)),
    "bert-w4g16-asym": ("bert", {"base": {"method": "rtn", "bits": 4, "group_size": 16, "symmetric": False}},
                        (3, 16, 100)),
}


def build_model(kind: str):
    """Tiny random models, seeded (the same weights on every call)."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if kind == "bert":
        cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
        return BertModel(cfg).eval()
    kv_heads = {"llama_gqa": 2, "llama_mha": 4}[kind]  # MHA: the v -> o group applies
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def calibration_ids(n: int, t: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, t), generator=gen) for _ in range(n)]
