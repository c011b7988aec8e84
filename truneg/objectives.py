"""The training objectives as pure tensor functions, named as in the paper.

Shapes: `gold` and `pred` are 1-D over the masked positions of a batch (M), `logits` is [M, V].
Nothing here syncs with the host or loops over tokens in Python.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from truneg.synonyms import SynonymLookup

DISCRIMINATOR_WEIGHT = 50.0  # ELECTRA's lambda


def gumbel_max_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """One token per row, sampled from softmax(logits / temperature) by the Gumbel-max trick (as ELECTRA)."""
    uniform = torch.rand_like(logits, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform + 1e-9) + 1e-9)
    return (logits.detach().float() / temperature + gumbel).argmax(dim=-1)


def hard_correction(gold: torch.Tensor, pred: torch.Tensor, lookup: SynonymLookup) -> torch.Tensor:
    """Bool mask of corrected positions: the prediction differs from the gold token and is its synonym."""
    return (pred != gold) & lookup.is_synonym(gold, pred)


def mlm_loss(logits: torch.Tensor, gold: torch.Tensor, corrected: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy averaged over the masked positions that hard correction left labelled.

    With no position left the loss is 0 (not NaN), so a step whose predictions were all corrected
    still trains the rest of the model.
    """
    if corrected is None:  # the baseline: exactly the usual cross-entropy
        return F.cross_entropy(logits.float(), gold) if gold.numel() else logits.sum() * 0.0
    keep = ~corrected
    per_position = F.cross_entropy(logits.float(), gold, reduction="none")
    return (per_position * keep).sum() / keep.sum().clamp(min=1)


def soft_regularization(embedding_matrix: torch.Tensor, gold: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """The paper's Eq. 3: mean over masked positions of 1 - cos(E[gold], E[pred]); gradients reach both rows."""
    if gold.numel() == 0:
        return embedding_matrix.sum() * 0.0
    gold_vectors = F.embedding(gold, embedding_matrix).float()
    pred_vectors = F.embedding(pred, embedding_matrix).float()
    return (1.0 - F.cosine_similarity(gold_vectors, pred_vectors, dim=-1)).mean()


def sentence_regularization(
    h_pred: torch.Tensor, h_gold: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The paper's SR_Sent: KL(softmax(H_p) || softmax(H_s)) over the hidden dimension, averaged over tokens.

    `h_pred` encodes the sentence with predictions filled in, `h_gold` the original; both [B, L, H].
    """
    log_p = F.log_softmax(h_pred.float(), dim=-1)
    log_s = F.log_softmax(h_gold.float(), dim=-1)
    per_token = (log_p.exp() * (log_p - log_s)).sum(dim=-1)
    if attention_mask is None:
        return per_token.mean()
    weights = attention_mask.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1)


def replaced_token_labels(
    disc_input: torch.Tensor, original_ids: torch.Tensor, masked: torch.Tensor, corrected_sample: torch.Tensor | None
) -> torch.Tensor:
    """ELECTRA discriminator labels: 1 (replaced) where the input differs from the original, except where
    the generator's sample is a synonym of the gold token (hard correction: labelled original, 0)."""
    replaced = disc_input != original_ids
    if corrected_sample is None:
        return replaced.long()
    corrected_full = torch.zeros_like(masked)
    corrected_full[masked] = corrected_sample
    return (replaced & ~corrected_full).long()


def discriminator_loss(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of replaced-token detection, averaged over the real (non-pad) tokens."""
    per_token = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    weights = attention_mask.to(per_token.dtype)
    return (per_token * weights).sum() / weights.sum().clamp(min=1)
