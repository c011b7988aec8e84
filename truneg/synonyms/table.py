"""Synonym tables for hard correction: which vocabulary tokens count as synonyms of a gold token.

A table is CSR over the vocabulary: row `w` lists, sorted, the token ids that are synonyms of `w`
(never `w` itself). It is built from WordNet (through nltk), from embedding nearest neighbours, or from
a user's TSV (truneg/synonyms/sources.py), and saved as `.npz` together with the vocab's sha256, the source and
the options.
`SynonymLookup` turns it into sorted int64 keys `row * V + col` on the device, so membership is one
`torch.searchsorted` with no host sync.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from truneg.errors import UserError

CONTINUATION = "##"  # WordPiece's mark of a piece that continues the word before it
# Each tokenizer kind's mark of a token that starts a word (truneg.data.words.tokenizer_kind names the kinds):
# WordPiece marks the continuing pieces instead, byte-level BPE and SentencePiece the starts.
WORD_STARTS = {"WordPiece": "", "byte-level BPE": "\u0120", "SentencePiece": "\u2581"}  # Ġ, ▁
SHIPPED_WORDNET_TABLE = Path(__file__).resolve().parents[1] / "assets" / "synonyms" / "wordnet_bert-base-uncased.npz"


def vocab_sha256(tokens: Sequence[str]) -> str:
    """sha256 of the vocab as `vocab.txt` lays it out, one token per line (equal to the file's sha256sum)."""
    return hashlib.sha256(("\n".join(tokens) + "\n").encode("utf-8")).hexdigest()


def read_vocab(path: str | Path) -> list[str]:
    """Tokens of a `vocab.txt`, or of a tokenizer folder that holds one."""
    path = Path(path)
    if path.is_dir():
        path = path / "vocab.txt"
    if not path.is_file():
        raise UserError(f"vocab file {path} does not exist; pass a BERT vocab.txt or a folder holding one")
    try:
        tokens = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise UserError(f"vocab file {path} is not UTF-8 text ({err.reason} at byte {err.start}); "
                        "pass a BERT vocab.txt") from None
    if tokens and tokens[-1] == "":
        tokens.pop()
    if not tokens:
        raise UserError(f"vocab file {path} is empty; pass a BERT vocab.txt")
    return tokens


def continuing_pieces(tokens: Sequence[str], kind: str = "WordPiece") -> np.ndarray:
    """Bool over the vocab: the pieces that continue the word before them: WordPiece's `##...`; for a kind that marks
    word starts, a piece without the mark that begins with a letter (`ning` of `Ġrun ning`; not `,`)."""
    marker = WORD_STARTS[kind]
    if not marker:
        return np.array([token.startswith(CONTINUATION) for token in tokens], dtype=bool)
    return np.array([not token.startswith(marker) and token[:1].isalpha() for token in tokens], dtype=bool)


def word_of(token: str, kind: str = "WordPiece") -> str | None:
    """The word a token stands for on its own, its kind's word-start mark stripped, or None: a whole word is two or
    more letters (of any script: what `str.isalpha` accepts, Unicode's letter categories), so no `##` piece, no
    word-internal BPE piece (no `Ġ`), no special, `[unused*]`, digit or single letter."""
    marker = WORD_STARTS[kind]
    if not token.startswith(marker):
        return None
    word = token[len(marker):]
    return word if len(word) >= 2 and word.isalpha() else None


def eligible_token_ids(tokens: Sequence[str], kind: str = "WordPiece") -> np.ndarray:
    """The whole-word tokens (`word_of`), the only rows and synonyms a table holds."""
    return np.array([i for i, tok in enumerate(tokens) if word_of(tok, kind) is not None], dtype=np.int64)


@dataclass
class SynonymTable:
    """CSR synonym table over a vocabulary: `indices[indptr[w]:indptr[w+1]]` are the synonyms of token w."""

    indptr: np.ndarray  # int64 [V+1]
    indices: np.ndarray  # int32, sorted within each row
    tokens: list[str]
    source: str
    options: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def sha256(self) -> str:
        return vocab_sha256(self.tokens)

    @property
    def content_sha256(self) -> str:
        """sha256 of what the table says: the vocab, then the CSR arrays as little-endian int64 / int32.

        Independent of the `.npz` container (compression, zip timestamps) and of `source`/`options`, so
        two builds that give the same synonyms have the same hash and any changed row changes it. The
        run record stores it, so a resumed run knows whether its table is still the one it trained with.
        """
        digest = hashlib.sha256()
        digest.update(b"truneg-synonym-table-v1\n")
        digest.update(self.sha256.encode("ascii"))
        digest.update(np.ascontiguousarray(self.indptr, dtype="<i8").tobytes())
        digest.update(np.ascontiguousarray(self.indices, dtype="<i4").tobytes())
        return digest.hexdigest()

    @property
    def num_entries(self) -> int:
        return int(self.indptr[-1])

    @property
    def num_rows_with_synonyms(self) -> int:
        return int(np.count_nonzero(np.diff(self.indptr)))

    def row(self, token_id: int) -> np.ndarray:
        return self.indices[self.indptr[token_id] : self.indptr[token_id + 1]]

    def synonyms_of(self, word: str) -> list[str]:
        token_id = self.token_to_id.get(word)
        return [] if token_id is None else [self.tokens[j] for j in self.row(token_id)]

    @property
    def token_to_id(self) -> dict[str, int]:
        if not hasattr(self, "_token_to_id"):
            self._token_to_id = {tok: i for i, tok in enumerate(self.tokens)}
        return self._token_to_id

    def keys(self) -> np.ndarray:
        """Sorted int64 keys `row * V + col`, the form the device lookup searches."""
        rows = np.repeat(np.arange(self.vocab_size, dtype=np.int64), np.diff(self.indptr))
        return rows * self.vocab_size + self.indices.astype(np.int64)

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[int, int]], tokens: Sequence[str], source: str, options: dict):
        """CSR from (row, col) id pairs; drops self-pairs and duplicates, sorts each row."""
        arr = np.array(list(pairs), dtype=np.int64).reshape(-1, 2)
        return cls.from_arrays(arr[:, 0], arr[:, 1], tokens, source, options)

    @classmethod
    def from_arrays(cls, rows: np.ndarray, cols: np.ndarray, tokens: Sequence[str], source: str, options: dict):
        vocab_size = len(tokens)
        keys = np.unique(rows.astype(np.int64) * vocab_size + cols.astype(np.int64))
        keys = keys[keys // vocab_size != keys % vocab_size]
        counts = np.bincount(keys // vocab_size, minlength=vocab_size)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        indices = (keys % vocab_size).astype(np.int32)
        return cls(indptr, indices, list(tokens), source, dict(options))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            indptr=self.indptr,
            indices=self.indices,
            vocab=np.frombuffer("\n".join(self.tokens).encode("utf-8"), dtype=np.uint8),
            vocab_sha256=np.array(self.sha256),
            source=np.array(self.source),
            options=np.array(json.dumps(self.options, sort_keys=True)),
        )
        tmp.replace(path)  # a reader never sees a half-written table

    @classmethod
    def load(cls, path: str | Path, expect_tokens: Sequence[str] | None = None) -> SynonymTable:
        """Load a `.npz` table; with `expect_tokens`, refuse a table built for another vocab."""
        path = Path(path)
        if not path.is_file():
            raise UserError(f"synonym table {path} does not exist; build one with `truneg synonyms build`")
        try:
            with np.load(path, allow_pickle=False) as npz:
                indptr, indices = npz["indptr"], npz["indices"]
                tokens = npz["vocab"].tobytes().decode("utf-8").split("\n")
                stored_sha = str(npz["vocab_sha256"])
                source = str(npz["source"])
                options = json.loads(str(npz["options"]))
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, UnicodeDecodeError) as err:
            raise UserError(
                f"synonym table {path} is corrupt or truncated ({type(err).__name__}); rebuild it with "
                "`truneg synonyms build`"
            ) from None
        problem = csr_problem(indptr, indices, tokens, stored_sha)
        if problem:
            raise UserError(f"synonym table {path} is inconsistent: {problem}; rebuild it with `truneg synonyms build`")
        table = cls(indptr, indices, tokens, source, options)
        if expect_tokens is not None and vocab_sha256(expect_tokens) != stored_sha:
            raise UserError(
                f"synonym table {path} was built for vocab sha256 {stored_sha[:12]}..., but the model's vocab "
                f"is sha256 {vocab_sha256(expect_tokens)[:12]}...; rebuild the table with --vocab for this vocab"
            )
        return table


