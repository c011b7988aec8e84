"""Fine-tuning recipes by model family and size: ELECTRA's, BERT's and RoBERTa's published hyper-parameters.

The size comes from the model's hidden size (small below 768, base up to 1023, large from 1024), the family
from its `model_type` (`--recipe electra|bert|roberta` chooses another: the paper fine-tuned its BERTs with
ELECTRA's).
A flag given on the command line wins over the recipe. docs/evaluation.md has the table with its sources.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoConfig

from truneg.errors import UserError

FAMILIES = ("electra", "bert", "roberta")
SIZES = ("small", "base", "large")


@dataclass(frozen=True)
class Recipe:
    lr: float
    layerwise_decay: float  # 1: off
    epochs: int | None  # None: the task's own (ELECTRA: 10 for RTE and STS-B, else 3)
    batch_size: int
    warmup_ratio: float
    max_seq_len: int
    doc_stride: int | None = None  # SQuAD only
    source: str = ""


ELECTRA_GLUE = "ELECTRA paper, Appendix A, Table 7; google-research/electra configure_finetuning.py"
ELECTRA_SQUAD = ELECTRA_GLUE + " (SQuAD: max_seq_length 512, doc_stride 128, 2 epochs)"
BERT_GLUE = ("BERT paper §4.1: batch 32, 3 epochs, lr searched in {5e-5, 4e-5, 3e-5, 2e-5}: 2e-5 picked, as "
             "google-research/bert's run_classifier example; warmup_proportion 0.1")
BERT_SQUAD = ("BERT paper §4.2 (SQuAD v1.1: 3 epochs, lr 5e-5, batch 32); google-research/bert run_squad.py: "
              "max_seq_length 384, doc_stride 128")
BERT_SMALL = ("Turc et al. 2019 (google-research/bert README, compact models): 4 epochs, lr searched in "
              "{3e-4, 1e-4, 5e-5, 3e-5}, batch in {8, ..., 128}: 1e-4 and 32 picked")
# One point of RoBERTa's sweep, the one fairseq's GLUE table gives most of its tasks (MNLI, QNLI, QQP, SST-2)
ROBERTA_GLUE = ("RoBERTa paper, Appendix C, Table 10: lr {1e-5, 2e-5, 3e-5}, batch {16, 32}, 10 epochs, warmup 6 %; "
                "lr 1e-5 and batch 32 picked, fairseq's RoBERTa GLUE README's point for MNLI, QNLI, QQP and SST-2")
ROBERTA_SQUAD = "RoBERTa publishes no SQuAD recipe: BERT's (" + BERT_SQUAD + ")"
ROBERTA = {size: (Recipe(1e-5, 1.0, 10, 32, 0.06, 128, source=ROBERTA_GLUE),
                  Recipe(5e-5, 1.0, 3, 32, 0.1, 384, 128, source=ROBERTA_SQUAD)) for size in ("base", "large")}

# (family, size) -> (GLUE's recipe, SQuAD's recipe)
RECIPES: dict[tuple[str, str], tuple[Recipe, Recipe]] = {
    ("electra", "small"): (Recipe(3e-4, 0.8, None, 32, 0.1, 128, source=ELECTRA_GLUE),
                           Recipe(3e-4, 0.8, 2, 32, 0.1, 512, 128, source=ELECTRA_SQUAD)),
    ("electra", "base"): (Recipe(1e-4, 0.8, None, 32, 0.1, 128, source=ELECTRA_GLUE),
                          Recipe(1e-4, 0.8, 2, 32, 0.1, 512, 128, source=ELECTRA_SQUAD)),
    ("electra", "large"): (Recipe(5e-5, 0.9, None, 32, 0.1, 128, source=ELECTRA_GLUE),
                           Recipe(5e-5, 0.9, 2, 32, 0.1, 512, 128, source=ELECTRA_SQUAD)),
    ("bert", "small"): (Recipe(1e-4, 1.0, 4, 32, 0.1, 128, source=BERT_SMALL),
                        Recipe(1e-4, 1.0, 4, 32, 0.1, 384, 128, source=BERT_SMALL + "; SQuAD: no published "
                               "recipe, BERT's lengths")),
    ("bert", "base"): (Recipe(2e-5, 1.0, 3, 32, 0.1, 128, source=BERT_GLUE),
                       Recipe(5e-5, 1.0, 3, 32, 0.1, 384, 128, source=BERT_SQUAD)),
    ("bert", "large"): (Recipe(2e-5, 1.0, 3, 32, 0.1, 128, source=BERT_GLUE),
                        Recipe(5e-5, 1.0, 3, 32, 0.1, 384, 128, source=BERT_SQUAD)),
    ("roberta", "small"): ROBERTA["base"],  # no small RoBERTa was published: base's
    ("roberta", "base"): ROBERTA["base"],
    ("roberta", "large"): ROBERTA["large"],
}
# The flags a recipe sets when they are not given (the flag's dest: the recipe's field)
FIELDS = ("lr", "layerwise_decay", "epochs", "batch_size", "warmup_ratio", "max_seq_len", "doc_stride")


def model_size(hidden_size: int) -> str:
    """ELECTRA-small's 256 and BERT's compact models (<= 512) are small, 768 base, 1024 large."""
    return "small" if hidden_size < 768 else "base" if hidden_size < 1024 else "large"


def recipe_for(family: str, hidden_size: int, benchmark: str) -> Recipe:
    """The published recipe for a family (FAMILIES) at this hidden size, for "glue" or "squad"."""
    if family not in FAMILIES:
        raise UserError(f"--recipe {family}: choose auto, {', '.join(FAMILIES[:-1])} or {FAMILIES[-1]}")
    glue, squad = RECIPES[(family, model_size(hidden_size))]
    return squad if benchmark == "squad" else glue


def model_recipe(model_dir: str | Path, benchmark: str, family: str = "auto") -> Recipe:
    """The recipe of a model folder (or hub name), from its config: its family unless `family` names one."""
    config = AutoConfig.from_pretrained(str(model_dir))
    if family == "auto":
        family = {"electra": "electra", "roberta": "roberta", "xlm-roberta": "roberta"}.get(config.model_type, "bert")
    return recipe_for(family, config.hidden_size, benchmark)


def fill(given: dict, recipe: Recipe) -> dict:
    """The recipe's values for the FIELDS that `given` leaves None (flags not given), the given ones kept."""
    values = asdict(recipe)
    return {k: values[k] if given.get(k) is None else given[k] for k in FIELDS if k in given}
