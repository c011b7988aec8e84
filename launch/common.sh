# Sourced by the launch scripts: check the hostfile, write the run's env file for the other nodes, check
# the run (`truneg preflight`), then hand over to the deepspeed launcher.
#
# Multi-node runs go over pdsh (DeepSpeed's default launcher; it has no ssh fallback;
# LAUNCHER_ARGS="--launcher openmpi" and the like choose another): every node needs this repo and its venv at
# the same path (the venv's bin goes first on each node's PATH, through the env file), passwordless ssh from
# the launching node, and OUTPUT and the data on storage every node sees (only rank 0 writes `latest` and the
# run record: a node-local OUTPUT makes the nodes disagree on where to resume). DeepSpeed forwards only some
# variables (PYTHON*, UCX_*; NCCL_* only from a node with a GPU) to the other nodes; the rest, and this
# shell's NCCL_*, CUDA_HOME, MASTER_ADDR/PORT (the MPI and Slurm runners set none) and PATH, go in
# $OUTPUT/deepspeed_env, which DS_ENV_FILE names (see truneg/cluster/env_file.py).
#
#   OUTPUT    the run's folder (required; shared storage)
#   GPU       v100 (default: fp16, the paper's machines) | a100 | h100 | h200 (bf16)
#   HOSTFILE  default launch/hosts; `local`: this machine's GPUs only, no hostfile, no ssh
#   CONFIG    a config instead of the recipe's;  PREFLIGHT=0 skips the check;  LAUNCHER_ARGS  for deepspeed
#   DATA      the corpus: a prepared folder (`truneg prepare`), or files, a folder or a glob
#   HC, SR    the objectives (default none);  STEPS, KEEP  steps and checkpoints kept
#   INIT      the continued recipes' checkpoint: a folder or an HF hub name (ORG/NAME[@REVISION], passed unchanged);
#             INIT_GENERATOR beside it for ELECTRA's public pair (INIT the discriminator)
#   COMPILE=1 adds --compile (per-layer torch.compile; off by default: no GPU has measured it faster, and the
#   whole-model compile measured 0.92-0.96x on an H200, docs/performance.md)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$REPO/launch/hosts}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
DEEPSPEED="${DEEPSPEED:-$REPO/.venv/bin/deepspeed}"
GPU="${GPU:-v100}"
GPU_ARCH="$("$PYTHON" -m truneg.train.config.ds_config arch "$GPU")" || exit 2  # sm70 for v100, ...; one line for another name
# Arrays below expand as ${a[@]+"${a[@]}"}: bash before 4.4 calls an empty "${a[@]}" unbound under set -u.
# LAUNCHER_ARGS split as a shell splits it, so a quoted value stays one word (--launcher_args "--mca
# btl_tcp_if_include ib0"); Python's shlex re-quotes each word, so nothing in it runs or expands here.
launcher_args=()
if [ -n "${LAUNCHER_ARGS:-}" ]; then
  quoted="$("$PYTHON" -c 'import shlex, sys; print(" ".join(map(shlex.quote, shlex.split(sys.argv[1]))))' \
    "$LAUNCHER_ARGS" 2>/dev/null)" || {
    echo "truneg: error: LAUNCHER_ARGS=$LAUNCHER_ARGS has an unclosed quote; quote it as in a shell" >&2; exit 2; }
  eval "launcher_args=($quoted)"
fi
hosts=()  # deepspeed's node arguments (each node's PATH, the venv's bin first, comes with the env file)
if [ "$HOSTFILE" != local ]; then
  "$PYTHON" -m truneg.cluster.hostfile "$HOSTFILE"
  hosts=(--hostfile "$HOSTFILE")
fi
# An exported MASTER_ADDR/MASTER_PORT (an InfiniBand address, a port of this job's own): deepspeed's runner
# would set its own (the first node's first `hostname -I` address, port 29500) over them.
if [ -n "${MASTER_ADDR:-}" ]; then hosts+=(--master_addr "$MASTER_ADDR"); fi
if [ -n "${MASTER_PORT:-}" ]; then hosts+=(--master_port "$MASTER_PORT"); fi
OUTPUT="${OUTPUT:-}"
if [ -z "$OUTPUT" ]; then
  echo "truneg: error: set OUTPUT to this run's folder on storage every node sees, e.g. OUTPUT=/shared/runs/NAME" >&2
  exit 2
fi
mkdir -p "$OUTPUT"
OUTPUT="$(cd "$OUTPUT" && pwd)"
# The env file goes in the folder of the run this launch writes (BERT's phase 2: its own, never phase 1's).
RUN_DIR="${RUN_DIR:-$OUTPUT}"
mkdir -p "$RUN_DIR"
if [ "$HOSTFILE" != local ]; then
  export DS_ENV_FILE="$(cd "$RUN_DIR" && pwd)/deepspeed_env"
  written=(--env-file "$DS_ENV_FILE" --launcher-args="${LAUNCHER_ARGS:-}")  # its launcher decides PATH
  # each rank checks its GPU against GPU=... (a check PREFLIGHT=0 skips, as the preflight)
  if [ "${PREFLIGHT:-1}" != 0 ]; then written+=(--gpu-arch "$GPU_ARCH"); fi
  "$PYTHON" -m truneg.cluster.hostfile "$HOSTFILE" "${written[@]}"
