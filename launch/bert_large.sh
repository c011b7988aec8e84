#!/usr/bin/env bash
# The paper's bert-large, continued from public weights on one 8-GPU node
# (HOSTFILE=local; the default is launch/hosts): seq 512, batch 128, lr 5e-5,
# 200k steps.
#   OUTPUT=/shared/runs/bert_large INIT=/shared/ckpt/bert-large DATA=/shared/wiki-books HC=wordnet launch/bert_large.sh [extra flags]
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
continued bert-large bert_large_continued "an HF BERT-large checkpoint: a folder, or a hub name (bert-large-uncased)" "$@"
