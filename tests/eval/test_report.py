"""`truneg report` from result files it did not write: hand-written results.json (one seed and --seeds),
ablation.json and fn_stats.json; a missing row and a missing cell show as missing, never as zero."""
from __future__ import annotations

import csv
import json
import statistics

import pytest

from truneg.cli import main


def write(path, content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content))


def seeds_results(task: str, accuracy: dict[int, float]) -> dict:
    """results.json of `finetune glue --seeds` (the fields report reads)."""
    return {"task": task, "seeds": list(accuracy), "reported": "median",
            "per_seed": {str(s): {"task": task, "accuracy": a, "seed": s} for s, a in accuracy.items()}}


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "ablation"
    # SR is expected (ablation.json lists it) but has no result at all; HC lacks MRPC
    write(root / "ablation.json", {"variants": {"baseline": "baseline", "HC": "HC", "SR": "SR", "HC+SR": "HC_SR"},
                                   "tasks": ["rte", "mrpc"]})
    write(root / "baseline/glue/rte/results.json", seeds_results("rte", {1: 0.60, 2: 0.62, 3: 0.64}))
    write(root / "baseline/glue/mrpc/results.json", seeds_results("mrpc", {1: 0.70, 2: 0.72, 3: 0.74}))
    write(root / "HC/glue/rte/results.json", seeds_results("rte", {1: 0.66, 2: 0.63, 3: 0.65}))
    write(root / "HC_SR/glue/rte/results.json", seeds_results("rte", {1: 0.61, 2: 0.65, 3: 0.66}))
    write(root / "HC_SR/glue/mrpc/results.json", seeds_results("mrpc", {1: 0.71, 2: 0.75, 3: 0.75}))
    write(root / "HC_SR/glue/mrpc/seed-1/results.json", {"task": "mrpc", "accuracy": 0.71, "seed": 1})  # not twice
    # a variant run elsewhere as one job, with one seed: named on the command line
    write(tmp_path / "job7/rte/results.json", {"task": "rte", "accuracy": 0.70, "seed": 42, "lr": 1e-4})
    write(tmp_path / "job7/mrpc/results.json", {"task": "mrpc", "accuracy": 0.69, "f1": 0.8, "seed": 42})
    fn = [{"checkpoint": "global_step2", "step": 2, "sequences": 10, "mismatched": 50, "iter_ratio": 0.05,
           "pred_ratio": 0.01},
          {"checkpoint": "global_step4", "step": 4, "sequences": 10, "mismatched": 40, "iter_ratio": 0.07,
           "pred_ratio": 0.02},
          {"checkpoint": "global_step1", "step": 1, "sequences": 0, "mismatched": 0, "iter_ratio": 0.0,
           "pred_ratio": 0.0}]  # nothing counted: no ratio
    write(root / "baseline/fn/fn_stats.json", fn)
    write(root / "HC/fn/fn_stats.json", fn[:1])
    return root, tmp_path / "job7"


