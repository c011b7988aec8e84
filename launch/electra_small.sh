#!/usr/bin/env bash
# The paper's ELECTRA-small, from scratch on one 8-GPU node: seq 128, batch 128, lr 5e-4, 1M steps.
#   OUTPUT=/shared/runs/es DATA=/shared/openwebtext HC=wordnet SR=word launch/electra_small.sh [extra flags]
source "$(dirname "$0")/common.sh"
launch --model electra-small --seq-len 128 \
  --deepspeed_config "${CONFIG:-$(recipe electra_small)}" \
  --train-data "${DATA:?set DATA to the corpus (files, folder or glob)}" \
  --output-dir "$OUTPUT" --max-steps "${STEPS:-1000000}" --save-steps 10000 --keep-checkpoints "${KEEP:-3}" \
  --log-steps 100 --hc "${HC:-none}" --sr "${SR:-none}" "$@"
