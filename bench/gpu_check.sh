#!/usr/bin/env bash
# One-GPU check in 5 minutes, on a bare image without network (README, "GPU check"):
#   bash bench/gather_wheels.sh            # here, with PyPI: the wheels the image lacks -> .cache/gpu_wheels
#   bash bench/gpu_check.sh                # there: installs them, then the four stages below
#   bash bench/gpu_check.sh --cpu-dry-run  # the same stages on the CPU with tiny models (tests/test_gpu_check.py)
#
# Stages (bench/gpu_check.py; each under `timeout`, each appending its lines to the summary as it goes):
#   1. every shipped GPU config (ds_configs/*.json but cpu_*) starts and takes 10 steps on a tiny model;
#   2. save, kill -9, resume: losses within 1e-5 relative of an uninterrupted run, CUDA RNG in the checkpoint;
#   3. one BERT-large HC+SR step under torch.cuda.set_sync_debug_mode("warn"): host syncs per phase;
#   4. BERT-large seq 128 bf16: ZeRO-1 vs ZeRO-3, with and without HC+SR, --compile for ZeRO-1 HC+SR (last);
#      ELECTRA-base baseline and HC+SR: samples/s, MFU (989 TFLOP/s and a bf16 GEMM measured here), peak memory;
#   5. (only when named in STAGES, and first) bench/gpu_mfu.py, the one GPU call (docs/gpu-check.md): how far
#      from 50 % MFU, and why. Its output goes to $OUT/gpu_mfu.log, its JSON lines to $OUT/gpu_mfu.jsonl, its
#      RESULT line to the summary. Not in this script's CPU dry run (bench/gpu_mfu.py --cpu-dry-run has its own).
# Stages 1-3 run side by side (they count, not time); stages 5 and 4 alone, after the fused optimizers' JIT
# builds (started first, in the background: FusedAdam, and FusedLamb when stage 1 runs) have finished.
# The next GPU session's calls: README, "GPU check".
#
# Environment: OUT (the summary goes to $OUT/gpu_check.txt and the logs to $OUT/gpu_check.log; OUT itself is
# never deleted, and the summary only appended to), WHEELS (default .cache/gpu_wheels), PY (default python3;
# .venv/bin/python for the dry run), BUDGET_S (the whole check; default 290, dry run 900), STAGES (default
# 1,2,3,4), STAGE<N>_TIMEOUT_S (one stage's limit), TORCH_EXTENSIONS_DIR (default one folder per machine,
# so that a second call on a warm machine reuses the JIT builds). Exit status 0 when every stage passed, else 1.
# No `set -e`: a stage that fails or times out is recorded and the next one runs.
cd "$(dirname "$0")/.." || exit 2
DRY=0
case "${1:-}" in
  --cpu-dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--cpu-dry-run]" >&2; exit 2 ;;
esac
if [ $DRY = 1 ]; then
  PY=${PY:-.venv/bin/python}; FLAG=--cpu-dry-run; BUDGET_S=${BUDGET_S:-900}
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}  # the CPU comm op, built once
else
  PY=${PY:-python3}; FLAG=; BUDGET_S=${BUDGET_S:-290}
  export DS_ACCELERATOR=cuda
fi
WHEELS=${WHEELS:-.cache/gpu_wheels}
STAGES=${STAGES:-1,2,3,4}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
if [ -n "${OUT:-}" ]; then RESULTS=$OUT; else RESULTS=runs/gpu_check; fi
SUMMARY=$RESULTS/gpu_check.txt
LOG=$RESULTS/gpu_check.log
mkdir -p "$RESULTS" "$WORK"
export TRUNEG_CACHE=$WORK/cache PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-${TMPDIR:-/tmp}/truneg_torch_extensions}

note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET_S - SECONDS)); }
status() { [ "$1" = 0 ] && echo ok || echo "FAILED (exit $1)"; }
# verdict RC LIMIT ELAPSED: a stage's result. `timeout -s KILL` exits 137 at its limit, and so does a process
# that the kernel's out-of-memory killer took before it: the elapsed time tells them apart.
verdict() {
  case $1 in
    0) echo PASS ;;
    124|137) if [ "$3" -ge "$2" ]; then echo "TIMEOUT after $2 s"
             else echo "KILLED (exit $1 after $3 s, before its $2 s limit: out of memory?)"; fi ;;
    *) echo "FAIL (exit $1)" ;;
  esac
}

