#!/usr/bin/env bash
# The paper's bert-base, continued from public weights on one 8-GPU node
# (HOSTFILE=local; the default is launch/hosts): seq 512, batch 128, lr 5e-5,
# 200k steps.
#   OUTPUT=/shared/runs/bert_base INIT=/shared/ckpt/bert-base DATA=/shared/wiki-books HC=wordnet launch/bert_base.sh [extra flags]
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
continued bert-base bert_base_continued "an HF BERT-base checkpoint: a folder, or a hub name (bert-base-uncased)" "$@"
