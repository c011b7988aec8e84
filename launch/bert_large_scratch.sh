#!/usr/bin/env bash
# BERT-large from scratch on a multi-node cluster at large batch, in BERT's two phases: seq 128 (phase 1), then
# seq 512 from phase 1's last checkpoint (phase 2: weights and optimizer moments carried, a fresh warm-up;
# docs/pretraining.md#two-phases).
#   OPT=lamb (default): LAMB, fp16, ZeRO stage 0 (LAMB's per-layer trust ratio needs whole layers:
#     DeepSpeed's BERT record ran it unpartitioned), batch 16384, lr 4e-3: phase 1 15,625 steps, phase 2 1,736.
#   OPT=adamw: AdamW, batch 8192, lr 4e-4 (RoBERTa-large's): phase 1 31,250 steps, phase 2 3,472; fp16 ZeRO-2, or
#     bf16 ZeRO-1 with GPU=a100|h100|h200.
# Phase 1 sees BERT's 256M sequences (256 x 1M); phase 2 a ninth of phase 1's steps, BERT's 900k : 100k.
#   PHASE=1 (default) | 2 | all: phase 1, phase 2, or phase 1 then phase 2 (phase 2 starts only once phase 1 has
#     saved its last step; the same command again resumes phase 1, or skips it when finished).
#   Phase 1: OUTPUT (its folder), DATA (its corpus, at seq 128), STEPS, CONFIG, KEEP.
#   Phase 2: OUTPUT2 (its own folder: phase 1's is only read), DATA2 (its corpus, at seq 512), STEPS2, CONFIG2,
#     KEEP2. Extra flags go to both phases (steps: STEPS and STEPS2, which PHASE=all's check of phase 1's end reads).
#   OUTPUT=/shared/runs/bl DATA=/shared/wiki-128 OUTPUT2=/shared/runs/bl-512 DATA2=/shared/wiki-512 PHASE=all \
#     HC=wordnet SR=word launch/bert_large_scratch.sh [extra flags]
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
PHASE="${PHASE:-1}"
case "$PHASE" in
  1) ;;
  2|all)
    if [ -z "${OUTPUT2:-}" ] || [ -z "${DATA2:-}" ]; then
      echo "truneg: error: PHASE=$PHASE needs OUTPUT2 (phase 2's own folder) and DATA2 (its corpus, at seq 512)" >&2
      exit 2
    fi
    mkdir -p "$OUTPUT2"
    OUTPUT2="$(cd "$OUTPUT2" && pwd)"
    if [ "$PHASE" = 2 ]; then RUN_DIR="$OUTPUT2"; fi ;;  # its env file: phase 1's folder is not written
  *) echo "truneg: error: PHASE=$PHASE: use 1, 2 or all" >&2; exit 2 ;;
esac
source "$(dirname "$0")/common.sh"
case "${OPT:-lamb}" in
  lamb) config="$REPO/ds_configs/bert_large_v100_fp16_lamb_zero0.json"; steps=15625
        config2="$REPO/ds_configs/bert_large_seq512_v100_fp16_lamb_zero0.json"; steps2=1736 ;;
  adamw) config="$(recipe bert_large)"; steps=31250; config2="$(recipe bert_large_seq512)"; steps2=3472 ;;
  *) echo "truneg: error: OPT=$OPT: use lamb or adamw" >&2; exit 2 ;;
esac
phase1=(bert-large 128 "$config" "$steps" 1000 50 "$@")
if [ "$PHASE" = 1 ]; then pretrain "${phase1[@]}"; fi
# Phase 2: its own folder, corpus, steps, config and kept checkpoints; phase 1's checkpoints (the tag its run.json
# records once started, so phase 1's `latest` moving later changes nothing)
first="$OUTPUT/checkpoints"
OUTPUT="$OUTPUT2" DATA="$DATA2" STEPS="${STEPS2:-$steps2}" CONFIG="${CONFIG2:-}" KEEP="${KEEP2:-}" \
  recipe_flags bert-large 512 "$config2" "$steps2" 500 50 "$@" --phase1-checkpoint "$first"
phase2=("${flags[@]}")
if [ "$PHASE" = all ]; then
  preflight "${phase2[@]}"  # phase 2's corpus, config and folder, before phase 1 spends its hours
  last="global_step${STEPS:-$steps}"
  if [ "$(cat "$first/latest" 2>/dev/null)" != "$last" ]; then
    WAIT=1 pretrain "${phase1[@]}" || exit  # a failed or signal-stopped phase 1: its status, no phase 2
    if [ "$(cat "$first/latest" 2>/dev/null)" != "$last" ]; then
      echo "truneg: error: phase 1 stopped before its last step ($last); run the same command to resume it" >&2
      exit 1
    fi
  fi
fi
launch "${phase2[@]}"
