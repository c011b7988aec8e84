"""BERT's two phases: phase 2 (seq 128 here, 512 on clusters) starts from a phase-1 checkpoint with
--phase1-checkpoint, carrying the fp32 masters, the moments and the counters, and resetting the LR schedule, every
optimizer hyper-parameter, the data order and the metric sums. Phase 1 is the bert-zero2 reference run (2 ranks,
ZeRO-2, seq 64, 24 steps); DeepSpeed's universal form of its tag is the independent per-parameter reference."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    comparable,
    deepspeed_cmd,
    finished,
    free_port,
    kill_group,
    read_metrics,
    run,
    start,
    wait_for,
)

PHASE1_STEP = 24  # the reference run's last step, its `latest`
STEPS, SAVE = 8, 4  # phase 2's
# Phase 2's optimizer settings, each other than phase 1's (cpu_zero2.json: betas 0.9/0.999, eps 1e-6, weight decay
# 0.01, clipping 1.0, warm-up 20 steps of log shape from 0): the optimizer must hold these after the load.
PHASE2_ADAM = {"lr": 1e-3, "betas": [0.8, 0.98], "eps": 1e-8, "weight_decay": 0.05, "torch_adam": True}
PHASE2_CLIP, PHASE2_WARMUP = 0.5, 4


def phase2_config(folder: Path, stage: int = 2) -> Path:
    config = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    config["optimizer"]["params"] = PHASE2_ADAM
    config["scheduler"]["params"].update(warmup_max_lr=PHASE2_ADAM["lr"], warmup_num_steps=PHASE2_WARMUP,
                                         warmup_type="linear")
    config["gradient_clipping"] = PHASE2_CLIP
    config["zero_optimization"]["stage"] = stage
    path = folder / f"phase2_zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


def phase2_args(phase1: Path, out: Path, corpus: Path, config: Path, *extra: str) -> list[str]:
    return ["--phase1-checkpoint", str(phase1), "--deepspeed_config", str(config), "--train-data", str(corpus),
            "--seq-len", "128", "--micro-batch-size", "4", "--max-steps", str(STEPS), "--save-steps", str(SAVE),
            "--log-steps", "1", "--output-dir", str(out), "--hc", "wordnet", "--sr", "word",
            "--eval-data", str(corpus), "--eval-max-sequences", "16", *extra]


def listing(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its modification time: what phase 2 must leave as it found it."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in sorted(folder.rglob("*"))}


def universal(checkpoint_dir: Path, tag: str, into: Path) -> Path:
    from truneg.train.checkpointing import checkpoint

    return checkpoint.convert_to_universal(checkpoint_dir, tag, into)


def reference_state(universal_dir: Path, name: str, key: str) -> torch.Tensor:
    return torch.load(universal_dir / "zero" / name / f"{key}.pt", weights_only=False)["param"]


def started_state(engine, state) -> dict:
    """What phase 2 holds before its first step, per parameter and overall (a collective: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from truneg.train.loop import innermost_optimizer

    inner = innermost_optimizer(engine)
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):  # ZeRO-1/2 link them at the first step
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    params = {}
    for name, param in engine.module.named_parameters():
        moments = {key: safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")}
        params[name] = {"fp32": safe_get_full_fp32_param(param).clone(), **moments}
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in inner.param_groups]
    return {"params": params, "steps": steps, "moments_held": len(inner.state), "groups": groups,
            "clip_grad": engine.optimizer.clip_grad, "scheduler_iteration": engine.lr_scheduler.last_batch_iteration,
            "global_steps": engine.global_steps, "global_samples": int(engine.global_samples),
            "skipped_steps": engine.skipped_steps, "sampler": state.batches.position, "first_step": state.first_step}


def run_rank(dump: Path, argv: list[str]) -> None:
    """A rank of the unbroken phase 2 (this file run as a script): pretrain.py's main, its state dumped before the
    first step (rank 0), then trained to the end."""
    from truneg import pretrain
    from truneg.train import build, loop
    from truneg.train.ranks import distributed

    real_open_blocks, real_train, read = build.open_blocks, loop.train, {}

    def open_blocks(cfg, start):
        blocks, record = real_open_blocks(cfg, start)
        read["seq_len"] = blocks.seq_len
        return blocks, record

    def train(cfg, engine, state):
        started = started_state(engine, state)
        if int(os.environ["RANK"]) == 0:
            torch.save({**started, **read}, dump)
        real_train(cfg, engine, state)

    build.open_blocks, loop.train = open_blocks, train
    sys.argv = ["pretrain.py", *argv]
    distributed.run_then_exit(pretrain.main)


