"""`truneg ablation`'s flags (the parser stays free of torch: `truneg --help` builds it)."""
from __future__ import annotations

import argparse
from pathlib import Path

from truneg.data.blocks import DEMO_CORPUS
from truneg.errors import float_between, int_at_least
from truneg.eval.seeds import parse_seeds
from truneg.eval.variants import DEFAULT_VARIANTS, VARIANTS

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared/data beside this repo
# Table 2's checkpoints are at 6.25, 12.5, 25, 50, 80 and 100 % of training. Saving every checkpoint of such a
# schedule takes saves at their greatest common step: 1.25 % with 80 (80 saves), 6.25 % with 75 (16 saves).
FN_CHECKPOINTS = "6.25,12.5,25,50,75,100"
RECIPE = "default: the exported model's recipe by family and size, docs/evaluation.md#recipes"


def parse_variants(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise argparse.ArgumentTypeError(f"unknown variant(s) {', '.join(unknown) or text!r}; choose from "
                                         f"{', '.join(VARIANTS)}")
    return list(dict.fromkeys(variants))


def parse_percents(text: str) -> list[float]:
    """`--fn-checkpoints`: percents of --steps in (0, 100], or `none`."""
    if text.strip().lower() == "none":
        return []
    try:
        percents = sorted({float(p) for p in text.split(",") if p.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give percents of --steps such as 25,50,100, or none") from None
    if not percents or not all(0 < p <= 100 for p in percents):
        raise argparse.ArgumentTypeError(f"{text!r}: each percent must be in (0, 100]")
    return percents


def add_parser(commands, func) -> None:
    parser = commands.add_parser("ablation", help="the paper's pipeline in one resumable command: each variant "
                                 "pre-trained alike, exported, fn-stats, GLUE over seeds, SQuAD, the report "
                                 "(paper Tables 2, 3, 6)")
    run = parser.add_argument_group("the run")
    run.add_argument("--variants", type=parse_variants, default=list(DEFAULT_VARIANTS),
                     help=f"comma-separated, of {', '.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)}; "
                          "HC_Embedding needs --hc-embeddings)")
    run.add_argument("--output-dir", default="runs/ablation",
                     help="one folder per variant, stages.json (the finished stages), ablation.json and report/ "
                          "(default: runs/ablation); the same command again continues with the first stage not done")
    pre = parser.add_argument_group("pre-training (each variant alike)")
    pre.add_argument("--preset", default=None, help="the model preset every variant pre-trains (default: bert-tiny; "
                     "with --init-from: the checkpoint's own architecture, as `auto` says it)")
    pre.add_argument("--init-from", help="continue each variant from this HF checkpoint, a folder or a hub name, "
                     "as the paper did from public ones (ELECTRA: its discriminator, or a folder with generator/ "
                     "and discriminator/)")
    pre.add_argument("--init-generator", help="ELECTRA: the generator checkpoint (a folder or a hub name) beside "
                     "--init-from's discriminator")
    pre.add_argument("--new-head", action="store_true", help="BERT: --init-from is an encoder without the MLM head "
                     "(a BertModel, a sentence-transformers model); pretrain.py starts the head (its --new-head)")
    pre.add_argument("--steps", type=int_at_least(1), default=300, help="pre-training steps of each variant")
    pre.add_argument("--train-data", nargs="+", default=[str(DEMO_CORPUS)],
                     help="pre-training corpus: files, folders or globs (default: the shipped novel)")
    pre.add_argument("--seq-len", type=int_at_least(3), default=128, help="pre-training tokens per sequence")
    pre.add_argument("--seed", type=int_at_least(0), default=42, help="pre-training's seed, the same in every variant")
    pre.add_argument("--micro-batch-size", type=int_at_least(1), help="override the config's micro batch per rank")
    pre.add_argument("--deepspeed_config", help="pre-training's DeepSpeed config (default: pretrain.py's choice)")
    pre.add_argument("--hc-embeddings", help="HC_Embedding's word vectors: a word2vec file or an HF model folder")
    launch = parser.add_argument_group("launch (the deepspeed launcher; as `truneg preflight` names them)")
    launch.add_argument("--hostfile", help="DeepSpeed hostfile: pre-train over its nodes (without it: this machine)")
    launch.add_argument("--launcher-args", default="", help="options given to `deepspeed` itself, e.g. "
                        "--launcher-args='--launcher slurm --num_nodes 4'")
    launch.add_argument("--num-gpus", type=int_at_least(1), help="ranks per node (default: 2 without --hostfile, "
                        "else every slot of the hostfile; CPU ranks on a machine without GPUs)")
    launch.add_argument("--master-port", type=int, default=29511, help="the launcher's rendezvous port")
    fn = parser.add_argument_group("false negatives (paper Table 2)")
    fn.add_argument("--fn-checkpoints", type=parse_percents, default=parse_percents(FN_CHECKPOINTS),
                    help=f"checkpoints to save and run fn-stats on, in percent of --steps (default {FN_CHECKPOINTS}; "
                         "the paper's 80 instead of 75 takes a save every 1.25 %%), or none. Saves fall on their "
                         "greatest common step; one that would take over 100 saves rounds the schedule onto the "
                         "first checkpoint's multiples")
    fn.add_argument("--fn-data", nargs="+", default=[str(SHARED_DATA / "wikitext-2-raw" / "wiki.valid.raw")],
                    help="fn-stats' text (default: WikiText-2's validation split in ../shared/data)")
    fn.add_argument("--fn-max-sequences", type=int_at_least(1), help="fn-stats: stop after this many sequences")
    tune = parser.add_argument_group("fine-tuning (flags not given: the model's published recipe)")
    tune.add_argument("--tasks", default="rte,mrpc", help="GLUE tasks, comma-separated (default: rte,mrpc; '': none, "
                      "the variants pre-trained and counted by fn-stats only)")
    tune.add_argument("--glue-dir", default=str(SHARED_DATA / "glue"),
                      help="GLUE's task folders (RTE/, MRPC/, ...; default: ../shared/data/glue beside this repo)")
    tune.add_argument("--finetune-seeds", type=parse_seeds, default=[1, 2, 3, 4, 5], metavar="S1,S2,...",
                      help="fine-tuning seeds: the tables report the median, with the spread (default 1,2,3,4,5)")
    tune.add_argument("--squad-train", help="SQuAD v1.1 training JSON: with --squad-dev, each variant is also "
                      "fine-tuned on SQuAD")
    tune.add_argument("--squad-dev", help="SQuAD v1.1 dev JSON")
    tune.add_argument("--recipe", choices=["auto", "electra", "bert", "roberta"], default="auto",
                      help="whose published recipe fills the fine-tuning flags not given (auto: by model family)")
    tune.add_argument("--epochs", type=int_at_least(0), help=f"fine-tuning epochs ({RECIPE})")
    tune.add_argument("--lr", type=float_between(0), help=f"fine-tuning learning rate ({RECIPE})")
    tune.add_argument("--batch-size", type=int_at_least(1), help=f"fine-tuning batch size ({RECIPE})")
    tune.add_argument("--layerwise-decay", type=float_between(0, 1), help=f"layer-wise lr decay ({RECIPE})")
    tune.add_argument("--max-train-samples", type=int_at_least(1), help="fine-tune on the first N training examples")
    tune.add_argument("--robustness", metavar="TASK", help="after TASK's fine-tuning (a task of --tasks, e.g. sst2), "
                      "score each seed's model on TASK's dev set under SwapSynWordNet (paper Table 5)")
    parser.set_defaults(func=func, output_paths=[("output_dir", "--output-dir", True)])
