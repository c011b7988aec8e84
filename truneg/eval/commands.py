"""Sub-commands of `truneg` for evaluation: fn-stats, fn-cases, finetune, robustness and ablation.

Each command imports its module when it runs: `truneg --help` and the parse stay free of torch and transformers.
"""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from truneg.data.blocks import DEMO_CORPUS
from truneg.errors import UserError, float_between, int_at_least

DEEPSPEED_HELP = ("train through HF Trainer's DeepSpeed integration (ZeRO, precision); the config's optimizer and "
                  "scheduler sections are ignored: the recipe's layer-wise AdamW groups and warmup stay")


def _finetune_glue(args) -> None:
    from truneg.eval.glue import finetune

    with contextlib.redirect_stdout(sys.stderr):  # stdout: the results alone (DeepSpeed prints its op builds there)
        results = finetune(args.task, args.model, args.data_dir, args.output_dir, epochs=args.epochs, lr=args.lr,
                           batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                           max_train_samples=args.max_train_samples, seed=args.seed,
                           layerwise_decay=args.layerwise_decay, deepspeed_config=args.deepspeed_config)
    print(json.dumps(results, indent=2))


def _finetune_squad(args) -> None:
    from truneg.eval.squad import finetune_squad

    with contextlib.redirect_stdout(sys.stderr):
        results = finetune_squad(args.model, args.train, args.dev, args.output_dir, epochs=args.epochs, lr=args.lr,
                                 batch_size=args.batch_size, max_seq_len=args.max_seq_len, doc_stride=args.doc_stride,
                                 max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
                                 seed=args.seed, layerwise_decay=args.layerwise_decay,
                                 deepspeed_config=args.deepspeed_config)
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
    parser.add_argument("--synonyms", type=Path, help="synonym table (default: the shipped WordNet table)")
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
    parser.add_argument("--batch-size", type=int_at_least(1), default=32)
    parser.add_argument("--max-sequences", type=int_at_least(1), help="stop after this many sequences")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoints' own, else bert-base-uncased)")


def _prepare(args, refs):
    from truneg.data.blocks import load_tokenizer
    from truneg.eval.false_negatives import checkpoints_tokenizer, open_sequences
    from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else checkpoints_tokenizer(refs)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = SynonymTable.load(args.synonyms or SHIPPED_WORDNET_TABLE, expect_tokens=tokens)
    blocks = open_sequences(args.data, tokenizer, args.seq_len, args.segmentation)
    return tokenizer, table, SynonymLookup(table), blocks


def _fn_stats(args) -> None:
    from truneg.eval.false_negatives import (
        discover_checkpoints,
        evaluate,
        format_table,
        load_mlm,
        write_stats,
    )

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
    from truneg.eval.false_negatives import discover_checkpoints, evaluate, load_mlm, write_cases

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


def _add_analysis(commands) -> None:
    stats = commands.add_parser("fn-stats", help="false-negative ratios per checkpoint (paper Table 2)")
    stats.add_argument("--checkpoints", nargs="+", required=True,
                       help="truneg checkpoints folders (every tag), tags, or exported HF MLM / generator folders")
    _common(stats)
    stats.set_defaults(func=_fn_stats)
    cases = commands.add_parser("fn-cases", help="dump corrected examples (paper Figure 3 / Table 1)")
    cases.add_argument("--checkpoint", required=True, help="a tag, a checkpoints folder (its newest tag) or an HF folder")
    cases.add_argument("-n", type=int_at_least(0), default=20, help="number of cases")
    _common(cases)
    cases.set_defaults(func=_fn_cases)


def _ablation(args) -> None:
    from truneg.eval.ablation import run_ablation

    run_ablation(args)


def _add_io(parser, model_help: str) -> None:
    """Flags every fine-tuning and robustness command takes."""
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--seed", type=int, default=42)
    parser.set_defaults(output_paths=[("output_dir", "--output-dir", True)])  # checked by cli.main, before any work


def _add_scoring(parser, max_seq_len_help: str) -> None:
    """Flags of the robustness commands' scoring: score with the fine-tuning's lengths."""
    parser.add_argument("--max-seq-len", type=int_at_least(8), help=f"as the model was fine-tuned with ({max_seq_len_help})")
    parser.add_argument("--doc-stride", type=int_at_least(1), help="SQuAD: as the model was fine-tuned with (default 128)")
    parser.add_argument("--max-eval-samples", type=int_at_least(1))


def _add_recipe(parser, epochs: int | None, epochs_help: str | None, max_seq_len: int) -> None:
    """The fine-tuning recipe's flags (glue and squad)."""
    parser.add_argument("--epochs", type=int_at_least(0), default=epochs, help=epochs_help)
    parser.add_argument("--lr", type=float_between(0), default=1e-4)
    parser.add_argument("--batch-size", type=int_at_least(1), default=32)
    parser.add_argument("--max-seq-len", type=int_at_least(8), default=max_seq_len)
    parser.add_argument("--max-train-samples", type=int_at_least(1), help="train on the first N examples")
    parser.add_argument("--layerwise-decay", type=float_between(0, 1), default=0.8,
                        help="ELECTRA's layer-wise lr decay, in (0, 1]; 1 turns it off")
    parser.add_argument("--deepspeed_config", help=DEEPSPEED_HELP)


