"""Model presets and the two pre-trainers (BERT MLM, ELECTRA generator + discriminator) built from HF classes.

Each pre-trainer's forward takes a masked batch and returns `(loss, stats)`: the total loss and a dict
of 0-d tensors (sums and counts, so they add up across ranks) that `metrics.py` turns into ratios.
The MLM / generator head runs only at the masked positions.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

from truneg.errors import UserError
from truneg.objectives import (
    DISCRIMINATOR_WEIGHT,
    discriminator_loss,
    gumbel_max_sample,
    hard_correction,
    mlm_loss,
    replaced_token_labels,
    sentence_regularization,
    soft_regularization,
)
from truneg.synonyms import SynonymLookup

VOCAB_SIZE = 30522
MAX_POSITIONS = 512

BERT_PRESETS = {
    "bert-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
# (discriminator, generator); the generator is 1/4 (small) or 1/3 (base) as wide, same depth, and
# both share one embedding of `embedding_size`, as in the official ELECTRA.
ELECTRA_PRESETS = {
    "electra-tiny": (
        dict(embedding_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
        dict(embedding_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=1, intermediate_size=64),
    ),
    "electra-small": (
        dict(embedding_size=128, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024),
        dict(embedding_size=128, hidden_size=64, num_hidden_layers=12, num_attention_heads=1, intermediate_size=256),
    ),
    "electra-base": (
        dict(embedding_size=768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        dict(embedding_size=768, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024),
    ),
}
PRESETS = sorted(BERT_PRESETS) + sorted(ELECTRA_PRESETS)


@dataclass
class ObjectiveConfig:
    hc_lookup: SynonymLookup | None = None
    hc_prediction: str = "default"  # argmax | sample | default (BERT: argmax, ELECTRA: sample)
    sr: str = "none"  # none | word | sent
    sr_weight: float = 1.0


def is_electra(preset: str) -> bool:
    return preset.startswith("electra")


def check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")


def _common_config() -> dict:
    return {"vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS, "type_vocab_size": 2}


def bert_masked_logits(mlm: BertForMaskedLM, input_ids, attention_mask, masked) -> torch.Tensor:
    """MLM logits [M, V] at the masked positions only: the head runs on M rows, not B x L."""
    hidden = mlm.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return mlm.cls(hidden[masked])


def generator_masked_logits(generator: ElectraForMaskedLM, input_ids, attention_mask, masked) -> torch.Tensor:
    hidden = generator.electra(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    return generator.generator_lm_head(generator.generator_predictions(hidden[masked]))


def _correct(gold, pred, lookup: SynonymLookup | None) -> torch.Tensor | None:
    """HC's corrected mask, or None without HC (so the baseline loss is the plain cross-entropy)."""
    return None if lookup is None else hard_correction(gold, pred, lookup)


def _stats_for_predictions(gold, pred, corrected, masked) -> dict[str, torch.Tensor]:
    if corrected is None:
        corrected = torch.zeros_like(gold, dtype=torch.bool)
    corrected_full = torch.zeros_like(masked)
    corrected_full[masked] = corrected
    return {
        "sequences": torch.tensor(float(masked.shape[0]), device=gold.device),
        "masked": masked.sum().float(),
        "mismatched": (pred != gold).sum().float(),
        "corrected": corrected.sum().float(),
        "sequences_corrected": corrected_full.any(dim=1).sum().float(),
    }


class _Pretrainer(nn.Module):
    """What the BERT and ELECTRA pre-trainers share: the objective's settings and soft regularization."""

    default_prediction = "argmax"

    def set_objective(self, objective: ObjectiveConfig) -> None:
        self.objective, self.hc_lookup = objective, objective.hc_lookup
        use_default = objective.hc_prediction == "default"
        self.prediction = self.default_prediction if use_default else objective.hc_prediction
        # SR reads the embedding matrix outside the embedding's own forward; ZeRO-3 must gather it.
        import deepspeed

        deepspeed.zero.register_external_parameter(self, self.word_embeddings.weight)

    def add_soft_regularization(self, loss, stats: dict, gold, pred, sentence_pair) -> torch.Tensor:
        """loss + sr_weight * SR. `sentence_pair()` gives (H_p, H_s, attention mask), encoded only for SR_Sent."""
        if self.objective.sr == "none":
            return loss
        if self.objective.sr == "word":
            sr = soft_regularization(self.word_embeddings.weight, gold, pred)
        else:
            sr = sentence_regularization(*sentence_pair())
        stats["sr_loss"] = sr.detach()
        return loss + self.objective.sr_weight * sr


