"""GLUE fine-tuning of an exported truneg model (or any HF BERT/ELECTRA folder), with the official metrics.

    truneg finetune glue --task rte --model runs/demo/hf --data-dir ../shared/data/glue/RTE --output-dir runs/rte

Reads GLUE's own TSV files (MRPC's header has a BOM, CoLA has no header, STS-B is a regression, MNLI
has matched and mismatched dev sets). The optimizer is ELECTRA's: AdamW (eps 1e-6, weight decay 0.01), linear
warmup then decay. `finetune`'s own defaults are ELECTRA-base's recipe (lr 1e-4, layer-wise decay 0.8, batch 32,
seq 128, 3 epochs, 10 for RTE and STS-B); the CLI and the ablation take the model's recipe by family and size
(truneg.eval.recipes). Metrics come from scikit-learn and scipy.

Training is HF's `Trainer` (`build_trainer`, shared with SQuAD): the layer-wise groups come from its
`create_optimizer` hook, `--deepspeed_config` goes through its DeepSpeed integration, and its tqdm bar
shows the loss, with the dev metric after each epoch, on stderr (stdout carries only the results).
"""
from __future__ import annotations

import csv
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    Trainer,
    TrainingArguments,
    set_seed,
    utils,
)
from transformers.trainer_callback import ProgressCallback

from truneg.errors import UserError
from truneg.model import hub
from truneg.model.presets import load_pretrained
from truneg.model.pretrainers import decays
from truneg.train.config.ds_config import MONITORS, read_config
from truneg.train.ranks.distributed import init_distributed

if TYPE_CHECKING:
    from torch.utils.data import Dataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer


@dataclass(frozen=True)
class Task:
    folder: str
    text_a: str | int  # a header name, or a column index for header-less files
    text_b: str | int | None
    label: str | int
    labels: tuple[str, ...] | None  # None: regression
    dev_files: tuple[str, ...] = ("dev.tsv",)
    header: bool = True
    epochs: int = 3


TASKS = {
    "cola": Task("CoLA", 3, None, 1, ("0", "1"), header=False),
    "sst2": Task("SST-2", "sentence", None, "label", ("0", "1")),
    "mrpc": Task("MRPC", "#1 String", "#2 String", "Quality", ("0", "1")),
    "stsb": Task("STS-B", "sentence1", "sentence2", "score", None, epochs=10),
    "qqp": Task("QQP", "question1", "question2", "is_duplicate", ("0", "1")),
    "mnli": Task("MNLI", "sentence1", "sentence2", "gold_label", ("contradiction", "entailment", "neutral"),
                 dev_files=("dev_matched.tsv", "dev_mismatched.tsv")),
    "qnli": Task("QNLI", "question", "sentence", "label", ("entailment", "not_entailment")),
    "rte": Task("RTE", "sentence1", "sentence2", "label", ("entailment", "not_entailment"), epochs=10),
}


def read_tsv(path: Path, task: Task) -> list[tuple[str, str | None, float | int]]:
    """(text_a, text_b, label) rows; `utf-8-sig` drops MRPC's BOM, QUOTE_NONE keeps its stray quotes."""
    if not path.is_file():
        raise UserError(f"{path} does not exist; --data-dir must hold GLUE's {task.folder} files (train.tsv, dev.tsv)")
    csv.field_size_limit(sys.maxsize)
    try:
        return _read_rows(path, task)
    except UnicodeDecodeError as err:
        raise UserError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                        f"is it GLUE's {task.folder}?") from None


def _read_rows(path: Path, task: Task) -> list[tuple[str, str | None, float | int]]:
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None) if task.header else None
        if task.header and header is None:
            raise UserError(f"{path} is empty; --data-dir must hold GLUE's {task.folder} files")

        def column(key):
            if isinstance(key, int) or key is None:
                return key
            if key not in header:
                raise UserError(f"{path} has no column {key!r} (header: {header}); is it GLUE's {task.folder}?")
            return header.index(key)

        a, b, y = column(task.text_a), column(task.text_b), column(task.label)
        rows = []
        for number, fields in enumerate(reader, 2 if task.header else 1):
            if len(fields) <= max(i for i in (a, b, y) if i is not None):
                raise UserError(f"{path}:{number}: {len(fields)} columns, too few for {task.folder}")
            value = fields[y].strip()
            if task.labels is None:
                try:
                    label: float | int = float(value)
                except ValueError:
                    raise UserError(f"{path}:{number}: score {value!r} is not a number") from None
            elif value in task.labels:
                label = task.labels.index(value)
            else:
                raise UserError(f"{path}:{number}: label {value!r} is not one of {task.labels}")
            rows.append((fields[a], fields[b] if b is not None else None, label))
    if not rows:
        raise UserError(f"{path} holds no examples")
    return rows


