#!/usr/bin/env bash
# BERT-large from scratch on a multi-node cluster at large batch, seq 128 (BERT's phase 1).
#   OPT=lamb (default): LAMB, fp16, ZeRO stage 0 (LAMB's per-layer trust ratio needs whole layers:
#     DeepSpeed's BERT record ran it unpartitioned), batch 16384, lr 4e-3, 15,625 steps.
#   OPT=adamw: AdamW, batch 8192, lr 4e-4 (RoBERTa-large's), 31,250 steps; fp16 ZeRO-2, or bf16 ZeRO-1 with
#     GPU=a100|h100|h200.
# Both see BERT's 256M sequences (256 x 1M steps).
#   OUTPUT=/shared/runs/bl DATA=/shared/wiki-books HC=wordnet SR=word launch/bert_large_scratch.sh [extra flags]
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
case "${OPT:-lamb}" in
  lamb) config="$REPO/ds_configs/bert_large_v100_fp16_lamb_zero0.json"; steps=15625 ;;
  adamw) config="$(recipe bert_large)"; steps=31250 ;;
  *) echo "truneg: error: OPT=$OPT: use lamb or adamw" >&2; exit 2 ;;
esac
pretrain bert-large 128 "$config" "$steps" 1000 50 "$@"
