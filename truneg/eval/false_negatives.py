"""False-negative analysis of any checkpoint: the paper's Table 2 (ratios), Figure 3 and Table 1 (cases).

A checkpoint's MLM (BERT's, or ELECTRA's generator) runs over a corpus with the training masking and a
fixed seed; a masked position is a false negative when the prediction differs from the gold token and
is its synonym (the HC test). Reported per checkpoint:
- iteration level: the share of sequences with at least one false negative;
- prediction level: the share of mismatched predictions that are false negatives.

What a "sequence" is moves the iteration-level ratio (more masked positions, more chances), so the
segmentation and the length are recorded with every row: `packed` blocks cut the token stream across
lines and articles (as pre-training does here); `line` and `article` sequences never cross a line or
an article (a long one becomes several sequences) and are padded with [PAD].
"""
from __future__ import annotations

import csv
import html
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import ElectraForMaskedLM

from truneg.data.blocks import open_training_blocks
from truneg.data.corpus import is_hf, resolve_text_files
from truneg.errors import UserError
from truneg.model.families import max_positions
from truneg.model.pretrainers import BertPretrainer, ElectraPretrainer
from truneg.train.heldout import masked_batch, masked_logits, mlm_sums, sample_with

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from truneg.synonyms.table import SynonymLookup, SynonymTable

CSV_COLUMNS = ["checkpoint", "step", "segmentation", "seq_len", "sequences", "masked", "mismatched", "corrected",
               "iter_ratio", "pred_ratio", "mlm_accuracy"]
# WikiText's article titles are ` = Title = ` lines; sections are ` = = Section = = `.
WIKITEXT_TITLE = re.compile(r"^\s*= [^=](.*[^=])? =\s*$")


@dataclass
class FnCounts:
    checkpoint: str
    step: int
    segmentation: str = "packed"
    seq_len: int = 0
    sequences: int = 0
    masked: int = 0
    mismatched: int = 0
    corrected: int = 0
    sequences_corrected: int = 0
    mlm_correct: int = 0  # masked positions whose argmax is the gold token (whatever --prediction HC judges)

    @property
    def iter_ratio(self) -> float:
        return self.sequences_corrected / self.sequences if self.sequences else 0.0

    @property
    def pred_ratio(self) -> float:
        return self.corrected / self.mismatched if self.mismatched else 0.0

    @property
    def mlm_accuracy(self) -> float:
        """The argmax MLM accuracy over all masked positions (BERT's masked_lm_accuracy)."""
        return self.mlm_correct / self.masked if self.masked else 0.0

    def row(self) -> dict:
        return {**asdict(self), "iter_ratio": self.iter_ratio, "pred_ratio": self.pred_ratio,
                "mlm_accuracy": self.mlm_accuracy}


@dataclass
class Case:
    context: list[str]  # tokens of the sequence; the masked position holds the gold token
    position: int
    gold: str
    pred: str
    synonyms: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Segmentation
# ---------------------------------------------------------------------------------------------------


def text_segments(files: list[Path], segmentation: str) -> list[str]:
    """The texts no sequence may cross: each non-blank line, or each article.

    An article ends at the end of a file or where a WikiText article title (` = Title = `) begins;
    a text without such titles is one article per file.
    """
    segments: list[str] = []
    for path in files:
        article: list[str] = []
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if segmentation == "line":
                segments += [line] if line.strip() else []
                continue
            if WIKITEXT_TITLE.match(line) and article:
                segments.append("\n".join(article))
                article = []
            if line.strip():
                article.append(line)
        if article:
            segments.append("\n".join(article))
    return segments


