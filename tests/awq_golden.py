"""The AWQ result of quantlab before AWQ was made reference-exact (commit f67e5e4, AWQ version 1), kept as a
golden file so the `awq` variants that name the old behaviour can be checked bit for bit.

tests/data/awq_v1_golden.pt was written by `write_golden()` at commit f67e5e4 (torch 2.13.0+cpu, this CPU);
`legacy` are the fields that select the old behaviour today (empty at f67e5e4, where they did not exist yet).
The environment it was recorded in is in awq_v1_golden.json: another torch or transformers may initialise the
tiny models or round differently, so the comparison only holds there.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

import quantlab
from quantlab.core.registry import make_config

GOLDEN = Path(__file__).parent / "data" / "awq_v1_golden.pt"
GOLDEN_ENV = GOLDEN.with_suffix(".json")

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


def quantized_state(case: str, legacy: dict) -> dict[str, torch.Tensor]:
    """The state dict after quantize() (codes, scales, zeros, folded norms), less the untouched embeddings / head."""
    kind, fields, calib = CASES[case]
    model = build_model(kind)
    quantlab.quantize(model, make_config({"method": "awq", **fields, **legacy}), calibration=calibration_ids(*calib),
                      progress=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()
            if not any(part in k for part in ("embed", "lm_head"))}


def environment() -> dict:
    import platform

    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine()}


def recorded_environment() -> dict:
    return {k: v for k, v in json.loads(GOLDEN_ENV.read_text()).items() if k in environment()}


def write_golden(legacy: dict, commit: str) -> None:
    torch.save({case: quantized_state(case, legacy) for case in CASES}, GOLDEN)
    GOLDEN_ENV.write_text(json.dumps({"recorded_at_commit": commit, **environment()}, indent=1) + "\n")
