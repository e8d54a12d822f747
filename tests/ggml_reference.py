"""llama.cpp's own quantizer, called through the libggml-base that llama-cpp-python builds: the reference the
ported GGML types (quantlab/core/ggml) are compared with byte for byte.

ggml_quantize_chunk lives in ggml-base (ggml-quants.c), compiled without architecture flags, so its float
arithmetic is plain IEEE single precision (no fused multiply-add): the same on every CPU kind.
"""
from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest
from ci_policy import SETUP_HINT, missing


def ggml_library() -> ctypes.CDLL:
    """The libggml-base shipped in llama_cpp/lib (skipped without the llamacpp extra; under CI=true, a failure)."""
    try:
        import llama_cpp
    except ImportError:
        missing("llama-cpp-python (the llamacpp extra)", SETUP_HINT)
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (lib_dir / name).exists():
            lib = ctypes.CDLL(os.fspath(lib_dir / name))
            break
    else:
        pytest.fail(f"llama-cpp-python is installed but {lib_dir} holds no libggml-base")
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def ggml_quantize(gguf_id: int, x: np.ndarray, imp: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's quantization of x (rows, K) float32 as type gguf_id, with quant_weights imp (K,) or None
    -> (rows, K / block * type_size) uint8, the bytes a GGUF file holds."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gguf_id)]
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, k = x.shape
    assert k % block == 0, (k, block)
    out = np.zeros((rows, k // block * type_size), dtype=np.uint8)
    imp_c = None if imp is None else np.ascontiguousarray(imp, dtype=np.float32)
    assert imp_c is None or imp_c.shape == (k,), imp_c.shape
    n = ggml_library().ggml_quantize_chunk(gguf_id, x.ctypes.data, out.ctypes.data, 0, rows, k,
                                           None if imp_c is None else imp_c.ctypes.data)
    assert n == out.nbytes, (n, out.nbytes)
    return out


# llama_model_quantize's per-tensor log line: "[ i/ n] name - [shape], type = src, size = ... (new type)"
LOG_LINE = re.compile(r"\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), size =[^\n]*?(?:\((\S+)\))?\n")


def llama_model_quantize(src, ftype: str, out=None, imatrix: dict[str, np.ndarray] | None = None) -> dict[str, str]:
    """llama.cpp's own model quantizer (llama_model_quantize, allow_requantize) on the GGUF src for ftype
    ("Q4_K_M"), with imatrix {GGUF tensor name: importance (K,)} handed over as llama-quantize hands the values it
    read from an imatrix file (llama_model_imatrix_data). Returns each tensor's type: read back from `out`, or
    without `out` a dry run whose per-tensor log line names the source type and, where it changes, the new one."""
    from quantlab.core.ggml.recipes import read_gguf_header

    ggml_library()  # skips / fails without llama-cpp-python
    import llama_cpp

    log: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):
        log.append(text.decode("utf-8", errors="replace"))

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.allow_requantize = True
    params.dry_run = out is None
    keep = []  # the ctypes buffers must outlive the call
    if imatrix:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()  # zeroed last: the terminator
        for entry, (name, values) in zip(entries, imatrix.items()):
            buf = np.ascontiguousarray(values, dtype=np.float32)
            keep.append(buf)
            entry.name = name.encode()
            entry.data = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entry.size = buf.size
        params.imatrix = ctypes.cast(entries, type(params.imatrix))
        keep.append(entries)
    llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
    try:
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out or "unused.gguf").encode(), ctypes.byref(params))
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))
    assert rc == 0, "".join(log)[-2000:]
    if out is not None:
        return {name: type_name for name, (_, type_name) in read_gguf_header(out)[1].items()}
    return {name: (new or old).lower() for name, old, new in LOG_LINE.findall("".join(log))}
