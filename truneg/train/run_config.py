"""The run's configuration: built once from the command line, typed, and read by every stage."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from truneg.data.masking import default_max_predictions

# The output folder's layout (--output-dir), besides run.json (run_dir.RUN_FILE) and DeepSpeed's monitors'
# folders (config.MONITORS).
CHECKPOINTS = "checkpoints"  # DeepSpeed's tags and `latest`
METRICS = "metrics.jsonl"  # truneg's record of each logged step

HC_SOURCES = ("none", "wordnet", "embedding")  # --hc's keywords; any other value is a table file (FILE.npz)


@dataclass(frozen=True)
class RunConfig:
    # model and objective
    model: str | None  # a preset; None: electra-tiny, or the --init-from checkpoint's own architecture
    init_from: str | None
    init_generator: str | None  # ELECTRA's generator beside --init-from's discriminator
    dropout: float | None  # None: 0.1 for a fresh model, the checkpoint's own with --init-from
    hc: str
    hc_embeddings: str | None
    hc_prediction: str
    sr: str
    sr_weight: float
    sr_sent_target: str
    # data
    train_data: list[str]
    tokenizer: str
    seq_len: int
    max_predictions: int
    cache_dir: Path | None
    num_proc: int | None
    data_workers: int
    # optimisation (the rest is in the DeepSpeed config)
    deepspeed_config: str | None
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    lr: float | None
    max_steps: int
    max_nonfinite_steps: int
    seed: int
    compile: str | None  # None | layers | whole (truneg.model.compile)
    # output, checkpoints, resume
    output_dir: Path
    save_steps: int
    log_steps: int
    keep_checkpoints: int
    step_timeout: float
    replica_check_steps: int
    resume: str
    overwrite: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        values = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        values["train_data"] = list(args.train_data)
        values["output_dir"] = Path(args.output_dir)
        values["max_predictions"] = args.max_predictions or default_max_predictions(args.seq_len)
        values["sr_sent_target"] = args.sr_sent_target or "masked"  # ELECTRA takes the original whatever it says
        if args.data_workers is None:  # background masking where a GPU waits for it; on CPU ranks it takes a core
            values["data_workers"] = 2 if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else 0
        return cls(**values)

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return self.output_dir / METRICS
