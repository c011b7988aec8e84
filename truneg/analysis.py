"""False-negative analysis of any checkpoint: the paper's Table 2 (ratios), Figure 3 and Table 1 (cases).

A checkpoint's MLM (BERT's, or ELECTRA's generator) runs over a corpus with the training masking and a
fixed seed; a masked position is a false negative when the prediction differs from the gold token and
is its synonym (the HC test). Reported per checkpoint:
- iteration level: the share of sequences with at least one false negative;
- prediction level: the share of mismatched predictions that are false negatives.
"""
from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from truneg.errors import UserError

CSV_COLUMNS = ["checkpoint", "step", "sequences", "masked", "mismatched", "corrected", "iter_ratio", "pred_ratio"]


@dataclass
class FnCounts:
    checkpoint: str
    step: int
    sequences: int = 0
    masked: int = 0
    mismatched: int = 0
    corrected: int = 0
    sequences_corrected: int = 0

    @property
    def iter_ratio(self) -> float:
        return self.sequences_corrected / self.sequences if self.sequences else 0.0

    @property
    def pred_ratio(self) -> float:
        return self.corrected / self.mismatched if self.mismatched else 0.0

    def row(self) -> dict:
        return {**asdict(self), "iter_ratio": self.iter_ratio, "pred_ratio": self.pred_ratio}


@dataclass
class Case:
    context: list[str]  # tokens of the sequence; the masked position holds the gold token
    position: int
    gold: str
    pred: str
    synonyms: list[str] = field(default_factory=list)


def count_false_negatives(gold: torch.Tensor, pred: torch.Tensor, corrected: torch.Tensor, masked: torch.Tensor) -> dict:
    """Counts over one batch. gold/pred/corrected are 1-D over the masked positions of `masked` [B, L]."""
    per_sequence = torch.zeros_like(masked)
    per_sequence[masked] = corrected
    return {
        "sequences": masked.shape[0],
        "masked": int(masked.sum()),
        "mismatched": int((pred != gold).sum()),
        "corrected": int(corrected.sum()),
        "sequences_corrected": int(per_sequence.any(dim=1).sum()),
    }


# ---------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------


@dataclass
class CheckpointRef:
    label: str
    step: int
    path: Path
    kind: str  # "hf" (a from_pretrained folder) or "truneg" (a tag of a truneg checkpoints folder)


def _tag_step(name: str) -> int:
    return int(name.removeprefix("global_step")) if name.removeprefix("global_step").isdigit() else -1


def discover_checkpoints(paths: list[str | Path]) -> list[CheckpointRef]:
    """Each PATH: a truneg checkpoints folder (all its tags), one tag, or an exported HF MLM/generator."""
    found: list[CheckpointRef] = []
    for raw in paths:
        path = Path(raw)
        if (path / "generator" / "config.json").is_file():
            found.append(CheckpointRef(str(path), -1, path / "generator", "hf"))
        elif (path / "config.json").is_file():
            found.append(CheckpointRef(str(path), -1, path, "hf"))
        elif (path / "checkpoints" / "latest").is_file() or (path / "latest").is_file():
            folder = path / "checkpoints" if (path / "checkpoints" / "latest").is_file() else path
            tags = sorted((p for p in folder.glob("global_step*") if p.is_dir() and _tag_step(p.name) >= 0),
                          key=lambda p: _tag_step(p.name))
            found.extend(CheckpointRef(f"{folder}/{t.name}", _tag_step(t.name), t, "truneg") for t in tags)
        elif path.is_dir() and (path.parent / "hf_config").is_dir():
            found.append(CheckpointRef(str(path), _tag_step(path.name), path, "truneg"))
        else:
            raise UserError(f"{path} is neither a truneg checkpoints folder, a tag in one, nor an HF model folder "
                            "(config.json); pass one of those")
    return found


