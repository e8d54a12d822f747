#!/usr/bin/env bash
# Peers' own checkpoints of SmolLM2-135M (issue 30): build the venvs, export quantlab's calibration windows, run
# each peer one at a time, record each checkpoint in experiments/referee/checkpoints.csv.
#
#   bash experiments/referee/run_peers.sh                                  # every run in RUNS, in that order
#   bash experiments/referee/run_peers.sh llmcompressor-gptq-w4a16-g64     # some of them
#
# Checkpoints go to $REFEREE_DIR/<peer>-<recipe>/ (default ~/.cache/quantlab/referee, outside git), each peer's
# output to $REFEREE_DIR/logs/<peer>-<recipe>.log. Idempotent: a finished checkpoint (a peer script renames its
# folder into place only once it is complete) is skipped and only recorded again; build_venvs.sh skips complete
# venvs; the windows are exported once per $REFEREE_DIR.
# Environment: REFEREE_MODEL (default smollm2-135m), REFEREE_EXPERIMENT (the calibration protocol's file, default
# experiments/smollm2_ptq.toml: 32 validation windows of 512 tokens, seed 0), REFEREE_THREADS (torch threads of
# each peer; default torch's), REFEREE_CSV (default experiments/referee/checkpoints.csv), QUANTLAB_PYTHON
# (quantlab's python, default python3). Another model or protocol: give it its own REFEREE_DIR and REFEREE_CSV.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/referee
PY=${QUANTLAB_PYTHON:-python3}
MODEL=${REFEREE_MODEL:-smollm2-135m}
OUT=${REFEREE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/quantlab/referee}
VENVS=${XDG_CACHE_HOME:-$HOME/.cache}/quantlab/venvs
WINDOWS=$OUT/windows
# cheapest first (on 2 cores: GPTQ and RTN minutes; llm-compressor's AWQ ~10 min each on a Xeon with AMX, about 3 min
# a decoder layer by the issue's measurement on an AVX2 EPYC; auto-round ~1.5 h there, its 50-iteration light recipe
# about a quarter of that)
RUNS=(llmcompressor-rtn-w4a16-g64 llmcompressor-gptq-w4a16-g64 llmcompressor-sq0.5-rtn-w8a8
      llmcompressor-sq0.8-gptq-w8a8 llmcompressor-sq0.5-gptq-w8a8 autoround-w4a16-g64-light
      llmcompressor-awq-w4a16-g64-noduo llmcompressor-awq-w4a16-g64 autoround-w4a16-g64)
THREADS=(); [[ -n "${REFEREE_THREADS:-}" ]] && THREADS=(--threads "$REFEREE_THREADS")
CSV=${REFEREE_CSV:-$HERE/checkpoints.csv}

peer_command() {  # CMD := the command that builds checkpoint $1 (its --windows and --out follow)
  case $1 in
    llmcompressor-*) CMD=("$VENVS/llmcompressor-0.14.0/bin/python" "$HERE/peer_llmcompressor.py"
                          --recipe "${1#llmcompressor-}") ;;
    autoround-*) CMD=("$VENVS/auto-round-0.16.1/bin/python" "$HERE/peer_autoround.py" --recipe "${1#autoround-}") ;;
    *) echo "run_peers: unknown run '$1'; known: ${RUNS[*]}" >&2; return 2 ;;
  esac
}

for name in "${@:-${RUNS[@]}}"; do peer_command "$name"; done  # every name is known before anything runs
bash "$HERE/build_venvs.sh"
if [[ ! -f "$WINDOWS/windows.json" ]]; then
  PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/export_windows.py" --out "$WINDOWS" --model "$MODEL" \
    --experiment "${REFEREE_EXPERIMENT:-experiments/smollm2_ptq.toml}"
fi
mkdir -p "$OUT/logs"
start_all=$SECONDS
for name in "${@:-${RUNS[@]}}"; do
  ckpt=$OUT/$name
  if [[ -f "$ckpt/referee_settings.json" ]]; then
    echo "run_peers: $name finished earlier ($ckpt), skipped"
  else
    echo "run_peers: $name -> $ckpt (log: $OUT/logs/$name.log)"
    start=$SECONDS
    peer_command "$name"
    "${CMD[@]}" --windows "$WINDOWS" --out "$ckpt" "${THREADS[@]}" > "$OUT/logs/$name.log" 2>&1 || {
      echo "run_peers: $name failed after $(( SECONDS - start )) s; the end of its log:" >&2
      tail -n 20 "$OUT/logs/$name.log" >&2
      exit 1
    }
    echo "run_peers: $name done in $(( SECONDS - start )) s"
  fi
  "$PY" "$HERE/checkpoints_csv.py" --csv "$CSV" "$ckpt"
done
echo "run_peers: all done in $(( SECONDS - start_all )) s; rows in $CSV"
