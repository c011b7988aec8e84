"""Corpus -> prepared folder of packed token blocks (memory-mapped) -> resumable sampler (masking: masking.py).

Blocks are `[CLS] t1 .. t_{L-2} [SEP]` cut from the token stream of each unit of the corpus (see
truneg/data/prepare.py); a blank line ends a document and puts a [SEP] into the stream. The sampler's order is a
pure function of (seed, epoch), so it is identical after a resume and does not depend on the world size.
"""
from __future__ import annotations

import glob
import os
import resource
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from truneg.data import prepare as prep
from truneg.data import words
from truneg.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSETS = Path(__file__).resolve().parents[1] / "assets"
DEFAULT_TOKENIZER = ASSETS / "vocab"
DEMO_CORPUS = ASSETS / "corpus"
# The automatic path (a corpus given to training) prepares at most this much text inside a launch;
# beyond it, `truneg prepare` once (on many processes and machines) is the way.
AUTO_PREPARE_MAX_BYTES = 2 << 30


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRUNEG_CACHE", Path.home() / ".cache" / "truneg"))


def load_tokenizer(name_or_dir: str | Path = DEFAULT_TOKENIZER) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a folder or hub name, `NAME@REVISION` too (the default is the shipped bert-base-uncased
    vocab)."""
    from transformers import AutoTokenizer

    spec = str(name_or_dir)
    name, _, revision = (spec, "", "") if Path(spec).exists() else spec.partition("@")
    try:
        return AutoTokenizer.from_pretrained(name, revision=revision or None)
    except (OSError, ValueError) as err:
        raise UserError(f"cannot load tokenizer {name_or_dir} ({err}); pass a folder with vocab.txt") from None


# ---------------------------------------------------------------------------------------------------
# Prepared folders
# ---------------------------------------------------------------------------------------------------


def _allow_open_files(needed: int) -> None:
    """Raise the soft limit on open files to the hard one when `needed` (plus what NCCL, CUDA and the
    DataLoader's shared tensors take: 1024) does not fit under it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = needed + 1024
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise UserError(f"the corpus needs about {needed} open files (one per shard) and this process may open "
                            f"{hard}; raise the hard limit (ulimit -Hn {wanted}, or the scheduler's or limits.conf's "
                            "nofile)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else hard, hard))


class PreparedBlocks:
    """The blocks of a prepared folder: the union of its memory-mapped shards, indexed like one
    [n, seq_len] array (`blocks[indices]` -> int32 rows; a sorted index array reads each shard in order).
    A folder of format 2 prepared with a byte-level BPE or SentencePiece tokenizer also holds each token's
    word-start bit (`word_starts(indices)`, truneg/data/words.py)."""

    def __init__(self, folder: Path, index: dict):
        self.folder, self.index, self.fingerprint = folder, index, index["fingerprint"]
        self.seq_len, dtype = index["seq_len"], np.dtype(index["dtype"])
        self.has_word_starts = bool(index.get("word_starts"))
        for shard in index["shards"]:
            _check_size(folder / shard["file"], shard["blocks"] * self.seq_len * dtype.itemsize)
            if self.has_word_starts:
                _check_size(folder / shard["starts"], shard["blocks"] * words.packed_width(self.seq_len))
        self._map_shards()

    def _map_shards(self) -> None:
        """Each mapping holds an open file: a corpus at the paper's scale has thousands of shards, past the
        usual soft limit of 1024 open files, so the soft limit is raised to the hard one where they need it."""
        dtype, shards = np.dtype(self.index["dtype"]), [s for s in self.index["shards"] if s["blocks"]]
        _allow_open_files(len(shards) * (2 if self.has_word_starts else 1))
        self._shards = [np.memmap(self.folder / s["file"], dtype=dtype, mode="r", shape=(s["blocks"], self.seq_len))
                        for s in shards]
        width = words.packed_width(self.seq_len)
        self._starts = [np.memmap(self.folder / s["starts"], dtype=np.uint8, mode="r", shape=(s["blocks"], width))
                        for s in shards] if self.has_word_starts else []
        self._offsets = np.concatenate([[0], np.cumsum([s["blocks"] for s in shards])]).astype(np.int64)

    # A DataLoader worker started by spawn or forkserver (Python 3.14's default on Linux) gets the dataset
    # pickled, and a memmap pickles as all of its bytes: the worker maps the shards itself instead.
    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_shards", "_starts", "_offsets")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._map_shards()

    def __len__(self) -> int:
        return int(self._offsets[-1])

    @property
    def shape(self) -> tuple[int, int]:
        return len(self), self.seq_len

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, tuple):  # blocks[rows, columns]
            rows = self[key[0]]
            return rows[key[1:]] if rows.ndim == 1 else rows[(slice(None), *key[1:])]
        if isinstance(key, (int, np.integer)):
            return self[np.array([key])][0]
        return self._gather(self._shards, key, self.seq_len, np.int32)

    def word_starts(self, indices) -> np.ndarray:
        """[n, seq_len] bools: which tokens of blocks `indices` start a word (as prepared; the bits of [CLS]
        and [SEP] are set, and mean nothing: specials are never masked)."""
        if not self.has_word_starts:
            raise UserError(f"{self.folder} holds no word starts (format {self.index.get('format')!r}, or a WordPiece "
                            "tokenizer's); prepare the corpus again with `truneg prepare ... --out NEW_DIR`")
        return words.unpack_starts(self._gather(self._starts, indices, words.packed_width(self.seq_len), np.uint8),
                                   self.seq_len)

    def _gather(self, maps: list[np.memmap], key, width: int, dtype: type) -> np.ndarray:
        indices = np.arange(len(self))[key] if isinstance(key, slice) else np.asarray(key, dtype=np.int64)
        if indices.size and (indices.min() < -len(self) or indices.max() >= len(self)):
            raise IndexError(f"block index out of range for {len(self)} blocks")
        indices = np.where(indices < 0, indices + len(self), indices)
        shard_of = np.searchsorted(self._offsets, indices, side="right") - 1
        rows = np.empty((len(indices), width), dtype=dtype)
        for s in np.unique(shard_of):
            at = shard_of == s
            rows[at] = maps[s][indices[at] - self._offsets[s]]
        return rows


def _check_size(path: Path, expect: int) -> None:
    size = path.stat().st_size if path.is_file() else None
    if size != expect:
        state = "missing" if size is None else f"{size} bytes, {expect} expected: truncated or replaced"
        raise UserError(f"shard {path} is {state}; run the same `truneg prepare` again into a new --out")


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / prep.INDEX).is_file()


