"""Robustness to synonym swaps and distractors (the paper's Table 5, on SQuAD; SwapSyn on GLUE too).

- `swap_syn_edits`: TextFlint's SwapSynWordNet with nltk's WordNet. POS-tag the words, skip stopwords and
  punctuation, replace int(10 %) of the words (at least 1, at most 10) by a single-word lemma, other than the
  word, of a synset of the same POS; a fixed seed; a text with no candidate drops out. Only the chosen words'
  characters change (the rest of the text stays as written); on SQuAD the context, outside the answers.
- `add_sent_distractor`: TextFlint's AddSentDiverse without CoreNLP: the question altered so that the
  distractor does not answer it (WordNet antonyms, nearby numbers, another question's proper nouns; a
  question with nothing to alter drops out), made declarative with a fake answer (another question's),
  and inserted before the context's sentence that holds the answer.

POS tags come from nltk's perceptron tagger when its data is installed; otherwise from WordNet itself:
each word takes the part of speech whose senses are most frequent in SemCor (WordNet's own tag counts).
"""
from __future__ import annotations

import json
import random
import re
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import nltk
import numpy as np
import torch
from nltk.tokenize import TreebankWordTokenizer
from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS
from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification, AutoTokenizer

from truneg.errors import UserError
from truneg.eval.glue import TASKS, compute_metrics, main_metric, read_tsv, resolve_model_dir
from truneg.eval.squad import (
    check_doc_stride,
    evaluate_predictions,
    predict_answers,
    read_squad,
    some_examples,
)
from truneg.model.presets import load_pretrained
from truneg.synonyms.wordnet import load_wordnet

if TYPE_CHECKING:
    from pathlib import Path

    from transformers import PreTrainedModel, PreTrainedTokenizerBase

WORDNET_POS = {"NN": "n", "VB": "v", "JJ": "a", "RB": "r"}
WH_WORDS = {"what", "which", "who", "whom", "whose", "when", "where", "why", "how"}


class Tools(NamedTuple):
    tokenizer: object  # nltk's TreebankWordTokenizer
    stopwords: frozenset
    wordnet: object  # nltk's WordNet corpus reader


@lru_cache(maxsize=1)
def _tools() -> Tools:
    return Tools(TreebankWordTokenizer(), ENGLISH_STOP_WORDS, load_wordnet())


@lru_cache(maxsize=200_000)
def wordnet_pos(word: str) -> str | None:
    """The part of speech whose WordNet senses of `word` are most frequent in SemCor (None: not in WordNet)."""
    wn = _tools().wordnet
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
    try:
        return [WORDNET_POS.get(tag[:2]) for _, tag in nltk.pos_tag(words)]
    except LookupError:  # the tagger's data is not installed: WordNet's own sense frequencies
        return [wordnet_pos(w.lower()) if w.isalpha() else None for w in words]


def synonyms(word: str, pos: str) -> list[str]:
    wn = _tools().wordnet
    names = {lemma.name() for s in wn.synsets(word, pos) for lemma in s.lemmas()}
    return sorted(n for n in names if "_" not in n and "-" not in n and n.lower() != word.lower())


Edit = tuple[int, int, str]  # characters [start, end) of a text, and what replaces them


def word_spans(text: str) -> list[tuple[int, int]]:
    """The Treebank tokenizer's words of `text` as character spans (its own alignment; where it fails on odd
    quotes, words and single punctuation marks)."""
    try:
        return list(_tools().tokenizer.span_tokenize(text))
    except ValueError:
        return [m.span() for m in re.finditer(r"\w+|[^\w\s]", text)]


def _cased(replacement: str, word: str) -> str:
    """A capitalised word's replacement capitalised (its other letters as WordNet writes them: "CA", "UK")."""
    return replacement[:1].upper() + replacement[1:] if word[:1].isupper() else replacement


def swap_syn_edits(text: str, rng: random.Random, ratio: float = 0.1, minimum: int = 1, maximum: int = 10,
                   keep: list[tuple[int, int]] = ()) -> list[Edit] | None:
    """SwapSynWordNet's swaps of `text` (none inside the `keep` spans), in text order, or None when no word is
    a candidate (the text drops out)."""
    stopwords = _tools().stopwords
    spans = word_spans(text)
    words = [text[start:end] for start, end in spans]
    candidates = {}
    for i, (word, pos) in enumerate(zip(words, pos_tags(words))):
        kept = any(start < spans[i][1] and spans[i][0] < end for start, end in keep)
        # a whole word, not a piece the tokenizer cut out of one ("got" of "gotta")
        whole = not text[spans[i][0] - 1: spans[i][0]].isalnum() and not text[spans[i][1]: spans[i][1] + 1].isalnum()
        if pos and word.isalpha() and word.lower() not in stopwords and not kept and whole:
            options = synonyms(word.lower(), pos)
            if options:
                candidates[i] = options
    if not candidates:
        return None
    count = max(minimum, min(maximum, int(ratio * len(words)), len(candidates)))  # TextFlint's get_trans_cnt
    edits = [(*spans[i], _cased(rng.choice(candidates[i]), words[i])) for i in rng.sample(sorted(candidates), count)]
    return sorted(edits)


