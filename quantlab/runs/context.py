"""The evaluation context: the float model (also the KL reference), its token windows and calibration data, loaded
once per experiment and shared by every run (runs/evaluate.py evaluates a run against it).

A quantized checkpoint as the model (compressed-tensors, GPTQ, AWQ) is imported with its codes, and measured against
the experiment's `reference` float model.
"""
from __future__ import annotations

import torch

from ..backends.ckpt_import import checkpoint_format, imported_row_fields, load_quantized_checkpoint
from ..eval import perplexity
from ..eval.embedding import mean_pooled_embeddings, sentences_from_text
from ..eval.lmeval import check_tasks
from ..models.data import (
    bos_token_id,
    calibration_windows,
    domain_label,
    eval_windows,
    load_text,
    load_token_ids,
    split_counts,
    tokenize,
)
from ..models.loading import load_model, model_info
from .experiment import Experiment


def load_models(exp: Experiment, device, cache_dir, progress: bool) -> tuple:
    """(model, tokenizer, KL reference model, source facts). A quantized checkpoint folder (compressed-tensors, GPTQ,
    AWQ) is imported with its codes (backends/ckpt_import.py) and measured against exp.reference (None: no KL),
    whose tokenizer must be the checkpoint's; any other model is loaded as it is and is its own KL reference."""
    if checkpoint_format(exp.model) is None:
        model, tokenizer = load_model(exp.model, exp.dtype, str(device), cache_dir, progress=progress)
        return model, tokenizer, model, {}
    model, tokenizer, facts = load_quantized_checkpoint(exp.model, exp.dtype, device)
    if tokenizer is None:
        raise ValueError(f"model {exp.model!r}: the checkpoint folder holds no tokenizer (save one beside it)")
    reference = None
    if exp.reference is not None:
        reference, ref_tokenizer = load_model(exp.reference, exp.dtype, str(device), cache_dir, progress=progress)
        if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"reference {exp.reference!r}: its tokenizer's vocabulary is not the one of model "
                             f"{exp.model!r}; KL and top-1 agreement compare the same tokens")
    return model, tokenizer, reference, facts


def source_fields(ctx: EvalContext) -> dict:
    """An imported checkpoint's row fields: where it came from, what ran, its grid where one scheme covers it."""
    if not ctx.source:
        return {}
    return {**imported_row_fields(ctx.source, ctx.model), "backend": "simulated (PyTorch dequant on the fly)",
            "reference_model": ctx.exp.reference}


