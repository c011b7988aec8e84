"""Robustness to synonym swaps and distractors (the paper's Table 5).

- `swap_syn`: TextFlint's SwapSynWordNet with nltk's WordNet. POS-tag the words, skip stopwords and
  punctuation, replace 10 % of the words (at least 1, at most 10) by a single-word lemma, other than the
  word, of a synset of the same POS; a fixed seed; sentences with no candidate drop out.
- `add_sent_distractor`: an AddSentDiverse-style distractor for SQuAD: the question made declarative
  with a fake answer, its content words swapped for WordNet synonyms, appended to the context.

POS tags come from nltk's perceptron tagger when its data is installed; otherwise from WordNet itself:
each word takes the part of speech whose senses are most frequent in SemCor (WordNet's own tag counts).
"""
from __future__ import annotations

import random
import re
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from truneg.errors import UserError

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WORDNET_POS = {"NN": "n", "VB": "v", "JJ": "a", "RB": "r"}
WH_WORDS = {"what", "which", "who", "whom", "whose", "when", "where", "why", "how"}


@lru_cache(maxsize=1)
def _tools():
    from nltk.tokenize import TreebankWordTokenizer
    from nltk.tokenize.treebank import TreebankWordDetokenizer
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    from truneg.wordnet_setup import load_wordnet

    return TreebankWordTokenizer(), TreebankWordDetokenizer(), ENGLISH_STOP_WORDS, load_wordnet()


@lru_cache(maxsize=200_000)
def wordnet_pos(word: str) -> str | None:
    """The part of speech whose WordNet senses of `word` are most frequent in SemCor (None: not in WordNet)."""
    wn = _tools()[3]
    best, best_count = None, -1
    for pos in "nvar":
        synsets = wn.synsets(word, pos)
        if synsets:
            count = sum(lemma.count() for s in synsets for lemma in s.lemmas() if lemma.name().lower() == word.lower())
            if count > best_count:
                best, best_count = pos, count
    return best


def pos_tags(words: list[str]) -> list[str | None]:
    """WordNet POS letters (n, v, a, r) or None per word."""
    import nltk

    try:
        return [WORDNET_POS.get(tag[:2]) for _, tag in nltk.pos_tag(words)]
    except LookupError:  # the tagger's data is not installed: WordNet's own sense frequencies
        return [wordnet_pos(w.lower()) if w.isalpha() else None for w in words]


def synonyms(word: str, pos: str) -> list[str]:
    wn = _tools()[3]
    names = {lemma.name() for s in wn.synsets(word, pos) for lemma in s.lemmas()}
    return sorted(n for n in names if "_" not in n and "-" not in n and n.lower() != word.lower())


def swap_syn(sentence: str, rng: random.Random, ratio: float = 0.1, minimum: int = 1, maximum: int = 10) -> str | None:
    """The sentence with synonym swaps, or None when it has no candidate (it drops out)."""
    tokenizer, detokenizer, stopwords, _ = _tools()
    words = tokenizer.tokenize(sentence)
    tags = pos_tags(words)
    candidates = {}
    for i, (word, pos) in enumerate(zip(words, tags)):
        if pos and word.isalpha() and word.lower() not in stopwords:
            options = synonyms(word.lower(), pos)
            if options:
                candidates[i] = options
    if not candidates:
        return None
    count = max(minimum, min(maximum, round(ratio * len(words)), len(candidates)))
    for i in rng.sample(sorted(candidates), min(count, len(candidates))):
        replacement = rng.choice(candidates[i])
        words[i] = replacement.capitalize() if words[i][:1].isupper() else replacement
    return detokenizer.detokenize(words)


def add_sent_distractor(question: str, fake_answer: str, rng: random.Random) -> str:
    """A declarative, perturbed copy of the question that carries a fake answer."""
    words = [w for w in re.findall(r"[\w'-]+", question) if w.lower() not in WH_WORDS]
    sentence = " ".join(words + [fake_answer]).strip()
    swapped = swap_syn(sentence, rng, ratio=0.3, maximum=5) or sentence
    return swapped[:1].upper() + swapped[1:] + "."


def swap_syn_glue(rows: list[tuple], seed: int) -> tuple[list[tuple], list[int]]:
    """Transform every example's first text; returns the kept rows and their indices."""
    rng = random.Random(seed)
    kept, index = [], []
    for i, (a, b, label) in enumerate(rows):
        swapped = swap_syn(a, rng)
        if swapped is not None:
            kept.append((swapped, b, label))
            index.append(i)
    if not kept:
        raise UserError("no sentence had a synonym to swap; is the text English?")
    return kept, index


