"""`truneg report RESULTS_DIR... --out DIR`: the paper's Tables 3 / 6 (GLUE) and 2 (false negatives) from result
files written anywhere (each variant may have run as its own cluster job).

    truneg report runs/ablation --out runs/report
    truneg report baseline=runs/base HC=runs/hc --out runs/report --tasks rte,mrpc

It reads every `results.json` (`finetune`, one seed or `--seeds`), `ablation.json`, `fn_stats.json` and the
ablation's `VARIANT/robustness/TASK/robustness.json` under each folder; each variant is also set against the
baseline paired by seed (paired.py). A result's variant is the NAME of a `NAME=DIR` argument, else the folder it
sits in under DIR (`HC/glue/rte/results.json`: HC; the ablation's folder HC_SR is HC+SR), else DIR's own name.
Scores are in percent; a cell is the median over seeds with their standard deviation; a score that is not there is
shown as missing (an empty CSV cell, `–` in markdown), never as zero.
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from truneg.errors import UserError
from truneg.eval.accuracy_curve import curve_points, write_curve
from truneg.eval.figures import FN_LEVELS, false_negative_panels, save_with_footer
from truneg.eval.live_report import check_one_table, fn_stats_rows, live_evaluations, write_eval
from truneg.eval.paired import gather_robustness, paired, write_glue_paired, write_robustness
from truneg.eval.variants import AVERAGED, BASELINE, GLUE_COLUMNS, VARIANTS, variant_of_folder

# Folders a result file sits in that name no variant (the ablation's layout: VARIANT/glue/TASK, VARIANT/fn)
LAYOUT_FOLDERS = {"glue", "squad", "fn", "fn-stats", "fn_stats"}
MISSING = "–"
GLUE_CAPTION = ("Cells: median over seeds ± their standard deviation. Average: the mean of the columns' medians "
                "(MNLI once, matched). Δ: the mean over the seeds both rows have of the per-seed difference of "
                "averages ± its standard deviation (glue_paired.md's Average row; – where they share no seed); it need "
                "not equal the difference of the Average column.")


@dataclass
class Found:
    glue: dict[tuple[str, str], dict[str, dict]] = field(default_factory=dict)  # (variant, task): {seed: results}
    sources: dict[tuple[str, str], Path] = field(default_factory=dict)
    fn_runs: dict[str, list[dict]] = field(default_factory=dict)  # run: fn_stats.json rows
    eval_runs: dict[str, list[dict]] = field(default_factory=dict)  # run: its live evaluations (metrics.jsonl)
    variants: list[str] = field(default_factory=list)  # as ablation.json lists them (expected rows)
    tasks: list[str] = field(default_factory=list)


def _load(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not readable JSON ({type(err).__name__}: {err})") from None


def _variant(path: Path, root: Path, name: str | None, folders: dict[str, str], depth: int) -> str:
    """depth: the folders below the variant's that name none (GLUE: the task's; 0 for fn_stats.json)."""
    if name:
        return name
    parts = [p for p in path.relative_to(root).parent.parts if p not in LAYOUT_FOLDERS]
    if parts and parts[0] in folders:
        return folders[parts[0]]
    if len(parts) > depth:
        return variant_of_folder(parts[0])
    return variant_of_folder(root.resolve().name)


def _per_seed(results: dict, path: Path) -> tuple[str, dict[str, dict]]:
    if not isinstance(results, dict) or "task" not in results:
        raise UserError(f"{path} is not a GLUE results.json of `truneg finetune glue` (no \"task\")")
    if "per_seed" in results:
        return results["task"], dict(results["per_seed"])
    return results["task"], {str(results.get("seed", "?")): results}


def gather(arguments: list[str]) -> Found:
    """Every result file under the RESULTS_DIR arguments (`NAME=DIR` names the variant)."""
    found = Found()
    for argument in arguments:
        name, _, folder = argument.rpartition("=") if "=" in argument else ("", "", argument)
        root = Path(folder)
        if not root.is_dir():
            raise UserError(f"{argument}: {root} is not a folder; pass folders that hold results.json, "
                            "ablation.json or fn_stats.json")
        folders: dict[str, str] = {}
        for ablation in sorted(root.rglob("ablation.json")):
            record = _load(ablation)
            folders.update({f: v for v, f in record.get("variants", {}).items()})
            found.variants += [v for v in record.get("variants", {}) if v not in found.variants]
            found.tasks += [t for t in record.get("tasks", []) if t not in found.tasks]
        for path in sorted(root.rglob("results.json")):
            if path.parent.name.startswith("seed-") and (path.parent.parent / "results.json").is_file():
                continue  # one seed of a --seeds run: its results.json has them all
            results = _load(path)
            if isinstance(results, dict) and "task" not in results and "exact_match" in results:
                continue  # SQuAD: not part of these tables
            if path.parent.name.startswith("seed-"):
                continue  # a --seeds run cut short: no combined results yet, its task shows as missing
            task, per_seed = _per_seed(results, path)
            key = (_variant(path, root, name, folders, 1), task)
            if key in found.glue:
                raise UserError(f"{key[0]} {key[1]} has two results: {found.sources[key]} and {path}; pass the "
                                "folders of one run each, or name them NAME=DIR")
            found.glue[key], found.sources[key] = per_seed, path
        for path in sorted(root.rglob("fn_stats.json")):
            rows = _load(path)
            run = _variant(path, root, name, folders, 0)
            if run in found.fn_runs:
                raise UserError(f"{path}: a second fn_stats.json of {run}; pass each run's folder as NAME=DIR")
            found.fn_runs[run] = rows
        for path in sorted(root.rglob("metrics.jsonl")):  # a pre-training run's, with --eval-data's records
            if records := live_evaluations(path):
                run = _variant(path, root, name, folders, 0)
                if run in found.eval_runs:
                    raise UserError(f"{path}: a second run's evaluations for {run}; pass each run's folder as "
                                    "NAME=DIR")
                found.eval_runs[run] = records
    return found


def _order(names) -> list[str]:
    known = list(VARIANTS)
    return sorted(set(names), key=lambda v: (v != BASELINE, known.index(v) if v in known else len(known), v))


def _values(per_seed: dict[str, dict], metric: str) -> dict[str, float]:
    """Each seed's score in percent; a NaN (STS-B's correlations of a constant prediction) is no score."""
    return {s: 100 * float(r[metric]) for s, r in per_seed.items()
            if isinstance(r.get(metric), (int, float)) and math.isfinite(r[metric])}


def _std(values) -> float | None:
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else None


def glue_rows(found: Found, tasks: list[str], baseline: str = BASELINE) -> tuple[list[str], list[dict]]:
    """The GLUE table: columns, and per variant each column's median and std over seeds, the average (of the
    medians over the averaged columns; missing if one is), and the Δ against the baseline with its spread: the mean
    and std over the seeds both rows have of the per-seed difference of averages (glue_paired's Average row)."""
    columns = [(task, column, metric) for task, column, metric in GLUE_COLUMNS if task in tasks]
    averaged = [c for _, c, _ in columns if c in AVERAGED]
    variants = _order([v for v, _ in found.glue] + found.variants + [baseline])
    rows = []
    for variant in variants:
        row: dict = {"variant": variant, "cells": {}, "by_seed": {}}
        for task, column, metric in columns:
            values = _values(found.glue.get((variant, task), {}), metric)
            row["by_seed"][column] = values
            row["cells"][column] = (statistics.median(values.values()), _std(values.values()),
                                    len(values)) if values else None
        complete = averaged and all(row["cells"][c] for c in averaged)
        row["average"] = statistics.fmean(row["cells"][c][0] for c in averaged) if complete else None
        seeds = set.intersection(*(set(row["by_seed"][c]) for c in averaged)) if complete else set()
        row["seed_averages"] = {s: statistics.fmean(row["by_seed"][c][s] for c in averaged) for s in seeds}
        row["seeds"] = max((cell[2] for cell in row["cells"].values() if cell), default=0)
        rows.append(row)
    base = next(r for r in rows if r["variant"] == baseline)
    for row in rows:
        # one estimator for Δ and its spread: a difference of the averages of medians would pair no seeds
        test = paired(row["seed_averages"], base["seed_averages"]) if row is not base else {"mean": None, "sd": None}
        row["delta"], row["delta_std"] = test["mean"], test["sd"]
    return [c for _, c, _ in columns], rows


def _fmt(value: float | None, spread: float | None = None, sign: bool = False) -> str:
    if value is None:
        return MISSING
    text = f"{value:+.2f}" if sign else f"{value:.2f}"
    return text + (f" ± {spread:.2f}" if spread is not None else "")


def _blank(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def write_glue(columns: list[str], rows: list[dict], out: Path, footer: str, baseline: str) -> list[Path]:
    header = ["variant", "seeds", *columns, "Average", f"Δ vs {baseline}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_fmt(*row["cells"][c][:2]) if row["cells"][c] else MISSING for c in columns]
        delta = "–" if row["variant"] == baseline else _fmt(row["delta"], row["delta_std"], sign=True)
        lines.append("| " + " | ".join([row["variant"], str(row["seeds"] or MISSING), *cells, _fmt(row["average"]),
                                        delta]) + " |")
    (out / "glue.md").write_text("\n".join(["# GLUE dev (paper Tables 3 and 6)", "", *lines, "", GLUE_CAPTION, "",
                                            footer]) + "\n", encoding="utf-8")
    with open(out / "glue.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["variant", "seeds", *[f"{c}{s}" for c in columns for s in ("", "_std")], "average", "delta",
                         "delta_std"])
        for row in rows:
            cells = [_blank(row["cells"][c][i]) if row["cells"][c] else "" for c in columns for i in (0, 1)]
            writer.writerow([row["variant"], row["seeds"] or "", *cells, _blank(row["average"]), _blank(row["delta"]),
                             _blank(row["delta_std"])])
    figure = Figure(figsize=(6.4, 4))
    ax = figure.subplots()
    others = [r for r in rows if r["variant"] != baseline]
    for i, row in enumerate(others):
        if row["delta"] is None:
            ax.text(i, 0, "missing", ha="center", va="bottom", fontsize=8)
        else:
            ax.bar(i, row["delta"], yerr=row["delta_std"], capsize=4, color="tab:blue")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlim(-0.6, max(len(others), 1) - 0.4)
    ax.set_xticks(range(len(others)), [r["variant"] for r in others])
    ax.set_ylabel(f"Δ average GLUE dev vs {baseline} (points)")
    ax.set_title("Each variant's mean per-seed change (bars: std over paired seeds)")
    save_with_footer(figure, footer, out / "glue_deltas.png", width=150, margin=0.05)
    return [out / "glue.md", out / "glue.csv", out / "glue_deltas.png"]


def fn_rows(found: Found) -> list[dict]:
    """Table 2: per run and checkpoint, the share of training done (step / the run's last evaluated step) and
    the iteration- and prediction-level ratios in percent; a run expected but not found is one missing row."""
    rows = []
    for run in _order(list(found.fn_runs) + [v for v in found.variants if found.fn_runs]):
        entries = found.fn_runs.get(run)
        if not entries:
            rows.append({"run": run, "checkpoint": None, "step": None, "progress": None, "iter": None, "pred": None,
                         "accuracy": None})
            continue
        last = max((e.get("step", -1) for e in entries), default=-1)
        for e in sorted(entries, key=lambda e: e.get("step", -1)):
            counted = e.get("sequences", 0) > 0
            rows.append({"run": run, "checkpoint": Path(e["checkpoint"]).name if e.get("checkpoint") else None,
                         "step": e.get("step"),
                         "progress": 100 * e["step"] / last if last > 0 and e.get("step", -1) >= 0 else None,
                         "iter": 100 * e["iter_ratio"] if counted else None,
                         "pred": 100 * e["pred_ratio"] if counted and e.get("mismatched", 0) else None,
                         "accuracy": 100 * e["mlm_accuracy"] if counted and "mlm_accuracy" in e else None})
    return rows


def write_fn(rows: list[dict], out: Path, footer: str) -> list[Path]:
    lines = ["| run | checkpoint | step | Check. (%) | Iter. (%) | Pred. (%) | MLM acc. (%) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['checkpoint'] or MISSING} | {MISSING if r['step'] is None else r['step']} | "
                     f"{_fmt(r['progress'])} | {_fmt(r['iter'])} | {_fmt(r['pred'])} | {_fmt(r['accuracy'])} |")
    (out / "false_negatives.md").write_text("\n".join(["# False negatives over training (paper Table 2)", "", *lines,
                                                       "", footer]) + "\n", encoding="utf-8")
    with open(out / "false_negatives.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", "checkpoint", "step", "progress_pct", "iter_pct", "pred_pct", "mlm_accuracy_pct"])
        for r in rows:
            writer.writerow([r["run"], r["checkpoint"] or "", "" if r["step"] is None else r["step"],
                             _blank(r["progress"]), _blank(r["iter"]), _blank(r["pred"]), _blank(r["accuracy"])])
    figure, axes = false_negative_panels("checkpoint (% of training)")
    for run in dict.fromkeys(r["run"] for r in rows):
        points = [r for r in rows if r["run"] == run and r["progress"] is not None]
        for ax, key in zip(axes, FN_LEVELS) if points else ():
            shown = [p for p in points if p[key] is not None]
            ax.plot([p["progress"] for p in shown], [p[key] for p in shown], "o-", label=run)
    axes[0].legend(fontsize=7)
    save_with_footer(figure, footer, out / "false_negatives.png")
    return [out / "false_negatives.md", out / "false_negatives.csv", out / "false_negatives.png"]


def report(arguments: list[str], out: str | Path, tasks: list[str] | None = None, baseline: str = BASELINE,
           command: str = "truneg report") -> list[Path]:
    """Write the tables that the results found allow; return the files written."""
    found = gather(arguments)
    check_one_table(found.eval_runs)  # Table 2 live compares runs counted with one table only
    for run, records in found.eval_runs.items():  # Table 2 live, for a run without fn_stats.json
        found.fn_runs.setdefault(run, fn_stats_rows(records))
    if not found.glue and not found.fn_runs:
        raise UserError(f"no results.json (GLUE), fn_stats.json or evaluations in metrics.jsonl under "
                        f"{' '.join(arguments)}")
    known = {t for t, _, _ in GLUE_COLUMNS}
    if tasks and set(tasks) - known:
        raise UserError(f"--tasks: unknown GLUE task(s) {', '.join(sorted(set(tasks) - known))}; choose from "
                        f"{', '.join(sorted(known))}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    footer = f"{command}  ({datetime.datetime.now(datetime.UTC):%Y-%m-%d})"
    written = []
    if found.glue:
        tasks = tasks or found.tasks or list(dict.fromkeys(t for t, _, _ in GLUE_COLUMNS))
        columns, rows = glue_rows(found, tasks, baseline)
        written += write_glue(columns, rows, out, footer, baseline)
        if len(rows) > 1:
            written += write_glue_paired(columns, rows, out, footer, baseline)
    if robustness := gather_robustness(arguments):
        written += write_robustness(robustness, out, footer, baseline)
    if found.fn_runs:
        written += write_fn(fn_rows(found), out, footer)
        if points := curve_points(found.fn_runs):  # fn-stats' records (with their counts): against accuracy
            written += write_curve(points, out, footer)
    if found.eval_runs:
        written += write_eval(found.eval_runs, out, footer)
    return written
