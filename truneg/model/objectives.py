"""The training objectives as pure tensor functions, named as in the paper.

Shapes are static: `gold`, `pred` and `valid` are [B, P] over the masked-position slots of a batch
(`valid` is False on padding slots), `logits` is [B, P, V]. Nothing here syncs with the host or loops
over tokens in Python.

The MLM cross-entropy and word-level SR take an optional `denominator`: their per-position terms are summed
and divided by it. Training passes the global batch's count of masked positions (every micro-batch and rank of
the optimizer step, a corrected position counting as 0 loss), so that a global batch's gradient does not depend
on its split; without one they are means over the micro-batch's counted positions (evaluation, direct calls).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from truneg.synonyms.table import SynonymLookup

DISCRIMINATOR_WEIGHT = 50.0  # ELECTRA's lambda


def gumbel_max_sample(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """One token per row, sampled from softmax(logits / temperature) by the Gumbel-max trick (as ELECTRA)."""
    uniform = torch.rand_like(logits, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform + 1e-9) + 1e-9)
    return (logits.detach().float() / temperature + gumbel).argmax(dim=-1)


def hard_correction(gold: torch.Tensor, pred: torch.Tensor, lookup: SynonymLookup) -> torch.Tensor:
    """Bool mask of corrected positions: the prediction differs from the gold token and is its synonym."""
    return (pred != gold) & lookup.is_synonym(gold, pred)


def masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The mean of `values` where `mask` is set (all of them with no mask); 0, not NaN, where none is."""
    if mask is None:
        return values.mean()
    weights = mask.to(values.dtype)
    return (values * weights).sum() / weights.sum().clamp(min=1)


def masked_sum_over(values: torch.Tensor, mask: torch.Tensor, denominator: torch.Tensor | None) -> torch.Tensor:
    """The sum of `values` where `mask` is set, divided by `denominator` (a 0-d tensor, at least 1);
    `masked_mean` with none."""
    if denominator is None:
        return masked_mean(values, mask)
    # a product with the mask, not a selection: static shapes, and a left-out position gets a zero gradient
    return (values * mask.to(values.dtype)).sum() / denominator


def mlm_loss(logits: torch.Tensor, gold: torch.Tensor, keep: torch.Tensor,
             denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy summed over the masked positions `keep` marks (the valid slots that hard correction
    left labelled) and divided by `denominator` (the global batch's masked count: a corrected position
    weighs 0); with none, averaged over `keep`.

    With no position left the loss is 0 (not NaN), so a step whose predictions were all corrected
    still trains the rest of the model.
    """
    labels = torch.where(keep, gold, torch.full_like(gold, -100))
    per_position = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), reduction="none")
    return masked_sum_over(per_position, keep.flatten(), denominator)


def soft_regularization(
    embedding_matrix: torch.Tensor, gold: torch.Tensor, pred: torch.Tensor, valid: torch.Tensor | None = None,
    denominator: torch.Tensor | None = None,
) -> torch.Tensor:
    """The paper's Eq. 3: 1 - cos(E[gold], E[pred]) summed over masked positions and divided by `denominator`
    (the global batch's masked count, as the MLM loss) or, with none, averaged; gradients reach both rows.

    A position with a zero row has no cosine and is left out (a term of 0): HF zero-initialises the [PAD] row,
    and a predicted [PAD] would otherwise send a gradient of |E[gold]| / 1e-8 into it (cosine_similarity's
    eps)."""
    # One lookup of both rows. Its gradient is sparse on the CPU: a dense one is a [V, H] buffer zeroed and then
    # summed into the embedding's gradient, 0.7 % of a bert-base step there (bench/hc_sr_overhead.py), where
    # the sparse one is [2 x B x P, H]. On GPUs the dense buffer is a memset and stays (the sparse sum is not checked
    # for host syncs there), and so does a torch.compile graph. So does bf16/fp16: a sparse gradient's rows are
    # added one by one into the large dense gradient, where a half-precision sum would round small ones away.
    sparse = (embedding_matrix.device.type == "cpu" and embedding_matrix.dtype in (torch.float32, torch.float64)
              and not torch.compiler.is_compiling())
    both = F.embedding(torch.stack([gold, pred]), embedding_matrix, sparse=sparse)
    gold_vectors, pred_vectors = both.float().unbind(0)
    per_position = 1.0 - F.cosine_similarity(gold_vectors, pred_vectors, dim=-1)
    counted = gold_vectors.ne(0).any(-1) & pred_vectors.ne(0).any(-1)
    if valid is not None:
        counted = counted & valid
    return masked_sum_over(per_position, counted, denominator)


def sentence_regularization(
    h_pred: torch.Tensor, h_s: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The paper's SR_Sent: KL(softmax(H_p) || softmax(H_s)) over the hidden dimension, averaged over tokens.

    `h_pred` (H_p) encodes the sentence with the predictions filled in; `h_s` (H_s) the masked sentence s (BERT's
    default, the MLM's own pass) or the original (`--sr-sent-target original`, and ELECTRA); both [B, L, H].
    """
    log_p = F.log_softmax(h_pred.float(), dim=-1)
    log_s = F.log_softmax(h_s.float(), dim=-1)
    per_token = (log_p.exp() * (log_p - log_s)).sum(dim=-1)
    return masked_mean(per_token, attention_mask)


def replaced_token_labels(
    disc_input: torch.Tensor, original_ids: torch.Tensor, corrected: torch.Tensor | None
) -> torch.Tensor:
    """ELECTRA discriminator labels [B, L]: 1 (replaced) where the input differs from the original, except
    where `corrected` [B, L] marks a generator sample that is a synonym of the gold token (hard
    correction: labelled original, 0)."""
    replaced = disc_input != original_ids
    if corrected is None:
        return replaced.long()
    return (replaced & ~corrected).long()


def discriminator_loss(
    logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Binary cross-entropy of replaced-token detection, averaged over the real (non-pad) tokens."""
    per_token = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    return masked_mean(per_token, attention_mask)


def false_negative_counts(
    gold: torch.Tensor, pred: torch.Tensor, corrected: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The paper's Table 2 counts over a [B, P] batch of masked slots, as 0-d float tensors that add up over
    batches and ranks: sequences, masked positions, mismatched predictions, corrected ones (false
    negatives), and sequences with at least one correction. Training metrics and `fn-stats` both use it."""
    corrected = corrected & valid
    return {
        "sequences": valid.new_ones(valid.shape[0], dtype=torch.float32).sum(),
        "masked": valid.sum().float(),
        "mismatched": ((pred != gold) & valid).sum().float(),
        "corrected": corrected.sum().float(),
        "sequences_corrected": corrected.any(dim=1).sum().float(),
    }


def masked_shortfall(target: torch.Tensor | None, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Whole-word masking's pieces short of each row's target count (no remaining word fitted), summed over the
    batch as a 0-d float; nothing for token masking (no target)."""
    return {} if target is None else {"mask_shortfall": (target - valid.sum(dim=1)).sum().float()}
