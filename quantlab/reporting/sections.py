"""The prose paragraphs of a report, written from its rows: Protocol (what was measured and how, including
how the speed ratios were formed), Intervals, Backend and Environment."""
from __future__ import annotations

import pandas as pd

from ..core.registry import is_baseline
from . import domains, stats

LATENCY_REF = "latency_ref_"  # + a latency column: the float model timed just before the row (runner)


def intervals_text(df: pd.DataFrame) -> str:
    if "ppl" not in df:
        return ""
    if "ppl_ci_low" not in df or df["ppl_ci_low"].isna().all():
        return ("**Intervals.** These rows carry no per-window NLL (they were recorded before quantlab stored it), "
                "so no confidence intervals are shown; rerunning the experiment with `--force` adds them.")
    n = int(df["eval_windows"].dropna().iloc[0])
    return (f"**Intervals.** 95% percentile bootstrap over the {n} evaluation windows ({stats.RESAMPLES} resamples, "
            f"seed {stats.SEED}). Δppl % intervals are paired: run and baseline are resampled on the same windows, "
            "so the difficulty they share cancels; ✓ marks an interval that excludes 0. They measure the noise of "
            "this token budget's window sample, not of calibration seeds (that is the ± std where runs repeat).")

def protocol_text(df: pd.DataFrame) -> str:
    r = df.iloc[0]
    if r.get("eval_metric") == "embedding":
        text = (
            f"**Protocol.** Embedding fidelity on {r['eval_dataset']} `{r['eval_split']}` ({r['eval_source']}): "
            f"the first {int(r['sentences'])} sentences (≥ 6 words, headings skipped), at most {int(r['max_length'])} "
            "tokens each, mean-pooled last hidden states; cosine similarity to the baseline's embedding per "
            "sentence (mean and 5th percentile). Layer rel err: ‖y − y_ref‖/‖y_ref‖ of each quantized linear's "
            "output, both models run end to end on the first 32 sentences."
        )
        if "prefill_tokens" in df and pd.notna(r.get("prefill_tokens")):
            text += (f" Latency: one forward of {int(r['prefill_tokens'])} tokens, median of "
                     f"{int(r['latency_repeats'])} repeats." + _latency_ratio_text(df))
        return text + _calibration_text(df)
    text = (
        f"**Protocol.** Perplexity on {r['eval_dataset']} `{r['eval_split']}` ({r['eval_source']}), "
        f"BOS: {r['bos']}, {int(r['eval_windows'])} non-overlapping windows of seq_len {int(r['seq_len'])} "
        f"= {int(r['eval_tokens'])} tokens ({int(r['predicted_tokens'])} predicted) "
        + ("spread evenly over the split (its first and last windows included)."
           if r.get("eval_window_order") == "spread" else "from the start of the split.")
    )
    if r.get("kl_tokens"):
        text += f" KL(baseline ‖ run) and top-1 agreement over the first {int(r['kl_tokens'])} tokens"
        text += f" (reference: {r['kl_reference']})." if isinstance(r.get("kl_reference"), str) else "."
    if isinstance(r.get("eval_dtype"), str):
        a, b, d = r["eval_dtype_float_ppl_float32"], r["eval_dtype_float_ppl"], r["eval_dtype"]
        text += (f" Perplexity and KL computed in {d} (torch.autocast; latency in float32): on these windows the "
                 f"float model's perplexity is {b:.4f} in {d} against {a:.4f} in float32 ({(b / a - 1) * 100:+.3f}%), "
                 "the shift the evaluation dtype alone makes.")
    if "prefill_tokens" in df and pd.notna(r.get("prefill_tokens")):
        text += (f" Latency: prefill {int(r['prefill_tokens'])} tokens, greedy decode {int(r['decode_tokens'])} "
                 f"tokens, batch {int(r['batch_size'])}, median of {int(r['latency_repeats'])} repeats after warm-up."
                 + _latency_ratio_text(df))
    return text + domains.protocol_text(df) + _memory_text(df) + _calibration_text(df)

