"""The run's configuration: built once from the command line, typed, and read by every stage."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from truneg.data.blocks import DEFAULT_TOKENIZER
from truneg.data.masking import DEFAULT_RATE, MaskScheme, default_max_predictions, mask_scheme
from truneg.model.families import own_tokenizer

# The output folder's layout (--output-dir), besides DeepSpeed's monitors' folders (config.MONITORS).
RUN_FILE = "run.json"  # what makes the folder's run that run (checkpointing.run_dir)
CHECKPOINTS = "checkpoints"  # DeepSpeed's tags and `latest`
METRICS = "metrics.jsonl"  # truneg's record of each logged step
PROFILE = "profile"  # --profile-steps' traces

EVAL_MAX_SEQUENCES = 1024  # --eval-max-sequences' default: its cost is bench/eval_cost.py's

HC_SOURCES = ("none", "wordnet", "embedding")  # --hc's keywords; any other value is a table file (FILE.npz)


@dataclass(frozen=True)
class RunConfig:
    # model and objective
    model: str | None  # a preset; None: electra-tiny, or the --init-from checkpoint's own architecture
    init_from: str | None
    init_generator: str | None  # ELECTRA's generator beside --init-from's discriminator
    new_head: bool  # BERT: --init-from lacks the MLM head, which starts as HF initialises it
    train_only: str | None  # "head": the MLM head alone, the encoder frozen (model/stages.py)
    untie_decoder: bool  # the decoder a copy of the word embeddings, trained apart
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
    mlm_probability: float | None  # None: the family's default (masking.MASK_SCHEMES), as the two below
    mask_replace_prob: float | None
    random_replace_prob: float | None
    whole_word_masking: bool  # every piece of a selected word (masking.whole_word_positions)
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
    activation_checkpointing: bool  # each encoder layer recomputed in the backward (the same gradients, less memory)
    # watching the run: not its identity (run_dir.run_identity), a resume may change them
    peak_tflops: float | None  # MFU's peak; None: the device's, where known (truneg.train.observe.flops)
    profile_steps: tuple[int, int] | None  # --profile-steps A:B (truneg.train.observe.profiling)
    profile_ranks: tuple[int, ...] | None  # None: every rank
    eval_data: list[str] | None  # held-out text (truneg.train.heldout); None: no evaluation
    eval_steps: int | None  # None: at each checkpoint save (and always at step 0 and the last step)
    eval_max_sequences: int
    eval_synonyms: str | None  # Table 2 live's table; None: the shipped WordNet table
    # output, checkpoints, resume
    output_dir: Path
    save_steps: int
    log_steps: int
    keep_checkpoints: int
    step_timeout: float
    replica_check_steps: int
    resume: str
    overwrite: bool
    phase1_checkpoint: str | None  # BERT's phase 2: the phase-1 run's checkpoint it starts from
    reset_optimizer: bool  # with it: the moments emptied after the load

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunConfig:
        values = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        values["train_data"] = list(args.train_data)
        values["output_dir"] = Path(args.output_dir)
        values["tokenizer"] = tokenizer_of(args)
        rate = getattr(args, "mlm_probability", None) or DEFAULT_RATE
        values["max_predictions"] = args.max_predictions or default_max_predictions(args.seq_len, rate)
        values["sr_sent_target"] = args.sr_sent_target or "masked"  # ELECTRA takes the original whatever it says
        values["eval_data"] = list(args.eval_data) if getattr(args, "eval_data", None) else None
        values["eval_max_sequences"] = getattr(args, "eval_max_sequences", None) or EVAL_MAX_SEQUENCES
        if values["profile_steps"] is not None:  # (checked by args.argument_problems)
            values["profile_steps"] = parse_profile_steps(values["profile_steps"])
        if values["profile_ranks"] is not None:
            values["profile_ranks"] = parse_profile_ranks(values["profile_ranks"])
        if args.data_workers is None:  # background masking where a GPU waits for it; on CPU ranks it takes a core
            values["data_workers"] = 2 if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu" else 0
        return cls(**values)

    def mask_scheme(self, family: str) -> MaskScheme:
        """The masking of this run's training batches for the model's family ("bert" or "electra")."""
        return mask_scheme(family, self.mlm_probability, self.mask_replace_prob, self.random_replace_prob)

    @property
    def checkpoint_dir(self) -> Path:
        return self.output_dir / CHECKPOINTS

    @property
    def metrics_file(self) -> Path:
        return self.output_dir / METRICS

    @property
    def profile_dir(self) -> Path:
        return self.output_dir / PROFILE


def tokenizer_of(args: argparse.Namespace) -> str:
    """--tokenizer, else an --init-from RoBERTa's or XLM-R's own, else the shipped bert-base-uncased vocab."""
    return getattr(args, "tokenizer", None) or own_tokenizer(args.init_from) or str(DEFAULT_TOKENIZER)


# --profile-steps and --profile-ranks, parsed and checked before any process group (the profiler: profiling.py)


def parse_profile_steps(text: str) -> tuple[int, int]:
    """'A:B' -> (A, B), optimizer steps with 1 <= A <= B; ValueError with the reason otherwise."""
    first, sep, last = text.partition(":")
    try:
        window = int(first), int(last)
    except ValueError:
        window = None
    if not sep or window is None or not 1 <= window[0] <= window[1]:
        raise ValueError(f"--profile-steps takes A:B, optimizer steps with 1 <= A <= B (e.g. 10:12), not {text!r}")
    return window


def parse_profile_ranks(text: str) -> tuple[int, ...]:
    """'0,3' -> (0, 3), global ranks; ValueError with the reason otherwise."""
    try:
        ranks = tuple(sorted({int(r) for r in text.split(",")}))
    except ValueError:
        ranks = ()
    if not ranks or ranks[0] < 0:
        raise ValueError(f"--profile-ranks takes global ranks separated by commas (e.g. 0,3), not {text!r}")
    return ranks


def profile_problems(steps: str | None, ranks: str | None, max_steps: int) -> list[str]:
    """One line per problem of the profiler's flags (args.argument_problems, before any process group)."""
    problems = []
    for text, parse in ((steps, parse_profile_steps), (ranks, parse_profile_ranks)):
        if text is not None:
            try:
                parse(text)
            except ValueError as err:
                problems.append(str(err))
    if steps is not None and not problems and parse_profile_steps(steps)[1] > max_steps:
        problems.append(f"--profile-steps {steps} ends past --max-steps {max_steps}: the run stops at step "
                        f"{max_steps}; profile steps within it")
    if ranks is not None and steps is None:
        problems.append("--profile-ranks chooses the ranks --profile-steps profiles: pass --profile-steps A:B too")
    return problems
