"""Dynamic masking with static shapes: an exact number of masked positions per sequence.

As BERT's `create_pretraining_data` and the official ELECTRA, each sequence gets
`min(max_predictions, max(1, round(rate x maskable)))` masked positions (rate 0.15 by default), and the batch
carries them as `masked_positions` [B, P] (padded with 0) plus `masked_valid` [B, P]. The model gathers those rows with
`torch.gather`: every shape is static, no boolean indexing, so nothing in the step waits on the host
and `torch.compile(fullgraph=True)` traces the whole step.

Masking is a pure function of (seed, epoch, sequence index): drawn anew each epoch, identical after a
resume, independent of the world size.
"""
from __future__ import annotations

import atexit
import math
import multiprocessing
import signal
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from truneg.data.words import tokenizer_kind
from truneg.errors import UserError
from truneg.synonyms.table import continuing_pieces

MaskScheme = tuple[float, float, float]  # (selected share, of those -> [MASK], -> random token); the rest unchanged
MASK_SCHEMES: dict[str, MaskScheme] = {  # each family's default
    "bert": (0.15, 0.8, 0.1),
    "electra": (0.15, 0.85, 0.0),
}
DEFAULT_RATE = 0.15  # both families'; the held-out evaluation's fixed masks always take it


def mask_scheme(family: str, rate: float | None = None, mask: float | None = None,
                random: float | None = None) -> MaskScheme:
    """The family's scheme with the given shares in place of its defaults (--mlm-probability, --mask-replace-prob,
    --random-replace-prob, named as HF's DataCollatorForLanguageModeling names them)."""
    default = MASK_SCHEMES[family]
    return tuple(d if v is None else float(v) for v, d in zip((rate, mask, random), default))  # type: ignore[return-value]


