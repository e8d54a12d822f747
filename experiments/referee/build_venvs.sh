#!/usr/bin/env bash
# Build one virtual environment per peer tool (issue 30): their pins conflict with quantlab's own
# (llm-compressor 0.14.0: transformers<=5.17, compressed-tensors==0.19.0, auto-round<=0.15.1, accelerate==1.15.0;
# quantlab: transformers 5.25, compressed-tensors 0.20.0), so each peer runs in its own venv.
#
#   bash experiments/referee/build_venvs.sh              # both venvs (skips a complete one)
#   bash experiments/referee/build_venvs.sh auto-round-0.16.1
#
# Each venv: python3 -m venv; torch==$TORCH first (this machine's index resolves it to the CPU wheel, as
# scripts/setup.sh relies on), then the peer, with torch==$TORCH repeated so no resolution can swap the build.
# A venv is complete when its marker file (.referee-complete) holds the exact spec it was built from; a venv
# without it (an interrupted build) or with another spec is rebuilt from scratch. `pip freeze` of each venv is
# written to experiments/referee/venvs/<name>.txt under a "# built from: <spec>" line; a rebuild of the same spec
# installs under that file as pip constraints (torch left out: the CPU build's +cpu label is this index's), so it
# gets the recorded versions (a changed spec resolves afresh).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY=${PYTHON:-python3}
TORCH=${QUANTLAB_TORCH:-2.13.0}
VENVS="${XDG_CACHE_HOME:-$HOME/.cache}/quantlab/venvs"
mkdir -p "$VENVS" "$HERE/venvs"

# name -> the peer's requirements (beside torch). Why each pin: experiments/referee/README.md.
declare -A SPECS=(
  [llmcompressor-0.14.0]="llmcompressor==0.14.0"
  [auto-round-0.16.1]="auto-round==0.16.1 transformers==5.25.0 compressed-tensors==0.20.0"
)
ORDER=(llmcompressor-0.14.0 auto-round-0.16.1)

build() {
  local name=$1 spec="torch==$TORCH ${SPECS[$1]}"
  local venv="$VENVS/$name" marker="$VENVS/$name/.referee-complete" freeze="$HERE/venvs/$name.txt"
  if [[ -f "$marker" && "$(cat "$marker")" == "$spec" ]]; then
    echo "build_venvs: $name complete ($venv), skipped"
    return
  fi
  echo "build_venvs: building $name: $spec"
  local start=$SECONDS constraints=()
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  if [[ -f "$freeze" && "$(head -n 1 "$freeze")" == "# built from: $spec" ]]; then  # the same spec as recorded
    grep -v -i '^torch==' "$freeze" > "$venv/referee-constraints.txt"
    constraints=(-c "$venv/referee-constraints.txt")
  fi
  "$venv/bin/python" -m pip install --quiet "torch==$TORCH"
  # shellcheck disable=SC2086  # the spec is a list of requirements
  "$venv/bin/python" -m pip install --quiet "${constraints[@]}" $spec
  "$venv/bin/python" - <<'EOF'
import torch
assert torch.version.cuda is None, f"venv has a CUDA torch ({torch.__version__}); expected the CPU build"
print(f"build_venvs: torch {torch.__version__} (CPU build)")
EOF
  { echo "# built from: $spec"; "$venv/bin/python" -m pip freeze --all | grep -v -E '^(pip|setuptools|wheel)=='; } \
    > "$freeze"
  echo "$spec" > "$marker"
  echo "build_venvs: $name built in $(( SECONDS - start )) s; versions in experiments/referee/venvs/$name.txt"
}

for name in "${@:-${ORDER[@]}}"; do
  if [[ -z "${SPECS[$name]+x}" ]]; then
    echo "build_venvs: unknown venv '$name'; known: ${ORDER[*]}" >&2
    exit 2
  fi
  build "$name"
done
