"""Process set-up under each launcher: ranks from mpirun's and srun's variables (DeepSpeed's openmpi, mvapich
and slurm runners set no RANK), each GPU process bound to its own device before the first collective, and the
`--local_rank` the deepspeed launcher adds to `truneg.cli`."""
from __future__ import annotations

import gzip
import json
import math
import os
import sys
import types
from pathlib import Path

import pytest
from conftest import (
    LAUNCH_VARS,
    assert_resumed_as_the_reference,
    cli_in_process,
    comparable,
    flip_tensor_byte,
    free_port,
    mid_run_copy,
    read_metrics,
    shm_allreduce_buffers,
    started_as_mpirun,
    train_args,
)

from truneg.errors import UserError
from truneg.train.observe.flops import preset_train_flops
from truneg.train.ranks import distributed


@pytest.fixture
def bare_env(monkeypatch):
    """No launcher variable at all; each case sets its own. adopt_launcher_env writes os.environ itself, so the
    whole environment is put back afterwards (a RANK left behind would make a later in-process run a rank 1)."""
    saved = dict(os.environ)
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(saved)


def _ranks() -> tuple[str | None, ...]:
    return tuple(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))


@pytest.mark.parametrize("launcher, expected", [
    ({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ("9", "16", "1")),
    ({"MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_LOCAL_RANK": "3"}, ("3", "4", "3")),
    ({"PMI_SIZE": "8", "PMI_RANK": "5", "MPI_LOCALRANKID": "1"}, ("5", "8", "1")),
    # srun's task: the step's size (a batch script has SLURM_NTASKS too, below)
    ({"SLURM_STEP_NUM_TASKS": "32", "SLURM_NTASKS": "32", "SLURM_PROCID": "17", "SLURM_LOCALID": "1"},
     ("17", "32", "1")),
    # an sbatch script itself: SLURM_PROCID=0 and the allocation's SLURM_NTASKS, but one process
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, (None, None, None)),
    # srun --mpi=pmi2: PMI_RANK and PMI_SIZE, no MPI_LOCALRANKID; the local rank is srun's
    ({"PMI_SIZE": "16", "PMI_RANK": "11", "SLURM_STEP_NUM_TASKS": "16", "SLURM_PROCID": "11", "SLURM_LOCALID": "3"},
     ("11", "16", "3")),
    # the shell of `srun --pty bash` inherits the step's variables, and is one process
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_PTY_PORT": "4321"},
     (None, None, None)),
    # a launcher that sets RANK (DeepSpeed's pdsh runner, torchrun) is taken as is, MPI variables or not
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3"},
     ("1", "2", "1")),
])
def test_ranks_come_from_mpirun_and_srun_and_a_batch_script_is_one_process(bare_env, launcher, expected):
    bare_env.setenv("MASTER_ADDR", "10.0.0.1")
    for name, value in launcher.items():
        bare_env.setenv(name, value)
    distributed.adopt_launcher_env()
    rank, world, local, port = _ranks()
    assert (rank, world, local) == expected  # None: a world of one, whose variables init_distributed sets
    assert distributed.launch_world_size() == int(world or 1)  # what the batch arithmetic is done for
    if world not in (None, "1") and "RANK" not in launcher:
        assert port == "29500"  # MASTER_ADDR given, MASTER_PORT torch's default


def test_mpirun_without_master_addr_or_mpi4py_stops_with_one_line(bare_env):
    """DeepSpeed's MPI discovery finds MASTER_ADDR through mpi4py; without either there is no rank 0 to meet,
    nor with an MPI that sees fewer processes than the launcher started."""
    bare_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    bare_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    bare_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    real_find_spec = distributed.importlib.util.find_spec
    bare_env.setattr(distributed.importlib.util, "find_spec",
                     lambda name, *a: None if name == "mpi4py" else real_find_spec(name, *a))
    with pytest.raises(UserError, match=r"OMPI_COMM_WORLD_SIZE=2\) without MASTER_ADDR: export MASTER_ADDR"):
        distributed.adopt_launcher_env()
    # with mpi4py there, DeepSpeed's discovery is asked for (and fills MASTER_ADDR and MASTER_PORT)
    os.environ.pop("RANK")  # not through monkeypatch, which would put back the RANK adopt_launcher_env wrote
    bare_env.setattr(distributed.importlib.util, "find_spec", lambda name, *a: object())
    mpi_world = types.SimpleNamespace(size=2)
    mpi4py = types.SimpleNamespace(MPI=types.SimpleNamespace(COMM_WORLD=types.SimpleNamespace(Get_size=lambda:
                                                                                              mpi_world.size)))
    bare_env.setitem(sys.modules, "mpi4py", mpi4py)
    distributed.adopt_launcher_env()
    assert _ranks()[:3] == ("1", "2", "1") and distributed._left_to_mpi_discovery()
    # unless that MPI cannot see the launcher's processes (srun without PMI: each a world of one)
    os.environ.pop("RANK")
    mpi_world.size = 1
    with pytest.raises(UserError, match=r"OMPI_COMM_WORLD_SIZE=2, but mpi4py's MPI sees 1 process\(es\)"):
        distributed.adopt_launcher_env()


