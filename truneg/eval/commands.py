"""Sub-commands of `truneg` for evaluation: eval, fn-stats, fn-cases, finetune, robustness, ablation and report.

Each command imports its module when it runs: `truneg --help` and the parse stay free of torch and transformers.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from truneg.errors import UserError, float_between, int_at_least
from truneg.eval import ablation_args
from truneg.eval.seeds import parse_seeds

DEEPSPEED_HELP = ("train through HF Trainer's DeepSpeed integration (ZeRO, precision); the config's optimizer and "
                  "scheduler sections are ignored: the recipe's layer-wise AdamW groups and warmup stay")


def _recipe(args, benchmark: str) -> dict:
    """The recipe's flags: those given, the rest from the model's published recipe by family and size."""
    from truneg.eval.glue import resolve_model_dir
    from truneg.eval.recipes import FIELDS, fill, model_recipe

    recipe = model_recipe(resolve_model_dir(args.model), benchmark, args.recipe)
    values = fill({k: getattr(args, k) for k in FIELDS if hasattr(args, k)}, recipe)
    print(f"truneg: recipe: {', '.join(f'{k} {v}' for k, v in values.items())} (defaults: {recipe.source})",
          file=sys.stderr, flush=True)
    return values


def _over_seeds(args, run_one) -> dict:
    """One run into --output-dir (--seed), or one per seed into --output-dir/seed-N and their median (--seeds)."""
    from truneg.eval.seeds import run_seeds

    if args.seeds:
        return run_seeds(run_one, args.seeds, Path(args.output_dir), expect=run_one.recipe)
    return run_one(args.seed, Path(args.output_dir))


def _finetune_glue(args) -> None:
    from truneg.eval.glue import TASKS, finetune

    with contextlib.redirect_stdout(sys.stderr):  # stdout: the results alone (DeepSpeed prints its op builds there)
        recipe = _recipe(args, "glue")

        def run_one(seed: int, out: Path) -> dict:
            return finetune(args.task, args.model, args.data_dir, out, max_train_samples=args.max_train_samples,
                            seed=seed, deepspeed_config=args.deepspeed_config, **recipe)

        run_one.recipe = {"task": args.task, **recipe, "max_train_samples": args.max_train_samples}
        if recipe.get("epochs") is None and args.task in TASKS:  # the task's own, as results.json records it
            run_one.recipe["epochs"] = TASKS[args.task].epochs
        results = _over_seeds(args, run_one)
    print(json.dumps(results, indent=2))


def _finetune_squad(args) -> None:
    from truneg.eval.squad import finetune_squad

    with contextlib.redirect_stdout(sys.stderr):
        recipe = _recipe(args, "squad")

        def run_one(seed: int, out: Path) -> dict:
            return finetune_squad(args.model, args.train, args.dev, out, max_train_samples=args.max_train_samples,
                                  max_eval_samples=args.max_eval_samples, seed=seed,
                                  deepspeed_config=args.deepspeed_config, **recipe)

        run_one.recipe = {**recipe, "max_train_samples": args.max_train_samples}
        results = _over_seeds(args, run_one)
    print(json.dumps(results, indent=2))


def _robustness_swap(args) -> None:
    from truneg.eval.robustness import evaluate_glue

    if args.task == "squad":
        if not args.dev or args.data_dir:
            raise UserError("swap-syn --task squad takes --dev FILE (SQuAD v1.1 dev JSON), not --data-dir")
        return _robustness_squad(args, "swap-syn")
    if not args.data_dir or args.dev or args.doc_stride is not None:
        raise UserError(f"swap-syn --task {args.task} takes --data-dir (the task's GLUE folder), not --dev or "
                        "--doc-stride (those are for --task squad)")
    print(json.dumps(evaluate_glue(args.task, args.model, args.data_dir, args.output_dir, args.seed,
                                   args.max_eval_samples, max_seq_len=args.max_seq_len or 128), indent=2))


def _robustness_squad(args, attack: str) -> None:
    from truneg.eval.robustness import evaluate_squad

    print(json.dumps(evaluate_squad(args.model, args.dev, args.output_dir, args.seed, args.max_eval_samples,
                                    max_seq_len=args.max_seq_len or 384, doc_stride=args.doc_stride or 128,
                                    attack=attack), indent=2))


def _common(parser) -> None:
    parser.add_argument("--data", nargs="+", required=True, help="text files, folders or globs to run the MLM over")
    parser.add_argument("--synonyms", type=Path,
                        help="synonym table (default: WordNet's for the tokenizer's vocab, the shipped table for "
                             "bert-base-uncased's)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.set_defaults(output_paths=[("out", "--out", True)])  # checked by cli.main, before the checkpoints run
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, [CLS] and [SEP] included")
    parser.add_argument("--segmentation", choices=["packed", "line", "article"], default="packed",
                        help="packed: blocks cut across lines and articles, as pre-training packs them; line / "
                             "article: no sequence crosses a line / an article (WikiText ` = Title = ` or a file), "
                             "padded. The paper's Table 2 does not say; see docs/evaluation.md")
    parser.add_argument("--seed", type=int, default=0, help="masking and sampling seed")
    parser.add_argument("--prediction", choices=["default", "argmax", "sample"], default="default",
                        help="default: argmax for BERT, the generator's sample for ELECTRA (as in training)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=32, help="sequences per forward (default 32)")
    parser.add_argument("--max-sequences", type=int_at_least(1), help="stop after this many sequences")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoints' own, else bert-base-uncased)")


def _prepare(args, refs):
    from truneg.eval.checkpoints import checkpoints_tokenizer
    from truneg.eval.false_negatives import open_sequences
    from truneg.synonyms.table import SynonymLookup
    from truneg.train.build import eval_table

    tokenizer = checkpoints_tokenizer(refs, args.tokenizer)
    table = eval_table(tokenizer, args.synonyms)  # a run's default: WordNet's for its vocab
    blocks = open_sequences(args.data, tokenizer, args.seq_len, args.segmentation)
    return tokenizer, table, SynonymLookup(table), blocks


def _fn_stats(args) -> None:
    from truneg.eval.checkpoints import discover_checkpoints, load_mlm
    from truneg.eval.false_negatives import evaluate, format_table, write_stats

    refs = discover_checkpoints(args.checkpoints)
    tokenizer, _, lookup, blocks = _prepare(args, refs)
    results = []
    for ref in refs:
        counts, _ = evaluate(load_mlm(ref), blocks, tokenizer, lookup, args.prediction, args.seed, args.batch_size,
                             args.max_sequences, label=ref.label, step=ref.step)
        counts.segmentation, counts.seq_len = args.segmentation, args.seq_len
        results.append(counts)
        print(f"{ref.label}: {counts.corrected} false negatives", flush=True)
    print(format_table(results))
    for path in write_stats(results, args.out).values():
        print(f"wrote {path}")


def _fn_cases(args) -> None:
    from truneg.eval.checkpoints import discover_checkpoints, load_mlm
    from truneg.eval.false_negatives import evaluate, write_cases

    refs = discover_checkpoints([args.checkpoint])
    if len(refs) != 1:
        refs = refs[-1:]  # a checkpoints folder: its newest tag
    tokenizer, table, lookup, blocks = _prepare(args, refs)
    counts, cases = evaluate(load_mlm(refs[0]), blocks, tokenizer, lookup, args.prediction, args.seed,
                             args.batch_size, args.max_sequences, label=refs[0].label, step=refs[0].step,
                             max_cases=args.n, table=table)
    written = write_cases(cases, args.out)
    print(f"{len(cases)} cases of {counts.corrected} false negatives in {counts.sequences} sequences")
    for path in written.values():
        print(f"wrote {path}")


def _eval(args) -> None:
    from truneg.eval.heldout_eval import evaluate_checkpoints
    from truneg.train.config.run_config import EVAL_MAX_SEQUENCES

    evaluate_checkpoints(args.path, args.data, args.generator, args.seq_len,
                         args.eval_max_sequences or EVAL_MAX_SEQUENCES, args.synonyms, args.tokenizer, args.batch_size,
                         args.out)


def _add_eval(commands) -> None:
    parser = commands.add_parser("eval", help="a checkpoint's held-out figures, as a run's --eval-data evaluates them")
    parser.add_argument("path", metavar="PATH", help="a truneg checkpoint tag, a checkpoints folder (each tag), an "
                        "exported folder, or a model name of the HF hub (NAME[@REVISION]; an ELECTRA discriminator)")
    parser.add_argument("generator", metavar="GENERATOR", nargs="?",
                        help="ELECTRA's generator beside a discriminator PATH, as --init-generator takes it")
    parser.add_argument("--data", nargs="+", required=True,
                        help="held-out text: the forms of pretrain.py's --train-data (prepared and cached alike)")
    parser.add_argument("--seq-len", type=int_at_least(8), default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--eval-max-sequences", type=int_at_least(1),
                        help="the first N sequences of --data (default: pretrain.py's --eval-max-sequences default)")
    parser.add_argument("--out", type=Path, help="write the figures to this JSON file (a list, one record a model)")
    parser.add_argument("--synonyms", help="the false negatives' table (default: the run's --eval-synonyms table saved "
                        "beside its checkpoints, else the shipped WordNet table, as a run's live evaluation counts)")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoint's own, else bert-base-uncased)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=32, help="sequences per forward (default 32; "
                        "the run's --micro-batch-size gives its live figures' shapes, so the same figures on the CPU)")
    parser.set_defaults(func=_eval, output_paths=[("out", "--out", False)])


def _add_analysis(commands) -> None:
    stats = commands.add_parser("fn-stats", help="false-negative ratios per checkpoint (paper Table 2)")
    stats.add_argument("--checkpoints", nargs="+", required=True,
                       help="truneg checkpoints folders (every tag), tags, exported folders (BERT's MLM, ELECTRA's "
                            "generator), or hub names")
    _common(stats)
    stats.set_defaults(func=_fn_stats)
    cases = commands.add_parser("fn-cases", help="dump corrected examples (paper Figure 3 / Table 1)")
    cases.add_argument("--checkpoint", required=True,
                       help="a tag, a checkpoints folder (its newest tag), an exported folder or a hub name")
    cases.add_argument("-n", type=int_at_least(0), default=20, help="number of cases")
    _common(cases)
    cases.set_defaults(func=_fn_cases)


def _ablation(args) -> None:
    from truneg.eval.ablation import run_ablation

    run_ablation(args)


def _report(args) -> None:
    from truneg.eval.report import report

    command = " ".join(["truneg report", *args.results, "--out", str(args.out)] +
                       (["--tasks", args.tasks] if args.tasks else []) +
                       (["--baseline", args.baseline] if args.baseline != "baseline" else []))
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    for path in report(args.results, args.out, tasks, args.baseline, command):
        if path.suffix == ".md":
            print(path.read_text(encoding="utf-8"))
        print(f"wrote {path}")


def _add_report(commands) -> None:
    parser = commands.add_parser("report", help="the paper's Tables 3 / 6 (GLUE) and 2 (false negatives) from "
                                 "results.json, ablation.json and fn_stats.json files")
    parser.add_argument("results", nargs="+", metavar="RESULTS_DIR",
                        help="folders searched for result files; NAME=DIR names the variant of a folder's results "
                             "(else: the folder under DIR they sit in, or DIR's name)")
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for glue.md/.csv/_deltas.png and false_negatives.md/.csv/.png")
    parser.add_argument("--tasks", help="GLUE tasks of the table, comma-separated (default: ablation.json's, else "
                                        "all eight); a task without a result shows as missing")
    parser.add_argument("--baseline", default="baseline", help="the variant the deltas are taken against")
    parser.set_defaults(func=_report, output_paths=[("out", "--out", True)])


def _add_io(parser, model_help: str, seeds: bool = False) -> None:
    """Flags every fine-tuning and robustness command takes (fine-tuning: --seed or --seeds)."""
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--output-dir", required=True, help="folder for results.json and what the run writes")
    seed = parser.add_mutually_exclusive_group() if seeds else parser
    seed.add_argument("--seed", type=int, default=42, help="one run, into --output-dir (default 42)" if seeds else
                      "the seed of the transformation's random choices (default 42)")
    if seeds:
        seed.add_argument("--seeds", type=parse_seeds, metavar="S1,S2,...",
                          help="one run per seed, each into --output-dir/seed-S (one already done is skipped); "
                               "results.json gives each seed's metrics and their median (the reported number), "
                               "mean and standard deviation")
    parser.set_defaults(output_paths=[("output_dir", "--output-dir", True)])  # checked by cli.main, before any work


def _add_scoring(parser, max_seq_len_help: str) -> None:
    """Flags of the robustness commands' scoring: score with the fine-tuning's lengths."""
    parser.add_argument("--max-seq-len", type=int_at_least(8),
                        help=f"as the model was fine-tuned with ({max_seq_len_help})")
    parser.add_argument("--doc-stride", type=int_at_least(1),
                        help="SQuAD: as the model was fine-tuned with (default 128)")
    parser.add_argument("--max-eval-samples", type=int_at_least(1), help="score the first N dev examples only")


RECIPE_HELP = "default: the model's recipe by family and size (docs/evaluation.md#recipes)"


def _add_recipe(parser, epochs_help: str) -> None:
    """The fine-tuning recipe's flags (glue and squad); a flag not given takes the model's published recipe."""
    parser.add_argument("--recipe", choices=["auto", "electra", "bert", "roberta"], default="auto",
                        help="whose published recipe sets the flags not given: auto (ELECTRA's for an ELECTRA, "
                             "RoBERTa's for a RoBERTa or XLM-R, BERT's for the rest), electra, bert or roberta; the "
                             "size comes from the model's hidden size")
    parser.add_argument("--epochs", type=int_at_least(0), help=epochs_help)
    parser.add_argument("--lr", type=float_between(0), help=f"peak learning rate ({RECIPE_HELP})")
    parser.add_argument("--batch-size", type=int_at_least(1), help=RECIPE_HELP)
    parser.add_argument("--max-seq-len", type=int_at_least(8), help=RECIPE_HELP)
    parser.add_argument("--warmup-ratio", type=float_between(0, 1), help=f"linear warmup's share of the steps "
                        f"({RECIPE_HELP})")
    parser.add_argument("--max-train-samples", type=int_at_least(1), help="train on the first N examples")
    parser.add_argument("--layerwise-decay", type=float_between(0, 1),
                        help=f"ELECTRA's layer-wise lr decay, in (0, 1]; 1 turns it off ({RECIPE_HELP})")
    parser.add_argument("--deepspeed_config", help=DEEPSPEED_HELP)


def add_commands(commands) -> None:
    _add_eval(commands)
    _add_analysis(commands)
    finetune = commands.add_parser("finetune", help="fine-tune and evaluate an exported model").add_subparsers(
        dest="benchmark", required=True)
    exported = "an exported truneg folder, any HF BERT/ELECTRA folder, or a model name of the HF hub (NAME[@REVISION])"
    glue = finetune.add_parser("glue", help="a GLUE task from GLUE's TSV files")
    glue.add_argument("--task", required=True, help="cola | sst2 | mrpc | stsb | qqp | mnli | qnli | rte")
    glue.add_argument("--data-dir", required=True, help="the task's folder with train.tsv and dev.tsv")
    _add_io(glue, exported, seeds=True)
    _add_recipe(glue, "ELECTRA's recipe: 3, or 10 for RTE and STS-B; BERT's: 3 (4 small); 0 scores the untrained "
                "model")
    glue.set_defaults(func=_finetune_glue)
    squad = finetune.add_parser("squad", help="SQuAD v1.1: exact match and F1")
    squad.add_argument("--train", required=True, help="SQuAD v1.1 training JSON")
    squad.add_argument("--dev", required=True, help="SQuAD v1.1 dev JSON")
    _add_io(squad, exported, seeds=True)
    _add_recipe(squad, "ELECTRA's recipe: 2; BERT's: 3 (4 small)")
    squad.add_argument("--doc-stride", type=int_at_least(1),
                       help="tokens that consecutive windows of a long context share (the HF tokenizer's stride; "
                            f"{RECIPE_HELP}: 128)")
    squad.add_argument("--max-eval-samples", type=int_at_least(1), help="score the first N dev questions only")
    squad.set_defaults(func=_finetune_squad)

    robustness = commands.add_parser("robustness", help="scores under synonym swaps and distractors (paper Table 5)")
    attacks = robustness.add_subparsers(dest="attack", required=True)
    swap = attacks.add_parser("swap-syn", help="TextFlint's SwapSynWordNet on SQuAD dev or a GLUE dev set")
    swap.add_argument("--task", required=True, help="squad (with --dev), or a GLUE task (with --data-dir)")
    swap.add_argument("--data-dir", help="the GLUE task's folder with dev.tsv")
    swap.add_argument("--dev", help="SQuAD v1.1 dev JSON (--task squad)")
    _add_io(swap, "a fine-tuned model (finetune glue's or squad's OUTPUT/model, or a hub name)")
    _add_scoring(swap, "default: the fine-tuning's, 128 for GLUE, 384 for SQuAD")
    swap.set_defaults(func=_robustness_swap)
    add_sent = attacks.add_parser("add-sent", help="TextFlint's AddSentDiverse (without CoreNLP) on SQuAD dev")
    add_sent.add_argument("--dev", required=True, help="SQuAD v1.1 dev JSON")
    _add_io(add_sent, "a fine-tuned QA model (finetune squad's OUTPUT/model, or a hub name)")
    _add_scoring(add_sent, "default: the fine-tuning's, 384")
    add_sent.set_defaults(func=lambda args: _robustness_squad(args, "add-sent"))

    _add_ablation(commands)
    _add_report(commands)


def _add_ablation(commands) -> None:
    ablation_args.add_parser(commands, _ablation)
