#!/usr/bin/env bash
# The language-model experiment of docs/experiments.md (the shape of the paper's §5.1 at CPU scale):
# six models trained with one equal budget (same steps, same tokens, same data order), then evaluated with
# sliding windows at 1x-16x the training length, plus the positional-LSH sweep of the ALiBi-trained model.
#
#   benchmarks/lm_experiment.sh train      # the six models, one after another (about 15 min each, quiet 2-core CPU)
#   benchmarks/lm_experiment.sh eval       # extrapolation table + sweep, CSV and PNG plots
#   benchmarks/lm_experiment.sh all
#
# `python -m positional_lsh.cli train` / `python -m positional_lsh.cli eval` are `plsh train` / `plsh eval`.
# Logs go to runs/lm/*.log. Set NICE="" to run at normal priority, OUT=... for another run directory.
# GPU / paper scale: see docs/experiments.md ("The same commands at the paper's scale").
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs/lm}
NICE=${NICE-nice -n 15}
PYTHON=${PYTHON:-python}
export PLSH_CACHE_DIR=${PLSH_CACHE_DIR:-runs/cache}
mkdir -p "$OUT"

# One budget for every model: 800 steps x 16 windows x 256 tokens = 3,276,800 training tokens (1.2 epochs).
COMMON=(--seq-len 256 --n-layer 4 --n-head 8 --d-model 256 --vocab-size 8192
        --steps 800 --batch-size 16 --lr 1.5e-3 --min-lr 1e-4 --warmup 80 --weight-decay 0.1 --grad-clip 1.0
        --eval-interval 100 --eval-batches 16 --ckpt-interval 100 --seed 0 --save-dtype float16 --no-progress)

train_one() {  # name, then model flags
    local name=$1; shift
    if [[ -f "$OUT/$name/trainer_state.pt" ]] && grep -q '"finished": true' "$OUT/$name/config.json"; then
        echo "== $name: already trained"; return
    fi
    local resume=()
    [[ -f "$OUT/$name/trainer_state.pt" ]] && resume=(--resume)
    echo "== training $name ($(date +%T))"
    $NICE "$PYTHON" -m positional_lsh.cli train --out "$OUT/$name" "${COMMON[@]}" "$@" "${resume[@]}" >> "$OUT/$name.log" 2>&1
    tail -n 2 "$OUT/$name.log"
}

train_all() {
    train_one alibi --position alibi
    train_one plsh-t1 --position plsh --num-samples 1
    train_one plsh-t4 --position plsh --num-samples 4
    train_one plsh-fixed --position plsh --num-samples 1 --scheme fixed
    train_one rope --position rope
    train_one nope --position nope
}

eval_all() {
    local models=(alibi plsh-t1 plsh-t4 plsh-fixed rope nope)
    # 1. Length extrapolation: every model with its own attention (and, for the positional-LSH-trained models,
    #    exact ALiBi) at 1x-16x the training length; sliding windows with stride = the training length (256);
    #    the first 16,384 test tokens.
    $NICE "$PYTHON" -m positional_lsh.cli eval "${models[@]/#/$OUT/}" \
        --factors 1,2,4,8,16 --max-tokens 16384 --samples none --out "$OUT/eval-extrapolation" --no-progress \
        > "$OUT/eval-extrapolation.log" 2>&1
    # 2. The ALiBi-trained model with positional-LSH attention: T = 1, 4, 16, 64 x 3 schemes, and windowed ALiBi
    #    at equal cost, at 1x, 4x and 16x; disjoint windows over the first 8,192 test tokens.
    $NICE "$PYTHON" -m positional_lsh.cli eval "$OUT/alibi" --factors 1,4,16 --stride window --max-tokens 8192 \
        --samples 1,4,16,64 --schemes discrete,gamma,fixed --out "$OUT/eval-sweep-alibi" --no-progress \
        > "$OUT/eval-sweep-alibi.log" 2>&1
    # 3. The positional-LSH-trained models at other inference T (discrete scheme), 1x and 4x.
    $NICE "$PYTHON" -m positional_lsh.cli eval "$OUT/plsh-t1" "$OUT/plsh-t4" --factors 1,4 --stride window \
        --max-tokens 8192 --samples 1,4,16,64 --schemes discrete --out "$OUT/eval-sweep-plsh" --no-progress \
        > "$OUT/eval-sweep-plsh.log" 2>&1
}

case "${1:-all}" in
    train) train_all ;;
    eval) eval_all ;;
    all) train_all; eval_all ;;
    *) echo "usage: $0 [train|eval|all]"; exit 2 ;;
esac
