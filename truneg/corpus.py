"""Corpus sources -> input units: the pieces a preparation tokenizes and packs independently.

A unit is a line-aligned byte range over the concatenation of the (sorted) text files, or a fixed range
of rows of an `hf:` dataset. Units are planned from file sizes or the dataset's row count alone, so every
machine of a split preparation plans the same units, and a unit's shard is the same bytes whichever
process, part or restart makes it. Inside a unit, text is read in chunks of about CHUNK_BYTES, which is
what bounds a worker's memory (not the unit size).

Documents as before: a blank line ends a document in text files (it becomes one [SEP]); each row of
an `hf:` dataset is a document (its tokens, then [SEP]).
"""
from __future__ import annotations

import glob
import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from truneg.errors import UserError

MiB = 1 << 20
CHUNK_BYTES = 1 * MiB
HF_BATCH_ROWS = 1000
# About this many units per corpus (parallelism over processes and machines), each 1-64 MiB of text.
UNITS_TARGET = 512
MIN_UNIT_BYTES, MAX_UNIT_BYTES = 1 * MiB, 64 * MiB


@dataclass(frozen=True)
class HFSpec:
    """`hf:NAME[:CONFIG][@SPLIT]#COLUMN`, e.g. `hf:wikimedia/wikipedia:20231101.en@train#text`."""

    name: str
    config: str | None
    split: str
    column: str

    @classmethod
    def parse(cls, spec: str) -> HFSpec:
        body, _, column = spec[3:].partition("#")
        body, _, split = body.partition("@")
        name, _, config = body.partition(":")
        if not name:
            raise UserError(f"{spec!r} names no dataset; write hf:NAME[:CONFIG][@SPLIT]#COLUMN")
        return cls(name, config or None, split or "train", column or "text")

    def __str__(self) -> str:
        return f"hf:{self.name}{':' + self.config if self.config else ''}@{self.split}#{self.column}"


def is_hf(spec: str | Path) -> bool:
    return isinstance(spec, str) and spec.startswith("hf:")


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
    if all(p.stat().st_size == 0 for p in files):
        raise UserError(f"the corpus at {', '.join(map(str, specs))} is empty; give it some text")
    return sorted(files)


def load_hf(spec: HFSpec, cache_dir: Path | None):
    """The dataset's column as a memory-mapped arrow dataset (datasets downloads parquet once)."""
    import datasets

    try:
        ds = datasets.load_dataset(spec.name, spec.config, split=spec.split,
                                   cache_dir=str(cache_dir) if cache_dir else None)
    except Exception as err:  # the hub, the builders and the file system raise many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise UserError(f"cannot load HF dataset {spec} ({type(err).__name__}: {first[:300]}); "
                        "check the name, config and split (only parquet/arrow/csv/json/text datasets load)") from None
    if spec.column not in ds.column_names:
        raise UserError(f"HF dataset {spec.name!r} has no column {spec.column!r} (it has {', '.join(ds.column_names)}); "
                        "name one with #COLUMN")
    return ds.select_columns([spec.column])


def unit_bytes_for(total_bytes: int) -> int:
    """Units of 1-64 MiB, about UNITS_TARGET of them: a function of the corpus size alone."""
    want = -(-total_bytes // UNITS_TARGET)
    return min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, -(-want // MiB) * MiB))


def _line_end(path: Path, offset: int, size: int) -> int:
    """The first offset at or after `offset` that starts a line."""
    with open(path, "rb") as fh:
        fh.seek(offset - 1)
        while True:
            block = fh.read(1 << 16)
            if not block:
                return size
            at = block.find(b"\n")
            if at >= 0:
                return min(size, offset + at)  # position of "\n" is offset-1+at, the line starts after it
            offset += len(block)


def plan_text_units(files: list[Path], unit_bytes: int | None) -> tuple[list[dict], int]:
    """Line-aligned ranges over the concatenated files: [{"segments": [[path, start, end], ...], "bytes": n}]."""
    sizes = [p.stat().st_size for p in files]
    unit_bytes = unit_bytes or unit_bytes_for(sum(sizes))
    units, segments, filled = [], [], 0
    for path, size in zip(files, sizes):
        pos = 0
        while pos < size:
            end = pos + min(size - pos, unit_bytes - filled)
            if end < size:
                end = _line_end(path, end, size)
            segments.append([str(path.resolve()), pos, end])
            filled += end - pos
            pos = end
            if filled >= unit_bytes:
                units.append({"segments": segments, "bytes": filled})
                segments, filled = [], 0
    if segments:
        units.append({"segments": segments, "bytes": filled})
    return units, unit_bytes


def plan_hf_units(ds, unit_bytes: int | None) -> tuple[list[dict], int]:
    """Fixed row ranges, sized from the column's arrow bytes per row: [{"rows": [start, end], "bytes": n}]."""
    rows, total = len(ds), int(ds.data.nbytes)
    if rows == 0:
        return [], 0
    per_row = max(1, total // rows)
    rows_per_unit = max(1, (unit_bytes or unit_bytes_for(total)) // per_row)
    return [{"rows": [s, min(rows, s + rows_per_unit)], "bytes": per_row * (min(rows, s + rows_per_unit) - s)}
            for s in range(0, rows, rows_per_unit)], rows_per_unit


def iter_text_unit(segments: list, digest: hashlib._Hash) -> Iterator[tuple[list[str], int]]:
    """(lines, replaced characters) of a text unit, about CHUNK_BYTES at a time; hashes the raw bytes read.

    Lines as datasets' `text` builder and universal newlines make them: str.splitlines of the decoded
    text, undecodable bytes replaced by U+FFFD. Chunks end after a b"\\n", never inside a character.
    """
    for path, start, end in segments:
        with open(path, "rb") as fh:
            fh.seek(start)
            left = end - start
            while left > 0:
                raw = fh.read(min(left, CHUNK_BYTES))
                left -= len(raw)
                if left > 0 and not raw.endswith(b"\n"):
                    tail = fh.readline(left)
                    raw += tail
                    left -= len(tail)
                digest.update(raw)
                text = raw.decode("utf-8", errors="replace")
                yield text.splitlines(), text.count("\ufffd")


def iter_hf_unit(ds, column: str, rows: list[int], digest: hashlib._Hash) -> Iterator[tuple[list[str], int]]:
    """(row texts, replaced characters) of a row range, HF_BATCH_ROWS rows at a time; hashes the texts."""
    for start in range(rows[0], rows[1], HF_BATCH_ROWS):
        texts = [t or "" for t in ds[start: min(rows[1], start + HF_BATCH_ROWS)][column]]
        for text in texts:
            digest.update(text.encode("utf-8", errors="replace"))
            digest.update(b"\0")
        yield texts, sum(t.count("\ufffd") for t in texts)
