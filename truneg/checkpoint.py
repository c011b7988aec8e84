"""Sharded, exactly resumable checkpoints through DeepSpeed's save_checkpoint / load_checkpoint.

DeepSpeed stores the module, the optimizer partitions, the LR scheduler and the step counters. It stores
no RNG state or data position, and writes `client_state` from rank 0 only, so each rank also writes
`truneg_rank{r}.pt` (RNG states, metric accumulator) beside the tag. The `latest` file is written by
truneg, last, after every rank finished: a checkpoint killed half-way is never the one resumed.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from truneg.errors import UserError

UNIVERSAL_INFO = {"universal_checkpoint_version": 0.2}
META_FILE = "truneg_meta.json"


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def latest_tag(checkpoint_dir: Path) -> str | None:
    latest = checkpoint_dir / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag or None


def rng_state() -> dict:
    from deepspeed.accelerator import get_accelerator

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if get_accelerator().device_name() != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    from deepspeed.accelerator import get_accelerator

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "accelerator" in state:
        get_accelerator().set_rng_state(state["accelerator"])


def universal_tag(tag: str) -> str:
    return f"{tag}_universal"


def saved_world_size(checkpoint_dir: Path, tag: str) -> int | None:
    meta = checkpoint_dir / tag / META_FILE
    return json.loads(meta.read_text(encoding="utf-8"))["world_size"] if meta.is_file() else None


def convert_to_universal(checkpoint_dir: Path, tag: str) -> Path:
    """DeepSpeed's ds_to_universal on one tag; reused if already done. Returns the universal folder."""
    out = checkpoint_dir / universal_tag(tag)
    if (out / "zero").is_dir() and (out / META_FILE).is_file():
        return out
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", str(checkpoint_dir / tag), "--output_folder", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise UserError(f"cannot convert {checkpoint_dir / tag} to a universal checkpoint ({tail[0][:200]}); "
                        "resume on the world size that wrote it")
    shutil.copyfile(checkpoint_dir / tag / META_FILE, out / META_FILE)  # marks the conversion complete
    return out


def _rank_file(checkpoint_dir: Path, tag: str, rank: int) -> Path:
    return checkpoint_dir / tag / f"truneg_rank{rank:05d}.pt"


def save(engine, checkpoint_dir: Path, step: int, client_state: dict, rank_state: dict) -> str:
    """A collective: every rank calls it. Returns the tag."""
    tag = tag_for_step(step)
    rank = dist.get_rank()
    path = _rank_file(checkpoint_dir, tag, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, path)
    state = {**client_state, "universal_checkpoint_info": UNIVERSAL_INFO}
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=state, save_latest=False)
    dist.barrier()
    if rank == 0:
        meta = {"step": step, "world_size": dist.get_world_size()}
        (checkpoint_dir / tag / META_FILE).write_text(json.dumps(meta) + "\n", encoding="utf-8")
        tmp = checkpoint_dir / "latest.tmp"
        tmp.write_text(tag, encoding="utf-8")
        os.replace(tmp, checkpoint_dir / "latest")  # atomic: `latest` names a complete checkpoint or the old one
    dist.barrier()
    return tag


def load(engine, checkpoint_dir: Path, tag: str) -> tuple[dict, dict | None]:
    """Load `tag`. Returns (client_state, this rank's state, or None if the checkpoint was written by
    another world size)."""
    try:
        path, client_state = engine.load_checkpoint(
            str(checkpoint_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
    except UserError:
        raise
    except Exception as err:  # torch.load and ZeRO raise many types on damaged or foreign files
        raise UserError(
            f"cannot read checkpoint {checkpoint_dir / tag} ({type(err).__name__}: {str(err)[:200]}); "
            "resume from another tag with --resume DIR, or start afresh with --resume none --overwrite"
        ) from None
    if path is None:
        raise UserError(f"cannot read checkpoint {checkpoint_dir / tag}; it is incomplete")
    rank_file = _rank_file(checkpoint_dir, tag, dist.get_rank())
    rank_state = None
    if rank_file.is_file() and client_state.get("world_size") == dist.get_world_size():
        rank_state = torch.load(rank_file, weights_only=False)
    return client_state, rank_state
