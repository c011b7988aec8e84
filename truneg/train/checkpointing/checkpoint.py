"""Checkpoints: the one place that addresses them (folder, `latest`, tag, step), saves and loads them through
DeepSpeed's save_checkpoint / load_checkpoint, finds the resume point and keeps the newest N. (A tag's fp32
weights for HF models are export.py's.)

DeepSpeed stores the module, the optimizer partitions, the LR scheduler and the step counters. It stores
no RNG state or data position, and writes `client_state` from rank 0 only, so each rank also writes
`truneg_rank{r}.pt` (RNG states, metric accumulator; plain types and tensors, read with weights_only=True) beside
the tag. When every rank has finished, the ranks checksum the tag's files into its manifest (integrity.py); then
truneg writes META (step, world size, samples trained on) and `latest`, last: a checkpoint killed half-way is never
the one resumed. What truneg's commands need of a tag they read from META, not from DeepSpeed's pickles.
"""
from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from truneg.errors import UserError
from truneg.train.checkpointing import integrity
from truneg.train.config.run_config import CHECKPOINTS
from truneg.train.ranks.distributed import on_rank_zero

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

UNIVERSAL_INFO = {"universal_checkpoint_version": 0.2}
META_FILE = integrity.META_FILE


TAG_PREFIX = "global_step"
HF_CONFIG_DIR = "hf_config"
DELETING_SUFFIX = ".deleting"


def tag_for_step(step: int) -> str:
    return f"{TAG_PREFIX}{step}"


def step_of_tag(tag: str) -> int:
    """`global_step120` -> 120; -1 for a tag of another form."""
    digits = tag[len(TAG_PREFIX):]
    return int(digits) if tag.startswith(TAG_PREFIX) and digits.isdigit() else -1


def latest_tag(checkpoint_dir: Path) -> str | None:
    latest = checkpoint_dir / "latest"
    if not latest.is_file():
        return None
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        raise UserError(f"{latest} is damaged (not a tag name); write the tag to resume from into it "
                        f"(e.g. {TAG_PREFIX}100), or pass --resume a tag folder") from None
    return tag or None


def list_tags(checkpoint_dir: Path) -> list[str]:
    """The step tags of a checkpoints folder, oldest first (universal conversions and deletions excluded)."""
    if not checkpoint_dir.is_dir():
        return []
    tags = [p.name for p in checkpoint_dir.iterdir() if p.is_dir() and step_of_tag(p.name) >= 0]
    return sorted(tags, key=step_of_tag)


def complete_tags(checkpoint_dir: Path) -> list[str]:
    """The tags whose save finished on every rank (META is written after that), oldest first: a running job's
    folder also holds a save in progress, or one that was cut."""
    return [t for t in list_tags(checkpoint_dir) if (checkpoint_dir / t / META_FILE).is_file()]


def resolve(path: str | Path) -> tuple[Path, str | None]:
    """A run's output folder, its checkpoints folder, or one tag folder -> (checkpoints folder, tag or None)."""
    path = Path(path)
    if (path / CHECKPOINTS / "latest").is_file():
        return path / CHECKPOINTS, None
    if (path / "latest").is_file():
        return path, None
    if path.is_dir() and ((path.parent / "latest").is_file() or (path.parent / HF_CONFIG_DIR).is_dir()):
        return path.parent, path.name
    raise UserError(f"{path} is not a truneg checkpoint folder (no `latest`); pass <output-dir>/checkpoints or a tag "
                    "in it")


def resolve_tag(path: str | Path) -> tuple[Path, str]:
    """Like `resolve`, with a folder's `latest` tag filled in."""
    checkpoint_dir, tag = resolve(path)
    tag = tag or latest_tag(checkpoint_dir)
    if tag is None or not (checkpoint_dir / tag).is_dir():
        raise UserError(f"checkpoint {checkpoint_dir / str(tag)} does not exist; pass a checkpoints folder or a tag in "
                        "it")
    return checkpoint_dir, tag


