"""False negatives against MLM accuracy: the curve the paper does not show, drawn by `truneg report`.

Each fn-stats record (a checkpoint of a run) is a point: its argmax MLM accuracy, its iteration-level ratio (the
share of sequences with a corrected prediction) and its prediction-level ratio (the share of mismatched predictions
corrected), each with a 95 % Wilson interval over its own counts (masked positions, sequences, mismatches). The
paper reports no MLM accuracy, so its Table 2 ranges are drawn as horizontal bands, and the accuracy its Pred. band
implies is read off every run's points together by linear interpolation between neighbours in order of accuracy
(the first stretch of accuracy over which the curve lies in the band), or said to lie beyond the measured range.
Iter. also depends on the masks per sequence and on the segmentation, which the paper does not state.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path

from truneg.eval.figures import FN_LEVELS, false_negative_panels, save_with_footer

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
# Table 2 of the paper, over its checkpoints (percent): (low, high) of each model size's range
PAPER_BANDS = {"BERT-base": {"iter": (6.90, 7.07), "pred": (1.31, 1.41)},
               "BERT-large": {"iter": (7.31, 7.58), "pred": (1.49, 1.60)}}
# a ratio's (successes, trials) in an fn-stats record
COUNTS = {"accuracy": ("mlm_correct", "masked"), "iter": ("sequences_corrected", "sequences"),
          "pred": ("corrected", "mismatched")}


def wilson(successes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion, as fractions; (0, 1) without trials."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    return max(0.0, centre - half), min(1.0, centre + half)


def curve_points(fn_runs: dict[str, list[dict]]) -> list[dict]:
    """One point per fn-stats record that carries its counts (Table 2 live's records from metrics.jsonl do not):
    run, step, and for accuracy, iter and pred the value, low and high in percent."""
    points = []
    for run, records in fn_runs.items():
        for record in sorted(records, key=lambda r: r.get("step", -1)):
            if not all(k in record for pair in COUNTS.values() for k in pair) or not record["masked"]:
                continue
            point = {"run": run, "step": record.get("step")}
            for key, (hits, trials) in COUNTS.items():
                low, high = wilson(record[hits], record[trials])
                point[key] = 100 * record[hits] / record[trials] if record[trials] else None
                point[f"{key}_low"], point[f"{key}_high"] = 100 * low, 100 * high
            points.append(point)
    return points


def implied_accuracy(points: list[dict], band: tuple[float, float], key: str = "pred") -> str:
    """The accuracies at which the measured curve (every run's points together, linear between neighbours in order
    of accuracy) lies within `band`: its first stretch there, or why there is none."""
    ordered = sorted((p["accuracy"], p[key]) for p in points if p[key] is not None)
    if not ordered:
        return "no measured point"
    low, high = band
    stretches = [(a, a) for a, y in ordered[:1] if low <= y <= high]
    for (a0, y0), (a1, y1) in zip(ordered, ordered[1:]):
        if y0 == y1:  # flat: inside the band throughout, or nowhere
            stretches += [(a0, a1)] if low <= y0 <= high else []
            continue
        t0, t1 = sorted(((low - y0) / (y1 - y0), (high - y0) / (y1 - y0)))
        t0, t1 = max(0.0, t0), min(1.0, t1)
        if t0 <= t1:
            stretches.append((a0 + t0 * (a1 - a0), a0 + t1 * (a1 - a0)))
    if not stretches:
        top = max(ordered, key=lambda point: point[1])
        if top[1] < low:
            return f"beyond the measured range (maximum {top[1]:.2f} % at {top[0]:.1f} % accuracy)"
        return f"below the measured range (the curve stays above the band, from {min(y for _, y in ordered):.2f} %)"
    first, last = stretches[0]
    for begin, end in stretches[1:]:  # the stretches that continue the first one
        if begin > last + 1e-9:
            break
        last = max(last, end)
    return f"{first:.1f} % MLM accuracy" if last - first < 0.05 else f"{first:.1f}-{last:.1f} % MLM accuracy"


def _arms(points: list[dict], key: str) -> list[list[float]]:
    """The error bars' lengths below and above each value (never negative: an end of the interval may round past a
    value of 0 or 100 %)."""
    return [[max(0.0, p[key] - p[f"{key}_low"]) for p in points], [max(0.0, p[f"{key}_high"] - p[key]) for p in points]]


def write_curve(points: list[dict], out: Path, footer: str) -> list[Path]:
    """false_negatives_accuracy.{md,csv,png}: the points with their intervals, the paper's bands and what they
    imply."""
    header = ["run", "step", *(f"{k}{s}" for k in COUNTS for s in ("", "_low", "_high"))]
    with open(out / "false_negatives_accuracy.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        for p in points:
            writer.writerow(["" if p[h] is None else (round(p[h], 4) if isinstance(p[h], float) else p[h])
                             for h in header])
    interval = "{:.2f} [{:.2f}, {:.2f}]".format
    lines = ["# False negatives against MLM accuracy", "",
             "Each checkpoint's fn-stats: value [95 % Wilson interval], in percent.", "",
             "| run | step | MLM acc. | Iter. | Pred. |", "|---|---|---|---|---|"]
    for p in points:
        cells = [interval(p[k], p[f"{k}_low"], p[f"{k}_high"]) if p[k] is not None else "–" for k in COUNTS]
        lines.append(f"| {p['run']} | {p['step']} | {' | '.join(cells)} |")
    lines += ["", "The paper's Table 2 gives no MLM accuracy; the accuracy its Pred. range implies under this curve "
              "(every run's points together, linear between neighbours in order of accuracy):", ""]
    lines += [f"- {size} (Pred. {band['pred'][0]:.2f}-{band['pred'][1]:.2f} %): "
              f"{implied_accuracy(points, band['pred'])}" for size, band in PAPER_BANDS.items()]
    lines += ["", "Iter. depends on the masks per sequence and on the segmentation, which the paper does not state.",
              "", footer]
    (out / "false_negatives_accuracy.md").write_text("\n".join(lines) + "\n", encoding="utf-8")

    figure, axes = false_negative_panels("MLM accuracy (%)")
    for ax, key in zip(axes, FN_LEVELS):
        for (size, band), colour in zip(PAPER_BANDS.items(), ("tab:gray", "tab:olive")):
            ax.axhspan(*band[key], color=colour, alpha=0.3, label=f"paper, {size}")
        for run in dict.fromkeys(p["run"] for p in points):
            shown = [p for p in points if p["run"] == run and p[key] is not None]
            ax.errorbar([p["accuracy"] for p in shown], [p[key] for p in shown], fmt="o-", capsize=2, label=run,
                        xerr=_arms(shown, "accuracy"), yerr=_arms(shown, key))
    axes[0].legend(fontsize=6)
    save_with_footer(figure, footer, out / "false_negatives_accuracy.png")
    return [out / f"false_negatives_accuracy.{ext}" for ext in ("md", "csv", "png")]
