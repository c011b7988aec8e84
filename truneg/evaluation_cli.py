"""Sub-commands of `truneg` for evaluation: `finetune glue` (and, as they land, SQuAD and robustness)."""
from __future__ import annotations

import json


def _finetune_glue(args) -> None:
    from truneg.glue import finetune

    results = finetune(args.task, args.model, args.data_dir, args.output_dir, epochs=args.epochs, lr=args.lr,
                       batch_size=args.batch_size, max_seq_len=args.max_seq_len, max_train_samples=args.max_train_samples,
                       seed=args.seed, layerwise_decay=args.layerwise_decay, deepspeed_config=args.deepspeed_config)
    print(json.dumps(results, indent=2))


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
