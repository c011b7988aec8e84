"""Step-time overhead of HC and SR: the same model, batch and seed in one process, variants interleaved.

    python bench/hc_sr_overhead.py [--presets electra-small,bert-base] [--batch 8] [--steps 10] \
        [--sr-sent-target masked|original]

A step is forward + backward + AdamW step at seq 128, like a training step. Every variant is the same
model (same weights: AdamW at lr 0) on the same masked batch, only its objective switched; the variants
run in a new random order each round, so that drift of the machine, and what one variant leaves behind
for the next (the extra encoder pass of sr_sent), fall on all of them alike. Prints a table per preset, HC's and SR's
own operations timed alone (a second estimate, without the step's noise), and a last line
`RESULT hc=<ratio> sr=<ratio> hc_sr=<ratio> sr_sent=<ratio>` (the bert-base ratios when it ran: the
median over rounds of each round's step time over the same round's baseline).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.masked_batch import real_batch  # noqa: E402
from truneg.data.blocks import load_tokenizer  # noqa: E402
from truneg.model.objectives import hard_correction, soft_regularization  # noqa: E402
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer  # noqa: E402
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable  # noqa: E402

VARIANTS = {
    "baseline": dict(hc=False, sr="none"),
    "hc": dict(hc=True, sr="none"),
    "sr": dict(hc=False, sr="word"),
    "hc_sr": dict(hc=True, sr="word"),
    "sr_sent": dict(hc=False, sr="sent"),
}


def bench_preset(preset: str, batch_size: int, steps: int, lookup: SynonymLookup) -> dict[str, float]:
    torch.manual_seed(0)
    model = build_pretrainer(preset, ObjectiveConfig()).train()
    batch = real_batch(load_tokenizer(), batch_size, 128, model.scheme)
    # One model for every variant: the same weights, in the same memory, so that only the objective differs
    # between them. AdamW at lr 0 does a full step's work (its weight decay included: a multiply by 1 - lr x wd)
    # and leaves the weights as they are.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.01)
    objectives = {name: ObjectiveConfig(hc_lookup=lookup if v["hc"] else None, sr=v["sr"],
                                        sr_sent_target=v.get("target", "masked")) for name, v in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for step in range(steps + 1):  # step 0 warms up
        order = list(VARIANTS)
        random.Random(step).shuffle(order)  # which variant runs first, and which runs after which
        for name in order:
            model.set_objective(objectives[name])
            torch.manual_seed(step)
            start = time.perf_counter()
            loss, _ = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step:
                times[name].append(time.perf_counter() - start)
    # Paired: each round's variant over the same round's baseline (drift of the machine cancels within a
    # round), then the median over rounds; the spread of those per-round ratios is the bench's own noise.
    ratios = {name: sorted(t / b for t, b in zip(times[name], times["baseline"])) for name in VARIANTS}
    medians = {name: statistics.median(t) for name, t in times.items()}
    # An estimate without the step's noise: HC's and SR's own operations timed alone, over the median step.
    own = own_operations_ms(model, batch, lookup)
    print(f"\n{preset}, batch {batch_size}, seq 128, {torch.get_num_threads()} threads, {steps} rounds")
    print(f"{'variant':<10} {'step ms':>9} {'ratio':>7} {'quartiles of round ratios':>27}")
    for name, seconds in medians.items():
        r = ratios[name]
        print(f"{name:<10} {1e3 * seconds:>9.1f} {statistics.median(r):>7.3f} "
              f"{r[len(r) // 4]:>13.3f} - {r[(3 * len(r)) // 4]:.3f}")
    for name, ms in own.items():
        print(f"{name} alone: {ms:.2f} ms = {1 + ms / (1e3 * medians['baseline']):.4f} of the baseline step")
    return {name: statistics.median(r) for name, r in ratios.items()}


def own_operations_ms(model, batch: dict[str, torch.Tensor], lookup: SynonymLookup,
                      repeats: int = 20) -> dict[str, float]:
    """Milliseconds of what HC and SR add to a step, timed alone on the batch's slots: HC's synonym lookup and
    mask; SR's lookup, cosine and backward, summed into a gradient the embedding already has."""
    gold = batch["original_ids"].gather(1, batch["masked_positions"])
    pred = gold.roll(1, dims=1)  # mostly different tokens, like early predictions
    valid = batch["masked_valid"]
    weight = model.word_embeddings.weight

    def hc():
        hard_correction(gold, pred, lookup) & valid

    def sr():
        soft_regularization(weight, gold, pred, valid).backward()

    weight.grad = torch.zeros_like(weight)
    timings = {}
    for name, operation in (("HC", hc), ("SR", sr)):
        operation()
        start = time.perf_counter()
        for _ in range(repeats):
            operation()
        timings[name] = 1e3 * (time.perf_counter() - start) / repeats
    weight.grad = None
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="electra-small,bert-base")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sr-sent-target", choices=["masked", "original"], default="masked")
    args = parser.parse_args()
    VARIANTS["sr_sent"]["target"] = args.sr_sent_target
    lookup = SynonymLookup(SynonymTable.load(SHIPPED_WORDNET_TABLE))
    by_preset = {preset: bench_preset(preset, args.batch, args.steps, lookup) for preset in args.presets.split(",")}
    ratios = by_preset.get("bert-base") or list(by_preset.values())[-1]
    print(f"RESULT hc={ratios['hc']:.3f} sr={ratios['sr']:.3f} hc_sr={ratios['hc_sr']:.3f} "
          f"sr_sent={ratios['sr_sent']:.3f}")


if __name__ == "__main__":
    main()
