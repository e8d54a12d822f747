"""`embedding = {...}`: the input embedding (and a tied head) as per-row integer codes (core/qembedding.py).

Applied after the method (and the export): methods calibrate with the float embedding, as it was.
"""
from __future__ import annotations

import contextlib

from ..core.extras import AFTER_EXPORT, RunExtra, register_extra
from ..core.qembedding import EmbeddingQuantConfig, quantize_embedding


@register_extra
class Embedding(RunExtra):
    key = "embedding"
    config_cls = EmbeddingQuantConfig
    stage = AFTER_EXPORT

    def refusal(self, config: EmbeddingQuantConfig, backend: str) -> str | None:
        return "does not export a quantized embedding (embedding = {...})" if backend in ("onnxruntime", "llama.cpp", "compressed-tensors") \
            else None

    @contextlib.contextmanager
    def apply(self, model, config: EmbeddingQuantConfig):
        yield quantize_embedding(model, config)  # codes replace the float table in the run's copy
