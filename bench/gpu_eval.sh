#!/usr/bin/env bash
# The held-out evaluation on one GPU (--eval-data): bf16 at ZeRO-1 and ZeRO-3, with --compile layers and whole, fp16
# at ZeRO-2, its host syncs, and `truneg eval` offline (fp32) against the bf16 and fp16 in-run records. Run where bench/gpu_check.sh runs:
#   OUT=DIR WHEELS=.cache/gpu_wheels_h200 bash bench/gpu_eval.sh        # summary: DIR/gpu_eval.txt
# The configs are the shipped bf16 and fp16 recipes with torch's AdamW (no JIT build), tiny models, seq 128.
set -u
OUT=${OUT:-runs/gpu_eval}
WHEELS=${WHEELS:-.cache/gpu_wheels}
PY=${PY:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_eval.XXXXXX")
mkdir -p "$OUT"
SUMMARY=$OUT/gpu_eval.txt
LOG=$OUT/gpu_eval.log
export TRUNEG_CACHE=$WORK/cache PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda
note() { echo "$*" | tee -a "$SUMMARY"; }
note "== bench/gpu_eval.sh on $(hostname), $(date -u '+%Y-%m-%d %H:%M UTC')"
if [ -f "$WHEELS/requirements.txt" ]; then
  timeout 150 "$PY" -m pip install -q --no-index --find-links "$WHEELS" -r "$WHEELS/requirements.txt" >> "$LOG" 2>&1
  note "install: exit $?"
fi
"$PY" - "$WORK" <<'EOF' >> "$LOG" 2>&1
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
cpu = json.loads(Path("ds_configs/cpu_zero2.json").read_text())
for name, source in (("bf16_zero1", "electra_small_a100_bf16_zero1.json"), ("bf16_zero3", "electra_base_a100_bf16_zero3.json"),
                     ("fp16_zero2", "electra_small_v100_fp16_zero2.json")):
    config = json.loads((Path("ds_configs") / source).read_text())
    config.update(optimizer=cpu["optimizer"], scheduler=cpu["scheduler"])  # torch's AdamW: no JIT build
    (work / f"{name}.json").write_text(json.dumps(config))
text = Path("truneg/assets/corpus/austen_pride_and_prejudice.txt").read_text()
(work / "train.txt").write_text(text[:200_000])
(work / "held_out.txt").write_text(text[200_000:400_000])
EOF
run() {  # run NAME MODEL CONFIG [flags]
  local name=$1 model=$2 config=$3
  shift 3
  local t0=$SECONDS
  timeout 240 "$PY" -m truneg.pretrain --model "$model" --deepspeed_config "$WORK/$config.json" \
    --train-data "$WORK/train.txt" --seq-len 128 --micro-batch-size 16 --gradient-accumulation-steps 1 \
    --max-steps 20 --save-steps 10 --log-steps 10 --output-dir "$OUT/$name" --hc wordnet --overwrite \
    --eval-data "$WORK/held_out.txt" --eval-max-sequences 256 "$@" > "$OUT/$name.log" 2>&1
  note "$name: exit $? in $((SECONDS - t0)) s; $(grep -c '^eval step' "$OUT/$name.log") evaluations; $(grep '^eval step 20 ' "$OUT/$name.log"); $(grep 'compile:' "$OUT/$name.log")"
}
run electra_zero1 electra-tiny bf16_zero1
run bert_zero3 bert-tiny bf16_zero3
run bert_compile bert-tiny bf16_zero1 --compile layers
run bert_whole bert-tiny bf16_zero1 --compile whole
run electra_fp16 electra-tiny fp16_zero2
# offline, fp32, against the bf16 and fp16 records of step 20
for name in electra_zero1 bert_zero3 electra_fp16; do
  timeout 120 "$PY" -m truneg.cli eval "$OUT/$name/checkpoints/global_step20" --data "$WORK/held_out.txt" \
    --seq-len 128 --eval-max-sequences 256 --out "$OUT/$name.offline.json" >> "$LOG" 2>&1
  "$PY" - "$OUT/$name" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
live = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if '"eval_' in l][-1]
offline = json.loads(run.with_name(run.name + ".offline.json").read_text())[0]
diffs = {k: abs(offline[k] - live[k]) / max(abs(live[k]), 1e-12) for k in live if k.startswith("eval_") and
         k != "eval_seconds" and isinstance(live[k], float)}
print(f"{run.name}: offline fp32 vs in-run, relative: " + ", ".join(f"{k[5:]} {v:.2e}" for k, v in diffs.items()))
EOF
done
# host syncs: the eval's batches under torch.cuda's sync debug mode (an implicit sync raises)
timeout 120 "$PY" - <<'EOF' 2>> "$LOG" | tee -a "$SUMMARY"
import numpy as np, torch
from truneg.data.blocks import load_tokenizer
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
from truneg.train.build import wordnet_table
from truneg.train.heldout import HeldOut
tokenizer = load_tokenizer()
blocks = np.random.default_rng(0).integers(1000, 20000, (64, 128)).astype(np.int32)
for preset in ("bert-tiny", "electra-tiny"):
    model = build_pretrainer(preset, ObjectiveConfig()).cuda().bfloat16()
    heldout = HeldOut(blocks, tokenizer, model.scheme, 64, 16, wordnet_table(tokenizer), "cuda")
    heldout.local_sums(model)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        heldout.local_sums(model)
        said = "no host sync in the eval's batches"
    except RuntimeError as err:
        said = f"a host sync: {str(err)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"syncs {preset}: {said}")
EOF
