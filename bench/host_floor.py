"""The host's floor under the GPU step, measured on the CPU: how long the host takes to issue one optimizer
step of BERT-large and of ELECTRA-base when the arithmetic costs nearly nothing.

    OMP_NUM_THREADS=1 python bench/host_floor.py

The models keep their layers, heads, parameter tensors and ops (24 layers and 16 heads for BERT-large; 12 + 12
for ELECTRA-base) but are 64-96 wide, at micro-batch 2 and seq 32: what is left of a step is the host's own
work (Python, the dispatcher, autograd, DeepSpeed's per-parameter loops), which on a GPU is the time to
launch the kernels and does not shrink with a faster device; only more samples per micro-step spread it.
Some arithmetic stays: about 0.7 GFLOP per micro-step of narrow BERT-large, forward and backward (torch's
flop counter), and dropout's random numbers, drawn on the CPU here (dropout 0 made a step about 13 % faster in
a side-by-side check); under the profiler the matrix products took about a fifth of the CPU time. So the floor
is an upper bound of the host's work, on this machine's CPU, not the GPU host's.

Each variant is truneg's own step (`truneg.pretrain.main` in this process, 1 rank, the shipped bf16 config
with torch AdamW in place of FusedAdam, which needs a GPU), beside a plain torch loop (bf16 weights, torch
AdamW, no DeepSpeed) measured in the same run: milliseconds per optimizer step at 4 micro-steps and at 1,
their ratio to the plain loop, and what they imply: the host's cost per micro-step and per optimizer step,
and the micro-batch above which a GPU at 50 % MFU (989 TFLOP/s, `bench/flops.py`'s FLOPs per sample at seq
128) has more to do than this host. Last line: `RESULT bert_large_zero1_time_vs_plain=... min_micro_bert_large=...`.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_runs import CORPUS, DS_CONFIGS, plain_step, run_pretrain  # noqa: E402
from bench.gpu_step import PEAK_TFLOPS, TFLOPS_PER_SAMPLE  # noqa: E402
from bench.hc_sr_overhead import real_batch  # noqa: E402
from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.model import pretrainers as models  # noqa: E402

MICRO, SEQ, STEPS, LOG = 2, 32, 25, 5
# Same depth, heads and parameter tensors as the real presets; 4-8 wide per head.
NARROW_BERT = {"bert-large": dict(hidden_size=64, num_hidden_layers=24, num_attention_heads=16, intermediate_size=256)}
NARROW_ELECTRA = {"electra-base": (
    dict(embedding_size=96, hidden_size=96, num_hidden_layers=12, num_attention_heads=12, intermediate_size=384),
    dict(embedding_size=96, hidden_size=32, num_hidden_layers=12, num_attention_heads=4, intermediate_size=128),
)}
CONFIGS = {"bert-large": "bert_large_a100_bf16_zero1.json", "electra-base": "electra_base_a100_bf16_zero1.json"}


def plain_ms(preset: str, accum: int) -> float:
    """A plain torch loop's optimizer step: bf16 weights, torch AdamW, no DeepSpeed, one batch masked before.
    Timed as truneg's records are: the mean step of each LOG-step interval, the median over the intervals
    after the first (ms)."""
    model = models.build_pretrainer(preset, models.ObjectiveConfig()).to(torch.bfloat16).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = real_batch(load_tokenizer(), MICRO, SEQ, model.scheme)
    intervals = []
    for _ in range(STEPS // LOG):
        t0 = time.perf_counter()
        for _ in range(LOG):
            plain_step(model, optimizer, batch, accum)
        intervals.append((time.perf_counter() - t0) / LOG)
    return 1e3 * statistics.median(intervals[1:])


def truneg_ms(preset: str, accum: int, work: Path, stage: int = 1) -> float:
    """truneg's step with DeepSpeed at a ZeRO stage (median ms over the logged intervals after the first). Its
    step also masks each micro-batch (CPU ranks mask inline; GPU ranks in DataLoader workers) and logs."""
    config = json.loads((DS_CONFIGS / CONFIGS[preset]).read_text())
    config["zero_optimization"]["stage"] = stage
    if stage == 0:  # DeepSpeed refuses fp32 gradient accumulation with bf16 at stage 0
        config.pop("data_types", None)
    config["optimizer"]["params"]["torch_adam"] = True  # FusedAdam is a CUDA op
    name = f"{preset}_zero{stage}_accum{accum}"
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    run = run_pretrain(["--model", preset, "--deepspeed_config", str(path), "--train-data", str(CORPUS),
                        "--seq-len", str(SEQ), "--micro-batch-size", str(MICRO), "--gradient-accumulation-steps",
                        str(accum), "--max-steps", str(STEPS), "--log-steps", str(LOG), "--save-steps", "0",
                        "--overwrite"], work / name)
    if not run.ok:
        raise SystemExit(f"{name}: {run.error}")
    return 1e3 * MICRO * accum / statistics.median(r["samples_per_sec"] for r in run.records[1:])


def min_micro(per_micro_ms: float, per_step_ms: float, accum: int, preset: str) -> float:
    """The micro-batch at which a GPU at 50 % MFU spends as long on a step's work as this host on issuing it."""
    gpu_ms_per_sample = 1e3 * TFLOPS_PER_SAMPLE[preset, 128] / (0.5 * PEAK_TFLOPS["H200"])
    return (per_micro_ms + per_step_ms / accum) / gpu_ms_per_sample


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="host_floor_"))
    results = {}
    with mock.patch.dict(models.BERT_PRESETS, NARROW_BERT), mock.patch.dict(models.ELECTRA_PRESETS, NARROW_ELECTRA):
        for preset in ("bert-large", "electra-base"):
            ms = {("plain", a): plain_ms(preset, a) for a in (4, 1)}
            ms.update({("zero1", a): truneg_ms(preset, a, work) for a in (4, 1)})
            if preset == "bert-large":
                ms.update({(f"zero{s}", 4): truneg_ms(preset, 4, work, stage=s) for s in (0, 2)})
            print(f"\n{preset} (narrow), ms per optimizer step, micro-batch {MICRO} at seq {SEQ}:", flush=True)
            print(f"  {'step':<26} {'4 micro-steps':>14} {'1 micro-step':>13}")
            for kind in ("plain", "zero0", "zero1", "zero2"):
                if (kind, 4) not in ms:
                    continue
                label = "plain torch loop" if kind == "plain" else f"truneg + DeepSpeed ZeRO-{kind[-1]}"
                cells = [f"{ms[kind, a]:.0f} ({ms[kind, a] / ms['plain', a]:.2f}x)" if (kind, a) in ms else "" for a in (4, 1)]
                print(f"  {label:<26} {cells[0]:>14} {cells[1]:>13}")
            for kind in ("plain", "zero1"):
                per_micro = (ms[kind, 4] - ms[kind, 1]) / 3
                per_step = ms[kind, 1] - per_micro
                at = {a: min_micro(per_micro, per_step, a, preset) for a in (4, 1)}
                print(f"  {kind}: {per_micro:.1f} ms per micro-step + {per_step:.1f} ms per optimizer step; a GPU at "
                      f"50 % MFU outworks this host from micro-batch {at[4]:.0f} (x 4) or {at[1]:.0f} (x 1)")
                results[preset, kind] = at
            results[preset, "ratio"] = ms["zero1", 4] / ms["plain", 4]
    print(f"RESULT bert_large_zero1_time_vs_plain={results['bert-large', 'ratio']:.2f} "
          f"electra_base_zero1_time_vs_plain={results['electra-base', 'ratio']:.2f} "
          f"min_micro_bert_large={results['bert-large', 'zero1'][4]:.0f} "
          f"min_micro_electra_base={results['electra-base', 'zero1'][4]:.0f}", flush=True)


if __name__ == "__main__":
    main()
