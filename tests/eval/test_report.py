"""`truneg report` from result files it did not write: hand-written results.json (one seed and --seeds),
ablation.json and fn_stats.json; a missing row and a missing cell show as missing, never as zero."""
from __future__ import annotations

import csv
import itertools
import json
import statistics
from fractions import Fraction

import pytest
from conftest import REPO, cli_in_process

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
           "pred_ratio": 0.01, "mlm_accuracy": 0.125},
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
    # HC+SR: average of the medians 70 against 67, but Δ and its spread both pair the seeds: per-seed averages
    # 66, 70, 70.5 against 65, 67, 69, differences 1, 3, 1.5 (mean 11/6, not 70 - 67)
    assert float(both["average"]) == pytest.approx(70.0) and float(both["delta"]) == pytest.approx(11 / 6, abs=1e-4)
    assert float(both["delta_std"]) == pytest.approx(statistics.stdev([1.0, 3.0, 1.5]), abs=1e-4)
    # one seed (42) that the baseline does not have: no pair, so no Δ
    one = rows["HC_Embedding"]
    assert one["delta"] == "" and one["delta_std"] == "" and one["RTE_std"] == ""
    markdown = (out / "glue.md").read_text()
    assert "| SR | – | – | – | – | – |" in markdown
    assert "| HC+SR | 3 | 75.00 ± 2.31 | 65.00 ± 2.65 | 70.00 | +1.83 ± 1.04 |" in markdown
    assert "Δ: the mean over the seeds both rows have of the per-seed difference" in markdown
    assert "truneg report" in markdown and "| 0.00 |" not in markdown
    # Table 2: baseline's checkpoints by step, the uncounted one missing; SR (expected) one missing row
    fn = list(csv.DictReader(open(out / "false_negatives.csv", encoding="utf-8")))
    baseline = [(r["checkpoint"], r["progress_pct"], r["iter_pct"], r["pred_pct"], r["mlm_accuracy_pct"]) for r in fn
                if r["run"] == "baseline"]
    assert baseline == [("global_step1", "25.0000", "", "", ""), ("global_step2", "50.0000", "5.0000", "1.0000",
                                                                  "12.5000"),
                        ("global_step4", "100.0000", "7.0000", "2.0000", "")]  # (an older fn_stats.json: no accuracy)
    assert [r for r in fn if r["run"] == "SR"] == [{"run": "SR", "checkpoint": "", "step": "", "progress_pct": "",
                                                    "iter_pct": "", "pred_pct": "", "mlm_accuracy_pct": ""}]
    assert (out / "glue_deltas.png").stat().st_size > 0 and (out / "false_negatives.png").stat().st_size > 0
    assert "wrote" in capsys.readouterr().out
    # each variant against the baseline, paired by seed: HC+SR's per-seed average differences 1, 3, 1.5 (mean 11/6,
    # sd 1.04, t(0.975, 2) 4.303: the interval holds 0; all 3 positive: sign-flip p 2/8); its MRPC differences
    # 1, 3, 1 (HC has no MRPC: no pairs). glue.md's Δ is this row's mean.
    paired = {(r["variant"], r["column"]): r for r in csv.DictReader(open(out / "glue_paired.csv", encoding="utf-8"))}
    average = paired["HC+SR", "Average"]
    half = 4.302653 * statistics.stdev([1.0, 3.0, 1.5]) / 3 ** 0.5
    assert float(average["mean Δ"]) == pytest.approx(11 / 6, abs=0.005) and average["pairs"] == "3"
    assert average["mean Δ"] == f"{float(both['delta']):+.2f}"
    assert average["95% t-interval"] == f"[{11 / 6 - half:+.2f}, {11 / 6 + half:+.2f}]"
    assert average["verdict"] == "within noise" and average["p (sign-flip)"] == "0.250"
    assert paired["HC", "MRPC"]["pairs"] == "0" and paired["HC", "MRPC"]["verdict"] == "no test (< 2 paired seeds)"
    assert paired["HC_Embedding", "RTE"]["pairs"] == "0"  # seed 42: the baseline has none


def reference_sign_flip_p(diffs: list[float]) -> float:
    """Every sign assignment, in exact fractions: the share whose |sum| reaches the observed |sum|."""
    exact = [Fraction(d) for d in diffs]
    observed = abs(sum(exact))
    signs = list(itertools.product((-1, 1), repeat=len(exact)))
    return sum(abs(sum(s * d for s, d in zip(sign, exact))) >= observed for sign in signs) / len(signs)


