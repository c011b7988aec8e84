"""The paper's pre-training variants (Tables 3 and 6), their `pretrain.py` flags and folders, and Table 3's
GLUE columns; free of torch, for `truneg report` as much as for `truneg ablation`."""
from __future__ import annotations

from pathlib import Path

# name: pretrain.py's flags. The first four are Table 3's (HC and SR with WordNet and word-level SR); Table 6
# adds HC over word2vec neighbours (`--hc embedding`, whose vectors `--hc-embeddings` names) and sentence-level SR.
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    "HC": ["--hc", "wordnet"],
    "SR": ["--sr", "word"],
    "HC+SR": ["--hc", "wordnet", "--sr", "word"],
    "HC_Embedding": ["--hc", "embedding"],
    "SR_Sent": ["--sr", "sent"],
}
DEFAULT_VARIANTS = ("baseline", "HC", "SR", "HC+SR")
BASELINE = "baseline"

# Table 3's columns in the paper's order: (task, column, metric); MNLI has its matched and mismatched dev sets,
# and the average counts MNLI once (matched), as the paper's average of eight tasks does.
GLUE_COLUMNS = (("cola", "CoLA", "matthews_correlation"), ("sst2", "SST-2", "accuracy"), ("mrpc", "MRPC", "accuracy"),
                ("stsb", "STS-B", "spearmanr"), ("qqp", "QQP", "accuracy"), ("mnli", "MNLI-m", "accuracy"),
                ("mnli", "MNLI-mm", "accuracy_mm"), ("qnli", "QNLI", "accuracy"), ("rte", "RTE", "accuracy"))
AVERAGED = ("CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI-m", "QNLI", "RTE")


def folder_name(variant: str) -> str:
    """A variant's folder under the ablation's --output-dir (HC+SR: HC_SR)."""
    return variant.replace("+", "_")


def variant_of_folder(name: str) -> str:
    return {folder_name(v): v for v in VARIANTS}.get(name, name)


def run_dir(out: Path, variant: str) -> Path:
    return out / folder_name(variant)
