"""Faults: bad input, non-finite losses, a failure on one rank, preemption, repeated kill -9. (Another world
size and two nodes: test_topology.)"""
from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    EXIT_PROBE,
    MAX_STEPS,
    REPO,
    SAVE_STEPS,
    cli_in_process,
    comparable,
    deepspeed_cmd,
    free_port,
    kill_group,
    mid_run_copy,
    read_metrics,
    resume_and_match,
    run,
    shm_allreduce_buffers,
    start,
    start_as_mpirun,
    train_args,
    wait_for,
)

from truneg.train.checkpointing import checkpoint


def pretrain_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "truneg.pretrain", *args]


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("truneg: error: ") and expected in last, last


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_bad_inputs_are_one_line_errors(tmp_path, launch_env, small_corpus, monkeypatch, capsys):
    from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymTable

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "broken.json").write_text('{"train_micro_batch_size_per_gpu": 4,,}')
    config = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    batch = {**config, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}
    (tmp_path / "batch.json").write_text(json.dumps(batch))
    (tmp_path / "fp16.json").write_text(json.dumps({**config, "fp16": {"enabled": True}}))
    (tmp_path / "decoupled.json").write_text(json.dumps({**config, "checkpoint": {"writer": {"decoupled": True}}}))
    (tmp_path / "bf16_true.json").write_text(json.dumps({**config, "bf16": True}))
    (tmp_path / "stage_str.json").write_text(json.dumps({**config, "zero_optimization": {"stage": "2"}}))
    (tmp_path / "afile.txt").write_text("")
    SynonymTable.from_pairs([(1, 2)], ["[PAD]", "big", "large"], "tsv", {}).save(tmp_path / "other_vocab.npz")
    (tmp_path / "truncated.npz").write_bytes(SHIPPED_WORDNET_TABLE.read_bytes()[:5000])
    other_run = tmp_path / "other_run"
    (other_run / "checkpoints" / "global_step5").mkdir(parents=True)
    (other_run / "checkpoints" / "latest").write_text("global_step5")
    (other_run / "checkpoints" / "global_step5" / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (other_run / "run.json").write_text('{"model": "bert-large"}')
    before = snapshot(other_run)
    broken_ckpt = tmp_path / "broken_ckpt"
    (broken_ckpt / "global_step1").mkdir(parents=True)
    (broken_ckpt / "latest").write_text("global_step1")
    (broken_ckpt / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"\x00garbage")

    base = ["--model", "bert-tiny", "--train-data", str(small_corpus), "--seq-len", "64", "--max-steps", "2"]
    # Checked before any process group exists (shared with `truneg preflight`): tested in this process.
    before_processes = {
        "missing corpus": (["--train-data", str(tmp_path / "nope")], "no text files found"),
        "empty corpus": (["--train-data", str(tmp_path / "empty.txt")], "is empty"),
        "unknown preset": (["--model", "gpt-9"], "unknown model preset 'gpt-9'"),
        "seq-len too long": (["--seq-len", "1024"], "beyond the model's 512 positions"),
        "dropout out of range": (["--dropout", "1.5"], "--dropout must be a finite number >= 0 and < 1, not 1.5"),
        "negative save steps": (["--save-steps", "-1"], "--save-steps must be >= 0, not -1"),
        "sr-sent-target for electra": (["--model", "electra-tiny", "--sr", "sent", "--sr-sent-target", "original"],
                                       "--sr-sent-target original is for BERT"),
        "resume and overwrite": (["--resume", str(other_run / "checkpoints"), "--overwrite"],
                                 "--overwrite starts afresh, --resume"),
        "malformed config": (["--deepspeed_config", str(tmp_path / "broken.json")], "is not valid JSON (line 1"),
        "batch sizes": (["--deepspeed_config", str(tmp_path / "batch.json")], "train_batch_size 10 does not split over "
                                                                              "4"),
        "fp16 on cpu": (["--deepspeed_config", str(tmp_path / "fp16.json")], "enables fp16, which the CPU does not "
                                                                             "support"),
        "decoupled checkpoint writer": (["--deepspeed_config", str(tmp_path / "decoupled.json")],
                                        "decoupled checkpoint writer (checkpoint.writer.decoupled"),
        "config section of the wrong type": (["--deepspeed_config", str(tmp_path / "bf16_true.json")],
                                             "bf16 is true; it must be an object"),
        "zero stage as a string": (["--deepspeed_config", str(tmp_path / "stage_str.json")],
                                   'zero_optimization.stage is "2"; it must be an integer'),
        "negative seed": (["--seed", "-1"], "--seed must be >= 0, not -1"),
        "infinite lr": (["--lr", "inf"], "--lr must be a finite number > 0, not inf"),
        "output folder is a file": (["--output-dir", str(tmp_path / "afile.txt")], "afile.txt is a file"),
        "table for another vocab": (["--hc", str(tmp_path / "other_vocab.npz")], "built for vocab sha256"),
        "truncated table": (["--hc", str(tmp_path / "truncated.npz")], "corrupt or truncated"),
        "stale build lock": ([], "delete it if no build is running"),
        "missing eval data": (["--eval-data", str(tmp_path / "nope")], "--eval-data: no text files found"),
        "empty eval data": (["--eval-data", str(tmp_path / "empty.txt")], "--eval-data: the corpus at"),
        "eval data short of a batch per rank": (["--eval-data", str(tmp_path / "short.txt")],
                                                "fewer than one micro-batch per rank (1 x "),
        "non-positive eval steps": (["--eval-data", str(small_corpus), "--eval-steps", "0"],
                                    "--eval-steps must be >= 1, not 0"),
        "eval steps without eval data": (["--eval-steps", "5"], "pass --eval-data too"),
        "eval table without eval data": (["--eval-synonyms", str(tmp_path / "other_vocab.npz")],
                                         "pass --eval-data too"),
        "eval table not a table": (["--eval-data", str(small_corpus), "--eval-synonyms", str(small_corpus)],
                                   "is not a table file: pass a FILE.npz"),
        "eval table for another vocab": (["--eval-data", str(small_corpus), "--eval-synonyms",
                                          str(tmp_path / "other_vocab.npz")], "--eval-synonyms: synonym table"),
    }
    (tmp_path / "short.txt").write_text(small_corpus.read_text()[:600])  # two blocks of 64 tokens
    # A lock that a process killed while loading DeepSpeed's JIT-built comm op left behind.
    stale_lock = tmp_path / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    stale_lock.parent.mkdir(parents=True)
    stale_lock.touch()
    os.utime(stale_lock, (time.time() - 3600, time.time() - 3600))

    from truneg.errors import exit_on_user_error
    from truneg.train.build import checked_start
    from truneg.train.heldout import prepare_eval_data
    from truneg.train.ranks.distributed import launch_world_size

    def start_checks(argv: list[str]) -> None:  # pretrain.py's, before its process group
        cfg, start = checked_start(argv)
        prepare_eval_data(cfg, start, launch_world_size())

    for name, (extra, expected) in before_processes.items():
        out = [] if "--output-dir" in extra else ["--output-dir", str(tmp_path / f"out_{name.replace(' ', '_')}")]
        with monkeypatch.context() as patch:
            patch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
            if name == "stale build lock":
                patch.setenv("TORCH_EXTENSIONS_DIR", str(stale_lock.parent.parent))
            if name == "batch sizes":
                patch.setenv("WORLD_SIZE", "4")  # as the launcher sets it: 10 does not split over 4 ranks
            with pytest.raises(SystemExit) as exited:
                exit_on_user_error(start_checks)([*base, *extra, *out])
        err = capsys.readouterr().err
        assert_one_line_error(subprocess.CompletedProcess([], exited.value.code, "", err), expected)
    assert stale_lock.exists(), "truneg must not delete a lock that a running build may hold"
    # nothing written: no refused run made its output folder, nor touched the file named as one
    assert not list(tmp_path.glob("out_*")) and (tmp_path / "afile.txt").read_text() == ""

    # Found once the processes run: one real launch each, both at once.
    after_processes = {
        "another run's folder": (["--output-dir", str(other_run)], "holds another run's checkpoints"),
        "unreadable checkpoint": (["--resume", str(broken_ckpt), "--output-dir", str(tmp_path / "out_broken")],
                                  "cannot read checkpoint"),
    }
    procs = {name: subprocess.Popen(pretrain_cmd(*base, *extra), env=launch_env, cwd=REPO, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (extra, _) in after_processes.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr),
                              after_processes[name][1])
    assert snapshot(other_run) == before, "a refused run must not touch the folder"


def test_hostfile_errors_stop_the_launch_scripts(tmp_path, launch_env):
    bad = tmp_path / "hosts"
    bad.write_text("node-1 slots=8\nnode-2 slots=eight\n")
    proc = subprocess.run(["bash", str(REPO / "launch" / "bert_large.sh")], env={**launch_env, "HOSTFILE": str(bad),
                          "DATA": "/nowhere", "PYTHON": sys.executable}, capture_output=True, text=True)
    assert_one_line_error(proc, f"{bad}:2: 'node-2 slots=eight' is not `HOST slots=N`")
    for text, expected in [("a slots=0\n", "slots=0"), ("a slots=2\na slots=2\n", "listed twice"),
                           ("# only\n", "lists no node")]:
        bad.write_text(text)
        assert_one_line_error(subprocess.run([sys.executable, "-m", "truneg.cluster.hostfile", str(bad)],
                                             capture_output=True,
                                             text=True), expected)


def test_non_finite_losses_skip_their_step_then_stop_the_run(tmp_path, launch_env, small_corpus):
    """Step 3's loss is NaN (injected): that update is skipped, counted, and training goes on with finite
    losses. Steps 6-8 are NaN too: three in a row stop the run, with `latest` at the last good step. ZeRO-3
    in fp32: DeepSpeed's own check (the grad norm) skips the step too, counts it and holds the LR schedule."""
    out = tmp_path / "nan"
    env = {**launch_env, "TRUNEG_INJECT_NONFINITE_STEPS": "3,6,7,8"}
    proc = subprocess.run(pretrain_cmd("--model", "bert-tiny", "--train-data", str(small_corpus), "--seq-len", "64",
                                       "--micro-batch-size", "2", "--gradient-accumulation-steps", "2",
                                       "--max-steps", "20", "--save-steps", "1", "--log-steps", "1",
                                       "--max-nonfinite-steps", "3", "--output-dir", str(out),
                                       "--deepspeed_config", str(REPO / "ds_configs" / "cpu_zero3.json")),
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert_one_line_error(proc, "3 non-finite losses in a row at step 8")
    assert "last good checkpoint (global_step5)" in proc.stderr
    assert (out / "checkpoints" / "latest").read_text() == "global_step5"
    assert not (out / "checkpoints" / "global_step6").exists(), "no checkpoint inside a run of skipped steps"
    records = {r["step"]: r for r in read_metrics(out)}
    assert [records[s]["nonfinite_steps"] for s in range(1, 6)] == [0, 0, 1, 0, 0]
    assert "loss" not in records[3], "a skipped step has no loss to show"
    assert all(math.isfinite(records[s]["loss"]) for s in (1, 2, 4, 5)), "the NaN step left the weights finite"
    assert records[4]["loss"] < records[1]["loss"] + 1.0
    # `lr` is the next step's rate: warmup raises it every applied step, and the skipped step 3 leaves it
    assert records[1]["lr"] < records[2]["lr"] == records[3]["lr"] < records[4]["lr"]
    assert [records[s]["skipped_steps"] for s in range(1, 6)] == [0, 0, 1, 1, 1]  # DeepSpeed's running total


FP16_ZERO0_STEP = """
import json, os, sys, types
import torch, deepspeed
from deepspeed.accelerator import get_accelerator
from truneg.train import loop

os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
get_accelerator().is_fp16_supported = lambda: True  # DeepSpeed's fp16 optimizer itself runs on the CPU
if sys.argv[2] == "unscaled":
    loop.backward_loss_scale = lambda engine: 1.0  # what DeepSpeed's engine.backward alone does


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return (self.lin(x).float() - y).pow(2).mean(), {}


torch.manual_seed(0)
model, x, y = Tiny(), torch.randn(4, 8), torch.randn(4, 1)
reference = Tiny()
reference.load_state_dict({k: v.half().float() for k, v in model.state_dict().items()})
(reference(x.half().float(), y)[0]).backward()  # fp32 SGD from the same (fp16-rounded) weights
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0},
          # 1024: this loss's scaled gradients fit fp16
          "gradient_clipping": 0.0, "fp16": {"enabled": True, "initial_scale_power": 10}}
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
before = engine.module.lin.weight.detach().float().clone()
state = types.SimpleNamespace(batches=iter([{"x": x.half(), "y": y}]), rank=0,
                              metrics=types.SimpleNamespace(add=lambda *a: None))
loop.train_step(engine, state, types.SimpleNamespace(received=None), loop.SkipGuard(engine), set())
print(json.dumps({"optimizer": type(engine.optimizer).__name__, "skipped": engine.skipped_steps,
                  "step": (engine.module.lin.weight.float() - before).tolist(),
                  "expected": (-0.5 * reference.lin.weight.grad).tolist()}))
"""


def test_fp16_at_zero_stage_0_steps_as_fp32_does(tmp_path, launch_env, monkeypatch):
    """DeepSpeed 0.19's engine.backward leaves the loss unscaled for fp16 at ZeRO-0, where its fp16 optimizer
    (the LAMB recipe's) divides the gradients by the loss scale (deepspeedai/DeepSpeed#8393): train_step
    scales the loss itself. DeepSpeed's own FP16_UnfusedOptimizer, on the CPU, one SGD step against fp32's.
    Unscaled, the step is the loss scale (here 1,024) times too small; this also fails once DeepSpeed scales
    the loss itself (twice, then)."""
    script = tmp_path / "fp16_step.py"
    script.write_text(FP16_ZERO0_STEP)
    steps = {}
    for mode in ("scaled", "unscaled"):
        proc = subprocess.run([sys.executable, str(script), str(free_port()), mode], env=launch_env, cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = torch.tensor(steps["scaled"]["expected"])
    assert steps["scaled"]["optimizer"] == "FP16_UnfusedOptimizer" and steps["scaled"]["skipped"] == 0
    assert torch.allclose(torch.tensor(steps["scaled"]["step"]), expected, rtol=2e-2, atol=1e-3)
    assert torch.tensor(steps["unscaled"]["step"]).abs().max() < 1e-2 * expected.abs().max()
    # a DeepSpeed not known to leave it unscaled might scale it too: fp16 at ZeRO-0 is refused there
    import importlib.metadata

    from truneg.train.config import checks

    config = {"fp16": {"enabled": True}, "zero_optimization": {"stage": 0}}
    assert checks.check_fp16_loss_scaling(config) is None
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.19.9" if name == "deepspeed" else real(name))
    said = checks.check_fp16_loss_scaling(config)
    assert said.startswith("fp16 at ZeRO stage 0 with deepspeed 0.19.9: truneg scales the loss itself"), said
    assert checks.check_fp16_loss_scaling({**config, "zero_optimization": {"stage": 2}}) is None


def test_a_failure_on_rank_0_alone_stops_every_rank_with_one_line(runs, tmp_path, launch_env, small_corpus):
    """Rank 0 alone completes a checkpoint (META, `latest`); when that fails (here `latest.tmp` is a folder, as
    a full disk would fail it), the other ranks learn it from the same all-reduce and stop too, where across
    nodes they would wait in their next collective until the timeout. `latest` still names the last good tag."""
    reference_dir, _ = runs("bert-zero2")
    out = tmp_path / "run"
    mid_run_copy(reference_dir, out)  # at step 16: its save of step 24 fails
    (out / "checkpoints" / "latest.tmp").mkdir()
    proc = run(deepspeed_cmd(*train_args("bert-zero2", out, small_corpus), port=free_port()), launch_env, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "truneg: error:" in line]
    assert any(f"cannot complete {out / 'checkpoints' / 'global_step24'}: IsADirectoryError: [Errno 21]" in line
               for line in errors), errors
    assert any("rank 0 could not complete" in line and "every rank stopped" in line for line in errors), errors
    assert "Traceback" not in proc.stderr and (out / "checkpoints" / "latest").read_text() == "global_step16"


def test_the_load_pre_check_reads_what_the_load_reads_in_any_torch_format_and_names_a_damaged_file(tmp_path):
    """checkpoint.load opens a tag's files before DeepSpeed's load (the two-rank case: test_distributed): the
    files this world reads (not the RNG states of ranks it lacks, nor ds_to_universal's leftover tmp/), in
    torch's zip format or its legacy one (`checkpoint_serialization: false`), and a file cut short is named."""
    import torch

    from truneg.errors import UserError
    from truneg.train.checkpointing import integrity

    tag = tmp_path / "global_step8"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                 "truneg_rank00000.pt", "truneg_rank00001.pt", "zero/dense.weight/fp32.pt", "zero/optimizer_state.pt",
                 "tmp/dense.weight/0.pt"):
        (tag / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.arange(1000.0), "name": name}, tag / name)
    legacy = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    torch.save({"state": torch.ones(1000)}, legacy, _use_new_zipfile_serialization=False)
    (tag / "truneg_rank00001 (copy).pt").write_bytes(b"not a checkpoint")  # not truneg's name: checked as a file
    loaded = [p.relative_to(tag).as_posix() for p in integrity.files_to_load(tag, 1, saved_world_size=2)]
    assert loaded == ["mp_rank_00_model_states.pt", "truneg_rank00001 (copy).pt", "zero/dense.weight/fp32.pt",
                      "zero/optimizer_state.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                      "zero_pp_rank_1_mp_rank_00_optim_states.pt"]  # no RNG states: written by another world size
    (tag / "truneg_rank00001 (copy).pt").unlink()
    same_world = [p.name for p in integrity.files_to_load(tag, 2, saved_world_size=2)]
    assert "truneg_rank00000.pt" in same_world and "truneg_rank00001.pt" in same_world
    integrity.check_readable(integrity.files_to_load(tag, 2, 2), tag)  # the legacy file too
    for cut in (tag / "zero" / "optimizer_state.pt", legacy):
        cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
        with pytest.raises(UserError, match=rf"cannot read checkpoint {tag}: {cut.relative_to(tag)} is damaged \("):
            integrity.check_readable([cut], tag)
    unreadable = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    unreadable.unlink()
    unreadable.mkdir()  # an OSError, not the file's content: said as such, not "damaged"
    with pytest.raises(UserError, match=r"zero_pp_rank_0_mp_rank_00_optim_states.pt: .*Is a directory.*check its "
                                        r"permissions and file system"):
        integrity.check_readable([unreadable], tag)


def test_saving_again_into_the_tag_latest_names_moves_latest_back_first(tmp_path):
    """--resume of an older tag rolls the run back; its next save of the newer step clears the old folder (and a
    leftover of a kill during an earlier removal), but `latest` goes back to the newest complete tag first, so a
    kill during that save still leaves a checkpoint to resume from."""
    from truneg.train.checkpointing import checkpoint

    folder = tmp_path / "checkpoints"
    for step in (100, 200):
        (folder / f"global_step{step}").mkdir(parents=True)
        (folder / f"global_step{step}" / checkpoint.META_FILE).write_text("{}")
    (folder / "global_step300").mkdir()  # a save that was cut: no META
    (folder / "global_step200.deleting").mkdir()
    (folder / "latest").write_text("global_step300")
    checkpoint._clear(folder, "global_step300")
    assert checkpoint.latest_tag(folder) == "global_step200" and not (folder / "global_step300").exists()
    checkpoint._clear(folder, "global_step200")
    assert checkpoint.latest_tag(folder) == "global_step100"
    assert sorted(p.name for p in folder.iterdir()) == ["global_step100", "latest"]
    checkpoint._clear(folder, "global_step100")
    assert not (folder / "latest").exists() and not list(folder.iterdir())  # a fresh start, not a dangling name
    # META is written whole or not at all; one a file system lost (a power cut) is one line, not a traceback
    from truneg.errors import UserError

    (folder / "global_step400").mkdir()
    checkpoint._commit(folder, "global_step400", 400, 2)
    assert checkpoint.saved_world_size(folder,
                                       "global_step400") == 2 and checkpoint.latest_tag(folder) == "global_step400"
    (folder / "global_step400" / checkpoint.META_FILE).write_text("")
    with pytest.raises(UserError, match="truneg_meta.json is damaged; resume from another tag"):
        checkpoint.saved_world_size(folder, "global_step400")


def test_keep_checkpoints_counts_complete_ones_only(tmp_path):
    """A preemption's save cut by the launcher's SIGKILL (no META) is no checkpoint: --keep-checkpoints 2 keeps
    the two newest complete ones. A cut tag goes once two complete ones are newer (a run may have resumed from it
    by name: it stays as long as the old rule kept it)."""
    from truneg.train.checkpointing import checkpoint

    folder = tmp_path / "checkpoints"
    for step in (100, 150, 200, 220, 250):
        (folder / f"global_step{step}").mkdir(parents=True)
        if step not in (150, 220):
            (folder / f"global_step{step}" / checkpoint.META_FILE).write_text("{}")
    (folder / "global_step300").mkdir()  # a save under way past `latest`: not touched
    (folder / "latest").write_text("global_step250")
    assert checkpoint.remove_old(folder, 2) == ["global_step100", "global_step150"]
    assert sorted(p.name for p in folder.iterdir()) == ["global_step200", "global_step220", "global_step250",
                                                         "global_step300", "latest"]


def test_preemption_saves_at_the_next_step_and_resumes_exactly(runs, tmp_path, launch_env, small_corpus):
    """SIGTERM, then SIGINT on the resumed run (what schedulers and Ctrl-C send), then a run to the end: one
    chain of launches, each stop checkpointed at the next step and the whole equal to the uninterrupted run. It
    evaluates at every step, so each stop lands on an eval step: the stop saves without it, the resume evaluates
    it, and every step has one evaluation, equal to the uninterrupted run's where that has one."""
    reference_dir, _ = runs("bert-zero2")
    out = tmp_path / "preempted"
    args = [*train_args("bert-zero2", out, small_corpus), "--eval-steps", "1"]
    stopped_at = 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        started_at = stopped_at
        proc = start(deepspeed_cmd(*args, port=free_port()), launch_env)
        try:
            assert wait_for(lambda proc=proc, started_at=started_at: len(read_metrics(out)) >= started_at + 3
                            or proc.poll() is not None, timeout=240)
            kill_group(proc, sig)  # what a scheduler does: the whole process group at once
            output, _ = proc.communicate(timeout=120)
        finally:
            kill_group(proc, signal.SIGKILL)
        assert "stopped by signal at step" in output, (sig, output[-3000:])
        if started_at:
            assert f"at step {started_at}" in output
        stopped_at = int(output.split("stopped by signal at step ")[1].split(";")[0])
        assert started_at < stopped_at < MAX_STEPS, (sig, started_at, stopped_at)
        assert (out / "checkpoints" / "latest").read_text() == f"global_step{stopped_at}"
    last = run(deepspeed_cmd(*args, port=free_port()), launch_env)
    assert f"at step {stopped_at}" in last.stdout
    assert comparable(read_metrics(out)) == comparable(read_metrics(reference_dir))
    evals, reference_evals = comparable(read_metrics(out, "eval")), comparable(read_metrics(reference_dir, "eval"))
    assert [r["step"] for r in evals] == list(range(MAX_STEPS + 1))
    assert [r for r in evals if r["step"] % SAVE_STEPS == 0] == reference_evals and len(reference_evals) == 4


# EXIT_PROBE, and what a destroyed default group alone does not show: the threads of gloo's groups and of rank 0's
# store still running at exit (DeepSpeed's clone of the world outlives destroy_process_group while its engine is
# alive: its ZeRO optimizer's gradient hooks, held by autograd, keep it past gc).
THREADS_AT_EXIT_PROBE = EXIT_PROBE + '''
def _threads():
    if "RANK" in os.environ and "torch.distributed" in sys.modules:
        names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
        comm = sorted(name for name in names if name.startswith(("gloo", "pt_gloo", "pt_tcpstore")))
        os.write(1, f"rank {os.environ['RANK']} at exit: comm threads {comm}\\n".encode())

atexit.register(_threads)
'''


def tag_names(checkpoints: Path) -> set[str]:
    """The tag folders a save has begun: not the `*.deleting` folder a save into an existing tag first renames
    the old one to."""
    if not checkpoints.is_dir():
        return set()
    return {p.name for p in checkpoints.glob("global_step*") if not p.name.endswith(checkpoint.DELETING_SUFFIX)}


def test_repeated_kill_9_including_during_checkpoint_writes(runs, tmp_path, launch_env, small_corpus):
    """ELECTRA, ZeRO-2, reading a folder `truneg prepare` wrote: killed (SIGKILL, launcher and ranks at once)
    three times, twice as a checkpoint is being written (the first of a run started afresh, then the next) and
    then at a random moment of a resumed run's training, then run to the end: every loss equal to the
    reference's on the raw text file, `latest` only ever naming a complete checkpoint, and no /dev/shm buffer
    left behind by any launch."""
    reference = comparable(read_metrics(runs("electra-zero2")[0]))
    reference_evals = comparable(read_metrics(runs("electra-zero2")[0], "eval"))
    out, corpus = tmp_path / "chaos", tmp_path / "prepared"
    proc = cli_in_process("prepare", "--train-data", str(small_corpus), "--seq-len", "64", "--out", str(corpus))
    assert proc.returncode == 0, proc.stderr[-2000:]
    args = train_args("electra-zero2", out, corpus)
    checkpoints, latest = out / "checkpoints", out / "checkpoints" / "latest"
    rng = random.Random(1234)
    kills = []
    for trial in range(3):
        known = tag_names(checkpoints)
        port, log = free_port(), tmp_path / f"trial{trial}.log"
        proc = start(deepspeed_cmd(*args, port=port), launch_env, log)
        try:
            if trial < 2:  # during a checkpoint write: as soon as a new tag folder appears
                hit = wait_for(lambda known=known, proc=proc: proc.poll() is not None or
                               bool(tag_names(checkpoints) - known), timeout=240, interval=0.002)
            else:  # at a random moment of this launch's training: within a few steps of its first
                hit = wait_for(lambda proc=proc, log=log: proc.poll() is not None or
                               re.search(r"^step \d+/", log.read_text(), re.M) is not None, timeout=240)
                wait_for(lambda proc=proc: proc.poll() is not None, timeout=rng.uniform(0.05, 0.6))
            kill_group(proc, signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            kill_group(proc, signal.SIGKILL)
        assert hit and proc.returncode != 0, (trial, log.read_text()[-3000:])  # killed, not ended
        tag = latest.read_text() if latest.is_file() else None
        kills.append((trial, tag))
        if tag:  # `latest` only ever names a complete checkpoint
            assert (checkpoints / tag / "truneg_meta.json").is_file(), kills
        # DeepSpeed's CPU allreduce buffers live in RAM-backed /dev/shm: a killed run leaves none either
        assert shm_allreduce_buffers(port) == [], kills
    # by the last trial a checkpoint was complete (at the latest, the one before trial 1's new tag): it resumed
    assert kills[1][1] and f"resumed from {checkpoints} at step" in (tmp_path / "trial2.log").read_text(), kills
    assert read_metrics(out)[-1]["step"] < MAX_STEPS, kills
    resume_and_match(args, out, int(kills[-1][1].removeprefix("global_step")), reference, launch_env, reference_evals)


def test_an_orphaned_build_lock_is_told_from_one_a_live_process_holds(tmp_path):
    from torch.utils.file_baton import FileBaton

    from truneg.train.ranks.distributed import orphaned_build_locks

    (tmp_path / "held_op").mkdir()
    (tmp_path / "orphaned_op").mkdir()
    held = FileBaton(str(tmp_path / "held_op" / "lock"))
    assert held.try_acquire()  # as torch holds it while it loads or builds an op
    (tmp_path / "orphaned_op" / "lock").touch()  # as a process killed in between leaves it (its descriptor closed)
    try:
        assert orphaned_build_locks(tmp_path) == [(tmp_path / "orphaned_op" / "lock").resolve()]
    finally:
        held.release()
    assert orphaned_build_locks(tmp_path / "held_op") == []


def test_a_stopped_rank_and_diverged_replicas_stop_the_run_with_one_line_naming_rank_1(tmp_path, launch_env,
                                                                                      small_corpus):
    """Two faults that crash nothing, two 2-rank runs at once, each started as mpirun starts them (no launcher to
    stop the others when one rank ends):
    - rank 1 stopped with SIGSTOP mid-run: rank 0 waits in a collective of the step, and its watchdog, past
      --step-timeout, writes rank 0's stack into the output folder, names rank 1 in one line and exits, where
      without it rank 0 would wait the collective timeout (10 minutes) and say nothing of who was behind;
    - TRUNEG_INJECT_DIVERGE=8: rank 1 changes one weight after step 8's update; the replica check before step 8's
      checkpoint (8 is no multiple of --replica-check-steps 3) stops both ranks naming rank 1 and the parameter,
      and `latest` stays the checkpoint of step 4; each leaves with its process groups destroyed and their
      threads ended (THREADS_AT_EXIT_PROBE), as a group left alive at sys.exit(2) aborted rank 0 in the
      interpreter's teardown now and then (exit -6, not 2).
    Every assertion holds beside other work (a second pytest, `stress`): none but the watchdog's bound is timed,
    and that bound is the watchdog's own arithmetic (below), not this machine's speed."""
    base = ["--model", "bert-tiny", "--deepspeed_config", str(REPO / "ds_configs" / "cpu_zero2.json"), "--train-data",
            str(small_corpus), "--seq-len", "64", "--micro-batch-size", "2", "--log-steps", "1"]
    hang_out, diverge_out = tmp_path / "hang", tmp_path / "diverge"
    hang_args = [*base, "--output-dir", str(hang_out), "--max-steps", "5000", "--save-steps", "0",
                 "--step-timeout", "8"]  # a tiny step takes well under a second, even beside other work
    diverge_args = [*base, "--output-dir", str(diverge_out), "--max-steps", "12", "--save-steps", "4",
                    "--replica-check-steps", "3"]
    logs = {name: [tmp_path / f"{name}{rank}.log" for rank in range(2)] for name in ("hang", "diverge")}
    probe = tmp_path / "exit_probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(THREADS_AT_EXIT_PROBE)
    env = {**launch_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), launch_env.get("PYTHONPATH")]))}
    hang = start_as_mpirun(env, free_port(), [hang_args] * 2, logs["hang"])
    diverge = start_as_mpirun({**env, "TRUNEG_INJECT_DIVERGE": "8"}, free_port(), [diverge_args] * 2,
                              logs["diverge"])
    try:
        assert wait_for(lambda: len(read_metrics(hang_out)) >= 3 or hang[0].poll() is not None, timeout=240)
        os.kill(hang[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        hang[0].wait(timeout=120)
        # The bound, from the watchdog's arithmetic: rank 0's step began before the SIGSTOP, or after at most the
        # rest of rank 0's own step (it passes no collective rank 1 has not joined); 8 s after it, the thread sees
        # it within a beat (1.6 s at 8 s), reads the beats twice 2.5 beats (4 s) apart from rank 0's own store
        # (milliseconds), dumps one stack and leaves by os._exit: 13.6 s and rank 0's rest of a step (a tenth of
        # a second, a few beside other work). The 10 s left are for the scheduler: the thread sleeps between
        # wakes, so a loaded CPU delays each wake by a time slice, not seconds. Far below the collective timeout
        # (10 minutes).
        assert time.monotonic() - stopped < 8 + 16
        for proc in diverge:
            proc.wait(timeout=240)
    finally:
        for proc in hang + diverge:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    hang_log = logs["hang"][0].read_text()
    assert hang[0].returncode == 2 and "Traceback" not in hang_log, hang_log[-3000:]
    [line] = [line for line in hang_log.splitlines() if line.startswith("truneg: error: ")]
    assert re.fullmatch(rf"truneg: error: step (\d+) ran past --step-timeout 8 s: rank 1 stopped running \(last "
                        rf"seen in step \d+\); every running rank's stack is in {hang_out / 'hang'}\. .*", line), line
    step = re.search(r"step (\d+) ran past", line)[1]
    stacks = (hang_out / "hang" / f"step{step}_rank00000.stacks.txt").read_text()
    # where rank 0 waited for rank 1: in the loop, in whichever collective rank 1 had not joined when it was stopped
    # (the step's all-reduces mostly; the all-gather of the weights if in its optimizer's step, the metrics'
    # all-reduce if in its bookkeeping after the step)
    assert re.search(r"distributed_c10d\.py\", line \d+ in (all_reduce|all_gather_into_tensor)\n", stacks) \
        and re.search(r"loop\.py\", line \d+ in _train\n", stacks), stacks
    # it left by os._exit: no interpreter teardown, so no gloo destructor to abort in
    assert "at exit: process group" not in hang_log, hang_log[-3000:]

    for rank, proc in enumerate(diverge):
        log = logs["diverge"][rank].read_text()
        assert proc.returncode == 2 and "Traceback" not in log, log[-3000:]
        assert f"rank {rank} at exit: process group destroyed" in log, log[-3000:]
        assert f"rank {rank} at exit: comm threads []" in log, log[-3000:]
        [line] = [line for line in log.splitlines() if line.startswith("truneg: error: ")]
        assert line.startswith(
            "truneg: error: the data-parallel replicas diverged by step 8: rank 1's weights differ from rank 0's, "
            "first in mlm.bert.embeddings.word_embeddings.weight (1 parameter(s) differ); stopped without saving. The "
            "last good checkpoint (global_step4) is intact"), line
    assert (diverge_out / "checkpoints" / "latest").read_text() == "global_step4"
    assert tag_names(diverge_out / "checkpoints") == {"global_step4"}, "no checkpoint of the diverged weights"
