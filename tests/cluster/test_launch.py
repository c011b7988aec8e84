"""The launch scripts, the env file the other nodes read, and `truneg preflight`: what they pass, write and
refuse. In-process or through the scripts with a stand-in deepspeed; CPU only."""
from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from truneg.cluster import preflight
from truneg.cluster.env_file import forwarded_env, launch_env, write_env_file
from truneg.errors import UserError
from truneg.train.config import checks

REPO = Path(__file__).resolve().parents[2]


def test_env_file_carries_the_variables_deepspeed_does_not_forward(tmp_path, monkeypatch):
    from deepspeed.launcher.multinode_runner import PDSHRunner

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=ib0\nHF_HOME=/old\n")
    environ = {"HOME": "/home/ann", "USER": "ann", "HF_HOME": "/shared/hf", "TRUNEG_CACHE": "/scratch/tok"}
    values = launch_env(environ)
    assert values == {"TRUNEG_CACHE": "/scratch/tok", "HF_HOME": "/shared/hf",
                      "NLTK_DATA": f"{sys.prefix}/share/nltk_data", "TORCH_EXTENSIONS_DIR": "/tmp/torch_extensions_ann"}
    path = tmp_path / "run" / "deepspeed_env"
    write_env_file(path, values, carry_over=[tmp_path / ".deepspeed_env"])
    lines = path.read_text().splitlines()
    assert lines == ["NCCL_SOCKET_IFNAME=ib0", "HF_HOME=/shared/hf", "TRUNEG_CACHE=/scratch/tok",
                     f"NLTK_DATA={sys.prefix}/share/nltk_data", "TORCH_EXTENSIONS_DIR=/tmp/torch_extensions_ann"]
    # as deepspeed/launcher/runner.py reads it, and as its runner exports it: nothing quoted or changed
    runner = PDSHRunner.__new__(PDSHRunner)
    runner.exports = {}
    for line in path.read_text().splitlines(keepends=True):
        key, val = line.split("=", maxsplit=1)
        runner.add_export(key, val)
    assert runner.exports == dict(line.split("=", 1) for line in lines)
    with pytest.raises(UserError, match="HF_HOME"):
        write_env_file(tmp_path / "bad", {"HF_HOME": "/my data/hf"}, carry_over=[])


def test_env_file_drops_comments_keeps_nccl_settings_and_refuses_what_the_remote_shell_would_mangle(tmp_path):
    """DeepSpeed forwards NCCL_* only from a launching node with a GPU, exports a carried-over `#NAME=...` line
    as `export #NAME=...;`, which comments out the rest of each node's command (the launch itself), and puts
    other values in double quotes, inside which $, ` and \\ still act."""
    from deepspeed.launcher.multinode_runner import PDSHRunner

    user = tmp_path / ".deepspeed_env"
    user.write_text("# the cluster's NCCL settings\n#NCCL_DEBUG=INFO\n\nNCCL_SOCKET_IFNAME=^docker0,lo\nEMPTY=\n")
    shell = {"NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "ib0", "TORCH_NCCL_BLOCKING_WAIT": "1",
             "CUDA_HOME": "/usr/local/cuda", "HOME": "/home/ann", "SECRET": "x", "HF_HUB_OFFLINE": "1"}
    path = tmp_path / "deepspeed_env"
    written = write_env_file(path, {"HF_HOME": "/shared/hf"}, carry_over=[user], forwarded=forwarded_env(shell))
    # the shell's NCCL settings, CUDA_HOME and HF_HUB_OFFLINE, the file's lines over them (as in DeepSpeed's runner),
    # no comment
    assert written == {"CUDA_HOME": "/usr/local/cuda", "HF_HUB_OFFLINE": "1", "NCCL_IB_HCA": "mlx5_0",
                       "NCCL_SOCKET_IFNAME": "^docker0,lo",
                       "TORCH_NCCL_BLOCKING_WAIT": "1", "EMPTY": "", "HF_HOME": "/shared/hf"}
    runner = PDSHRunner.__new__(PDSHRunner)
    runner.exports = {}
    for line in path.read_text().splitlines(keepends=True):  # as deepspeed/launcher/runner.py reads the file
        key, val = line.split("=", maxsplit=1)
        runner.add_export(key, val)
    assert not any(key.startswith("#") for key in runner.exports)
    assert runner.exports["NCCL_SOCKET_IFNAME"] == '"^docker0,lo"'  # quoted by DeepSpeed, as it should be
    (tmp_path / "bad_line").write_text("export NCCL_DEBUG=INFO\n")
    with pytest.raises(UserError, match=r"bad_line:1: 'export NCCL_DEBUG=INFO' is not `NAME=value`"):
        write_env_file(tmp_path / "out", {}, carry_over=[tmp_path / "bad_line"])
    for value in ("$HOME/x", "a`b`", 'a"b', "a b"):
        with pytest.raises(UserError, match="remote shell"):
            write_env_file(tmp_path / "out", {"X": value}, carry_over=[])
    # DeepSpeed's slurm launcher: srun's --export=ALL,NAME=value,... cuts a value at its comma. This shell's own
    # value is left to --export=ALL (whole); a value only the file has is refused, and no file is written.
    shell["NCCL_IB_HCA"] = "mlx5_0,mlx5_1"
    written = write_env_file(path, {}, carry_over=[], forwarded=forwarded_env(shell), launcher="slurm", environ=shell)
    assert "NCCL_IB_HCA" not in written and "NCCL_IB_HCA" not in path.read_text() and "CUDA_HOME" in written
    assert "NCCL_IB_HCA" in write_env_file(path, {}, carry_over=[], forwarded=forwarded_env(shell), environ=shell)
    with pytest.raises(UserError, match=r"NCCL_SOCKET_IFNAME=\^docker0,lo would reach the ranks mangled: srun's"):
        write_env_file(tmp_path / "slurm_env", {}, carry_over=[user], launcher="slurm", environ=shell)
    assert not (tmp_path / "slurm_env").exists()
    # ... unless DeepSpeed passes the shell's variable on itself (NCCL_* from a node with a GPU): then refused too
    with pytest.raises(UserError, match=r"NCCL_IB_HCA=mlx5_0,mlx5_1 would reach the ranks mangled: DeepSpeed passes"):
        write_env_file(tmp_path / "slurm_env", {}, carry_over=[], forwarded=forwarded_env(shell), launcher="slurm",
                       environ=shell, runner_exports=("PYTHON", "UCX", "NCCL"))
    # openmpi and the other MPI launchers start no shell: DeepSpeed's quotes would reach the ranks
    with pytest.raises(UserError,
                       match=r"NCCL_SOCKET_IFNAME=\^docker0,lo would reach the ranks mangled: DeepSpeed quotes"):
        write_env_file(tmp_path / "mpi_env", {}, carry_over=[user], launcher="openmpi", environ=shell)
    assert not (tmp_path / "mpi_env").exists()
    # PATH's entries DeepSpeed would quote are left out for those launchers, but not the venv's bin (its ninja)
    assert forwarded_env({"PATH": "/a~b/bin:/bin"}, venv_bin="/v/bin", launcher="openmpi")["PATH"] == "/v/bin:/bin"
    with pytest.raises(UserError, match="the venv's /home/a~b/v/bin holds a character"):
        forwarded_env({"PATH": "/bin"}, venv_bin="/home/a~b/v/bin", launcher="openmpi")