def csr_problem(indptr: np.ndarray, indices: np.ndarray, tokens: Sequence[str], stored_sha: str) -> str | None:
    """What is wrong with a stored CSR, in a few words, or None when it is a valid table.

    `SynonymLookup` turns the CSR into keys `row * V + col` and binary-searches them, which is only right
    when every row is sorted and unique; a self-pair would make a word its own synonym.
    """
    vocab_size = len(tokens)
    if indptr.dtype != np.int64 or indptr.shape != (vocab_size + 1,):
        return f"indptr is {indptr.dtype} {list(indptr.shape)}, expected int64 [{vocab_size + 1}] (vocab size + 1)"
    if indices.dtype != np.int32 or indices.ndim != 1:
        return f"indices is {indices.dtype} {list(indices.shape)}, expected a 1-D int32 array"
    if vocab_sha256(tokens) != stored_sha:
        return "its vocab does not match its stored vocab sha256"
    if indptr[0] != 0 or indptr[-1] != len(indices) or np.any(np.diff(indptr) < 0):
        return f"indptr must rise from 0 to len(indices) = {len(indices)}"
    if len(indices) and (indices.min() < 0 or indices.max() >= vocab_size):
        return f"indices must lie in [0, {vocab_size})"
    rising = np.diff(indices.astype(np.int64)) > 0
    row_starts = indptr[1:-1]
    rising[row_starts[(row_starts > 0) & (row_starts < len(indices))] - 1] = True  # across rows: no order
    if not rising.all():
        position = int(np.argmin(rising)) + 1
        row = int(np.searchsorted(indptr, position, side="right")) - 1
        return f"row {row} ({tokens[row]!r}) is not sorted and unique, which the lookup's binary search needs"
    rows = np.repeat(np.arange(vocab_size, dtype=np.int64), np.diff(indptr))
    if np.any(rows == indices):
        row = int(rows[rows == indices][0])
        return f"row {row} ({tokens[row]!r}) lists the word as its own synonym"
    return None


