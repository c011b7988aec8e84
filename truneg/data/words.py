"""Where words start: the tokenizer kinds truneg tells apart, and the word-start bits `truneg prepare` stores.

Whole-word masking (masking.whole_word_positions) needs each piece's word. WordPiece (BERT's, ELECTRA's) marks the
pieces that continue a word (`##`), so its words are read from the ids. Byte-level BPE (RoBERTa's, GPT-2's) and
SentencePiece's Metaspace (XLM-R's, T5's) mark the tokens that start a word (`Ġ`, `▁`), but not every start: a
prepared line has no leading space (`remains` at a line's start is `re m ain s`, no `Ġ`) and a quote glues to its
word (`"Well` is `" W ell`). So `truneg prepare` stores a word-start bit per token (format 2), taken from the
tokenizer's own pre-tokenizer words (its backend's `Encoding.word_ids`): a token starts a word when it is the first
of its line (or of a slice of a long line), or when the pre-tokenizer put it in another word than the token before.
Byte-level BPE's pre-tokenizer (GPT-2's pattern) splits letters, digits, punctuation and `'s`-like endings apart
(`"`, `Well`, `,` are three words; `don't` is `don` + `'t`); Metaspace splits on spaces only (`"Well,` is one word).
"""
from __future__ import annotations

import json
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# The tokenizer kinds truneg tells apart, by how they mark words: WordPiece marks the pieces that continue a word,
# byte-level BPE and SentencePiece's Metaspace the tokens that start one.
PRE_TOKENIZER_KINDS = {"ByteLevel": "byte-level BPE", "Metaspace": "SentencePiece"}
STORED_KINDS = ("byte-level BPE", "SentencePiece")  # the kinds whose word starts `truneg prepare` stores
STARTS_SUFFIX = ".starts"  # beside each shard: [blocks, ceil(seq_len / 8)] uint8, one bit a token (np.packbits)
PROBE_WORDS = "one two three"  # a pre-tokenizer that splits words makes three of it
_BEFORE_THE_FIRST = object()  # unequal to any word id


def tokenizer_kind(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """"WordPiece", "byte-level BPE" or "SentencePiece", read from the fast tokenizer's backend (its model, else its
    pre-tokenizer); the backend model's name for another kind; None for a tokenizer without a backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    model = type(backend.model).__name__
    if model == "WordPiece":
        return model
    spec = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    parts = spec.get("pretokenizers", [spec]) if spec.get("type") == "Sequence" else [spec]
    kinds = [PRE_TOKENIZER_KINDS[p["type"]] for p in parts if p.get("type") in PRE_TOKENIZER_KINDS]
    return kinds[0] if kinds else model


def stores_word_starts(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `truneg prepare` stores word-start bits for this tokenizer (WordPiece's `##` needs none)."""
    return tokenizer_kind(tokenizer) in STORED_KINDS


def splits_words(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's pre-tokenizer splits text into words: Metaspace with `split=False` (Llama's) or
    ByteLevel without its pattern make one word of a whole line, whose starts no bit can then tell."""
    encoding = tokenizer.backend_tokenizer.encode(PROBE_WORDS, add_special_tokens=False)
    return len({w for w in encoding.word_ids if w is not None}) == len(PROBE_WORDS.split())


def encoding_starts(word_ids: Sequence[int | None]) -> Iterator[bool]:
    """Each token's word-start bit, from one encoded text's word ids: its first token starts a word, and so does
    a token of another word than the one before. (An added token is a word of its own: it has its own word id.)"""
    return map(operator.ne, word_ids, [_BEFORE_THE_FIRST, *word_ids])  # C-level: a third of a generator's time


def pack_starts(blocks: np.ndarray) -> np.ndarray:
    """[n, seq_len] bools -> [n, ceil(seq_len / 8)] uint8, as stored."""
    return np.packbits(blocks, axis=1)


def unpack_starts(packed: np.ndarray, seq_len: int) -> np.ndarray:
    """`pack_starts`'s rows -> [n, seq_len] bools."""
    return np.unpackbits(packed, axis=1, count=seq_len).astype(bool)


def packed_width(seq_len: int) -> int:
    return -(-seq_len // 8)
