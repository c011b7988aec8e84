"""Model FLOPs per training sample from DeepSpeed's flops profiler, beside truneg's own formula
(truneg.train.observe.flops, behind the runs' `tflops` and `mfu`), for MFU.

    python bench/flops.py [--presets bert-large,electra-base] [--seq-len 128] [--samples-per-sec X --peak-tflops Y]

The profiler counts one forward of the pre-trainer (BERT: encoder + masked-only head; ELECTRA: generator,
sample, discriminator) at batch 1; a training step costs about 3x the forward (backward = 2x).
With --samples-per-sec and --peak-tflops (V100 fp16: 125, A100 bf16: 312, H100 bf16: 989) it prints MFU.
tests/train/test_efficiency.py checks the formula against the profiler in the same way (tolerance: docs/pretraining.md).
Last line: RESULT <preset>_tflops_per_sample=<x> ... (the profiler's)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.data.masking import default_max_predictions, mask_tokens  # noqa: E402
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer  # noqa: E402
from truneg.train.observe.flops import preset_train_flops  # noqa: E402


def train_flops_per_sample(preset: str, seq_len: int, objective: ObjectiveConfig | None = None) -> float:
    """3x the profiler's count of one forward at batch 1 (`objective`: SR_Sent's passes, say)."""
    from deepspeed.profiling.flops_profiler import get_model_profile

    tokenizer = load_tokenizer()
    model = build_pretrainer(preset, objective or ObjectiveConfig()).eval()
    rows = np.random.default_rng(0).integers(1000, 30000, (1, seq_len))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    kwargs = mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), model.scheme,
                         0, 0, np.arange(1), default_max_predictions(seq_len))
    with torch.no_grad():
        flops, _, params = get_model_profile(model, kwargs=kwargs, print_profile=False, as_string=False, warm_up=0)
    return 3.0 * flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="bert-large,electra-base")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--samples-per-sec", type=float, help="measured training throughput, for MFU")
    parser.add_argument("--peak-tflops", type=float, help="the accelerator's peak, for MFU")
    args = parser.parse_args()
    results = {}
    print(f"{'preset':<14} {'train TFLOPs/sample':>20} {'TFLOPs/step @256':>17} {'formula / profiler':>19}")
    for preset in args.presets.split(","):
        per_sample = train_flops_per_sample(preset, args.seq_len) / 1e12
        results[preset] = per_sample
        formula = preset_train_flops(preset, args.seq_len) / 1e12
        print(f"{preset:<14} {per_sample:>20.4f} {256 * per_sample:>17.2f} {formula / per_sample:>19.4f}")
        if args.samples_per_sec and args.peak_tflops:
            print(f"  MFU at {args.samples_per_sec} samples/s: "
                  f"{per_sample * args.samples_per_sec / args.peak_tflops:.1%}")
    print("RESULT " + " ".join(f"{p.replace('-', '_')}_tflops_per_sample={v:.4f}" for p, v in results.items()))


if __name__ == "__main__":
    main()