def rng_state() -> dict:
    """Plain types and tensors only, so that the rank's file loads with weights_only=True (numpy's state is an
    array and a tuple of numpy scalars, which torch's safe unpickler refuses)."""
    _, key, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": int(has_gauss),
                   "cached_gaussian": float(gauss)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if get_accelerator().device_name() != "cpu":
        state["accelerator"] = get_accelerator().get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """The states `rng_state` saved. A GPU checkpoint's accelerator state is left out on CPU ranks (the run goes
    on, not bitwise): DeepSpeed's CPU accelerator would load it into torch's CPU generator, which refuses it."""
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    if isinstance(numpy_state, dict):  # else numpy's own tuple, as files written before held it
        numpy_state = ("MT19937", numpy_state["key"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
    torch.set_rng_state(state["torch"])
    if "accelerator" in state and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(state["accelerator"])


def universal_tag(tag: str) -> str:
    return f"{tag}{integrity.UNIVERSAL_SUFFIX}"


def read_meta(checkpoint_dir: Path, tag: str) -> dict | None:
    """The tag's META ({"step", "world_size"}, and "samples" since truneg wrote it); None for a tag without one."""
    meta = checkpoint_dir / tag / META_FILE
    if not meta.is_file():
        return None
    try:
        found = json.loads(meta.read_text(encoding="utf-8"))
    except ValueError:
        found = None
    if not isinstance(found, dict) or "world_size" not in found:  # a file system that lost the write (power cut
        # before it reached the disk)
        raise UserError(f"{meta} is damaged; resume from another tag with --resume DIR")
    return found


def saved_world_size(checkpoint_dir: Path, tag: str) -> int | None:
    meta = read_meta(checkpoint_dir, tag)
    return None if meta is None else meta["world_size"]


def saved_samples(checkpoint_dir: Path, tag: str) -> int | None:
    """The samples the tag had trained on, as its META says; None for a tag written before META held them."""
    samples = (read_meta(checkpoint_dir, tag) or {}).get("samples")
    return samples if isinstance(samples, int) else None


def convert_to_universal(checkpoint_dir: Path, tag: str, into: Path | None = None) -> Path:
    """DeepSpeed's ds_to_universal on one tag, into `into` (default: beside it); reused if already done. Returns the
    universal folder."""
    out = (into or checkpoint_dir) / universal_tag(tag)
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


RANK_STATE_PREFIX = integrity.RANK_STATE_PREFIX


def rank_state_file(checkpoint_dir: Path, tag: str, rank: int) -> Path:
    """The rank's own state in a tag (data position, RNG): DeepSpeed's files hold the model and optimizer."""
    return checkpoint_dir / tag / f"{RANK_STATE_PREFIX}{rank:05d}.pt"


def save(engine: DeepSpeedEngine, checkpoint_dir: Path, step: int, client_state: dict, rank_state: dict) -> str:
    """A collective: every rank calls it. Returns the tag."""
    tag = tag_for_step(step)
    rank = dist.get_rank()
    on_rank_zero(lambda: _clear(checkpoint_dir, tag), f"clear the old {checkpoint_dir / tag}")
    path = rank_state_file(checkpoint_dir, tag, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rank_state, path)
    state = {**client_state, "universal_checkpoint_info": UNIVERSAL_INFO}
    engine.save_checkpoint(str(checkpoint_dir), tag=tag, client_state=state, save_latest=False)
    dist.barrier()
    manifest = integrity.hash_share(checkpoint_dir / tag)
    samples = int(engine.global_samples)
    on_rank_zero(lambda: _commit(checkpoint_dir, tag, step, dist.get_world_size(), manifest, samples),
                 f"complete {checkpoint_dir / tag}")
    return tag


def _clear(checkpoint_dir: Path, tag: str) -> None:
    """A folder of this tag is left from a save that was cut, or from a timeline that --resume rolled back:
    shards of another world size, or a universal form of other weights, must not mix with this save. If
    `latest` names it (the rolled-back case), `latest` first goes back to the newest complete tag before it,
    so that a kill during this save leaves a checkpoint to resume from."""
    if latest_tag(checkpoint_dir) == tag:
        earlier = [t for t in complete_tags(checkpoint_dir) if step_of_tag(t) < step_of_tag(tag)]
        if earlier:
            _point_latest(checkpoint_dir, earlier[-1])
        else:
            (checkpoint_dir / "latest").unlink()
    _remove_tag(checkpoint_dir, tag)


def _point_latest(checkpoint_dir: Path, tag: str) -> None:
    tmp = checkpoint_dir / "latest.tmp"
    tmp.write_text(tag, encoding="utf-8")
    os.replace(tmp, checkpoint_dir / "latest")  # atomic: `latest` names a complete checkpoint or the old one


def _commit(checkpoint_dir: Path, tag: str, step: int, world_size: int, manifest: dict | str | None = None,
            samples: int | None = None) -> None:
    """After every rank wrote its part: the tag's manifest (integrity.hash_share's, or the line saying why a rank
    could not checksum its share), its META (with the samples trained on, which `truneg eval` reports: read there
    without unpickling DeepSpeed's files), then `latest` (atomic: it names a complete checkpoint or the old one)."""
    if isinstance(manifest, str):
        raise UserError(manifest)
    if manifest is not None:
        integrity.write_manifest(checkpoint_dir / tag, manifest)
    meta = checkpoint_dir / tag / META_FILE
    tmp = meta.with_name(META_FILE + ".tmp")
    counts = {"step": step, "world_size": world_size, **({} if samples is None else {"samples": samples})}
    tmp.write_text(json.dumps(counts) + "\n", encoding="utf-8")
    os.replace(tmp, meta)  # atomic: a tag has a whole META or none
    _point_latest(checkpoint_dir, tag)


def remove_old(checkpoint_dir: Path, keep: int) -> list[str]:
    """Keep the newest `keep` complete checkpoints (rank 0, after `latest` names the newest). A tag without META
    (a save that was cut, as a preemption's killed mid-save) counts for none, and goes once `keep` complete ones
    are newer than it (a run may have resumed from it by name). A tag is first renamed (atomic) and then deleted,
    so a kill half-way leaves only a `*.deleting` folder, which the next call clears; `latest` and every kept tag
    stay whole. Returns the tags removed."""
    for leftover in checkpoint_dir.glob(f"*{DELETING_SUFFIX}"):
        shutil.rmtree(leftover, ignore_errors=True)
    if keep < 1:
        return []
    latest = latest_tag(checkpoint_dir)
    tags = [t for t in list_tags(checkpoint_dir) if latest is None or step_of_tag(t) <= step_of_tag(latest)]
    complete = [t for t in tags if (checkpoint_dir / t / META_FILE).is_file()]
    kept = complete[-keep:]
    removed = [t for t in tags if t not in kept and t != latest
               and (t in complete or sum(step_of_tag(c) > step_of_tag(t) for c in complete) >= keep)]
    for tag in removed:
        _remove_tag(checkpoint_dir, tag)
    return removed


def _remove_tag(checkpoint_dir: Path, tag: str) -> None:
    """A tag and its universal form, each renamed first (atomic), then deleted: a kill half-way leaves a
    `*.deleting` folder, never half a tag."""
    for folder in (checkpoint_dir / tag, checkpoint_dir / universal_tag(tag)):
        _remove(folder)


def _remove(folder: Path) -> None:
    if folder.is_dir():
        doomed = folder.with_name(folder.name + DELETING_SUFFIX)
        shutil.rmtree(doomed, ignore_errors=True)  # a leftover of a kill during an earlier removal
        folder.rename(doomed)
        shutil.rmtree(doomed)


def load(engine: DeepSpeedEngine, checkpoint_dir: Path, tag: str, saved_world_size: int | None,
         own_run: bool = True) -> tuple[dict, dict | None]:
    """Load `tag`, written by `saved_world_size` ranks (its META; a universal tag keeps its source's). Returns
    (client_state, this rank's state, or None if the checkpoint was written by another world size or, `own_run`
    False, by another run: a phase-1 tag, whose LR schedule is not loaded either)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    integrity.verify_before_load(checkpoint_dir / tag, saved_world_size)
    try:
        path, client_state = engine.load_checkpoint(
            str(checkpoint_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=own_run
        )
    except Exception as err:  # torch.load and ZeRO raise many types on damaged or foreign files
        raise UserError(
            f"cannot read checkpoint {checkpoint_dir / tag} ({type(err).__name__}: {str(err)[:200]}); "
            "resume from another tag with --resume DIR, or start afresh with --resume none --overwrite"
        ) from None
    if path is None:
        raise UserError(f"cannot read checkpoint {checkpoint_dir / tag}; it is incomplete")
    if engine.zero_optimization_stage() == 3 and engine.load_universal_checkpoint():
        _restore_group_settings(engine.optimizer.optimizer, checkpoint_dir / tag / "zero" / "optimizer_state.pt")
    rank_file = rank_state_file(checkpoint_dir, tag, rank)
    rank_state = None
    if own_run and rank_file.is_file() and saved_world_size == world_size:
        rank_state = load_rank_state(rank_file)
    return client_state, rank_state


def load_rank_state(path: Path) -> dict:
    """A rank's own file, with torch's safe unpickler. A file written before truneg stored plain types there
    (numpy's RNG state pickled as numpy objects) loads as the pickle it is, with a warning; only in a tag of that
    time (no manifest): one with a manifest was saved since, so its rank files hold nothing else."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if (path.parent / integrity.MANIFEST_FILE).is_file():
            raise UserError(f"{path} holds more than tensors and plain types, which truneg does not write: it is not "
                            "truneg's; resume only from checkpoints you trust") from None
        print(f"truneg: warning: {path} was written before truneg saved plain types there; loading it with pickle",
              flush=True)
        return torch.load(path, map_location="cpu", weights_only=False)


def _restore_group_settings(optimizer: torch.optim.Optimizer, universal_optimizer_state: Path) -> None:
    """DeepSpeed 0.19's ZeRO-3 universal load gives every parameter group the first group's settings
    (stage3.py, _load_universal_checkpoint): the no-decay group (biases, LayerNorm) would be decayed from then on.
    Each group gets its own back, as saved (the file is memory-mapped: only the settings are read)."""
    saved = integrity.load_deepspeed_file(universal_optimizer_state)
    saved_groups = saved["optimizer_state_dict"]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise UserError(f"{universal_optimizer_state} holds {len(saved_groups)} parameter groups, this model "
                        f"{len(optimizer.param_groups)}; resume it with the model it was written by")
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


# ---------------------------------------------------------------------------------------------------
# The resume point
# ---------------------------------------------------------------------------------------------------


@dataclass
class ResumePoint:
    checkpoint_dir: Path
    tag: str
    saved_world_size: int | None
    phase1: bool = False  # a phase-1 tag that phase 2 starts from (phases.py), not this run's own
    universal_dir: Path | None = None  # where its universal form goes (default: beside it)

    def load_dir(self, world_size: int) -> Path:
        """The folder DeepSpeed loads the tag to load (`prepare_universal`'s) from."""
        return (self.universal_dir or self.checkpoint_dir) if self.universal(world_size) else self.checkpoint_dir

    @property
    def partitioned(self) -> bool:
        """Written at ZeRO stage 1-3: the optimizer (and at 3 the weights) in per-rank partitions."""
        return any((self.checkpoint_dir / self.tag).glob("*zero_pp_rank_*"))

    def universal(self, world_size: int) -> bool:
        """Written on another world size with ZeRO partitions: loaded through DeepSpeed's universal checkpoint.
        At ZeRO stage 0 every rank holds the whole state, which loads on any world size as it is."""
        return self.saved_world_size not in (None, world_size) and self.partitioned


def find_resume_point(resume: str, output_dir: Path) -> ResumePoint | None:
    """--resume auto | none | DIR -> the checkpoint to continue from (None: start afresh)."""
    if resume == "none":
        return None
    if resume == "auto":
        checkpoint_dir = output_dir / CHECKPOINTS
        tag = latest_tag(checkpoint_dir)
        if tag is None:
            return None
        if not (checkpoint_dir / tag).is_dir():
            raise UserError(f"{checkpoint_dir / 'latest'} names {tag}, which does not exist; pass --resume a tag in "
                            f"{checkpoint_dir}, or start afresh with --resume none --overwrite")
    else:
        if not Path(resume).is_dir():
            raise UserError(f"--resume {resume}: no such checkpoint folder; pass a checkpoints folder or one of its "
                            "tags")
        checkpoint_dir, tag = resolve_tag(resume)
    return ResumePoint(checkpoint_dir, tag, saved_world_size(checkpoint_dir, tag))


def prepare_universal(point: ResumePoint, world_size: int) -> str:
    """The tag to load: the checkpoint's own, or its universal form on another world size (converted once,
    on rank 0, by DeepSpeed's ds_to_universal; a collective)."""
    if not point.universal(world_size):
        return point.tag

    def convert() -> None:
        if point.universal_dir is not None:
            point.universal_dir.mkdir(parents=True, exist_ok=True)
        convert_to_universal(point.checkpoint_dir, point.tag, point.universal_dir)
        print(f"truneg: {point.tag} was written by {point.saved_world_size} ranks; loading its universal form on "
              f"{world_size}", flush=True)

    # the converter reads every shard: a changed byte would pass into the universal form, which has no manifest
    integrity.verify_before_load(point.checkpoint_dir / point.tag, point.saved_world_size)
    on_rank_zero(convert, f"convert {point.checkpoint_dir / point.tag} to a universal checkpoint")
    return universal_tag(point.tag)
