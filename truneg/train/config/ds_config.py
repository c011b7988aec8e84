"""DeepSpeed JSON configs: pick the recipe for the preset and the hardware, read it, fit it to the world
size and the command line, and say what was chosen.

Two extensions to DeepSpeed's format, both replaced before DeepSpeed sees the config:
  - `"total_num_steps": "auto"` takes `--max-steps`;
  - `"warmup_num_steps": "auto"` is 1 % of `--max-steps` (BERT's and ELECTRA's 10k of 1M), and `"6%"`
    any other share, so that a recipe's warmup fits however many steps a run is given.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from truneg.errors import UserError, exit_on_user_error, out_of_range

DS_CONFIGS = Path(__file__).resolve().parents[3] / "ds_configs"
CPU_CONFIG = DS_CONFIGS / "cpu_zero2.json"
# DeepSpeed's monitor sections, with the folder under --output-dir of each that writes files
MONITORS = {"tensorboard": "tensorboard", "csv_monitor": "csv", "wandb": None, "comet": None}
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: bf16 tensor cores. Below it (V100, sm_70) bf16 is only emulated.
# DeepSpeed versions whose engine.backward leaves the loss unscaled for fp16 at ZeRO stage 0 while the step
# divides the gradients by the loss scale (deepspeedai/DeepSpeed#8393): truneg.train.loop scales it itself there.
# Another version (even a 0.19.x: the fix is a pull request) may scale it too, twice then: the start refuses
# fp16 at ZeRO-0 on a version not listed here until its engine.backward is read and the version added.
FP16_ZERO0_UNSCALED_DEEPSPEED = ("0.19.8",)

# (preset, continued from a checkpoint) -> recipe stem; the hardware picks `<stem>_v100_fp16_zero2` or
# `<stem>_a100_bf16_zero1` (ZeRO-1: 1.7x ZeRO-2's samples/s for BERT-large on one H200, README "GPU check").
_RECIPES = {
    ("electra-tiny", False): "electra_small", ("electra-tiny", True): "electra_small",
    ("electra-small", False): "electra_small", ("electra-small", True): "electra_small",
    ("electra-base", False): "electra_base", ("electra-base", True): "electra_base_continued",
    ("bert-tiny", False): "bert_base", ("bert-tiny", True): "bert_base",
    ("bert-base", False): "bert_base", ("bert-base", True): "bert_base_continued",
    ("bert-large", False): "bert_large", ("bert-large", True): "bert_large_continued",
}
# The launch scripts' GPU=... names and the compute capability each stands for (launch/common.sh asks here,
# through `python -m truneg.train.config.ds_config`, for the architecture its ranks check and for each recipe's file).
LAUNCH_GPUS = {"v100": (7, 0), "a100": (8, 0), "h100": (9, 0), "h200": (9, 0)}
# --gpu-arch's names: the architectures of the launch scripts' GPU=... (sm70, sm80, sm90)
GPU_ARCHS = {f"sm{major}{minor}": (major, minor) for major, minor in LAUNCH_GPUS.values()}
# The launch scripts' GPU=... as its arch, in the env file every node reads: the ranks check it against their
# own GPU (the preflight can only where the launching node has one).
GPU_ARCH_ENV = "TRUNEG_GPU_ARCH"
_WARMUP_SHARE = re.compile(r"^(\d+(?:\.\d+)?)%$")


def precision_for(capability: tuple[int, int] | None) -> str:
    """fp32 on the CPU (None), fp16 below compute capability 8.0, bf16 from 8.0 (never through emulation)."""
    if capability is None:
        return "fp32"
    return "bf16" if tuple(capability) >= BF16_MIN_CAPABILITY else "fp16"


def local_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's first CUDA GPU, None without one (or under DS_ACCELERATOR=cpu).

    Not torch.cuda.is_bf16_supported(): it is True on a V100 through emulation."""
    import os

    import torch

    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(0))


