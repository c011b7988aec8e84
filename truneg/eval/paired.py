"""Each variant against the baseline, paired by fine-tuning seed: is a difference distinguishable from noise?

A fine-tuning seed fixes the classifier's start and the data order, so the runs of two variants under one seed are
a pair. Per task (and for the average over tasks), with d_s = variant_s - baseline_s over the seeds both have:
the mean of d, its 95 % t-interval (mean ± t(0.975, n-1) · sd / √n) and the paired t-test's two-sided p. An
interval that holds 0 is "within noise". Fewer than 2 pairs: no test. The same for SwapSynWordNet's drop.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from scipy import stats

from truneg.eval.variants import VARIANTS, variant_of_folder

CONFIDENCE = 0.95
ROBUSTNESS_FILE = "robustness.json"  # truneg ablation's VARIANT/robustness/TASK/robustness.json (median of seeds)


def paired(variant: dict[str, float], baseline: dict[str, float]) -> dict:
    """The comparison of two {seed: score} maps over the seeds both have: n, mean difference, its interval, p."""
    seeds = sorted(set(variant) & set(baseline))
    diffs = [variant[s] - baseline[s] for s in seeds]
    out = {"n": len(diffs), "mean": statistics.fmean(diffs) if diffs else None, "low": None, "high": None, "p": None}
    if len(diffs) >= 2:
        sd = statistics.stdev(diffs)
        half = stats.t.ppf(0.5 + CONFIDENCE / 2, len(diffs) - 1) * sd / math.sqrt(len(diffs))
        out.update(low=out["mean"] - half, high=out["mean"] + half,
                   p=float(stats.ttest_rel(*zip(*[(variant[s], baseline[s]) for s in seeds])).pvalue)
                   if sd > 0 else (1.0 if out["mean"] == 0 else 0.0))
    return out


def verdict(test: dict) -> str:
    if test["low"] is None:
        return "no test (< 2 paired seeds)"
    return "within noise" if test["low"] <= 0 <= test["high"] else ("better" if test["low"] > 0 else "worse")


def _row(variant: str, column: str, test: dict) -> list[str]:
    if test["mean"] is None:
        return [variant, column, "0", "–", "–", "–", verdict(test)]
    interval = "–" if test["low"] is None else f"[{test['low']:+.2f}, {test['high']:+.2f}]"
    p = "–" if test["p"] is None else f"{test['p']:.3f}"
    return [variant, column, str(test["n"]), f"{test['mean']:+.2f}", interval, p, verdict(test)]


HEADER = ["variant", "column", "pairs", "mean Δ", f"{CONFIDENCE:.0%} interval", "p (paired t)", "verdict"]


def write_glue_paired(columns: list[str], rows: list[dict], out: Path, footer: str, baseline: str) -> list[Path]:
    """report's GLUE rows (`by_seed` per column, `seed_averages`) as paired comparisons against the baseline."""
    base = next(r for r in rows if r["variant"] == baseline)
    table = []
    for row in rows:
        if row is base:
            continue
        for column in columns:
            table.append(_row(row["variant"], column, paired(row["by_seed"][column], base["by_seed"][column])))
        table.append(_row(row["variant"], "Average", paired(row["seed_averages"], base["seed_averages"])))
    return _write("glue_paired", f"GLUE dev: each variant minus {baseline}, paired by fine-tuning seed", table, out,
                  footer)


def gather_robustness(arguments: list[str]) -> dict[tuple[str, str], dict]:
    """{(variant, task): robustness.json} of the ablations' folders among the arguments."""
    found = {}
    for argument in arguments:
        root = Path(argument.rpartition("=")[2])
        for path in sorted(root.glob(f"*/robustness/*/{ROBUSTNESS_FILE}")):
            record = json.loads(path.read_text(encoding="utf-8"))
            found[(variant_of_folder(path.parents[2].name), record["task"])] = record
    return found


def write_robustness(found: dict[tuple[str, str], dict], out: Path, footer: str, baseline: str) -> list[Path]:
    """SwapSynWordNet (paper Table 5): per variant the median original and transformed scores and the drop, and
    each variant's drop minus the baseline's, paired by seed (a smaller drop is the more robust model)."""
    lines = ["| variant | task | seeds | original | transformed | drop | Δ drop vs baseline, 95 % interval | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    known = list(VARIANTS)
    for (variant, task), record in sorted(found.items(), key=lambda item: (
            item[0][1], item[0][0] != baseline, known.index(item[0][0]) if item[0][0] in known else len(known))):
        drops = {s: r["drop"] for s, r in record["per_seed"].items()}
        base = found.get((baseline, task))
        test = paired(drops, {s: r["drop"] for s, r in base["per_seed"].items()}) if base and variant != baseline \
            else None
        interval = "–" if test is None or test["low"] is None else (f"{test['mean']:+.2f} "
                                                                    f"[{test['low']:+.2f}, {test['high']:+.2f}]")
        lines.append(f"| {variant} | {task} | {len(drops)} | {record['original']:.2f} | {record['transformed']:.2f} | "
                     f"{record['drop']:.2f} | {interval} | {'–' if test is None else verdict(test)} |")
    (out / "robustness.md").write_text("\n".join([f"# SwapSynWordNet ({next(iter(found.values()))['examples']} "
                                                  "transformed dev examples; medians over seeds)", "", *lines, "",
                                                  footer]) + "\n", encoding="utf-8")
    return [out / "robustness.md"]


def _write(name: str, title: str, table: list[list[str]], out: Path, footer: str) -> list[Path]:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table]
    (out / f"{name}.md").write_text("\n".join([f"# {title}", "", *lines, "", footer]) + "\n", encoding="utf-8")
    with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(HEADER)
        writer.writerows(table)
    return [out / f"{name}.md", out / f"{name}.csv"]