def _device() -> str:
    """Where a robustness evaluation runs: a GPU where there is one (full dev sets, scored twice)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def classify(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[tuple], regression: bool,
             max_len: int = 128, batch_size: int = 64) -> np.ndarray:
    """A classifier's predictions (a class, or a score for STS-B) for (text_a, text_b, label) rows; each batch
    is padded to its longest example."""
    import torch

    model.eval()
    device = next(model.parameters()).device
    outputs = []
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start: start + batch_size]
            b = [r[1] for r in batch] if batch[0][1] is not None else None
            enc = tokenizer([r[0] for r in batch], b, truncation=True, max_length=max_len, padding=True,
                            return_tensors="pt").to(device)
            logits = model(**enc).logits
            outputs.append((logits.squeeze(-1).float() if regression else logits.argmax(-1)).cpu())
    return torch.cat(outputs).numpy()


def evaluate_glue(task_name: str, model_dir: str | Path, data_dir: str | Path, output_dir: str | Path, seed: int = 42,
                  max_eval_samples: int | None = None) -> dict:
    """Score a fine-tuned classifier on the original dev set and its SwapSynWordNet transform."""
    import json
    from pathlib import Path

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from truneg.glue import TASKS, compute_metrics, main_metric, read_tsv, resolve_model_dir
    from truneg.models import load_pretrained

    if task_name not in TASKS:
        raise UserError(f"unknown GLUE task {task_name!r}; choose one of {', '.join(TASKS)}")
    task = TASKS[task_name]
    model_dir = resolve_model_dir(model_dir)
    rows = read_tsv(Path(data_dir) / task.dev_files[0], task)[:max_eval_samples]  # (read_tsv refuses no rows)
    transformed, index = swap_syn_glue(rows, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(AutoModelForSequenceClassification, model_dir, "--model").to(_device())
    regression = task.labels is None
    metric = main_metric(task_name)
    scores = {}
    for name, subset in (("original", [rows[i] for i in index]), ("transformed", transformed)):
        predictions = classify(model, tokenizer, subset, regression)
        scores[name] = 100 * compute_metrics(task_name, predictions, np.array([r[2] for r in subset]))[metric]
    results = {"task": task_name, "transform": "SwapSynWordNet", "metric": metric, **scores,
               "drop": scores["original"] - scores["transformed"], "examples": len(index), "dropped_out": len(rows) - len(index),
               "seed": seed}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "robustness.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


def evaluate_squad(model_dir: str | Path, dev_file: str | Path, output_dir: str | Path, seed: int = 42,
                   max_eval_samples: int | None = None, max_seq_len: int = 384, doc_stride: int = 128) -> dict:
    """EM/F1 of a fine-tuned QA model on SQuAD dev, and with an AddSentDiverse-style distractor appended."""
    import json
    from pathlib import Path

    from transformers import AutoModelForQuestionAnswering, AutoTokenizer

    from truneg.glue import resolve_model_dir
    from truneg.models import load_pretrained
    from truneg.squad import (
        check_doc_stride,
        evaluate_predictions,
        predict_answers,
        read_squad,
        some_examples,
    )

    check_doc_stride(max_seq_len, doc_stride)
    model_dir = resolve_model_dir(model_dir)
    examples = some_examples(read_squad(dev_file)[:max_eval_samples], dev_file, "question")
    rng = random.Random(seed)
    answers = [e["answers"][0] for e in examples if e["answers"]]
    attacked = []
    for example in examples:
        fake = rng.choice([a for a in answers if a not in example["answers"]] or ["nothing"])
        distractor = add_sent_distractor(example["question"], fake, rng)
        attacked.append({**example, "context": example["context"] + " " + distractor})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(AutoModelForQuestionAnswering, model_dir, "--model").to(_device())
    scores = {name: evaluate_predictions(data, predict_answers(model, tokenizer, data, max_seq_len, doc_stride))
              for name, data in (("original", examples), ("transformed", attacked))}
    results = {"transform": "AddSentDiverse", **{f"{k}_{m}": v for k, d in scores.items() for m, v in d.items()},
               "drop_f1": scores["original"]["f1"] - scores["transformed"]["f1"],
               "drop_exact_match": scores["original"]["exact_match"] - scores["transformed"]["exact_match"],
               "examples": len(examples), "seed": seed}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "robustness.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results
