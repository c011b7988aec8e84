# Sourced by the launch scripts: check the hostfile, then hand over to the deepspeed launcher.
# Multi-node runs go over pdsh (or ssh): every node needs this repo at the same path, the same venv,
# passwordless ssh from the launching node, and the data on a shared file system. DeepSpeed forwards
# the variables listed in ~/.deepspeed_env (one NAME=VALUE per line), e.g. NCCL_SOCKET_IFNAME.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOSTFILE="${HOSTFILE:-$REPO/launch/hosts}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
DEEPSPEED="${DEEPSPEED:-$REPO/.venv/bin/deepspeed}"
"$PYTHON" -m truneg.hostfile "$HOSTFILE"
launch() {
  # exec: the launcher's exit status, which is a failed rank's, is this script's.
  exec "$DEEPSPEED" --hostfile "$HOSTFILE" ${LAUNCHER_ARGS:-} "$REPO/truneg/pretrain.py" "$@"
}
