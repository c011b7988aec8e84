"""GLUE fine-tuning of an exported truneg model (or any HF BERT/ELECTRA folder), with the official metrics.

    truneg finetune glue --task rte --model runs/demo/hf --data-dir ../shared/data/glue/RTE --output-dir runs/rte

Reads GLUE's own TSV files (MRPC's header has a BOM, CoLA has no header, STS-B is a regression, MNLI
has matched and mismatched dev sets). Defaults are ELECTRA's published fine-tuning hyper-parameters:
AdamW (eps 1e-6, weight decay 0.01), linear warmup over 10 % then decay, batch 32, seq 128, layer-wise
learning-rate decay 0.8, 3 epochs (10 for RTE and STS-B). Metrics come from scikit-learn and scipy.
"""
from __future__ import annotations

import csv
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from truneg.errors import UserError


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
    with open(path, encoding="utf-8-sig", newline="") as fh:
        reader = csv.reader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader) if task.header else None

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
                label: float | int = float(value)
            elif value in task.labels:
                label = task.labels.index(value)
            else:
                raise UserError(f"{path}:{number}: label {value!r} is not one of {task.labels}")
            rows.append((fields[a], fields[b] if b is not None else None, label))
    if not rows:
        raise UserError(f"{path} holds no examples")
    return rows


def compute_metrics(task_name: str, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """GLUE's official metrics, from scikit-learn and scipy."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    if task_name == "stsb":
        return {"pearson": float(pearsonr(predictions, labels)[0]), "spearmanr": float(spearmanr(predictions, labels)[0])}
    if task_name == "cola":
        return {"matthews_correlation": float(matthews_corrcoef(labels, predictions))}
    metrics = {"accuracy": float(accuracy_score(labels, predictions))}
    if task_name in ("mrpc", "qqp"):
        metrics["f1"] = float(f1_score(labels, predictions))
    return metrics


def resolve_model_dir(model: str | Path) -> Path:
    """An exported ELECTRA folder fine-tunes its discriminator; anything else is an HF model folder."""
    model = Path(model)
    if (model / "discriminator" / "config.json").is_file():
        return model / "discriminator"
    if not (model / "config.json").is_file():
        raise UserError(f"--model {model} holds no HF model (config.json); export a checkpoint with `truneg export` first")
    return model


def layerwise_param_groups(model, lr: float, decay: float, weight_decay: float) -> list[dict]:
    """ELECTRA's layer-wise learning-rate decay: the top layer gets lr, each layer below it decay x more."""
    num_layers = model.config.num_hidden_layers
    groups: dict[tuple[int, bool], list] = {}
    for name, param in model.named_parameters():
        if ".embeddings." in name or name.startswith("embeddings."):
            depth = 0
        elif ".layer." in name:
            depth = int(name.split(".layer.")[1].split(".")[0]) + 1
        else:
            depth = num_layers + 1  # pooler, classifier
        no_decay = name.endswith("bias") or "LayerNorm" in name
        groups.setdefault((depth, no_decay), []).append(param)
    return [{"params": params, "lr": lr * decay ** (num_layers + 1 - depth),
             "weight_decay": 0.0 if no_decay else weight_decay} for (depth, no_decay), params in sorted(groups.items())]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def encode(tokenizer, rows, max_len: int) -> dict[str, torch.Tensor]:
    a = [r[0] for r in rows]
    b = [r[1] for r in rows] if rows[0][1] is not None else None
    enc = tokenizer(a, b, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
    labels = torch.tensor([r[2] for r in rows], dtype=torch.float32 if isinstance(rows[0][2], float) else torch.long)
    return {**enc, "labels": labels}


def predict(model, data: dict[str, torch.Tensor], batch_size: int, regression: bool, device) -> np.ndarray:
    model.eval()
    outputs = []
    with torch.no_grad():
        for start in range(0, len(data["labels"]), batch_size):
            batch = {k: v[start: start + batch_size].to(device) for k, v in data.items() if k != "labels"}
            logits = model(**batch).logits
            outputs.append(logits.squeeze(-1).float().cpu() if regression else logits.argmax(-1).cpu())
    return torch.cat(outputs).numpy()


def finetune(task_name: str, model_dir: str | Path, data_dir: str | Path, output_dir: str | Path, epochs: int | None = None,
             lr: float = 1e-4, batch_size: int = 32, max_seq_len: int = 128, max_train_samples: int | None = None,
             seed: int = 42, warmup_ratio: float = 0.1, weight_decay: float = 0.01, layerwise_decay: float = 0.8,
             deepspeed_config: str | None = None) -> dict:
    """Fine-tune and evaluate on the dev set(s); writes and returns results.json's content."""
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        get_linear_schedule_with_warmup,
    )

    if task_name not in TASKS:
        raise UserError(f"unknown GLUE task {task_name!r}; choose one of {', '.join(TASKS)}")
    task = TASKS[task_name]
    data_dir, output_dir, model_dir = Path(data_dir), Path(output_dir), resolve_model_dir(model_dir)
    train_rows = read_tsv(data_dir / "train.tsv", task)
    dev_sets = {name: read_tsv(data_dir / name, task) for name in task.dev_files}
    if max_train_samples:
        train_rows = train_rows[:max_train_samples]
    regression = task.labels is None
    epochs = epochs or task.epochs

    seed_everything(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=1 if regression else len(task.labels),
        problem_type="regression" if regression else "single_label_classification")
    train = encode(tokenizer, train_rows, max_seq_len)
    steps_per_epoch = math.ceil(len(train_rows) / batch_size)
    total_steps = steps_per_epoch * epochs
    groups = layerwise_param_groups(model, lr, layerwise_decay, weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=lr, eps=1e-6)
    scheduler = get_linear_schedule_with_warmup(optimizer, math.ceil(warmup_ratio * total_steps), total_steps)
    engine, device = model, torch.device("cpu")
    if deepspeed_config:  # on GPUs: the same loop through a DeepSpeed engine, with this recipe's optimizer
        import deepspeed

        from truneg.config import read_config
        from truneg.trainer import init_distributed

        init_distributed()
        config = {k: v for k, v in read_config(deepspeed_config).items()
                  if k not in ("optimizer", "scheduler", "train_batch_size", "tensorboard", "csv_monitor", "wandb")}
        config.update(train_micro_batch_size_per_gpu=batch_size, gradient_accumulation_steps=1, gradient_clipping=1.0)
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                               config=config)
        device = engine.device
    order_rng = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        model.train()
        index = torch.randperm(len(train_rows), generator=order_rng)
        for start in range(0, len(train_rows), batch_size):
            batch = {k: v[index[start: start + batch_size]].to(device) for k, v in train.items()}
            loss = engine(**batch).loss
            if deepspeed_config:
                engine.backward(loss)
                engine.step()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)

    metrics: dict[str, float] = {}
    for name, rows in dev_sets.items():
        dev = encode(tokenizer, rows, max_seq_len)
        scores = compute_metrics(task_name, predict(engine, dev, 64, regression, device), dev["labels"].numpy())
        suffix = "_mm" if name == "dev_mismatched.tsv" else ""
        metrics.update({k + suffix: v for k, v in scores.items()})
    results = {"task": task_name, "model": str(model_dir), **metrics, "train_samples": len(train_rows),
               "eval_samples": sum(len(r) for r in dev_sets.values()), "epochs": epochs, "lr": lr,
               "batch_size": batch_size, "seed": seed, "layerwise_decay": layerwise_decay}
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    model.save_pretrained(output_dir / "model")  # for `truneg robustness` and further use
    tokenizer.save_pretrained(output_dir / "model")
    return results