def test_paired_comparison_tells_a_consistent_gain_from_noise():
    from truneg.eval.paired import paired, verdict

    base = {str(s): 60.0 + s for s in range(1, 7)}
    # 6 seeds, each better: p is 2 of the 64 sign assignments, below 0.05
    gain = paired({s: v + 2.0 + 0.25 * int(s) for s, v in base.items()}, base)
    assert gain["p"] == 2 / 64 == reference_sign_flip_p([2.0 + 0.25 * s for s in range(1, 7)])
    assert verdict(gain) == "better" and gain["low"] > 0 and gain["n"] == 6
    worse = paired(base, {s: v + 2.0 + 0.25 * int(s) for s, v in base.items()})
    assert worse["p"] == 2 / 64 and verdict(worse) == "worse"
    # mixed signs (binary-exact scores): the p of the independent enumeration
    diffs = [1.0, 2.5, -0.5, 1.5, 3.0, -0.25]
    mixed = paired({s: base[s] + d for s, d in zip(base, diffs)}, base)
    assert mixed["p"] == pytest.approx(reference_sign_flip_p(diffs), abs=1e-12) and verdict(mixed) == "within noise"
    # 3 seeds cannot reach 0.05 (p >= 2/8), though each is better and the t-interval excludes 0
    three = paired({"1": 62.0, "2": 63.25, "3": 64.5}, {"1": 60.0, "2": 61.0, "3": 62.0})
    assert three["p"] == 0.25 and three["low"] > 0 and verdict(three) == "within noise"
    noise = paired({"1": 63.0, "2": 60.0, "3": 65.0, "4": 60.0}, {"1": 60.0, "2": 62.0, "3": 64.0, "4": 61.0})
    assert noise["p"] == reference_sign_flip_p([3.0, -2.0, 1.0, -1.0]) == 1.0 and verdict(noise) == "within noise"
    assert verdict(paired({"1": 1.0}, {"1": 0.0})) == "no test (< 2 paired seeds)"


def test_equal_differences_are_no_test():
    """The same difference on every seed leaves no spread to measure noise by, and float rounding is no spread:
    90.1 - 90.0 and 90.2 - 90.1 differ in their last bits, and a t-test would call that a certain gain."""
    from truneg.eval.paired import paired, verdict

    rounding = paired({"1": 90.1, "2": 90.2, "3": 90.3}, {"1": 90.0, "2": 90.1, "3": 90.2})
    assert len({90.1 - 90.0, 90.2 - 90.1, 90.3 - 90.2}) > 1  # the example does carry rounding
    assert verdict(rounding) == "no test (equal differences)" and rounding["mean"] == pytest.approx(0.1)
    assert rounding["p"] is None and rounding["low"] is None and rounding["n"] == 3
    for variant in ({"1": 61.0, "2": 63.0, "3": 70.0}, {"1": 60.0, "2": 62.0, "3": 69.0}):
        assert verdict(paired(variant, {"1": 60.0, "2": 62.0, "3": 69.0})) == "no test (equal differences)"
    # a spread of 0.01 points, the tables' last digit, is tested
    assert paired({"1": 61.0, "2": 63.01}, {"1": 60.0, "2": 62.0})["p"] == 2 / 4


def test_the_tables_show_no_test_for_equal_differences(tmp_path):
    """glue_paired and robustness: per-seed differences equal up to rounding read "no test (equal differences)"."""
    write(tmp_path / "baseline/glue/rte/results.json", seeds_results("rte", {1: 0.900, 2: 0.901, 3: 0.902}))
    write(tmp_path / "HC/glue/rte/results.json", seeds_results("rte", {1: 0.901, 2: 0.902, 3: 0.903}))
    for variant, drops in (("baseline", (1.0, 2.0, 3.0)), ("HC", (1.5, 2.5, 3.5))):
        write(tmp_path / variant / "robustness/sst2/robustness.json", {
            "task": "sst2", "original": 80.0, "transformed": 78.0, "drop": 2.0, "examples": 9,
            "per_seed": {str(s): {"drop": d} for s, d in enumerate(drops, 1)}})
    main(["report", str(tmp_path), "--out", str(tmp_path / "out"), "--tasks", "rte"])
    row = next(r for r in csv.DictReader(open(tmp_path / "out" / "glue_paired.csv", encoding="utf-8"))
               if r["column"] == "RTE")
    assert (row["mean Δ"], row["95% t-interval"], row["p (sign-flip)"], row["verdict"]) == (
        "+0.10", "–", "–", "no test (equal differences)")
    assert "| HC | sst2 | 3 | 80.00 | 78.00 | 2.00 | +0.50 | – | no test (equal differences) |" in (
        tmp_path / "out" / "robustness.md").read_text()


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