def default_config_path(preset: str | None = None, capability: tuple[int, int] | None | str = "local",
                        continued: bool = False) -> Path:
    """The recipe for a preset on this hardware: cpu_zero2 on the CPU; on GPUs the preset's recipe (the
    paper's continued one with `continued`): fp16 at ZeRO-2 below compute capability 8.0, bf16 at ZeRO-1 from it.

    capability "local" reads this machine's GPU; None means the CPU. A preset None is electra-base."""
    if capability == "local":
        capability = local_capability()
    if capability is None:
        return CPU_CONFIG
    return recipe_path(_RECIPES.get((preset or "electra-base", bool(continued)), "electra_small"), capability)


def recipe_path(stem: str, capability: tuple[int, int]) -> Path:
    """A recipe's config for a GPU: `<stem>_v100_fp16_zero2` below compute capability 8.0, `<stem>_a100_bf16_zero1`
    from it."""
    if precision_for(capability) == "bf16":
        return DS_CONFIGS / f"{stem}_a100_bf16_zero1.json"
    return DS_CONFIGS / f"{stem}_v100_fp16_zero2.json"


def launch_gpu(name: str) -> tuple[int, int]:
    """The compute capability of a launch script's GPU=... name."""
    if name not in LAUNCH_GPUS:
        raise UserError(f"GPU={name}: use {', '.join(LAUNCH_GPUS)}")
    return LAUNCH_GPUS[name]


# Sections and keys truneg reads before DeepSpeed parses the config: of the wrong JSON type they would stop
# truneg's own code with a traceback, not with a line about the file.
SECTIONS = ("bf16", "fp16", "zero_optimization", "optimizer", "scheduler", "data_types", "checkpoint", *MONITORS)
NUMBERS = {("zero_optimization", "stage"): "an integer", ("optimizer", "params", "lr"): "a number",
           ("scheduler", "params", "warmup_max_lr"): "a number"}


def read_config(path: str | Path, *, for_trainer: bool = False) -> dict:
    """A DeepSpeed config file as a dict. For pre-training, the sections and keys truneg reads are checked for their
    JSON types; `for_trainer` (fine-tuning through HF's Trainer, whose "auto" values and DeepSpeed's own parser
    take the rest) checks the file only."""
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(f"DeepSpeed config {path} {what}; pass one of {DS_CONFIGS}/*.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not valid JSON (line {err.lineno}: {err.msg}); "
                        "fix the file") from None
    except UnicodeDecodeError as err:
        raise UserError(f"DeepSpeed config {path} is not UTF-8 text ({err.reason} at byte {err.start}); pass a JSON "
                        "file") from None
    if not isinstance(config, dict):
        raise UserError(f"DeepSpeed config {path} must hold a JSON object")
    if for_trainer:
        return config
    for section in SECTIONS:
        value = config.get(section)
        params = value.get("params") if isinstance(value, dict) else None
        for name, part in ((section, value), (f"{section}.params", params)):
            if part is not None and not isinstance(part, dict):
                raise UserError(f"DeepSpeed config {path}: {name} is {json.dumps(part)}; it must be an object "
                                f"{{...}}, as in {DS_CONFIGS}/*.json")
    for keys, kind in NUMBERS.items():
        value = config.get(keys[0], {})
        for key in keys[1:]:
            value = value.get(key) if isinstance(value, dict) else None
        number = isinstance(value, int) or (kind == "a number" and isinstance(value, float))
        if value is not None and (isinstance(value, bool) or not number):
            raise UserError(f"DeepSpeed config {path}: {'.'.join(keys)} is {json.dumps(value)}; it must be {kind}")
    return config


def _positive(config: dict, key: str) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"the DeepSpeed config's {key} is {value!r}; it must be an integer >= 1")
    return value


def _largest_divisor_at_most(n: int, bound: int) -> int:
    return max(d for d in range(1, min(n, bound) + 1) if n % d == 0)