def test_report_from_hand_written_results_with_missing_rows(tmp_path, results, capsys):
    root, job = results
    out = tmp_path / "report"
    main(["report", str(root), f"HC_Embedding={job}", "--out", str(out)])
    rows = {r["variant"]: r for r in csv.DictReader(open(out / "glue.csv", encoding="utf-8"))}
    assert list(rows) == ["baseline", "HC", "SR", "HC+SR", "HC_Embedding"]
    # SR: expected, absent: every cell empty, no 0
    assert all(v == "" for k, v in rows["SR"].items() if k != "variant")
    # HC: RTE there, MRPC missing, so no average and no delta
    assert float(rows["HC"]["RTE"]) == 65.0 and rows["HC"]["MRPC"] == "" and rows["HC"]["average"] == ""
    assert rows["HC"]["delta"] == ""
    base, both = rows["baseline"], rows["HC+SR"]
    assert (float(base["RTE"]), float(base["RTE_std"]), float(base["average"])) == pytest.approx((62.0, 2.0, 67.0))
    assert base["delta"] == "" and base["seeds"] == "3"
    # HC+SR: average of the medians 70 against 67; the spread pairs the seeds: per-seed averages 66, 70, 70.5
    # against 65, 67, 69
    assert float(both["average"]) == pytest.approx(70.0) and float(both["delta"]) == pytest.approx(3.0)
    assert float(both["delta_std"]) == pytest.approx(statistics.stdev([1.0, 3.0, 1.5]), abs=1e-4)
    # one seed (42) that the baseline does not have: a delta, no spread
    one = rows["HC_Embedding"]
    assert float(one["delta"]) == pytest.approx(69.5 - 67.0) and one["delta_std"] == "" and one["RTE_std"] == ""
    markdown = (out / "glue.md").read_text()
    assert "| SR | – | – | – | – | – |" in markdown
    assert "| HC+SR | 3 | 75.00 ± 2.31 | 65.00 ± 2.65 | 70.00 | +3.00 ± 1.04 |" in markdown
    assert "truneg report" in markdown and "| 0.00 |" not in markdown
    # Table 2: baseline's checkpoints by step, the uncounted one missing; SR (expected) one missing row
    fn = list(csv.DictReader(open(out / "false_negatives.csv", encoding="utf-8")))
    baseline = [(r["checkpoint"], r["progress_pct"], r["iter_pct"], r["pred_pct"]) for r in fn
                if r["run"] == "baseline"]
    assert baseline == [("global_step1", "25.0000", "", ""), ("global_step2", "50.0000", "5.0000", "1.0000"),
                        ("global_step4", "100.0000", "7.0000", "2.0000")]
    assert [r for r in fn if r["run"] == "SR"] == [{"run": "SR", "checkpoint": "", "step": "", "progress_pct": "",
                                                    "iter_pct": "", "pred_pct": ""}]
    assert (out / "glue_deltas.png").stat().st_size > 0 and (out / "false_negatives.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out


def test_report_restricted_to_tasks_and_its_refusals(tmp_path, results, capsys):
    root, job = results
    main(["report", str(root), "--out", str(tmp_path / "rte"), "--tasks", "rte"])
    rows = {r["variant"]: r for r in csv.DictReader(open(tmp_path / "rte" / "glue.csv", encoding="utf-8"))}
    assert float(rows["HC"]["average"]) == 65.0 and "MRPC" not in rows["HC"]
    # the same variant and task twice: one line, exit 2, nothing written
    for argv in (["report", f"HC={job}", f"HC={job}", "--out", str(tmp_path / "twice")],
                 ["report", str(root), "--out", str(tmp_path / "none"), "--tasks", "rte,wnli"],
                 ["report", str(tmp_path / "absent"), "--out", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "HC mrpc has two results" in err and "absent is not a folder" in err and "unknown GLUE task(s) wnli" in err
    assert not (tmp_path / "twice").exists() and not (tmp_path / "none").exists()


def test_a_nan_score_is_missing_not_a_number(tmp_path):
    """STS-B's correlations are NaN when a model predicts one constant: that seed has no score, and a task whose
    seeds all lack one shows as missing."""
    write(tmp_path / "base/stsb/results.json", {"task": "stsb", "spearmanr": float("nan"), "seed": 1})
    write(tmp_path / "base/rte/results.json", seeds_results("rte", {1: 0.5, 2: float("nan"), 3: 0.7}))
    main(["report", f"baseline={tmp_path / 'base'}", "--out", str(tmp_path / "out"), "--tasks", "stsb,rte"])
    row = next(csv.DictReader(open(tmp_path / "out" / "glue.csv", encoding="utf-8")))
    assert row["STS-B"] == "" and row["average"] == ""
    assert (float(row["RTE"]), float(row["RTE_std"])) == pytest.approx((60.0, 14.1421), abs=1e-4)
    table = [line for line in (tmp_path / "out" / "glue.md").read_text().splitlines() if line.startswith("|")]
    assert table[2].startswith("| baseline | 2 | – | 60.00 ± 14.14 | – |") and "nan" not in "".join(table).lower()