def _latency_ratio_text(df: pd.DataFrame) -> str:
    """How the × speed columns were formed: paired with a float measurement per row, or against the baseline row."""
    col = "prefill_ms_p50"
    timed = df[~df["method"].map(is_baseline) & df[col].notna()] if col in df else df.iloc[:0]
    if timed.empty:
        return ""
    paired = timed[LATENCY_REF + col].notna() if LATENCY_REF + col in timed else pd.Series(False, index=timed.index)
    if paired.all():
        return (" × speed: the float model's latency measured in the same process just before the row's, over the "
                "row's, so drift of the machine between rows cancels.")
    if paired.any():
        return (" × speed: rows " + ", ".join(timed.loc[paired, "run"]) + " divide the float model's latency "
                "measured just before their own; the others divide the baseline row's, measured at its own time.")
    return (" × speed: the baseline row's latency over the row's, each measured at its own time (on a shared "
            "machine latency drifts between runs; rerunning them with `--force` pairs each with a float measurement).")

def _memory_text(df: pd.DataFrame) -> str:
    """What the memory columns measured (rows say it in memory_probe)."""
    if "memory_probe" not in df or df["memory_probe"].isna().all():
        return ""
    probes = list(dict.fromkeys(str(p) for p in df["memory_probe"].dropna()))
    return " Memory: " + "; ".join(probes) + "."

def _calibration_text(df: pd.DataFrame) -> str:
    if "calib_samples" not in df or df["calib_samples"].isna().all():
        return ""
    rows = df[df["calib_samples"].notna()]
    r = rows.iloc[0]
    text = (f" Calibration (methods that use data): {int(r['calib_samples'])} windows of {int(r['calib_seq_len'])} "
            f"tokens at seeded random offsets of {r['calib_source']} (never the test split).")
    others = rows.drop_duplicates(["calib_samples", "calib_seq_len", "calib_source"]).iloc[1:]
    for _, o in others.iterrows():  # runs with their own calibration = {...}
        names = rows.loc[(rows["calib_samples"] == o["calib_samples"]) & (rows["calib_seq_len"] == o["calib_seq_len"])
                         & (rows["calib_source"] == o["calib_source"]), "run"]
        text += (f" {', '.join(names)}: {int(o['calib_samples'])} windows of {int(o['calib_seq_len'])} tokens of "
                 f"{o['calib_source']}.")
    return text

def environment_text(df: pd.DataFrame) -> str:
    keys = ["model", "dtype", "seed", "device_name", "cpu_model", "cpu_isa", "cpu_threads", "torch", "transformers",
            "torchao", "quantlab", "python", "git_sha"]
    parts = []
    for k in (k for k in keys if k in df.columns):
        values = list(dict.fromkeys(str(v) for v in df[k] if v is not None and v == v))
        if k == "cpu_threads":
            values = [str(int(float(v))) for v in values]
        if values:
            parts.append(f"{k} " + ", ".join(f"`{v}`" for v in values))
    if "load_avg_1m_start" in df.columns and df["load_avg_1m_start"].notna().any():
        loads = pd.concat([df["load_avg_1m_start"], df["load_avg_1m_end"]]).dropna()
        parts.append(f"load average (1 min) at the runs' starts and ends {loads.min():.2f} to {loads.max():.2f}")
    return "**Environment.** " + ", ".join(parts)

def backend_text(df: pd.DataFrame) -> str:
    backends = ", ".join(f"`{b}`" for b in df["backend"].unique())
    text = (f"**Backend.** {backends}. Simulated rows hold real integer codes (weight bytes are real) "
            "but dequantize them in PyTorch each forward, so their latency is not a low-bit kernel's.")
    if df["backend"].astype(str).str.startswith("torchao").any():
        text += (" `torchao` rows were exported from the same codes to torchao kernels (`backend_kernels`); their "
                 "latency and memory are real; `export_parity_*` columns hold the kernel-vs-simulated check.")
    return text
