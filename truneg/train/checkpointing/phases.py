"""BERT from scratch in two phases (seq 128, then 512): phase 2 starts from a phase-1 checkpoint
(`--phase1-checkpoint`), carrying its weights, fp32 masters, optimizer moments and step counters, and resetting the
LR schedule, every optimizer hyper-parameter, the sampler, the seeds and the metric sums (docs/pretraining.md's
table). Phase 1's folder is only read: its universal form, for another world size, goes under phase 2's folder.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from truneg.errors import UserError
from truneg.model.presets import ELECTRA_PRESETS
from truneg.train.checkpointing import checkpoint
from truneg.train.config.run_config import CHECKPOINTS, RUN_FILE, RunConfig

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

FLAG = "--phase1-checkpoint"
UNIVERSAL_DIR = "phase1"  # under phase 2's --output-dir: the phase-1 tag's universal form (another world size)
# The run record's fields naming the phase-1 checkpoint it started from: recorded, not compared (phase 1's `latest`
# moving does not make phase 2's resume another run), and kept from phase 2's start.
RECORD = ("phase1_tag", "phase1_step", "phase1_samples")


@dataclass(frozen=True)
class Phase1:
    """The phase-1 checkpoint a phase-2 run starts from, and phase 1's run record."""

    checkpoint_dir: Path
    tag: str
    step: int
    samples: int | None
    world_size: int | None  # (None: the tag is gone, and phase 2 resumes from its own checkpoint)
    record: dict  # phase 1's run.json

    def resume_point(self, output_dir: Path) -> checkpoint.ResumePoint:
        """Loaded as a resume is, less its own state; its universal form goes under phase 2's `output_dir`, in a folder
        of this phase-1 run's own (a tag name alone could be another phase 1's)."""
        run = hashlib.sha256(str(self.checkpoint_dir).encode()).hexdigest()[:12]
        return checkpoint.ResumePoint(self.checkpoint_dir, self.tag, self.world_size, phase1=True,
                                      universal_dir=output_dir / UNIVERSAL_DIR / run)

    def run_record(self) -> dict:
        return {"phase1_checkpoint": str(self.checkpoint_dir), "phase1_tag": self.tag, "phase1_step": self.step,
                "phase1_samples": self.samples}


def _read_json(path: Path) -> dict | None:
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def started(spec: str) -> bool:
    """Whether `--phase1-checkpoint spec` names a run with a checkpoint yet (PHASE=all checks phase 2 before it)."""
    try:
        checkpoint.resolve(spec)
    except UserError:
        return False
    return True


def find_phase1(spec: str, output_dir: Path, pinned: bool = True) -> Phase1:
    """`--phase1-checkpoint RUN | RUN/checkpoints | RUN/checkpoints/TAG` -> the phase-1 checkpoint. Without a tag, the
    one phase 2's run.json recorded at its start (when it names this folder and `pinned`: not for a phase 2 started
    afresh, --overwrite or --resume none), else phase 1's `latest`. A phase 2 that has saved resumes from its own
    checkpoint and needs only the recorded step of the tag, which phase 1 may have deleted since."""
    path = Path(spec)
    if not path.is_dir():
        raise UserError(f"{FLAG} {spec}: no such folder; pass phase 1's --output-dir, its checkpoints folder or a tag")
    try:
        checkpoint_dir, tag = checkpoint.resolve(path)
    except UserError:
        raise UserError(f"{FLAG} {spec} holds no complete checkpoint (no `latest`); pass a phase-1 run that saved "
                        "one") from None
    checkpoint_dir = checkpoint_dir.resolve()
    if checkpoint_dir.parent == output_dir.resolve():
        raise UserError(f"{FLAG} {spec} is this --output-dir's own checkpoints: phase 2 needs a folder of its own, "
                        "which phase 1's is never written to; pass another --output-dir")
    recorded = _read_json(output_dir / RUN_FILE) or {} if pinned else {}
    if recorded.get("phase1_checkpoint") != str(checkpoint_dir):
        recorded = {}
    saved = (output_dir / CHECKPOINTS / "latest").is_file()
    if tag is not None and recorded.get("phase1_tag") not in (None, tag) and saved:
        raise UserError(f"{FLAG} {spec}: the phase 2 in {output_dir} started from {recorded['phase1_tag']}, not {tag}; "
                        f"pass that tag (or none), or --overwrite to start phase 2 again from {tag}")
    tag = tag or recorded.get("phase1_tag") or checkpoint.latest_tag(checkpoint_dir)
    meta = checkpoint.read_meta(checkpoint_dir, tag) if tag else None
    if meta is None and saved and isinstance(recorded.get("phase1_step"), int):  # resumed: the record is enough
        meta = {"step": recorded["phase1_step"], "samples": recorded.get("phase1_samples"), "world_size": None}
    if meta is None:
        raise UserError(f"{FLAG} {spec}: {checkpoint_dir / str(tag)} is not a complete checkpoint (no META: its save "
                        "was cut, or it was deleted); pass a complete tag")
    record = _read_json(checkpoint_dir.parent / RUN_FILE)
    if record is None:
        raise UserError(f"{FLAG} {spec}: {checkpoint_dir.parent / RUN_FILE} is missing or damaged, so phase 1's model, "
                        "tokenizer and table are unknown; pass the output folder of a truneg run")
    return Phase1(checkpoint_dir, tag, meta["step"], meta.get("samples"), meta["world_size"], record)


def _resolved(path: str | Path | None) -> str | None:
    """A folder as one path however it was written (relative or not); a hub name as it is."""
    return None if path is None else str(Path(path).resolve()) if Path(path).exists() else str(path)