def test_env_file_keeps_the_users_lines_over_defaults_and_carries_master_addr_and_the_venvs_path(tmp_path, monkeypatch):
    """~/.deepspeed_env's values stand over truneg's defaults (what the launching shell sets goes over both);
    MASTER_ADDR/PORT reach every rank (the MPI and Slurm runners set none, and a rank without it waits in MPI
    discovery while the others do not); PATH leads to the venv's ninja (each node's shell starts outside it)."""
    from truneg.cluster import hostfile

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for name in os.environ:  # what the machine running the tests may set (a GPU node, a Slurm job)
        if name.startswith(("NCCL_", "TORCH_NCCL_")) or name in ("HF_HOME", "NLTK_DATA", "TORCH_EXTENSIONS_DIR",
                                                                 "MASTER_PORT", "CUDA_HOME", "DS_ENV_FILE"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TRUNEG_CACHE", "/scratch/tok")
    monkeypatch.setenv("MASTER_ADDR", "node-01")
    monkeypatch.setenv("PATH", "/usr/bin:/opt/my tools:/bin")
    (tmp_path / ".deepspeed_env").write_text("HF_HOME=/shared/hf\nNLTK_DATA=/shared/nltk\nTRUNEG_CACHE=/old\n")
    hosts = tmp_path / "hosts"
    hosts.write_text("node-01 slots=8 max_slots=8  # the first\nnode-02 slots=8 max-slots=8\n")
    hostfile.main([str(hosts), "--env-file", str(tmp_path / "run" / "deepspeed_env"),
                   "--launcher-args=--launcher openmpi"])
    written = dict(line.split("=", 1) for line in (tmp_path / "run" / "deepspeed_env").read_text().splitlines())
    venv_bin = f"{sys.prefix}/bin"
    assert written == {"TRUNEG_CACHE": "/scratch/tok", "HF_HOME": "/shared/hf", "NLTK_DATA": "/shared/nltk",
                       "TORCH_EXTENSIONS_DIR": launch_env()["TORCH_EXTENSIONS_DIR"],  # the default
                       "MASTER_ADDR": "node-01", "PATH": f"{venv_bin}:/usr/bin:/bin"}  # an entry with a space left out
    # a value DeepSpeed would quote stops an openmpi launch over two nodes; on one node DeepSpeed reads no env file
    # (the ranks inherit this shell) and nothing is refused
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^lo")
    with pytest.raises(SystemExit) as refused:
        hostfile.main([str(hosts), "--env-file", str(tmp_path / "two_env"), "--launcher-args=--launcher openmpi"])
    assert refused.value.code == 2
    one = tmp_path / "one_host"
    one.write_text("node-01 slots=8\n")
    hostfile.main([str(one), "--env-file", str(tmp_path / "one_env"), "--launcher-args=--launcher openmpi"])
    assert "NCCL_SOCKET_IFNAME=^lo" in (tmp_path / "one_env").read_text()
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    # over pdsh (the default) too, before each node's own PATH: DeepSpeed's runner puts the value in double
    # quotes, which the node's shell expands
    hostfile.main([str(hosts), "--env-file", str(tmp_path / "pdsh_env")])
    pdsh_env = dict(line.split("=", 1) for line in (tmp_path / "pdsh_env").read_text().splitlines())
    assert pdsh_env["PATH"] == f"{venv_bin}:$PATH"
    from deepspeed.launcher import multinode_runner, runner

    pdsh = multinode_runner.PDSHRunner(runner.parse_args(["--hostfile", str(hosts), "train.py"]), "e30=")
    pdsh.add_export("PATH", pdsh_env["PATH"])
    line = " ".join(pdsh.get_cmd({}, {"node-01": [0]})[0])
    node = subprocess.run(["bash", "-c", line[line.index("export PATH"):line.index("; ") + 1] + ' echo "$PATH"'],
                          env={"PATH": "/node/bin:/bin"}, capture_output=True, text=True)
    assert node.stdout.strip() == f"{venv_bin}:/node/bin:/bin", (line, node.stderr)
    # a launch onto no other node reads no env file: a venv path with a space there is nobody's problem
    assert "PATH" not in forwarded_env({"PATH": "/bin"}, venv_bin="/opt/my venv/bin", remote=False)
    # a loopback MASTER_ADDR (left from work on one machine) would send the other nodes' ranks to themselves
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(SystemExit) as refused:
        hostfile.main([str(hosts), "--env-file", str(tmp_path / "loopback_env")])
    assert refused.value.code == 2 and not (tmp_path / "loopback_env").exists()
    hostfile.main([str(one), "--env-file", str(tmp_path / "loopback_env")])  # one node: fine
    for name in ("LOCALHOST", "::1"):  # names and addresses as the node resolves them
        with pytest.raises(UserError, match="is a loopback address"):
            hostfile.check_master_addr({"MASTER_ADDR": name})
    monkeypatch.setenv("MASTER_ADDR", "node-01")
    # pdsh's remote shell gets this folder (`cd`), the venv's Python and the script unquoted: a space breaks them
    (tmp_path / "my runs").mkdir()
    monkeypatch.chdir(tmp_path / "my runs")
    with pytest.raises(SystemExit) as refused:
        hostfile.main([str(hosts), "--env-file", str(tmp_path / "space_env")])
    assert refused.value.code == 2 and not (tmp_path / "space_env").exists()
    hostfile.main([str(one), "--env-file", str(tmp_path / "space_env")])  # one node: no remote shell
    with pytest.raises(UserError, match="the venv's Python, /opt/my venv/bin/python, holds a character"):
        hostfile.check_pdsh_paths(cwd=tmp_path, python="/opt/my venv/bin/python", repo=REPO)
    monkeypatch.chdir(tmp_path)
    assert hostfile.check_hostfile(hosts) == {"node-01": 8, "node-02": 8}  # Open MPI's max_slots and a comment
    # --check-ssh goes where deepspeed's own ssh goes: its --ssh_port
    calls = []
    monkeypatch.setattr(hostfile.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert hostfile.check_ssh(["node-01"], port=2222) == [] and calls[0][-4:] == ["-p", "2222", "node-01", "true"]


def test_launch_script_writes_the_env_file_into_the_users_output_folder(tmp_path):
    stub = tmp_path / "deepspeed"
    stub.write_text('#!/bin/sh\necho "DS_ENV_FILE=$DS_ENV_FILE"\necho "$@"\n')
    stub.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items()
              if not k.startswith(("NCCL_", "TORCH_NCCL_", "CUDA_HOME", "MASTER_ADDR", "MASTER_PORT", "DS_ENV_FILE"))},
           "DEEPSPEED": str(stub), "PREFLIGHT": "0", "DATA": str(tmp_path), "HOME": str(tmp_path),
           "PYTHON": sys.executable}
    missing = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], env=env, capture_output=True,
                             text=True)
    assert missing.returncode != 0 and "OUTPUT" in missing.stderr
    out = tmp_path / "runs" / "small"
    done = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh"), "--seed", "3"],
                          env={**env, "OUTPUT": str(out)},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"DS_ENV_FILE={out}/deepspeed_env" in done.stdout
    assert f"--output-dir {out} " in done.stdout and "electra_small_v100_fp16_zero2.json" in done.stdout
    assert "--seed 3" in done.stdout and f"--hostfile {REPO}/launch/hosts" in done.stdout
    keys = [line.split("=", 1)[0] for line in (out / "deepspeed_env").read_text().splitlines()]
    assert keys == ["TRUNEG_CACHE", "HF_HOME", "NLTK_DATA", "TORCH_EXTENSIONS_DIR", "PATH"]  # PREFLIGHT=0: no GPU check
    # every recipe: its model, sequence length and config for the GPU, INIT where it continues, COMPILE=1
    expect = {"bert_base.sh": ("bert-base", 512, "bert_base_continued_a100_bf16_zero1.json"),
              "bert_large.sh": ("bert-large", 512, "bert_large_continued_a100_bf16_zero1.json"),
              "electra_base.sh": ("electra-base", 512, "electra_base_continued_a100_bf16_zero1.json"),
              "electra_small.sh": ("electra-small", 128, "electra_small_a100_bf16_zero1.json"),
              "bert_large_scratch.sh": ("bert-large", 128, "bert_large_v100_fp16_lamb_zero0.json")}
    for script, (model, seq, config) in expect.items():
        env_gpu = {**env, "OUTPUT": str(out), "GPU": "h200", "COMPILE": "1"}
        proc = subprocess.run(["bash", str(REPO / "launch" / script), "--seed", "3"], env=env_gpu, capture_output=True,
                              text=True)
        if seq == 512:
            assert proc.returncode != 0 and "set INIT to an HF" in proc.stderr, script
            proc = subprocess.run(["bash", str(REPO / "launch" / script), "--seed", "3"],
                                  env={**env_gpu, "INIT": "/ckpt"}, capture_output=True, text=True)
            assert "--init-from /ckpt" in proc.stdout, script
        assert proc.returncode == 0, (script, proc.stderr)
        assert f"--model {model} --seq-len {seq} --deepspeed_config {REPO}/ds_configs/{config} " in proc.stdout, script
        tail = "--compile --init-from /ckpt --seed 3" if seq == 512 else "--compile --seed 3"
        assert (REPO / "ds_configs" / config).is_file() and proc.stdout.rstrip().endswith(tail), proc.stdout
    # INIT: a folder, made absolute for every node; a hub name (nothing of that name here) passed unchanged
    (tmp_path / "ckpt").mkdir()
    for init, given in (("ckpt", tmp_path / "ckpt"), ("google/bert_uncased_L-2_H-128_A-2@main",) * 2):
        proc = subprocess.run(["bash", str(REPO / "launch" / "bert_base.sh")], capture_output=True, text=True,
                              cwd=tmp_path, env={**env, "OUTPUT": str(out), "INIT": init})
        assert proc.returncode == 0 and proc.stdout.rstrip().endswith(f"--init-from {given}"), proc
    pair = {"INIT": "google/electra-base-discriminator", "INIT_GENERATOR": "google/electra-base-generator"}
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_base.sh")], capture_output=True, text=True,
                          cwd=tmp_path, env={**env, "OUTPUT": str(out), **pair})
    assert proc.stdout.rstrip().endswith("--init-from {INIT} --init-generator {INIT_GENERATOR}".format(**pair)), proc
    # BERT-large from scratch with AdamW takes the GPU's recipe too; a GPU=... the scripts do not know: one line
    proc = subprocess.run(["bash", str(REPO / "launch" / "bert_large_scratch.sh")], capture_output=True, text=True,
                          env={**env, "OUTPUT": str(out), "GPU": "a100", "OPT": "adamw"})
    assert f"--deepspeed_config {REPO}/ds_configs/bert_large_a100_bf16_zero1.json " in proc.stdout, proc.stderr
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], capture_output=True, text=True,
                          env={**env, "OUTPUT": str(out), "GPU": "t4"})
    assert (proc.returncode, proc.stderr) == (2, "truneg: error: GPU=t4: use v100, a100, h100, h200\n"), proc
    # DeepSpeed's pdsh runner stops the ranks on every node (Ctrl-C, a scheduler's SIGTERM) with `pkill -f` of
    # words of the remote command: built by its own runner from what the script hands deepspeed, that pattern
    # must be one word of the remote shell, and match the launcher each node runs
    from deepspeed.launcher import multinode_runner, runner

    given = done.stdout.splitlines()[-1].split()
    assert given[:2] == ["--hostfile", f"{REPO}/launch/hosts"] and "--venv_script" not in given
    command, kill, _ = multinode_runner.PDSHRunner(runner.parse_args(given), "e30=").get_cmd({}, {"node-01": [0]})
    pkill = shlex.split(" ".join(kill[kill.index("pkill -f "):]))
    started = shlex.split(" ".join(command[command.index("-w") + 2:]))  # what each node's shell runs
    launched = " ".join(started[started.index(sys.executable):])  # the node launcher's command line
    assert pkill[:2] == ["pkill", "-f"] and len(pkill) == 3 and pkill[2] in launched, (pkill, launched)
    # an exported MASTER_ADDR/PORT (an InfiniBand address, a port of its own) goes to deepspeed, which would set its own
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], capture_output=True, text=True,
                          env={**env, "OUTPUT": str(out), "MASTER_ADDR": "10.1.0.1", "MASTER_PORT": "29611"})
    assert f"--hostfile {REPO}/launch/hosts --master_addr 10.1.0.1 --master_port 29611 " in proc.stdout, proc.stderr
    # sbatch runs a copy of its script, with no common.sh beside it: one line, not "command not found" later
    (tmp_path / "slurm_script").write_text((REPO / "launch" / "electra_small.sh").read_text())
    proc = subprocess.run(["bash", str(tmp_path / "slurm_script")], env={**env, "OUTPUT": str(out)},
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"truneg: error: {tmp_path}/slurm_script has no common.sh beside it: run the script where it lies in the repo "
        "(sbatch runs a copy: sbatch --wrap 'bash REPO/launch/SCRIPT.sh')"], proc.stderr
    # HOSTFILE=local: this machine only, no env file
    local_out = tmp_path / "runs" / "local"
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")],
                          env={**env, "OUTPUT": str(local_out), "HOSTFILE": "local"}, capture_output=True, text=True)
    assert proc.returncode == 0 and "--hostfile" not in proc.stdout, proc.stderr
    assert not (local_out / "deepspeed_env").exists()
    # relative paths become absolute: each node's shell starts where this one is, or in its home folder
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], cwd=tmp_path, capture_output=True,
                          text=True, env={**env, "OUTPUT": str(out), "DATA": "corpus", "HC": "my.npz", "SR": "word"})
    assert f"--train-data {tmp_path}/corpus " in proc.stdout and f"--hc {tmp_path}/my.npz --sr word" in proc.stdout
    # the preflight is told LAUNCHER_ARGS (its launcher and node filters), and nothing about hosts with local
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nif [ "$2" = truneg.cluster.preflight ]; then echo "PREFLIGHT $*"; exit 0; fi\n'
                      f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    for extra, expected in (({}, "--launcher-args= --model"),
                            ({"LAUNCHER_ARGS": "--launcher openmpi"}, "--launcher-args=--launcher openmpi --model"),
                            ({"LAUNCHER_ARGS": "--num_nodes 2", "HOSTFILE": "local"}, "--launcher-args=--num_nodes 2")):
        proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], capture_output=True, text=True,
                              env={**env, "OUTPUT": str(out), "PYTHON": str(python), "PREFLIGHT": "1", **extra})
        preflight_line = next(line for line in proc.stdout.splitlines() if line.startswith("PREFLIGHT"))
        assert expected in preflight_line, preflight_line
        assert ("--hostfile" in preflight_line) == ("HOSTFILE" not in extra), preflight_line
    # with the preflight on, each rank checks its GPU against GPU=... (v100, the default): the env file says it
    assert "TRUNEG_GPU_ARCH=sm70\n" in (out / "deepspeed_env").read_text()
    # LAUNCHER_ARGS split as a shell splits it: a quoted value reaches deepspeed as one word; nothing in it runs
    words = tmp_path / "deepspeed_words"
    words.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    words.chmod(0o755)
    ran = tmp_path / "ran"
    launcher_args = f'--launcher openmpi --launcher_args "--mca btl_tcp_if_include ib0" $(touch {ran})'
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], capture_output=True, text=True,
                          env={**env, "OUTPUT": str(out), "DEEPSPEED": str(words), "LAUNCHER_ARGS": launcher_args})
    assert proc.returncode == 0, proc.stderr
    given = proc.stdout.splitlines()
    assert given[given.index("--launcher_args") + 1] == "--mca btl_tcp_if_include ib0", given
    assert f"{ran})" in given and not ran.exists()
    proc = subprocess.run(["bash", str(REPO / "launch" / "electra_small.sh")], capture_output=True, text=True,
                          env={**env, "OUTPUT": str(out), "LAUNCHER_ARGS": "--include 'node-01"})
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "truneg: error: LAUNCHER_ARGS=--include 'node-01 has an unclosed quote; quote it as in a shell"], proc.stderr


