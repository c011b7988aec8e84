"""Checkpoints that move between topologies (another world size, a GPU checkpoint on CPU ranks) and runs across
nodes: two nodes on one machine, the launch scripts through DeepSpeed's runner."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    MAX_STEPS,
    REPO,
    cli_in_process,
    comparable,
    deepspeed_cmd,
    free_port,
    kill_group,
    read_metrics,
    run,
    start,
    started_as_mpirun,
    train_args,
    wait_for,
)

ZERO3_UNIVERSAL_GROUPS = """
import json, os, sys
from pathlib import Path
import torch, deepspeed
from truneg.train.checkpointing import checkpoint
from truneg.model.pretrainers import parameter_groups

os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
deepspeed.init_distributed(dist_backend="gloo")
folder = Path(sys.argv[2])


class Tiny(torch.nn.Module):  # a weight (decayed), a bias and a LayerNorm (not): truneg's two groups
    def __init__(self):
        super().__init__()
        self.dense, self.LayerNorm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.LayerNorm(self.dense(x)).sum()


def engine(universal):
    torch.manual_seed(0)
    model = Tiny()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "checkpoint": {"load_universal": universal}, "steps_per_print": 10**9}
    return deepspeed.initialize(model=model, model_parameters=parameter_groups(model), config=config)[0]


def decays(e):
    return [group["weight_decay"] for group in e.optimizer.optimizer.param_groups]


saved = engine(False)
saved.backward(saved(torch.randn(2, 4)))
saved.step()
tag = checkpoint.save(saved, folder, 1, {}, {})
checkpoint.convert_to_universal(folder, tag)
by_deepspeed, by_truneg = engine(True), engine(True)
by_deepspeed.load_checkpoint(str(folder), tag=checkpoint.universal_tag(tag))  # DeepSpeed's load alone
checkpoint.load(by_truneg, folder, checkpoint.universal_tag(tag), checkpoint.saved_world_size(folder, tag))
print(json.dumps({"saved": decays(saved), "deepspeed": decays(by_deepspeed), "truneg": decays(by_truneg)}))
"""


def test_a_zero_3_checkpoint_resumed_on_another_world_size_keeps_each_groups_weight_decay(tmp_path, launch_env):
    """DeepSpeed 0.19's ZeRO-3 universal load gives every parameter group the first one's settings: biases and
    LayerNorm would be decayed after a resume on another world size (the ZeRO-3 recipes). One process saves
    its partitions, DeepSpeed converts them, and truneg's load gives each group its own settings back."""
    script = tmp_path / "zero3_groups.py"
    script.write_text(ZERO3_UNIVERSAL_GROUPS)
    proc = subprocess.run([sys.executable, str(script), str(free_port()), str(tmp_path / "checkpoints")],
                          env=launch_env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["saved"] == found["truneg"] == [0.01, 0.0]
    assert found["deepspeed"] == [0.01, 0.01], "DeepSpeed's universal load keeps the groups apart now"


def test_a_gpu_checkpoints_rng_states_load_on_a_cpu_rank():
    """A checkpoint written on GPUs holds the CUDA generator's state (16 bytes: seed and offset) beside the host's;
    a CPU rank restores the host's generators and leaves the CUDA one out."""
    from truneg.train.checkpointing import checkpoint

    torch.manual_seed(3)
    state = checkpoint.rng_state()
    expected = torch.rand(4)
    state["accelerator"] = torch.zeros(16, dtype=torch.uint8)
    torch.manual_seed(5)
    checkpoint.set_rng_state(state)
    assert torch.equal(torch.rand(4), expected)


def close_losses(records: list[dict], reference: list[dict], start_step: int) -> None:
    by_step = {r["step"]: r for r in reference}
    for record in records:
        if record["step"] > start_step:
            ref = by_step[record["step"]]
            assert record["samples"] == ref["samples"] and record["lr"] == pytest.approx(ref["lr"], rel=1e-9)
            # The same global batch summed in another order (accumulation against the all-reduce, ZeRO-0's against
            # ZeRO-2's): a gradient moves by a few ulps, an Adam update by about lr x that share, so the weights by
            # ~1e-9 a step and the loss by far less than 3e-5 over 16 steps (seen: 1.5e-7 2 -> 1 ranks, 4.7e-6 ZeRO-0)
            assert record["loss"] == pytest.approx(ref["loss"], rel=3e-5), record["step"]


def test_resume_on_another_world_size_two_to_one_and_back(runs, tmp_path, launch_env, small_corpus):
    reference_dir, _ = runs("bert-deterministic")
    reference = read_metrics(reference_dir)
    out = tmp_path / "resized"
    shutil.copytree(reference_dir, out)
    (out / "metrics.jsonl").unlink()
    (out / "checkpoints" / "latest").write_text("global_step8")
    shutil.rmtree(out / "checkpoints" / "global_step16")  # global_step24 stays: the 2-rank save of a lost timeline
    args = train_args("bert-deterministic", out, small_corpus)
    # 1 rank: the same global batch of 8 through 2 accumulation steps
    one = run(deepspeed_cmd(*args, "--gradient-accumulation-steps", "2", num_gpus=1, port=free_port()), launch_env)
    assert "written by 2 ranks; loading its universal form on 1" in one.stdout
    assert f"resumed from {out / 'checkpoints'} at step 8" in one.stdout
    close_losses(read_metrics(out), reference, 8)
    # metrics.jsonl holds no evaluation of step 8, which was due: the resume evaluates the 2-rank weights on 1 rank,
    # exactly as 2 ranks did: the same weights, kernels and micro-batch shape (a row's figures are its own inputs')
    evals = comparable(read_metrics(out, "eval"))
    assert [r["step"] for r in evals] == [8, 16, 24]
    assert evals[0] == comparable([r for r in read_metrics(reference_dir, "eval") if r["step"] == 8])[0]
    assert [r["step"] for r in read_metrics(out)] == list(range(9, MAX_STEPS + 1))
    # global_step24 written again, by 1 rank: none of the 2-rank save's shards is left to mix with it
    assert len(list((out / "checkpoints" / "global_step24").glob("*optim_states.pt"))) == 1
    assert not list((out / "checkpoints").glob("*.deleting"))
    # ... and back to 2 ranks from the 1-rank checkpoint of step 16
    # (the 1-rank leg's records after step 16 are dropped, so that what is checked below was written again)
    (out / "checkpoints" / "latest").write_text("global_step16")
    metrics = out / "metrics.jsonl"
    # (and its evaluation of step 16, which the 2-rank resume then makes of the same 1-rank weights)
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] < 16 or json.loads(line)["step"] == 16 and "loss" in line))
    two = run(deepspeed_cmd(*args, port=free_port()), launch_env)
    assert "written by 1 ranks; loading its universal form on 2" in two.stdout
    assert f"resumed from {out / 'checkpoints'} at step 16" in two.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(9, MAX_STEPS + 1))
    close_losses(read_metrics(out), reference, 16)
    assert comparable(read_metrics(out, "eval"))[1] == evals[1] and evals[1]["eval_masked"] > 0


