"""The run's output folder: one run per folder (`run.json` records what makes it that run), and a check
that every node sees the same folder (only rank 0 writes `latest` and the run record)."""
from __future__ import annotations

import copy
import json
import shutil
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from truneg.data.corpus import is_hf
from truneg.data.masking import MASK_SCHEMES
from truneg.errors import UserError
from truneg.train.checkpointing import phases
from truneg.train.checkpointing.checkpoint import complete_tags
from truneg.train.config.ds_config import MONITORS
from truneg.train.config.run_config import CHECKPOINTS, HC_SOURCES, METRICS, PROFILE, RUN_FILE, RunConfig
from truneg.train.ranks.distributed import on_rank_zero

SHARED_PROBE_TIMEOUT_S = 10.0  # network file systems cache attributes for a few seconds


def run_identity(cfg: RunConfig, ds_config: dict, parts: dict) -> dict:
    """What makes two invocations the same run: everything but lengths, intervals and monitor paths.
    `parts` names what was built or loaded (model architecture, the synonym table's and the data's hashes)."""
    per_world = (*MONITORS, "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "checkpoint")
    config = {k: copy.deepcopy(v) for k, v in ds_config.items() if k not in per_world}
    scheduler = config.get("scheduler", {}).get("params", {})
    scheduler.pop("total_num_steps", None)
    return {
        "model": cfg.model, "train_data": sorted(str(Path(p).resolve()) if not is_hf(p) else p
                                                 for p in cfg.train_data),
        "tokenizer": str(cfg.tokenizer), "seq_len": cfg.seq_len, "max_predictions": cfg.max_predictions,
        "seed": cfg.seed, "init_from": cfg.init_from, "hc": cfg.hc, "hc_prediction": cfg.hc_prediction,
        "sr": cfg.sr, "sr_weight": cfg.sr_weight, "sr_sent_target": cfg.sr_sent_target, "dropout": cfg.dropout,
        "ds_config": config, **parts,
        **({"masking": list(cfg.mask_scheme(parts["architecture"]["family"]))} if "architecture" in parts else {}),
        **({"init_generator": cfg.init_generator} if cfg.init_generator else {}),  # (absent from older records)
        **({"new_head": True} if cfg.new_head else {}),  # (only when set: earlier runs still resume)
        **({"reset_optimizer": True} if cfg.reset_optimizer else {}),
        **({"whole_word_masking": True} if cfg.whole_word_masking else {}),
        **({"train_only": cfg.train_only} if cfg.train_only else {}),
        **({"untie_decoder": True} if cfg.untie_decoder else {}),
    }


# Fields added after runs were already recorded: a record without them is an older truneg's, resumed with a
# warning rather than refused.
LATER_FIELDS = ("max_predictions", "sr_sent_target", "architecture", "synonym_table", "data")


# Fields that may hold a path, relative or not, as the command line gave it: the launch scripts make them
# absolute, a hand-typed command may not; compared resolved.
PATH_FIELDS = {"init_from": (), "init_generator": (), "hc": HC_SOURCES}
# The commit a hub name resolved to, beside the field that names it: recorded, not compared (a branch that moved
# since does not make a resume another run, whose weights come from its checkpoint), and kept from the run's start.
RECORD_ONLY = {"init_revision": "init_from", "init_generator_revision": "init_generator"}
KEPT_FROM_START = (*RECORD_ONLY, *phases.RECORD)  # (phases.RECORD: the phase-1 tag a phase 2 started from)


def _resolved(record: dict) -> dict:
    out = {k: v for k, v in record.items() if k not in KEPT_FROM_START}
    names = {field for revision, field in RECORD_ONLY.items() if record.get(revision)}  # hub names, not paths
    for key, words in PATH_FIELDS.items():
        if isinstance(out.get(key), str) and out[key] not in words and key not in names:
            out[key] = str(Path(out[key]).resolve())
    return out


def _compared(previous: dict, identity: dict) -> tuple[dict, dict, list[str]]:
    """The two records as compared (an older record's later fields left out, its masking the family's default),
    and the later fields it lacks."""
    family = identity.get("architecture", {}).get("family")
    if "masking" not in previous and family in MASK_SCHEMES:  # recorded before the flags: the family's default
        previous = {**previous, "masking": list(MASK_SCHEMES[family])}
    missing = [k for k in LATER_FIELDS if k in identity and k not in previous]
    trimmed = {k: v for k, v in identity.items() if k not in missing}
    if family == "electra":
        # --sr-sent-target changes nothing for ELECTRA (refused for it now, recorded by older runs as given)
        previous, trimmed = ({k: v for k, v in r.items() if k != "sr_sent_target"} for r in (previous, trimmed))
    return _resolved(previous), _resolved(trimmed), missing


def _same_run(previous: dict | None, identity: dict) -> tuple[bool, list[str]]:
    if previous is None:
        return False, []
    old, new, missing = _compared(previous, identity)
    return old == new, missing


def _differing(previous: dict, identity: dict) -> list[str]:
    """The fields in which a recorded run and this one differ, as _same_run compares them (a field only one of them
    has counts)."""
    old, new, _ = _compared(previous, identity)
    return sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))