@pytest.fixture(scope="module")
def unbroken(runs, launch_env, small_corpus, tmp_path_factory):
    """Phase 2 on 2 ranks from the reference run, uninterrupted, its state before the first step dumped by rank 0.
    Returns (phase 1's folder, phase 2's folder, the dump, phase 2's config, phase 1's listing before)."""
    phase1, _ = runs("bert-zero2")
    before = listing(phase1)
    root = tmp_path_factory.mktemp("phases")
    out, dump, config = root / "phase2", root / "started.pt", phase2_config(root)
    argv = phase2_args(phase1, out, small_corpus, config)
    port = free_port()
    env = {**launch_env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), launch_env.get("PYTHONPATH", "")]),
           "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, __file__, str(dump), *argv], cwd=REPO, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    outputs = finished(ranks)
    for proc, output in zip(ranks, outputs):
        assert proc.returncode == 0, output[-3000:]
    return phase1, out, torch.load(dump, weights_only=False), config, before, outputs[0]


def test_phase_2_carries_the_masters_and_moments_and_resets_the_schedule_and_settings(unbroken, tmp_path):
    phase1, out, started, _, before, stdout = unbroken
    reference = universal(phase1 / "checkpoints", f"global_step{PHASE1_STEP}", tmp_path)
    # carried, bitwise, per parameter: fp32 masters, both moments, the step counts
    for name, got in started["params"].items():
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            want = reference_state(reference, name, key).view_as(got[key])
            assert torch.equal(got[key], want), (name, key)
    assert started["steps"] == [float(PHASE1_STEP)]
    meta = json.loads((phase1 / "checkpoints" / f"global_step{PHASE1_STEP}" / "truneg_meta.json").read_text())
    assert (started["global_steps"], started["global_samples"]) == (PHASE1_STEP, meta["samples"])
    # reset: the schedule (the warm-up's start: lr 0, read from the optimizer before the step), every hyper-parameter
    # to phase 2's config (phase 1's are all different), the data order
    saved = torch.load(reference / "zero" / "optimizer_state.pt", weights_only=False)
    phase1_groups = saved["param_groups"]  # (ZeRO-1/2's universal form)
    assert phase1_groups[0]["lr"] > 0 and saved["clip_grad"] == 1.0
    assert started["scheduler_iteration"] == -1 and [g["lr"] for g in started["groups"]] == [0.0, 0.0]
    assert [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in started["groups"]] == \
        [((0.8, 0.98), 1e-8, 0.05), ((0.8, 0.98), 1e-8, 0.0)]
    assert [(tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in phase1_groups] == \
        [((0.9, 0.999), 1e-6, 0.01), ((0.9, 0.999), 1e-6, 0.0)]
    assert started["clip_grad"] == PHASE2_CLIP
    assert started["sampler"] == {"epoch": 0, "offset": 0}
    assert started["seq_len"] == 128 and started["first_step"] == PHASE1_STEP
    # continued: the steps and tags follow on from phase 1; the warm-up is phase 2's, linear over 4 steps
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(PHASE1_STEP + 1, PHASE1_STEP + STEPS + 1))
    assert [r["lr"] for r in records[:PHASE2_WARMUP + 1]] == \
        [PHASE2_ADAM["lr"] * k / PHASE2_WARMUP for k in range(PHASE2_WARMUP + 1)]
    assert records[0]["samples"] == meta["samples"] + 8  # micro-batch 4 x 2 ranks
    assert [r["step"] for r in read_metrics(out, "eval")] == list(range(PHASE1_STEP, PHASE1_STEP + STEPS + 1, SAVE))
    tags = sorted(p.name for p in (out / "checkpoints").glob("global_step*"))
    assert tags == sorted(f"global_step{PHASE1_STEP + s}" for s in range(SAVE, STEPS + 1, SAVE))
    record = json.loads((out / "run.json").read_text())
    assert (record["phase1_checkpoint"], record["phase1_tag"], record["phase1_step"]) == \
        (str((phase1 / "checkpoints").resolve()), f"global_step{PHASE1_STEP}", PHASE1_STEP)
    assert listing(phase1) == before  # phase 1's folder: not a file added, changed or touched
    # the export of a phase-2 run is an ordinary HF BERT with 512 positions
    from conftest import cli_in_process
    from transformers import BertForMaskedLM

    assert cli_in_process("export", str(out), str(tmp_path / "hf")).returncode == 0
    exported = BertForMaskedLM.from_pretrained(tmp_path / "hf")
    assert exported.bert.embeddings.position_embeddings.weight.shape[0] == 512
    assert f"phase 2 from {phase1 / 'checkpoints'}/global_step{PHASE1_STEP} at step {PHASE1_STEP}" in stdout