def adopt(cfg: RunConfig, phase1: Phase1) -> RunConfig:
    """Phase 2's config: phase 1's preset where --model is not given; a preset, tokenizer or family that contradicts
    phase 1's is one line."""
    record = phase1.record
    family = (record.get("architecture") or {}).get("family")
    if family == "electra" or record.get("model") in ELECTRA_PRESETS:
        raise UserError(f"{FLAG}: phase 1 is an ELECTRA run; truneg's two phases are BERT's (ELECTRA pre-trains at one "
                        "length): continue it at its own --seq-len with --resume")
    if record.get("init_from") or not record.get("model"):
        raise UserError(f"{FLAG}: phase 1 continued a checkpoint (--init-from); phase 2 follows a run from scratch: "
                        "`truneg export` phase 1 and continue the export with --init-from")
    if cfg.model is not None and cfg.model != record["model"]:
        raise UserError(f"--model {cfg.model}, but phase 1 trained {record['model']}: drop --model (phase 2 takes "
                        "phase 1's)")
    if _resolved(cfg.tokenizer) != _resolved(record.get("tokenizer")):
        raise UserError(f"--tokenizer {cfg.tokenizer}, but phase 1 tokenized with {record.get('tokenizer')}: pass "
                        "that one")
    return replace(cfg, model=record["model"])


def _optimizer_kind(ds_config: dict) -> tuple[str, str, int]:
    precision = "fp16" if ds_config.get("fp16", {}).get("enabled") else (
        "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32")
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    return str((ds_config.get("optimizer") or {}).get("type", "")).lower(), precision, stage


def config_problem(phase1: Phase1, ds_config: dict, table_sha: str | None) -> str | None:
    """Phase 2 keeps phase 1's optimizer, precision and ZeRO stage (its moments and masters are theirs) and its HC
    table; one line for another."""
    mine, theirs = _optimizer_kind(ds_config), _optimizer_kind(phase1.record.get("ds_config") or {})
    for name, a, b in zip(("optimizer", "precision", "ZeRO stage"), mine, theirs):
        if a != b:
            return (f"phase 1 ran with {name} {b}, this config with {a}: phase 2 carries phase 1's optimizer state, "
                    f"so it keeps its optimizer, precision and ZeRO stage; pass a config with {name} {b}")
    if table_sha != phase1.record.get("synonym_table"):
        hc = phase1.record.get("hc")
        return (f"this --hc gives another synonym table than phase 1's (--hc {hc}): phase 2 corrects with phase 1's "
                f"table; pass --hc {hc}")
    return None


def resume_across_lengths_problem(resume: str, seq_len: int) -> str | None:
    """--resume DIR of a run at another --seq-len: a resume would carry its schedule, data position and RNG."""
    try:
        checkpoint_dir, _ = checkpoint.resolve(resume)
    except UserError:
        return None  # (find_resume_point says what is wrong)
    record = _read_json(checkpoint_dir.parent / RUN_FILE) if checkpoint_dir.name == CHECKPOINTS else None
    if record is not None and isinstance(record.get("seq_len"), int) and record["seq_len"] != seq_len:
        return (f"--resume {resume} continues a run at --seq-len {record['seq_len']}, not {seq_len}: to go on at "
                f"{seq_len} (BERT's phase 2), start from it with {FLAG} {resume} in a new --output-dir")
    return None


# ---------------------------------------------------------------------------------------------------
# The optimizer across the boundary
# ---------------------------------------------------------------------------------------------------


def _chain(engine: DeepSpeedEngine) -> list:
    """DeepSpeed's optimizer wrappers (ZeRO, bf16, fp16), outermost first, then the torch optimizer they hold."""
    chain, inner = [], engine.optimizer
    while inner is not None:
        chain.append(inner)
        inner = getattr(inner, "optimizer", None)
    return chain


class Settings:
    """Phase 2's optimizer hyper-parameters as its engine built them (lr at the warm-up's start, betas, eps, weight
    decay per group, LAMB's coefficients, the wrappers' gradient clipping): taken before the load, put back after it.
    DeepSpeed's optimizer load brings phase 1's back with the moments (and truneg's ZeRO-3 group restore re-applies
    them). A group's `step` (FusedAdam keeps one per group) is the moments' count, carried with them."""

    def __init__(self, engine: DeepSpeedEngine):
        chain = _chain(engine)
        self.groups = [{k: v for k, v in g.items() if k not in ("params", "step")} for g in chain[-1].param_groups]
        self.clipping = [(wrapper, wrapper.clip_grad) for wrapper in chain[:-1] if hasattr(wrapper, "clip_grad")]

    def restore(self, engine: DeepSpeedEngine) -> None:
        groups = _chain(engine)[-1].param_groups
        if len(groups) != len(self.groups):  # (torch's own load refuses a phase 1 of another group count first)
            raise UserError(f"the optimizer holds {len(groups)} parameter groups after phase 1's load, "
                            f"{len(self.groups)} before it: start phase 2 with the truneg that wrote phase 1")
        for group, fresh in zip(groups, self.groups):
            group.update(fresh)
        for wrapper, clip in self.clipping:
            wrapper.clip_grad = clip


def empty_moments(engine: DeepSpeedEngine) -> None:
    """--reset-optimizer: the innermost optimizer's moments and step counts emptied after the full load (the masters
    stay phase 1's), as a fresh optimizer has them: every optimizer DeepSpeed builds fills an empty state at its
    first step."""
    inner = _chain(engine)[-1]
    inner.state.clear()
    for group in inner.param_groups:
        group.pop("step", None)