def segment_sequences(segments: list[str], tokenizer: PreTrainedTokenizerBase, seq_len: int) -> np.ndarray:
    """[n, seq_len] int32: each segment's tokens in consecutive [CLS] .. [SEP] sequences, [PAD] after."""
    body = seq_len - 2
    encoded = tokenizer(segments, add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"]
    pieces = [ids[start:start + body] for ids in encoded for start in range(0, len(ids), body)]
    sequences = np.full((len(pieces), seq_len), tokenizer.pad_token_id, dtype=np.int32)
    for row, piece in enumerate(pieces):
        sequences[row, 0] = tokenizer.cls_token_id
        sequences[row, 1:len(piece) + 1] = piece
        sequences[row, len(piece) + 1] = tokenizer.sep_token_id
    return sequences


def open_sequences(data: list[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, segmentation: str) -> np.ndarray:
    """The sequences fn-stats / fn-cases run over, for --segmentation packed | line | article."""
    if seq_len < 8:
        raise UserError(f"--seq-len {seq_len} is too short; use 128 or 512 (at least 8)")
    if segmentation == "packed":
        return open_training_blocks(data, tokenizer, seq_len)[0]
    if any(is_hf(spec) for spec in data):
        raise UserError(f"--segmentation {segmentation} reads text files; pass files, or use --segmentation packed "
                        "for an hf: dataset")
    sequences = segment_sequences(text_segments(resolve_text_files(data), segmentation), tokenizer, seq_len)
    if len(sequences) == 0:
        raise UserError(f"{', '.join(data)} holds no text to segment; give it some text")
    return sequences


def attention_mask_of(original: np.ndarray, pad_id: int) -> torch.Tensor | None:
    """1 on real tokens, 0 on the [PAD] that ends a line or article sequence; None for a batch without [PAD] (packed
    blocks: as a run's forward, which takes none)."""
    padded = original == pad_id
    return torch.from_numpy(~padded).long() if padded.any() else None


# ---------------------------------------------------------------------------------------------------
# Running the MLM
# ---------------------------------------------------------------------------------------------------


def evaluate(mlm: torch.nn.Module, blocks: np.ndarray, tokenizer: PreTrainedTokenizerBase,
             lookup: SynonymLookup, prediction: str = "default", seed: int = 0,
             batch_size: int = 32, max_sequences: int | None = None, label: str = "", step: int = -1,
             max_cases: int = 0, table: SynonymTable | None = None) -> tuple[FnCounts, list[Case]]:
    """Mask each block as training would (seed, epoch 0, block index) and count the HC corrections: the forward, the
    generator's per-sequence sample and the counting of a run's live evaluation (truneg.train.heldout). `mlm`: a
    masked LM of BERT's family (a BERT, a RoBERTa) or an ELECTRA generator."""
    if blocks.shape[1] > (positions := max_positions(mlm.config)):
        raise UserError(f"--seq-len {blocks.shape[1]} is beyond the model's {positions} positions "
                        f"({label or 'the checkpoint'}); use {positions} or less")
    is_bert = not isinstance(mlm, ElectraForMaskedLM)
    if prediction == "default":  # what pre-training's HC judges: BERT's argmax, ELECTRA's generator sample
        prediction = (BertPretrainer if is_bert else ElectraPretrainer).default_prediction
    counts, cases = FnCounts(label, step), []
    total = len(blocks) if max_sequences is None else min(max_sequences, len(blocks))
    mlm.eval()
    with torch.no_grad():
        for start in range(0, total, batch_size):
            indices = np.arange(start, min(start + batch_size, total))
            original = np.asarray(blocks[indices], dtype=np.int64)
            batch = masked_batch(original, indices, tokenizer, "bert" if is_bert else "electra", seed)
            positions, valid = batch["masked_positions"], batch["masked_valid"]
            gold = batch["original_ids"].gather(1, positions)
            attention_mask = attention_mask_of(original, tokenizer.pad_token_id)
            logits = masked_logits(mlm, batch["input_ids"], positions, attention_mask)
            pred = logits.argmax(-1) if prediction == "argmax" else sample_with(logits, batch["uniforms"])
            sums, corrected = mlm_sums(logits, gold, valid, pred, lookup, torch.ones(len(indices), dtype=torch.bool))
            for key in ("sequences", "masked", "mismatched", "corrected", "sequences_corrected", "mlm_correct"):
                setattr(counts, key, getattr(counts, key) + int(sums[key]))
            if len(cases) < max_cases and corrected.any():
                for row, slot in corrected.nonzero().tolist()[: max_cases - len(cases)]:
                    gold_token = tokenizer.convert_ids_to_tokens(int(gold[row, slot]))
                    # a line/article sequence's [PAD] tail
                    context = original[row][original[row] != tokenizer.pad_token_id]
                    cases.append(Case(tokenizer.convert_ids_to_tokens(context.tolist()), int(positions[row, slot]),
                                      gold_token, tokenizer.convert_ids_to_tokens(int(pred[row, slot])),
                                      table.synonyms_of(gold_token) if table is not None else []))
    return counts, cases


# ---------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------


def format_table(results: list[FnCounts]) -> str:
    header = (f"{'checkpoint':<48} {'step':>7} {'segments':>12} {'seqs':>7} {'masked':>8} {'mismatch':>9} {'FN':>6} "
              f"{'iter %':>7} {'pred %':>7} {'acc %':>7}")
    lines = [header, "-" * len(header)]
    for r in results:
        name = r.checkpoint if len(r.checkpoint) <= 48 else "..." + r.checkpoint[-45:]
        segments = f"{r.segmentation}/{r.seq_len}"
        lines.append(f"{name:<48} {r.step:>7} {segments:>12} {r.sequences:>7} {r.masked:>8} {r.mismatched:>9} "
                     f"{r.corrected:>6} "
                     f"{100 * r.iter_ratio:>7.2f} {100 * r.pred_ratio:>7.3f} {100 * r.mlm_accuracy:>7.2f}")
    return "\n".join(lines)


def write_stats(results: list[FnCounts], out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "fn_stats.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(r.row() for r in results)
    (out / "fn_stats.json").write_text(json.dumps([r.row() for r in results], indent=2) + "\n", encoding="utf-8")
    steps = [r.step if r.step >= 0 else i for i, r in enumerate(results)]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(steps, [100 * r.iter_ratio for r in results], "o-", label="iteration level (% sequences)")
    ax.plot(steps, [100 * r.pred_ratio for r in results], "s-", label="prediction level (% mismatches)")
    ax.set_xlabel("training step" if all(r.step >= 0 for r in results) else "checkpoint")
    ax.set_ylabel("false negatives (%)")
    settings = sorted({f"{r.segmentation}, {r.seq_len} tokens" for r in results})
    ax.set_title("False negatives met by the MLM" + (f" ({settings[0]})" if len(settings) == 1 else ""))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "fn_stats.png", dpi=120)
    plt.close(fig)
    return {name: out / name for name in ("fn_stats.csv", "fn_stats.json", "fn_stats.png")}


def _window(case: Case, width: int = 24) -> tuple[list[str], int]:
    start = max(1, case.position - width)
    tokens = [t for t in case.context[start: case.position + width + 1]]
    return tokens, case.position - start


def write_cases(cases: list[Case], out: Path) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    text_lines, rows = [], []
    for number, case in enumerate(cases, 1):
        tokens, at = _window(case)
        plain = " ".join(tokens[:at] + [f"[{case.gold} -> {case.pred}]"] + tokens[at + 1:]).replace(" ##", "")
        text_lines += [f"{number}. {plain}", f"   gold: {case.gold}   prediction: {case.pred}   "
                       f"synonyms of gold: {', '.join(case.synonyms)}", ""]
        marked = " ".join(html.escape(t) for t in tokens[:at]) + f" <mark>{html.escape(case.gold)}</mark> " + \
            " ".join(html.escape(t) for t in tokens[at + 1:])
        rows.append(f"<tr><td>{number}</td><td>{marked.replace(' ##', '')}</td><td>{html.escape(case.gold)}</td>"
                    f"<td><b>{html.escape(case.pred)}</b></td><td>{html.escape(', '.join(case.synonyms))}</td></tr>")
    (out / "cases.txt").write_text("\n".join(text_lines) + "\n", encoding="utf-8")
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>truneg false-negative cases</title><style>"
            "body{font-family:sans-serif;margin:2em}td{border-bottom:1px solid #ddd;padding:.4em;vertical-align:top}"
            "mark{background:#fd6}</style></head><body><h1>Corrected predictions (false negatives)</h1>"
            f"<p>{len(cases)} cases: the gold token is highlighted in its context.</p><table><tr><th>#</th>"
            "<th>context</th><th>gold</th><th>prediction</th><th>synonyms of gold</th></tr>"
            + "".join(rows) + "</table></body></html>\n")
    (out / "cases.html").write_text(page, encoding="utf-8")
    return {"cases.txt": out / "cases.txt", "cases.html": out / "cases.html"}
