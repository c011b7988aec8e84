"""The checks a run must pass before it starts, shared by pretrain.py's start-up and `truneg preflight`.

    config, choices = resolve_config(args, world_size)       # choices: lines for rank 0 to print
    problems = start_problems(args, config, world_size)      # [] when the run can start
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
from pathlib import Path

import torch
from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam, ZenFlowCPUAdam
from deepspeed.ops.lamb import FusedLamb
from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion
from deepspeed.runtime import config as dsc
from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum
from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

from truneg.data.blocks import is_prepared, prepared_seq_len
from truneg.data.corpus import is_hf, resolve_text_files
from truneg.data.masking import DEFAULT_RATE, capped_rate, default_max_predictions
from truneg.errors import UserError, check_output_path
from truneg.model import families, hub
from truneg.model.presets import (
    DEFAULT_PRESET,
    VOCAB_SIZE,
    foreign_model_problem,
    is_electra_checkpoint,
    matching_preset,
)
from truneg.train.config import ds_config, memory
from truneg.train.config.ds_config import GPU_ARCH_ENV, GPU_ARCHS
from truneg.train.config.run_config import tokenizer_of

# The torch wheels that carry each generation's kernels (pytorch/pytorch#172352: 2.11 dropped sm_70 from
# the CUDA 12.8 wheels, and the CUDA 13 wheels never had it).
_WHEEL_FOR = {7: "cu126", 8: "cu128", 9: "cu128", 10: "cu128", 12: "cu128"}
_NODE_LOCAL = ("/tmp", "/var/tmp", "/dev/shm", "/run")

_LOCAL = "local"  # capability argument: read this machine's GPU


def _capability(capability):
    return ds_config.local_capability() if capability == _LOCAL else capability


def effective_preset(args: argparse.Namespace, fetch: bool = False) -> str | None:
    """--model, else the preset an --init-from checkpoint matches (None if none), else electra-tiny. A hub name not
    in the HF cache yet is of no known size, unless `fetch` downloads its config (a few kB)."""
    if args.model or not args.init_from:
        return args.model or DEFAULT_PRESET
    folder = hub.folder_or_cached(args.init_from) or (hub.fetch_config(args.init_from) if fetch else None)
    electra = True if getattr(args, "init_generator", None) else None  # a discriminator alone is ELECTRA's too
    return matching_preset(folder, electra) if folder is not None else None


def init_config(args: argparse.Namespace) -> dict:
    """The --init-from checkpoint's config.json (an ELECTRA export's discriminator's) where it is here; {} else."""
    folder = hub.folder_or_cached(args.init_from) if args.init_from else None
    if folder is None:
        return {}
    config = folder / "discriminator" / "config.json" if is_electra_checkpoint(folder) else folder / "config.json"
    try:
        read = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return read if isinstance(read, dict) else {}


def memory_shape(args: argparse.Namespace) -> dict:
    """What the memory estimate needs beyond the preset: the model's vocabulary rows (an --init-from's own, else the
    presets'), the head stage, and an untied decoder (--untie-decoder, or a checkpoint exported untied)."""
    config = init_config(args)
    return {"vocab_size": int(config.get("vocab_size") or VOCAB_SIZE),
            "head_only": getattr(args, "train_only", None) == "head",
            "untied": bool(getattr(args, "untie_decoder", False)) or config.get("tie_word_embeddings") is False}


def resolve_config(args: argparse.Namespace, world_size: int, capability=_LOCAL,
                   memory_gib=_LOCAL) -> tuple[dict, list[str]]:
    """The DeepSpeed config for this run and the lines saying what was chosen.

    args: pretrain.py's arguments (deepspeed_config, model, init_from, max_steps, output_dir,
    micro_batch_size, gradient_accumulation_steps, lr, seq_len, max_predictions, sr). capability: (major, minor)
    of the GPUs, None for the CPU, "local" (default) for this machine's; memory_gib: the GPUs' memory, None where
    unknown, "local" for this machine's. A shipped GPU recipe's micro-batch follows the memory where it is known
    (truneg.train.config.memory). Raises UserError when the batch does not split."""
    capability = _capability(capability)
    memory_gib = memory.local_memory_gib() if memory_gib == _LOCAL else memory_gib
    path = args.deepspeed_config
    if path:
        choice = f"config: {path}"
    else:
        # on GPUs the recipe (and its micro-batch for the memory) follows the size: never a guess at a hub name's
        preset = effective_preset(args, fetch=capability is not None)
        path = ds_config.default_config_path(preset, capability, continued=bool(args.init_from))
        where = "the CPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
        kind = "continued" if args.init_from else "from scratch"
        choice = f"config: {path} (default for {preset or 'this checkpoint'} {kind} on {where})"
    micro_cap, by_memory = memory_micro_cap(args, path, capability, memory_gib)
    rate = getattr(args, "mlm_probability", None) or DEFAULT_RATE
    capped = args.max_predictions and capped_rate(args.max_predictions, rate, args.seq_len)
    by_memory += [f"warning: {capped}"] if capped else []
    config, choices = ds_config.resolve(
        path, world_size, args.max_steps, Path(args.output_dir),
        micro_batch=args.micro_batch_size, grad_accum=args.gradient_accumulation_steps, lr=args.lr,
        micro_cap=micro_cap,
    )
    return config, [choice, *by_memory, *choices]