class EvalContext:
    """The float model (also the KL reference), token windows and calibration data, shared across runs. A quantized
    checkpoint as the model is imported (load_models): kl_model is then exp.reference's float model (or None)."""

    def __init__(self, exp: Experiment, device, data_dir, cache_dir, progress: bool):
        self.exp, self.device, self.data_dir, self.cache_dir, self.progress = exp, device, data_dir, cache_dir, progress
        # lm-eval tasks are built (their data sets loaded) before the model: a task the hub must serve fails here
        self.lm_eval_tasks = check_tasks(list(exp.eval.lm_eval_tasks), data_dir) if exp.eval.lm_eval_tasks else None
        self.model, self.tokenizer, self.kl_model, self.source = load_models(exp, device, cache_dir, progress)
        self.max_positions = model_info(self.model)["max_positions"]
        self.bos_id = bos_token_id(self.tokenizer, exp.eval.bos)  # None, or the token every window starts with
        length = exp.eval.seq_len if exp.eval.metric == "perplexity" else exp.eval.max_length
        self._check_length("eval", length)
        e = exp.eval
        if e.metric == "embedding":
            text, self.eval_source = load_text(e.dataset, e.split, data_dir)
            self.sentences = sentences_from_text(text, e.num_sentences)
            self.eval_ids = tokenize(" ".join(self.sentences), self.tokenizer, cache_dir)
            self.reference = mean_pooled_embeddings(self.model, self.tokenizer, self.sentences, e.max_length,
                                                    progress=progress)
            self.error_batch = self.tokenizer(self.sentences[:32], padding=True, truncation=True,
                                              max_length=e.max_length, return_tensors="pt")
        else:
            self.eval_ids, self.eval_source = load_token_ids(e.dataset, e.split, self.tokenizer, data_dir, cache_dir)
            self.windows = eval_windows(self.eval_ids, e.seq_len, e.max_windows, e.max_tokens, self.bos_id, e.windows)
            # KL reference: ctx.model runs on each KL window right before the evaluated model (perplexity());
            # nothing is stored, so memory does not grow with kl_windows (stored log-probs: T x V x 4 B each)
            self.kl_windows = min(e.kl_windows, len(self.windows)) if self.kl_model is not None else 0
            # [eval] datasets: {label: (windows, source)} of every domain, the main one (above) first
            self.domains = {}
            for d in e.datasets or ():
                ids, source = (self.eval_ids, self.eval_source) if d == e.dataset else load_token_ids(
                    d, e.split, self.tokenizer, data_dir, cache_dir)
                windows = self.windows if d == e.dataset else eval_windows(ids, e.seq_len, e.max_windows, e.max_tokens,
                                                                           self.bos_id, e.windows)
                self.domains[domain_label(d)] = (windows, source)
        self._reference_state = self._model_state()
        self._calib, self._calib_ids, self.calib_sources = {}, {}, {}
        self._dtype_shift = None

    @property
    def eval_dtype(self) -> str | None:
        """[eval] dtype for perplexity(): None for float32 (the model's own dtype)."""
        return None if self.exp.eval.dtype == "float32" else self.exp.eval.dtype

    def eval_dtype_fields(self) -> dict:
        """[eval] dtype other than float32: the float model's perplexity on the main windows in float32 and in that
        dtype, measured once per experiment, so every row states what the evaluation dtype alone moves."""
        if self.eval_dtype is None:
            return {}
        if self._dtype_shift is None:
            model = self.kl_model if self.kl_model is not None else self.model
            fp32 = perplexity(model, self.windows, progress=self.progress)["ppl"]
            low = perplexity(model, self.windows, progress=self.progress, dtype=self.eval_dtype)["ppl"]
            self._dtype_shift = {"eval_dtype": self.eval_dtype, "eval_dtype_float_ppl_float32": fp32,
                                 "eval_dtype_float_ppl": low}
        return self._dtype_shift

    def _model_state(self) -> tuple:
        """In-place changes bump a tensor's version: the float model (the KL reference) must stay as loaded."""
        return self.model.training, tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def check_reference(self) -> None:
        if self._model_state() != self._reference_state:
            raise RuntimeError("the float model (KL reference, baseline) was modified in place by this or an "
                               "earlier run; runs must quantize a copy")

    def _check_length(self, what: str, length: int) -> None:
        if self.max_positions and length > self.max_positions:
            raise ValueError(f"{what} length {length} exceeds the model's max positions ({self.max_positions})")

    def calibration(self, seed: int | None = None, protocol=None) -> torch.Tensor:
        """Calibration windows of `protocol` (default: the experiment's) drawn with `seed` (default: the
        experiment's), cached per (protocol, seed). Several datasets: each gives its share of num_samples
        (split_counts by `mix`), drawn with the same seed from its own text, concatenated in the listed order."""
        seed = self.exp.seed if seed is None else seed
        c = protocol or self.exp.calibration
        if (c, seed) not in self._calib:
            self._check_length("calibration.seq_len", c.seq_len)
            counts = split_counts(c.num_samples, c.mix or [1] * len(c.domains()))
            parts, sources = [], []
            for d, n in zip(c.domains(), counts):
                if (d, c.split) not in self._calib_ids:
                    self._calib_ids[d, c.split] = load_token_ids(d, c.split, self.tokenizer, self.data_dir,
                                                                 self.cache_dir)
                ids, source = self._calib_ids[d, c.split]
                parts.append(calibration_windows(ids, n, c.seq_len, seed, self.bos_id))
                sources.append(source if c.datasets is None else f"{domain_label(d)} ({n} windows): {source}")
            self._calib[c, seed] = torch.cat(parts)
            self.calib_sources[c] = "; ".join(sources)
        return self._calib[c, seed]
