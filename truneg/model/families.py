"""The masked LMs truneg runs, by their config.json's `model_type`: BERT's, RoBERTa's (roberta, xlm-roberta) and
ELECTRA's generator.

RoBERTa is BERT's encoder with two differences that every forward must follow: its head is `lm_head` (dense, GELU,
`layer_norm`, the decoder tied to the word embeddings, one bias), and its positions are counted from the padding
index, past `<pad>` tokens, from the input ids. A `<pad>` that masking's random replacement draws, or that SR_Sent's
filled-in sentence holds, would then shift every later position; `encode` passes the positions of the attention mask
instead (every position of a full training block), as HF would count them for the unmasked input.
Training, the held-out evaluation, fn-stats, compile and export all read a model through this module.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import (
    BertForMaskedLM,
    ElectraForMaskedLM,
    PretrainedConfig,
    RobertaForMaskedLM,
    XLMRobertaForMaskedLM,
)

from truneg.data.blocks import load_tokenizer
from truneg.data.words import tokenizer_kind
from truneg.model import hub
from truneg.model.pair import model_type as model_type_of

# model_type -> the masked LM truneg pre-trains (an export's config without a model_type is BERT's)
MLM_CLASSES: dict[str, type] = {"bert": BertForMaskedLM, "roberta": RobertaForMaskedLM,
                                "xlm-roberta": XLMRobertaForMaskedLM}
ROBERTA_TYPES = ("roberta", "xlm-roberta")
MODEL_TYPES = ("bert", "electra", *ROBERTA_TYPES)  # every model_type --init-from takes
# model_types users reach for that truneg refuses, and why (the others: "not a masked LM truneg builds")
REFUSED_TYPES = {"deberta-v2": "its public checkpoints carry no trained MLM head",
                 "gpt2": "a causal LM, not a masked one", "t5": "a sequence-to-sequence model, not a masked LM"}


def mlm_class(model_type: str | None) -> type:
    """The masked-LM class of a (non-ELECTRA) model_type; BERT's for None (old exports carry none) and for a type
    truneg does not take (which presets.from_pretrained_with_head refuses by its config)."""
    return MLM_CLASSES.get(model_type or "bert", BertForMaskedLM)


def is_roberta(config: PretrainedConfig) -> bool:
    return getattr(config, "model_type", None) in ROBERTA_TYPES


def head_prefix(cls: type) -> str:
    """The MLM head's keys in a checkpoint of `cls` (what --new-head starts afresh)."""
    return "lm_head." if cls in (RobertaForMaskedLM, XLMRobertaForMaskedLM) else "cls.predictions."


def mlm_head(mlm: nn.Module) -> nn.Module:
    """The module that turns hidden states into vocabulary logits (BERT's `cls`, RoBERTa's `lm_head`)."""
    return mlm.lm_head if is_roberta(mlm.config) else mlm.cls


def max_positions(config: PretrainedConfig) -> int:
    """The longest sequence the model's position table holds: RoBERTa's start past the padding index."""
    if is_roberta(config):
        return config.max_position_embeddings - config.pad_token_id - 1
    return config.max_position_embeddings


def length_problem(init_from: str, seq_len: int) -> str | None:
    """One line when --seq-len passes the positions of --init-from's RoBERTa or XLM-R (BERT's are the presets'
    512, checked with the arguments); None otherwise, or where its config is not here yet."""
    folder = hub.folder_or_cached(init_from)
    if folder is None or model_type_of(folder) not in ROBERTA_TYPES:
        return None
    config = PretrainedConfig(**json.loads((folder / "config.json").read_text()))
    config.model_type = model_type_of(folder)
    if seq_len > (longest := max_positions(config)):
        return (f"--seq-len {seq_len} is beyond the {longest} positions of --init-from {init_from} (its "
                f"max_position_embeddings {config.max_position_embeddings} less the padding index and one); use "
                f"{longest} or less")
    return None