def prepared_seq_len(folder: str | Path) -> int | None:
    """The --seq-len a prepared folder's blocks have (its index), without opening them; None for a damaged index."""
    try:
        return int(prep._read_json(Path(folder) / prep.INDEX)["seq_len"])
    except (UserError, KeyError, TypeError, ValueError):
        return None  # (open_prepared says what is wrong)


def open_prepared(folder: str | Path, tokenizer: PreTrainedTokenizerBase | None = None,
                  seq_len: int | None = None) -> PreparedBlocks:
    """A prepared folder's blocks, checked against the tokenizer and --seq-len the run uses."""
    folder = Path(folder)
    if not is_prepared(folder):
        if (folder / prep.SETTINGS).is_file():
            raise UserError(f"{folder} is an unfinished preparation (no {prep.INDEX}): run the same `truneg prepare` "
                            "again to finish it, or `truneg prepare --merge PART_DIRS... --out DIR` for parts")
        raise UserError(f"{folder} has no {prep.INDEX}: not a prepared folder; run `truneg prepare` into it")
    index = prep._read_json(folder / prep.INDEX)
    if index.get("format") not in prep.READABLE_FORMATS:
        raise UserError(f"{folder} was prepared in format {index.get('format')!r}, not {prep.FORMAT!r}; prepare it "
                        "again")
    if seq_len is not None and index["seq_len"] != seq_len:
        raise UserError(f"{folder} holds blocks of --seq-len {index['seq_len']}, not {seq_len}; "
                        f"pass --seq-len {index['seq_len']} or prepare the corpus again with --seq-len {seq_len}")
    if tokenizer is not None and index["tokenizer"] != prep.tokenizer_fingerprint(tokenizer):
        raise UserError(f"{folder} was prepared with another tokenizer (vocab); pass that --tokenizer or prepare "
                        "the corpus again with this one")
    if tokenizer is not None and index.get("tokenizer_probe") != prep.tokenizer_probe(tokenizer):
        raise UserError(f"{folder} was prepared with a tokenizer of the same vocab that splits text otherwise (its "
                        "lowercasing, accents or CJK options); pass that --tokenizer or prepare the corpus again")
    return PreparedBlocks(folder, index)


