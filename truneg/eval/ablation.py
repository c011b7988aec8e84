"""The paper's pipeline in one resumable command (Tables 2, 3 and 6): each variant pre-trained alike, exported,
its checkpoints through fn-stats, fine-tuned on GLUE (and SQuAD) over seeds, then the report.

    truneg ablation --preset bert-tiny --tasks rte,mrpc --steps 300 --finetune-seeds 1,2,3        # CPU-sized
    truneg ablation --preset bert-base --init-from bert-base-uncased --seq-len 512 --steps 200000 \\
        --hostfile launch/hosts --deepspeed_config CONFIG --tasks cola,sst2,mrpc,stsb,qqp,mnli,qnli,rte   # the paper's

Every variant trains through the real `deepspeed` launcher with the same seed, data and steps. Each finished stage
(VARIANT/pretrain, /export, /fn-stats, /glue/TASK, /robustness/TASK and /squad with their seeds and recipe flags,
then report) goes into `<output-dir>/stages.json`: the same command again after a kill continues with the first
stage not done, and a fine-tuning cut between seeds keeps the seeds it finished. Writes `ablation.json`,
`ablation.txt` and, through `truneg report`, `report/` (glue.md/.csv/_deltas.png, glue_paired.md/.csv,
false_negatives.md/.csv/.png, robustness.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from truneg.cluster.hostfile import check_hostfile
from truneg.errors import UserError, check_output_path
from truneg.eval.glue import TASKS, finetune, main_metric, resolve_model_dir
from truneg.eval.recipes import FIELDS, fill, model_recipe
from truneg.eval.report import report
from truneg.eval.robustness import evaluate_glue
from truneg.eval.seeds import run_seeds, seed_dir
from truneg.eval.squad import finetune_squad
from truneg.eval.variants import VARIANTS, folder_name, run_dir
from truneg.train.checkpointing.checkpoint import complete_tags, latest_tag, step_of_tag
from truneg.train.checkpointing.export import export
from truneg.train.config.args import parse_args
from truneg.train.config.run_config import CHECKPOINTS

STAGES_FILE = "stages.json"
# What makes two invocations the same ablation: a stage recorded under other values would be another run's
IDENTITY = ("preset", "init_from", "init_generator", "new_head", "steps", "seed", "seq_len", "train_data",
            "deepspeed_config", "micro_batch_size", "hc_embeddings", "fn_checkpoints")
AUTO = "auto"  # --preset: the --init-from checkpoint's own architecture


MAX_SAVES = 100  # a schedule whose exact steps would take more saves is rounded onto a coarser grid


def _exact_steps(steps: int, percents: list[float]) -> list[int]:
    return [max(1, round(steps * p / 100)) for p in percents]


def save_steps(steps: int, percents: list[float]) -> int:
    """Save every this many steps: each scheduled checkpoint, and the last, falls on a save. Their greatest
    common step, unless that takes over MAX_SAVES saves (300 steps at 6.25 %: every step); then the first
    checkpoint's step (at least steps / MAX_SAVES), and fn_steps rounds the schedule onto its multiples."""
    exact = _exact_steps(steps, percents)
    every = math.gcd(steps, *exact)
    return every if steps // every <= MAX_SAVES else max(min(exact), math.ceil(steps / MAX_SAVES))


def fn_steps(steps: int, percents: list[float]) -> list[int]:
    """The steps of --fn-checkpoints (percents of --steps, at least step 1), each on a save of save_steps
    (the last step is always saved)."""
    every = save_steps(steps, percents)
    return sorted({s if s >= steps else min(steps, max(every, every * round(s / every)))
                   for s in _exact_steps(steps, percents)})


def preset(args: argparse.Namespace) -> str:
    """--preset as given; not given, the checkpoint's own architecture (`auto`) with --init-from, else bert-tiny."""
    return args.preset or (AUTO if args.init_from else "bert-tiny")


def identity(args: argparse.Namespace) -> dict:
    """What stages.json compares (a flag added later is recorded only when set, so that earlier runs continue)."""
    return {**{k: getattr(args, k, None) for k in IDENTITY}, "preset": preset(args), "new_head": args.new_head or None}