def test_each_gpu_process_is_bound_to_its_own_device_before_the_first_collective(bare_env):
    """DeepSpeed binds the device only inside deepspeed.initialize; truneg's shared-folder check and the data
    barrier come before it, and would run every rank on cuda:0, which NCCL refuses (the process group is bound to
    cuda:LOCAL_RANK)."""
    import deepspeed
    import deepspeed.accelerator

    calls = []
    accelerator = types.SimpleNamespace(device_name=lambda: "cuda",
                                        set_device=lambda i: calls.append(("set_device", i)))
    bare_env.setattr(distributed, "get_accelerator", lambda: accelerator)
    bare_env.setattr(deepspeed, "init_distributed",
                     lambda **kw: calls.append(("init", kw["dist_backend"], kw["auto_mpi_discovery"])))
    bare_env.setattr(distributed.dist, "get_rank", lambda: 3)
    bare_env.setattr(distributed.dist, "get_world_size", lambda: 4)
    for name, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                        "MASTER_PORT": "1"}.items():
        bare_env.setenv(name, value)
    assert distributed.init_distributed() == (3, 4)
    # NCCL (the accelerator's backend), no MPI discovery (the launcher's variables are there), then cuda:1
    assert calls == [("init", None, False), ("set_device", 1)]
    calls.clear()  # where the ranks are left to DeepSpeed's MPI discovery (mpirun with mpi4py), it is asked for
    bare_env.setattr(distributed, "_left_to_mpi_discovery", lambda: True)
    assert distributed.init_distributed() == (3, 4) and calls[0] == ("init", None, True)


def test_two_processes_started_as_mpirun_starts_them_resume_as_the_deepspeed_launchers_run(launch_env, runs,
                                                                                          small_corpus, tmp_path):
    """DeepSpeed's openmpi runner starts `python -u pretrain.py ARGS` on every slot with only Open MPI's
    variables. Two such processes must form one world of 2, load the 2 ranks' shards of the reference's step-16
    checkpoint (which the deepspeed launcher's ranks wrote) and train steps 17-24 bitwise as that run did; here
    with masking in a DataLoader worker, where the reference masked inline, and with torch.profiler over steps 18-19
    on both ranks and an MFU peak (neither is the run's identity, and the profiled losses are the unprofiled
    run's). Both runs' records carry the efficiency figures."""
    reference_dir, _ = runs("bert-zero2")
    reference = comparable(read_metrics(reference_dir))
    reference_evals = comparable(read_metrics(reference_dir, "eval"))
    out, port = tmp_path / "mpirun", free_port()
    resumed_from = mid_run_copy(reference_dir, out)
    argv = [*train_args("bert-zero2", out, small_corpus), "--data-workers", "1", "--profile-steps", "18:19",
            "--peak-tflops", "0.5"]
    codes, outputs = started_as_mpirun(launch_env, port, [argv, argv])
    assert codes == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "x 2 ranks" in outputs[0]
    assert_resumed_as_the_reference(outputs[0], out, resumed_from, reference, reference_evals)
    assert shm_allreduce_buffers(port) == []  # DeepSpeed's CPU allreduce buffers in /dev/shm: none left behind
    assert_profiled_and_measured(out, outputs, resumed_from)