METRIC_NAMES = ("accuracy", "f1", "matthews_correlation", "pearson", "spearmanr")


def main_metric(task_name: str) -> str:
    """The score a task is reported by, as in the paper's Table 3 (as ELECTRA): "STS is reported by Spearman
    correlation, CoLA ... by Matthew's correlation, and other tasks are reported by accuracy" (MRPC and QQP too;
    results.json has their F1 besides)."""
    return {"cola": "matthews_correlation", "stsb": "spearmanr"}.get(task_name, "accuracy")


def compute_metrics(task_name: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """GLUE's official metrics, from scikit-learn and scipy."""
    if task_name == "stsb":
        return {"pearson": float(pearsonr(predictions, labels)[0]),
                "spearmanr": float(spearmanr(predictions, labels)[0])}
    if task_name == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(labels, predictions))}
    metrics = {"accuracy": float(accuracy_score(labels, predictions))}
    if task_name in ("mrpc", "qqp"):
        metrics["f1"] = float(f1_score(labels, predictions))
    return metrics


def resolve_model_dir(model: str | Path) -> Path:
    """An exported ELECTRA folder fine-tunes its discriminator; anything else is an HF model folder, or a model name
    of the HF hub (NAME[@REVISION]), resolved to its snapshot in the HF cache."""
    model = hub.locate(str(model), "--model").path
    if (model / "discriminator" / "config.json").is_file():
        return model / "discriminator"
    if not (model / "config.json").is_file():
        raise UserError(f"--model {model} holds no HF model (config.json); export a checkpoint with `truneg export` "
                        "first")
    # the files from_pretrained reads weights from
    weights = (utils.SAFE_WEIGHTS_NAME, utils.SAFE_WEIGHTS_INDEX_NAME, utils.WEIGHTS_NAME, utils.WEIGHTS_INDEX_NAME)
    if not any((model / name).is_file() for name in weights):
        raise UserError(f"--model {model} has a config.json but no weights ({', '.join(weights)}); export a "
                        "checkpoint with `truneg export`, or pass the folder that holds them")
    return model


def layerwise_param_groups(model: torch.nn.Module, lr: float, decay: float, weight_decay: float) -> list[dict]:
    """ELECTRA's layer-wise learning-rate decay (its `_get_layer_lrs`): lr x decay^(layers + 2 - depth), where
    the embeddings and `embeddings_project` are depth 0, layer i is depth i + 1 and the task head (and BERT's
    pooler) depth layers + 2. The top layer thus gets lr x decay^2, the head lr."""
    num_layers = model.config.num_hidden_layers
    groups: dict[tuple[int, bool], list] = {}
    for name, param in model.named_parameters():
        if re.search(r"(^|\.)embeddings(_project)?\.", name):
            depth = 0
        elif match := re.search(r"(^|\.)layer\.(\d+)\.", name):
            depth = int(match.group(2)) + 1
        else:
            depth = num_layers + 2  # the task head, BERT's pooler
        no_decay = not decays(name)
        groups.setdefault((depth, no_decay), []).append(param)
    return [{"params": params, "lr": lr * decay ** (num_layers + 2 - depth),
             "weight_decay": 0.0 if no_decay else weight_decay} for (depth, no_decay), params in sorted(groups.items())]


# --- fine-tuning through HF's Trainer (GLUE and SQuAD) ------------------------------------------------

# Sections of a DeepSpeed config that fine-tuning replaces: with an `optimizer` section Trainer's integration
# would build DeepSpeed's own optimizer and silently drop the layer-wise groups; `scheduler` would replace the
# recipe's warmup; the monitors would write into the current folder (Trainer reports nothing: report_to none).
REPLACED_DS_SECTIONS = ("optimizer", "scheduler")
DROPPED_DS_MONITORS = tuple(MONITORS)


