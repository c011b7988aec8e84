"""Sharded, exactly resumable checkpoints through DeepSpeed's save_checkpoint / load_checkpoint.

DeepSpeed stores the module, the optimizer partitions, the LR scheduler and the step counters. It stores
no RNG state or data position, and writes `client_state` from rank 0 only, so each rank also writes
`truneg_rank{r}.pt` (RNG states, metric accumulator) beside the tag. The `latest` file is written by
truneg, last, after every rank finished: a checkpoint killed half-way is never the one resumed.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from truneg.errors import UserError

UNIVERSAL_INFO = {"universal_checkpoint_version": 0.2}


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
        tmp = checkpoint_dir / "latest.tmp"
        tmp.write_text(tag, encoding="utf-8")
        os.replace(tmp, checkpoint_dir / "latest")  # atomic: `latest` names a complete checkpoint or the old one
    dist.barrier()
    return tag


def load(engine, checkpoint_dir: Path, tag: str | None = None, universal: bool = False) -> tuple[dict, dict | None]:
    """Load `tag` (default: `latest`). Returns (client_state, this rank's state or None if the checkpoint
    was written with another world size)."""
    tag = tag or latest_tag(checkpoint_dir)
    if tag is None:
        raise UserError(f"no checkpoint to resume in {checkpoint_dir} (no `latest`); drop --resume or fix the path")
    if not (checkpoint_dir / tag).is_dir():
        raise UserError(f"checkpoint {checkpoint_dir / tag} does not exist; `latest` names a missing tag")
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