note "== bench/gpu_check.sh $([ $DRY = 1 ] && echo "--cpu-dry-run" || echo "on $(hostname)"), $(date -u '+%Y-%m-%d %H:%M UTC'), budget ${BUDGET_S} s, stages $STAGES"

# Install what the image lacks, from the folder bench/gather_wheels.sh made (no network needed).
if [ $DRY = 0 ]; then
  if [ -f "$WHEELS/requirements.txt" ]; then
    t0=$SECONDS
    timeout 150 "$PY" -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt" >> "$LOG" 2>&1
    rc=$?
    note "install from $WHEELS: $(status $rc) in $((SECONDS - t0)) s"
    if [ $rc != 0 ]; then
      # The resolver wants a version the folder lacks (a folder made with --present that guessed wrong): install
      # the folder's wheels of the packages the image has none of, as they are, and let the stages tell.
      MISSING=$("$PY" - "$WHEELS" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    try:
        distribution(wheel.name.split("-")[0])
    except PackageNotFoundError:
        print(wheel)
PYEOF
)
      # shellcheck disable=SC2086
      timeout 150 "$PY" -m pip install -q --no-index --no-deps $MISSING >> "$LOG" 2>&1
      rc=$?
      note "install --no-deps of the $(echo "$MISSING" | grep -c .) wheels the image lacks: $(status $rc)"
    fi
    if [ -f "$WHEELS/nltk_data.tar.gz" ]; then
      mkdir -p "$WORK/nltk_data" && tar -xzf "$WHEELS/nltk_data.tar.gz" -C "$WORK/nltk_data"
      export NLTK_DATA=$WORK/nltk_data
    fi
  else
    note "install: no $WHEELS/requirements.txt (bench/gather_wheels.sh makes it); using what the image has"
  fi
  note "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -2)"
  note "nvcc: $( (nvcc --version || "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" --version) 2>&1 | grep -i release || echo 'not found: the fused optimizers cannot build')"
fi
# The fused optimizers (FusedAdam for the AdamW configs, FusedLamb for the LAMB one) build just in time with
# this machine's nvcc; start both first (before `info`) so that stage 1 finds them built or under way.
BUILDS=()
if [ $DRY = 0 ]; then
  # This GPU's plain major.minor: DeepSpeed's op builder cannot parse an image's "9.0a" (see truneg.train.ranks.distributed)
  export TORCH_CUDA_ARCH_LIST=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)
  export MAX_JOBS=${MAX_JOBS:-$(nproc)}
  prebuild() {
    local t0=$SECONDS
    timeout "$(left)" "$PY" -c "from deepspeed.ops.op_builder import ${1}Builder as B; B().load()" > "$WORK/build_$1.log" 2>&1
    local rc=$?
    note "JIT build $1 (sm ${TORCH_CUDA_ARCH_LIST}): $(status $rc) in $((SECONDS - t0)) s"
    [ $rc = 0 ] || { echo "===== JIT build $1: $(status $rc)"; cat "$WORK/build_$1.log"; } >> "$LOG"  # nvcc's words
  }
  prebuild FusedAdam & BUILDS+=($!)
  case ",$STAGES," in *",1,"*) prebuild FusedLamb & BUILDS+=($!) ;; esac  # only the LAMB config takes it
