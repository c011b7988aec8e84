"""Corpus sources -> input units: the pieces a preparation tokenizes and packs independently.

A unit is a line-aligned byte range over the concatenation of the (sorted) text files, or a fixed range
of row groups of one parquet file of an `hf:` dataset (or a whole data file of another format), streamed,
never converted. Units are planned from file sizes or parquet footers alone, so every
machine of a split preparation plans the same units, and a unit's shard is the same bytes whichever
process, part or restart makes it. Inside a unit, text is read in chunks of about CHUNK_BYTES, which is
what bounds a worker's memory (not the unit size), lines whole: a line longer than a chunk (a file whose lines
end in a lone CR, a book on one line) is read whole, and a file without a line feed is one unit.

Documents: a blank line ends a document in text files (it becomes one [SEP]); each row of
an `hf:` dataset is a document (its tokens, then [SEP]). A line or row longer than SLICE_CHARS (a whole book)
is tokenized in slices (`text_slices`).
"""
from __future__ import annotations

import glob
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from truneg.errors import UserError

MiB = 1 << 20
CHUNK_BYTES = 1 * MiB
# The tokenizer takes some 50x the size of what it is given at once: longer lines and rows go to it in slices.
SLICE_CHARS = 1 * MiB
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
    """A file, a folder (its *.txt, recursively) or a glob; several may be given. Sorted, and each file once
    however many paths reach it (a folder and a file in it, a link): by the first of its paths."""
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
    first_path: dict[Path, Path] = {}
    for path in sorted(files):
        first_path.setdefault(path.resolve(), path)
    return sorted(first_path.values())


@dataclass
class HFSource:
    """An `hf:` dataset opened for streaming: nothing is downloaded or converted before tokenization, and
    each unit reads only its own part of one data file (so each machine of a split preparation reads its
    part). Parquet files are read by row groups (pyarrow, through fsspec: only the column's pages);
    other formats are streamed whole by `datasets`, a file per unit."""

    spec: HFSpec
    stream: object  # datasets.IterableDataset of the one column, one shard per data file
    files: list[str]
    row_groups: list[list[tuple[int, int]] | None]  # per parquet file, (rows, column bytes) of each row group
    nbytes: list[int]  # per file: the column's uncompressed bytes (parquet), else the file's size
    fingerprint: str


def _file_facts(url: str, column: str) -> tuple[list[tuple[int, int]] | None, int, list]:
    """(row groups, bytes, identity) of one data file: its size and version (mtime, or the hub's blob id),
    and for parquet each row group's rows and column bytes, from the footer (a few KB read)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    info = fs.info(path)
    identity = [url, info.get("size"), info.get("mtime") or info.get("blob_id") or info.get("ETag")]
    if not url.endswith(".parquet"):
        return None, int(info.get("size") or 0), identity
    import pyarrow.parquet as pq

    with fs.open(path, "rb") as fh:
        meta = pq.ParquetFile(fh).metadata
    col = [meta.schema.column(i).name for i in range(meta.num_columns)].index(column)
    groups = [(meta.row_group(g).num_rows, meta.row_group(g).column(col).total_uncompressed_size)
              for g in range(meta.num_row_groups)]
    return groups, sum(b for _, b in groups), identity


def open_hf(spec: HFSpec, cache_dir: Path | None) -> HFSource:
    """The dataset's column as a stream of its data files (parquet, json, csv, text: what datasets 5.x loads)."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(spec.name, spec.config, cache_dir=str(cache_dir) if cache_dir else None)
        files = [str(f) for f in builder.config.data_files[spec.split]]
        stream = builder.as_streaming_dataset(split=spec.split)
    except Exception as err:  # the hub, the builders and the file system raise many types
        first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
        raise UserError(f"cannot load HF dataset {spec} ({type(err).__name__}: {first[:300]}); "
                        "check the name, config and split (only parquet/arrow/csv/json/text datasets load)") from None
    columns = stream.column_names or list(next(iter(stream.take(1)), {}).keys())
    if spec.column not in columns:
        raise UserError(f"HF dataset {spec.name!r} has no column {spec.column!r} (it has {', '.join(columns)}); "
                        "name one with #COLUMN")
    stream = stream.select_columns([spec.column])
    if stream.num_shards != len(files):  # one shard per data file is what the units rely on
        raise UserError(f"HF dataset {spec} streams as {stream.num_shards} shards from {len(files)} data files; "
                        "save it as parquet files (Dataset.to_parquet) and pass their folder as hf:FOLDER#COLUMN")
    facts = [_file_facts(f, spec.column) for f in files]
    fingerprint = hashlib.sha256(json.dumps([str(spec), [f[2] for f in facts]]).encode()).hexdigest()
    return HFSource(spec, stream, files, [f[0] for f in facts], [f[1] for f in facts], fingerprint)


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