def apply_edits(text: str, edits: list[Edit]) -> str:
    """`text` with the (non-overlapping, sorted) edits made."""
    pieces, at = [], 0
    for start, end, replacement in edits:
        pieces += [text[at:start], replacement]
        at = end
    return "".join(pieces) + text[at:]


def moved(position: int, edits: list[Edit]) -> int:
    """Where a character position outside the edits is in the edited text."""
    return position + sum(len(new) - (end - start) for start, end, new in edits if end <= position)


def swap_syn(sentence: str, rng: random.Random, ratio: float = 0.1, minimum: int = 1, maximum: int = 10) -> str | None:
    """The sentence with synonym swaps, or None when it has no candidate (it drops out)."""
    edits = swap_syn_edits(sentence, rng, ratio, minimum, maximum)
    return None if edits is None else apply_edits(sentence, edits)


def antonym(word: str, pos: str) -> str | None:
    """A single-word WordNet antonym of `word` (or of its base form: "won" -> lose, "largest" -> small) in that
    part of speech (the first, in sorted order)."""
    wn = _tools().wordnet
    forms = {word.lower(), (wn.morphy(word.lower(), pos) or word).lower()}
    names = {a.name() for s in wn.synsets(word, pos) for lemma in s.lemmas() if lemma.name().lower() in forms
             for a in lemma.antonyms()}
    return min((n for n in names if "_" not in n and "-" not in n), default=None)


def proper_nouns(questions: list[str]) -> list[str]:
    """The capitalised words inside questions (not their first word): AddSentDiverse's stand-ins for proper
    nouns, one of which replaces another's."""
    found = {q[start:end] for q in questions for start, end in word_spans(q)[1:] if q[start:start + 1].isupper()
             and q[start:end].isalpha() and q[start:end].lower() not in _tools().stopwords}
    return sorted(found)