fi
builds_done() { [ ${#BUILDS[@]} -gt 0 ] && wait "${BUILDS[@]}"; BUILDS=(); }  # before a stage that times

timeout 60 "$PY" bench/gpu_check.py info --summary "$SUMMARY" --work "$WORK" $FLAG >> "$LOG" 2>&1
note "info: $(status $?)"

run_stage() {  # run_stage N NAME DEFAULT_LIMIT_S SUBCOMMAND
  local n=$1 name=$2 sub=$4 limit_var="STAGE$1_TIMEOUT_S"
  case ",$STAGES," in *",$n,"*) ;; *) return 0 ;; esac
  local limit=${!limit_var:-$3} rest
  rest=$(left)
  [ "$limit" -gt "$rest" ] && limit=$rest
  if [ "$limit" -lt 5 ]; then
    note "stage $n $name: SKIPPED (the ${BUDGET_S} s budget is spent)"; echo SKIPPED > "$WORK/status.$n"; return 0
  fi
  local t0=$SECONDS rc result
  timeout -s KILL "$limit" "$PY" bench/gpu_check.py "$sub" --summary "$SUMMARY" --work "$WORK" $FLAG > "$WORK/stage$n.log" 2>&1
  rc=$?
  result=$(verdict $rc "$limit" $((SECONDS - t0)))
  note "stage $n $name: $result in $((SECONDS - t0)) s"
  # A process killed while it loaded a JIT-built op leaves the op's lock, and every later load would wait on it.
  case $rc in 124|137) "$PY" bench/gpu_check.py locks --summary "$SUMMARY" --work "$WORK" $FLAG >> "$LOG" 2>&1 ;; esac
  [ $rc = 0 ] || note "  last line of its log: $(grep -v '^[[:space:]]*$' "$WORK/stage$n.log" | tail -1 | cut -c1-300)"
  echo "$result" > "$WORK/status.$n"
  { echo "===== stage $n $name: $result"; cat "$WORK/stage$n.log"
    for f in "$WORK/stage$n"/*.log; do [ -f "$f" ] && { echo "----- $f"; cat "$f"; }; done; } >> "$LOG" 2>/dev/null
}

# Stage 5, when named: the one GPU call (bench/gpu_mfu.py), alone and first; its variants keep to its budget.
case ",$STAGES," in *",5,"*)
  if [ $DRY = 1 ]; then
    note "stage 5 mfu: SKIPPED (CUDA only: bench/gpu_mfu.py; its own dry run is bench/gpu_mfu.py --cpu-dry-run)"
  else
    builds_done
    limit=${STAGE5_TIMEOUT_S:-540}; [ "$limit" -gt "$(left)" ] && limit=$(left)
    if [ "$limit" -lt 5 ]; then  # as run_stage: `timeout 0` would set no limit at all
      note "stage 5 mfu: SKIPPED (the ${BUDGET_S} s budget is spent)"; echo SKIPPED > "$WORK/status.5"
    else
      t0=$SECONDS
      # its own budget a little inside the stage's limit, so that it writes its last line itself
      OUT=$RESULTS BUDGET_S=$((limit - 10)) timeout -s KILL "$limit" "$PY" bench/gpu_mfu.py > "$RESULTS/gpu_mfu.log" 2>&1
      rc=$?
      grep -E '^RESULT ' "$RESULTS/gpu_mfu.log" | sed 's/^/  /' >> "$SUMMARY"
      result=$(verdict $rc "$limit" $((SECONDS - t0)))
      case $rc in 124|137) "$PY" bench/gpu_check.py locks --summary "$SUMMARY" --work "$WORK" $FLAG >> "$LOG" 2>&1 ;; esac
      note "stage 5 mfu: $result in $((SECONDS - t0)) s (its log: $RESULTS/gpu_mfu.log, its records: $RESULTS/gpu_mfu.jsonl)"
      echo "$result" > "$WORK/status.5"
    fi
  fi ;;
esac

# Stages 1-3 time nothing: side by side. Stage 4 times, so it runs alone.
run_stage 1 configs 150 configs & S1=$!
run_stage 2 resume 150 resume & S2=$!
run_stage 3 syncs 150 syncs & S3=$!
wait $S1 $S2 $S3
case ",$STAGES," in *",4,"*) builds_done ;; esac
run_stage 4 throughput 290 throughput
builds_done

FAILED=$(cat "$WORK"/status.* 2>/dev/null | grep -vc '^PASS$')
note "== done in ${SECONDS} s: $([ "$FAILED" = 0 ] && echo "every stage passed" || echo "$FAILED stage(s) did not pass"); work files in $WORK"
[ "$FAILED" = 0 ]