def test_a_zero_0_checkpoint_resumes_on_another_world_size_directly_and_exports(runs, tmp_path, launch_env,
                                                                               small_corpus):
    """At ZeRO stage 0 every rank holds the whole optimizer: there are no ZeRO partitions for ds_to_universal
    to convert, and the checkpoint loads on any world size as it is. Nor for zero_to_fp32 (which stopped the
    export of the LAMB recipe's checkpoints): `truneg export` writes the model file's weights."""
    reference = read_metrics(runs("bert-deterministic")[0])
    config = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    config["zero_optimization"] = {"stage": 0}
    (tmp_path / "zero0.json").write_text(json.dumps(config))
    out = tmp_path / "zero0"
    args = [*train_args("bert-deterministic", out, small_corpus), "--deepspeed_config", str(tmp_path / "zero0.json")]
    run(deepspeed_cmd(*args, "--max-steps", "8", port=free_port()), launch_env)
    assert not list((out / "checkpoints" / "global_step8").glob("*zero_pp_rank*"))
    one = run(deepspeed_cmd(*args, "--gradient-accumulation-steps", "2", num_gpus=1, port=free_port()), launch_env)
    assert "universal" not in one.stdout and f"resumed from {out / 'checkpoints'} at step 8" in one.stdout
    assert [r["step"] for r in read_metrics(out)] == list(range(1, MAX_STEPS + 1))
    close_losses(read_metrics(out), reference, 8)  # ZeRO-0 and ZeRO-2 do the same fp32 arithmetic

    from transformers import BertForMaskedLM

    proc = cli_in_process("export", str(out / "checkpoints"), str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    exported = BertForMaskedLM.from_pretrained(tmp_path / "hf").state_dict()
    trained = torch.load(out / "checkpoints" / f"global_step{MAX_STEPS}" / "mp_rank_00_model_states.pt",
                         weights_only=False)["module"]
    assert len(trained) > 20 and all(torch.equal(exported[k.removeprefix("mlm.")], v) for k, v in trained.items())


def test_two_nodes_on_loopback_train_checkpoint_and_resume(runs, tmp_path, launch_env, small_corpus):
    reference_dir, _ = runs("bert-zero2")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "two_nodes"
    args = train_args("bert-zero2", out, small_corpus)

    def launch_nodes(port: int):
        return [start([str(Path(sys.executable).parent / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh",
                       f"--node_rank={node}", "--master_addr", "127.0.0.1", "--master_port", str(port),
                       str(REPO / "truneg" / "pretrain.py"), *args], launch_env) for node in (0, 1)]

    # Rank 1 with an output folder of its own (node-local storage): every rank stops with one line. (The start-up
    # checks are the ranks' own: two ranks as mpirun starts them, without the runners and node launchers.)
    codes, outputs = started_as_mpirun(launch_env, free_port(),
                                       [args, train_args("bert-zero2", tmp_path / "node_local", small_corpus)])
    assert codes == [2, 2], outputs[0][-3000:]
    for output in outputs:
        assert "ranks do not see" in output and "must be one folder every node shares" in output, output[-2000:]
    assert not (out / "checkpoints").exists()

    nodes = launch_nodes(free_port())
    try:
        assert wait_for(lambda: (out / "checkpoints" / "latest").is_file() or any(p.poll() is not None for p in nodes),
                        240)
    finally:
        for proc in nodes:
            kill_group(proc, signal.SIGKILL)
            proc.wait(timeout=60)
    assert len(read_metrics(out)) < MAX_STEPS
    nodes = launch_nodes(free_port())
    outputs = [proc.communicate(timeout=300)[0] for proc in nodes]
    assert [proc.returncode for proc in nodes] == [0, 0], outputs[0][-3000:]
    assert "resumed from" in outputs[0]
    # 2 ranks, as the reference's: the same kernels and shapes, bitwise
    assert comparable(read_metrics(out)) == comparable(read_metrics(reference_dir))
    # The ranks find different checkpoints to resume from (here told so; a stale copy of `latest` on one node
    # would do the same): every rank stops with one line before loading anything.
    resumes = [[*args, "--resume", str(out / "checkpoints" / tag)] for tag in ("global_step16", "global_step24")]
    codes, outputs = started_as_mpirun(launch_env, free_port(), resumes)
    assert codes == [2, 2], outputs[0][-3000:]
    for output in outputs:
        assert "the ranks found different checkpoints to resume from" in output and "step 16 to step 24" in output


def test_a_failed_rank_exit_code_passes_through_the_launchers(tmp_path, launch_env):
    """A launch script, through the deepspeed runner and DeepSpeed's per-node launcher, exits with the ranks' 2.
    (The deepspeed launcher alone: test_a_failure_on_rank_0_alone_stops_every_rank_with_one_line.)"""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n")
    script = subprocess.run(
        ["bash", str(REPO / "launch" / "electra_small.sh"), "--deepspeed_config",
         str(REPO / "ds_configs" / "cpu_zero2.json")],
        # PREFLIGHT=0: the rank itself, not the preflight, meets the missing corpus
        env={**launch_env, "HOSTFILE": str(hostfile), "DATA": str(tmp_path / "no-corpus"),
             "OUTPUT": str(tmp_path / "out"),
             "PREFLIGHT": "0",
             "PYTHON": sys.executable, "DEEPSPEED": str(Path(sys.executable).parent / "deepspeed"),
             "LAUNCHER_ARGS": f"--no_ssh --node_rank=0 --master_addr 127.0.0.1 --master_port {free_port()}"},
        capture_output=True, text=True, timeout=300)
    assert script.returncode == 2 and "no text files found" in script.stdout + script.stderr
