"""The ablation runner: real pre-trainings from hub names (a BERT, ELECTRA's two repos), exported, fine-tuned
and reported; its stages, resume and launch commands."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    SHARED_DATA,
    free_port,
    hub_snapshot,
    need_shared,
    read_metrics,
    sentence_transformers_folder,
)


def test_ablation_runs_three_variants_and_reports_deltas(tmp_path, launch_env, small_corpus):
    """From a tiny BERT encoder without its MLM head, laid out as sentence-transformers save one, in an HF cache laid
    out as the hub's, named as on the hub and resolved offline: `--new-head` and no --preset (the checkpoint's own
    architecture), as MiniLM runs (docs/minilm.md); then GLUE, SwapSynWordNet on SST-2 and the report."""
    from transformers import BertForMaskedLM

    glue = need_shared(SHARED_DATA / "glue")
    out, cache = tmp_path / "ablation", tmp_path / "hf-cache"
    encoder = sentence_transformers_folder(hub_snapshot(cache, "org/tiny-bert"))
    env = {**launch_env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "truneg.cli", "ablation", "--tasks", "sst2", "--robustness",
                           "sst2", "--init-from", "org/tiny-bert", "--new-head", "--variants", "baseline,HC,SR",
                           "--steps", "6", "--train-data", str(small_corpus), "--seq-len", "64", "--micro-batch-size",
                           "4",
                           "--glue-dir", str(glue), "--max-train-samples", "64", "--epochs", "1", "--output-dir",
                           str(out),
                           "--master-port", str(free_port()), "--num-gpus", "1", "--finetune-seeds", "42",
                           "--fn-checkpoints", "none"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "ablation.json").read_text())
    assert "| SR | 1 |" in (out / "report" / "glue.md").read_text()  # the report, at the end
    assert list(report["scores"]) == ["baseline", "HC", "SR"]
    assert all(0 <= s["sst2"] <= 100 for s in report["scores"].values())
    assert report["preset"] == "auto" and (out / "report" / "glue_paired.md").is_file()
    # SwapSynWordNet on SST-2 dev for each variant's seed, in the record, the table and the report
    robust = json.loads((out / "HC" / "robustness" / "sst2" / "robustness.json").read_text())
    assert robust["drop"] == pytest.approx(robust["original"] - robust["transformed"]) and robust["examples"] > 800
    assert report["robustness"]["HC"]["drop"] == robust["drop"] and "SwapSynWordNet on sst2" in (out / "ablation.txt"
                                                                                                 ).read_text()
    assert "| HC | sst2 | 1 |" in (out / "report" / "robustness.md").read_text()
    # the table's Δ rows are each variant's score minus the baseline's (to the printed two decimals)
    table = (out / "ablation.txt").read_text()
    assert "Δ avg" in table
    deltas = [float(line.split()[1]) for line in table.splitlines() if line.startswith("  Δ")]
    scores = {v: s["sst2"] for v, s in report["scores"].items()}
    assert deltas == [pytest.approx(scores[v] - scores["baseline"], abs=0.006) for v in ("HC", "SR")]
    # the export of a --new-head run is a whole BertForMaskedLM: the encoder continued, the head trained, the
    # encoder's pooler carried bitwise (GLUE starts from it)
    exported, info = BertForMaskedLM.from_pretrained(out / "baseline" / "hf", output_loading_info=True)
    assert not [k for k in info["missing_keys"] if not k.endswith("position_ids")]
    start = encoder.encoder.layer[0].attention.self.query.weight
    assert 0 < (exported.bert.encoder.layer[0].attention.self.query.weight - start).abs().max() < 0.05
    from safetensors.torch import load_file

    weights = load_file(out / "baseline" / "hf" / "model.safetensors")
    assert torch.equal(weights["bert.pooler.dense.weight"], encoder.pooler.dense.weight)
    # each variant ran with its own objectives (HC cannot be told from its losses here: it corrects nothing
    # in 6 steps of a tiny model), as its run.json records them
    for variant, (hc, sr) in {"baseline": ("none", "none"), "HC": ("wordnet", "none"), "SR": ("none", "word")}.items():
        recorded = json.loads((out / variant.replace("+", "_") / "run.json").read_text())
        assert (recorded["hc"], recorded["sr"], recorded["init_from"]) == (hc, sr, "org/tiny-bert"), variant
        assert recorded["new_head"] is True and recorded["model"] is None, variant
        assert (recorded["synonym_table"] is None) == (hc == "none"), variant
    runs = {v: read_metrics(out / v.replace("+", "_")) for v in report["scores"]}
    assert all(len(r) == 6 for r in runs.values())
    assert "sr_loss" not in runs["baseline"][0] and "sr_loss" not in runs["HC"][0] and "sr_loss" in runs["SR"][0]
    # One seed, one data order: the first step's forward is the same model on the same batch in every variant.
    # SR adds its own term, so the MLM loss itself is equal; HC only removes corrected positions, so the
    # predictions (accuracy) are equal, and the loss too when it corrected nothing.
    first = {v: r[0] for v, r in runs.items()}
    assert first["SR"]["mlm_loss"] == pytest.approx(first["baseline"]["mlm_loss"], rel=1e-6)
    assert first["HC"]["mlm_accuracy"] == first["baseline"]["mlm_accuracy"] == first["SR"]["mlm_accuracy"]
    assert first["baseline"]["hc_corrected"] == first["SR"]["hc_corrected"] == 0
    if first["HC"]["hc_corrected"] == 0:
        assert first["HC"]["mlm_loss"] == pytest.approx(first["baseline"]["mlm_loss"], rel=1e-6)
    for variant in report["scores"]:
        results = json.loads((out / variant.replace("+", "_") / "glue" / "sst2" / "results.json").read_text())
        assert results["train_samples"] == 64 and results["eval_samples"] == 872
        # the report's score is that fine-tuning's SST-2 accuracy, in percent
        assert report["scores"][variant]["sst2"] == pytest.approx(100 * results["accuracy"], abs=1e-9)


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
    monkeypatch.setattr(ablation, "recipe", lambda *a: {})
    monkeypatch.setattr(ablation, "report", lambda *a: [])
    from truneg.cli import build_parser

    args = build_parser().parse_args(["ablation", "--tasks", "mrpc", "--glue-dir", str(tmp_path / "glue"),
                                      "--output-dir",
                                      str(tmp_path / "out"), "--steps", "6", "--fn-checkpoints", "none",
                                      "--finetune-seeds", "1"])
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
    # a pre-training that a signal stopped early (it exits 0) is said, not exported (a folder without stage
    # records: an earlier version's)
    (tmp_path / "out" / "stages.json").unlink()
    (tmp_path / "out" / "SR" / "checkpoints" / "latest").write_text("global_step2")
    monkeypatch.setattr(ablation, "pretrain", lambda variant, args, out: None)
    with pytest.raises(UserError, match="pre-training SR stopped at global_step2, short of --steps 6"):
        ablation.run_ablation(args)


def test_electra_continues_from_its_two_hub_names_through_export_fine_tuning_and_the_report(tmp_path, launch_env,
                                                                                            small_corpus):
    """The paper's ELECTRA-base command at tiny size: the discriminator and the generator as two hub repos in an HF
    cache resolved offline, pre-trained, exported, fn-stats on the generator, GLUE, and the report."""
    from transformers import ElectraForSequenceClassification

    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer

    glue = need_shared(SHARED_DATA / "glue")
    out, cache = tmp_path / "ablation", tmp_path / "hf-cache"
    pair = build_pretrainer("electra-tiny", ObjectiveConfig())
    pair.discriminator.save_pretrained(hub_snapshot(cache, "org/tiny-electra-discriminator", "d" * 40))
    pair.generator.save_pretrained(hub_snapshot(cache, "org/tiny-electra-generator", "e" * 40))
    env = {**launch_env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "truneg.cli", "ablation", "--preset", "electra-tiny",
                           "--init-from", "org/tiny-electra-discriminator",
                           "--init-generator", "org/tiny-electra-generator", "--variants", "SR", "--tasks", "rte",
                           "--steps", "2", "--train-data", str(small_corpus), "--seq-len", "32",
                           "--micro-batch-size", "4", "--glue-dir", str(glue), "--max-train-samples", "32",
                           "--epochs", "1", "--finetune-seeds", "1", "--fn-checkpoints", "100",
                           "--fn-data", str(small_corpus), "--fn-max-sequences", "16", "--output-dir", str(out),
                           "--master-port", str(free_port()), "--num-gpus", "1"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "SR" / "run.json").read_text())
    assert ({k: record[k] for k in ("init_from", "init_revision", "init_generator", "init_generator_revision")}
            == {"init_from": "org/tiny-electra-discriminator", "init_revision": "d" * 40,
                "init_generator": "org/tiny-electra-generator", "init_generator_revision": "e" * 40})
    # the public discriminator's trained encoder went on training (not a fresh one of the same shape)
    exported = ElectraForSequenceClassification.from_pretrained(out / "SR" / "hf" / "discriminator")
    start = pair.discriminator.electra.encoder.layer[0].attention.self.query.weight
    assert (exported.electra.encoder.layer[0].attention.self.query.weight - start).abs().max() < 0.05
    report = json.loads((out / "ablation.json").read_text())
    assert 0 <= report["scores"]["SR"]["rte"] <= 100
    assert "| SR | 1 |" in (out / "report" / "glue.md").read_text()
    assert "SR" in (out / "report" / "false_negatives.md").read_text()


def test_each_variant_launches_pretrain_with_its_objectives_and_the_shared_flags(tmp_path, monkeypatch):
    """What `truneg ablation` hands the deepspeed launcher for each variant: the same preset, data, steps, seed,
    config and --init-from (the paper continued public checkpoints), and only its own --hc / --sr."""
    import subprocess as sp

    from truneg.cli import build_parser
    from truneg.errors import UserError
    from truneg.eval import ablation
    from truneg.eval.variants import DEFAULT_VARIANTS

    commands = []
    monkeypatch.setattr(ablation.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or sp.CompletedProcess(cmd, 0))
    args = build_parser().parse_args(["ablation", "--preset", "electra-base", "--init-from", "/ckpt/electra-base",
                                      "--seq-len", "512", "--steps", "200", "--deepspeed_config", "c.json",
                                      "--num-gpus", "8"])
    for variant in DEFAULT_VARIANTS:
        ablation.pretrain(variant, args, tmp_path / variant)
    for variant, cmd in zip(DEFAULT_VARIANTS, commands):
        assert cmd[1:3] == ["--num_gpus", "8"] and cmd[cmd.index("--init-from") + 1] == "/ckpt/electra-base"
        assert [cmd[cmd.index(f) + 1] for f in ("--model", "--seq-len", "--max-steps", "--deepspeed_config")] == [
            "electra-base", "512", "200", "c.json"]
        objectives = [(f, cmd[i + 1]) for i, f in enumerate(cmd) if f in ("--hc", "--sr")]
        assert objectives == {"baseline": [], "HC": [("--hc", "wordnet")], "SR": [("--sr", "word")],
                              "HC+SR": [("--hc", "wordnet"), ("--sr", "word")]}[variant], variant
    # pretrain.py's own checks refuse a bad run before the first of the four launches
    glue = tmp_path / "glue"  # GLUE's files are checked first: these stand in for the shared data folder's
    for folder in ("RTE", "MRPC"):
        (glue / folder).mkdir(parents=True)
        (glue / folder / "train.tsv").write_text("")
    args = build_parser().parse_args(["ablation", "--seq-len", "1024", "--output-dir", str(tmp_path / "bad"),
                                      "--glue-dir", str(glue)])
    commands.clear()
    with pytest.raises(UserError, match="--seq-len 1024 is beyond the model's 512 positions"):
        ablation.run_ablation(args)
    assert commands == []


def test_the_minilm_script_runs_an_ablation_that_passes_its_checks(tmp_path):
    """bench/minilm/run.sh (docs/minilm.md) as written: with HEAD_STEPS=0 (the page's first run) its `truneg ablation`
    parses, launches pretrain.py with the checkpoint's own architecture and --new-head, and passes every check before
    the first pre-training; --preset auto without --init-from and a --robustness task not fine-tuned are refused in
    one line. By default a head stage comes first (pretrain.py's arguments parse), its export and fn-stats by line,
    and the ablation continues from the export, without --new-head; TASKS='' fine-tunes nothing."""
    from truneg.cli import build_parser
    from truneg.errors import UserError
    from truneg.eval import ablation
    from truneg.train.config.args import parse_args

    need_shared(SHARED_DATA / "glue")

    def dry_run(**env) -> list[str]:
        return subprocess.run(["bash", "bench/minilm/run.sh", str(tmp_path)], cwd=REPO, capture_output=True,
                              text=True, check=True, env={"DRY_RUN": "1", "SHARED": str(SHARED_DATA),
                                                          "PATH": "/usr/bin:/bin", **env}).stdout.splitlines()

    head, export, head_stats, staged, _ = dry_run()
    head_args = parse_args(head.split()[head.split().index("truneg/pretrain.py") + 1:])
    assert (head_args.train_only, head_args.new_head, head_args.max_steps, head_args.lr) == ("head", True, 400, 1e-3)
    assert export.split()[1:] == ["export", str(tmp_path / "head" / "checkpoints"), str(tmp_path / "head" / "hf")]
    assert build_parser().parse_args(head_stats.split()[1:]).segmentation == "line"
    staged_args = build_parser().parse_args(["ablation", *staged.split()[2:]])
    assert staged_args.init_from == str(tmp_path / "head" / "hf") and not staged_args.new_head
    no_glue = build_parser().parse_args(["ablation", *dry_run(TASKS="")[3].split()[2:]])
    assert ablation._check(no_glue, tmp_path) == [] and no_glue.robustness is None
    ablation_line, fn_stats_line = dry_run(HEAD_STEPS="0")
    words = ablation_line.split()[2:]  # after `truneg ablation`
    args = build_parser().parse_args(["ablation", *words])
    # then the novels' Table 2 of HC's last checkpoint, which docs/minilm.md quotes
    stats = build_parser().parse_args(fn_stats_line.split()[1:])
    assert stats.checkpoints == [str(tmp_path / "HC" / "checkpoints" / "global_step160")], stats.checkpoints
    assert args.new_head and args.preset is None and args.robustness == "sst2" and len(args.finetune_seeds) >= 3
    argv = ablation.pretrain_args("HC+SR", args, tmp_path / "HC_SR")
    assert "--model" not in argv and "--new-head" in argv and argv[argv.index("--init-from") + 1] == args.init_from
    assert ablation._check(args, tmp_path) == ["rte", "mrpc", "cola", "sst2"]
    for change, refusal in ((["--preset", "auto", "--init-from", ""], "--preset auto takes the architecture of"),
                            (["--robustness", "qnli"], "--robustness qnli scores a task's fine-tuned models")):
        wrong = build_parser().parse_args(["ablation", *words, *change])
        with pytest.raises(UserError, match=refusal):
            ablation._check(wrong, tmp_path)


def test_table_6_variants_launch_over_a_hostfile_with_the_init_pair_and_the_checkpoint_schedule(tmp_path, monkeypatch):
    """HC_Embedding and SR_Sent launch with their own objectives; --hostfile and --launcher-args go to `deepspeed`
    as `truneg preflight` takes them (every slot of the hostfile: no --num_gpus); --init-from and
    --init-generator go to every variant; saves fall on each checkpoint of Table 2's schedule."""
    import subprocess as sp

    from truneg.cli import build_parser
    from truneg.eval import ablation

    commands = []
    monkeypatch.setattr(ablation.subprocess, "run",
                        lambda cmd, **kw: commands.append(cmd) or sp.CompletedProcess(cmd, 0))
    args = build_parser().parse_args(["ablation", "--variants", "HC_Embedding,SR_Sent", "--hc-embeddings", "w2v.txt",
                                      "--hostfile", "hosts", "--launcher-args", "--launcher slurm --num_nodes 2",
                                      "--init-from", "google/electra-base-discriminator", "--init-generator",
                                      "google/electra-base-generator", "--preset", "electra-base", "--steps", "200000",
                                      "--master-port", "29600"])
    for variant in args.variants:
        ablation.pretrain(variant, args, tmp_path / variant)
    for variant, cmd in zip(args.variants, commands):
        script = next(i for i, c in enumerate(cmd) if c.endswith("pretrain.py"))
        assert cmd[1:script] == ["--hostfile", "hosts", "--launcher", "slurm", "--num_nodes", "2", "--master_port",
                                 "29600"]
        flags = dict(zip(cmd[script + 1::2], cmd[script + 2::2]))
        assert flags["--init-from"] == "google/electra-base-discriminator"
        assert flags["--init-generator"] == "google/electra-base-generator"
        assert flags["--save-steps"] == "12500"  # 6.25 % of 200k: every checkpoint of 6.25,12.5,25,50,75,100 %
        objectives = [(f, cmd[i + 1]) for i, f in enumerate(cmd) if f in ("--hc", "--sr", "--hc-embeddings")]
        assert objectives == {"HC_Embedding": [("--hc", "embedding"), ("--hc-embeddings", "w2v.txt")],
                              "SR_Sent": [("--sr", "sent")]}[variant]
    assert ablation.fn_steps(200000, [6.25, 12.5, 25, 50, 80, 100])[-2:] == [160000, 200000]
    assert ablation.save_steps(200000, [6.25, 12.5, 25, 50, 80, 100]) == 2500  # the paper's 80 %: 80 saves
    assert ablation.save_steps(8, []) == 8
    # 300 steps at 6.25 %: a gcd of 1 would save every step; the schedule goes onto the first checkpoint's grid
    assert ablation.save_steps(300, [6.25, 12.5, 25, 50, 75, 100]) == 19
    assert ablation.fn_steps(300, [6.25, 12.5, 25, 50, 75, 100]) == [19, 38, 76, 152, 228, 300]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ablation", "--variants", "HC,Word2Vec"])


def test_an_ablation_killed_between_stages_continues_without_repeating_a_finished_one(tmp_path, monkeypatch):
    """Every stage recorded in stages.json: killed during the second seed of HC's MRPC, the same command runs
    that seed alone (its first seed's folder kept), then the report; once more, nothing at all."""
    import subprocess as sp

    from transformers import BertConfig

    from truneg.cli import build_parser
    from truneg.errors import UserError
    from truneg.eval import ablation
    from truneg.train.checkpointing.checkpoint import META_FILE

    for task in ("RTE", "MRPC"):
        (tmp_path / "glue" / task).mkdir(parents=True)
        (tmp_path / "glue" / task / "train.tsv").write_text("")
    (tmp_path / "valid.txt").write_text("text\n")
    out, calls, kill = tmp_path / "out", [], {"at": ("HC", "mrpc", 2)}

    def pretrain(variant, args, folder):
        calls.append(("pretrain", variant))
        for step in (4, 6, 8):  # --fn-checkpoints 50,100 of 8 steps: saves every 4... and one tag off-schedule
            (folder / "checkpoints" / f"global_step{step}").mkdir(parents=True)
            (folder / "checkpoints" / f"global_step{step}" / META_FILE).write_text("{}")
        (folder / "checkpoints" / "latest").write_text("global_step8")

    def export(checkpoints, hf):
        calls.append(("export", hf.parent.name))
        BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2).save_pretrained(hf)
        (hf / "model.safetensors").write_bytes(b"")

    def fn_stats_process(cmd, **kw):  # `truneg fn-stats` as a process
        tags = cmd[cmd.index("--checkpoints") + 1:cmd.index("--data")]
        fn = cmd[cmd.index("--out") + 1]
        calls.append(("fn-stats", [t.rsplit("/", 1)[1] for t in tags]))
        rows = [{"checkpoint": t, "step": int(t.rsplit("step", 1)[1]), "sequences": 4, "mismatched": 10,
                 "iter_ratio": 0.25, "pred_ratio": 0.1} for t in tags]
        (tmp_path / fn).mkdir(parents=True, exist_ok=True)
        (tmp_path / fn / "fn_stats.json").write_text(json.dumps(rows))
        return sp.CompletedProcess(cmd, 0)

    def finetune(task, model, data_dir, folder, seed, max_train_samples, **recipe):
        variant = model.parent.name
        calls.append(("glue", variant, task, seed, recipe["lr"]))
        if kill["at"] == (variant, task, seed):
            raise KeyboardInterrupt  # the job killed here
        results = {"task": task, "accuracy": 0.5 + seed / 100 + (variant == "HC") / 10, "seed": seed, **recipe,
                   "max_train_samples": max_train_samples}
        folder.mkdir(parents=True)
        (folder / "results.json").write_text(json.dumps(results))
        return results

    reports = []
    real_report = ablation.report
    monkeypatch.setattr(ablation, "report", lambda *a: reports.append(a) or real_report(*a))
    for name, spy in (("pretrain", pretrain), ("export", export), ("finetune", finetune)):
        monkeypatch.setattr(ablation, name, spy)
    monkeypatch.setattr(ablation.subprocess, "run", fn_stats_process)
    argv = ["ablation", "--variants", "baseline,HC", "--tasks", "rte,mrpc", "--glue-dir", str(tmp_path / "glue"),
            "--output-dir", str(out), "--steps", "8", "--fn-checkpoints", "50,100", "--fn-data",
            str(tmp_path / "valid.txt"), "--finetune-seeds", "1,2"]
    with pytest.raises(KeyboardInterrupt):
        ablation.run_ablation(build_parser().parse_args(argv))
    done = json.loads((out / "stages.json").read_text())["done"]
    fn = f"fn-stats (data {tmp_path / 'valid.txt'})"
    assert list(done) == ["baseline/pretrain", "baseline/export", f"baseline/{fn}", "baseline/glue/rte (seeds 1,2)",
                          "baseline/glue/mrpc (seeds 1,2)", "HC/pretrain", "HC/export", f"HC/{fn}",
                          "HC/glue/rte (seeds 1,2)"]
    assert ("fn-stats", ["global_step4", "global_step8"]) in calls  # the schedule's checkpoints only
    assert ("glue", "baseline", "rte", 1, 1e-4) in calls  # a bert-tiny-sized export: BERT's compact recipe
    calls.clear()
    kill["at"] = None
    record = ablation.run_ablation(build_parser().parse_args(argv))
    assert calls == [("glue", "HC", "mrpc", 2, 1e-4)]  # not even HC's MRPC seed 1, nor any earlier stage
    assert record["scores"]["HC"] == {"rte": pytest.approx(61.5), "mrpc": pytest.approx(61.5)}  # medians
    assert len(reports) == 1 and "| HC | 2 |" in (out / "report" / "glue.md").read_text()
    assert "| HC | global_step8 | 8 | 100.00 | 25.00 | 10.00 |" in (out / "report" / "false_negatives.md").read_text()
    calls.clear()
    ablation.run_ablation(build_parser().parse_args(argv))
    assert calls == [] and len(reports) == 1
    # a seed more: only that seed of each fine-tuning runs (not a skipped stage), then the report again
    more = [*argv[:-1], "1,2,3"]
    ablation.run_ablation(build_parser().parse_args(more))
    assert calls == [("glue", v, t, 3, 1e-4) for v in ("baseline", "HC") for t in ("rte", "mrpc")]
    assert len(reports) == 2 and json.loads((out / "HC" / "glue" / "rte" / "results.json").read_text())["seeds"] == [
        1, 2, 3]
    # another learning rate over the finished seeds: one line, nothing run
    calls.clear()
    with pytest.raises(UserError, match=r"was fine-tuned with lr 0.0001 \(now 0.001\)"):
        ablation.run_ablation(build_parser().parse_args([*more, "--lr", "1e-3"]))
    assert calls == []
    # so does a subset of the training examples that the finished seeds did not train on
    with pytest.raises(UserError, match=r"was fine-tuned with max_train_samples None \(now 100\)"):
        ablation.run_ablation(build_parser().parse_args([*more, "--max-train-samples", "100"]))
    assert calls == []
    # fn-stats over other text runs again (and the report), the fine-tunings do not
    ablation.run_ablation(build_parser().parse_args([*more, "--fn-max-sequences", "2"]))
    assert [c[0] for c in calls] == ["fn-stats", "fn-stats"] and len(reports) == 3
    calls.clear()
    # other pre-training settings in the same folder would mix two runs: one line, nothing run
    with pytest.raises(UserError, match=r"holds an ablation run with steps 8 \(now 9\)"):
        ablation.run_ablation(build_parser().parse_args([*argv, "--steps", "9"]))
    assert calls == []


def test_an_ablation_without_glue_tasks_tabulates_no_scores():
    """--tasks '' (the variants pre-trained and counted by fn-stats only): no average over no task."""
    from truneg.eval.ablation import format_table

    assert format_table({"baseline": {}, "HC": {}}, []) == ("no GLUE task fine-tuned (--tasks ''): baseline, HC "
                                                           "pre-trained and counted by fn-stats")
