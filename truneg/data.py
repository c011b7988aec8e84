"""Corpus -> packed token blocks (cached, memory-mapped) -> resumable sampler -> dynamic masking.

Blocks are `[CLS] t1 .. t_{L-2} [SEP]` cut from the concatenated token stream of the corpus; a blank
line ends a document and puts a [SEP] into the stream. Masking is a pure function of
(seed, epoch, sequence index), so it is drawn anew at each epoch, is identical after a resume, and
does not depend on the world size.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from truneg.errors import UserError

CACHE_FORMAT = 1
ASSETS = Path(__file__).parent / "assets"
DEFAULT_TOKENIZER = ASSETS / "vocab"
DEMO_CORPUS = ASSETS / "corpus"


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRUNEG_CACHE", Path.home() / ".cache" / "truneg"))


def load_tokenizer(name_or_dir: str | Path = DEFAULT_TOKENIZER):
    """The fast tokenizer of a folder or hub name (the default is the shipped bert-base-uncased vocab)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(name_or_dir))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load tokenizer {name_or_dir} ({err}); pass a folder with vocab.txt") from None


def resolve_text_files(spec: str | Sequence[str]) -> list[Path]:
    """A file, a folder (its *.txt, recursively) or a glob; several may be given. Sorted, deduplicated."""
    specs = [spec] if isinstance(spec, (str, Path)) else list(spec)
    files: set[Path] = set()
    for item in specs:
        path = Path(item)
        if path.is_dir():
            files.update(p for p in path.rglob("*.txt") if p.is_file())
        elif path.is_file():
            files.add(path)
        else:
            files.update(Path(p) for p in glob.glob(str(item), recursive=True) if Path(p).is_file())
    if not files:
        raise UserError(f"no text files found at {', '.join(map(str, specs))}; pass a file, a folder or a glob")
    empty = [p for p in files if p.stat().st_size == 0]
    if len(empty) == len(files):
        raise UserError(f"the corpus at {', '.join(map(str, specs))} is empty; give it some text")
    return sorted(files)


def _corpus_fingerprint(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.resolve()).encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _tokenizer_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    state = json.dumps([type(tokenizer).__name__, getattr(tokenizer, "do_lower_case", None), vocab])
    return hashlib.sha256(state.encode()).hexdigest()


def _load_text_dataset(train_data: str | Sequence[str], cache_dir: Path):
    """Rows of text from files (one row per line; empty rows are document boundaries) or an HF dataset."""
    import datasets

    if isinstance(train_data, str) and train_data.startswith("hf:"):
        # hf:NAME[:CONFIG][@SPLIT]#COLUMN, e.g. hf:wikitext:wikitext-103-raw-v1@train#text
        spec, _, column = train_data[3:].partition("#")
        spec, _, split = spec.partition("@")
        name, _, config = spec.partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "train", cache_dir=str(cache_dir / "hf"))
        except Exception as err:  # the hub or the local script raises many types
            raise UserError(f"cannot load HF dataset {name!r} ({type(err).__name__}: {err})") from None
        column = column or "text"
        if column not in ds.column_names:
            raise UserError(f"HF dataset {name!r} has no column {column!r}; name one with #COLUMN")
        return ds.select_columns([column]).rename_column(column, "text"), name
    files = resolve_text_files(train_data)
    ds = datasets.load_dataset(
        "text",
        data_files=[str(p) for p in files],
        split="train",
        encoding_errors="replace",  # undecodable bytes become U+FFFD and are counted, not fatal
        cache_dir=str(cache_dir / "hf"),
    )
    return ds, _corpus_fingerprint(files)


def _tokenize_batch(batch: dict, tokenizer, sep_id: int) -> dict:
    # Only the ids: building Python lists of type ids and attention masks costs as much as tokenizing.
    encoded = tokenizer(batch["text"], add_special_tokens=False, return_attention_mask=False,
                        return_token_type_ids=False, verbose=False)["input_ids"]
    ids = [tokens if text.strip() else [sep_id] for text, tokens in zip(batch["text"], encoded)]
    return {"input_ids": ids, "replaced_chars": [text.count("\ufffd") for text in batch["text"]]}


def pack_blocks(flat_ids: np.ndarray, seq_len: int, cls_id: int, sep_id: int) -> np.ndarray:
    """Cut the token stream into [n, seq_len] blocks framed by [CLS] .. [SEP]; the tail is dropped."""
    body = seq_len - 2
    n = len(flat_ids) // body
    blocks = np.empty((n, seq_len), dtype=np.int32)
    blocks[:, 0], blocks[:, -1] = cls_id, sep_id
    blocks[:, 1:-1] = flat_ids[: n * body].reshape(n, body)
    return blocks


