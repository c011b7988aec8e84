#!/usr/bin/env bash
# The paper's electra-base, continued from public weights on one 8-GPU node: seq 512, batch 128, lr 5e-5,
# 200k steps.
#   OUTPUT=/shared/runs/electra_base INIT=/shared/ckpt/electra-base DATA=/shared/wiki-books HC=wordnet launch/electra_base.sh [extra flags]
source "$(dirname "$0")/common.sh"
launch --model electra-base --seq-len 512 \
  --init-from "${INIT:?set INIT to an HF ELECTRA-base checkpoint: a folder with generator/ and discriminator/}" \
  --deepspeed_config "${CONFIG:-$(recipe electra_base_continued)}" \
  --train-data "${DATA:?set DATA to the corpus (files, folder or glob)}" \
  --output-dir "$OUTPUT" --max-steps "${STEPS:-200000}" --save-steps 5000 --keep-checkpoints "${KEEP:-3}" \
  --log-steps 100 --hc "${HC:-none}" --sr "${SR:-none}" "$@"