def position_ids(config: PretrainedConfig, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """RoBERTa's position ids from the attention mask (HF's rule, `padding_idx + 1` on, with the mask in place of
    `input_ids != pad`); None for BERT and ELECTRA, whose positions do not read the ids."""
    if not is_roberta(config):
        return None
    if attention_mask is None:
        return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids) + config.pad_token_id + 1
    mask = attention_mask.long()
    return mask.cumsum(1) * mask + config.pad_token_id


def encode(mlm: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The encoder's last hidden states [B, L, H] (a BERT, a RoBERTa or an ELECTRA generator)."""
    return mlm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids(mlm.config, input_ids, attention_mask)).last_hidden_state


def gather_positions(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """hidden [B, L, H] at positions [B, P] -> [B, P, H], by torch.gather (static shape, no host sync)."""
    return hidden.gather(1, positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


def masked_logits(mlm: nn.Module, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """MLM logits [B, P, V] at the masked positions only: the head runs on B x P rows, not B x L."""
    rows = gather_positions(hidden, positions)
    if isinstance(mlm, ElectraForMaskedLM):
        return mlm.generator_lm_head(mlm.generator_predictions(rows))
    return mlm_head(mlm)(rows)


# ---------------------------------------------------------------------------------------------------
# The tokenizer a checkpoint was trained with
# ---------------------------------------------------------------------------------------------------


# A tokenizer's files in a checkpoint folder: a fast tokenizer's, WordPiece's, byte-level BPE's (RoBERTa's vocab.json
# and merges.txt) or SentencePiece's model
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "sentencepiece.bpe.model", "spiece.model")


def saved_tokenizer(folder: Path) -> Path | None:
    """Where a checkpoint folder keeps its tokenizer: the folder, or an ELECTRA export's parts; None if nowhere."""
    candidates = [folder, folder / "generator", folder / "discriminator"]
    return next((c for c in candidates if any((c / name).is_file() for name in TOKENIZER_FILES)), None)


def is_roberta_checkpoint(init_from: str) -> bool:
    """Whether --init-from names a RoBERTa or an XLM-R: its folder's or cached config's model_type, else (a hub name
    not cached yet, online) its config fetched alone."""
    folder = hub.folder_or_cached(init_from) or hub.fetch_config(init_from)
    return folder is not None and model_type_of(folder) in ROBERTA_TYPES


def own_tokenizer(init_from: str | None) -> str | None:
    """--tokenizer's default for an --init-from RoBERTa or XLM-R: the checkpoint itself, as given (a folder, or a hub
    name and its revision: the same string on every start, which run.json records), whose tokenizer files
    AutoTokenizer reads; None otherwise, where the shipped bert-base-uncased vocab (the public uncased BERTs' and
    ELECTRAs') stays the default."""
    return init_from if init_from and is_roberta_checkpoint(init_from) else None


def tokenizer_problem(init_from: str, given: str | None) -> str | None:
    """One line when --tokenizer is of another kind or size than --init-from's own tokenizer (its embedding rows
    would read other tokens); None when they match, when --tokenizer is the default, or when the checkpoint keeps no
    tokenizer here to compare with (the start then refuses a tokenizer larger than its embeddings)."""
    if not given or given == init_from:
        return None
    folder = hub.folder_or_cached(init_from)
    own_dir = saved_tokenizer(folder) if folder is not None else None
    if own_dir is None or Path(given).resolve() == own_dir.resolve():
        return None
    tokenizer, own = load_tokenizer(given), load_tokenizer(own_dir)
    mine, theirs = (tokenizer_kind(tokenizer), len(tokenizer)), (tokenizer_kind(own), len(own))
    if mine == theirs:
        return None
    fix = ("drop --tokenizer (the checkpoint's own is a RoBERTa's default)" if model_type_of(folder) in ROBERTA_TYPES
           else f"pass --tokenizer {own_dir}")
    return (f"--tokenizer {given} is a {mine[0] or 'tokenizer'} of {mine[1]} tokens, and --init-from {init_from} was "
            f"trained with a {theirs[0] or 'tokenizer'} of {theirs[1]} ({own_dir}): its embedding rows would read "
            f"other tokens; {fix}")