def default_max_predictions(seq_len: int, rate: float = DEFAULT_RATE) -> int:
    """`rate` of the sequence rounded up to a multiple of 4: 20 at seq 128 and 80 at 512 at BERT's 15 %, as BERT's
    recipes (at most the sequence: the slots are positions of it)."""
    return min(seq_len, max(4, -(-int(np.ceil(rate * seq_len)) // 4) * 4))


def capped_rate(max_predictions: int, rate: float, seq_len: int) -> str | None:
    """A line when --max-predictions holds fewer slots than `rate` selects of a full block ([CLS] and [SEP] are not
    maskable): the masked share is then lower than the rate; None when it does not cap it."""
    wanted = int(np.rint(rate * (seq_len - 2)))
    if max_predictions >= wanted:
        return None
    share = max_predictions / (seq_len - 2)
    return (f"--max-predictions {max_predictions} caps the mask rate {rate:g} at --seq-len {seq_len}: {wanted} "
            f"positions a full block would select, {max_predictions} are masked ({share:.1%})")


def mask_tokens(
    input_ids: np.ndarray,
    special_ids: Sequence[int],
    mask_id: int,
    vocab_size: int,
    scheme: str | MaskScheme,
    seed: int,
    epoch: int,
    indices: np.ndarray,
    max_predictions: int,
    word_continues: np.ndarray | None = None,
    word_starts: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """Mask a [B, L] batch of token ids with `scheme` (a family's default by name, or `mask_scheme`'s shares). Returns
    int64 `input_ids` (masked), `original_ids`, `masked_positions` [B, P] and bool `masked_valid` [B, P], with
    P = max_predictions. Positions are sorted within a row. With `word_continues` (bool over the vocab: the pieces
    that continue a word, WordPiece's `##`) or `word_starts` (bool [B, L]: the tokens that start a word, as
    `truneg prepare` stored them for byte-level BPE and SentencePiece), whole words are masked
    (`whole_word_positions`), and the batch also carries each row's target count, `masked_target` [B]."""
    select_p, mask_p, random_p = MASK_SCHEMES[scheme] if isinstance(scheme, str) else scheme
    original = np.array(input_ids, dtype=np.int64)
    batch, length = original.shape
    order_draw = np.empty((batch, length))
    action_draw = np.empty((batch, max_predictions))
    random_ids = np.empty((batch, max_predictions), dtype=np.int64)
    for row, index in enumerate(indices):
        rng = np.random.default_rng([seed, epoch, int(index)])
        order_draw[row] = rng.random(length)
        action_draw[row] = rng.random(max_predictions)
        random_ids[row] = rng.integers(0, vocab_size, max_predictions)
    maskable = ~np.isin(original, np.asarray(special_ids))
    num_maskable = maskable.sum(axis=1)
    count = np.minimum(max_predictions, np.maximum(1, np.rint(select_p * num_maskable).astype(np.int64)))
    count = np.minimum(count, num_maskable)
    whole_words = word_continues is not None or word_starts is not None
    if not whole_words:
        # A random order of the maskable positions (unmaskable ones last); the first `count` are selected.
        order = np.argsort(np.where(maskable, order_draw, 2.0), axis=1, kind="stable")[:, :max_predictions]
        valid = np.arange(max_predictions)[None, :] < count[:, None]
        positions = np.sort(np.where(valid, order, length), axis=1)  # sorted; padding (= length) last
    else:
        continues = word_continues[original] if word_continues is not None else ~np.asarray(word_starts, dtype=bool)
        positions = np.full((batch, max_predictions), length, dtype=np.int64)
        for row in range(batch):
            taken = whole_word_positions(maskable[row], continues[row], order_draw[row], count[row])
            positions[row, :len(taken)] = taken
    valid = positions < length
    positions = np.where(valid, positions, 0)

    ids = original.copy()
    rows = np.broadcast_to(np.arange(batch)[:, None], positions.shape)
    to_mask = valid & (action_draw < mask_p)
    to_random = valid & (action_draw >= mask_p) & (action_draw < mask_p + random_p)
    ids[rows[to_mask], positions[to_mask]] = mask_id
    ids[rows[to_random], positions[to_random]] = random_ids[to_random]
    masked = {
        "input_ids": torch.from_numpy(ids),
        "original_ids": torch.from_numpy(original),
        "masked_positions": torch.from_numpy(positions.astype(np.int64)),
        "masked_valid": torch.from_numpy(valid),
    }
    if whole_words:
        masked["masked_target"] = torch.from_numpy(count.astype(np.int64))
    return masked


def whole_word_positions(maskable: np.ndarray, continues: np.ndarray, draw: np.ndarray, target: int) -> np.ndarray:
    """Whole-word masking of one row: its words (a maskable piece that does not continue one, per the row's
    `continues`, starts a word, and so does the first piece after a special token: a word never spans one, and a word
    cut at the block's start or end is the part inside it) taken in the order of their first piece's `draw`, each
    with all its pieces; a word that would pass `target` pieces is skipped and the next one tried. Returns the
    positions, sorted: at most `target`, and `target` unless no remaining word fits."""
    after_maskable = np.concatenate([[False], maskable[:-1]])
    starts = maskable & ~(continues & after_maskable)
    word = np.cumsum(starts) - 1  # each maskable position's word
    first = np.flatnonzero(starts)
    if len(first) == 0:  # nothing maskable (a row of specials)
        return first
    lengths = np.bincount(word[maskable], minlength=len(first))
    chosen, total = np.zeros(len(first), dtype=bool), 0
    for w in np.argsort(draw[first], kind="stable"):
        if total + lengths[w] <= target:
            chosen[w], total = True, total + lengths[w]
            if total == target:
                break
    return np.flatnonzero(maskable & chosen[np.maximum(word, 0)] & (word >= 0))


class _MicroBatchPlan(torch.utils.data.Sampler):
    """The sampler's micro-batches in order, each with the sampler position just after it."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __iter__(self):
        for epoch, indices in self.sampler:
            yield epoch, indices, self.sampler.state_dict()


class _MaskedMicroBatches(torch.utils.data.Dataset):
    """Reads one micro-batch of blocks and masks it: run in the DataLoader's workers."""

    def __init__(self, blocks, special_ids, mask_id: int, vocab_size: int, scheme: str | MaskScheme, seed: int,
                 max_predictions: int, word_continues: np.ndarray | None = None, stored_starts: bool = False):
        self.blocks, self.special_ids, self.mask_id, self.vocab_size = blocks, special_ids, mask_id, vocab_size
        self.scheme, self.seed, self.max_predictions = scheme, seed, max_predictions
        self.word_continues, self.stored_starts = word_continues, stored_starts

    def __getitem__(self, item):
        epoch, indices, position = item
        order = np.argsort(indices)  # sorted reads from the memory map, original order kept
        rows = np.empty((len(indices), self.blocks.shape[1]), dtype=np.int64)
        rows[order] = self.blocks[indices[order]]
        starts = None
        if self.stored_starts:
            starts = np.empty(rows.shape, dtype=bool)
            starts[order] = self.blocks.word_starts(indices[order])
        batch = mask_tokens(rows, self.special_ids, self.mask_id, self.vocab_size, self.scheme, self.seed, epoch,
                            indices, self.max_predictions, self.word_continues, starts)
        return pack(batch), position


def pack(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """A batch as one byte buffer and its layout. A worker then hands the training thread one tensor instead
    of four, and each costs that thread about the same (a shared-memory segment, its file descriptor, its
    mapping): `bench/loader_rate.py` measured 0.37 ms a micro-batch against 0.91 with one worker. A GPU
    rank pins and copies one buffer. The int64 tensors come first, so every view of it stays aligned."""
    layout = [(k, v.dtype, v.shape)
              for k, v in sorted(batch.items(), key=lambda kv: kv[1].element_size(), reverse=True)]
    return torch.cat([batch[k].reshape(-1).view(torch.uint8) for k, _, _ in layout]), layout


def unpack(buffer: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """`pack`'s batch again, as views of the buffer (no copy)."""
    batch, start = {}, 0
    for name, dtype, shape in layout:
        size = math.prod(shape) * dtype.itemsize
        batch[name] = buffer[start:start + size].view(dtype).view(*shape)
        start += size
    return batch


def _leave_stop_signals_to_the_rank(worker_id: int) -> None:
    """A scheduler's SIGTERM (and a terminal's SIGINT) reaches the whole process group, workers included.
    torch's workers die of it, and the rank's next batch then raises instead of finishing the step and
    saving. The rank stops its workers itself, and they also leave when it dies (torch's watchdog)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stop_workers(loader_iterator: weakref.ref) -> None:
    iterator = loader_iterator()
    if iterator is not None:
        iterator._shutdown_workers()  # what its __del__ does


def word_boundaries(tokenizer, blocks) -> tuple[np.ndarray | None, bool]:
    """Where whole-word masking reads the words: (WordPiece's continuing pieces over the vocab, False), or (None,
    True) for another kind, whose word starts the prepared `blocks` hold (PreparedBlocks.word_starts)."""
    if tokenizer_kind(tokenizer) == "WordPiece":
        return continuing_pieces(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))), False
    if not getattr(blocks, "has_word_starts", False):
        raise UserError("--whole-word-masking: the prepared blocks hold no word starts; prepare the corpus again with "
                        "`truneg prepare ... --out NEW_DIR`")
    return None, True


class MaskedBatches:
    """Iterator of masked micro-batches for one rank (dicts of tensors, see `mask_tokens`).

    With `workers` > 0 a torch DataLoader reads and masks ahead in background processes, so the step never
    waits on the input. Masking is a pure function of (seed, epoch, index), so the batches are the same with
    or without workers; `position` is the sampler's state after the last batch handed out (not after what
    the workers read ahead), which is what a checkpoint stores. With a GPU `device` the batches come on it,
    copied from pinned memory: a copy from pageable memory would make the host wait for the GPU's queue to
    drain first. `whole_words`: WordPiece's words by `##`; another kind's by the word starts stored in the prepared
    `blocks` (PreparedBlocks.word_starts)."""

    def __init__(self, blocks, sampler, tokenizer, scheme: str | MaskScheme, seed: int, max_predictions: int,
                 workers: int = 0, device: torch.device | None = None, whole_words: bool = False):
        self.device = device if device is not None and device.type != "cpu" else None
        pin_memory = self.device is not None and self.device.type == "cuda"
        continues, stored = word_boundaries(tokenizer, blocks) if whole_words else (None, False)
        dataset = _MaskedMicroBatches(blocks, sorted(tokenizer.all_special_ids), tokenizer.mask_token_id,
                                      len(tokenizer), scheme, seed, max_predictions, continues, stored)
        self.position = sampler.state_dict()
        if workers > 0:
            loader = torch.utils.data.DataLoader(
                dataset, sampler=_MicroBatchPlan(sampler), batch_size=None, num_workers=workers,
                pin_memory=pin_memory, prefetch_factor=4, persistent_workers=False,
                # its own generator: the workers' base seed would otherwise be drawn from the global torch RNG,
                # shifting dropout and Gumbel noise (masking itself needs no torch RNG)
                generator=torch.Generator().manual_seed(seed),
                worker_init_fn=_leave_stop_signals_to_the_rank,
                # fork, as Python before 3.14 did on Linux: under forkserver (3.14's default) the workers' parent
                # is the fork server, which a SIGTERM to the process group kills, and the workers with it
                multiprocessing_context="fork" if "fork" in multiprocessing.get_all_start_methods() else None,
            )
            self._it = iter(loader)
            # the workers ignore SIGTERM, so they are stopped here before multiprocessing's exit handler sends
            # them SIGTERM and joins them (which would wait forever); atexit runs the newer handler first
            atexit.register(_stop_workers, weakref.ref(self._it))
        else:
            items = map(dataset.__getitem__, _MicroBatchPlan(sampler))
            self._it = (((buffer.pin_memory() if pin_memory else buffer, layout), pos)
                        for (buffer, layout), pos in items)

    def __next__(self) -> dict[str, torch.Tensor]:
        (buffer, layout), self.position = next(self._it)
        if self.device is not None:  # one asynchronous copy; the batch's tensors are views of it there
            buffer = buffer.to(self.device, non_blocking=True)
        return unpack(buffer, layout)

    def __iter__(self):
        return self
