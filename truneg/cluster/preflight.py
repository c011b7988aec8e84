"""`truneg preflight`: check a pre-training run before launching it, on any machine that sees its files.

    truneg preflight --hostfile launch/hosts --deepspeed_config ds_configs/bert_large_v100_fp16_lamb_zero0.json \\
        --model bert-large --train-data /shared/corpus --output-dir /shared/runs/bl --max-steps 15625 [--gpu-arch sm70]

prints what the run would do, one `key: value` a line, and exits 0; or one line per problem and exits 2.
The checks themselves live in truneg.train.config.checks, which pretrain.py's start-up runs too.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import torch

from truneg.cluster.hostfile import (
    check_hostfile,
    check_multi_node_launch,
    check_ssh,
    is_this_machine_one_of,
    launched_resources,
    launcher_options,
)
from truneg.data.masking import DEFAULT_RATE, default_max_predictions
from truneg.errors import UserError, out_of_range
from truneg.train.checkpointing import phases
from truneg.train.config import ds_config, memory
from truneg.train.config.args import argument_problems
from truneg.train.config.args import build_parser as pretrain_parser
from truneg.train.config.checks import (
    deepspeed_optimizer,
    effective_preset,
    memory_shape,
    path_problems,
    resolve_config,
    start_problems,
)
from truneg.train.config.ds_config import GPU_ARCHS
from truneg.train.config.run_config import RunConfig

BYTES_PER_PARAM = {"fp32": 16, "fp16": 14, "bf16": 14}  # weights + fp32 master + two moments (Adam, LAMB)


def summary(args: argparse.Namespace, config: dict, world_size: int, capability, params: int | None) -> list[str]:
    """`key: value` lines: what the run would do."""
    precision = ds_config.precision_of(config)
    scheduler = (config.get("scheduler") or {}).get("params") or {}
    global_batch = config["train_batch_size"]
    where = "CPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
    lines = [
        f"world size: {world_size}",
        f"micro-batch: {config['train_micro_batch_size_per_gpu']}",
        f"gradient accumulation: {config['gradient_accumulation_steps']}",
        f"global batch: {global_batch}",
        f"precision: {precision} ({where})",
        f"ZeRO stage: {(config.get('zero_optimization') or {}).get('stage', 0)}",
        f"optimizer: {(config.get('optimizer') or {}).get('type')} ({deepspeed_optimizer(config)[0]}), "
        f"lr {(config.get('optimizer') or {}).get('params', {}).get('lr')}",
        f"steps: {args.max_steps}",
        f"warmup: {scheduler.get('warmup_num_steps', 'none')}",
        f"sequence length: {args.seq_len}",
        f"tokens seen: {args.max_steps * global_batch * args.seq_len:,}",
    ]
    saves = args.max_steps // args.save_steps if args.save_steps else 0
    kept = min(saves, args.keep_checkpoints) if args.keep_checkpoints else saves
    if params is not None:
        size = params * BYTES_PER_PARAM[precision]
        lines.append(f"checkpoint size: {size / 1e9:.1f} GB (estimate: {params / 1e6:.0f}M parameters x "
                     f"{BYTES_PER_PARAM[precision]} bytes: weights, fp32 master, two moments)")
        lines.append(f"checkpoints kept: {kept} of {saves} ({kept * size / 1e9:.1f} GB)")
    else:
        lines.append(f"checkpoints kept: {kept} of {saves}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = pretrain_parser()
    parser.prog = "truneg preflight"
    parser.description = __doc__
    parser.add_argument("--hostfile", help="DeepSpeed hostfile; without it: one node with this machine's GPUs")
    parser.add_argument("--gpu-arch", choices=sorted(GPU_ARCHS),
                        help="the nodes' GPU generation, when this machine has none (sm70 V100, sm80 A100, sm90 "
                             "H100/H200)")
    parser.add_argument("--gpu-memory", type=float, metavar="GB",
                        help="the nodes' GPU memory in GiB as torch reports it (40, 80, 141), when this machine has "
                             "no GPU: a shipped recipe's micro-batch follows it")
    parser.add_argument("--check-ssh", action="store_true", help="also reach every node of the hostfile over ssh")
    parser.add_argument("--launcher", default="pdsh",
                        help="DeepSpeed's multi-node launcher, as given to it (default pdsh)")
    parser.add_argument("--launcher-args", default="",
                        help="the options given to `deepspeed` itself (the launch scripts' LAUNCHER_ARGS), read by "
                             "DeepSpeed's own parser: --launcher, --include, --exclude, --num_nodes and --num_gpus "
                             "decide the nodes and GPUs the run gets; write it as --launcher-args='...'")
    return parser


def run(argv: list[str] | None = None) -> int:
    """Print the summary and return 0, or print one line per problem and return 2."""
    args = build_parser().parse_args(argv)
    problems: list[str] = []
    hosts: dict[str, int] = {}
    if args.hostfile:
        try:
            hosts = check_hostfile(args.hostfile)
        except UserError as err:
            problems.append(str(err))
    local = ds_config.local_capability()
    capability = GPU_ARCHS[args.gpu_arch] if args.gpu_arch else local
    # the nodes' memory: --gpu-memory, else this machine's GPU's where it stands for theirs
    gpu_memory = args.gpu_memory
    if gpu_memory is None and not args.gpu_arch:
        gpu_memory = memory.local_memory_gib()
    if args.gpu_memory is not None and (problem := out_of_range(args.gpu_memory, 1)):
        problems.append(f"--gpu-memory {problem}")
        gpu_memory = None
    # (a node that only launches, outside the hostfile's nodes, may have another GPU: each rank checks its own)
    if args.gpu_arch and local is not None and local[0] != capability[0] and (not hosts
                                                                              or is_this_machine_one_of(list(hosts))):
        # the wrappers pass GPU=v100 by default: a forgotten GPU=h100 would otherwise read as a torch-build problem
        problems.append(f"--gpu-arch {args.gpu_arch} (the launch scripts' GPU=...) but this node's GPU is sm_{local[0]}"
                        f"{local[1]}: set GPU to this cluster's GPUs (v100, a100, h100, h200), or run the preflight "
                        "where they are")
    local_gpus = max(torch.cuda.device_count() if local is not None else 1, 1)  # this machine's GPUs
    launcher, ssh_port = args.launcher, None
    try:
        hosts, named, options = launched_resources(hosts, local_gpus, args.launcher_args,
                                                   os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        launcher, ssh_port = named or launcher, options.ssh_port
    except UserError as err:
        problems.append(str(err))
        with contextlib.suppress(UserError):  # options deepspeed parses but its runner refuses: --check-ssh's port
            ssh_port = launcher_options(args.launcher_args).ssh_port
    world_size = max(sum(hosts.values()), 1)
    if not args.hostfile:
        hosts = {}  # one machine: no node checks
    problems += argument_problems(args)
    phase1 = None
    if args.phase1_checkpoint and phases.started(args.phase1_checkpoint):  # (none yet: PHASE=all's check first)
        try:
            afresh = args.overwrite or args.resume == "none"
            phase1 = phases.find_phase1(args.phase1_checkpoint, Path(args.output_dir), pinned=not afresh)
            args.model = phases.adopt(RunConfig.from_args(args), phase1).model  # phase 1's preset sizes the run
        except UserError as err:
            problems.append(str(err))
    config, choices = None, []
    try:
        config, choices = resolve_config(args, world_size, capability, gpu_memory)
    except UserError as err:
        problems.append(str(err))
    if phase1 is not None and config and (problem := phases.config_problem(
            phase1, config, phase1.record.get("synonym_table"))):  # (the table: checked at the start, built there)
        problems.append(problem)
    nodes = max(len(hosts), 1)
    problems += start_problems(args, config, world_size, capability, nodes) if config else path_problems(args, nodes)
    if len(hosts) > 1:
        problems += check_multi_node_launch(args.train_data, launcher, launcher_args=args.launcher_args)
    if args.check_ssh and hosts:
        problems += check_ssh(list(hosts), port=ssh_port)
    if problems:
        for problem in problems:
            print(f"truneg: error: {problem}", file=sys.stderr, flush=True)
        return 2
    preset, shape = effective_preset(args), memory_shape(args)
    params = memory.parameter_count(preset, shape["vocab_size"], untied=shape["untied"]) if preset else None
    if hosts:
        print(f"hostfile: {args.hostfile} ({len(hosts)} nodes: {', '.join(f'{h}={s}' for h, s in hosts.items())})")
    for line in choices:
        key, _, value = line.partition(": ")
        print(line if value and key == "config" else f"note: {line}")
    for line in summary(args, config, world_size, capability, params):
        print(line)
    if preset and capability is not None:  # the estimate at the micro-batch chosen, whatever chose it
        precision, micro = ds_config.precision_of(config), config["train_micro_batch_size_per_gpu"]
        rate = args.mlm_probability or DEFAULT_RATE
        predictions = args.max_predictions or default_max_predictions(args.seq_len, rate)
        checkpointing = bool(args.activation_checkpointing)
        static, per_sample = memory.estimate_gib(preset, precision, args.seq_len, predictions, args.sr, checkpointing,
                                                 **shape)
        print(f"GPU memory estimate: {static + micro * per_sample:.1f} GiB at micro-batch {micro} (weights and "
              f"optimizer states {static:.1f} GiB, unpartitioned, + {per_sample:.3f} GiB a sample"
              f"{', activation checkpointing' if checkpointing else ''})"
              + (f" of {gpu_memory:g} GiB" if gpu_memory else "; pass --gpu-memory for the nodes' micro-batch"))
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(run(argv))


if __name__ == "__main__":
    main()