def resolve_batch_sizes(config: dict, world_size: int, micro_batch: int | None, grad_accum: int | None) -> str:
    """Fit the batch to `world_size`, keeping the config's global batch (train_batch_size) where it has one.

    The config's train_micro_batch_size_per_gpu is the most one rank holds: when train_batch_size is given,
    the micro-batch is the largest divisor of train_batch_size / world_size up to it, and gradient
    accumulation makes up the rest. --micro-batch-size or --gradient-accumulation-steps alone keep the
    global batch; both together set it (micro x accumulation x world size). Returns one line saying what
    was chosen; a split that does not exist is a UserError naming the numbers and what to pass."""
    if world_size < 1:
        raise UserError(f"world size {world_size}: there must be at least one rank")
    for flag, value in (("--micro-batch-size", micro_batch), ("--gradient-accumulation-steps", grad_accum)):
        if value is not None and (problem := out_of_range(value, 1)):
            raise UserError(f"{flag} {problem}")
    total = _positive(config, "train_batch_size")
    micro_cap = _positive(config, "train_micro_batch_size_per_gpu")
    accum_config = _positive(config, "gradient_accumulation_steps")
    how = ""
    if micro_batch is not None and grad_accum is not None:
        micro, accum = micro_batch, grad_accum
        how = " (set by --micro-batch-size x --gradient-accumulation-steps"
        how += f"; the config's {total} is replaced)" if total and total != micro * accum * world_size else ")"
    elif total is None:  # a per-rank config (the CPU ones): the global batch follows the world size
        micro = micro_batch or micro_cap
        accum = grad_accum or accum_config or 1
        if micro is None:
            raise UserError("the DeepSpeed config needs train_batch_size or train_micro_batch_size_per_gpu; add one")
        how = " (per-rank config: grows with the world size)"
    else:
        if total % world_size:
            raise UserError(
                f"train_batch_size {total} does not split over {world_size} ranks; run on a world size that "
                f"divides {total}, or pass --micro-batch-size M --gradient-accumulation-steps A for a global "
                f"batch of M x A x {world_size}"
            )
        per_rank = total // world_size
        if micro_batch is not None:
            if per_rank % micro_batch:
                raise UserError(
                    f"--micro-batch-size {micro_batch} does not divide train_batch_size {total} / {world_size} "
                    f"ranks = {per_rank}; pass a divisor of {per_rank}, or --gradient-accumulation-steps too "
                    "to change the global batch"
                )
            micro, accum = micro_batch, per_rank // micro_batch
        elif grad_accum is not None:
            if per_rank % grad_accum:
                raise UserError(
                    f"--gradient-accumulation-steps {grad_accum} does not divide train_batch_size {total} / "
                    f"{world_size} ranks = {per_rank}; pass a divisor of {per_rank}, or --micro-batch-size too "
                    "to change the global batch"
                )
            micro, accum = per_rank // grad_accum, grad_accum
        elif micro_cap is None and accum_config is not None:
            if per_rank % accum_config:
                raise UserError(
                    f"gradient_accumulation_steps {accum_config} does not divide train_batch_size {total} / "
                    f"{world_size} ranks = {per_rank}; set train_micro_batch_size_per_gpu instead"
                )
            micro, accum = per_rank // accum_config, accum_config
        else:
            cap = micro_cap or per_rank
            micro = _largest_divisor_at_most(per_rank, cap)
            accum = per_rank // micro
            if micro < cap:
                how = f" (micro-batch {micro}, not the config's {cap}, so that the split is exact)"
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = accum
    config["train_batch_size"] = micro * accum * world_size
    return (f"global batch {config['train_batch_size']} = micro-batch {micro} x gradient accumulation "
            f"{accum} x {world_size} ranks{how}")


def resolve_warmup(value, max_steps: int) -> int | None:
    """"auto" -> 1 % of max_steps, "N%" -> N % of it (at least 1 step); a number stays; None stays None."""
    if value == "auto":
        value = "1%"
    if isinstance(value, str):
        match = _WARMUP_SHARE.match(value.strip())
        if not match:
            raise UserError(f"warmup_num_steps {value!r}: write a number of steps, \"auto\" (1 %) or a share like "
                            "\"6%\"")
        return max(1, round(max_steps * float(match.group(1)) / 100))
    return value


