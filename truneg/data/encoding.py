"""A unit's text -> its token stream (and each token's word-start bit) -> framed blocks: `truneg prepare`'s
tokenizing and packing (truneg/data/prepare.py runs them, a unit to a worker)."""
from __future__ import annotations

from itertools import chain

import numpy as np

from truneg.data import corpus, words


def encode(backend, texts: list[str], sep_id: int, rows_are_documents: bool) -> np.ndarray:
    """The token stream of some lines (a blank one is a [SEP]) or rows (each followed by [SEP]). The tokenizer
    gets at most about SLICE_CHARS characters at a time: a longer line or row in slices (corpus.text_slices)."""
    return encode_words(backend, texts, sep_id, rows_are_documents, with_starts=False)[0]


def encode_words(backend, texts: list[str], sep_id: int, rows_are_documents: bool,
                 with_starts: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """`encode`'s stream and, `with_starts`, each token's word-start bit (words.encoding_starts; a [SEP] and the
    first token of a slice are set)."""
    ids: list[list[int]] = [[] for _ in texts]
    starts: list[list[bool]] | None = [[] for _ in texts] if with_starts else None
    batch: list[tuple[int, str]] = []
    held = 0  # characters in the batch
    for i, text in enumerate(texts):
        for piece in corpus.text_slices(text):
            if batch and held + len(piece) > corpus.SLICE_CHARS:
                _encode_into(backend, batch, ids, starts)
                held = 0
            batch.append((i, piece))
            held += len(piece)
    _encode_into(backend, batch, ids, starts)

    def stream(rows: list, sep, dtype: type) -> np.ndarray:
        if rows_are_documents:
            pieces = list(chain.from_iterable((row, (sep,)) for row in rows))
        else:
            pieces = [row if t.strip() else (sep,) for t, row in zip(texts, rows)]
        return np.fromiter(chain.from_iterable(pieces), dtype=dtype, count=sum(map(len, pieces)))

    return stream(ids, sep_id, np.int64), None if starts is None else stream(starts, True, bool)


def _encode_into(backend, batch: list[tuple[int, str]], ids: list[list[int]],
                 starts: list[list[bool]] | None = None) -> None:
    """Tokenize a batch of (text index, slice) and append each slice's ids (and word-start bits) to its text's;
    empties the batch. The word ids need the pre-tokenizer's splits, which the fast call does not keep."""
    texts = [t for _, t in batch]
    encodings = (backend.encode_batch_fast(texts, add_special_tokens=False) if starts is None
                 else backend.encode_batch(texts, add_special_tokens=False))
    for (i, _), encoding in zip(batch, encodings):
        ids[i].extend(encoding.ids)
        if starts is not None:
            starts[i].extend(words.encoding_starts(encoding.word_ids))
    batch.clear()


def pack_blocks(stream: np.ndarray, seq_len: int, cls_id: int, sep_id: int,
                dtype: np.dtype | type = np.int32) -> tuple[np.ndarray, np.ndarray]:
    """Cut a token stream into [n, seq_len] blocks framed by [CLS] .. [SEP]: the blocks, and the tail left over
    (the next piece's start, or dropped at a unit's end)."""
    body = seq_len - 2
    n = len(stream) // body
    blocks = np.empty((n, seq_len), dtype=dtype)
    blocks[:, 0], blocks[:, -1] = cls_id, sep_id
    blocks[:, 1:-1] = stream[: n * body].reshape(n, body)
    return blocks, stream[n * body:]