def test_a_killed_phase_2_starts_again_from_its_recorded_tag_and_resumes_bitwise(unbroken, runs, launch_env,
                                                                                  small_corpus, tmp_path):
    """kill -9 before phase 2's first save (then phase 1's `latest` moves: the recorded tag still holds), again after
    it; the same command each time, and the whole phase's records are the unbroken one's, bitwise."""
    reference_phase1, reference_out, _, config, _, _ = unbroken
    phase1, out = tmp_path / "phase1", tmp_path / "phase2"
    shutil.copytree(reference_phase1, phase1)
    cmd = deepspeed_cmd(*phase2_args(phase1, out, small_corpus, config), port=free_port())
    first = start(cmd, launch_env)
    try:
        assert wait_for(lambda: (out / "run.json").is_file(), 120)
    finally:
        kill_group(first)
        first.wait()
    (phase1 / "checkpoints" / "latest").write_text("global_step16")  # phase 1 resumed elsewhere, say
    second = start(cmd, launch_env)
    try:
        assert wait_for(lambda: (out / "checkpoints" / "latest").is_file(), 180)
    finally:
        kill_group(second)
        second.wait()
    third = run(cmd, launch_env)
    assert f"resumed from {out / 'checkpoints'} at step" in third.stdout
    assert comparable(read_metrics(out)) == comparable(read_metrics(reference_out))
    assert comparable(read_metrics(out, "eval")) == comparable(read_metrics(reference_out, "eval"))


def stage_config(folder: Path, stage: int) -> Path:
    """cpu_zero2.json at another ZeRO stage: phase 1's config for the in-process cases."""
    config = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    config["zero_optimization"]["stage"] = stage
    path = folder / f"phase1_zero{stage}.json"
    path.write_text(json.dumps(config))
    return path


def phase2_in_process(argv: list[str]):
    """pretrain.py's stages up to the first step, in this process (a world of one): (engine, state)."""
    from truneg.train import build, loop
    from truneg.train.checkpointing import checkpoint
    from truneg.train.ranks import distributed

    cfg, begin = build.checked_start(argv)
    distributed.init_distributed(cfg.output_dir)
    blocks, _ = build.open_blocks(cfg, begin)
    model = build.build_model(cfg, begin.table, vocab_size=len(begin.tokenizer))
    engine = build.build_engine(cfg, model, begin.ds_config)
    tag = checkpoint.prepare_universal(begin.resume, 1)
    return engine, loop.start_state(cfg, engine, blocks, begin.tokenizer, begin.resume, tag, begin.phase1)


