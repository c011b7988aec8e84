"""The paper's ablation (Tables 3 and 6): baseline, HC, SR and HC+SR pre-trained alike, then fine-tuned.

    truneg ablation --preset bert-tiny --tasks rte,mrpc --steps 300                 # CPU-sized
    truneg ablation --preset electra-base --init-from CKPT --seq-len 512 --steps 200000 --tasks rte,mrpc,sst2,cola \\
        --deepspeed_config ds_configs/electra_base_continued_v100_fp16_zero2.json --num-gpus 8   # as the paper

Each variant trains through the real `deepspeed` launcher with the same seed, data and steps, is exported
with `truneg export`, and is fine-tuned on each task with the same hyper-parameters. Writes
`<output-dir>/ablation.json` and prints the table: per task, the average, and the change against the baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from truneg.errors import UserError, check_output_path
from truneg.eval.glue import TASKS, finetune, main_metric
from truneg.train.args import parse_args
from truneg.train.checkpoint import latest_tag, step_of_tag
from truneg.train.export import export
from truneg.train.run_config import CHECKPOINTS

VARIANTS = {"baseline": [], "HC": ["--hc", "wordnet"], "SR": ["--sr", "word"], "HC+SR": ["--hc", "wordnet", "--sr", "word"]}


def run_dir(out: Path, variant: str) -> Path:
    """A variant's pre-training folder under --output-dir (HC+SR: HC_SR)."""
    return out / variant.replace("+", "_")


def pretrain_args(variant: str, args: argparse.Namespace, out: Path) -> list[str]:
    """`pretrain.py`'s arguments for one variant."""
    argv = ["--model", args.preset, "--train-data", *args.train_data, "--max-steps", str(args.steps),
            "--save-steps", str(args.steps), "--log-steps", str(max(1, args.steps // 10)), "--seed", str(args.seed),
            "--seq-len", str(args.seq_len), "--output-dir", str(out), *VARIANTS[variant]]
    if args.deepspeed_config:
        argv += ["--deepspeed_config", args.deepspeed_config]
    if args.micro_batch_size:
        argv += ["--micro-batch-size", str(args.micro_batch_size)]
    if args.init_from:
        argv += ["--init-from", args.init_from]
    return argv


def pretrain(variant: str, args: argparse.Namespace, out: Path) -> None:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(args.num_gpus), "--master_port", str(args.master_port),
           str(Path(__file__).resolve().parents[1] / "pretrain.py"), *pretrain_args(variant, args, out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise UserError(f"pre-training {variant} failed (exit {proc.returncode}); its last lines:\n{tail}")


def format_table(scores: dict[str, dict[str, float]], tasks: list[str]) -> str:
    header = f"{'variant':<10}" + "".join(f"{t:>9}" for t in tasks) + f"{'avg':>9}{'Δ avg':>9}"
    lines = [header, "-" * len(header)]
    base_avg = sum(scores["baseline"].values()) / len(tasks)
    for variant, by_task in scores.items():
        avg = sum(by_task.values()) / len(tasks)
        cells = "".join(f"{by_task[t]:>9.2f}" for t in tasks)
        delta = "" if variant == "baseline" else f"{avg - base_avg:>+9.2f}"
        lines.append(f"{variant:<10}{cells}{avg:>9.2f}{delta:>9}")
        if variant != "baseline":
            lines.append(f"{'  Δ':<10}" + "".join(f"{by_task[t] - scores['baseline'][t]:>+9.2f}" for t in tasks))
    return "\n".join(lines)


def run_ablation(args: argparse.Namespace) -> dict:
    # Everything checked before the first of the four pre-trainings: the output folder, pretrain.py's own checks
    # of its arguments, the tasks and their files.
    check_output_path(args.output_dir, "--output-dir")
    out = Path(args.output_dir)
    parse_args(pretrain_args("HC+SR", args, run_dir(out, "HC+SR")))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown GLUE task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    glue_dir = Path(args.glue_dir)
    for task in tasks:
        if not (glue_dir / TASKS[task].folder / "train.tsv").is_file():
            raise UserError(f"{glue_dir / TASKS[task].folder / 'train.tsv'} is missing; point --glue-dir at GLUE's folders")
    scores: dict[str, dict[str, float]] = {}
    for variant in VARIANTS:
        folder = run_dir(out, variant)
        latest = latest_tag(folder / CHECKPOINTS)
        if latest is None or step_of_tag(latest) != args.steps:  # not run, or cut short: it resumes
            pretrain(variant, args, folder)
            latest = latest_tag(folder / CHECKPOINTS)
            if latest is None or step_of_tag(latest) != args.steps:  # a stop signal ends a run early, with status 0
                raise UserError(f"pre-training {variant} stopped at {latest or 'no checkpoint'}, short of --steps "
                                f"{args.steps}; run the same ablation again to continue it")
        export(folder / CHECKPOINTS, folder / "hf")
        scores[variant] = {}
        for task in tasks:
            results = finetune(task, folder / "hf", glue_dir / TASKS[task].folder, folder / "glue" / task,
                               epochs=args.epochs, lr=args.lr, batch_size=args.batch_size,
                               max_train_samples=args.max_train_samples, seed=args.seed)
            scores[variant][task] = 100 * results[main_metric(task)]
        print(f"{variant}: " + ", ".join(f"{t} {s:.2f}" for t, s in scores[variant].items()), flush=True)
    table = format_table(scores, tasks)
    print(table)
    report = {"preset": args.preset, "init_from": args.init_from, "steps": args.steps, "seed": args.seed, "tasks": tasks,
              "scores": scores}
    (out / "ablation.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out / "ablation.txt").write_text(table + "\n", encoding="utf-8")
    return report
