"""`truneg report`'s part of the runs' live evaluations (--eval-data's records in metrics.jsonl): their curves
against the samples seen, and the paper's Table 2 for a run that has no fn_stats.json."""
from __future__ import annotations

import csv
import json
from pathlib import Path

from matplotlib.figure import Figure

from truneg.errors import UserError
from truneg.eval.figures import save_with_footer
from truneg.train.observe.records import EVAL_PREFIX, is_eval_record

# the curves drawn, where a run has them: (key, axis label)
CURVES = [("eval_mlm_loss", "MLM loss"), ("eval_mlm_accuracy", "MLM accuracy"), ("eval_disc_auc", "disc. AUC"),
          ("eval_hc_pred_ratio", "false negatives (% mismatches)")]


def live_evaluations(path: Path) -> list[dict]:
    """A run's evaluation records in metrics.jsonl, by step (a line a kill cut short is skipped)."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and is_eval_record(record):
            records.append(record)
    return sorted(records, key=lambda r: r.get("step", -1))


def check_one_table(runs: dict[str, list[dict]]) -> None:
    """Table 2 live compares runs only if one table counted them all (a run's --eval-synonyms, WordNet's by default):
    refused otherwise, in one line naming two runs that differ. Records of older runs name none and are taken as
    they are."""
    tables = {run: r["eval_synonym_table"] for run, records in runs.items() for r in records
              if r.get("eval_synonym_table")}
    if len(set(tables.values())) > 1:
        (a, table_a), *others = tables.items()
        b, table_b = next((run, t) for run, t in others if t != table_a)
        raise UserError(f"the live evaluations of {a} and {b} counted false negatives with different tables "
                        f"({table_a}; {table_b}): their Table 2 rows do not compare; rerun `truneg eval` of one with "
                        "the other's --synonyms, or report them apart")


def fn_stats_rows(records: list[dict]) -> list[dict]:
    """fn_stats.json's rows of a run's live evaluations (the same counts: truneg.train.heldout)."""
    return [{"checkpoint": "live", "step": r["step"], "sequences": r.get("eval_sequences", 0),
             "mismatched": r.get("eval_mismatched", 0),
             "iter_ratio": r["eval_hc_iter_ratio"], "pred_ratio": r["eval_hc_pred_ratio"],
             "mlm_accuracy": r["eval_mlm_accuracy"]} for r in records]


def write_eval(runs: dict[str, list[dict]], out: Path, footer: str) -> list[Path]:
    """eval.csv (every record of every run) and eval_curves.png (each figure against the samples seen)."""
    keys = list(dict.fromkeys(k for records in runs.values() for r in records for k in r
                              if k.startswith(EVAL_PREFIX)))
    with open(out / "eval.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["run", "step", "samples", *keys])
        for run, records in runs.items():
            for r in records:
                writer.writerow([run, r["step"], r.get("samples", ""), *(r.get(k, "") for k in keys)])
    shown = [(k, label) for k, label in CURVES if k in keys]
    figure = Figure(figsize=(4 * len(shown), 3.6))
    axes = figure.subplots(1, len(shown), squeeze=False)[0]
    for ax, (key, label) in zip(axes, shown):
        scale = 100 if key == "eval_hc_pred_ratio" else 1
        for run, records in runs.items():
            points = [r for r in records if r.get(key) is not None]  # null: no figure (an AUC of one class)
            ax.plot([r.get("samples", r["step"]) for r in points], [scale * r[key] for r in points], "o-", label=run)
        ax.set_xlabel("samples seen")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    save_with_footer(figure, footer, out / "eval_curves.png")
    return [out / "eval.csv", out / "eval_curves.png"]
