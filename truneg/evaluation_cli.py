"""Sub-commands of `truneg` for evaluation: fine-tuning, robustness and the ablation runner."""
from __future__ import annotations

import json


def _finetune_glue(args) -> None:
    from truneg.glue import finetune

    results = finetune(args.task, args.model, args.data_dir, args.output_dir, epochs=args.epochs, lr=args.lr,
                       batch_size=args.batch_size, max_seq_len=args.max_seq_len, max_train_samples=args.max_train_samples,
                       seed=args.seed, layerwise_decay=args.layerwise_decay, deepspeed_config=args.deepspeed_config)
    print(json.dumps(results, indent=2))


def _finetune_squad(args) -> None:
    from truneg.squad import finetune_squad

    results = finetune_squad(args.model, args.train, args.dev, args.output_dir, epochs=args.epochs, lr=args.lr,
                             batch_size=args.batch_size, max_seq_len=args.max_seq_len, doc_stride=args.doc_stride,
                             max_train_samples=args.max_train_samples, max_eval_samples=args.max_eval_samples,
                             seed=args.seed, layerwise_decay=args.layerwise_decay)
    print(json.dumps(results, indent=2))


def _robustness_swap(args) -> None:
    from truneg.robustness import evaluate_glue

    print(json.dumps(evaluate_glue(args.task, args.model, args.data_dir, args.output_dir, args.seed,
                                   args.max_eval_samples), indent=2))


def _robustness_add_sent(args) -> None:
    from truneg.robustness import evaluate_squad

    print(json.dumps(evaluate_squad(args.model, args.dev, args.output_dir, args.seed, args.max_eval_samples), indent=2))


def add_commands(commands) -> None:
    finetune = commands.add_parser("finetune", help="fine-tune and evaluate an exported model").add_subparsers(
        dest="benchmark", required=True)
    glue = finetune.add_parser("glue", help="a GLUE task from GLUE's TSV files")
    glue.add_argument("--task", required=True, help="cola | sst2 | mrpc | stsb | qqp | mnli | qnli | rte")
    glue.add_argument("--model", required=True, help="an exported truneg folder or any HF BERT/ELECTRA folder")
    glue.add_argument("--data-dir", required=True, help="the task's folder with train.tsv and dev.tsv")
    glue.add_argument("--output-dir", required=True)
    glue.add_argument("--epochs", type=int, help="default: 3, or 10 for RTE and STS-B (ELECTRA's)")
    glue.add_argument("--lr", type=float, default=1e-4)
    glue.add_argument("--batch-size", type=int, default=32)
    glue.add_argument("--max-seq-len", type=int, default=128)
    glue.add_argument("--max-train-samples", type=int)
    glue.add_argument("--seed", type=int, default=42)
    glue.add_argument("--layerwise-decay", type=float, default=0.8, help="ELECTRA's layer-wise lr decay; 1 turns it off")
    glue.add_argument("--deepspeed_config", help="run the loop through a DeepSpeed engine (GPUs)")
    glue.set_defaults(func=_finetune_glue)
    squad = finetune.add_parser("squad", help="SQuAD v1.1: exact match and F1")
    squad.add_argument("--model", required=True, help="an exported truneg folder or any HF BERT/ELECTRA folder")
    squad.add_argument("--train", required=True, help="SQuAD v1.1 training JSON")
    squad.add_argument("--dev", required=True, help="SQuAD v1.1 dev JSON")
    squad.add_argument("--output-dir", required=True)
    squad.add_argument("--epochs", type=int, default=2)
    squad.add_argument("--lr", type=float, default=1e-4)
    squad.add_argument("--batch-size", type=int, default=32)
    squad.add_argument("--max-seq-len", type=int, default=384)
    squad.add_argument("--doc-stride", type=int, default=128)
    squad.add_argument("--max-train-samples", type=int)
    squad.add_argument("--max-eval-samples", type=int)
    squad.add_argument("--seed", type=int, default=42)
    squad.add_argument("--layerwise-decay", type=float, default=0.8)
    squad.set_defaults(func=_finetune_squad)

    robustness = commands.add_parser("robustness", help="scores under synonym swaps and distractors (paper Table 5)")
    attacks = robustness.add_subparsers(dest="attack", required=True)
    swap = attacks.add_parser("swap-syn", help="TextFlint's SwapSynWordNet on a GLUE dev set")
    swap.add_argument("--task", required=True)
    swap.add_argument("--model", required=True, help="a fine-tuned classifier (finetune glue's OUTPUT/model)")
    swap.add_argument("--data-dir", required=True)
    swap.add_argument("--output-dir", required=True)
    swap.add_argument("--seed", type=int, default=42)
    swap.add_argument("--max-eval-samples", type=int)
    swap.set_defaults(func=_robustness_swap)
    add_sent = attacks.add_parser("add-sent", help="an AddSentDiverse-style distractor on SQuAD dev")
    add_sent.add_argument("--model", required=True, help="a fine-tuned QA model (finetune squad's OUTPUT/model)")
    add_sent.add_argument("--dev", required=True)
    add_sent.add_argument("--output-dir", required=True)
    add_sent.add_argument("--seed", type=int, default=42)
    add_sent.add_argument("--max-eval-samples", type=int)
    add_sent.set_defaults(func=_robustness_add_sent)

    from truneg.ablation import add_command

    add_command(commands)
