"""DeepSpeed JSON configs: pick the default for the accelerator, read, apply command-line overrides, check."""
from __future__ import annotations

import json
from pathlib import Path

from truneg.errors import UserError

DS_CONFIGS = Path(__file__).resolve().parent.parent / "ds_configs"


def default_config_path() -> Path:
    """cpu_zero2 on the CPU; on GPUs, bf16 where supported (A100/H100), else fp16 (V100)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return DS_CONFIGS / "cpu_zero2.json"
    if accelerator.is_bf16_supported():
        return DS_CONFIGS / "electra_base_a100_bf16_zero3.json"
    return DS_CONFIGS / "electra_base_v100_fp16_zero2.json"


def read_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"DeepSpeed config {path} does not exist; pass one of {DS_CONFIGS}/*.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON (line {err.lineno}: {err.msg}); fix the file") from None
    if not isinstance(config, dict):
        raise UserError(f"DeepSpeed config {path} must hold a JSON object")
    return config


def resolve_batch_sizes(config: dict, world_size: int, micro_batch: int | None, grad_accum: int | None) -> None:
    """Apply --micro-batch-size / --gradient-accumulation-steps and check train_batch_size divides evenly.

    DeepSpeed would assert deep inside initialize(); this says which numbers clash and what to change.
    """
    if micro_batch is not None:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    if grad_accum is not None:
        config["gradient_accumulation_steps"] = grad_accum
    if micro_batch is not None or grad_accum is not None:
        config.pop("train_batch_size", None)
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    total = config.get("train_batch_size")
    if micro is None and total is not None and accum is not None:
        micro = total // (accum * world_size)
    if accum is None:
        accum = 1 if total is None or micro is None else total // (micro * world_size)
    if micro is None or micro < 1 or accum < 1:
        raise UserError("the DeepSpeed config needs train_micro_batch_size_per_gpu (or train_batch_size) >= 1")
    if total is not None and total != micro * accum * world_size:
        raise UserError(
            f"train_batch_size {total} != micro batch {micro} x gradient accumulation {accum} x {world_size} ranks; "
            "make train_batch_size divisible, or drop it and set train_micro_batch_size_per_gpu"
        )
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accum
    config["train_batch_size"] = micro * accum * world_size


def prepare_config(
    path: str | Path,
    world_size: int,
    max_steps: int,
    output_dir: Path,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    lr: float | None = None,
) -> dict:
    """The config as deepspeed.initialize gets it: batch sizes resolved, "auto" steps filled in, monitors
    pointed at the run's output folder."""
    config = read_config(path)
    resolve_batch_sizes(config, world_size, micro_batch, grad_accum)
    if lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
        scheduler_params = config.get("scheduler", {}).get("params", {})
        for key in ("warmup_max_lr", "max_lr", "cycle_max_lr"):
            if key in scheduler_params:
                scheduler_params[key] = lr
    scheduler_params = config.get("scheduler", {}).get("params", {})
    for key, value in list(scheduler_params.items()):
        if value == "auto" and key == "total_num_steps":
            scheduler_params[key] = max_steps
        elif value == "auto" and key == "warmup_num_steps":
            scheduler_params[key] = max(1, max_steps // 100)
    monitor_dirs = {"tensorboard": "tensorboard", "csv_monitor": "csv", "wandb": None, "comet": None}
    for section, subdir in monitor_dirs.items():
        if section in config and subdir is not None:
            config[section]["output_path"] = str(output_dir / subdir)
            config[section].setdefault("job_name", "")
    config.setdefault("steps_per_print", 10**9)  # truneg logs its own metrics
    return config
