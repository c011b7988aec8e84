"""truneg's MLM training step (masked-only head) against HF BertForMaskedLM with a plain torch step
(full-vocab head over every position), same config, weights, batch, threads and optimizer.

    python bench/mlm_throughput.py [--sizes tiny,small,base] [--batch 8] [--steps 12]

Both steps: forward, loss, backward, AdamW step, zero_grad (in place, for both). The two run alternately, so drift of
the machine hits both alike. Last line: RESULT speedup=<bert-base ratio> (HF step time / truneg step time).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.masked_batch import hf_labels, real_batch  # noqa: E402
from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.model.presets import BERT_PRESETS
from truneg.model.pretrainers import BertPretrainer, ObjectiveConfig  # noqa: E402

SIZES = {
    "tiny": BERT_PRESETS["bert-tiny"],
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),  # BERT-small
    "base": BERT_PRESETS["bert-base"],
}


def step_time(step_fn, optimizer) -> float:
    start = time.perf_counter()
    loss = step_fn()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # steady memory: no 400 MB of fresh gradient pages per step
    return time.perf_counter() - start


def bench_size(name: str, batch_size: int, steps: int) -> float:
    torch.manual_seed(0)
    hf = BertForMaskedLM(BertConfig(**SIZES[name], attn_implementation="sdpa")).train()
    ours = BertPretrainer(copy.deepcopy(hf), ObjectiveConfig()).train()
    batch = real_batch(load_tokenizer(), batch_size, 128, "bert")
    labels = hf_labels(batch)
    ones = torch.ones_like(batch["input_ids"])
    hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4)
    our_opt = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    hf_times, our_times = [], []
    for step in range(steps + 1):  # step 0 warms up
        # HF as run_mlm calls it: the tokenizer's attention mask (all ones here), the full-vocab head at every
        # position, labels -100 but at the masked ones (as its collator writes them).
        # truneg passes no mask for packed blocks (none has padding). Both use SDPA attention.
        pair = [("hf", lambda: hf(input_ids=batch["input_ids"], attention_mask=ones, labels=labels).loss, hf_opt),
                ("ours", lambda: ours(**batch)[0], our_opt)]
        for who, fn, opt in pair if step % 2 else pair[::-1]:
            seconds = step_time(fn, opt)
            if step:
                (hf_times if who == "hf" else our_times).append(seconds)
    hf_ms, our_ms = 1e3 * statistics.median(hf_times), 1e3 * statistics.median(our_times)
    masked = int(batch["masked_valid"].sum())
    print(f"{name:<6} {hf_ms:>12.1f} {our_ms:>12.1f} {hf_ms / our_ms:>8.3f}   ({masked} of {batch_size * 128} "
          "positions masked)")
    return hf_ms / our_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="tiny,small,base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    print(f"batch {args.batch}, seq 128, {torch.get_num_threads()} threads, AdamW step included, "
          f"median of {args.steps}")
    print(f"{'size':<6} {'HF full ms':>12} {'truneg ms':>12} {'speedup':>8}")
    ratios = {name: bench_size(name, args.batch, args.steps) for name in args.sizes.split(",")}
    print(f"RESULT speedup={ratios.get('base', list(ratios.values())[-1]):.3f}")


if __name__ == "__main__":
    main()
