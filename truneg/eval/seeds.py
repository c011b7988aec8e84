"""Fine-tuning over several seeds: each seed in its own folder, then the median, mean and spread.

    truneg finetune glue --task rte --model runs/demo/hf --data-dir GLUE/RTE --output-dir runs/rte --seeds 1,2,3

GLUE dev scores of one fine-tuning vary by more than the gains under test on the small tasks, so ELECTRA
reports the median over runs: `results.json` holds every seed's metrics and names the median as the reported
number (its values are also at the top level, where a one-seed results.json has its own).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

from truneg.errors import UserError

# Scores that are summarised over seeds (a `_mm` suffix: MNLI's mismatched dev set); the rest of a result is
# the recipe, which must be the same for every seed.
METRICS = ("accuracy", "f1", "matthews_correlation", "pearson", "spearmanr", "exact_match")
RECIPE_KEYS = ("task", "epochs", "lr", "batch_size", "layerwise_decay", "warmup_ratio", "max_seq_len", "doc_stride",
               "train_samples", "max_train_samples")
NONE_IS_A_VALUE = ("max_train_samples",)  # None: every training example, not "not given"
REPORTED = "median"


def seed_dir(output_dir: Path, seed: int) -> Path:
    return output_dir / f"seed-{seed}"


def parse_seeds(text: str) -> list[int]:
    """`--seeds 1,2,3`: distinct integers >= 0, in the order given."""
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,3)") from None
    if not seeds or any(s < 0 for s in seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more seeds >= 0, e.g. 1,2,3")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r} names a seed twice")
    return seeds


def is_metric(key: str) -> bool:
    return key.removesuffix("_mm") in METRICS


def summarize(per_seed: dict[int, dict]) -> dict[str, dict[str, float | None]]:
    """Median, mean and sample standard deviation (None for one seed) of each metric every seed has. A NaN (STS-B's
    correlations of a constant prediction) is left out, as no score; a metric NaN in every seed stays NaN."""
    runs = list(per_seed.values())
    keys = [k for k in runs[0] if is_metric(k) and all(isinstance(r.get(k), (int, float)) for r in runs)]
    values = {k: [float(r[k]) for r in runs if math.isfinite(r[k])] for k in keys}
    return {"median": {k: statistics.median(v) if v else math.nan for k, v in values.items()},
            "mean": {k: statistics.fmean(v) if v else math.nan for k, v in values.items()},
            "std": {k: statistics.stdev(v) if len(v) > 1 else None for k, v in values.items()}}


def combine(per_seed: dict[int, dict]) -> dict:
    """results.json of several seeds: the recipe, the median's metrics at the top, and every seed's."""
    first = next(iter(per_seed.values()))
    summary = summarize(per_seed)
    recipe = {k: v for k, v in first.items() if not is_metric(k) and k != "seed"}
    return {**recipe, **summary[REPORTED], "reported": REPORTED, "seeds": list(per_seed), **summary,
            "per_seed": {str(seed): result for seed, result in per_seed.items()}}


def _check_same_recipe(done: dict, expect: dict, folder: Path) -> None:
    differ = [f"{k} {done[k]} (now {expect[k]})" for k in RECIPE_KEYS
              if k in done and k in expect and (expect[k] is not None or k in NONE_IS_A_VALUE) and done[k] != expect[k]]
    if differ:
        raise UserError(f"{folder} was fine-tuned with {', '.join(differ)}; give the same flags to continue it, or "
                        "another --output-dir")


def _finished(path: Path) -> dict | None:
    """A seed's results.json, or None where the seed is not done: no file, or one that a kill cut mid-write."""
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return result if isinstance(result, dict) else None


def run_seeds(run_one: Callable[[int, Path], dict], seeds: Iterable[int], output_dir: str | Path,
              expect: dict | None = None) -> dict:
    """Run `run_one(seed, folder)` for each seed not already done (its folder's results.json: a killed run skips
    them), then write and return the combined results.json. `expect`: recipe values a finished seed must share."""
    output_dir = Path(output_dir)
    per_seed: dict[int, dict] = {}
    for seed in seeds:
        done = seed_dir(output_dir, seed) / "results.json"
        result = _finished(done)
        if result is not None:
            per_seed[seed] = result
            _check_same_recipe(per_seed[seed], expect or {}, done.parent)
        else:
            per_seed[seed] = run_one(seed, seed_dir(output_dir, seed))
    results = combine(per_seed)
    if os.environ.get("RANK", "0") == "0":  # under `deepspeed -m truneg.cli finetune`, one rank writes
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results