def test_live_evaluations_draw_their_curves_and_table_2_for_runs_without_fn_stats(tmp_path, capsys):
    """Two pre-training runs' metrics.jsonl (training records and their evaluations' records, a line a kill cut
    short): eval.csv and eval_curves.png per run, and Table 2 from the live records of the run without fn_stats.json
    (the other's fn_stats.json wins). The prediction ratio is defined where predictions mismatched."""
    import matplotlib.image

    def evaluation(step, accuracy, pred_ratio):
        return {"step": step, "samples": 8 * step, "eval_mlm_loss": 10 - step / 8, "eval_mlm_accuracy": accuracy,
                "eval_perplexity": 2.0, "eval_hc_iter_ratio": 0.5 * pred_ratio, "eval_hc_pred_ratio": pred_ratio,
                "eval_sequences": 96, "eval_masked": 800, "eval_mismatched": 0 if step == 8 else 700,
                "eval_seconds": 0.3}

    for run, scale in (("base", 1.0), ("hc", 0.5)):
        lines = [evaluation(0, 0.0, 0.01 * scale)]
        for step in (8, 16):
            lines += [{"step": step, "samples": 8 * step, "loss": 9.0, "lr": 1e-4}, evaluation(step, step / 100,
                                                                                                  0.02 * scale)]
        text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 17, "samp'
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text(text)
    write(tmp_path / "hc" / "fn" / "fn_stats.json", [{"checkpoint": "global_step16", "step": 16, "sequences": 10,
                                                       "mismatched": 5, "iter_ratio": 0.3, "pred_ratio": 0.2}])
    out = tmp_path / "report"
    main(["report", f"baseline={tmp_path / 'base'}", f"HC={tmp_path / 'hc'}", "--out", str(out)])
    rows = list(csv.DictReader(open(out / "eval.csv", encoding="utf-8")))
    assert [(r["run"], int(r["step"]), int(r["samples"])) for r in rows] == [
        (run, s, 8 * s) for run in ("baseline", "HC") for s in (0, 8, 16)]
    assert float(rows[2]["eval_mlm_accuracy"]) == 0.16 and "loss" not in rows[0]
    assert matplotlib.image.imread(out / "eval_curves.png").shape[1] > 600
    table = list(csv.DictReader(open(out / "false_negatives.csv", encoding="utf-8")))
    assert [(r["run"], r["checkpoint"], r["step"], r["pred_pct"]) for r in table] == [
        ("baseline", "live", "0", "1.0000"), ("baseline", "live", "8", ""),  # no mismatch at step 8: no ratio
        ("baseline", "live", "16", "2.0000"),
        ("HC", "global_step16", "16", "20.0000")]
    assert table[2]["mlm_accuracy_pct"] == "16.0000" and table[2]["progress_pct"] == "100.0000"
    # two runs' evaluations under one name: one line, exit 2, nothing written
    with pytest.raises(SystemExit) as exited:
        main(["report", f"HC={tmp_path / 'base'}", f"HC={tmp_path / 'hc'}", "--out", str(tmp_path / "twice")])
    assert exited.value.code == 2 and not (tmp_path / "twice").exists()
    assert "a second run's evaluations for HC" in capsys.readouterr().err


