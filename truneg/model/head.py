"""The MLM head's own stage (`--train-only head`) and its decoder (`--untie-decoder`).

A checkpoint without a trained MLM head (a sentence encoder, a classifier: `--new-head`) predicts noise at first, and
HC has nothing to correct until the head predicts words. The head stage trains the head alone: every other parameter
is frozen (no gradient, no optimizer state, at every ZeRO stage), and the frozen encoder runs in eval mode, without
dropout, as a fixed feature extractor (its config keeps its own dropout, which the next stage trains with).

In BERT's and RoBERTa's MLM the decoder's weight *is* the word-embedding matrix, so freezing the encoder freezes it too:
only the transform (dense, LayerNorm) and the bias train. `--untie-decoder` gives the decoder a copy of the word
embeddings to train apart (`tie_word_embeddings` false in the config). transformers then unties the decoder's bias
from the head's as well; truneg keeps them one parameter (one live bias), and an export writes both keys with its
value, as an untied model's `from_pretrained` reads them.
"""
from __future__ import annotations

from torch import nn

from truneg.model import families


def head_prefix(model: nn.Module) -> str:
    """The pre-trainer's parameter names of the MLM head (`mlm.cls.` or `mlm.lm_head.`)."""
    return "mlm." + families.head_prefix(type(model.mlm)).split(".")[0] + "."


def bias_owner(mlm: nn.Module) -> nn.Module:
    """The module holding the head's `bias` and its `decoder` (BERT's `cls.predictions`, RoBERTa's `lm_head`)."""
    head = families.mlm_head(mlm)
    return getattr(head, "predictions", head)


def one_live_bias(mlm: nn.Module) -> None:
    """An untied MLM's decoder bias and head bias as one parameter (the decoder's value: the one its forward adds)."""
    owner = bias_owner(mlm)
    if owner.decoder.bias is not owner.bias:
        owner.bias = owner.decoder.bias


def untie_decoder(mlm: nn.Module) -> None:
    """The decoder's weight becomes a copy of the word embeddings (a no-op for an untied checkpoint)."""
    decoder = mlm.get_output_embeddings()
    if decoder.weight is mlm.get_input_embeddings().weight:
        decoder.weight = nn.Parameter(decoder.weight.detach().clone())
    mlm.config.tie_word_embeddings = False
    one_live_bias(mlm)


def is_untied(mlm: nn.Module) -> bool:
    return mlm.get_output_embeddings().weight is not mlm.get_input_embeddings().weight


def freeze_all_but_the_head(model: nn.Module) -> list[str]:
    """`--train-only head`: every parameter outside the MLM head frozen (the tied decoder is the word embeddings':
    frozen with them), the encoder put in eval mode for good (the pre-trainer's `train()` keeps it there). Returns the
    names of the parameters left to train."""
    prefix = head_prefix(model)
    trained = []
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(prefix))
        if param.requires_grad:
            trained.append(name)
    model.encoder_frozen = True
    model.train()
    return trained
