#!/usr/bin/env bash
# The paper's ELECTRA-small, from scratch on one 8-GPU node
# (HOSTFILE=local; the default is launch/hosts): seq 128, batch 128, lr 5e-4, 1M steps.
#   OUTPUT=/shared/runs/es DATA=/shared/openwebtext HC=wordnet SR=word launch/electra_small.sh [extra flags]
[ -f "$(dirname "$0")/common.sh" ] || { echo "truneg: error: $0 has no common.sh beside it: run the script where it lies in the repo (sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')" >&2; exit 2; }
source "$(dirname "$0")/common.sh"
config="$(recipe electra_small)"
pretrain electra-small 128 "$config" 1000000 10000 100 "$@"