def pretrain_args(variant: str, args: argparse.Namespace, out: Path) -> list[str]:
    """`pretrain.py`'s arguments for one variant."""
    model = [] if preset(args) == AUTO else ["--model", preset(args)]
    argv = [*model, "--train-data", *args.train_data, "--max-steps", str(args.steps),
            "--save-steps", str(save_steps(args.steps, args.fn_checkpoints)), "--log-steps",
            str(max(1, args.steps // 10)), "--seed", str(args.seed), "--seq-len", str(args.seq_len),
            "--output-dir", str(out), *VARIANTS[variant], *(["--new-head"] if args.new_head else [])]
    if variant == "HC_Embedding":
        argv += ["--hc-embeddings", str(args.hc_embeddings)]
    for flag, value in (("--deepspeed_config", args.deepspeed_config), ("--micro-batch-size", args.micro_batch_size),
                        ("--init-from", args.init_from), ("--init-generator", args.init_generator)):
        if value:
            argv += [flag, str(value)]
    return argv


def launcher(args: argparse.Namespace) -> list[str]:
    """The `deepspeed` launcher's own options: the GPUs per node, the hostfile, --launcher-args, the port."""
    cmd = [str(Path(sys.executable).parent / "deepspeed")]
    extra = shlex.split(args.launcher_args or "")
    num_gpus = args.num_gpus or (None if args.hostfile or "--num_gpus" in extra else 2)
    if num_gpus:
        cmd += ["--num_gpus", str(num_gpus)]
    if args.hostfile:
        cmd += ["--hostfile", args.hostfile]
    return cmd + extra + ["--master_port", str(args.master_port)]


def _run(what: str, cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-5:])
        raise UserError(f"{what} failed (exit {proc.returncode}); its last lines:\n{tail}")


def pretrain(variant: str, args: argparse.Namespace, out: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "pretrain.py"
    _run(f"pre-training {variant}", [*launcher(args), str(script), *pretrain_args(variant, args, out)])


def fn_stats(variant: str, args: argparse.Namespace, folder: Path) -> None:
    """`truneg fn-stats` on the scheduled checkpoints, into VARIANT/fn (one line per text line, as Table 2)."""
    wanted = set(fn_steps(args.steps, args.fn_checkpoints))
    tags = [folder / CHECKPOINTS / t for t in complete_tags(folder / CHECKPOINTS) if step_of_tag(t) in wanted]
    if not tags:
        raise UserError(f"{folder / CHECKPOINTS} holds none of the checkpoints of --fn-checkpoints "
                        f"(steps {', '.join(map(str, sorted(wanted)))})")
    cmd = [sys.executable, "-m", "truneg.cli", "fn-stats", "--checkpoints", *map(str, tags), "--data", *args.fn_data,
           "--out", str(folder / "fn"), "--seq-len", str(args.seq_len), "--segmentation", "line"]
    if args.fn_max_sequences:
        cmd += ["--max-sequences", str(args.fn_max_sequences)]
    _run(f"fn-stats of {variant}", cmd)


def recipe(model: Path, args: argparse.Namespace, benchmark: str) -> dict:
    """The fine-tuning flags given, the rest from the exported model's published recipe."""
    given = {k: getattr(args, k, None) for k in FIELDS if k not in ("doc_stride", "max_seq_len", "warmup_ratio")}
    if benchmark == "squad":
        given.update(max_seq_len=None, doc_stride=None)
    return fill(given, model_recipe(resolve_model_dir(model), benchmark, args.recipe))


def finetune_glue(task: str, model: Path, args: argparse.Namespace, out: Path) -> dict:
    values = recipe(model, args, "glue")
    glue_dir = Path(args.glue_dir) / TASKS[task].folder
    epochs = TASKS[task].epochs if values.get("epochs") is None else values["epochs"]  # as results.json has them
    return run_seeds(lambda seed, folder: finetune(task, model, glue_dir, folder, seed=seed,
                                                   max_train_samples=args.max_train_samples, **values),
                     args.finetune_seeds, out, expect={"task": task, **values, "epochs": epochs,
                                                       "max_train_samples": args.max_train_samples})


def tuning(args: argparse.Namespace) -> str:
    """What a GLUE / SQuAD stage is recorded with: other seeds or recipe flags run it again (the seeds done are
    kept, and run_seeds refuses in one line a recipe that differs from theirs)."""
    given = [f"{k} {getattr(args, k)}" for k in ("recipe", "lr", "epochs", "batch_size", "layerwise_decay",
                                                 "max_train_samples") if getattr(args, k, None) not in (None, "auto")]
    return " ".join(["seeds", ",".join(map(str, args.finetune_seeds)), *given])


def fn_settings(args: argparse.Namespace) -> str:
    """What an fn-stats stage is recorded with: other text or another sequence limit runs it again."""
    return " ".join(["data", *args.fn_data, *(["max", str(args.fn_max_sequences)] if args.fn_max_sequences else [])])


def finetune_squad_seeds(model: Path, args: argparse.Namespace, out: Path) -> dict:
    values = recipe(model, args, "squad")
    return run_seeds(lambda seed, folder: finetune_squad(model, args.squad_train, args.squad_dev, folder, seed=seed,
                                                         max_train_samples=args.max_train_samples, **values),
                     args.finetune_seeds, out, expect={**values, "max_train_samples": args.max_train_samples})


def robustness_seeds(task: str, folder: Path, args: argparse.Namespace) -> dict:
    """SwapSynWordNet on TASK's dev set for each seed's fine-tuned model (one transform, seed 42, for every variant
    and seed), into VARIANT/robustness/TASK: each seed's robustness.json, and their median beside them."""
    out = folder / "robustness" / task
    per_seed = {seed: evaluate_glue(task, seed_dir(folder / "glue" / task, seed) / "model",
                                    Path(args.glue_dir) / TASKS[task].folder, seed_dir(out, seed))
                for seed in args.finetune_seeds}
    summary = {k: statistics.median(r[k] for r in per_seed.values()) for k in ("original", "transformed", "drop")}
    first = next(iter(per_seed.values()))
    combined = {**{k: first[k] for k in ("task", "transform", "metric", "examples", "dropped_out")}, **summary,
                "reported": "median", "per_seed": {str(seed): r for seed, r in per_seed.items()}}
    (out / "robustness.json").write_text(json.dumps(combined, indent=2) + "\n", encoding="utf-8")
    return combined


class Stages:
    """stages.json: the finished stages of the ablation in --output-dir, and the settings they were run with."""

    def __init__(self, out: Path, identity: dict):
        self.path, self.identity = out / STAGES_FILE, identity
        self.done: dict[str, str] = {}
        if self.path.is_file():
            try:
                record = json.loads(self.path.read_text(encoding="utf-8"))
                record["identity"], record["done"]  # noqa: B018 (both keys, or it is not a stage record)
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{self.path} is damaged; delete it to run every stage again (finished seeds and "
                                "pre-trainings are kept in their folders)") from None
            differ = [f"{k} {record['identity'].get(k)!r} (now {v!r})" for k, v in identity.items()
                      if record["identity"].get(k) != v]
            if differ:
                raise UserError(f"{out} holds an ablation run with {', '.join(differ)}; give the same settings to "
                                "continue it, or another --output-dir")
            self.done = record["done"]

    def __contains__(self, stage: str) -> bool:
        return stage in self.done

    def record(self, stage: str) -> None:
        self.done[stage] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(".json.partial")  # a kill mid-write leaves the last record whole
        partial.write_text(json.dumps({"identity": self.identity, "done": self.done}, indent=2) + "\n",
                           encoding="utf-8")
        os.replace(partial, self.path)


def format_table(scores: dict[str, dict[str, float]], tasks: list[str]) -> str:
    """Per variant each task's median score, the average and the change against the baseline (if it ran)."""
    if not tasks:
        return f"no GLUE task fine-tuned (--tasks ''): {', '.join(scores)} pre-trained and counted by fn-stats"
    header = f"{'variant':<13}" + "".join(f"{t:>9}" for t in tasks) + f"{'avg':>9}{'Δ avg':>9}"
    lines = [header, "-" * len(header)]
    base = scores.get("baseline")
    for variant, by_task in scores.items():
        avg = sum(by_task.values()) / len(tasks)
        delta = "" if base is None or variant == "baseline" else f"{avg - sum(base.values()) / len(tasks):>+9.2f}"
        lines.append(f"{variant:<13}" + "".join(f"{by_task[t]:>9.2f}" for t in tasks) + f"{avg:>9.2f}{delta:>9}")
        if base is not None and variant != "baseline":
            lines.append(f"{'  Δ':<13}" + "".join(f"{by_task[t] - base[t]:>+9.2f}" for t in tasks))
    return "\n".join(lines)


def _check(args: argparse.Namespace, out: Path) -> list[str]:
    """Everything that can be refused before the first pre-training: the output folder, the tasks and their
    files, the hostfile, SQuAD's and fn-stats' files, and pretrain.py's own checks of each variant's arguments."""
    check_output_path(out, "--output-dir")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise UserError(f"unknown GLUE task(s) {', '.join(unknown)}; choose from {', '.join(TASKS)}")
    if args.robustness and args.robustness not in tasks:
        raise UserError(f"--robustness {args.robustness} scores a task's fine-tuned models: add it to --tasks "
                        f"({','.join(tasks)})")
    if preset(args) == AUTO and not args.init_from:
        raise UserError("--preset auto takes the architecture of --init-from's checkpoint: pass --init-from, or a "
                        "preset")
    for task in tasks:
        if not (Path(args.glue_dir) / TASKS[task].folder / "train.tsv").is_file():
            raise UserError(f"{Path(args.glue_dir) / TASKS[task].folder / 'train.tsv'} is missing; point --glue-dir "
                            "at GLUE's folders")
    if bool(args.squad_train) != bool(args.squad_dev):
        raise UserError("SQuAD takes both --squad-train and --squad-dev")
    for flag, path in (("--squad-train", args.squad_train), ("--squad-dev", args.squad_dev),
                       *(("--fn-data", p) for p in (args.fn_data if args.fn_checkpoints else []))):
        if path and not Path(path).exists():
            raise UserError(f"{flag} {path} does not exist")
    if "HC_Embedding" in args.variants and not args.hc_embeddings:
        raise UserError("the HC_Embedding variant needs --hc-embeddings (a word2vec file or an HF model folder)")
    if args.hostfile:
        check_hostfile(args.hostfile)
    for variant in args.variants:
        parse_args(pretrain_args(variant, args, run_dir(out, variant)))
    return tasks


def _pretrained(variant: str, args: argparse.Namespace, folder: Path) -> None:
    """Pre-train a variant not at --steps yet (a cut run resumes from its latest checkpoint)."""
    latest = latest_tag(folder / CHECKPOINTS)
    if latest is None or step_of_tag(latest) != args.steps:
        pretrain(variant, args, folder)
        latest = latest_tag(folder / CHECKPOINTS)
        if latest is None or step_of_tag(latest) != args.steps:  # a stop signal ends a run early, with status 0
            raise UserError(f"pre-training {variant} stopped at {latest or 'no checkpoint'}, short of --steps "
                            f"{args.steps}; run the same ablation again to continue it")


def run_ablation(args: argparse.Namespace) -> dict:
    out = Path(args.output_dir)
    tasks = _check(args, out)
    stages = Stages(out, identity(args))
    ran = False

    def stage(name: str, work, *work_args) -> None:
        nonlocal ran
        if name not in stages:
            work(*work_args)
            stages.record(name)
            ran = True

    scores: dict[str, dict[str, float]] = {}
    for variant in args.variants:
        folder = run_dir(out, variant)
        stage(f"{variant}/pretrain", _pretrained, variant, args, folder)
        stage(f"{variant}/export", export, folder / CHECKPOINTS, folder / "hf")
        if args.fn_checkpoints:
            stage(f"{variant}/fn-stats ({fn_settings(args)})", fn_stats, variant, args, folder)
        for task in tasks:
            stage(f"{variant}/glue/{task} ({tuning(args)})", finetune_glue, task, folder / "hf", args,
                  folder / "glue" / task)
        if args.robustness:
            stage(f"{variant}/robustness/{args.robustness} ({tuning(args)})", robustness_seeds, args.robustness,
                  folder, args)
        if args.squad_train:
            stage(f"{variant}/squad ({tuning(args)})", finetune_squad_seeds, folder / "hf", args, folder / "squad")
        scores[variant] = {t: 100 * json.loads((folder / "glue" / t / "results.json").read_text())[main_metric(t)]
                           for t in tasks}
        print(f"{variant}: " + ", ".join(f"{t} {s:.2f}" for t, s in scores[variant].items()), flush=True)
    table = format_table(scores, tasks)
    robust = {v: json.loads((run_dir(out, v) / "robustness" / args.robustness / "robustness.json").read_text())
              for v in args.variants} if args.robustness else {}
    if robust:
        table += f"\n\nSwapSynWordNet on {args.robustness} dev (median over seeds): original / transformed / drop\n"
        table += "\n".join(f"{v:<13}{r['original']:>9.2f}{r['transformed']:>9.2f}{r['drop']:>9.2f}"
                            for v, r in robust.items())
    print(table)
    record = {"preset": preset(args), "init_from": args.init_from, "init_generator": args.init_generator,
              "steps": args.steps, "seed": args.seed, "finetune_seeds": args.finetune_seeds, "tasks": tasks,
              "variants": {v: folder_name(v) for v in args.variants}, "reported": "median", "scores": scores,
              **({"robustness": {v: {k: r[k] for k in ("task", "original", "transformed", "drop", "examples")}
                                 for v, r in robust.items()}} if robust else {})}
    (out / "ablation.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (out / "ablation.txt").write_text(table + "\n", encoding="utf-8")
    report_stage = "report " + ",".join(args.variants) + " " + ",".join(tasks)
    if ran or report_stage not in stages:
        stages.done.pop(report_stage, None)
        stage(report_stage, report, [str(out)], out / "report", tasks, "baseline",
              f"truneg report {out} --out {out / 'report'}")
    return record
