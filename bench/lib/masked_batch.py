"""A masked batch of real text for the CPU benchmarks (bench/hc_sr_overhead.py, bench/mlm_throughput.py,
bench/zero_memory.py): rows of the shipped Austen corpus, masked as truneg's loader masks them, and the same
batch's labels as HF's MLM collator writes them."""
from __future__ import annotations

import numpy as np
import torch

from truneg.data.blocks import DEMO_CORPUS
from truneg.data.masking import default_max_predictions, mask_tokens


def real_batch(tokenizer, batch: int, seq_len: int, scheme: str) -> dict[str, torch.Tensor]:
    """`batch` consecutive rows of `seq_len` tokens ([CLS] text [SEP]) from the corpus's start, masked with `scheme`
    (the pre-trainer's: "bert" or "electra") at seed 0, epoch 0."""
    text = (DEMO_CORPUS / "austen_pride_and_prejudice.txt").read_text()
    ids = tokenizer(text[:200_000], add_special_tokens=False, verbose=False)["input_ids"]
    body = seq_len - 2
    rows = np.array([[tokenizer.cls_token_id] + ids[i * body:(i + 1) * body] + [tokenizer.sep_token_id] for i
                     in range(batch)])
    return mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), scheme, 0, 0,
                       np.arange(batch), default_max_predictions(seq_len))


def hf_labels(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF-style MLM labels (-100 off the masked positions) of a truneg batch."""
    labels = torch.full_like(batch["original_ids"], -100)
    gold = batch["original_ids"].gather(1, batch["masked_positions"])
    return labels.scatter(1, batch["masked_positions"], torch.where(batch["masked_valid"], gold, -100))