def finetuning_deepspeed_config(path: str | Path) -> dict:
    """The user's DeepSpeed config for Trainer's integration: batch sizes and clipping from the command line."""
    config = read_config(path, for_trainer=True)
    replaced = [k for k in REPLACED_DS_SECTIONS if k in config]
    if replaced:
        print(f"truneg: note: finetune ignores the {' and '.join(replaced)} section(s) of {path}: it keeps ELECTRA's "
              "layer-wise AdamW groups and linear warmup (--lr, --layerwise-decay)", file=sys.stderr, flush=True)
    for key in REPLACED_DS_SECTIONS + DROPPED_DS_MONITORS:
        config.pop(key, None)
    config.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto",
                  gradient_clipping="auto")
    zero = config.get("zero_optimization") or {}
    if zero.get("stage") == 3:  # else Trainer's save_model writes a ZeRO checkpoint, not the model's weights
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return config


def _trainer_classes():
    """Trainer subclasses, defined on first use so that importing this module does not import transformers."""
    class LayerwiseDecayTrainer(Trainer):
        """Trainer whose optimizer is AdamW over ELECTRA's layer-wise groups. `create_optimizer` is the hook Trainer
        calls with and without DeepSpeed (its DeepSpeed integration discards an optimizer passed to __init__)."""

        def __init__(self, *args, layerwise_decay: float, **kwargs):
            super().__init__(*args, **kwargs)
            self.layerwise_decay = layerwise_decay

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                groups = layerwise_param_groups(model or self.model, self.args.learning_rate, self.layerwise_decay,
                                                self.args.weight_decay)
                self.optimizer = torch.optim.AdamW(groups, lr=self.args.learning_rate, eps=self.args.adam_epsilon,
                                                   betas=(self.args.adam_beta1, self.args.adam_beta2))
            return self.optimizer

    class ConsoleProgress(ProgressCallback):
        """Trainer's tqdm bar with the latest loss and lr on it, and one line per evaluation, all on stderr."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or self.training_bar is None or not logs:
                return
            if "loss" in logs:  # lr: the head's (Trainer logs the first group's, the embeddings')
                scheduler = kwargs.get("lr_scheduler")
                lr = max(scheduler.get_last_lr()) if scheduler else logs.get("learning_rate", 0.0)
                self.training_bar.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{lr:.2e}")
            scores = {k[len("eval_"):]: v for k, v in logs.items() if k.startswith("eval_") and
                      not k.endswith(("_runtime", "_per_second"))}
            if scores:
                shown = ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if isinstance(v, float))
                self.training_bar.write(f"epoch {logs.get('epoch', 0):.2f}: {shown}", file=sys.stderr)

    return LayerwiseDecayTrainer, ConsoleProgress


def build_trainer(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, train_dataset: Dataset,
                  eval_dataset: Dataset, compute_metrics: Callable, output_dir: Path, *,
                  epochs: int, lr: float, batch_size: int, seed: int, warmup_ratio: float = 0.1,
                  weight_decay: float = 0.01, layerwise_decay: float = 0.8,
                  deepspeed_config: str | None = None) -> Trainer:
    """A Trainer with this module's recipe: AdamW (eps 1e-6) over layer-wise groups, linear warmup then decay,
    gradient clipping 1, the dev set(s) scored after each epoch, nothing saved or reported on the way."""
    LayerwiseDecayTrainer, ConsoleProgress = _trainer_classes()
    ds_config, precision = None, {}
    if deepspeed_config:
        ds_config = finetuning_deepspeed_config(deepspeed_config)
        # the config's precision decides (Trainer's integration refuses a mismatch with the arguments)
        precision = {k: bool(ds_config.get(k, {}).get("enabled", False)) for k in ("fp16", "bf16")}
        init_distributed()  # gloo and the /dev/shm workaround on the CPU; Trainer reuses the process group
    total_steps = math.ceil(len(train_dataset) / batch_size) * epochs
    args = TrainingArguments(
        output_dir=str(output_dir), num_train_epochs=epochs, learning_rate=lr, per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=64, warmup_steps=warmup_ratio, weight_decay=weight_decay, adam_epsilon=1e-6,
        max_grad_norm=1.0, lr_scheduler_type="linear", seed=seed, eval_strategy="epoch", save_strategy="no",
        logging_strategy="steps", logging_steps=max(1, min(50, total_steps // 10)), report_to="none",
        disable_tqdm=False, dataloader_pin_memory=torch.cuda.is_available(), deepspeed=ds_config, **precision)
    trainer = LayerwiseDecayTrainer(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                                    processing_class=tokenizer, compute_metrics=compute_metrics,
                                    layerwise_decay=layerwise_decay)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(ConsoleProgress())
    return trainer


def train_and_score(trainer: Trainer, epochs: int) -> dict[str, float]:
    """Train (the dev set(s) are scored after each epoch) and return the last scores, `eval_`-prefixed as
    Trainer logs them; with 0 epochs, the untrained model's."""
    if epochs > 0:
        trainer.train()
    else:
        trainer.evaluate()
    latest: dict[str, float] = {}
    for entry in trainer.state.log_history:
        latest.update({k: v for k, v in entry.items() if k.startswith("eval_")})
    return latest


