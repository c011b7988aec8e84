#!/usr/bin/env bash
# One-GPU check, under 8 minutes: bert-large (seq 128) and electra-base, about 100 steps each, with and
# without HC+SR. Prints samples/s, MFU (from DeepSpeed's flops profiler) and the HC+SR overhead.
#   bash bench/gpu_check.sh            # needs a CUDA GPU; bf16 where supported, else fp16
# Anchors: DeepSpeed 272 samples/s per V100 and NVIDIA 580 per A100 for BERT-large phase 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DS=${DS:-.venv/bin/deepspeed}
OUT=${OUT:-runs/gpu_check}
STEPS=${STEPS:-100}
DATA=${DATA:-truneg/assets/corpus}
PEAK=${PEAK:-$($PY -c "import torch; n=torch.cuda.get_device_name(); print(989 if 'H100' in n or 'H200' in n else 312 if 'A100' in n else 125)")}
BF16=$($PY -c "import torch; print(int(torch.cuda.is_bf16_supported()))")
rm -rf "$OUT"; mkdir -p "$OUT"
FLOPS=$($PY bench/flops.py --presets bert-large,electra-base | tail -1)
echo "$FLOPS"
for model in bert-large electra-base; do
  base=${model%%-*}
  if [ "$BF16" = 1 ]; then config=ds_configs/${base}_$( [ $base = bert ] && echo large || echo base )_a100_bf16_zero3.json
  else config=ds_configs/${base}_$( [ $base = bert ] && echo large || echo base )_v100_fp16_zero2.json; fi
  for variant in baseline hcsr; do
    extra=(); [ $variant = hcsr ] && extra=(--hc wordnet --sr word)
    $DS --num_gpus 1 truneg/pretrain.py --model $model --deepspeed_config $config --train-data $DATA \
      --seq-len 128 --micro-batch-size 32 --gradient-accumulation-steps 1 --max-steps $STEPS --log-steps 10 \
      --save-steps 0 --output-dir "$OUT/$model-$variant" --overwrite "${extra[@]}" > "$OUT/$model-$variant.log" 2>&1
  done
done
$PY - "$OUT" "$PEAK" "$FLOPS" <<'PYEOF'
import json, statistics, sys
out, peak, flops = sys.argv[1], float(sys.argv[2]), sys.argv[3]
per_sample = {kv.split("=")[0].split("_tflops")[0]: float(kv.split("=")[1]) for kv in flops.split()[1:]}
print(f"{'run':<24} {'samples/s':>10} {'TFLOPS':>8} {'MFU':>6}")
rates = {}
for model in ("bert-large", "electra-base"):
    for variant in ("baseline", "hcsr"):
        records = [json.loads(l) for l in open(f"{out}/{model}-{variant}/metrics.jsonl")]
        rate = statistics.median(r["samples_per_sec"] for r in records[2:])  # skip warm-up intervals
        rates[model, variant] = rate
        tflops = rate * per_sample[model.replace("-", "_")]
        print(f"{model + ' ' + variant:<24} {rate:>10.1f} {tflops:>8.1f} {tflops / peak:>6.1%}")
    print(f"{model}: HC+SR step time / baseline = {rates[model, 'baseline'] / rates[model, 'hcsr']:.3f}")
PYEOF