def resolve(
    path: str | Path,
    world_size: int,
    max_steps: int,
    output_dir: Path,
    micro_batch: int | None = None,
    grad_accum: int | None = None,
    lr: float | None = None,
    micro_cap: int | None = None,
) -> tuple[dict, list[str]]:
    """The config as deepspeed.initialize gets it, and the lines saying what was chosen (for rank 0 to print):
    batch sizes fitted to the world size (`micro_cap` in place of the file's micro-batch: the GPU memory's), --lr
    applied, "auto" and "N%" steps filled in, bf16 gradients accumulated in fp32 where DeepSpeed allows it
    (ZeRO >= 1), monitors pointed at the run's folder, and DeepSpeed's throughput timer unsynchronized."""
    config = read_config(path)
    if micro_cap is not None:
        config["train_micro_batch_size_per_gpu"] = micro_cap
    choices = [resolve_batch_sizes(config, world_size, micro_batch, grad_accum)]
    if lr is not None:
        config.setdefault("optimizer", {}).setdefault("params", {})["lr"] = lr
        scheduler_params = config.get("scheduler", {}).get("params", {})
        for key in ("warmup_max_lr", "max_lr", "cycle_max_lr"):
            if key in scheduler_params:
                scheduler_params[key] = lr
    scheduler_params = config.get("scheduler", {}).get("params", {})
    if scheduler_params.get("total_num_steps") == "auto":
        scheduler_params["total_num_steps"] = max_steps
    if "warmup_num_steps" in scheduler_params:
        written = scheduler_params["warmup_num_steps"]
        warmup = scheduler_params["warmup_num_steps"] = resolve_warmup(written, max_steps)
        line = f"warmup {warmup} steps" + (f" ({written} of --max-steps {max_steps})" if isinstance(written, str)
                                           else "")
        if isinstance(warmup, int) and warmup >= max_steps:
            line += f"; longer than --max-steps {max_steps}: the peak learning rate is never reached"
        choices.append(line)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if config.get("bf16", {}).get("enabled"):
        if stage >= 1 and "grad_accum_dtype" not in config.get("data_types", {}):
            config.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
            choices.append("bf16 gradients accumulate in fp32 (data_types.grad_accum_dtype)")
        elif stage == 0 and config["gradient_accumulation_steps"] > 1:
            choices.append("bf16 gradients accumulate in bf16: DeepSpeed has no fp32 accumulation for bf16 at ZeRO "
                           "stage 0")
    for section, subdir in MONITORS.items():
        if section in config and subdir is not None:
            config[section]["output_path"] = str(Path(output_dir) / subdir)
            config[section].setdefault("job_name", "")
    config.setdefault("steps_per_print", 10**9)  # truneg logs its own metrics
    # DeepSpeed's throughput timer synchronizes the device at each micro-step's forward and step by default:
    # the host then waits for the GPU to drain instead of queueing the next kernels. truneg times its own
    # steps, so the timer runs on the host clock unless the config asks for it synchronized.
    config.setdefault("timers", {}).setdefault("throughput", {}).setdefault("synchronized", False)
    return config, choices


def precision_of(config: dict) -> str:
    if config.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp16" if config.get("fp16", {}).get("enabled") else "fp32"


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    """For launch/common.sh: `python -m truneg.train.config.ds_config arch GPU` prints the architecture of GPU=...
    (sm70, ...), which the ranks check against their own; `python -m truneg.train.config.ds_config recipe STEM GPU`
    the recipe's config file."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m truneg.train.config.ds_config")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("arch").add_argument("gpu")
    recipe = commands.add_parser("recipe")
    recipe.add_argument("stem")
    recipe.add_argument("gpu")
    args = parser.parse_args(argv)
    capability = launch_gpu(args.gpu)
    if args.command == "arch":
        print(f"sm{capability[0]}{capability[1]}")
        return
    path = recipe_path(args.stem, capability)
    if not path.is_file():
        raise UserError(f"no recipe {path.name} in {DS_CONFIGS}")
    print(path)


if __name__ == "__main__":
    main()