class _Examples(torch.utils.data.Dataset):
    """Tokenized examples, unpadded: Trainer's collator pads each batch to its longest example."""

    def __init__(self, tokenizer, rows, max_len: int):
        b = [r[1] for r in rows] if rows[0][1] is not None else None
        self.enc = tokenizer([r[0] for r in rows], b, truncation=True, max_length=max_len)
        self.labels = [r[2] for r in rows]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**{k: v[i] for k, v in self.enc.items()}, "labels": self.labels[i]}


def finetune(task_name: str, model_dir: str | Path, data_dir: str | Path, output_dir: str | Path,
             epochs: int | None = None,
             lr: float = 1e-4, batch_size: int = 32, max_seq_len: int = 128, max_train_samples: int | None = None,
             seed: int = 42, warmup_ratio: float = 0.1, weight_decay: float = 0.01, layerwise_decay: float = 0.8,
             deepspeed_config: str | None = None) -> dict:
    """Fine-tune and evaluate on the dev set(s); writes and returns results.json's content."""
    if task_name not in TASKS:
        raise UserError(f"unknown GLUE task {task_name!r}; choose one of {', '.join(TASKS)}")
    task = TASKS[task_name]
    data_dir, output_dir, model_dir = Path(data_dir), Path(output_dir), resolve_model_dir(model_dir)
    train_rows = read_tsv(data_dir / "train.tsv", task)
    dev_sets = {name: read_tsv(data_dir / name, task) for name in task.dev_files}
    if max_train_samples:
        train_rows = train_rows[:max_train_samples]
    regression = task.labels is None
    epochs = task.epochs if epochs is None else epochs

    set_seed(seed)  # transformers': Python, numpy and torch (CUDA too)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(AutoModelForSequenceClassification, model_dir, "--model",
                            num_labels=1 if regression else len(task.labels),
                            problem_type="regression" if regression else "single_label_classification")

    def scores(prediction) -> dict[str, float]:
        logits = prediction.predictions
        return compute_metrics(task_name, logits.squeeze(-1) if regression else logits.argmax(-1), prediction.label_ids)

    eval_sets = {Path(name).stem: _Examples(tokenizer, rows, max_seq_len) for name, rows in dev_sets.items()}
    trainer = build_trainer(model, tokenizer, _Examples(tokenizer, train_rows, max_seq_len), eval_sets, scores,
                            output_dir, epochs=epochs, lr=lr, batch_size=batch_size, seed=seed,
                            warmup_ratio=warmup_ratio,
                            weight_decay=weight_decay, layerwise_decay=layerwise_decay,
                            deepspeed_config=deepspeed_config)
    logged = train_and_score(trainer, epochs)
    metrics: dict[str, float] = {}
    for name in dev_sets:
        prefix, suffix = f"eval_{Path(name).stem}_", "_mm" if name == "dev_mismatched.tsv" else ""
        metrics.update({k[len(prefix):] + suffix: v for k, v in logged.items()
                        if k.startswith(prefix) and k[len(prefix):] in METRIC_NAMES})
    results = {"task": task_name, "model": str(model_dir), **metrics, "train_samples": len(train_rows),
               "eval_samples": sum(len(r) for r in dev_sets.values()), "epochs": epochs, "lr": lr,
               "batch_size": batch_size, "seed": seed, "layerwise_decay": layerwise_decay, "warmup_ratio": warmup_ratio,
               "max_seq_len": max_seq_len, "max_train_samples": max_train_samples}
    trainer.save_model(str(output_dir / "model"))  # model and tokenizer, for `truneg robustness` and further use
    if trainer.is_world_process_zero():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results
