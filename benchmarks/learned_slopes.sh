#!/usr/bin/env bash
# The learned-slopes experiment of docs/experiments.md ("Learned slopes"): exact ALiBi and positional LSH
# (T = 4 and T = 16 per training step) trained with fixed and with learned slopes on one equal budget, plus a
# seed yardstick (exact ALiBi, fixed and learned, trained again with seed 1); then evaluated at 1x-16x the
# training length, and the learned slopes per layer and head plotted.
#
#   benchmarks/learned_slopes.sh train     # eight models, one after another (~5 min each on a busy 2-core CPU)
#   benchmarks/learned_slopes.sh eval      # extrapolation table, slopes.csv, figures
#   benchmarks/learned_slopes.sh all
#
# Logs go to $OUT/*.log (default runs/slopes). Set NICE="" to run at normal priority.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/slopes}
NICE=${NICE-nice -n 5}
export PLSH_CACHE_DIR=${PLSH_CACHE_DIR:-runs/cache}
mkdir -p "$OUT"

# One budget for every model: 600 steps x 16 windows x 256 tokens = 2,457,600 training tokens.
COMMON=(--vocab-size 2048 --n-layer 2 --n-head 8 --d-model 128 --seq-len 256 --batch-size 16 --steps 600
        --warmup 60 --lr 2e-3 --min-lr 2e-4 --eval-interval 200 --eval-batches 8 --threads 1 --no-progress)

MODELS=(alibi-fixed alibi-learned plsh-t4-fixed plsh-t4-learned plsh-t16-fixed plsh-t16-learned
        alibi-fixed-seed1 alibi-learned-seed1)

flags_of() {
    case $1 in
        alibi-fixed) echo "--position alibi" ;;
        alibi-learned) echo "--position alibi --learn-slopes" ;;
        plsh-t4-fixed) echo "--position plsh --num-samples 4" ;;
        plsh-t4-learned) echo "--position plsh --num-samples 4 --learn-slopes" ;;
        plsh-t16-fixed) echo "--position plsh --num-samples 16" ;;
        plsh-t16-learned) echo "--position plsh --num-samples 16 --learn-slopes" ;;
        alibi-fixed-seed1) echo "--position alibi --seed 1" ;;
        alibi-learned-seed1) echo "--position alibi --learn-slopes --seed 1" ;;
    esac
}

train() {
    for m in "${MODELS[@]}"; do
        # shellcheck disable=SC2046
        $NICE plsh train --out "$OUT/$m" "${COMMON[@]}" $(flags_of "$m") > "$OUT/$m.log" 2>&1
    done
}

evaluate() {
    local dirs=()
    for m in "${MODELS[@]}"; do dirs+=("$OUT/$m"); done
    $NICE plsh eval "${dirs[@]}" --factors 1,4,8,16 --samples none --no-equal-cost --max-tokens 8192 \
        --threads 1 --no-progress --out "$OUT/eval" > "$OUT/eval.log" 2>&1
    python benchmarks/learned_slopes_report.py --runs "$OUT" --figures docs/figures
}

case ${1:-all} in
    train) train ;;
    eval) evaluate ;;
    all) train; evaluate ;;
    *) echo "usage: $0 [train|eval|all]" >&2; exit 2 ;;
esac
