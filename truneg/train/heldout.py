"""Held-out evaluation (--eval-data), and the forward and counting that `truneg eval` and `truneg fn-stats` share.

Fixed masks: sequence i of the eval data is masked by training's rule (masking.mask_tokens: 15 % of its maskable
positions) from EVAL_SEED and i, and ELECTRA's generator sample at its masked slots is drawn with uniforms from a
generator of sequence i's own. Every run, variant, world size and resume sees the same ones.

The eval's own forward: no HC, SR or SR_Sent pass; its MLM loss runs over all masked positions. Sequence i goes to
data-parallel rank i % world; each rank's share is padded to whole micro-batches of the training shape with zero
weight, so every rank runs the same forwards (ZeRO-3 gathers in them). The sums stay on the device and are
all-reduced once at the end; losses are summed in fixed point, so that the order (ranks, batches) changes no bit.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from truneg.data.blocks import PreparedBlocks, ensure_prepared, open_prepared
from truneg.data.masking import default_max_predictions, mask_tokens
from truneg.errors import UserError
from truneg.model import families
from truneg.model.objectives import false_negative_counts, hard_correction
from truneg.model.pretrainers import BertPretrainer, fill_masked
from truneg.synonyms.table import SynonymLookup, SynonymTable
from truneg.train.build import Start, eval_table, open_blocks
from truneg.train.checkpointing.checkpoint import HF_CONFIG_DIR

if TYPE_CHECKING:
    from pathlib import Path

    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from truneg.train.config.run_config import RunConfig

EVAL_SEED = 0  # fn-stats' default seed: not --seed, so that runs of different seeds see the same masks
EVAL_SYNONYMS_FILE = "eval_synonyms.npz"  # --eval-synonyms' table, in checkpoints/hf_config/: `truneg eval`'s default
_FIXED_POINT = 2.0**24  # a loss summed as integer multiples of 2^-24 in float64: exact, so in any order
_SAMPLE_STREAM = 1  # numpy seed [seed, 0, index, 1]: a stream apart from the masks' [seed, epoch, index]


def table_label(table: SynonymTable) -> str:
    """The eval records' `eval_synonym_table`: the table's source and content hash (the same however it was found)."""
    return f"{table.source} {table.content_sha256[:16]}"


def run_eval_table(checkpoint_dir: Path, tokenizer: PreTrainedTokenizerBase) -> SynonymTable:
    """The table a run's live ratios counted with: its --eval-synonyms table saved beside its configs, else
    WordNet's."""
    saved = checkpoint_dir / HF_CONFIG_DIR / EVAL_SYNONYMS_FILE
    return eval_table(tokenizer, saved if saved.is_file() else None)


def prepare_eval_data(cfg: RunConfig, start: Start, world_size: int) -> Path | None:
    """Before any process group, on each node's local rank 0: --eval-data prepared and cached as --train-data is,
    and refused (one line) when it is missing, empty, or shorter than one micro-batch per rank. (--eval-synonyms
    was read, and checked against the vocab, by check_start: `start.eval_table`.)"""
    if not cfg.eval_data or int(os.environ.get("LOCAL_RANK", 0)) != 0:
        return None
    try:
        folder = ensure_prepared(cfg.eval_data, start.tokenizer, cfg.seq_len, cfg.cache_dir, cfg.num_proc)
        found = len(open_prepared(folder, start.tokenizer, cfg.seq_len))
    except UserError as err:
        raise UserError(f"--eval-data: {err}") from None
    micro = start.ds_config["train_micro_batch_size_per_gpu"]
    if found < world_size * micro:
        raise UserError(f"--eval-data {' '.join(cfg.eval_data)} holds {found} sequence(s) of --seq-len {cfg.seq_len}, "
                        f"fewer than one micro-batch per rank ({world_size} x {micro}); give it more text")
    return folder


def open_eval_blocks(cfg: RunConfig, start: Start, prepared: Path | None) -> PreparedBlocks | None:
    """The eval blocks on every rank, found as the training blocks are (a collective; None without --eval-data)."""
    if not cfg.eval_data:
        return None
    return open_blocks(replace(cfg, train_data=cfg.eval_data), replace(start, prepared=prepared))[0]


def save_eval_table(cfg: RunConfig, start: Start) -> None:
    """Rank 0: --eval-synonyms' table beside the run's configs, so that `truneg eval` of its checkpoints counts
    offline with the table the live ratios used (WordNet's, without the flag, is its default anyway)."""
    if cfg.eval_data and cfg.eval_synonyms:
        start.eval_table.save(cfg.checkpoint_dir / HF_CONFIG_DIR / EVAL_SYNONYMS_FILE)