def build_blocks(
    train_data: str | Sequence[str],
    tokenizer,
    seq_len: int,
    cache_dir: Path | None = None,
    num_proc: int | None = None,
) -> Path:
    """Tokenize and pack a corpus once; return the `.npy` of blocks (reused while corpus, tokenizer, seq-len match)."""
    cache_dir = Path(cache_dir or default_cache_dir())
    ds, corpus_key = _load_text_dataset(train_data, cache_dir)
    key = hashlib.sha256(
        json.dumps([CACHE_FORMAT, corpus_key, _tokenizer_fingerprint(tokenizer), seq_len]).encode()
    ).hexdigest()[:24]
    out = cache_dir / "blocks" / f"{key}.npy"
    if out.is_file():
        return out
    tokenized = ds.map(
        _tokenize_batch,
        batched=True,
        batch_size=2000,
        num_proc=num_proc or min(os.cpu_count() or 1, max(1, len(ds) // 2000), 8),
        remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "sep_id": tokenizer.sep_token_id},
        desc="tokenize",
    )
    # The arrow column's flat value buffer is the token stream: no Python loop over rows.
    ids_column = tokenized.data.column("input_ids").combine_chunks()
    flat = ids_column.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    replaced = int(np.sum(tokenized.data.column("replaced_chars").to_numpy()))
    if replaced:
        print(f"truneg: warning: {replaced} undecodable bytes in the corpus were replaced by U+FFFD", flush=True)
    blocks = pack_blocks(flat, seq_len, tokenizer.cls_token_id, tokenizer.sep_token_id)
    if len(blocks) == 0:
        raise UserError(f"the corpus has {len(flat)} tokens, fewer than one block of --seq-len {seq_len}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp.npy")
    np.save(tmp, blocks)
    tmp.replace(out)  # atomic: concurrent builders on a shared file system are safe
    return out


def open_blocks(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r")


# ---------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------


@dataclass
class SamplerState:
    epoch: int = 0
    offset: int = 0  # sequences of this epoch's permutation consumed, across all ranks


class ResumableSampler:
    """Each global micro-step takes the next `micro_batch * world_size` sequences of a seeded per-epoch
    permutation, and rank r takes its slice. The position (epoch, offset) goes into checkpoints; it counts
    sequences, so a run resumed on another world size with the same global batch reads the same data."""

    def __init__(self, num_sequences: int, micro_batch: int, world_size: int, rank: int, seed: int):
        self.global_micro = micro_batch * world_size
        if num_sequences < self.global_micro:
            raise UserError(
                f"the corpus has {num_sequences} sequences, fewer than one micro-batch across ranks "
                f"({micro_batch} x {world_size}); add text or lower the batch size"
            )
        self.num_sequences, self.micro_batch, self.rank, self.seed = num_sequences, micro_batch, rank, seed
        self.state = SamplerState()

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """Yields (epoch, sequence indices of this rank's micro-batch) forever, from the current state."""
        while True:
            perm = self._permutation(self.state.epoch)
            while self.state.offset + self.global_micro <= self.num_sequences:
                start = self.state.offset + self.rank * self.micro_batch
                self.state.offset += self.global_micro
                yield self.state.epoch, perm[start : start + self.micro_batch]
            self.state = SamplerState(self.state.epoch + 1, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "offset": self.state.offset}

    def load_state_dict(self, state: dict) -> None:
        self.state = SamplerState(int(state["epoch"]), int(state["offset"]))


# ---------------------------------------------------------------------------------------------------
# Masking
# ---------------------------------------------------------------------------------------------------

MASK_SCHEMES = {
    # name: (selected share, of those -> [MASK], -> random token); the rest stay unchanged
    "bert": (0.15, 0.8, 0.1),
    "electra": (0.15, 0.85, 0.0),
}


def mask_tokens(
    input_ids: np.ndarray,
    special_ids: Sequence[int],
    mask_id: int,
    vocab_size: int,
    scheme: str,
    seed: int,
    epoch: int,
    indices: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic masking, a pure function of (seed, epoch, sequence index).

    Returns (masked input ids, labels) as int64 tensors; labels are the gold ids at selected positions
    and -100 elsewhere.
    """
    select_p, mask_p, random_p = MASK_SCHEMES[scheme]
    ids = np.array(input_ids, dtype=np.int64)
    draws = np.empty((3,) + ids.shape)
    for row, index in enumerate(indices):
        rng = np.random.default_rng([seed, epoch, int(index)])
        draws[0, row], draws[1, row] = rng.random((2, ids.shape[1]))
        draws[2, row] = rng.integers(0, vocab_size, ids.shape[1])
    maskable = ~np.isin(ids, np.asarray(special_ids))
    selected = (draws[0] < select_p) & maskable
    labels = np.where(selected, ids, -100)
    to_mask = selected & (draws[1] < mask_p)
    to_random = selected & (draws[1] >= mask_p) & (draws[1] < mask_p + random_p)
    ids[to_mask] = mask_id
    ids[to_random] = draws[2][to_random].astype(np.int64)
    return torch.from_numpy(ids), torch.from_numpy(labels)


class MaskedBatches:
    """Iterator of masked micro-batches for one rank: dicts of input_ids, attention_mask, labels."""

    def __init__(self, blocks: np.ndarray, sampler: ResumableSampler, tokenizer, scheme: str, seed: int):
        self.blocks, self.sampler, self.scheme, self.seed = blocks, sampler, scheme, seed
        self.special_ids = sorted(tokenizer.all_special_ids)
        self.mask_id, self.vocab_size = tokenizer.mask_token_id, len(tokenizer)
        self._it = iter(sampler)

    def __next__(self) -> dict[str, torch.Tensor]:
        epoch, indices = next(self._it)
        order = np.argsort(indices)  # sorted reads from the memory map, original order kept
        rows = np.empty((len(indices), self.blocks.shape[1]), dtype=np.int64)
        rows[order] = self.blocks[indices[order]]
        input_ids, labels = mask_tokens(
            rows, self.special_ids, self.mask_id, self.vocab_size, self.scheme, self.seed, epoch, indices
        )
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": labels,
            "original_ids": torch.from_numpy(rows),
        }

    def __iter__(self):
        return self