def test_table_2_live_refuses_runs_counted_with_different_tables_and_reads_a_null_auc(tmp_path, capsys):
    """Each evaluation names the table its Table 2 counted with (`eval_synonym_table`): runs counted with one compare,
    runs counted with two are refused in one line, exit 2, nothing written. A null AUC (one class only) is no point
    of its curve."""
    def evaluation(step, table, auc):
        return {"step": step, "samples": 8 * step, "eval_mlm_loss": 9.0, "eval_mlm_accuracy": 0.1,
                "eval_disc_auc": auc, "eval_hc_iter_ratio": 0.1, "eval_hc_pred_ratio": 0.2, "eval_sequences": 96,
                "eval_masked": 800, "eval_mismatched": 700, "eval_synonym_table": table, "eval_seconds": 0.3}

    for run, table in (("base", "wordnet 0123456789abcdef"), ("hc", "wordnet 0123456789abcdef"),
                       ("knn", "embeddings fedcba9876543210")):
        (tmp_path / run).mkdir()
        (tmp_path / run / "metrics.jsonl").write_text(
            "".join(json.dumps(evaluation(s, table, None if s == 0 else 0.6 + s / 100)) + "\n" for s in (0, 8)))
    main(["report", f"baseline={tmp_path / 'base'}", f"HC={tmp_path / 'hc'}", "--out", str(tmp_path / "one")])
    rows = list(csv.DictReader(open(tmp_path / "one" / "eval.csv", encoding="utf-8")))
    assert [r["eval_disc_auc"] for r in rows] == ["", str(0.6 + 8 / 100)] * 2
    assert (tmp_path / "one" / "eval_curves.png").is_file()
    with pytest.raises(SystemExit) as exited:
        main(["report", f"baseline={tmp_path / 'base'}", f"kNN={tmp_path / 'knn'}", "--out", str(tmp_path / "two")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and not (tmp_path / "two").exists() and len(err.strip().splitlines()) == 1
    assert "baseline and kNN counted false negatives with different tables" in err


def test_the_minilm_pages_tables_rebuild_from_their_kept_files(tmp_path):
    """docs/minilm.md's tables come from the files kept in docs/minilm/: `truneg report` of its results gives the kept
    CSVs byte for byte (a report that changed, or files copied from another run, would not)."""
    kept = REPO / "docs" / "minilm"
    proc = cli_in_process("report", str(kept / "results"), "--out", str(tmp_path / "page"))
    assert proc.returncode == 0, proc.stderr
    for name in ("glue.csv", "glue_paired.csv", "false_negatives.csv"):
        assert (tmp_path / "page" / name).read_bytes() == (kept / name).read_bytes(), name
    # the run with a head stage first (its Table 2 and the curve against accuracy; no GLUE)
    proc = cli_in_process("report", str(kept / "head_stage" / "results"), "--out", str(tmp_path / "head"))
    assert proc.returncode == 0, proc.stderr
    for name in ("false_negatives.csv", "false_negatives_accuracy.csv"):
        assert (tmp_path / "head" / name).read_bytes() == (kept / "head_stage" / name).read_bytes(), name


def test_false_negatives_against_accuracy_with_wilson_intervals_and_the_papers_bands(tmp_path):
    """fn-stats' records with their counts are points (accuracy, Iter., Pred.), each with a 95 % interval equal to
    scipy's Wilson interval; the Pred. band of the paper's BERT-base reads 18.1-19.1 % accuracy off a curve that
    rises linearly from 0.5 % at 10 % accuracy to 2.5 % at 30 %, and BERT-large's 1.49-1.60 % 19.9-21.0 %; a curve
    that stays below a band says so with its maximum. Table 2 live's records (no counts) draw no point."""
    from scipy.stats import binomtest

    from truneg.eval.accuracy_curve import curve_points, implied_accuracy
    from truneg.eval.report import report

    def record(step, correct, seq_corrected, corrected, masked=1000, sequences=100, mismatched=None):
        mismatched = masked - correct if mismatched is None else mismatched
        return {"checkpoint": f"global_step{step}", "step": step, "sequences": sequences, "masked": masked,
                "mismatched": mismatched, "corrected": corrected, "sequences_corrected": seq_corrected,
                "mlm_correct": correct, "iter_ratio": seq_corrected / sequences, "pred_ratio": corrected / mismatched,
                "mlm_accuracy": correct / masked}

    # accuracy 10 % (900 mismatches, 4.5 corrected: 0.5 %) and 30 % (700, 17.5: 2.5 %), as counts of 2,000 positions
    head = [record(10, 200, 3, 9, masked=2000, mismatched=1800), record(20, 600, 9, 35, masked=2000, mismatched=1400)]
    write(tmp_path / "head" / "fn_stats.json", head)
    write(tmp_path / "low" / "fn_stats.json", [record(5, 50, 1, 2)])
    written = report([f"head={tmp_path / 'head'}", f"low={tmp_path / 'low'}"], tmp_path / "out")
    assert tmp_path / "out" / "false_negatives_accuracy.png" in written
    points = curve_points({"head": head})
    for point, counts in zip(points, head):
        for key, (hits, trials) in (("accuracy", ("mlm_correct", "masked")), ("pred", ("corrected", "mismatched")),
                                    ("iter", ("sequences_corrected", "sequences"))):
            reference = binomtest(counts[hits], counts[trials]).proportion_ci(0.95, method="wilson")
            assert point[f"{key}_low"] == pytest.approx(100 * reference.low, abs=1e-9)
            assert point[f"{key}_high"] == pytest.approx(100 * reference.high, abs=1e-9)
    assert implied_accuracy(points, (1.31, 1.41)) == "18.1-19.1 % MLM accuracy"
    assert implied_accuracy(points, (1.49, 1.60)) == "19.9-21.0 % MLM accuracy"
    assert implied_accuracy(points[:1], (1.31, 1.41)) == "beyond the measured range (maximum 0.50 % at 10.0 % accuracy)"
    assert implied_accuracy(points[:1], (0.4, 0.6)) == "10.0 % MLM accuracy"  # a single point inside the band
    assert implied_accuracy(points, (0.4, 0.6)) == "10.0-11.0 % MLM accuracy"  # from inside the band to above it
    assert implied_accuracy(points, (0.1, 0.2)).startswith("below the measured range")
    page = (tmp_path / "out" / "false_negatives_accuracy.md").read_text()
    assert "| head | 10 | 10.00 [" in page and "- BERT-base (Pred. 1.31-1.41 %): 18.1-19.1 % MLM accuracy" in page
    assert "which the paper does not state" in page
    assert curve_points({"live": [{"step": 8, "sequences": 10, "iter_ratio": 0.1, "pred_ratio": 0.0}]}) == []
