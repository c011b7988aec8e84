#!/usr/bin/env bash
# The paper's ELECTRA-small, from scratch on one 8-GPU node
# (HOSTFILE=local; the default is launch/hosts): seq 128, batch 128, lr 5e-4, 1M steps.
#   OUTPUT=/shared/runs/es DATA=/shared/openwebtext HC=wordnet SR=word launch/electra_small.sh [extra flags]
source "$(dirname "$0")/common.sh"
pretrain electra-small 128 "$(recipe electra_small)" 1000000 10000 100 "$@"
