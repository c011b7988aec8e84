"""The two pre-trainers (BERT MLM, ELECTRA generator + discriminator) built from HF classes.

Each pre-trainer's forward takes a masked batch and returns `(loss, stats)`: the total loss and a dict
of 0-d tensors (sums and counts, so they add up across ranks) that `metrics.py` turns into ratios.
The MLM / generator head runs only at the masked positions.

`masked_denominator` (train_step's): the MLM / generator cross-entropy and word-level SR are summed over the
micro-batch and divided by it, the global batch's masked count over the factor DeepSpeed divides the gradients by,
so that the accumulated gradient is the global batch's own however it is split. None: this micro-batch's means.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

from truneg.errors import UserError
from truneg.model import families
from truneg.model.carried import load_pooler
from truneg.model.head import is_untied, one_live_bias
from truneg.model.objectives import (
    DISCRIMINATOR_WEIGHT,
    discriminator_loss,
    false_negative_counts,
    gumbel_max_sample,
    hard_correction,
    masked_shortfall,
    mlm_loss,
    replaced_token_labels,
    sentence_regularization,
    soft_regularization,
)
from truneg.model.pair import (
    check_electra_folder,
    check_tieable,
    differing_embeddings,
    model_type,
    note_kept_copy,
    refuse_lone_electra,
)
from truneg.model.presets import (
    BERT_PRESETS,
    DEFAULT_PRESET,
    ELECTRA_PRESETS,
    SIZE_KEYS,
    VOCAB_SIZE,
    check_preset,
    common_config,
    from_pretrained_with_head,
    is_electra,
    is_electra_checkpoint,
    preset_sizes,
)
from truneg.synonyms.table import SynonymLookup


@dataclass
class ObjectiveConfig:
    hc_lookup: SynonymLookup | None = None
    reach_lookup: SynonymLookup | None = None  # the table HC's reach is counted with (default: hc_lookup's)
    hc_prediction: str = "default"  # argmax | sample | default (BERT: argmax, ELECTRA: sample)
    sr: str = "none"  # none | word | sent
    sr_weight: float = 1.0
    sr_sent_target: str = "masked"  # H_s of SR_Sent: the masked sentence (the MLM's own pass) | the original


def _correct(gold, pred, valid, lookup: SynonymLookup | None) -> torch.Tensor:
    """HC's corrected mask over the valid slots (all False without HC)."""
    if lookup is None:
        return torch.zeros_like(valid)
    return hard_correction(gold, pred, lookup) & valid


