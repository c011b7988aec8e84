"""Each variant against the baseline, paired by fine-tuning seed: is a difference distinguishable from noise?

A fine-tuning seed fixes the classifier's start and the data order, so the runs of two variants under one seed are
a pair. Per task (and for the average over tasks), with d_s = variant_s - baseline_s over the seeds both have:
the mean of d, its 95 % t-interval (mean ± t(0.975, n-1) · sd / √n, the size of the difference) and the p of an
exact two-sided sign-flip test (`sign_flip_p`), which the verdict follows: p < 0.05 is "better" or "worse" by the
mean's sign, else "within noise". With n pairs that p is never below 2/2^n, so fewer than 6 seeds never read
"better" or "worse". No test: fewer than 2 pairs, or differences equal up to RESOLUTION (their
spread is then no estimate of the noise). The same for SwapSynWordNet's drop.
"""
from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import numpy as np

from truneg.eval.variants import VARIANTS, variant_of_folder

CONFIDENCE = 0.95
# Scores are percentages printed to 0.01: differences whose spread is under half of that are one value (0.1 from
# 90.1 - 90.0 and from 90.2 - 90.1 differ by float rounding alone), and a table could not show their spread.
RESOLUTION = 0.005
EXACT_UP_TO = 16  # pairs: all 2^n sign assignments (65,536 at 16); beyond, a fixed random draw of that many
NO_PAIRS = "no test (< 2 paired seeds)"
EQUAL = "no test (equal differences)"
ROBUSTNESS_FILE = "robustness.json"  # truneg ablation's VARIANT/robustness/TASK/robustness.json (median of seeds)


def sign_flip_p(diffs: list[float]) -> float:
    """The exact two-sided sign-flip (randomization) test of paired differences: under "no difference" each d_s is
    as likely +|d_s| as -|d_s|, so p is the share of the 2^n sign assignments whose |sum| is at least the observed
    |sum| (a sum and its negation count alike, so p >= 2/2^n). Past EXACT_UP_TO pairs, a fixed random draw of
    2^EXACT_UP_TO assignments gives (1 + hits) / (1 + draws)."""
    d = np.asarray(diffs, dtype=float)
    if len(d) <= EXACT_UP_TO:
        signs = 1 - 2 * ((np.arange(2 ** len(d))[:, None] >> np.arange(len(d))) & 1)  # every assignment
    else:
        signs = np.random.default_rng(0).choice([-1, 1], size=(2 ** EXACT_UP_TO, len(d)))
    # a sum of the same terms in another order may differ in its last bits: those count as ties
    hits = int(np.count_nonzero(np.abs(signs @ d) >= abs(d.sum()) - 1e-9))
    return hits / len(signs) if len(d) <= EXACT_UP_TO else (1 + hits) / (1 + len(signs))


def paired(variant: dict[str, float], baseline: dict[str, float]) -> dict:
    """The comparison of two {seed: score} maps over the seeds both have: n, the mean difference and, where tested
    (see the module's docstring), its 95 % t-interval (low, high) and the sign-flip test's p; None where not; sd:
    the differences' standard deviation (2 pairs or more)."""
    seeds = sorted(set(variant) & set(baseline))
    diffs = [variant[s] - baseline[s] for s in seeds]
    out = {"n": len(diffs), "mean": statistics.fmean(diffs) if diffs else None, "low": None, "high": None, "p": None,
           "sd": statistics.stdev(diffs) if len(diffs) >= 2 else None}
    if len(diffs) >= 2 and max(diffs) - min(diffs) >= RESOLUTION:
        from scipy import stats  # (a second of imports: `truneg report` of runs without seeds to pair pays none)

        half = stats.t.ppf(0.5 + CONFIDENCE / 2, len(diffs) - 1) * out["sd"] / math.sqrt(len(diffs))
        out.update(low=out["mean"] - half, high=out["mean"] + half, p=sign_flip_p(diffs))
    return out


def verdict(test: dict) -> str:
    """The test's reading: no test (and why), within noise (p >= 0.05), else better or worse by the mean's sign."""
    if test["p"] is None:
        return NO_PAIRS if test["n"] < 2 else EQUAL
    if test["p"] >= 1 - CONFIDENCE:
        return "within noise"
    return "better" if test["mean"] > 0 else "worse"


def _row(variant: str, column: str, test: dict) -> list[str]:
    if test["mean"] is None:
        return [variant, column, "0", "–", "–", "–", verdict(test)]
    interval = "–" if test["low"] is None else f"[{test['low']:+.2f}, {test['high']:+.2f}]"
    p = "–" if test["p"] is None else f"{test['p']:.3f}"
    return [variant, column, str(test["n"]), f"{test['mean']:+.2f}", interval, p, verdict(test)]


HEADER = ["variant", "column", "pairs", "mean Δ", f"{CONFIDENCE:.0%} t-interval", "p (sign-flip)", "verdict"]
CAPTION = (f"Δ: the mean over the seeds both rows have of the per-seed difference, with its {CONFIDENCE:.0%} "
           f"t-interval. p: exact two-sided sign-flip test over those differences (never below 2/2^pairs); "
           f"p < {1 - CONFIDENCE:.2f} reads better or worse, else within noise. No test: fewer than 2 paired seeds, "
           f"or differences that spread less than {RESOLUTION} points (equal at the tables' resolution).")


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
                  CAPTION + "\n\n" + footer)


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
    lines = [f"| variant | task | seeds | original | transformed | drop | Δ drop vs baseline, {CONFIDENCE:.0%} "
             "t-interval | p (sign-flip) | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    known = list(VARIANTS)
    for (variant, task), record in sorted(found.items(), key=lambda item: (
            item[0][1], item[0][0] != baseline, known.index(item[0][0]) if item[0][0] in known else len(known))):
        drops = {s: r["drop"] for s, r in record["per_seed"].items()}
        base = found.get((baseline, task))
        test = paired(drops, {s: r["drop"] for s, r in base["per_seed"].items()}) if base and variant != baseline \
            else None
        mean, interval, p, mark = ["–"] * 4 if test is None else _row(variant, task, test)[3:]
        shown = mean if interval == "–" else f"{mean} {interval}"  # a mean without a test stands alone
        lines.append(f"| {variant} | {task} | {len(drops)} | {record['original']:.2f} | {record['transformed']:.2f} | "
                     f"{record['drop']:.2f} | {shown} | {p} | {mark} |")
    (out / "robustness.md").write_text("\n".join([f"# SwapSynWordNet ({next(iter(found.values()))['examples']} "
                                                  "transformed dev examples; medians over seeds)", "", *lines, "",
                                                  CAPTION, "", footer]) + "\n", encoding="utf-8")
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
