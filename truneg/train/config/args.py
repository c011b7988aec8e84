"""pretrain.py's arguments and their range checks, shared with `truneg preflight`."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import deepspeed
from deepspeed.constants import default_pg_timeout

from truneg.data.blocks import DEMO_CORPUS
from truneg.data.masking import mask_scheme
from truneg.errors import UserError, check_output_path, out_of_range
from truneg.model.compile import COMPILE_MODES, DEFAULT_MODE
from truneg.model.hub import folder_or_cached
from truneg.model.presets import (
    DEFAULT_PRESET,
    ELECTRA_PRESETS,
    MAX_POSITIONS,
    PRESETS,
    check_preset,
    is_electra,
    is_electra_checkpoint,
)
from truneg.train.config.run_config import EVAL_MAX_SEQUENCES, profile_problems

USAGE = """Pre-train BERT (MLM) or ELECTRA (RTD) on DeepSpeed, with the paper's hard correction and soft regularization.

    deepspeed truneg/pretrain.py                                  # electra-tiny on the shipped corpus
    deepspeed --num_gpus 2 truneg/pretrain.py --model bert-tiny --hc wordnet --sr word
    deepspeed --hostfile launch/hosts truneg/pretrain.py --model bert-large \\
        --deepspeed_config ds_configs/bert_large_v100_fp16_zero2.json --train-data /data/corpus