def load_mlm(ref: CheckpointRef):
    """The masked LM of a checkpoint: BertForMaskedLM, or ELECTRA's generator (ElectraForMaskedLM)."""
    from transformers import AutoConfig, BertForMaskedLM, ElectraForMaskedLM

    if ref.kind == "truneg":
        from truneg.export import load_parts

        parts, _ = load_parts(ref.path)
        return parts.get("mlm") or parts["generator"]
    architectures = AutoConfig.from_pretrained(ref.path).architectures or []
    if "BertForMaskedLM" in architectures:
        return BertForMaskedLM.from_pretrained(ref.path)
    if "ElectraForMaskedLM" in architectures:
        return ElectraForMaskedLM.from_pretrained(ref.path)
    raise UserError(f"{ref.path} holds a {architectures or 'model'} without an MLM head; pass a BERT MLM or an ELECTRA generator")


# ---------------------------------------------------------------------------------------------------
# Running the MLM
# ---------------------------------------------------------------------------------------------------


def evaluate(mlm, blocks: np.ndarray, tokenizer, lookup, prediction: str = "default", seed: int = 0,
             batch_size: int = 32, max_sequences: int | None = None, label: str = "", step: int = -1,
             max_cases: int = 0, table=None) -> tuple[FnCounts, list[Case]]:
    """Mask each block as training would (seed, epoch 0, block index) and count the HC corrections."""
    from transformers import BertForMaskedLM

    from truneg.data import mask_tokens
    from truneg.models import bert_masked_logits, generator_masked_logits
    from truneg.objectives import gumbel_max_sample, hard_correction

    is_bert = isinstance(mlm, BertForMaskedLM)
    scheme, logits_of = ("bert", bert_masked_logits) if is_bert else ("electra", generator_masked_logits)
    prediction = ("argmax" if is_bert else "sample") if prediction == "default" else prediction
    counts, cases = FnCounts(label, step), []
    total = len(blocks) if max_sequences is None else min(max_sequences, len(blocks))
    torch.manual_seed(seed)
    mlm.eval()
    with torch.no_grad():
        for start in range(0, total, batch_size):
            indices = np.arange(start, min(start + batch_size, total))
            original = np.asarray(blocks[indices], dtype=np.int64)
            inputs, labels = mask_tokens(original, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                                         scheme, seed, 0, indices)
            masked = labels != -100
            gold = labels[masked]
            logits = logits_of(mlm, inputs, torch.ones_like(inputs), masked)
            pred = logits.argmax(-1) if prediction == "argmax" else gumbel_max_sample(logits)
            corrected = hard_correction(gold, pred, lookup)
            for key, value in count_false_negatives(gold, pred, corrected, masked).items():
                setattr(counts, key, getattr(counts, key) + value)
            if len(cases) < max_cases and corrected.any():
                rows, cols = masked.nonzero(as_tuple=True)
                for k in corrected.nonzero().flatten().tolist()[: max_cases - len(cases)]:
                    row, col = int(rows[k]), int(cols[k])
                    gold_token = tokenizer.convert_ids_to_tokens(int(gold[k]))
                    cases.append(Case(tokenizer.convert_ids_to_tokens(original[row].tolist()), col, gold_token,
                                      tokenizer.convert_ids_to_tokens(int(pred[k])),
                                      table.synonyms_of(gold_token) if table is not None else []))
    return counts, cases


# ---------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------


def format_table(results: list[FnCounts]) -> str:
    header = f"{'checkpoint':<48} {'step':>7} {'seqs':>7} {'masked':>8} {'mismatch':>9} {'FN':>6} {'iter %':>7} {'pred %':>7}"
    lines = [header, "-" * len(header)]
    for r in results:
        name = r.checkpoint if len(r.checkpoint) <= 48 else "..." + r.checkpoint[-45:]
        lines.append(f"{name:<48} {r.step:>7} {r.sequences:>7} {r.masked:>8} {r.mismatched:>9} {r.corrected:>6} "
                     f"{100 * r.iter_ratio:>7.2f} {100 * r.pred_ratio:>7.3f}")
    return "\n".join(lines)


def write_stats(results: list[FnCounts], out: Path) -> dict[str, Path]:
    import csv

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
    ax.set_title("False negatives met by the MLM")
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
