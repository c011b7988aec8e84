#!/usr/bin/env bash
# ELECTRA-base pre-training on V100 nodes: fp16, ZeRO-2, Adam, the paper's batch 256 and 766k steps.
#   DATA=/shared/corpus OUT=/shared/runs/electra-base HC=wordnet SR=word launch/electra_base.sh [extra flags]
# On A100/H100: CONFIG=ds_configs/electra_base_a100_bf16_zero3.json launch/electra_base.sh
source "$(dirname "$0")/common.sh"
launch --model electra-base --seq-len 512 \
  --deepspeed_config "${CONFIG:-$REPO/ds_configs/electra_base_v100_fp16_zero2.json}" \
  --train-data "${DATA:?set DATA to the corpus (files, folder or glob)}" \
  --output-dir "${OUT:-$REPO/runs/electra-base}" --max-steps "${STEPS:-766000}" \
  --save-steps 5000 --log-steps 100 --hc "${HC:-none}" --sr "${SR:-none}" "$@"