def fill_masked(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`ids` with `values` written at the valid masked positions (padding slots rewrite what is there)."""
    return ids.scatter(1, positions, torch.where(valid, values, ids.gather(1, positions)))


class _Pretrainer(nn.Module):
    """What the BERT and ELECTRA pre-trainers share: the objective's settings and soft regularization."""

    default_prediction = "argmax"

    def set_objective(self, objective: ObjectiveConfig) -> None:
        self.objective, self.hc_lookup = objective, objective.hc_lookup
        self.reach_lookup = objective.reach_lookup or objective.hc_lookup
        use_default = objective.hc_prediction == "default"
        self.prediction = self.default_prediction if use_default else objective.hc_prediction
        # SR reads the embedding matrix outside the embedding's own forward; ZeRO-3 must gather it.
        deepspeed.zero.register_external_parameter(self, self.word_embeddings.weight)

    def reach_counts(self, gold: torch.Tensor, original_ids: torch.Tensor, positions: torch.Tensor,
                     valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """HC's reach over the masked slots: how many are words of their own with synonyms
        (`SynonymLookup.judgeable`), by the reach table; nothing without one."""
        if self.reach_lookup is None:
            return {}
        following = original_ids.gather(1, (positions + 1).clamp(max=original_ids.shape[1] - 1))
        return {"hc_judgeable": (self.reach_lookup.judgeable(gold, following) & valid).sum().float()}

    def add_soft_regularization(self, loss: torch.Tensor, stats: dict, gold: torch.Tensor, pred: torch.Tensor,
                                valid: torch.Tensor, sentence_pair: Callable[[], tuple],
                                denominator: torch.Tensor | None = None) -> torch.Tensor:
        """loss + sr_weight * SR. `sentence_pair()` gives (H_p, H_s, attention mask), encoded only for SR_Sent;
        `denominator` divides word-level SR's sum (SR_Sent's mean over micro x seq_len tokens is split-invariant)."""
        if self.objective.sr == "none":
            return loss
        if self.objective.sr == "word":
            # [PAD]'s row is not trained through lookups and stays near zero, where the cosine's gradient grows
            # like 1 / |row|: a predicted [PAD] is left out (the objective itself leaves out an exact zero row)
            pad = self.word_embeddings.padding_idx
            sr = soft_regularization(self.word_embeddings.weight, gold, pred,
                                     valid if pad is None else valid & (pred != pad), denominator)
        else:
            sr = sentence_regularization(*sentence_pair())
        stats["sr_loss"] = sr.detach()
        return loss + self.objective.sr_weight * sr


class BertPretrainer(_Pretrainer):
    """A masked LM of BERT's family (BertForMaskedLM, or RoBERTa's and XLM-R's: families.py) trained by MLM at the
    masked positions, with optional HC and SR. RoBERTa's masking is BERT's (15 %, 80/10/10)."""

    scheme = "bert"
    encoder_frozen = False  # --train-only head (head.py): the encoder stays in eval mode

    def __init__(self, mlm: nn.Module, objective: ObjectiveConfig, pooler: dict[str, torch.Tensor] | None = None):
        super().__init__()
        self.mlm = mlm
        # A continued checkpoint's pooler (carried.py): a plain dict, so neither a parameter of the engine nor
        # moved or cast with the module.
        self.pooler = pooler
        self.set_objective(objective)

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.mlm.base_model.embeddings.word_embeddings

    def train(self, mode: bool = True) -> BertPretrainer:
        super().train(mode)
        if self.encoder_frozen:  # a frozen encoder is a fixed feature extractor: no dropout
            self.mlm.base_model.eval()
        return self

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return families.encode(self.mlm, input_ids, attention_mask)

    def masked_logits(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return families.masked_logits(self.mlm, hidden, positions)

    def forward(self, input_ids: torch.Tensor, original_ids: torch.Tensor, masked_positions: torch.Tensor,
                masked_valid: torch.Tensor, attention_mask: torch.Tensor | None = None,
                masked_denominator: torch.Tensor | None = None,
                masked_target: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        gold = original_ids.gather(1, masked_positions)
        hidden = self.encode(input_ids, attention_mask)
        logits = self.masked_logits(hidden, masked_positions)
        pred = logits.detach().argmax(-1) if self.prediction == "argmax" else gumbel_max_sample(logits)
        corrected = _correct(gold, pred, masked_valid, self.hc_lookup)
        loss = mlm_loss(logits, gold, masked_valid & ~corrected, masked_denominator)
        stats = {"mlm_loss": loss.detach(), **false_negative_counts(gold, pred, corrected, masked_valid),
                 **self.reach_counts(gold, original_ids, masked_positions, masked_valid),
                 **masked_shortfall(masked_target, masked_valid)}

        def sentence_pair():
            # Section 5: "we fill the masked sentence s with the predicted tokens to have the predicted sentence
            # s_p. Then s_p and s are fed to the Transformer encoder to have H_p and H_s", and SR_Sent "requires
            # the extra calculation for the predicted sequence H_p". So by default H_s is the MLM forward's own
            # encoding of the masked sentence, and only H_p costs a pass. Related Work speaks of "the predicted
            # sentence and the original sentence": `--sr-sent-target original` encodes the unmasked original
            # instead (a second extra pass). Gradients flow into both H_p and H_s, as the loss is written.
            h_pred = self.encode(fill_masked(input_ids, masked_positions, masked_valid, pred), attention_mask)
            if self.objective.sr_sent_target == "original":
                return h_pred, self.encode(original_ids, attention_mask), attention_mask
            return h_pred, hidden, attention_mask

        return self.add_soft_regularization(loss, stats, gold, pred, masked_valid, sentence_pair,
                                            masked_denominator), stats


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

    def masked_logits(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return families.masked_logits(self.generator, hidden, positions)

    def forward(self, input_ids: torch.Tensor, original_ids: torch.Tensor, masked_positions: torch.Tensor,
                masked_valid: torch.Tensor, attention_mask: torch.Tensor | None = None,
                masked_denominator: torch.Tensor | None = None,
                masked_target: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        gold = original_ids.gather(1, masked_positions)
        gen_hidden = self.generator.electra(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        gen_logits = self.masked_logits(gen_hidden, masked_positions)
        sample = gumbel_max_sample(gen_logits)
        argmax = gen_logits.detach().argmax(-1)
        pred = sample if self.prediction == "sample" else argmax
        corrected = _correct(gold, pred, masked_valid, self.hc_lookup)
        gen_loss = mlm_loss(gen_logits, gold, masked_valid & ~corrected, masked_denominator)

        # The discriminator always sees the sample; its HC relabelling is judged on the sample too.
        disc_input = fill_masked(input_ids, masked_positions, masked_valid, sample)
        corrected_sample = corrected if pred is sample else _correct(gold, sample, masked_valid, self.hc_lookup)
        corrected_full = torch.zeros_like(input_ids, dtype=torch.bool).scatter(1, masked_positions, corrected_sample)
        disc_labels = replaced_token_labels(disc_input, original_ids,
                                            corrected_full if self.hc_lookup is not None else None)
        disc_hidden = self.discriminator.electra(input_ids=disc_input, attention_mask=attention_mask).last_hidden_state
        disc_logits = self.discriminator.discriminator_predictions(disc_hidden)
        # a mean over the micro-batch's B x L tokens (training's blocks are full and pass no attention mask): the
        # same count in every micro-batch, so the mean of the micro-batches' means is the global batch's
        disc_loss = discriminator_loss(disc_logits, disc_labels, attention_mask)
        loss = gen_loss + DISCRIMINATOR_WEIGHT * disc_loss

        active = torch.ones_like(disc_labels, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        stats = {
            "gen_loss": gen_loss.detach(),
            "disc_loss": disc_loss.detach(),
            "disc_correct": (((disc_logits.detach() > 0).long() == disc_labels) & active).sum().float(),
            "disc_tokens": active.sum().float(),
            # the official ELECTRA logs both: masked_lm_accuracy (argmax) and sampled_masked_lm_accuracy
            "mlm_argmax_correct": ((argmax == gold) & masked_valid).sum().float(),
            "mlm_sampled_correct": ((sample == gold) & masked_valid).sum().float(),
            **false_negative_counts(gold, pred, corrected, masked_valid),
            **self.reach_counts(gold, original_ids, masked_positions, masked_valid),
            **masked_shortfall(masked_target, masked_valid),
        }

        def sentence_pair():
            # ELECTRA's encoder is the discriminator, and it has already encoded the sentence filled with the
            # generator's samples (s_p, with the sample as ELECTRA's prediction): H_p costs nothing. H_s is the
            # discriminator's encoding of the original sentence, the one extra pass. (The masked sentence is
            # not a discriminator input: the discriminator never sees [MASK].)
            h_gold = self.discriminator.electra(input_ids=original_ids, attention_mask=attention_mask)
            return disc_hidden, h_gold.last_hidden_state, attention_mask

        return self.add_soft_regularization(loss, stats, gold, pred, masked_valid, sentence_pair,
                                            masked_denominator), stats


def build_pretrainer(
    preset: str | None,
    objective: ObjectiveConfig,
    init_from: str | Path | None = None,
    dropout: float | None = None,
    vocab_size: int = VOCAB_SIZE,
    init_generator: str | Path | None = None,
    new_head: bool = False,
) -> BertPretrainer | ElectraPretrainer:
    """A fresh model of a preset, or one continued from an HF checkpoint folder (`--init-from`; with
    `init_generator`, ELECTRA's discriminator there and its generator in that folder).

    `dropout` None keeps the checkpoint's own dropout (0.1 for a fresh model); `vocab_size` follows the
    tokenizer, so that no id a smaller vocab cannot produce has a row. With `init_from`, `preset` None takes
    the checkpoint's architecture, and a preset that contradicts it is refused. `new_head` (BERT): the checkpoint
    is an encoder without the MLM head (presets.from_pretrained_with_head), which starts as HF initialises it.
    """
    if init_from:
        model = _continued(preset, Path(init_from), objective, Path(init_generator) if init_generator else None,
                           new_head)
        rows = architecture(model)["vocab_size"]
        if vocab_size > rows:  # masking would draw ids past the embedding table
            raise UserError(f"the tokenizer has {vocab_size} tokens, --init-from's embeddings {rows} rows; pass "
                            "--tokenizer the checkpoint's own tokenizer")
        if dropout is not None:
            set_dropout(model, dropout)
        return model
    preset = preset or DEFAULT_PRESET
    check_preset(preset)
    dropout = 0.1 if dropout is None else dropout
    common = {**common_config(), "vocab_size": vocab_size,
              "hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    if not is_electra(preset):
        return BertPretrainer(BertForMaskedLM(BertConfig(**common, **BERT_PRESETS[preset])), objective)
    disc_sizes, gen_sizes = ELECTRA_PRESETS[preset]
    discriminator = ElectraForPreTraining(ElectraConfig(**common, **disc_sizes))
    generator = ElectraForMaskedLM(ElectraConfig(**common, **gen_sizes))
    return ElectraPretrainer(generator, discriminator, objective)


def _continued(preset: str | None, root: Path, objective: ObjectiveConfig, generator_root: Path | None = None,
               new_head: bool = False) -> BertPretrainer | ElectraPretrainer:
    electra = is_electra_checkpoint(root) or generator_root is not None
    if new_head and electra:
        raise UserError(f"--new-head starts a BERT's MLM head; --init-from {root} is an ELECTRA checkpoint, whose "
                        "generator is the MLM: drop --new-head")
    if not electra:
        refuse_lone_electra(root)  # before --model's check, which would call it a BERT checkpoint
    if generator_root is not None and is_electra_checkpoint(root):
        raise UserError(f"--init-from {root} holds its own generator/ beside discriminator/; drop --init-generator, "
                        "or pass --init-from the discriminator's folder")
    if preset is not None:
        check_preset(preset)
        if is_electra(preset) != electra:
            raise UserError(f"--model {preset} contradicts --init-from {root}, which holds "
                            f"{'an ELECTRA' if electra else 'a BERT'} checkpoint; drop --model or pass a matching "
                            "preset")
    if generator_root is not None:  # the public pair: two folders (or hub names), tied into one embedding
        check_electra_folder(root, "--init-from")
        check_electra_folder(generator_root, "--init-generator")
        generator, _ = from_pretrained_with_head(ElectraForMaskedLM, generator_root, "--init-generator")
        discriminator, _ = from_pretrained_with_head(ElectraForPreTraining, root)
        check_tieable(generator, discriminator, (str(generator_root), str(root)))
        note_kept_copy(differing_embeddings(generator, discriminator))
        model = ElectraPretrainer(generator, discriminator, objective)
        config = discriminator.config
    elif electra:
        generator, _ = from_pretrained_with_head(ElectraForMaskedLM, root / "generator")
        discriminator, _ = from_pretrained_with_head(ElectraForPreTraining, root / "discriminator")
        check_tieable(generator, discriminator, (str(root / "generator"), str(root / "discriminator")))
        note_kept_copy(differing_embeddings(generator, discriminator))  # a folder assembled by hand, say
        model = ElectraPretrainer(generator, discriminator, objective)
        config = discriminator.config
    else:
        mlm, unexpected = from_pretrained_with_head(families.mlm_class(model_type(root)), root, new_head=new_head)
        if is_untied(mlm):  # an untied checkpoint (a head stage's export): it continues untied, with one live bias
            one_live_bias(mlm)
        model = BertPretrainer(mlm, objective, pooler=load_pooler(root, mlm.config, unexpected, mlm.base_model_prefix))
        if new_head and os.environ.get("RANK", "0") == "0":
            print(f"truneg: --new-head: {root} has no MLM head; its transform (dense, LayerNorm) and bias start as HF "
                  "initialises them, the decoder tied to the loaded word embeddings", flush=True)
        config = model.mlm.config
    if preset is not None:
        loaded, wanted = {k: getattr(config, k) for k in SIZE_KEYS}, preset_sizes(preset)
        if loaded != wanted:
            raise UserError(f"--model {preset} ({wanted['num_hidden_layers']} layers x {wanted['hidden_size']}) "
                            f"contradicts --init-from {root} "
                            f"({loaded['num_hidden_layers']} x {loaded['hidden_size']}); "
                            "drop --model to train the checkpoint's own architecture")
    # HF's from_pretrained returns its models in eval mode, and DeepSpeed's engine never calls train(): without
    # this a continued run would pre-train with every dropout layer off
    return model.train()


def architecture(model: BertPretrainer | ElectraPretrainer) -> dict:
    """What was built or loaded, for the run record: family, layers, width, vocab, dropout, and a RoBERTa's or an
    XLM-R's model_type (none for a BERT or an ELECTRA, whose recorded runs resume as recorded)."""
    config = model.mlm.config if isinstance(model, BertPretrainer) else model.discriminator.config
    return {"family": model.scheme, "layers": config.num_hidden_layers, "hidden": config.hidden_size,
            "vocab_size": config.vocab_size, "dropout": config.hidden_dropout_prob,
            **({"model_type": config.model_type} if families.is_roberta(config) else {})}


def set_dropout(model: nn.Module, p: float) -> None:
    """Apply --dropout to every dropout layer and config of a loaded checkpoint."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "hidden_dropout_prob"):
            config.hidden_dropout_prob = config.attention_probs_dropout_prob = p


def checkpoint_activations(model: BertPretrainer | ElectraPretrainer) -> None:
    """--activation-checkpointing: each HF encoder layer keeps only its input for the backward and runs again there,
    through HF's gradient checkpointing with torch's non-reentrant checkpoint (which dynamo traces inside a compiled
    layer's graph; its RNG state is restored, so dropout draws the same masks and the gradients are the same)."""
    parts = [model.mlm] if isinstance(model, BertPretrainer) else [model.generator, model.discriminator]
    for part in parts:
        part.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def decays(name: str) -> bool:
    """BERT's and ELECTRA's rule: weight decay on every parameter but biases and LayerNorm weights (RoBERTa's head
    names its LayerNorm `layer_norm`)."""
    return not (name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name)


def parameter_groups(model: nn.Module) -> list[dict]:
    """Pre-training's two groups (see `decays`): the first takes the config's weight_decay, the second 0."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if decays(name) else no_decay).append(param)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


