"""The held-out evaluation's cost at its defaults (--eval-max-sequences, one evaluation per checkpoint save), as a
share of the training time between two evaluations: from FLOPs for each shipped recipe, and measured on this CPU.

    python bench/eval_cost.py [--preset bert-base] [--seq-len 128] [--micro-batch 8] [--rounds 3]

FLOPs: an evaluation is a forward of each of its sequences (truneg.train.observe.flops: the encoder, the masked-only
head; ELECTRA's generator and discriminator), training between two evaluations is save_steps x global batch samples of
forward and backward. Measured: the same model and micro-batch in one process, a training step (forward, backward,
AdamW) and the evaluation (truneg.train.heldout.HeldOut) timed alternately; their per-sequence ratio projects the
share for the BERT-large recipe. Prints a table and a last line `RESULT flops_share=<bert-large>
measured_share=<bert-large, from this CPU's ratio> ratio=<eval / training time per sequence>`.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.data.masking import default_max_predictions, mask_tokens  # noqa: E402
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer  # noqa: E402
from truneg.train.config.run_config import EVAL_MAX_SEQUENCES  # noqa: E402
from truneg.train.heldout import HeldOut  # noqa: E402
from truneg.train.observe.flops import TRAINING_FACTOR, forward_flops, preset_sizes  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# the shipped recipes: (preset, seq_len, DeepSpeed config, save_steps) as launch/*.sh run them
RECIPES = {
    "bert-large (continued)": ("bert-large", 512, "bert_large_continued_a100_bf16_zero1.json", 5000),
    "bert-base (continued)": ("bert-base", 512, "bert_base_continued_a100_bf16_zero1.json", 5000),
    "electra-base (continued)": ("electra-base", 512, "electra_base_continued_a100_bf16_zero1.json", 5000),
}


def flops_share(preset: str, seq_len: int, global_batch: int, save_steps: int,
                sequences: int = EVAL_MAX_SEQUENCES) -> float:
    sizes, predictions = preset_sizes(preset), default_max_predictions(seq_len)
    evaluation = sequences * forward_flops(sizes, seq_len, predictions)
    training = save_steps * global_batch * TRAINING_FACTOR * forward_flops(sizes, seq_len, predictions)
    return evaluation / training


def measured_ratio(preset: str, seq_len: int, micro_batch: int, rounds: int) -> tuple[float, float, float]:
    """(eval seconds per sequence / training seconds per sequence, the two medians) on this machine."""
    tokenizer = load_tokenizer()
    text = (REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt").read_text()[:200_000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body, count = seq_len - 2, 4 * micro_batch
    blocks = np.array([[tokenizer.cls_token_id, *ids[i * body:(i + 1) * body], tokenizer.sep_token_id]
                       for i in range(count)], dtype=np.int32)
    torch.manual_seed(0)
    model = build_pretrainer(preset, ObjectiveConfig(), vocab_size=len(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)  # same weights every round
    scheme = model.scheme
    batch = mask_tokens(blocks[:micro_batch], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                        scheme, 0, 0, np.arange(micro_batch), default_max_predictions(seq_len))
    heldout = HeldOut(blocks, tokenizer, scheme, count, micro_batch, None)
    train_s, eval_s = [], []
    for round_ in range(rounds + 1):  # the first round warms up
        started = time.perf_counter()
        loss, _ = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train = (time.perf_counter() - started) / micro_batch
        started = time.perf_counter()
        heldout.evaluate(model)
        evaluation = (time.perf_counter() - started) / count
        if round_:
            train_s.append(train)
            eval_s.append(evaluation)
    train, evaluation = statistics.median(train_s), statistics.median(eval_s)
    return evaluation / train, evaluation, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bert-base", help="the model measured on this machine")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"evaluation: --eval-max-sequences {EVAL_MAX_SEQUENCES} (default), once per checkpoint save (default)")
    print(f"{'recipe':<26} {'seq':>4} {'batch':>6} {'save every':>10} {'eval share (FLOPs)':>19}")
    shares = {}
    for name, (preset, seq_len, config, save_steps) in RECIPES.items():
        batch = json.loads((REPO / "ds_configs" / config).read_text())["train_batch_size"]
        shares[name] = flops_share(preset, seq_len, batch, save_steps)
        print(f"{name:<26} {seq_len:>4} {batch:>6} {save_steps:>10} {100 * shares[name]:>18.3f}%")
    ratio, evaluation, train = measured_ratio(args.preset, args.seq_len, args.micro_batch, args.rounds)
    threads = torch.get_num_threads()
    print(f"measured here ({args.preset}, seq {args.seq_len}, micro-batch {args.micro_batch}, {threads} thread(s)): "
          f"eval {1e3 * evaluation:.1f} ms / sequence, training {1e3 * train:.1f} ms / sequence, "
          f"ratio {ratio:.3f} (FLOPs say {1 / TRAINING_FACTOR:.3f})")
    # the BERT-large recipe's share, with this machine's eval / training time per sequence
    preset, seq_len, config, save_steps = RECIPES["bert-large (continued)"]
    batch = json.loads((REPO / "ds_configs" / config).read_text())["train_batch_size"]
    measured = ratio * EVAL_MAX_SEQUENCES / (save_steps * batch)
    print(f"RESULT flops_share={shares['bert-large (continued)']:.5f} measured_share={measured:.5f} ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
