"""Check a GGUF alias' converted checkpoint against the two references it must equal (issue 32: the Qwen2.5-Coder
aliases; also runs on gemma3-270m and smollm2-135m):

- transformers' own GGUF load (`from_pretrained(dir, gguf_file=...)`): fp32 logits on text windows, max |diff|;
- quantlab's dequantization of the GGUF's tensors (core/ggml, tested bit for bit against llama.cpp's): every
  weight of the converted checkpoint, max |diff| and how many tensors are bitwise equal.

Writes one row per alias to reports/gguf_alias_check.csv (replacing that alias' earlier row) and prints it.
The 1.5B model needs ~15 GiB (its peak_rss_gib): the converted model and transformers' load are held at once.

    python experiments/check_gguf_aliases.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from quantlab.core.ggml import names
from quantlab.core.ggml.gguffile import read_gguf
from quantlab.eval.memprobe import peak_rss_mib, reset_peak_rss
from quantlab.models.loading import ALIASES, alias_gguf_path, load_model, model_info

CSV = ROOT / "reports" / "gguf_alias_check.csv"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa() -> str:
    """The vector instruction sets that decide CPU speed here (AVX2, AVX-512, AMX), from /proc/cpuinfo's flags."""
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), []) if Path("/proc/cpuinfo").exists() else []
    return " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "unknown"


def _windows(tok, n: int = 2, seq_len: int = 128) -> torch.Tensor:
    """The first n windows of seq_len tokens of the WikiText-2 validation split (no test data is needed here)."""
    from quantlab.models.data import eval_windows, load_token_ids

    ids, _ = load_token_ids("wikitext2", "validation", tok)
    return eval_windows(ids, seq_len, n)


def _weights_against_ggml(model, gguf_path: Path) -> tuple[int, int, float]:
    """(tensors compared, bitwise equal, max |diff|) between the model's parameters and quantlab's dequantization
    of the GGUF tensor each comes from (in the model's row order)."""
    cfg = model.config
    contents = read_gguf(gguf_path)
    n_head = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    compared = equal = 0
    worst = 0.0
    for hf_name, p in model.named_parameters():
        gname = names.to_gguf_name(hf_name, cfg.model_type, cfg.num_hidden_layers)
        if gname not in contents.tensors:
            continue
        ref = names.from_gguf_rows(contents.tensors[gname].floats(), gname, cfg.model_type, n_head, n_kv)
        ref = ref - names.norm_shift(gname, cfg.model_type)
        diff = float((p.detach().float() - ref.reshape(p.shape)).abs().max())
        compared += 1
        equal += diff == 0.0
        worst = max(worst, diff)
    return compared, equal, worst


def check(alias: str) -> dict:
    from transformers import AutoModelForCausalLM

    gc.collect()
    reset_peak_rss()  # this alias' peak, not an earlier one's
    t0 = time.perf_counter()
    model, tok = load_model(alias, progress=False)
    load_s = time.perf_counter() - t0
    gguf = alias_gguf_path(alias)
    compared, equal, weight_diff = _weights_against_ggml(model, gguf)
    plain = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = _windows(tok)
    with torch.no_grad():
        ours, theirs = model(ids).logits, plain(ids).logits
    info = model_info(model)
    return {
        "alias": alias, "gguf_file": gguf.name, "model_type": model.config.model_type, "params": info["params"],
        "tied_embeddings": info["tied_embeddings"], "layers": model.config.num_hidden_layers,
        "heads": model.config.num_attention_heads, "kv_heads": model.config.num_key_value_heads,
        "logits_max_abs_diff_vs_transformers_gguf": float((ours - theirs).abs().max()),
        "logit_windows": f"{ids.shape[0]}x{ids.shape[1]} wikitext2 validation",
        "weights_compared": compared, "weights_bitwise_equal": equal, "weights_max_abs_diff_vs_ggml": weight_diff,
        "load_s": round(load_s, 1), "peak_rss_gib": round(peak_rss_mib() / 1024, 2),
        "cpu": cpu_model(), "cpu_isa": cpu_isa(), "threads": torch.get_num_threads(), "machine": platform.machine(), "loadavg_1m": os.getloadavg()[0],
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("aliases", nargs="+", choices=[a for a in ALIASES if a != "minilm-l6"])
    args = parser.parse_args(argv)
    rows = []
    for alias in args.aliases:
        row = check(alias)
        print(row, flush=True)
        rows.append(row)
        old = pd.read_csv(CSV) if CSV.exists() else pd.DataFrame()
        kept = old[old["alias"] != alias] if len(old) else old
        pd.concat([kept, pd.DataFrame([row])], ignore_index=True).to_csv(CSV, index=False)  # each alias as it ends


if __name__ == "__main__":
    main()