def claim_output_dir(cfg: RunConfig, identity: dict, rank: int) -> None:
    """Refuse an --output-dir holding another run's checkpoints unless --overwrite; record this run."""
    out = cfg.output_dir
    identity = json.loads(json.dumps(identity))
    run_file = out / RUN_FILE
    # What a run can resume: `latest`, or a save every rank finished. A run that stopped before its first complete
    # save (or one still running towards it) leaves only its model's configs, perhaps a save in progress or cut.
    has_checkpoints = (cfg.checkpoint_dir / "latest").is_file() or bool(complete_tags(cfg.checkpoint_dir))
    has_leftovers = cfg.checkpoint_dir.is_dir() and any(cfg.checkpoint_dir.iterdir())
    missing: list[str] = []
    if run_file.is_file():
        try:
            previous = json.loads(run_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            previous = None
        if not isinstance(previous, dict):
            if has_checkpoints and not cfg.overwrite:
                raise UserError(f"{run_file} is damaged, so the checkpoints in {out} cannot be matched to this run; "
                                "restore it from a copy, or pass --overwrite to delete them and start afresh")
            previous = None
        same, missing = _same_run(previous, identity)
        different = not same
        if same and has_checkpoints and cfg.resume != "none" and not cfg.overwrite:  # resumed: its start's commit
            identity.update({k: previous[k] for k in KEPT_FROM_START if k in previous})
    else:
        different = has_checkpoints
    fresh_start = cfg.resume == "none" and has_checkpoints
    if different and has_leftovers and not has_checkpoints and not cfg.overwrite:
        raise UserError(f"{out} holds what another run left before its first complete checkpoint (it stopped early, or "
                        "is still running); pass --overwrite to delete it and start this run there, or choose another "
                        "--output-dir")
    if (different and has_checkpoints or fresh_start) and not cfg.overwrite:
        what = "another run's checkpoints" if different else "checkpoints of this run"
        differ = _differing(previous, identity) if different and previous is not None else []
        raise UserError(
            f"{out} holds {what}; resume it with --resume auto and the same arguments, choose another "
            "--output-dir, or pass --overwrite to delete them"
            + (f" (its {RUN_FILE} differs in {', '.join(differ)})" if differ else "")
        )
    if missing and has_checkpoints and rank == 0:
        print(f"truneg: warning: {run_file} predates the fields {', '.join(missing)}; resuming it as the same run",
              flush=True)
    dist.barrier()  # every rank has read run.json before rank 0 rewrites it

    def record() -> None:
        if cfg.overwrite:
            for name in (CHECKPOINTS, PROFILE, phases.UNIVERSAL_DIR, *filter(None, MONITORS.values())):
                shutil.rmtree(out / name, ignore_errors=True)
            (out / METRICS).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        tmp = run_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
        tmp.replace(run_file)

    on_rank_zero(record, f"record this run in {run_file}")


def check_shared_output_dir(output_dir: Path, rank: int, world_size: int, resume_step: int = -1) -> None:
    """Every rank reads back a file that rank 0 wrote in --output-dir. A node with a folder of its own
    (node-local storage) would find no checkpoint and start afresh while rank 0 resumes: the run would hang
    or silently diverge. Then every rank must have found the same checkpoint to resume from (`resume_step`,
    -1 for none): a `latest` rewritten while the ranks started, or a node's stale cached copy of it, would
    load shards of different steps. Stops on every rank with one line."""
    if world_size == 1:
        return
    device = get_accelerator().current_device_name()  # NCCL takes device tensors only
    nonce = torch.randint(0, 2**62, (1,)) if rank == 0 else torch.zeros(1, dtype=torch.int64)
    nonce = nonce.to(device)
    dist.broadcast(nonce, src=0)
    probe = output_dir / f".truneg-shared-{int(nonce.item()):x}"

    def write_probe() -> None:
        output_dir.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname(), encoding="utf-8")

    # (a full or read-only folder on rank 0 stops every rank, not rank 0 alone: also the barrier before the reads)
    on_rank_zero(write_probe, f"write in {output_dir}")
    deadline = time.monotonic() + SHARED_PROBE_TIMEOUT_S
    while not probe.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    blind = torch.tensor([0 if probe.is_file() else 1], dtype=torch.int64, device=device)
    dist.all_reduce(blind)
    dist.barrier()
    if rank == 0:
        probe.unlink(missing_ok=True)
    if blind.item():
        raise UserError(
            f"{int(blind.item())} of {world_size} ranks do not see {output_dir} as rank 0 wrote it: "
            "--output-dir must be one folder every node shares (NFS, Lustre, ...), not node-local storage"
        )
    steps = torch.tensor([resume_step, -resume_step], dtype=torch.int64, device=device)
    dist.all_reduce(steps, op=dist.ReduceOp.MAX)
    highest, lowest = int(steps[0].item()), -int(steps[1].item())
    if highest != lowest:
        raise UserError(f"the ranks found different checkpoints to resume from in {output_dir} ({_step(lowest)} to "
                        f"{_step(highest)}; this rank: {_step(resume_step)}): `latest` changed while they started, or "
                        "a node sees a stale copy of the folder; start again once nothing else writes there")


def _step(step: int) -> str:
    return "none" if step < 0 else f"step {step}"