@pytest.mark.parametrize("stage, phase1_ranks", [(0, 1), (2, 1), (2, 2)])
def test_reset_optimizer_keeps_the_masters_and_empties_the_moments(world_of_one, runs, small_corpus, tmp_path,
                                                                   stage, phase1_ranks, monkeypatch):
    """--reset-optimizer at ZeRO-0, ZeRO-2 and ZeRO-2 through the universal form (phase 1 on 2 ranks, phase 2 on 1):
    the fp32 masters are phase 1's, bitwise; no moment and no step count is left."""
    from deepspeed.utils import safe_get_full_fp32_param

    from truneg.pretrain import main
    from truneg.train import loop
    from truneg.train.loop import innermost_optimizer

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    if phase1_ranks == 2:
        phase1, _ = runs("bert-zero2")
        tag = f"global_step{PHASE1_STEP}"
    else:
        phase1, tag = tmp_path / "phase1", "global_step2"
        main(["--model", "bert-tiny", "--deepspeed_config", str(stage_config(tmp_path, stage)), "--train-data",
              str(small_corpus), "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", "2", "--save-steps", "2",
              "--output-dir", str(phase1), "--hc", "wordnet", "--sr", "word", "--lr", "2e-3"])
    before, out = listing(phase1), tmp_path / "phase2"
    engine, state = phase2_in_process(phase2_args(phase1, out, small_corpus, phase2_config(tmp_path, stage),
                                                  "--reset-optimizer"))
    try:
        inner = innermost_optimizer(engine)
        assert len(inner.state) == 0 and all("step" not in group for group in inner.param_groups)
        assert [group["lr"] for group in inner.param_groups] == [0.0, 0.0]
        assert inner.param_groups[0]["betas"] == tuple(PHASE2_ADAM["betas"])
        if stage == 0:  # the module's fp32 weights are the masters
            saved = torch.load(phase1 / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)
            weights_now = engine.module.state_dict()
            assert all(torch.equal(weights_now[name], weights) for name, weights in saved["module"].items())
        else:
            reference = universal(phase1 / "checkpoints", tag, tmp_path / "reference")
            for name, param in engine.module.named_parameters():
                got = safe_get_full_fp32_param(param)
                assert torch.equal(got, reference_state(reference, name, "fp32").view_as(got)), name
        assert any((out / "phase1").glob(f"*/{tag}_universal")) == (phase1_ranks == 2)  # under phase 2's folder
        assert listing(phase1) == before
        # the emptied optimizer takes its first step as a fresh one does: moments and a step count of 1
        stop, guard = loop.StopSignal(), loop.SkipGuard(engine)
        loop.train_step(engine, state, stop, guard, set())
        assert inner.state and {float(s["step"]) for s in inner.state.values()} == {1.0}
    finally:
        engine.destroy()


def test_phase_2_refuses_what_it_cannot_start_from_in_one_line(world_of_one, runs, small_corpus, tmp_path, capsys,
                                                               monkeypatch):
    from conftest import cli_in_process

    from truneg.pretrain import main

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))  # the corpus prepared here, once

    phase1, _ = runs("bert-zero2")
    config = phase2_config(tmp_path)
    cut = tmp_path / "cut" / "checkpoints"  # a phase 1 whose only save was cut: a tag without META
    (cut / "global_step1").mkdir(parents=True)
    (cut / "latest").write_text("global_step1")
    electra = tmp_path / "electra"  # an ELECTRA phase 1
    shutil.copytree(phase1 / "checkpoints" / f"global_step{PHASE1_STEP}", electra / "checkpoints" / "global_step24",
                    ignore=lambda folder, names: [n for n in names if n.endswith(".pt")])
    (electra / "checkpoints" / "latest").write_text("global_step24")
    record = json.loads((phase1 / "run.json").read_text())
    (electra / "run.json").write_text(json.dumps({**record, "model": "electra-tiny",
                                                  "architecture": {**record["architecture"], "family": "electra"}}))
    prepared = tmp_path / "prepared64"
    assert cli_in_process("prepare", "--train-data", str(small_corpus), "--seq-len", "64", "--out",
                          str(prepared)).returncode == 0
    other_run = tmp_path / "other"  # phase 2's folder holds another run (phase 1's copy)
    shutil.copytree(phase1, other_run)
    other_before = listing(other_run)
    out = tmp_path / "phase2"
    cases = [
        (phase2_args(cut.parent, out, small_corpus, config), "is not a complete checkpoint"),
        (phase2_args(phase1, out, prepared, config), "holds blocks of --seq-len 64, not 128"),
        (phase2_args(phase1, out, small_corpus, phase2_config(tmp_path, stage=3)), "ZeRO stage 2, this config"),
        (phase2_args(phase1, out, small_corpus, config)[:-8] + ["--hc", "none"], "pass --hc wordnet"),
        (phase2_args(phase1, out, small_corpus, config, "--model", "bert-base"), "phase 1 trained bert-tiny"),
        (phase2_args(electra, out, small_corpus, config), "phase 1 is an ELECTRA run"),
        (phase2_args(phase1, out, small_corpus, config, "--init-from", str(phase1)), "drop --init-from"),
        (phase2_args(phase1, out, small_corpus, config, "--resume", str(phase1 / "checkpoints")), "drop --resume"),
        (["--resume", str(phase1 / "checkpoints"), "--seq-len", "128", "--train-data", str(small_corpus),
          "--output-dir", str(out)], "--phase1-checkpoint"),
        (["--reset-optimizer", "--output-dir", str(out)], "pass that too"),
        (phase2_args(phase1, other_run, small_corpus, config), "holds another run's checkpoints"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        err = capsys.readouterr().err  # (the corpus's preparation may draw its progress bar first)
        assert stopped.value.code == 2 and err.count("truneg: error: ") == 1, (expected, err)
        assert err.splitlines()[-1].startswith("truneg: error: ") and expected in err.splitlines()[-1], (expected, err)
        assert not out.exists(), expected
    assert listing(other_run) == other_before
    # `truneg preflight` checks phase 1's optimizer, precision and stage too, and sizes the run by phase 1's preset
    from truneg.cluster import preflight

    assert preflight.run(phase2_args(phase1, out, small_corpus, phase2_config(tmp_path, stage=3))) == 2
    assert "phase 1 ran with ZeRO stage 2, this config with 3" in capsys.readouterr().err
    assert preflight.run(phase2_args(phase1, out, small_corpus, config)) == 0
    assert not out.exists()


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), sys.argv[2:])