def alter_question(question: str, rng: random.Random, nouns: list[str]) -> str | None:
    """AddSentDiverse's altered question: each word that has a WordNet antonym takes it, each number a nearby
    one, each capitalised word inside the question another question's; None when nothing could be altered."""
    spans = word_spans(question)
    words = [question[start:end] for start, end in spans]
    edits = []
    for i, (word, pos) in enumerate(zip(words, pos_tags(words))):
        new = None
        if re.fullmatch(r"[0-9]+", word):  # a nearby number: a year a few years off, another within a fifth of it
            value = int(word)
            new = str(max(0, value + rng.choice([-1, 1]) * rng.randint(1, 10 if 1000 <= value < 3000 else
                                                                          max(1, value // 5))))
        elif word.isalpha() and pos and (opposite := antonym(word.lower(), pos)):
            new = _cased(opposite, word)
        elif i > 0 and word[:1].isupper() and word.isalpha():
            others = [n for n in nouns if n != word]
            new = rng.choice(others) if others else None
        if new is not None and new != word:
            edits.append((*spans[i], new))
    return apply_edits(question, edits) if edits else None


def add_sent_distractor(altered_question: str, fake_answer: str) -> str:
    """The altered question made declarative (its question words dropped) with a fake answer at its end."""
    words = [w for w in re.findall(r"[\w'-]+", altered_question) if w.lower() not in WH_WORDS]
    sentence = " ".join(words + [fake_answer]).strip()
    return sentence[:1].upper() + sentence[1:] + ("" if sentence.endswith(".") else ".")


SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+")
# A period after these ends no sentence: "St. Louis", "Dr. Who", "U.S. Army", "J. Smith", "vs. them"
ABBREVIATION = re.compile(r"(?:[A-Z][a-z]{0,2}|[A-Za-z](?:\.[A-Za-z])+|vs|etc)\.")


def sentence_starts(text: str) -> list[int]:
    """Where `text`'s sentences start (0 first): after . ! or ? (and closing quotes or brackets) and whitespace,
    but not after an abbreviation's period."""
    starts = [0]
    for match in SENTENCE_END.finditer(text):
        before = text[:match.start() + 1].rsplit(None, 1)[-1]
        if not ABBREVIATION.fullmatch(before):
            starts.append(match.end())
    return starts


def insert_before_answer(example: dict, distractor: str) -> dict:
    """The example with `distractor` inserted before the context's sentence that holds the (first) answer; the
    answers' starts moved with it."""
    context, first = example["context"], min(example["answer_starts"], default=0)
    at = max(start for start in sentence_starts(context) if start <= first)
    added = distractor + " "
    starts = [s + len(added) if s >= at else s for s in example["answer_starts"]]
    return {**example, "context": context[:at] + added + context[at:], "answer_starts": starts}


def swap_syn_squad(example: dict, rng: random.Random) -> dict | None:
    """SwapSynWordNet on a SQuAD context, none of its answers' words swapped (the answers' starts moved with
    the swaps); None when nothing can be swapped."""
    keep = [(s, s + len(a)) for s, a in zip(example["answer_starts"], example["answers"])]
    edits = swap_syn_edits(example["context"], rng, keep=keep)
    if edits is None:
        return None
    return {**example, "context": apply_edits(example["context"], edits),
            "answer_starts": [moved(s, edits) for s in example["answer_starts"]]}


def add_sent_squad(examples: list[dict], rng: random.Random) -> list[dict | None]:
    """AddSentDiverse on each SQuAD example (None where its question has nothing to alter)."""
    nouns = proper_nouns([e["question"] for e in examples])
    answers = [e["answers"][0] for e in examples if e["answers"]]
    attacked = []
    for example in examples:
        fake = rng.choice([a for a in answers if a not in example["answers"]] or ["nothing"])
        altered = alter_question(example["question"], rng, nouns)
        attacked.append(None if altered is None else insert_before_answer(example, add_sent_distractor(altered, fake)))
    return attacked


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
    return "cuda" if torch.cuda.is_available() else "cpu"


def classify(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[tuple], regression: bool,
             max_len: int = 128, batch_size: int = 64) -> np.ndarray:
    """A classifier's predictions (a class, or a score for STS-B) for (text_a, text_b, label) rows; each batch
    is padded to its longest example."""
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
                  max_eval_samples: int | None = None, max_seq_len: int = 128) -> dict:
    """Score a fine-tuned classifier on the original dev set and its SwapSynWordNet transform."""
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
        predictions = classify(model, tokenizer, subset, regression, max_len=max_seq_len)
        scores[name] = 100 * compute_metrics(task_name, predictions, np.array([r[2] for r in subset]))[metric]
    results = {"task": task_name, "transform": "SwapSynWordNet", "metric": metric, **scores,
               "drop": scores["original"] - scores["transformed"], "examples": len(index),
               "dropped_out": len(rows) - len(index),
               "seed": seed}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "robustness.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


SQUAD_ATTACKS = {"add-sent": "AddSentDiverse", "swap-syn": "SwapSynWordNet"}


def evaluate_squad(model_dir: str | Path, dev_file: str | Path, output_dir: str | Path, seed: int = 42,
                   max_eval_samples: int | None = None, max_seq_len: int = 384, doc_stride: int = 128,
                   attack: str = "add-sent") -> dict:
    """EM/F1 of a fine-tuned QA model on SQuAD dev questions, as they are and attacked (`SQUAD_ATTACKS`), over
    the questions the attack could transform."""
    check_doc_stride(max_seq_len, doc_stride)
    model_dir = resolve_model_dir(model_dir)
    examples = some_examples(read_squad(dev_file)[:max_eval_samples], dev_file, "question")
    rng = random.Random(seed)
    if attack == "add-sent":
        transformed = add_sent_squad(examples, rng)
    else:
        transformed = [swap_syn_squad(example, rng) for example in examples]
    kept = [i for i, example in enumerate(transformed) if example is not None]
    if not kept:
        raise UserError(f"{SQUAD_ATTACKS[attack]} could transform no question of {dev_file}; is the text English?")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(AutoModelForQuestionAnswering, model_dir, "--model").to(_device())
    scores = {name: evaluate_predictions(data, predict_answers(model, tokenizer, data, max_seq_len, doc_stride))
              for name, data in (("original", [examples[i] for i in kept]),
                                 ("transformed", [transformed[i] for i in kept]))}
    results = {"transform": SQUAD_ATTACKS[attack], **{f"{k}_{m}": v for k, d in scores.items() for m, v in d.items()},
               "drop_f1": scores["original"]["f1"] - scores["transformed"]["f1"],
               "drop_exact_match": scores["original"]["exact_match"] - scores["transformed"]["exact_match"],
               "examples": len(kept), "dropped_out": len(examples) - len(kept), "seed": seed}
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / "robustness.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results
