"""SQuAD v1.1 fine-tuning and evaluation (exact match and F1 with the official answer normalisation).

    truneg finetune squad --model runs/demo/hf --train train-v1.1.json --dev dev-v1.1.json --output-dir runs/squad

Features are built as in HF's run_qa: question + context windows of --max-seq-len with --doc-stride
overlap; answers map to token start/end through the offset mapping. Prediction takes the best
start + end logit over the n-best spans of each window, at most 30 tokens long.
"""
from __future__ import annotations

import collections
import json
import re
import string
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, set_seed

from truneg.errors import UserError
from truneg.eval.glue import build_trainer, resolve_model_dir, train_and_score
from truneg.model.presets import load_pretrained

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# --- the official SQuAD v1.1 evaluation -------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """Lower case, and remove punctuation, articles and extra whitespace (the official evaluate-v1.1.py)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def f1_score(prediction: str, ground_truth: str) -> float:
    pred_tokens, gold_tokens = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred_tokens), overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def evaluate_predictions(examples: list[dict], predictions: dict[str, str]) -> dict[str, float]:
    """EM and F1 in percent, each the max over the gold answers, averaged over the questions."""
    em = f1 = 0.0
    for example in examples:
        if example["id"] not in predictions:  # as the official script: a question not answered scores 0
            continue
        prediction = predictions[example["id"]]
        golds = example["answers"] or [""]
        em += max(exact_match(prediction, g) for g in golds)
        f1 += max(f1_score(prediction, g) for g in golds)
    return {"exact_match": 100 * em / len(examples), "f1": 100 * f1 / len(examples)}


# --- data -----------------------------------------------------------------------------------------

def read_squad(path: str | Path) -> list[dict]:
    """Flat examples {id, question, context, answers (texts), answer_starts} of a SQuAD v1.1 JSON file."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist; pass a SQuAD v1.1 JSON file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))["data"]
        examples = [{"id": qa["id"], "question": qa["question"], "context": paragraph["context"],
                     "answers": [a["text"] for a in qa["answers"]],
                     "answer_starts": [a["answer_start"] for a in qa["answers"]]}
                    for article in data for paragraph in article["paragraphs"] for qa in paragraph["qas"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise UserError(f"{path} is not SQuAD v1.1 JSON ({type(err).__name__}: {err})") from None
    for e in examples:  # the values' types too: a string answer_start would fail deep in the feature code
        texts_ok = all(isinstance(v, str) for v in (e["question"], e["context"], *e["answers"]))
        starts_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in e["answer_starts"])
        if not (texts_ok and starts_ok):
            raise UserError(f"{path}: question {e['id']!r} is not SQuAD v1.1 (question, context and answer texts are "
                            "strings, answer_start an integer); fix the file")
    return examples


def some_examples(examples: list[dict], path: str | Path, what: str) -> list[dict]:
    """`examples`, refused in one line when there are none."""
    if not examples:
        raise UserError(f"{path} has no {what}; pass a SQuAD v1.1 file with some")
    return examples


def check_doc_stride(max_seq_len: int, doc_stride: int, longest_question: int = 0, special_tokens: int = 3) -> None:
    """The stride (the tokens consecutive windows share, as the HF tokenizer takes it) must be less than a window's
    share of context: what [CLS], two [SEP] and the longest question leave. Checked before any work (no question
    read yet: 0 tokens) and again in `features` beside the longest question, where the tokenizer would stop
    otherwise (a ValueError, or a panic of its Rust core that no `except Exception` catches)."""
    room = max_seq_len - longest_question - special_tokens
    if doc_stride < room:
        return
    beside = f" beside the longest question ({longest_question} tokens)" if longest_question else ""
    raise UserError(f"--doc-stride {doc_stride} (the tokens consecutive windows share) leaves no context in a window "
                    f"of --max-seq-len {max_seq_len}{beside}; use --doc-stride below {max(room, 1)}, or a larger "
                    "--max-seq-len")


def features(tokenizer: PreTrainedTokenizerBase, examples: list[dict], max_len: int, stride: int, train: bool) -> dict:
    questions = [e["question"].lstrip() for e in examples]
    longest = max(len(ids) for ids in tokenizer(questions, add_special_tokens=False)["input_ids"])
    check_doc_stride(max_len, stride, longest, tokenizer.num_special_tokens_to_add(pair=True))
    enc = tokenizer(questions, [e["context"] for e in examples], truncation="only_second", max_length=max_len,
                    stride=stride, return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length")
    sample_map = enc.pop("overflow_to_sample_mapping")
    starts, ends = [], []
    for i, offsets in enumerate(enc["offset_mapping"]):
        sequence_ids = enc.sequence_ids(i)
        example = examples[sample_map[i]]
        # offsets outside the context are None'd so that prediction never picks the question
        enc["offset_mapping"][i] = [o if sequence_ids[k] == 1 else None for k, o in enumerate(offsets)]
        if not train:
            continue
        if not example["answers"]:  # no gold answer (an unanswered dev question): point at [CLS]
            starts.append(0)
            ends.append(0)
            continue
        start_char = example["answer_starts"][0]
        end_char = start_char + len(example["answers"][0])
        context = [k for k, s in enumerate(sequence_ids) if s == 1]
        first, last = context[0], context[-1]
        if offsets[first][0] > start_char or offsets[last][1] < end_char:
            starts.append(0)  # the answer is not in this window: point at [CLS]
            ends.append(0)
            continue
        start = first
        while start <= last and offsets[start][0] <= start_char:
            start += 1
        end = last
        while end >= first and offsets[end][1] >= end_char:
            end -= 1
        starts.append(start - 1)
        ends.append(end + 1)
    out = {"input_ids": torch.tensor(enc["input_ids"]), "attention_mask": torch.tensor(enc["attention_mask"]),
           "offsets": enc["offset_mapping"], "example_index": sample_map}
    if "token_type_ids" in enc:
        out["token_type_ids"] = torch.tensor(enc["token_type_ids"])
    if train:
        out["start_positions"], out["end_positions"] = torch.tensor(starts), torch.tensor(ends)
    return out


def best_answers(examples: list[dict], feats: dict, start_logits: np.ndarray, end_logits: np.ndarray, n_best: int = 20,
                 max_answer_tokens: int = 30) -> dict:
    best: dict[str, tuple[float, str]] = {}
    for i, example_index in enumerate(feats["example_index"]):
        example, offsets = examples[example_index], feats["offsets"][i]
        for s in np.argsort(start_logits[i])[-n_best:]:
            for e in np.argsort(end_logits[i])[-n_best:]:
                if offsets[s] is None or offsets[e] is None or e < s or e - s + 1 > max_answer_tokens:
                    continue
                score = float(start_logits[i][s] + end_logits[i][e])
                if example["id"] not in best or score > best[example["id"]][0]:
                    best[example["id"]] = (score, example["context"][offsets[s][0]: offsets[e][1]])
    return {qid: text for qid, (_, text) in best.items()}


def predict_answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[dict], max_seq_len: int,
                    doc_stride: int) -> dict[str, str]:
    model.eval()
    device = next(model.parameters()).device  # wherever the caller put the model (robustness: its GPU)
    feats = features(tokenizer, examples, max_seq_len, doc_stride, train=False)
    inputs = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor)}
    starts, ends = [], []
    with torch.no_grad():
        for start in range(0, len(inputs["input_ids"]), 64):
            out = model(**{k: v[start: start + 64].to(device) for k, v in inputs.items()})
            starts.append(out.start_logits.float().cpu().numpy())
            ends.append(out.end_logits.float().cpu().numpy())
    return best_answers(examples, feats, np.concatenate(starts), np.concatenate(ends))


# --- fine-tuning ---------------------------------------------------------------------------------

class _Features(torch.utils.data.Dataset):
    """The windows' model inputs and start/end labels (all padded to --max-seq-len already)."""

    def __init__(self, feats: dict):
        self.tensors = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor)}

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, i: int) -> dict:
        return {k: v[i] for k, v in self.tensors.items()}