def test_preflight_prints_the_run_or_one_line_per_problem(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(checks, "_NODE_LOCAL", ("/tmp/node-local",))  # tmp_path stands for shared storage
    monkeypatch.setattr(preflight.ds_config, "local_capability", lambda: None)  # as on a node without a GPU
    stubs, bare = tmp_path / "bin", tmp_path / "bare"  # DeepSpeed's multi-node launcher needs pdsh
    stubs.mkdir()
    bare.mkdir()
    (stubs / "pdsh").write_text("#!/bin/sh\n")
    (stubs / "pdsh").chmod(0o755)
    monkeypatch.setenv("PATH", str(stubs))
    out = tmp_path / "shared" / "run"
    argv = ["--hostfile", str(REPO / "launch" / "hosts"), "--gpu-arch", "sm70", "--model", "bert-large",
            "--deepspeed_config", str(REPO / "ds_configs" / "bert_large_v100_fp16_lamb_zero0.json"),
            "--output-dir", str(out), "--max-steps", "15625", "--save-steps", "2000", "--keep-checkpoints", "3"]
    assert preflight.run(argv) == 0
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if not line.startswith("note"))
    assert printed["world size"] == "32" and printed["global batch"] == "16384"
    assert printed["micro-batch"] == "32" and printed["gradient accumulation"] == "16"
    assert printed["precision"] == "fp16 (sm_70)" and printed["ZeRO stage"] == "0"
    assert printed["optimizer"].startswith("Lamb (FusedLamb)") and printed["warmup"] == "312"
    assert printed["tokens seen"] == f"{15625 * 16384 * 128:,}"
    assert printed["checkpoint size"].startswith("4.7 GB") and printed["checkpoints kept"].startswith("3 of 7")
    assert not out.exists()  # nothing written
    lamb_zero2 = tmp_path / "lamb_zero2.json"
    lamb_zero2.write_text(json.dumps({**json.loads((REPO / "ds_configs"
                                                    / "bert_large_v100_fp16_lamb_zero0.json").read_text()),
                                       "zero_optimization": {"stage": 2}}))
    bad = ["--hostfile", str(REPO / "launch" / "hosts"), "--gpu-arch", "sm70", "--model", "bert-large",
           "--deepspeed_config", str(lamb_zero2), "--output-dir", "/tmp/node-local/run", "--train-data",
           str(tmp_path / "none")]
    assert preflight.run(bad) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and all(line.startswith("truneg: error: ") for line in errors)
    assert "FusedLamb" in errors[0] and "node-local" in errors[1] and "no text files" in errors[2]
    # a config that cannot be read does not hide the other problems
    (tmp_path / "afile").write_text("")
    assert preflight.run([*bad[:bad.index("--deepspeed_config")], "--deepspeed_config", str(tmp_path / "afile"),
                          "--output-dir", str(tmp_path / "afile"), "--train-data", str(tmp_path / "none")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and "is not valid JSON" in errors[0], errors
    assert "afile is a file" in errors[1] and "no text files" in errors[2], errors
    # every argument out of range, one line each: the checks pretrain.py makes before its first step
    out_of_range = ["--dropout", "1.5", "--save-steps", "-1", "--max-nonfinite-steps", "0", "--max-predictions", "999"]
    assert preflight.run([*argv, *out_of_range]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert [line.removeprefix("truneg: error: ") for line in errors] == [
        "--max-nonfinite-steps must be >= 1, not 0", "--save-steps must be >= 0, not -1",
        "--max-predictions 999 must be between 1 and --seq-len 128",
        "--dropout must be a finite number >= 0 and < 1, not 1.5"]
    # over several nodes with pdsh: no pdsh, and a glob each node's shell would expand on its own (`**` as `*`)
    monkeypatch.setenv("PATH", str(bare))
    (tmp_path / "corpus" / "a").mkdir(parents=True)
    (tmp_path / "corpus" / "a" / "x.txt").write_text("text\n")
    glob = ["--hostfile", str(REPO / "launch" / "hosts"), "--gpu-arch", "sm70", "--output-dir", str(out),
            "--train-data", str(tmp_path / "corpus" / "**" / "*.txt")]
    assert preflight.run(glob) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and "pdsh is not installed" in errors[0] and "is a glob" in errors[1]
    # the openmpi and slurm runners pass arguments on through no shell, but set no MASTER_ADDR: it must come
    # from this shell (the scripts' env file carries it), an env file deepspeed reads, or the launcher's options
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpi4py" else real_find_spec(name, *a))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert preflight.run([*glob, "--launcher", "openmpi"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "deepspeed's openmpi launcher gives the ranks no MASTER_ADDR: export MASTER_ADDR=" in line, line
    assert preflight.run([*glob, "--launcher-args=--launcher openmpi --launcher_args '-x MASTER_ADDR=node-01'"]) == 0
    (tmp_path / ".deepspeed_env").write_text("MASTER_ADDR=node-01\n")
    assert preflight.run([*glob, "--launcher", "openmpi"]) == 0
    (tmp_path / ".deepspeed_env").unlink()
    monkeypatch.setenv("MASTER_ADDR", "node-01")
    assert preflight.run([*glob, "--launcher", "openmpi"]) == 0
    assert preflight.run([*glob, "--launcher-args=--launcher=slurm"]) == 0  # LAUNCHER_ARGS, as the scripts pass it
    # --check-ssh reaches the nodes LAUNCHER_ARGS leave, on their --ssh_port (deepspeed's one parse of them)
    real_run, ssh = subprocess.run, []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: real_run(cmd, **kw) if cmd[0] != "ssh"
                        else ssh.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    assert preflight.run([*glob, "--check-ssh",
                          "--launcher-args=--launcher=slurm --ssh_port 2222 --include node-02@node-04"]) == 0, \
        capsys.readouterr().err
    assert [cmd[-4:] for cmd in ssh] == [["-p", "2222", node, "true"] for node in ("node-02", "node-04")], ssh
    # options the runner refuses (said) still give --check-ssh their port, on the hostfile's nodes
    ssh.clear()
    assert preflight.run([*glob, "--check-ssh", "--launcher-args=--launcher openmpi --num_gpus 4 --ssh_port 2222"]) == 2
    assert "openmpi launcher refuses them" in capsys.readouterr().err
    assert [cmd[-4:] for cmd in ssh] == [["-p", "2222", f"node-0{n}", "true"] for n in (1, 2, 3, 4)], ssh
    monkeypatch.setattr(subprocess, "run", real_run)
    capsys.readouterr()
    # LAUNCHER_ARGS' node filters change the world size as deepspeed's runner applies them; one node needs no pdsh
    for launcher_args, world, accumulation in (("--num_nodes=1 --num_gpus 4", "4", "128"),
                                               ("--num_nodes 2", "16", "32"),
                                               ("--include node-02:0,1,2,3@node-04:4,5,6,7", "8", "64")):
        assert preflight.run([*argv, f"--launcher-args={launcher_args}"]) == 0, capsys.readouterr().err
        monkeypatch.setenv("PATH", str(stubs))
        printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines()
                       if not line.startswith("note"))
        assert printed["world size"] == world, launcher_args
        assert printed["gradient accumulation"] == accumulation and printed["global batch"] == "16384"
    assert preflight.run([*argv, "--launcher-args=--include node-02:0,1@node-04"]) == 2
    assert "does not split over 10 ranks" in capsys.readouterr().err
    # without a hostfile, deepspeed reads CUDA_VISIBLE_DEVICES as --include, or drops it for a GPU filter; the
    # options are split as a shell splits them (as the scripts do); launcher names as it lowers them
    from truneg.cluster.hostfile import launched_resources

    assert launched_resources({}, 2, "", "4,5")[:2] == ({"localhost": 2}, None)
    assert launched_resources({}, 8, "--launcher PDSH --num_gpus 2")[:2] == ({"localhost": 2}, "pdsh")
    for launcher_args, said in (("--exclude localhost:0", "ignores CUDA_VISIBLE_DEVICES=4,5"),
                                ("--num_nodes 1", "refuses --num_nodes/--num_gpus with CUDA_VISIBLE_DEVICES=4,5")):
        with pytest.raises(UserError, match=said):
            launched_resources({}, 2, launcher_args, "4,5")
    assert launched_resources({"a": 8}, 2, "--num_gpus 2", "4,5")[:2] == ({"a": 2}, None)  # a hostfile: not read
    assert launched_resources({"a": 8}, 2, "--include 'a'")[:2] == ({"a": 8}, None)
    quoted = "--launcher openmpi --launcher_args '--mca btl_tcp_if_include ib0'"
    assert launched_resources({"a": 8, "b": 8}, 2, quoted)[:2] == ({"a": 8, "b": 8}, "openmpi")
    # and the options, as deepspeed's own parser read them (one parse: the preflight's ssh check takes its port)
    assert launched_resources({"a": 8, "b": 8}, 2, quoted).options.launcher_args == "--mca btl_tcp_if_include ib0"
    assert launched_resources({"a": 8, "b": 8}, 2, "--ssh_port 2222").options.ssh_port == 2222
    # what the chosen runner itself refuses at launch, by its own checks: the MPI runners take no node filter,
    # srun no uneven slots; with one node left deepspeed builds no runner, and only the slot check applies
    for launcher_args, said in (("--launcher openmpi --num_gpus 4", "openmpi launcher refuses them: openmpi backend "
                                 "does not support limiting num nodes/gpus"),
                                ("--launcher mvapich --exclude b", None),
                                ("--launcher slurm --include a:0,1@b:0", "slurm backend needs the same slot count"),
                                ("--launcher slurm --include a:2,3@b:0,1", "cannot select specific device ids"),
                                ("--include 'a", "No closing quotation")):
        if said is None:
            assert launched_resources({"a": 8, "b": 8}, 2, launcher_args)[:2] == ({"a": 8}, "mvapich")
            continue
        with pytest.raises(UserError, match=said):
            launched_resources({"a": 8, "b": 8}, 2, launcher_args)
    for launcher_args, said in (("--include node-09", "Hostname 'node-09' not found in hostfile"),
                                ("--num_nodes 2 --exclude node-01", "--num_nodes/--num_gpus together with --include"),
                                ("--frobnicate", "unrecognized arguments: --frobnicate")):
        assert preflight.run([*argv, f"--launcher-args={launcher_args}"]) == 2
        [line] = capsys.readouterr().err.splitlines()
        assert line.startswith("truneg: error: LAUNCHER_ARGS") and said in line, line
    bf16 = ["--gpu-arch", "sm70", "--deepspeed_config", str(REPO / "ds_configs" / "electra_base_a100_bf16_zero3.json"),
            "--output-dir", str(out)]
    assert preflight.run(bf16) == 2 and "only emulates" in capsys.readouterr().err
    # GPU=v100 (the scripts' default) on an H100 node: said as such, first, not as a torch build without sm_70
    monkeypatch.setattr(preflight.ds_config, "local_capability", lambda: (9, 0))
    v100 = ["--gpu-arch", "sm70", "--deepspeed_config", str(REPO / "ds_configs" / "bert_large_v100_fp16_zero2.json"),
            "--output-dir", str(out)]
    assert preflight.run(v100) == 2
    first = capsys.readouterr().err.splitlines()[0]
    assert "--gpu-arch sm70 (the launch scripts' GPU=...) but this node's GPU is sm_90: set GPU" in first, first
    assert preflight.run(["--gpu-arch", "sm90", *v100[2:]]) == 0  # the same run, told the right GPU
    # launched from a node that is not one of the hostfile's (a login node with another GPU): its own GPU says
    # nothing of theirs, and each rank checks its own against GPU=... (the env file's TRUNEG_GPU_ARCH)
    from truneg.cluster.hostfile import is_this_machine_one_of

    elsewhere, here = tmp_path / "elsewhere_hosts", tmp_path / "here_hosts"
    elsewhere.write_text("node-77.invalid slots=8\n")
    here.write_text(f"{socket.gethostname()} slots=8\n")
    assert not is_this_machine_one_of(["node-77.invalid", "192.0.2.1"])  # 192.0.2.0/24: documentation addresses
    assert all(is_this_machine_one_of([h]) for h in ("localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()))
    assert preflight.run([*v100, "--hostfile", str(elsewhere)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert preflight.run([*v100, "--hostfile", str(here)]) == 2
    assert "but this node's GPU is sm_90: set GPU" in capsys.readouterr().err.splitlines()[0]
    # a launch from a node without a GPU: the scripts' GPU=... reaches every rank in the env file, and each rank's
    # start-up (the same checks, without --gpu-arch) compares it with its own GPU
    monkeypatch.setenv(checks.GPU_ARCH_ENV, "sm70")
    assert preflight.run(v100[2:]) == 2
    assert "GPU=... says sm70 (TRUNEG_GPU_ARCH) but this node's GPU is sm_90: set GPU" in capsys.readouterr().err
    monkeypatch.setenv(checks.GPU_ARCH_ENV, "sm90")
    assert preflight.run(v100[2:]) == 0


def test_bert_large_scratch_runs_phase_2_only_after_a_finished_phase_1(tmp_path):
    """PHASE=all: phase 2's preflight first, then phase 1 (waited for), then phase 2 from phase 1's checkpoints only
    once phase 1's `latest` names its last step; a failed or stopped phase 1 ends the script with no phase 2, the same
    command again skips a finished phase 1. A stub deepspeed records each launch and plays phase 1's end."""
    log, out, out2 = tmp_path / "launches", tmp_path / "p1", tmp_path / "p2"
    stub = tmp_path / "deepspeed"
    stub.write_text('#!/bin/sh\necho "DEEPSPEED $*" >> "$LOG"\ncase "$*" in *"--seq-len 128"*)\n'
                    '  if [ "$FINISH" = 1 ]; then mkdir -p "$OUTPUT/checkpoints"; '
                    'echo "global_step$STEPS" > "$OUTPUT/checkpoints/latest"; fi\n  exit "$RC";;\nesac\n')
    stub.chmod(0o755)
    python = tmp_path / "python"  # the preflight, recorded in the same log
    python.write_text(f'#!/bin/sh\nif [ "$2" = truneg.cluster.preflight ]; then echo "PREFLIGHT $*" >> "$LOG"; '
                      f'case "$*" in *"--seq-len $REFUSE "*) exit 2;; esac; exit 0; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "DS_ENV_FILE"))},
           "DEEPSPEED": str(stub), "PYTHON": str(python), "HOSTFILE": "local", "LOG": str(log), "OUTPUT": str(out),
           "DATA": str(tmp_path / "c128"), "OUTPUT2": str(out2), "DATA2": str(tmp_path / "c512"), "STEPS": "3",
           "PHASE": "all", "RC": "0", "FINISH": "1", "HOME": str(tmp_path), "REFUSE": "none"}

    def launch(**extra):
        log.unlink(missing_ok=True)
        proc = subprocess.run(["bash", str(REPO / "launch" / "bert_large_scratch.sh"), "--seed", "3"],
                              env={**env, **extra}, capture_output=True, text=True)
        return proc, log.read_text().splitlines() if log.is_file() else []

    for failed in ({"RC": "1", "FINISH": "0"}, {"RC": "0", "FINISH": "0"}):  # failed / stopped, `latest` not the last
        proc, lines = launch(**failed)
        assert proc.returncode == 1 and len(lines) == 3, (proc.stderr, lines)
        assert lines[0].startswith("PREFLIGHT") and "--seq-len 512" in lines[0] and "--seq-len 128" in lines[1]
        assert lines[2].startswith("DEEPSPEED") and "--seq-len 128" in lines[2]
    assert "phase 1 stopped before its last step (global_step3)" in proc.stderr
    for refused in ("512", "128"):  # a preflight that refuses either phase launches nothing
        proc, lines = launch(REFUSE=refused)
        assert proc.returncode == 2 and not any(line.startswith("DEEPSPEED") for line in lines), (refused, lines)
    proc, lines = launch()
    assert proc.returncode == 0 and [line.split()[0] for line in lines] == ["PREFLIGHT"] * 2 + [
        "DEEPSPEED", "PREFLIGHT", "DEEPSPEED"], (proc.stderr, lines)
    phase2 = lines[-1]
    assert (f"--seq-len 512 --deepspeed_config {REPO}/ds_configs/bert_large_seq512_v100_fp16_lamb_zero0.json "
            f"--train-data {tmp_path}/c512 --output-dir {out2} --max-steps 1736 ") in phase2, phase2
    assert phase2.endswith(f"--seed 3 --phase1-checkpoint {out}/checkpoints"), phase2
    proc, lines = launch()  # phase 1 finished: straight to phase 2
    assert proc.returncode == 0 and [line.split()[0] for line in lines] == ["PREFLIGHT", "PREFLIGHT", "DEEPSPEED"]
    # PHASE=2 alone: AdamW's recipe for the GPU, its env file in phase 2's folder; without OUTPUT2: one line
    proc, lines = launch(PHASE="2", OPT="adamw", GPU="a100", HOSTFILE=str(REPO / "launch" / "hosts"),
                         STEPS2="7", PREFLIGHT="0")
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr
    assert f"--deepspeed_config {REPO}/ds_configs/bert_large_seq512_a100_bf16_zero1.json " in lines[0]
    assert "--max-steps 7 " in lines[0] and (out2 / "deepspeed_env").is_file() and not (out / "deepspeed_env").exists()
    proc, _ = launch(PHASE="2", OUTPUT2="")
    assert proc.returncode == 2 and proc.stderr.startswith("truneg: error: PHASE=2 needs OUTPUT2"), proc.stderr
