"""The ablation runner: four real pre-trainings with one seed, exported and fine-tuned, and its table."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, SHARED_DATA, free_port, need_shared, read_metrics


def test_ablation_runs_four_variants_and_reports_deltas(tmp_path, launch_env, small_corpus):
    glue = need_shared(SHARED_DATA / "glue")
    out = tmp_path / "ablation"
    proc = subprocess.run([sys.executable, "-m", "truneg.cli", "ablation", "--preset", "bert-tiny", "--tasks", "rte",
                           "--steps", "6", "--train-data", str(small_corpus), "--seq-len", "64", "--micro-batch-size", "4",
                           "--glue-dir", str(glue), "--max-train-samples", "64", "--epochs", "1", "--output-dir", str(out),
                           "--master-port", str(free_port()), "--num-gpus", "1"],
                          env=launch_env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "ablation.json").read_text())
    assert list(report["scores"]) == ["baseline", "HC", "SR", "HC+SR"]
    assert all(0 <= s["rte"] <= 100 for s in report["scores"].values())
    # the table's Δ rows are each variant's score minus the baseline's (to the printed two decimals)
    table = (out / "ablation.txt").read_text()
    assert "Δ avg" in table
    deltas = [float(line.split()[1]) for line in table.splitlines() if line.startswith("  Δ")]
    scores = {v: s["rte"] for v, s in report["scores"].items()}
    assert deltas == [pytest.approx(scores[v] - scores["baseline"], abs=0.006) for v in ("HC", "SR", "HC+SR")]
    # each variant ran with its own objectives (HC cannot be told from its losses here: it corrects nothing
    # in 6 steps of a tiny model), as its run.json records them
    for variant, (hc, sr) in {"baseline": ("none", "none"), "HC": ("wordnet", "none"), "SR": ("none", "word"),
                              "HC+SR": ("wordnet", "word")}.items():
        recorded = json.loads((out / variant.replace("+", "_") / "run.json").read_text())
        assert (recorded["hc"], recorded["sr"]) == (hc, sr), variant
        assert (recorded["synonym_table"] is None) == (hc == "none"), variant
    runs = {v: read_metrics(out / v.replace("+", "_")) for v in report["scores"]}
    assert all(len(r) == 6 for r in runs.values())
    assert "sr_loss" not in runs["baseline"][0] and "sr_loss" in runs["SR"][0] and "sr_loss" in runs["HC+SR"][0]
    # One seed, one data order: the first step's forward is the same model on the same batch in every variant.
    # SR adds its own term, so the MLM loss itself is equal; HC only removes corrected positions, so the
    # predictions (accuracy) are equal, and the loss too when it corrected nothing.
    first = {v: r[0] for v, r in runs.items()}
    assert first["SR"]["mlm_loss"] == pytest.approx(first["baseline"]["mlm_loss"], rel=1e-6)
    assert first["HC+SR"]["mlm_loss"] == pytest.approx(first["HC"]["mlm_loss"], rel=1e-6)
    assert first["HC"]["mlm_accuracy"] == first["baseline"]["mlm_accuracy"] == first["SR"]["mlm_accuracy"]
    assert first["baseline"]["hc_corrected"] == first["SR"]["hc_corrected"] == 0
    if first["HC"]["hc_corrected"] == 0:
        assert first["HC"]["mlm_loss"] == pytest.approx(first["baseline"]["mlm_loss"], rel=1e-6)
    for variant in report["scores"]:
        results = json.loads((out / variant.replace("+", "_") / "glue" / "rte" / "results.json").read_text())
        assert results["train_samples"] == 64 and results["eval_samples"] == 277
        # the report's score is that fine-tuning's RTE accuracy, in percent
        assert report["scores"][variant]["rte"] == pytest.approx(100 * results["accuracy"], abs=1e-9)


def test_a_variant_cut_short_is_pre_trained_on_and_mrpc_scores_by_accuracy(tmp_path, monkeypatch):
    """A variant whose latest checkpoint is before --steps (a run stopped early, or an earlier invocation's)
    goes back to pre-training, which resumes it (or refuses another run's folder): it is not exported as if
    finished. The table's MRPC score is accuracy, as the paper's Table 3 reports it."""
    from truneg.errors import UserError
    from truneg.eval import ablation

    (tmp_path / "glue" / "MRPC").mkdir(parents=True)
    (tmp_path / "glue" / "MRPC" / "train.tsv").write_text("")
    launched = []
    monkeypatch.setattr(ablation, "export", lambda *a, **k: None)
    monkeypatch.setattr(ablation, "finetune", lambda *a, **k: {"accuracy": 0.75, "f1": 0.8})
    from truneg.cli import build_parser

    args = build_parser().parse_args(["ablation", "--tasks", "mrpc", "--glue-dir", str(tmp_path / "glue"), "--output-dir",
                                      str(tmp_path / "out"), "--steps", "6"])
    for variant, step in (("baseline", 6), ("HC", 3), ("SR", 6), ("HC+SR", 0)):
        checkpoints = tmp_path / "out" / variant.replace("+", "_") / "checkpoints"
        checkpoints.mkdir(parents=True)
        if step:
            (checkpoints / "latest").write_text(f"global_step{step}")
    def pretrained(variant, args, out):  # as a run that reaches --steps writes it
        launched.append(variant)
        (out / "checkpoints" / "latest").write_text(f"global_step{args.steps}")

    monkeypatch.setattr(ablation, "pretrain", pretrained)
    report = ablation.run_ablation(args)
    assert launched == ["HC", "HC+SR"]
    assert report["scores"]["baseline"] == {"mrpc": 75.0}
    # a pre-training that a signal stopped early (it exits 0) is said, not exported
    (tmp_path / "out" / "SR" / "checkpoints" / "latest").write_text("global_step2")
    monkeypatch.setattr(ablation, "pretrain", lambda variant, args, out: None)
    with pytest.raises(UserError, match="pre-training SR stopped at global_step2, short of --steps 6"):
        ablation.run_ablation(args)


def test_each_variant_launches_pretrain_with_its_objectives_and_the_shared_flags(tmp_path, monkeypatch):
    """What `truneg ablation` hands the deepspeed launcher for each variant: the same preset, data, steps, seed,
    config and --init-from (the paper continued public checkpoints), and only its own --hc / --sr."""
    import subprocess as sp

    from truneg.cli import build_parser
    from truneg.errors import UserError
    from truneg.eval import ablation

    commands = []
    monkeypatch.setattr(ablation.subprocess, "run", lambda cmd, **kw: commands.append(cmd) or sp.CompletedProcess(cmd, 0))
    args = build_parser().parse_args(["ablation", "--preset", "electra-base", "--init-from", "/ckpt/electra-base",
                                      "--seq-len", "512", "--steps", "200", "--deepspeed_config", "c.json", "--num-gpus", "8"])
    for variant in ablation.VARIANTS:
        ablation.pretrain(variant, args, tmp_path / variant)
    for variant, cmd in zip(ablation.VARIANTS, commands):
        assert cmd[1:3] == ["--num_gpus", "8"] and cmd[cmd.index("--init-from") + 1] == "/ckpt/electra-base"
        assert [cmd[cmd.index(f) + 1] for f in ("--model", "--seq-len", "--max-steps", "--deepspeed_config")] == [
            "electra-base", "512", "200", "c.json"]
        objectives = [(f, cmd[i + 1]) for i, f in enumerate(cmd) if f in ("--hc", "--sr")]
        assert objectives == {"baseline": [], "HC": [("--hc", "wordnet")], "SR": [("--sr", "word")],
                              "HC+SR": [("--hc", "wordnet"), ("--sr", "word")]}[variant], variant
    # pretrain.py's own checks refuse a bad run before the first of the four launches
    args = build_parser().parse_args(["ablation", "--seq-len", "1024", "--output-dir", str(tmp_path / "bad")])
    commands.clear()
    with pytest.raises(UserError, match="--seq-len 1024 is beyond the model's 512 positions"):
        ablation.run_ablation(args)
    assert commands == []
