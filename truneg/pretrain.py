"""Pre-train BERT (MLM) or ELECTRA (RTD) on DeepSpeed, with the paper's hard correction and soft regularization.

    deepspeed truneg/pretrain.py                                  # electra-tiny on the shipped corpus
    deepspeed --num_gpus 2 truneg/pretrain.py --model bert-tiny --hc wordnet --sr word
    deepspeed --hostfile launch/hosts truneg/pretrain.py --model bert-large \\
        --deepspeed_config ds_configs/bert_large_v100_fp16_zero2.json --train-data /data/corpus

Output (under --output-dir): checkpoints/ (DeepSpeed's layout, `latest`), tensorboard/, metrics.jsonl.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script by the deepspeed launcher: import truneg from the repo, and keep this folder's
    # module names (data, models, ...) from shadowing installed packages.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import argparse
import os

from truneg.errors import UserError, exit_on_user_error

DEFAULT_OUTPUT_DIR = "runs/pretrain"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import deepspeed

    from truneg.data import DEFAULT_TOKENIZER, DEMO_CORPUS
    from truneg.models import MAX_POSITIONS, PRESETS, check_preset

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="electra-tiny", help=f"preset: {', '.join(PRESETS)}")
    parser.add_argument("--train-data", nargs="+", default=[str(DEMO_CORPUS)],
                        help="text files, folders or globs (blank lines separate documents), or hf:NAME[:CONFIG][@SPLIT]#COLUMN")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer folder (default: bert-base-uncased)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--save-steps", type=int, default=100, help="0: no checkpoints (benchmarks)")
    parser.add_argument("--log-steps", type=int, default=10)
    parser.add_argument("--output-dir", type=Path, default=Path(DEFAULT_OUTPUT_DIR))
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--init-from", help="continue pre-training from an HF checkpoint folder")
    parser.add_argument("--resume", default="auto", help="auto (latest checkpoint in --output-dir, if any) | none | DIR")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in an --output-dir that holds another run")
    parser.add_argument("--micro-batch-size", type=int, help="override train_micro_batch_size_per_gpu")
    parser.add_argument("--gradient-accumulation-steps", type=int, help="override gradient_accumulation_steps")
    parser.add_argument("--lr", type=float, help="override the optimizer's (and the warmup's peak) learning rate")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--hc", default="none", help="hard correction: none | wordnet | embedding | FILE.npz")
    parser.add_argument("--hc-embeddings", help="for --hc embedding: a word2vec file or an HF model folder")
    parser.add_argument("--hc-prediction", choices=["argmax", "sample", "default"], default="default",
                        help="the prediction HC judges (default: argmax for BERT, the generator's sample for ELECTRA)")
    parser.add_argument("--sr", choices=["none", "word", "sent"], default="none", help="soft regularization")
    parser.add_argument("--sr-weight", type=float, default=1.0)
    parser.add_argument("--max-nonfinite-steps", type=int, default=10,
                        help="stop after this many non-finite losses in a row (fp32/bf16)")
    parser.add_argument("--cache-dir", type=Path, help="tokenized-corpus cache (default: $TRUNEG_CACHE or ~/.cache/truneg)")
    parser.add_argument("--num-proc", type=int, help="tokenizer processes")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (DeepSpeed's engine.compile)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    for name in ("seq_len", "max_steps", "log_steps", "max_nonfinite_steps"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1")
    check_preset(args.model)
    if args.seq_len > MAX_POSITIONS:
        raise UserError(f"--seq-len {args.seq_len} is beyond the model's {MAX_POSITIONS} positions; use {MAX_POSITIONS} or less")
    return args


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from truneg import trainer

    # 1. Processes: one per device, gloo on the CPU.
    rank, world_size = trainer.init_distributed()

    # 2. Config and output folder: refuse to mix two runs in one folder.
    ds_config = trainer.deepspeed_config(args, world_size)
    trainer.claim_output_dir(args, ds_config, rank)

    # 3. Where to resume from; a checkpoint of another world size goes through DeepSpeed's universal format.
    resume = trainer.find_resume_point(args, ds_config, world_size)

    # 4. Data: tokenize and pack once per node (cached, memory-mapped).
    tokenizer, blocks = trainer.load_blocks(args)

    # 5. Model and objective (HC's synonym lookup, SR), on DeepSpeed.
    engine = trainer.build_engine(args, ds_config, tokenizer)

    # 6. Resume: weights, optimizer, scheduler, step, data position and RNG states.
    state = trainer.TrainState.start(args, engine, blocks, tokenizer, resume)

    # 7. Train, log, checkpoint; stop cleanly on SIGTERM/SIGINT.
    trainer.train(args, engine, state)


if __name__ == "__main__":
    main()
