"""Shared fixtures: the repo, the shared data folder, and the environment for real deepspeed launches."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
VENV_BIN = Path(sys.executable).parent
NOVELS = SHARED_DATA / "british-novels"
WIKITEXT = SHARED_DATA / "wikitext-2-raw" / "wiki.valid.raw"


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