class _SquadScorer:
    """Trainer's compute_metrics for SQuAD: the best span of each question's windows, EM and F1; it keeps the
    last predictions for predictions.json."""

    def __init__(self, examples: list[dict], feats: dict):
        self.examples, self.feats, self.predictions = examples, feats, {}

    def __call__(self, prediction) -> dict[str, float]:
        start_logits, end_logits = prediction.predictions
        self.predictions = best_answers(self.examples, self.feats, start_logits, end_logits)
        return evaluate_predictions(self.examples, self.predictions)


def finetune_squad(model_dir: str | Path, train_file: str | Path, dev_file: str | Path, output_dir: str | Path,
                   epochs: int = 2, lr: float = 1e-4, batch_size: int = 32,
                   max_seq_len: int = 384, doc_stride: int = 128, max_train_samples: int | None = None,
                   max_eval_samples: int | None = None, seed: int = 42, layerwise_decay: float = 0.8,
                   deepspeed_config: str | None = None, warmup_ratio: float = 0.1) -> dict:
    """Fine-tune on HF's Trainer (glue.build_trainer: the same recipe) and score dev; writes results.json,
    predictions.json and the model."""
    check_doc_stride(max_seq_len, doc_stride)
    model_dir = resolve_model_dir(model_dir)
    train_examples = some_examples([e for e in read_squad(train_file) if e["answers"]][:max_train_samples],
                                   train_file, "answered question")
    dev_examples = some_examples(read_squad(dev_file)[:max_eval_samples], dev_file, "question")
    set_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"{model_dir}'s tokenizer is not a fast tokenizer; SQuAD needs offset mappings")
    model = load_pretrained(AutoModelForQuestionAnswering, model_dir, "--model")
    train = _Features(features(tokenizer, train_examples, max_seq_len, doc_stride, train=True))
    dev_feats = features(tokenizer, dev_examples, max_seq_len, doc_stride, train=True)
    scorer = _SquadScorer(dev_examples, dev_feats)
    output_dir = Path(output_dir)
    trainer = build_trainer(model, tokenizer, train, {"dev": _Features(dev_feats)}, scorer, output_dir, epochs=epochs,
                            lr=lr,
                            batch_size=batch_size, seed=seed, layerwise_decay=layerwise_decay,
                            warmup_ratio=warmup_ratio, deepspeed_config=deepspeed_config)
    logged = train_and_score(trainer, epochs)
    results = {"model": str(model_dir), "exact_match": logged["eval_dev_exact_match"], "f1": logged["eval_dev_f1"],
               "train_samples": len(train_examples), "eval_samples": len(dev_examples), "epochs": epochs, "lr": lr,
               "batch_size": batch_size, "layerwise_decay": layerwise_decay, "warmup_ratio": warmup_ratio,
               "max_seq_len": max_seq_len, "doc_stride": doc_stride, "max_train_samples": max_train_samples,
               "seed": seed}
    trainer.save_model(str(output_dir / "model"))
    if trainer.is_world_process_zero():
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        (output_dir / "predictions.json").write_text(json.dumps(scorer.predictions, indent=1) + "\n", encoding="utf-8")
    return results