def ensure_prepared(
    train_data: str | Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    cache_dir: Path | None = None,
    num_proc: int | None = None,
    *,
    prepare: bool = True,
) -> Path:
    """The prepared folder for --train-data: the folder itself, or the cache's preparation of a corpus
    (made here when `prepare`, for corpora up to AUTO_PREPARE_MAX_BYTES). No collective: call it on each
    node's local rank 0 before `deepspeed.init_distributed`, so no barrier waits on the tokenizer."""
    specs = [str(train_data)] if isinstance(train_data, (str, Path)) else [str(s) for s in train_data]
    prepared = [s for s in specs if Path(s).is_dir() and ((Path(s) / prep.INDEX).is_file()
                                                         or (Path(s) / prep.SETTINGS).is_file())]
    if prepared:
        if len(specs) > 1:
            raise UserError(f"{prepared[0]} is a prepared folder: give it alone to --train-data")
        open_prepared(prepared[0])  # an unfinished one is a clear error here
        return Path(prepared[0])
    cache_dir = Path(cache_dir or default_cache_dir())
    settings, units, _ = prep.plan(specs, tokenizer, seq_len, cache_dir / "hf")
    folder = cache_dir / "prepared" / prep.settings_key(settings)[:24]
    if is_prepared(folder):
        return folder
    if not prepare:
        raise UserError(f"{' '.join(specs)} is not prepared in {cache_dir}; prepare it on this node's local rank 0 "
                        "first")
    size = sum(u["bytes"] for u in units)
    if size > AUTO_PREPARE_MAX_BYTES:
        raise UserError(
            f"the corpus is {size / 1e9:.1f} GB, too large to prepare inside a training launch; run once "
            f"`truneg prepare --train-data {' '.join(specs)} --seq-len {seq_len} --out DIR --num-proc N` "
            "(add --part i/n on n machines) and pass --train-data DIR")
    # Into a folder of this process's own, published by one atomic rename: two launches, or the local rank 0
    # of several nodes sharing the cache, may prepare the same corpus at once.
    own = _private_folder(folder)
    prep.prepare(specs, tokenizer, seq_len, own, num_proc, hf_cache_dir=cache_dir / "hf")
    try:
        own.rename(folder)
    except OSError:  # another process published the same preparation first
        shutil.rmtree(own, ignore_errors=True)
        if not is_prepared(folder):
            raise
    return folder


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _private_folder(folder: Path) -> Path:
    """`FOLDER.HOST.PID.XXXX.tmp`, this process's own. A folder a killed preparation on this host left (its
    process gone) is taken over, so its committed shards are kept and only the rest is prepared; another
    host's are left alone (its process cannot be checked from here)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    mine = f"{folder.name}.{socket.gethostname()}."
    own = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f"{mine}{os.getpid()}.", suffix=".tmp"))
    for left in sorted(folder.parent.glob(f"{glob.escape(mine)}*.tmp")):
        pid = left.name[len(mine):].split(".")[0]
        if left == own or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        try:
            left.rename(own)  # replaces the empty `own`; of two takers one wins, the other finds it gone
        except OSError:
            continue
        print(f"truneg: continuing the preparation a killed process left in {left.name}", flush=True)
        break
    return own


def open_training_blocks(train_data: str | Sequence[str], tokenizer: PreTrainedTokenizerBase, seq_len: int,
                         **where) -> tuple[PreparedBlocks, str]:
    """(blocks, fingerprint) of --train-data: a prepared folder, or a corpus prepared into the cache.

    The fingerprint names the prepared content (tokenizer, seq_len and every shard's bytes): record it
    with the run, so a folder prepared again from another corpus is not resumed as the same run. `where`:
    ensure_prepared's cache_dir, num_proc and prepare."""
    blocks = open_prepared(ensure_prepared(train_data, tokenizer, seq_len, **where), tokenizer, seq_len)
    return blocks, blocks.fingerprint


def whole_word_problem(tokenizer: PreTrainedTokenizerBase, name: str | None, train_data: str | Sequence[str],
                       seq_len: int) -> str | None:
    """Why --whole-word-masking cannot tell this run's word starts (one line), or None: a tokenizer of no kind truneg
    reads words of, one whose pre-tokenizer does not split words, or a prepared folder of format 1 given with a
    byte-level BPE or SentencePiece tokenizer (its word starts were not stored). A corpus given to training is
    prepared in the current format, which stores them."""
    kind = words.tokenizer_kind(tokenizer)
    if kind == "WordPiece":
        return None
    if kind not in words.STORED_KINDS:
        return (f"--whole-word-masking: --tokenizer {name} is {kind or 'of no kind truneg can read'}, whose word "
                "starts truneg cannot tell (it reads WordPiece's `##`, and byte-level BPE's and SentencePiece's "
                "words); drop the flag, or use a tokenizer of those kinds")
    if not words.splits_words(tokenizer):
        return (f"--whole-word-masking: --tokenizer {name} is {kind} whose pre-tokenizer does not split text into "
                f"words (it makes one word of {words.PROBE_WORDS!r}), so truneg cannot tell its word starts; drop the "
                "flag")
    specs = [train_data] if isinstance(train_data, (str, Path)) else list(train_data)
    if len(specs) == 1 and is_prepared(specs[0]):
        index = prep._read_json(Path(specs[0]) / prep.INDEX)
        if index.get("format") == prep.FORMAT_WITHOUT_STARTS:
            return (f"--whole-word-masking: {specs[0]} was prepared in format {prep.FORMAT_WITHOUT_STARTS!r}, without "
                    f"the word starts a {kind} tokenizer needs; prepare the corpus again into a new folder: truneg "
                    f"prepare --train-data CORPUS --tokenizer {name} --seq-len {seq_len} --out NEW_DIR")
    return None


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
    sequences, so a run resumed on another world size with the same global batch reads the same data. An
    epoch ends where the next global batch (x `accumulation`) would not fit: the tail it drops is the same
    whatever the split of that batch into ranks and micro-steps."""

    def __init__(self, num_sequences: int, micro_batch: int, world_size: int, rank: int, seed: int,
                 accumulation: int = 1):
        self.global_micro = micro_batch * world_size
        self.global_batch = self.global_micro * accumulation
        if num_sequences < self.global_batch:
            raise UserError(
                f"the corpus has {num_sequences} sequences, fewer than one global batch ({micro_batch} x "
                f"{accumulation} x {world_size}: micro-batch x accumulation x ranks); add text or lower the batch size"
            )
        self.num_sequences, self.micro_batch, self.rank, self.seed = num_sequences, micro_batch, rank, seed
        self.accumulation = accumulation
        self.state = SamplerState()

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """Yields (epoch, sequence indices of this rank's micro-batch) forever, from the current state."""
        while True:
            perm = self._permutation(self.state.epoch)
            # an optimizer step starts only where it fits whole. It starts at the offset a checkpoint saved, which
            # need not be a multiple of this run's global batch (`--resume DIR` of a run with another batch size).
            while self.state.offset + self.global_batch <= self.num_sequences:
                for _ in range(self.accumulation):
                    start = self.state.offset + self.rank * self.micro_batch
                    self.state.offset += self.global_micro
                    yield self.state.epoch, perm[start : start + self.micro_batch]
            self.state = SamplerState(self.state.epoch + 1, 0)

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "offset": self.state.offset}

    def load_state_dict(self, state: dict) -> None:
        self.state = SamplerState(int(state["epoch"]), int(state["offset"]))