def assert_profiled_and_measured(out: Path, outputs: list[str], resumed_from: int) -> None:
    """Each rank's trace of steps 18-19 parses as Chrome's trace format and holds those steps alone, rank 0 printed
    its top operators; every record has the efficiency keys, mfu only where --peak-tflops was given, and each
    start's first interval is marked and left out of tensorboard's throughput curves."""
    for rank in (0, 1):
        trace = json.loads(gzip.decompress((out / "profile" / "step18-19" / f"rank{rank}.pt.trace.json.gz")
                                           .read_bytes()))
        steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("truneg optimizer step")}
        assert steps == {"truneg optimizer step 18", "truneg optimizer step 19"}, steps
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert f"truneg: profiled steps 18-19 into {out / 'profile' / 'step18-19'}" in outputs[0]
    assert "Self CPU" in outputs[0] and "truneg: profiled" not in outputs[1]  # rank 0's table only

    records = read_metrics(out)  # steps 1-16 of the reference run, 17-24 of this one
    per_sample = preset_train_flops("bert-tiny", 64)  # seq 64, word-level SR: no extra pass
    for r in records:
        assert r["memory_max_rss_gib"] > 0.1 and 0 <= r["data_wait_fraction"] <= 1, r
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0, r  # DeepSpeed's ZeRO-2 norm
        assert r["tflops"] == pytest.approx(r["samples_per_sec"] * per_sample / 2 / 1e12, rel=1e-9), r  # per rank
        assert ("mfu" in r) == (r["step"] > resumed_from), r
        assert "mfu" not in r or r["mfu"] == pytest.approx(r["tflops"] / 0.5, rel=1e-12)
    assert [r["step"] for r in records if r.get("warmup")] == [1, resumed_from + 1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    samples = {r["step"]: r["samples"] for r in records}
    assert [e.step for e in events.Scalars("Train/Samples/grad_norm")] == list(samples.values())
    assert [e.step for e in events.Scalars("Train/Samples/tflops")] == [
        samples[s] for s in samples if s not in (1, resumed_from + 1)]
    assert "Train/Samples/memory_max_rss_gib" in events.Tags()["scalars"]


def test_the_cli_takes_the_local_rank_the_deepspeed_launcher_adds(tmp_path):
    """`deepspeed -m truneg.cli finetune glue ...` runs `python -m truneg.cli --local_rank=N finetune glue ...`."""
    proc = cli_in_process("--local_rank=1", "finetune", "glue", "--task", "rte", "--model", str(tmp_path / "absent"),
                          "--data-dir", str(tmp_path), "--output-dir", str(tmp_path / "out"))
    assert "unrecognized arguments" not in proc.stderr
    assert proc.returncode == 2 and proc.stderr.startswith("truneg: error:")  # past the parser, to the missing model


def test_a_changed_byte_in_one_ranks_shard_stops_every_rank_with_one_line_naming_the_file(launch_env, runs,
                                                                                           small_corpus, tmp_path):
    """One bit flipped inside a tensor of rank 1's ZeRO optimizer shard (bad storage, a copy gone wrong): the file
    still opens, and a resume would train on. Each rank checksums its share of the tag's files against the manifest
    its save wrote, and every rank learns what each found: both stop with the same line naming the file (a rank
    stopped alone inside DeepSpeed's load would leave the other waiting in its first all-reduce; across nodes until
    the timeout). Started as mpirun starts them, so no launcher stops rank 0 for it. `truneg verify` says the same
    offline (exit 2), and the intact reference checkpoint verifies (exit 0)."""
    reference_dir, _ = runs("bert-zero2")
    out, port = tmp_path / "damaged", free_port()
    resumed_from = mid_run_copy(reference_dir, out)
    tag = out / "checkpoints" / f"global_step{resumed_from}"
    [shard] = tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    flip_tensor_byte(shard)
    records = (out / "metrics.jsonl").read_text()
    argv = train_args("bert-zero2", out, small_corpus)
    codes, outputs = started_as_mpirun(launch_env, port, [argv, argv])
    assert codes == [2, 2], outputs[0][-3000:] + outputs[1][-3000:]
    assert not any("Traceback" in output for output in outputs), outputs
    lines = [[line for line in output.splitlines() if line.startswith("truneg: error: ")] for output in outputs]
    assert [len(rank_lines) for rank_lines in lines] == [1, 1], lines
    assert lines[0] == lines[1], lines
    assert lines[0][0].startswith(f"truneg: error: {shard} is damaged: its bytes changed since the save (checksum ")
    assert lines[0][0].endswith("resume from another tag with --resume DIR, or start afresh with --resume none "
                                "--overwrite")
    assert (out / "checkpoints" / "latest").read_text() == f"global_step{resumed_from}"  # nothing touched
    assert (out / "metrics.jsonl").read_text() == records
    assert shm_allreduce_buffers(port) == []
    verify = cli_in_process("verify", str(out / "checkpoints"))
    assert verify.returncode == 2 and verify.stderr.splitlines() == [lines[0][0].split("; resume")[0]], verify
    intact = cli_in_process("verify", str(reference_dir / "checkpoints"), "--tag", tag.name)
    assert intact.returncode == 0 and intact.stdout.strip().endswith(": intact"), intact
