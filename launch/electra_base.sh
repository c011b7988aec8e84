#!/usr/bin/env bash
# The paper's electra-base, continued from public weights on one 8-GPU node
# (HOSTFILE=local; the default is launch/hosts): seq 512, batch 128, lr 5e-5,
# 200k steps.
#   OUTPUT=/shared/runs/electra_base INIT=/shared/ckpt/electra-base DATA=/shared/wiki-books HC=wordnet launch/electra_base.sh [extra flags]
#   OUTPUT=... INIT=google/electra-base-discriminator INIT_GENERATOR=google/electra-base-generator DATA=... launch/electra_base.sh
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
continued electra-base electra_base_continued \
  "an HF ELECTRA-base checkpoint: a folder with generator/ and discriminator/, or the discriminator (a folder or a hub name: google/electra-base-discriminator) with INIT_GENERATOR=google/electra-base-generator" "$@"