# ---------------------------------------------------------------------------------------------------
# One batch: masks, the MLM's predictions, the discriminator's scores, and their sums
# ---------------------------------------------------------------------------------------------------


def masked_batch(rows: np.ndarray, indices: np.ndarray, tokenizer: PreTrainedTokenizerBase, scheme: str,
                 seed: int = EVAL_SEED) -> dict[str, torch.Tensor]:
    """mask_tokens' batch of sequences `indices` (epoch 0), plus `uniforms` [B, P]: the generator's draw per slot."""
    slots = default_max_predictions(rows.shape[1])
    batch = mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), scheme, seed, 0,
                        indices, slots)
    draws = [np.random.default_rng([seed, 0, int(i), _SAMPLE_STREAM]).random(slots) for i in indices]
    batch["uniforms"] = torch.from_numpy(np.stack(draws).astype(np.float32))
    return batch


def sample_with(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """A token per slot from softmax(logits) by its given uniform (inverse CDF): the sample depends on the
    sequence's own draw alone, not on the batch or the global RNG."""
    cdf = torch.softmax(logits.float(), dim=-1).cumsum(-1)
    target = (uniforms.to(cdf.dtype) * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=logits.shape[-1] - 1)


def masked_logits(mlm: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                  attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, P, V] logits of a masked LM (BERT's, RoBERTa's) or an ELECTRA generator at the masked positions (as in
    training)."""
    return families.masked_logits(mlm, families.encode(mlm, input_ids, attention_mask), positions)


def _fixed(values: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    """The sum of `values` where `counted`, in units of 2^-24 (a padding slot's value, whatever it is, adds 0)."""
    return torch.where(counted, torch.round(values.double() * _FIXED_POINT), 0.0).sum()


def mlm_sums(logits: torch.Tensor, gold: torch.Tensor, valid: torch.Tensor, pred: torch.Tensor,
             lookup: SynonymLookup | None, rows: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The MLM's sums over [B, P] slots (`valid`: real masked slots; `rows`: real sequences): the loss and the argmax
    hits over all masked positions, and the paper's Table 2 counts of `pred` against `lookup`. Also the corrected
    mask (the false negatives)."""
    per_position = F.cross_entropy(logits.flatten(0, -2).float(), gold.flatten(), reduction="none").view_as(gold)
    corrected = (hard_correction(gold, pred, lookup) if lookup is not None else torch.zeros_like(valid)) & valid
    counts = false_negative_counts(gold, pred, corrected, valid)
    counts["sequences"] = rows.sum().double()
    sums = {"mlm_loss": _fixed(per_position, valid), "mlm_correct": ((logits.argmax(-1) == gold) & valid).sum(),
            **counts}
    return {k: v.double() for k, v in sums.items()}, corrected


def disc_sums(discriminator: torch.nn.Module, batch: dict, sample: torch.Tensor,
              tokens: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """ELECTRA's discriminator on the masked input with the generator's samples filled in, labels unchanged by HC:
    its sums over the `tokens` [B, L] that count, and its logits and labels for the AUC."""
    disc_input = fill_masked(batch["input_ids"], batch["masked_positions"], batch["masked_valid"], sample)
    labels = disc_input != batch["original_ids"]
    hidden = discriminator.electra(input_ids=disc_input).last_hidden_state  # packed blocks: no padding
    logits = disc_logits_fp32(discriminator.discriminator_predictions, hidden)
    per_token = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
    said = logits > 0
    sums = {"disc_loss": _fixed(per_token, tokens), "disc_tokens": tokens.sum(),
            "disc_correct": ((said == labels) & tokens).sum(), "disc_true_positive": (said & labels & tokens).sum(),
            "disc_said_replaced": (said & tokens).sum(), "disc_replaced": (labels & tokens).sum()}
    return {k: v.double() for k, v in sums.items()}, logits, labels


def disc_logits_fp32(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """ELECTRA's discriminator head (dense, activation, dense_prediction: HF's ElectraDiscriminatorPredictions) in
    fp32 whatever the run's dtype: bf16 logits keep 8 bits, so many scores tie and the AUC drops (a tie counts
    half). Under ZeRO-3 the head's weights are gathered whole for it (a no-op otherwise)."""
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        x = F.linear(hidden.float(), head.dense.weight.float(), head.dense.bias.float())
        return F.linear(head.activation(x), head.dense_prediction.weight.float(),
                        head.dense_prediction.bias.float()).squeeze(-1)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The exact ROC AUC (Mann-Whitney, ties at their mean rank), as scikit-learn's roc_auc_score; NaN with one
    class only."""
    scores, labels = scores.double().flatten(), labels.bool().flatten()
    positives = int(labels.sum())
    negatives = labels.numel() - positives
    if positives == 0 or negatives == 0:
        return math.nan
    ordered, order = torch.sort(scores)
    _, inverse, counts = torch.unique_consecutive(ordered, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = (ends - counts.double() + 1 + ends) / 2  # the 1-based ranks a tie shares
    rank_sum = mean_rank[inverse][labels[order]].sum().item()
    return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives)


def metrics_of(totals: dict[str, float], auc: float | None = None) -> dict[str, float | None]:
    """The eval's figures under metrics.jsonl's names, from the summed counts (ELECTRA's where `disc_tokens` is)."""
    masked = max(totals["masked"], 1.0)
    loss = totals["mlm_loss"] / _FIXED_POINT / masked
    out = {"eval_mlm_loss": loss, "eval_mlm_accuracy": totals["mlm_correct"] / masked}
    if "disc_tokens" not in totals:
        out["eval_perplexity"] = math.exp(min(loss, 700.0))
    else:
        out["eval_mlm_sampled_accuracy"] = totals["mlm_sampled_correct"] / masked
        out["eval_disc_loss"] = totals["disc_loss"] / _FIXED_POINT / max(totals["disc_tokens"], 1.0)
        out["eval_disc_auc"] = None if auc is None or math.isnan(auc) else auc  # one class only: no AUC (JSON null)
        out["eval_disc_accuracy"] = totals["disc_correct"] / max(totals["disc_tokens"], 1.0)
        out["eval_disc_precision"] = totals["disc_true_positive"] / max(totals["disc_said_replaced"], 1.0)
        out["eval_disc_recall"] = totals["disc_true_positive"] / max(totals["disc_replaced"], 1.0)
    out["eval_hc_iter_ratio"] = totals["sequences_corrected"] / max(totals["sequences"], 1.0)
    out["eval_hc_pred_ratio"] = totals["corrected"] / max(totals["mismatched"], 1.0)
    out["eval_sequences"] = int(totals["sequences"])
    out["eval_masked"] = int(totals["masked"])
    out["eval_mismatched"] = int(totals["mismatched"])  # the prediction ratio's denominator
    if "disc_tokens" in totals:  # the AUC's positives and all its tokens: two AUCs compare by pairs out of P x N
        out["eval_disc_replaced"] = int(totals["disc_replaced"])
        out["eval_disc_tokens"] = int(totals["disc_tokens"])
    return out


# ---------------------------------------------------------------------------------------------------
# The evaluation of a run (every rank) or of a checkpoint (one process)
# ---------------------------------------------------------------------------------------------------


class HeldOut:
    """The first `count` sequences of the eval blocks, masked once, this rank's share of them on the device."""

    def __init__(self, blocks: PreparedBlocks | np.ndarray, tokenizer: PreTrainedTokenizerBase, scheme: str,
                 count: int, micro_batch: int, table: SynonymTable | SynonymLookup | None,
                 device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1, seed: int = EVAL_SEED):
        count = min(count, len(blocks))
        per_rank = -(-count // world_size)
        padded = -(-per_rank // micro_batch) * micro_batch
        own = np.arange(rank, count, world_size)
        rows = np.asarray(blocks[own] if len(own) else blocks[np.arange(1)], dtype=np.int64)
        rows = np.concatenate([rows, np.repeat(rows[:1], padded - len(own), axis=0)])[:padded]
        indices = np.concatenate([own, np.zeros(padded - len(own), dtype=own.dtype)])
        batch = masked_batch(rows, indices, tokenizer, scheme, seed)
        real = torch.arange(padded) < len(own)  # padding: zero weight
        batch["masked_valid"] &= real[:, None]
        batch["rows"] = real
        self.batches = [{k: v[s:s + micro_batch].to(device) for k, v in batch.items()}
                        for s in range(0, padded, micro_batch)]
        self.table_label = table_label(table) if isinstance(table, SynonymTable) else None
        if isinstance(table, SynonymTable):
            table = SynonymLookup(table).to(device)
        self.lookup, self.count, self.world_size = table, count, world_size
        self.every, self.last = 0, 0  # for_run's schedule

    @classmethod
    def for_run(cls, cfg: RunConfig, engine: DeepSpeedEngine, blocks: PreparedBlocks,
                tokenizer: PreTrainedTokenizerBase, table: SynonymTable, first_step: int = 0) -> HeldOut:
        """A run's evaluation: its micro-batch shape and rank, and the one eval table (build.start_eval_table's, not
        the run's HC table). `first_step`: where this phase's --max-steps count from (phase 2's: phase 1's last)."""
        heldout = cls(blocks, tokenizer, engine.module.scheme, cfg.eval_max_sequences,
                      engine.train_micro_batch_size_per_gpu(), table, engine.device, dist.get_rank(),
                      dist.get_world_size())
        heldout.every, heldout.last = cfg.eval_steps or cfg.save_steps, first_step + cfg.max_steps
        return heldout

    def due(self, step: int) -> bool:
        """Every --eval-steps (by default at each save's step) and at the last step (step 0: the loop's)."""
        return step == self.last or (self.every > 0 and step % self.every == 0)

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """The figures of a BertPretrainer or ElectraPretrainer (a collective under a process group). The model is
        left in the mode it was in (train, for a run: DeepSpeed never calls train())."""
        keys, sums, scores = self.local_sums(model)
        reduced = dist.is_initialized() and dist.get_world_size() > 1
        if reduced:
            dist.all_reduce(sums)
            scores = None if scores is None else tuple(_gathered(t) for t in scores)
        totals = dict(zip(keys, sums.tolist()))  # the eval's one host sync (with the AUC's, for ELECTRA)
        table = {} if self.table_label is None else {"eval_synonym_table": self.table_label}
        if scores is None:
            return {**metrics_of(totals), **table}
        logits, labels, counted = scores
        return {**metrics_of(totals, roc_auc(logits[counted], labels[counted])), **table}

    def local_sums(self, model: torch.nn.Module) -> tuple[list[str], torch.Tensor, tuple | None]:
        """This rank's share: the names and float64 sums of its counts, and for ELECTRA the discriminator's
        (logits, labels, counted) over its tokens. No host sync."""
        electra = not isinstance(model, BertPretrainer)
        mlm = model.generator if electra else model.mlm
        was_training = model.training
        sums, scores = None, []
        model.eval()
        try:
            with torch.no_grad():
                for batch in self.batches:
                    values, score = self._batch(mlm, model.discriminator if electra else None, batch)
                    sums = values if sums is None else sums + values
                    scores.append(score)
        finally:
            model.train(was_training)
        if not electra:
            return self._keys, sums, None
        return self._keys, sums, tuple(torch.cat([s[i] for s in scores]) for i in range(3))

    def _batch(self, mlm: torch.nn.Module, discriminator: torch.nn.Module | None,
               batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, tuple | None]:
        positions, valid = batch["masked_positions"], batch["masked_valid"]
        gold = batch["original_ids"].gather(1, positions)
        logits = masked_logits(mlm, batch["input_ids"], positions)
        if discriminator is None:  # BERT: HC judges the argmax
            sums, _ = mlm_sums(logits, gold, valid, logits.argmax(-1), self.lookup, batch["rows"])
            self._keys = list(sums)
            return torch.stack(list(sums.values())), None
        sample = sample_with(logits, batch["uniforms"])  # ELECTRA: the generator's sample
        sums, _ = mlm_sums(logits, gold, valid, sample, self.lookup, batch["rows"])
        sums["mlm_sampled_correct"] = ((sample == gold) & valid).sum().double()
        tokens = batch["rows"][:, None].expand_as(batch["input_ids"])
        disc, disc_logits, labels = disc_sums(discriminator, batch, sample, tokens)
        sums.update(disc)
        self._keys = list(sums)
        return torch.stack(list(sums.values())), (disc_logits, labels, tokens)

    def run(self, engine: DeepSpeedEngine, step: int) -> dict:
        """The record of the engine's model at `step`, with the evaluation's time (a collective)."""
        started = time.perf_counter()
        record = {"step": step, "samples": int(engine.global_samples), **self.evaluate(engine.module)}
        record["eval_seconds"] = time.perf_counter() - started
        return record


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    out = tensor.new_empty((dist.get_world_size() * tensor.shape[0], *tensor.shape[1:]))
    dist.all_gather_single(out, tensor.contiguous())
    return out
