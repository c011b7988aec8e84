#!/usr/bin/env bash
# The paper's bert-large, continued from public weights on one 8-GPU node: seq 512, batch 128, lr 5e-5,
# 200k steps.
#   OUTPUT=/shared/runs/bert_large INIT=/shared/ckpt/bert-large DATA=/shared/wiki-books HC=wordnet launch/bert_large.sh [extra flags]
source "$(dirname "$0")/common.sh"
launch --model bert-large --seq-len 512 \
  --init-from "${INIT:?set INIT to an HF BERT-large checkpoint folder (e.g. bert-large-uncased)}" \
  --deepspeed_config "${CONFIG:-$(recipe bert_large_continued)}" \
  --train-data "${DATA:?set DATA to the corpus (files, folder or glob)}" \
  --output-dir "$OUTPUT" --max-steps "${STEPS:-200000}" --save-steps 5000 --keep-checkpoints "${KEEP:-3}" \
  --log-steps 100 --hc "${HC:-none}" --sr "${SR:-none}" "$@"