class BertPretrainer(_Pretrainer):
    """BertForMaskedLM trained by MLM at the masked positions, with optional HC and SR."""

    scheme = "bert"

    def __init__(self, mlm: BertForMaskedLM, objective: ObjectiveConfig):
        super().__init__()
        self.mlm = mlm
        self.set_objective(objective)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.mlm.bert.embeddings.word_embeddings

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.mlm.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def masked_logits(self, input_ids, attention_mask, masked) -> torch.Tensor:
        return bert_masked_logits(self.mlm, input_ids, attention_mask, masked)

    def forward(self, input_ids, attention_mask, labels, original_ids):
        masked = labels != -100
        gold = labels[masked]
        logits = self.masked_logits(input_ids, attention_mask, masked)
        pred = logits.detach().argmax(-1) if self.prediction == "argmax" else gumbel_max_sample(logits)
        corrected = _correct(gold, pred, self.hc_lookup)
        loss = mlm_loss(logits, gold, corrected)
        stats = {"mlm_loss": loss.detach(), **_stats_for_predictions(gold, pred, corrected, masked)}

        def sentence_pair():
            filled = original_ids.masked_scatter(masked, pred)
            return self.encode(filled, attention_mask), self.encode(original_ids, attention_mask), attention_mask

        return self.add_soft_regularization(loss, stats, gold, pred, sentence_pair), stats


class ElectraPretrainer(_Pretrainer):
    """ELECTRA: a small generator (MLM) feeds its Gumbel-max samples to the discriminator (RTD)."""

    scheme = "electra"
    default_prediction = "sample"

    def __init__(self, generator: ElectraForMaskedLM, discriminator: ElectraForPreTraining, objective: ObjectiveConfig):
        super().__init__()
        # One embedding module (word, position, type and its LayerNorm) for both, and the generator's
        # output layer tied to the word embeddings, as in the official ELECTRA.
        generator.electra.embeddings = discriminator.electra.embeddings
        generator.generator_lm_head.weight = discriminator.electra.embeddings.word_embeddings.weight
        self.generator, self.discriminator = generator, discriminator
        self.set_objective(objective)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.discriminator.electra.embeddings.word_embeddings

    def masked_logits(self, input_ids, attention_mask, masked) -> torch.Tensor:
        return generator_masked_logits(self.generator, input_ids, attention_mask, masked)

    def forward(self, input_ids, attention_mask, labels, original_ids):
        masked = labels != -100
        gold = labels[masked]
        gen_logits = self.masked_logits(input_ids, attention_mask, masked)
        sample = gumbel_max_sample(gen_logits)
        pred = sample if self.prediction == "sample" else gen_logits.detach().argmax(-1)
        corrected = _correct(gold, pred, self.hc_lookup)
        gen_loss = mlm_loss(gen_logits, gold, corrected)

        # The discriminator always sees the sample; its HC relabelling is judged on the sample too.
        disc_input = input_ids.masked_scatter(masked, sample)
        corrected_sample = corrected if pred is sample else _correct(gold, sample, self.hc_lookup)
        disc_labels = replaced_token_labels(disc_input, original_ids, masked, corrected_sample)
        disc_out = self.discriminator.electra(input_ids=disc_input, attention_mask=attention_mask)
        disc_logits = self.discriminator.discriminator_predictions(disc_out.last_hidden_state)
        disc_loss = discriminator_loss(disc_logits, disc_labels, attention_mask)
        loss = gen_loss + DISCRIMINATOR_WEIGHT * disc_loss

        active = attention_mask.bool()
        stats = {
            "gen_loss": gen_loss.detach(),
            "disc_loss": disc_loss.detach(),
            "disc_correct": (((disc_logits.detach() > 0).long() == disc_labels) & active).sum().float(),
            "disc_tokens": active.sum().float(),
            **_stats_for_predictions(gold, pred, corrected, masked),
        }

        def sentence_pair():  # the discriminator already encoded the filled-in sentence
            h_gold = self.discriminator.electra(input_ids=original_ids, attention_mask=attention_mask)
            return disc_out.last_hidden_state, h_gold.last_hidden_state, attention_mask

        return self.add_soft_regularization(loss, stats, gold, pred, sentence_pair), stats


def build_pretrainer(
    preset: str, objective: ObjectiveConfig, init_from: str | Path | None = None, dropout: float = 0.1
) -> BertPretrainer | ElectraPretrainer:
    """A fresh model of a preset, or one continued from an HF checkpoint (`--init-from`)."""
    check_preset(preset)
    common = {**_common_config(), "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    if not is_electra(preset):
        if init_from:
            return BertPretrainer(_from_pretrained(BertForMaskedLM, Path(init_from)), objective)
        return BertPretrainer(BertForMaskedLM(BertConfig(**common, **BERT_PRESETS[preset])), objective)
    if init_from:
        root = Path(init_from)
        generator = _from_pretrained(ElectraForMaskedLM, root / "generator")
        discriminator = _from_pretrained(ElectraForPreTraining, root / "discriminator")
        return ElectraPretrainer(generator, discriminator, objective)
    disc_sizes, gen_sizes = ELECTRA_PRESETS[preset]
    discriminator = ElectraForPreTraining(ElectraConfig(**common, **disc_sizes))
    generator = ElectraForMaskedLM(ElectraConfig(**common, **gen_sizes))
    return ElectraPretrainer(generator, discriminator, objective)


def _from_pretrained(cls, path: Path):
    if not (path / "config.json").is_file():
        raise UserError(
            f"--init-from: {path} holds no HF model (config.json); pass an exported truneg folder "
            "(with generator/ and discriminator/ for ELECTRA) or an HF model folder"
        )
    try:
        return cls.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UserError(f"--init-from: cannot load {path} ({err})") from None