def memory_micro_cap(args: argparse.Namespace, path: str | Path, capability, memory_gib: float | None
                     ) -> tuple[int | None, list[str]]:
    """A shipped GPU recipe's micro-batch for the GPUs' memory, and the line saying so; (None, []) for a user's own
    config, the CPU, an unknown memory or an --init-from of no preset's size."""
    preset = effective_preset(args)
    shipped = Path(path).resolve().parent == ds_config.DS_CONFIGS and not Path(path).name.startswith("cpu_")
    if capability is None or memory_gib is None or preset is None or not shipped or not Path(path).is_file():
        return None, []
    precision = ds_config.precision_of(ds_config.read_config(path))
    predictions = args.max_predictions or default_max_predictions(args.seq_len, getattr(args, "mlm_probability", None)
                                                                  or DEFAULT_RATE)
    micro, line = memory.micro_for_memory(memory_gib, preset, precision, args.seq_len, predictions, args.sr,
                                          bool(getattr(args, "activation_checkpointing", False)), **memory_shape(args))
    return micro, [line]


def deepspeed_optimizer(config: dict) -> tuple[str, type | None]:
    """(DeepSpeed's optimizer class name, the class or None if unknown) that deepspeed.initialize would
    build from the config's "optimizer", following DeepSpeedEngine._configure_basic_optimizer. Imports
    the classes only: no op is built."""
    section = config.get("optimizer") or {}
    written = section.get("type")
    if not written:
        return "none", None
    name = written.lower() if written.lower() in dsc.DEEPSPEED_OPTIMIZERS else written
    params = section.get("params") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer") or {}
    on_cpu = offload.get("device") in (OffloadDeviceEnum.cpu.value, OffloadDeviceEnum.nvme.value)
    if name in (dsc.ADAM_OPTIMIZER, dsc.ADAMW_OPTIMIZER):
        w_mode = name == dsc.ADAMW_OPTIMIZER or params.get(dsc.ADAM_W_MODE, dsc.ADAM_W_MODE_DEFAULT)
        if params.get(dsc.TORCH_ADAM_PARAM):
            cls = torch.optim.AdamW if w_mode else torch.optim.Adam
        elif on_cpu:
            cls = ZenFlowCPUAdam if (config.get("zero_optimization") or {}).get("zenflow") else DeepSpeedCPUAdam
        else:
            cls = FusedAdam
    elif name == dsc.ADAGRAD_OPTIMIZER:
        cls = DeepSpeedCPUAdagrad if on_cpu else torch.optim.Adagrad
    elif name == dsc.LAMB_OPTIMIZER:
        cls = FusedLamb
    elif name == dsc.LION_OPTIMIZER:
        cls = DeepSpeedCPULion if on_cpu else FusedLion
    elif name in (dsc.MUADAM_OPTIMIZER, dsc.MUADAMW_OPTIMIZER, dsc.MUSGD_OPTIMIZER, dsc.MUON_OPTIMIZER):
        return {"muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD", "muon": "MuonWithAuxAdam"}[name], None
    else:
        cls = getattr(torch.optim, name, None)
        return (cls.__name__ if isinstance(cls, type) else written), (cls if isinstance(cls, type) else None)
    return cls.__name__, cls