# ---------------------------------------------------------------------------------------------------
# Device lookup
# ---------------------------------------------------------------------------------------------------


class SynonymLookup(nn.Module):
    """On-device membership test `pred in V[gold]` through `torch.searchsorted` over sorted int64 keys."""

    def __init__(self, table: SynonymTable):
        super().__init__()
        self.vocab_size = table.vocab_size
        # Non-persistent: the table is data, not weights; int64 and bool survive .half()/.bfloat16().
        self.register_buffer("keys", torch.from_numpy(table.keys()), persistent=False)
        # HC's reach: the tokens with a row, and WordPiece's word-continuing pieces (`##...`)
        self.register_buffer("has_row", torch.from_numpy(np.diff(table.indptr) > 0), persistent=False)
        continues = continuing_pieces(table.tokens, table.options.get("tokenizer_kind", "WordPiece"))
        self.register_buffer("continues", torch.from_numpy(continues), persistent=False)

    def judgeable(self, gold: torch.Tensor, following: torch.Tensor) -> torch.Tensor:
        """Bool tensor shaped like `gold`: True where `gold` is a word of its own with synonyms (HC's reach): it has a
        row and the token after it (`following`, the original's) does not continue its word (a masked `run` of
        `running` is no word of its own: its synonyms would not be the word's)."""
        in_vocab = (gold >= 0) & (gold < self.vocab_size) & (following >= 0) & (following < self.vocab_size)
        gold, following = gold.clamp(0, self.vocab_size - 1), following.clamp(0, self.vocab_size - 1)
        return self.has_row[gold] & ~self.continues[following] & in_vocab

    def is_synonym(self, gold: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """Bool tensor shaped like `gold`: True where `pred` is in the synonym row of `gold`.

        An id outside the table's vocab [0, V) is never a synonym: unbounded, `pred = V + k` would read
        as key `(gold + 1) * V + k`, a synonym of the next row (a model whose output vocab exceeds V).
        """
        if self.keys.numel() == 0:
            return torch.zeros_like(gold, dtype=torch.bool)
        gold, pred = gold.long(), pred.long()
        in_vocab = (gold >= 0) & (gold < self.vocab_size) & (pred >= 0) & (pred < self.vocab_size)
        query = (gold * self.vocab_size + pred).reshape(-1)
        position = torch.searchsorted(self.keys, query).clamp_(max=self.keys.numel() - 1)
        return (self.keys[position] == query).reshape(gold.shape) & in_vocab
