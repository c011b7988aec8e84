#!/usr/bin/env bash
# BERT-large phase-1 pre-training (seq 128) on V100 nodes: fp16, ZeRO-2, LAMB.
#   DATA=/shared/corpus OUT=/shared/runs/bert-large HC=wordnet SR=word launch/bert_large.sh [extra flags]
# On A100/H100: CONFIG=ds_configs/bert_large_a100_bf16_zero3.json launch/bert_large.sh
source "$(dirname "$0")/common.sh"
launch --model bert-large --seq-len 128 \
  --deepspeed_config "${CONFIG:-$REPO/ds_configs/bert_large_v100_fp16_zero2.json}" \
  --train-data "${DATA:?set DATA to the corpus (files, folder or glob)}" \
  --output-dir "${OUT:-$REPO/runs/bert-large}" --max-steps "${STEPS:-100000}" \
  --save-steps 2000 --log-steps 50 --hc "${HC:-none}" --sr "${SR:-none}" "$@"