Output (under --output-dir): checkpoints/ (DeepSpeed's layout, `latest`), tensorboard/, metrics.jsonl.
"""
DEFAULT_OUTPUT_DIR = "runs/pretrain"
# Far above a normal step (BERT-large's takes about a second on GPUs), below DeepSpeed's 10-minute collective timeout.
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_REPLICA_CHECK_STEPS = 100  # cost: docs/performance.md


def build_parser() -> argparse.ArgumentParser:
    """The pre-training arguments (shared with `truneg preflight`)."""
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"preset: {', '.join(PRESETS)} (default: electra-tiny, or with --init-from "
                        "the checkpoint's own architecture)")
    parser.add_argument("--train-data", nargs="+", default=[str(DEMO_CORPUS)],
                        help="text files, folders or globs (blank lines separate documents), or "
                             "hf:NAME[:CONFIG][@SPLIT]#COLUMN")
    parser.add_argument("--tokenizer", help="tokenizer folder or hub name (default: bert-base-uncased's; with "
                        "--init-from a RoBERTa or XLM-R, the checkpoint's own)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--save-steps", type=int, default=100,
                        help="0: no periodic checkpoints (benchmarks; a SIGTERM still saves)")
    parser.add_argument("--log-steps", type=int, default=10)
    parser.add_argument("--eval-data", nargs="+",
                        help="held-out text (the forms of --train-data), evaluated with fixed masks at step 0, every "
                             "--eval-steps and at the last step (docs/pretraining.md#held-out-evaluation)")
    parser.add_argument("--eval-steps", type=int, help="evaluate every N optimizer steps (default: at each checkpoint "
                        "save)")
    parser.add_argument("--eval-max-sequences", type=int,
                        help=f"the first N sequences of --eval-data, over all ranks (default {EVAL_MAX_SEQUENCES})")
    parser.add_argument("--eval-synonyms", help="the table the eval's Table 2 counts false negatives with, the same "
                        "for every run to be compared (a FILE.npz of `truneg synonyms build`; default: the shipped "
                        "WordNet table, whatever --hc is)")
    parser.add_argument("--output-dir", type=Path, default=Path(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--init-from", help="continue pre-training from an HF checkpoint: a folder, or a model name "
                        "of the HF hub (NAME[@REVISION], resolved through the HF cache; HF_HUB_OFFLINE honoured)")
    parser.add_argument("--init-generator",
                        help="ELECTRA from two checkpoints: --init-from is the discriminator (ElectraForPreTraining), "
                             "this the generator (ElectraForMaskedLM), each a folder or a hub name; one embedding "
                             "is kept, the discriminator's")
    parser.add_argument("--new-head", action="store_true",
                        help="BERT: --init-from is an encoder without the MLM head (a BertModel, a "
                             "sentence-transformers model); the head starts as HF initialises it, its decoder tied "
                             "to the loaded embeddings")
    parser.add_argument("--train-only", choices=["head"],
                        help="head: train the MLM head alone, the encoder (and the word embeddings) frozen and run "
                             "without dropout; BERT's or RoBERTa's, without --sr (docs/pretraining.md#the-head-stage)")
    parser.add_argument("--untie-decoder", action="store_true",
                        help="the MLM head's decoder becomes a copy of the word embeddings, trained apart from them "
                             "(exported with tie_word_embeddings false; a checkpoint so exported continues untied)")
    parser.add_argument("--phase1-checkpoint", metavar="RUN[/checkpoints[/TAG]]",
                        help="BERT's phase 2 (e.g. seq 512 after 128): start from this phase-1 run's checkpoint (its "
                             "`latest`, or the tag), carrying weights and optimizer moments, with a fresh LR schedule, "
                             "data order and this config's optimizer settings (docs/pretraining.md#two-phases)")
    parser.add_argument("--reset-optimizer", action="store_true",
                        help="with --phase1-checkpoint: empty the optimizer's moments and step counts after the load")
    parser.add_argument("--resume", default="auto",
                        help="auto (latest checkpoint in --output-dir, if any) | none | DIR")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in an --output-dir that holds another run")
    parser.add_argument("--micro-batch-size", type=int, help="override train_micro_batch_size_per_gpu")
    parser.add_argument("--gradient-accumulation-steps", type=int, help="override gradient_accumulation_steps")
    parser.add_argument("--lr", type=float, help="override the optimizer's (and the warmup's peak) learning rate")
    parser.add_argument("--dropout", type=float,
                        help="dropout of every layer (default: 0.1, or with --init-from the checkpoint's own)")
    parser.add_argument("--hc", default="none", help="hard correction: none | wordnet | embedding | FILE.npz")
    parser.add_argument("--hc-embeddings", help="for --hc embedding: a word2vec file or an HF model folder")
    parser.add_argument("--hc-prediction", choices=["argmax", "sample", "default"], default="default",
                        help="the prediction HC judges (default: argmax for BERT, the generator's sample for ELECTRA)")
    parser.add_argument("--sr", choices=["none", "word", "sent"], default="none", help="soft regularization")
    parser.add_argument("--sr-weight", type=float, default=1.0)
    parser.add_argument("--sr-sent-target", choices=["masked", "original"],
                        help="H_s of --sr sent for BERT: the masked sentence (the MLM's own pass, default) or the "
                             "original (ELECTRA's discriminator never sees [MASK]: it always takes the original)")
    parser.add_argument("--mlm-probability", type=float,
                        help="the share of each sequence's maskable positions selected (default 0.15)")
    parser.add_argument("--mask-replace-prob", type=float,
                        help="the share of the selected positions replaced by [MASK] (default: BERT 0.8, ELECTRA 0.85)")
    parser.add_argument("--random-replace-prob", type=float,
                        help="the share of the selected positions replaced by a random token (default: BERT 0.1, "
                             "ELECTRA 0); the rest stay unchanged")
    parser.add_argument("--whole-word-masking", action="store_true",
                        help="mask whole words (every piece of a word selected: WordPiece's `##`, or the words that "
                             "`truneg prepare` stored for byte-level BPE and SentencePiece), as Google's "
                             "whole-word-masking BERTs; the count of masked pieces is the same")
    parser.add_argument("--max-predictions", type=int,
                        help="masked positions per sequence, at most (default: --mlm-probability of --seq-len rounded "
                             "up to 4: 20 at 128, 80 at 512 at 0.15)")
    parser.add_argument("--max-nonfinite-steps", type=int, default=10,
                        help="stop after this many optimizer steps in a row skipped for non-finite losses (any "
                             "precision)")
    parser.add_argument("--cache-dir", type=Path,
                        help="tokenized-corpus cache (default: $TRUNEG_CACHE or ~/.cache/truneg)")
    parser.add_argument("--num-proc", type=int, help="tokenizer processes")
    parser.add_argument("--data-workers", type=int,
                        help="DataLoader workers that read and mask ahead (default: 2 on GPUs, 0 on CPU ranks)")
    parser.add_argument("--compile", nargs="?", const=DEFAULT_MODE, choices=COMPILE_MODES,
                        help="torch.compile: layers (the bare flag: each encoder layer, the embeddings and the heads "
                             "in place) | whole (the pre-trainer at once, DeepSpeed's engine.compile)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="keep only each encoder layer's input for the backward and recompute the layer there "
                             "(torch's non-reentrant checkpoint through HF): less activation memory, a longer step")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--keep-checkpoints", type=int, default=0,
                        help="keep only the newest N complete checkpoints (0: keep all)")
    parser.add_argument("--step-timeout", type=float, default=DEFAULT_STEP_TIMEOUT_S,
                        help="seconds a training step may take (a launch's first, the saves and a resume's load: the "
                             "collective timeout less a minute; a universal conversion is not timed) "
                             "before every rank writes its stack and the run stops, naming the ranks behind; 0: off; "
                             "below the collective timeout (DEEPSPEED_TIMEOUT, minutes)")
    parser.add_argument("--replica-check-steps", type=int, default=DEFAULT_REPLICA_CHECK_STEPS,
                        help="compare the data-parallel replicas' weights every N steps and before each checkpoint "
                             "(0: off)")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's dense TFLOP/s for MFU (default: known GPUs' datasheet peak for the run's "
                             "precision; the CPU and fp32 runs have an MFU only with this)")
    parser.add_argument("--profile-steps", metavar="A:B",
                        help="torch.profiler over optimizer steps A to B, inclusive, into OUTPUT/profile/stepA-B/")
    parser.add_argument("--profile-ranks", metavar="R,R",
                        help="the global ranks --profile-steps profiles (default: all)")
    return deepspeed.add_config_arguments(parser)


def step_timeout_problem(seconds: float) -> str | None:
    """--step-timeout must stop a hung run before the collective timeout does (which says nothing of who hung)."""
    if problem := out_of_range(seconds, 0):
        return f"--step-timeout {problem}"
    collective = default_pg_timeout.total_seconds()
    if seconds >= collective:
        return (f"--step-timeout {seconds:g} is not below the collective timeout ({collective:g} s, DEEPSPEED_TIMEOUT="
                f"{collective / 60:g} minutes), which would stop the run first without naming the rank behind; pass a "
                "smaller one, or raise the collective timeout with it: export "
                f"DEEPSPEED_TIMEOUT={int(seconds // 60) + 5}")
    return None


def _is_electra_run(args: argparse.Namespace) -> bool:
    if getattr(args, "init_generator", None):
        return True
    if getattr(args, "phase1_checkpoint", None):  # BERT's phase 2 (an ELECTRA phase 1 is refused at the start)
        return False
    folder = folder_or_cached(args.init_from) if args.init_from else None
    if folder is not None:
        return is_electra_checkpoint(folder)
    if args.init_from:  # a hub name not downloaded yet: of no known kind but --model's (not the default preset's)
        return args.model in ELECTRA_PRESETS
    return (args.model or DEFAULT_PRESET) in ELECTRA_PRESETS


def masking_problems(args: argparse.Namespace) -> list[str]:
    """The mask rate in (0, 1); the [MASK] and random shares of the selected positions, each in [0, 1], at most 1
    together (with the family's default for the one not given)."""
    problems = []
    rate, mask, random = (getattr(args, name, None) for name in ("mlm_probability", "mask_replace_prob",
                                                                   "random_replace_prob"))
    if rate is not None and (problem := out_of_range(rate, 0, 1, low_open=True, high_open=True)):
        problems.append(f"--mlm-probability {problem}")
    for flag, value in (("--mask-replace-prob", mask), ("--random-replace-prob", random)):
        if value is not None and (problem := out_of_range(value, 0, 1)):
            problems.append(f"{flag} {problem}")
    if not problems and (mask is not None or random is not None):
        _, mask, random = mask_scheme("electra" if _is_electra_run(args) else "bert", None, mask, random)
        if mask + random > 1 + 1e-12:
            problems.append(f"--mask-replace-prob {mask:g} and --random-replace-prob {random:g} share the selected "
                            "positions: together at most 1 (the rest stay unchanged)")
    return problems


def head_stage_problems(args: argparse.Namespace) -> list[str]:
    """--train-only head and --untie-decoder: what they cannot go with (one line each)."""
    problems = []
    if (args.train_only or args.untie_decoder) and _is_electra_run(args):
        flag = "--train-only head" if args.train_only else "--untie-decoder"
        problems.append(f"{flag} is for a BERT's (RoBERTa's) MLM head; ELECTRA's generator, its MLM, is trained with "
                        "its discriminator: drop the flag")
    if args.train_only and args.sr != "none":
        problems.append(f"--sr {args.sr} with --train-only head: SR reaches the word embeddings and the encoder, both "
                        "frozen in the head stage; train the head on the baseline objective (drop --sr)")
    if args.train_only and args.dropout is not None:
        problems.append("--dropout with --train-only head: the frozen encoder runs without dropout and its config "
                        "keeps its own; drop --dropout")
    if args.train_only and args.activation_checkpointing:
        problems.append("--activation-checkpointing with --train-only head: the frozen encoder keeps nothing for a "
                        "backward, and HF's checkpointing would make its embeddings' output need one; drop the flag")
    if args.train_only and not args.init_from and not _is_electra_run(args):
        problems.append("--train-only head trains a head on a checkpoint's encoder, which a fresh model has not: pass "
                        "--init-from the checkpoint")
    if args.train_only and args.phase1_checkpoint:
        problems.append("--train-only head with --phase1-checkpoint: phase 2 carries phase 1's optimizer over every "
                        "parameter; train the head in a run of its own (--init-from an export)")
    return problems


def argument_problems(args: argparse.Namespace) -> list[str]:
    """One line per argument out of range (shared with `truneg preflight`, which lists them all)."""
    # (--micro-batch-size and --gradient-accumulation-steps are checked with the config's own values, in
    # config.resolve_batch_sizes; --num-proc 0 means every CPU)
    floors = {"seq_len": 1, "max_steps": 1, "log_steps": 1, "max_nonfinite_steps": 1, "save_steps": 0,
              "keep_checkpoints": 0, "data_workers": 0, "num_proc": 0, "seed": 0, "replica_check_steps": 0,
              "eval_steps": 1, "eval_max_sequences": 1}
    problems = [f"--{name.replace('_', '-')} {problem}" for name, least in floors.items()
                if getattr(args, name) is not None and (problem := out_of_range(getattr(args, name), least))]
    if problem := step_timeout_problem(args.step_timeout):
        problems.append(problem)
    if args.model is not None:
        try:
            check_preset(args.model)
        except UserError as err:
            problems.append(str(err))
    problems += masking_problems(args)
    if args.max_predictions is not None and not 1 <= args.max_predictions <= args.seq_len:
        problems.append(f"--max-predictions {args.max_predictions} must be between 1 and --seq-len {args.seq_len}")
    if args.seq_len > MAX_POSITIONS:
        problems.append(f"--seq-len {args.seq_len} is beyond the model's {MAX_POSITIONS} positions; use "
                        f"{MAX_POSITIONS} "
                        "or less")
    if args.dropout is not None and (problem := out_of_range(args.dropout, 0, 1, high_open=True)):
        problems.append(f"--dropout {problem}")
    if args.lr is not None and (problem := out_of_range(args.lr, 0, low_open=True)):
        problems.append(f"--lr {problem}")
    if problem := out_of_range(args.sr_weight, 0):
        problems.append(f"--sr-weight {problem}")
    if args.cache_dir is not None:  # (--output-dir: preflight.path_problems)
        try:
            check_output_path(args.cache_dir, "--cache-dir")
        except UserError as err:
            problems.append(str(err))
    if args.sr_sent_target is not None and _is_electra_run(args):
        problems.append(f"--sr-sent-target {args.sr_sent_target} is for BERT: ELECTRA's --sr sent always encodes the "
                        "original sentence (its discriminator never sees [MASK]); drop the flag")
    if args.init_generator and not args.init_from:
        problems.append("--init-generator is the generator beside --init-from's discriminator: pass --init-from too")
    elif args.init_generator and args.model is not None and not is_electra(args.model):
        problems.append(f"--init-generator makes an ELECTRA run, --model {args.model} a BERT one; drop one of them")
    if args.new_head and not args.init_from:
        problems.append("--new-head starts the MLM head a checkpoint lacks: pass --init-from the checkpoint")
    elif args.new_head and _is_electra_run(args):
        problems.append("--new-head starts a BERT's MLM head; ELECTRA's generator is its MLM: drop --new-head")
    problems += head_stage_problems(args)
    if args.peak_tflops is not None and (problem := out_of_range(args.peak_tflops, 0, low_open=True)):
        problems.append(f"--peak-tflops {problem}")
    problems += profile_problems(args.profile_steps, args.profile_ranks, args.max_steps)
    if not args.eval_data and (args.eval_steps is not None or args.eval_max_sequences is not None
                               or args.eval_synonyms is not None):
        problems.append("--eval-steps, --eval-max-sequences and --eval-synonyms set the held-out evaluation: pass "
                        "--eval-data too")
    elif args.eval_synonyms is not None and not (args.eval_synonyms.endswith(".npz")
                                                 and Path(args.eval_synonyms).is_file()):
        problems.append(f"--eval-synonyms {args.eval_synonyms} is not a table file: pass a FILE.npz built by "
                        "`truneg synonyms build`")
    if args.phase1_checkpoint:
        clash = [flag for flag, given in (("--init-from", args.init_from), ("--init-generator", args.init_generator),
                                          ("--new-head", args.new_head),
                                          (f"--resume {args.resume}", args.resume not in ("auto", "none"))) if given]
        if clash:
            problems.append(f"--phase1-checkpoint starts phase 2 from a phase-1 checkpoint, {clash[0]} from another "
                            f"start; drop {clash[0].split()[0]} (the same command resumes phase 2)")
    elif args.reset_optimizer:
        problems.append("--reset-optimizer empties the moments phase 2 carries from --phase1-checkpoint: pass that too")
    if args.overwrite and args.resume not in ("auto", "none"):  # it would start afresh, the checkpoint unread
        problems.append(f"--overwrite starts afresh, --resume {args.resume} continues a checkpoint: to continue it in "
                        "a folder that holds another run, choose an empty --output-dir instead")
    return problems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    problems = argument_problems(args)
    if problems:
        raise UserError(problems[0])
    return args