def test_the_phase_1_tag_phase_2_records_holds_on_a_restart_not_afresh_and_is_all_a_resume_needs(tmp_path):
    from truneg.errors import UserError
    from truneg.train.checkpointing import phases

    phase1, out = tmp_path / "phase1", tmp_path / "phase2"
    for step in (16, 24):
        (phase1 / "checkpoints" / f"global_step{step}").mkdir(parents=True)
        meta = {"step": step, "world_size": 2, "samples": 8 * step}
        (phase1 / "checkpoints" / f"global_step{step}" / "truneg_meta.json").write_text(json.dumps(meta))
    (phase1 / "checkpoints" / "latest").write_text("global_step24")
    (phase1 / "run.json").write_text(json.dumps({"model": "bert-tiny"}))
    assert phases.find_phase1(str(phase1), out).tag == "global_step24"  # a first start: phase 1's `latest`
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"phase1_checkpoint": str((phase1 / "checkpoints").resolve()),
                                              "phase1_tag": "global_step16", "phase1_step": 16}))
    assert phases.find_phase1(str(phase1), out).tag == "global_step16"  # a restart: the tag it started from
    assert phases.find_phase1(str(phase1), out, pinned=False).tag == "global_step24"  # --overwrite, --resume none
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("global_step20")  # phase 2 has saved
    with pytest.raises(UserError, match="started from global_step16, not global_step24"):
        phases.find_phase1(str(phase1 / "checkpoints" / "global_step24"), out)
    shutil.rmtree(phase1 / "checkpoints" / "global_step16")  # phase 1 deleted it since: the record is enough
    assert phases.find_phase1(str(phase1), out).step == 16
    # a phase 1 that has not saved yet (PHASE=all checks phase 2 first): nothing to check against
    (tmp_path / "new" / "checkpoints" / "hf_config").mkdir(parents=True)
    assert not phases.started(str(tmp_path / "new")) and phases.started(str(phase1))


def test_a_phase_2_is_a_bert_run_for_the_flag_checks():
    from truneg.errors import UserError
    from truneg.train.config.args import parse_args

    assert parse_args(["--phase1-checkpoint", "p1", "--sr", "sent", "--sr-sent-target", "original"])
    with pytest.raises(UserError, match="together at most 1"):  # BERT's 0.1 random share beside it
        parse_args(["--phase1-checkpoint", "p1", "--mask-replace-prob", "0.95"])