def plan_hf_units(source: HFSource, unit_bytes: int | None) -> tuple[list[dict], int]:
    """Runs of whole row groups of each parquet file, about unit_bytes of the column each (a larger row
    group is a unit alone), so every byte is read once; a whole file of another format:
    [{"file": k, "row_groups": [first, end] | None, "rows": n | None, "bytes": n}]."""
    unit_bytes = unit_bytes or unit_bytes_for(sum(source.nbytes))
    units = []
    for k, groups in enumerate(source.row_groups):
        if groups is None:
            units.append({"file": k, "row_groups": None, "rows": None, "bytes": source.nbytes[k]})
            continue
        first, rows, nbytes = 0, 0, 0
        for g, (n, b) in enumerate(groups):
            rows, nbytes = rows + n, nbytes + b
            if nbytes >= unit_bytes or g == len(groups) - 1:
                units.append({"file": k, "row_groups": [first, g + 1], "rows": rows, "bytes": nbytes})
                first, rows, nbytes = g + 1, 0, 0
    return units, unit_bytes


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
                if not raw:  # (read would return nothing for ever)
                    raise UserError(f"{path} is shorter than when this preparation was planned: it changed while "
                                    "being prepared; prepare it again once it stays as it is")
                left -= len(raw)
                if left > 0 and not raw.endswith(b"\n"):
                    tail = fh.readline(left)
                    raw += tail
                    left -= len(tail)
                digest.update(raw)
                text = raw.decode("utf-8", errors="replace")
                yield text.splitlines(), text.count("\ufffd")


def _unit_batches(source: HFSource, unit: dict) -> Iterator[list]:
    if unit["row_groups"] is None:
        stream = source.stream.shard(num_shards=len(source.files), index=unit["file"], contiguous=True)
        for batch in stream.iter(batch_size=HF_BATCH_ROWS):
            yield batch[source.spec.column]
        return
    import fsspec
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(source.files[unit["file"]])
    with fs.open(path, "rb") as fh:
        groups = range(*unit["row_groups"])
        for batch in pq.ParquetFile(fh).iter_batches(HF_BATCH_ROWS, row_groups=groups, columns=[source.spec.column]):
            yield batch.column(0).to_pylist()


def iter_hf_unit(source: HFSource, unit: dict, digest: hashlib._Hash) -> Iterator[tuple[list[str], int]]:
    """(row texts, replaced characters) of a unit, up to HF_BATCH_ROWS rows and about CHUNK_BYTES of text at a
    time (a row can be a whole book: the tokenizer's memory is some 50x the text it is given); hashes the texts."""
    for batch in _unit_batches(source, unit):
        texts, size = [], 0
        for text in batch:
            text = text or ""
            digest.update(text.encode("utf-8", errors="replace"))
            digest.update(b"\0")
            texts.append(text)
            size += len(text)
            if size >= CHUNK_BYTES:
                yield texts, sum(t.count("\ufffd") for t in texts)
                texts, size = [], 0
        if texts:
            yield texts, sum(t.count("\ufffd") for t in texts)


_LAST_SPACE = re.compile(r"\s\S*\Z")  # searched between two positions: the last whitespace character before the end


def text_slices(text: str) -> list[str]:
    """`text` in slices of at most SLICE_CHARS characters, each cut just before a whitespace character, so that
    the slices' tokens are the text's (WordPiece splits words at whitespace; a byte-level BPE keeps the space
    with the word after it). A run of SLICE_CHARS characters without whitespace is cut where it ends."""
    slices, start = [], 0
    while len(text) - start > SLICE_CHARS:
        end = start + SLICE_CHARS
        space = _LAST_SPACE.search(text, start + 1, end + 1)
        cut = space.start() if space else end
        slices.append(text[start:cut])
        start = cut
    slices.append(text[start:])
    return slices