fi

absolute() {  # a path as seen from here, for every node (DeepSpeed's runner cds to this folder there, and
  # carries on from the home folder where it does not exist); hf:NAME specs stay
  case "$1" in /*|hf:*) echo "$1" ;; *) echo "$PWD/$1" ;; esac
}

checkpoint() {  # INIT: a folder, made absolute; or a model name of the HF hub (ORG/NAME[@REVISION], nothing of that
  # name here), passed unchanged for each node to resolve through its HF cache
  if "$PYTHON" -c 'import sys; from truneg.model.hub import is_hub_name; sys.exit(not is_hub_name(sys.argv[1]))' "$1"
  then echo "$1"; else absolute "$1"; fi
}

recipe() {  # recipe STEM: the recipe's config for $GPU (fp16 ZeRO-2 for a V100, bf16 ZeRO-1 from an A100)
  "$PYTHON" -m truneg.train.config.ds_config recipe "$1" "$GPU"
}

recipe_flags() {  # recipe_flags MODEL SEQ_LEN CONFIG STEPS SAVE_STEPS LOG_STEPS [more flags]: a recipe's
  # pretrain.py flags, into the array `flags` (OUTPUT, DATA, CONFIG, STEPS, KEEP, HC, SR, COMPILE as above)
  local model=$1 seq=$2 config=$3 steps=$4 save=$5 log=$6
  shift 6
  : "${DATA:?set DATA to the corpus (a prepared folder, files, a folder or a glob)}"
  local compile=() hc="${HC:-none}"
  if [ "${COMPILE:-0}" = 1 ]; then compile=(--compile); fi
  case "$hc" in none|wordnet|embedding) ;; *) hc="$(absolute "$hc")" ;; esac  # or a table file
  flags=(--model "$model" --seq-len "$seq" --deepspeed_config "$(absolute "${CONFIG:-$config}")"
    --train-data "$(absolute "$DATA")"
    --output-dir "$OUTPUT" --max-steps "${STEPS:-$steps}" --save-steps "$save" --keep-checkpoints "${KEEP:-3}"
    --log-steps "$log" --hc "$hc" --sr "${SR:-none}" ${compile[@]+"${compile[@]}"} "$@")
}

pretrain() {  # pretrain MODEL SEQ_LEN CONFIG STEPS SAVE_STEPS LOG_STEPS [more flags]: a recipe's run
  recipe_flags "$@" || return
  launch "${flags[@]}"
}

continued() {  # continued MODEL RECIPE INIT_HINT [more flags]: the paper's continued pre-training at seq 512
  local model=$1 stem=$2 hint=$3 config init=()
  shift 3
  : "${INIT:?set INIT to $hint}"
  config="$(recipe "$stem")"  # assigned alone: set -e stops on its failure here, not inside an argument list
  init=(--init-from "$(checkpoint "$INIT")")
  if [ -n "${INIT_GENERATOR:-}" ]; then init+=(--init-generator "$(checkpoint "$INIT_GENERATOR")"); fi
  pretrain "$model" 512 "$config" 200000 5000 100 "${init[@]}" "$@"
}

preflight() {  # preflight FLAGS: `truneg preflight` of pretrain.py's flags (PREFLIGHT=0 skips it)
  if [ "${PREFLIGHT:-1}" != 0 ]; then
    local checked=(--gpu-arch "$GPU_ARCH")  # local: this machine's GPUs, as deepspeed counts them
    if [ "$HOSTFILE" != local ]; then checked+=(--hostfile "$HOSTFILE"); fi
    # LAUNCHER_ARGS' --launcher, --include/--exclude and --num_nodes/--num_gpus decide the nodes and the world size
    "$PYTHON" -m truneg.cluster.preflight ${checked[@]+"${checked[@]}"} --launcher-args="${LAUNCHER_ARGS:-}" "$@"
  fi
}

launch() {  # launch FLAGS: the preflight, then deepspeed; WAIT=1 returns its status (a phase before another)
  preflight "$@" || return  # (called in `||`, as WAIT=1's caller does, set -e stops nothing inside)
  if [ "${WAIT:-0}" = 1 ]; then
    "$DEEPSPEED" ${hosts[@]+"${hosts[@]}"} ${launcher_args[@]+"${launcher_args[@]}"} "$REPO/truneg/pretrain.py" "$@"
    return
  fi
  # exec: the launcher's exit status, which is a failed rank's, is this script's.
  exec "$DEEPSPEED" ${hosts[@]+"${hosts[@]}"} ${launcher_args[@]+"${launcher_args[@]}"} "$REPO/truneg/pretrain.py" "$@"
}