def add_commands(commands) -> None:
    _add_analysis(commands)
    finetune = commands.add_parser("finetune", help="fine-tune and evaluate an exported model").add_subparsers(
        dest="benchmark", required=True)
    exported = "an exported truneg folder or any HF BERT/ELECTRA folder"
    glue = finetune.add_parser("glue", help="a GLUE task from GLUE's TSV files")
    glue.add_argument("--task", required=True, help="cola | sst2 | mrpc | stsb | qqp | mnli | qnli | rte")
    glue.add_argument("--data-dir", required=True, help="the task's folder with train.tsv and dev.tsv")
    _add_io(glue, exported)
    _add_recipe(glue, None, "default: 3, or 10 for RTE and STS-B (ELECTRA's); 0 scores the untrained model", 128)
    glue.set_defaults(func=_finetune_glue)
    squad = finetune.add_parser("squad", help="SQuAD v1.1: exact match and F1")
    squad.add_argument("--train", required=True, help="SQuAD v1.1 training JSON")
    squad.add_argument("--dev", required=True, help="SQuAD v1.1 dev JSON")
    _add_io(squad, exported)
    _add_recipe(squad, 2, None, 384)
    squad.add_argument("--doc-stride", type=int_at_least(1), default=128,
                       help="tokens that consecutive windows of a long context share (the HF tokenizer's stride)")
    squad.add_argument("--max-eval-samples", type=int_at_least(1))
    squad.set_defaults(func=_finetune_squad)

    robustness = commands.add_parser("robustness", help="scores under synonym swaps and distractors (paper Table 5)")
    attacks = robustness.add_subparsers(dest="attack", required=True)
    swap = attacks.add_parser("swap-syn", help="TextFlint's SwapSynWordNet on SQuAD dev or a GLUE dev set")
    swap.add_argument("--task", required=True, help="squad (with --dev), or a GLUE task (with --data-dir)")
    swap.add_argument("--data-dir", help="the GLUE task's folder with dev.tsv")
    swap.add_argument("--dev", help="SQuAD v1.1 dev JSON (--task squad)")
    _add_io(swap, "a fine-tuned model (finetune glue's or squad's OUTPUT/model)")
    _add_scoring(swap, "default: the fine-tuning's, 128 for GLUE, 384 for SQuAD")
    swap.set_defaults(func=_robustness_swap)
    add_sent = attacks.add_parser("add-sent", help="TextFlint's AddSentDiverse (without CoreNLP) on SQuAD dev")
    add_sent.add_argument("--dev", required=True, help="SQuAD v1.1 dev JSON")
    _add_io(add_sent, "a fine-tuned QA model (finetune squad's OUTPUT/model)")
    _add_scoring(add_sent, "default: the fine-tuning's, 384")
    add_sent.set_defaults(func=lambda args: _robustness_squad(args, "add-sent"))

    _add_ablation(commands)


def _add_ablation(commands) -> None:
    parser = commands.add_parser("ablation", help="baseline / HC / SR / HC+SR pre-training, then GLUE (paper Tables 3, 6)")
    parser.add_argument("--preset", default="bert-tiny", help="the model preset every variant pre-trains")
    parser.add_argument("--tasks", default="rte,mrpc", help="GLUE tasks to fine-tune on, comma-separated")
    parser.add_argument("--steps", type=int_at_least(1), default=300, help="pre-training steps of each variant")
    parser.add_argument("--train-data", nargs="+", default=[str(DEMO_CORPUS)], help="pre-training corpus")
    parser.add_argument("--glue-dir", default=str(Path(__file__).resolve().parents[3] / "shared" / "data" / "glue"),
                        help="GLUE's task folders (RTE/, MRPC/, ...; default: ../shared/data/glue beside this repo)")
    parser.add_argument("--output-dir", default="runs/ablation")
    parser.add_argument("--num-gpus", type=int_at_least(1), default=2, help="ranks per node (CPU ranks on a machine without GPUs)")
    parser.add_argument("--master-port", type=int, default=29511)
    parser.add_argument("--deepspeed_config")
    parser.add_argument("--init-from", help="continue each variant's pre-training from this HF checkpoint, as the paper "
                        "did from public ones (ELECTRA: a folder with generator/ and discriminator/)")
    parser.add_argument("--micro-batch-size", type=int_at_least(1))
    parser.add_argument("--seq-len", type=int_at_least(3), default=128)
    parser.add_argument("--seed", type=int_at_least(0), default=42)
    parser.add_argument("--epochs", type=int_at_least(0), help="fine-tuning epochs (default: ELECTRA's per task)")
    parser.add_argument("--lr", type=float_between(0), default=1e-4, help="fine-tuning learning rate")
    parser.add_argument("--batch-size", type=int_at_least(1), default=32, help="fine-tuning batch size")
    parser.add_argument("--max-train-samples", type=int_at_least(1), help="fine-tune on the first N training examples")
    parser.set_defaults(func=_ablation)
