"""Can the input keep a GPU fed? truneg's masked micro-batches against HF's MLM collator, side by side.

    python bench/loader_rate.py [--micro-batch 64] [--workers 0,1,2] [--batches 300]

Both read the same seq-128 blocks (the built-in corpus, tiled) in a shuffled order and mask them as BERT
does. truneg: `MaskedBatches` (its DataLoader workers read and mask a whole micro-batch: exact count per
sequence, static [B, 20] positions). HF: a `torch.utils.data.DataLoader` over the rows with
`DataCollatorForLanguageModeling(mlm_probability=0.15)`, as `Trainer` feeds run_mlm (its workers collate).
For each number of workers it prints the samples/s the training process receives and the training thread's
own CPU time per micro-batch (what the input takes from the host that issues the GPU's work), against the
samples/s a GPU needs at 50 % MFU of an H200's dense bf16 peak (truneg.train.observe.flops: the peak, and the FLOPs per
sample). The workers share this machine's cores with the consumer: on a GPU node each rank's workers have cores of
their own.
Last line: RESULT speedup=<truneg / HF samples/s at the most workers> truneg_samples_per_s=... main_ms=...
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from truneg.data.blocks import DEMO_CORPUS, ResumableSampler, load_tokenizer  # noqa: E402
from truneg.data.encoding import pack_blocks  # noqa: E402
from truneg.data.masking import MaskedBatches, default_max_predictions  # noqa: E402
from truneg.train.observe.flops import dense_peak_tflops, preset_train_flops  # noqa: E402

SEQ_LEN = 128


def corpus_blocks(tokenizer, rows: int) -> np.ndarray:
    """The built-in corpus packed as truneg prepares it, tiled to `rows` blocks."""
    text = "\n".join(p.read_text(encoding="utf-8") for p in sorted(Path(DEMO_CORPUS).glob("*.txt")))
    ids = np.array(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    blocks, _ = pack_blocks(ids, SEQ_LEN, tokenizer.cls_token_id, tokenizer.sep_token_id, np.uint16)
    return np.resize(blocks, (rows, SEQ_LEN))


def truneg_batches(blocks: np.ndarray, tokenizer, micro_batch: int, workers: int):
    sampler = ResumableSampler(len(blocks), micro_batch, world_size=1, rank=0, seed=0)
    return MaskedBatches(blocks, sampler, tokenizer, "bert", 0, default_max_predictions(SEQ_LEN), workers=workers)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, blocks: np.ndarray):
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i].tolist()}  # as a tokenized `datasets` row reaches the collator


def hf_batches(blocks: np.ndarray, tokenizer, micro_batch: int, workers: int):
    from transformers import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    loader = torch.utils.data.DataLoader(_Rows(blocks), batch_size=micro_batch, shuffle=True, num_workers=workers,
                                         collate_fn=collator, generator=torch.Generator().manual_seed(0),
                                         prefetch_factor=4 if workers else None, drop_last=True)
    return iter(loader)


def measure(batches, micro_batch: int, count: int) -> tuple[float, float]:
    """(samples/s received, the training thread's CPU ms per micro-batch), after 20 warm-up batches."""
    for _ in range(20):
        next(batches)
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(count):
        next(batches)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    return count * micro_batch / wall, 1e3 * cpu / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--workers", default="0,1,2")
    parser.add_argument("--batches", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer()
    blocks = corpus_blocks(tokenizer, 100_000)
    peak = dense_peak_tflops("NVIDIA H200", "bf16")
    need = {m: 0.5 * peak * 1e12 / preset_train_flops(m, SEQ_LEN) for m in ("bert-large", "electra-base")}
    print(f"micro-batch {args.micro_batch}, seq {SEQ_LEN}; a GPU at 50 % MFU of {peak:g} TFLOP/s needs "
          + ", ".join(f"{m} {n:,.0f}" for m, n in need.items()) + " samples/s")
    print(f"{'workers':>7} {'truneg samples/s':>17} {'main ms':>8} {'HF samples/s':>13} {'main ms':>8} {'ratio':>6}")
    measured = {}
    for workers in map(int, args.workers.split(",")):
        ours = measure(truneg_batches(blocks, tokenizer, args.micro_batch, workers), args.micro_batch, args.batches)
        hf = measure(hf_batches(blocks, tokenizer, args.micro_batch, workers), args.micro_batch, args.batches)
        measured[workers] = ours, hf
        print(f"{workers:>7} {ours[0]:>17,.0f} {ours[1]:>8.2f} {hf[0]:>13,.0f} {hf[1]:>8.2f} {ours[0] / hf[0]:>6.2f}",
              flush=True)
    ours, hf = measured[max(measured)]  # at the most workers, whatever order --workers lists them in
    print(f"RESULT speedup={ours[0] / hf[0]:.2f} truneg_samples_per_s={ours[0]:.0f} main_ms={ours[1]:.2f}")


if __name__ == "__main__":
    main()