def check_optimizer(config: dict) -> str | None:
    """One line when DeepSpeed would refuse (or, for LAMB, silently mistrain) the optimizer under the
    config's ZeRO stage, or the bf16 gradient accumulation at ZeRO-0; None when they agree. The reference
    is DeepSpeed's own list, deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    written = (config.get("optimizer") or {}).get("type")
    name, cls = deepspeed_optimizer(config)
    if written is None:
        return "the DeepSpeed config has no optimizer section; add one (e.g. {\"type\": \"AdamW\", ...})"
    if cls is None and name not in ("MuAdam", "MuAdamW", "MuSGD", "MuonWithAuxAdam"):
        return (f"optimizer type {written!r} is neither DeepSpeed's nor torch.optim's; "
                "use AdamW, Adam, Lamb, Lion or Adagrad")
    if stage >= 1:
        supported = cls in ZERO_SUPPORTED_OPTIMIZERS or name == "MuonWithAuxAdam"
        if name == "FusedLamb":
            return (f"optimizer {written} (DeepSpeed's FusedLamb) does not work under ZeRO stage {stage}: DeepSpeed "
                    "lists it outside ZERO_SUPPORTED_OPTIMIZERS, and with zero_allow_untested_optimizer LAMB's "
                    "per-layer trust ratio would be computed per shard; use ZeRO stage 0 "
                    "(ds_configs/bert_large_v100_fp16_lamb_zero0.json) or AdamW with ZeRO-1/2")
        if not supported and not config.get("zero_allow_untested_optimizer"):
            return (f"optimizer {written} ({name}) is not among DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS for ZeRO stage "
                    f"{stage}; use AdamW/Adam/Adagrad/Lion, ZeRO stage 0, or set zero_allow_untested_optimizer")
    elif (config.get("bf16") or {}).get("enabled") and (config.get("data_types")
                                                        or {}).get("grad_accum_dtype") == "fp32":
        return ("bf16 with data_types.grad_accum_dtype fp32 at ZeRO stage 0: DeepSpeed refuses that mix "
                "(NotImplementedError); drop grad_accum_dtype (accumulate in bf16), use ZeRO-1/2, or fp16")
    return None


def cuda_arch_problem(capability: tuple[int, int]) -> str | None:
    """One line when this torch has no kernels for the GPU: no sm_XY of the same major version at or below
    the GPU's (cubins run forward within a major version only). None for a CPU build (no arch list)."""
    arch_list = torch.cuda.get_arch_list()
    if not arch_list:
        return None
    major, minor = capability
    built = [a.split("_", 1)[1].rstrip("af") for a in arch_list if a.startswith("sm_")]
    if any(int(b) // 10 == major and int(b) % 10 <= minor for b in built if b.isdigit()):
        return None
    wheel = _WHEEL_FOR.get(major, "cu128")
    return (f"this torch {torch.__version__} has no kernels for sm_{major}{minor} (it carries {' '.join(arch_list)}); "
            f"install a build that does: pip install torch --index-url https://download.pytorch.org/whl/{wheel}")


def check_precision(config: dict, capability: tuple[int, int] | None) -> list[str]:
    """bf16 needs compute capability 8.0 (it is only emulated on a V100); fp16 needs a GPU."""
    precision = ds_config.precision_of(config)
    if capability is None:
        if precision == "fp16":
            return ["the config enables fp16, which the CPU does not support; use ds_configs/cpu_zero2.json"]
        return []
    problems = []
    if precision == "bf16" and tuple(capability) < ds_config.BF16_MIN_CAPABILITY:
        problems.append(f"the config enables bf16, which sm_{capability[0]}{capability[1]} only emulates (bf16 needs "
                        "compute capability 8.0, A100 or later); use a ds_configs/*_v100_fp16_*.json config")
    arch = cuda_arch_problem(tuple(capability))
    if arch:
        problems.append(arch)
    return problems


def check_fp16_loss_scaling(config: dict) -> str | None:
    """fp16 at ZeRO stage 0 only with a DeepSpeed whose loss scaling there truneg knows (see
    `config.FP16_ZERO0_UNSCALED_DEEPSPEED`): another one might scale the loss on top of truneg."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    installed = importlib.metadata.version("deepspeed")
    known = ds_config.FP16_ZERO0_UNSCALED_DEEPSPEED
    if ds_config.precision_of(config) != "fp16" or stage != 0 or installed.split("+")[0] in known:
        return None
    return (f"fp16 at ZeRO stage 0 with deepspeed {installed}: truneg scales the loss itself for deepspeed "
            f"{', '.join(known)}, whose engine.backward does not there (deepspeedai/DeepSpeed#8393), and this one may "
            f"scale it again; install deepspeed=={known[-1]}, or use a config with ZeRO stage >= 1 or bf16")


def _check_output_dir(output_dir: Path, nodes: int) -> list[str]:
    resolved = Path(output_dir).expanduser().absolute()
    if nodes > 1 and any(str(resolved) == p or str(resolved).startswith(p + "/") for p in _NODE_LOCAL):
        return [f"--output-dir {output_dir} is node-local, but the run spans {nodes} nodes: every node must see "
                "the same checkpoints; pass a folder on shared storage"]
    try:
        check_output_path(output_dir, "--output-dir")
    except UserError as err:
        return [str(err)]
    existing = resolved
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        return [f"--output-dir {output_dir}: {existing} is not writable; pass a folder you can write"]
    return []


def _check_corpus(train_data: list[str], seq_len: int | None) -> list[str]:
    for spec in train_data:  # a prepared folder is read at the length it was prepared at
        if seq_len is not None and is_prepared(spec) and (length := prepared_seq_len(spec)) not in (None, seq_len):
            return [f"{spec} holds blocks of --seq-len {length}, not {seq_len}; pass --seq-len {length} or prepare "
                    f"the corpus again with --seq-len {seq_len}"]
    files = [spec for spec in train_data if not is_hf(spec) and not is_prepared(spec)]
    if not files:
        return []
    try:
        resolve_text_files(files)
    except UserError as err:
        return [str(err)]
    return []


def start_problems(args: argparse.Namespace, config: dict, world_size: int, capability=_LOCAL,
                nodes: int = 1) -> list[str]:
    """Every problem that would stop (or silently spoil) the run, one line each; [] when it can start.

    Pure checks, no process group: the launch scripts' GPU=... (TRUNEG_GPU_ARCH) against this GPU, the
    optimizer against the ZeRO stage, the precision and the torch build against the GPU (capability as in
    resolve_config), fp16 ZeRO-0's loss scaling against the DeepSpeed version, the output folder (shared
    when nodes > 1) and the corpus. `config` is resolve_config's."""
    capability = _capability(capability)
    problems = []
    told = os.environ.get(GPU_ARCH_ENV)
    known = {major for major, _ in GPU_ARCHS.values()}  # a newer GPU (sm_100, ...) has no GPU=... to match
    if told in GPU_ARCHS and capability is not None and capability[0] in known and GPU_ARCHS[told][0] != capability[0]:
        problems.append(f"the launch scripts' GPU=... says {told} ({GPU_ARCH_ENV}) but this node's GPU is "
                        f"sm_{capability[0]}{capability[1]}: set GPU to this cluster's GPUs (v100, a100, h100, h200)")
    optimizer = check_optimizer(config)
    if optimizer:
        problems.append(optimizer)
    problems += check_precision(config, capability)
    scaling = check_fp16_loss_scaling(config)
    if scaling:
        problems.append(scaling)
    writer = config.get("checkpoint", {}).get("writer") or {}
    if writer.get("decoupled") or config.get("datastates_ckpt", False) is not False:
        # it writes after save_checkpoint returns, when truneg marks the checkpoint complete (META, then `latest`)
        problems.append("the config's decoupled checkpoint writer (checkpoint.writer.decoupled, datastates_ckpt) "
                        "finishes in the background, after truneg has marked the checkpoint complete: a kill then "
                        "leaves `latest` naming a half-written one; drop it (checkpoint.writer without decoupled is "
                        "fine)")
    if getattr(args, "compile", None) == "layers" and (config.get("zero_optimization") or {}).get("stage", 0) == 3:
        # ZeRO-3 frees each layer's gathered weights after its forward; a compiled backward saved them as tensors
        problems.append("--compile layers is not checked at ZeRO-3 (its gathered weights are freed under the compiled "
                        "layers' backward): use --compile whole, or ZeRO-0/1/2")
    return problems + path_problems(args, nodes)


def path_problems(args: argparse.Namespace, nodes: int = 1) -> list[str]:
    """The checkpoint to start from, the output folder and the corpus: checked whatever the config."""
    problems, seq_len = [], getattr(args, "seq_len", None)
    for flag, spec in (("--init-from", args.init_from), ("--init-generator", getattr(args, "init_generator", None))):
        if spec and (problem := hub.problem(spec, flag)):
            problems.append(problem)
        elif spec and (folder := hub.folder_or_cached(spec)) and (problem := foreign_model_problem(folder, flag)):
            problems.append(problem)  # (a hub name not cached yet: from_pretrained_with_head, once downloaded)
        elif spec and flag == "--init-from" and (problem := families.tokenizer_problem(spec, tokenizer_of(args))
                                                 or seq_len and families.length_problem(spec, seq_len)):
            problems.append(problem)
    problems += _check_output_dir(args.output_dir, nodes)
    problems += _check_corpus(args.train_data, seq_len)
    problems += [f"--eval-data: {p}" for p in _check_corpus(getattr(args, "eval_data", None) or [], seq_len)]
    return problems
