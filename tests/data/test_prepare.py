"""`truneg prepare` and prepared folders: an independent packing reference, resume, parts, dtypes, hf:, bad input."""
from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import framed_blocks

from truneg import cli
from truneg.data import encoding, prepare
from truneg.data.blocks import load_tokenizer, open_prepared, open_training_blocks
from truneg.errors import UserError

SEQ = 16
UNIT = 4096  # small units: a few per test corpus, so parts, workers and resume have several shards


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, small_corpus) -> Path:
    """Three files: the novel's start with CRLF line ends, blank lines, an undecodable byte and an empty file."""
    folder = tmp_path_factory.mktemp("texts")
    text = small_corpus.read_bytes()[:20_000]
    (folder / "a.txt").write_bytes(text[:9000].replace(b"\n", b"\r\n"))
    (folder / "b.txt").write_bytes(b"caf\xe9 society\n\n\n" + text[9000:])
    (folder / "c.txt").write_bytes(b"")
    return folder


def reference_stream(files: list[Path], tokenizer, tmp: Path) -> np.ndarray:
    """Today's pipeline, independently: datasets' `text` builder, the HF tokenizer call, [SEP] per blank line."""
    import datasets

    rows = list(datasets.load_dataset("text", data_files=[str(f) for f in files], split="train",
                                 encoding_errors="replace", cache_dir=str(tmp / "hf"))["text"])
    ids = tokenizer(rows, add_special_tokens=False)["input_ids"]
    return np.array([t for row, toks in zip(rows, ids) for t in (toks if row.strip() else [tokenizer.sep_token_id])])


def shard_bytes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((folder / "shards").glob("*.bin"))}


def assert_units_follow_stream(folder: Path, stream: np.ndarray, seq: int) -> None:
    """Each shard holds its unit's stream cut into blocks (its tail dropped), and the units' streams, end to
    end, are the whole corpus's stream: the cuts lose, split and reorder nothing."""
    index, at = open_prepared(folder).index, 0
    for shard in index["shards"]:
        blocks = np.fromfile(folder / shard["file"], dtype=np.uint16).reshape(-1, seq)
        assert (blocks[:, 1:-1].reshape(-1) == stream[at: at + shard["blocks"] * (seq - 2)]).all()
        assert (blocks[:, 0] == 101).all() and (blocks[:, -1] == 102).all()
        at += shard["tokens"]
    assert at == len(stream)


def test_blocks_equal_todays_packing_of_the_same_text(tmp_path, corpus, tokenizer):
    files = sorted(corpus.glob("*.txt"))
    stream = reference_stream(files, tokenizer, tmp_path)
    one = open_prepared(prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "one", 1, progress=False), tokenizer,
                        SEQ)
    expect = np.array(framed_blocks(stream, SEQ, tokenizer.cls_token_id, tokenizer.sep_token_id))
    assert one.shape == expect.shape and (one[np.arange(len(one))] == expect).all()
    # Several units: each unit is packed alone (its tail dropped), and the units' streams, end to end,
    # are the whole corpus's stream: the line-aligned cuts lose and split no line.
    many = prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "many", 1, unit_bytes=UNIT, progress=False)
    assert len(open_prepared(many).index["shards"]) >= 4
    assert_units_follow_stream(many, stream, SEQ)
    # as a DataLoader worker started by spawn/forkserver gets it: the folder's name, not the shards' bytes
    import pickle

    blocks = open_prepared(many)
    sent = pickle.dumps(blocks)
    assert len(sent) < 4096 < blocks.shape[0] * SEQ * 2
    assert (pickle.loads(sent)[np.arange(len(blocks))] == blocks[np.arange(len(blocks))]).all()
    # a soft limit on open files below the shard count is raised as far as the hard one allows
    import resource

    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, limits[1]))
        assert len(open_prepared(many)) == len(blocks) and resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 64
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)


def test_a_file_reached_by_two_paths_is_read_once(tmp_path, corpus, tokenizer):
    """A folder and a file in it, the same file by another path, a link to it: each file's text once (the
    plan of the folder alone), by its first path in sorted order."""
    import shutil

    from truneg.data.corpus import resolve_text_files

    texts = shutil.copytree(corpus, tmp_path / "texts")
    (tmp_path / "zz").mkdir()  # paths that sort after the files' own
    (tmp_path / "zz" / "link.txt").symlink_to(texts / "b.txt")
    (tmp_path / "zz" / "folder").symlink_to(texts)
    specs = [str(texts), str(texts / "a.txt"), str(tmp_path / "zz" / "link.txt"), str(tmp_path / "zz" / "folder")]
    assert resolve_text_files(specs) == sorted(texts.glob("*.txt"))
    assert prepare.plan(specs, tokenizer, SEQ)[1] == prepare.plan(str(texts), tokenizer, SEQ)[1]


def test_a_file_that_shrinks_while_being_prepared_is_a_clear_error(tmp_path, tokenizer):
    """Read to its planned end, a file cut short since would give nothing for ever: one line instead."""
    import hashlib

    from truneg.data.corpus import iter_text_unit

    text = tmp_path / "t.txt"
    text.write_text("one line\n" * 10)
    plan = prepare.plan(str(text), tokenizer, SEQ)[1]
    text.write_text("one line\n")
    with pytest.raises(UserError, match="t.txt is shorter than when this preparation was planned"):
        list(iter_text_unit(plan[0]["segments"], hashlib.sha256()))


def test_killed_prepare_resumes_to_the_same_shards(tmp_path, corpus, tokenizer):
    whole = prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "whole", 1, unit_bytes=UNIT, progress=False)
    killed = prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "killed", 1, unit_bytes=UNIT, progress=False)
    shards = sorted((killed / "shards").glob("*.bin"))
    # What a kill leaves: no index; a shard renamed but never committed (truncated, its record lost);
    # a half-written temporary file and no shard for the next unit.
    (killed / "index.json").unlink()
    (killed / "part-0-of-1.json").unlink()
    shards[1].with_suffix(".json").unlink()
    shards[1].write_bytes(shards[1].read_bytes()[:100])
    shards[2].rename(shards[2].with_name(shards[2].name + ".999.tmp"))
    shards[2].with_suffix(".json").unlink()
    kept = shards[0].stat().st_mtime_ns
    with pytest.raises(UserError, match="unfinished preparation"):
        open_training_blocks(str(killed), tokenizer, SEQ)
    prepare.prepare(str(corpus), tokenizer, SEQ, killed, 2, unit_bytes=UNIT, progress=False)  # 2 worker processes
    assert shard_bytes(killed) == shard_bytes(whole) and not list((killed / "shards").glob("*.tmp"))
    assert shards[0].stat().st_mtime_ns == kept, "a committed shard is not redone"
    assert open_prepared(killed).fingerprint == open_prepared(whole).fingerprint


def test_parts_merged_equal_one_preparation(tmp_path, corpus, tokenizer):
    whole = open_prepared(prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "whole", 1, unit_bytes=UNIT,
                                          progress=False))
    # part 0 and 2 share a folder (one shared file system), part 1 is elsewhere (another machine's disk)
    for i, folder in ((0, "shared"), (1, "other"), (2, "shared")):
        prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / folder, 1, part=(i, 3), unit_bytes=UNIT, progress=False)
    assert not (tmp_path / "shared" / "index.json").exists(), "a part alone is not a prepared folder"
    with pytest.raises(UserError, match="parts 1/3 are missing"):
        prepare.merge([tmp_path / "shared"], tmp_path / "merged")
    merged = open_prepared(prepare.merge([tmp_path / "shared", tmp_path / "other"], tmp_path / "merged"), tokenizer,
                           SEQ)
    assert merged.fingerprint == whole.fingerprint and len(merged) == len(whole)
    assert (merged[np.arange(len(merged))] == whole[np.arange(len(whole))]).all()
    assert {**shard_bytes(tmp_path / "shared"), **shard_bytes(tmp_path / "other")} == shard_bytes(whole.folder)


def test_parts_claiming_one_shared_folder_at_once_both_go_on(tmp_path, corpus, tokenizer, monkeypatch):
    """Part 1 finds no prepare.json, then part 0 (another machine) writes it before part 1 looks at the folder:
    part 1 goes on with it, as with one written before, and still refuses another preparation's."""
    settings = prepare.plan(str(corpus), tokenizer, SEQ, unit_bytes=UNIT)[0]
    out = tmp_path / "shared"
    real_is_file, looked = Path.is_file, []

    def part_0_writes_meanwhile(path: Path) -> bool:
        if path == out / prepare.SETTINGS and not looked:
            looked.append(path)
            prepare._claim(out, settings)  # part 0, between part 1's two looks
            return False
        return real_is_file(path)

    monkeypatch.setattr(Path, "is_file", part_0_writes_meanwhile)
    prepare._claim(out, settings)
    assert looked and prepare._read_json(out / prepare.SETTINGS) == settings
    monkeypatch.setattr(Path, "is_file", real_is_file)
    with pytest.raises(UserError, match="another seq_len"):
        prepare._claim(out, {**settings, "seq_len": SEQ * 2})
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def _word_tokenizer(size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    vocab.update({f"w{i}": i + 5 for i in range(size - 5)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")


@pytest.mark.parametrize("vocab,dtype", [(65536, "uint16"), (70000, "int32")])
def test_ids_round_trip_through_the_narrowest_dtype(tmp_path, vocab, dtype):
    tokenizer = _word_tokenizer(vocab)
    ids = np.random.default_rng(0).integers(5, vocab, 3000)  # ids past 32767 catch a signed 16-bit store
    (tmp_path / "c.txt").write_text(" ".join(f"w{i - 5}" for i in ids) + "\n")
    blocks, _ = open_training_blocks(str(tmp_path / "c.txt"), tokenizer, SEQ, cache_dir=tmp_path / "cache", num_proc=1)
    assert blocks.index["dtype"] == dtype and blocks[np.arange(3)].dtype == np.int32
    assert blocks[np.arange(len(blocks))].tolist() == framed_blocks(ids, SEQ, 2, 3)


def test_hf_rows_reach_the_tokenizer_about_a_chunk_of_text_at_a_time(monkeypatch):
    """A row can be a whole book and a batch holds 1,000 rows: the tokenizer gets them about CHUNK_BYTES of text
    at a time, the same rows in the same order (so the same shards: packing carries over) and the same hash."""
    import hashlib

    from truneg.data import corpus

    rows = [f"row {i} " * (i % 7 + 1) for i in range(40)] + [None, "x" * 500]
    monkeypatch.setattr(corpus, "_unit_batches", lambda source, unit: iter([rows[:30], rows[30:]]))
    whole_digest, chunks_digest = hashlib.sha256(), hashlib.sha256()
    whole = list(corpus.iter_hf_unit(None, {}, whole_digest))
    monkeypatch.setattr(corpus, "CHUNK_BYTES", 100)
    chunks = list(corpus.iter_hf_unit(None, {}, chunks_digest))
    assert [t for texts, _ in chunks for t in texts] == [t for texts, _ in whole for t in texts] \
        == [r or "" for r in rows]
    assert len(whole) == 2 and len(chunks) > 6
    assert all(sum(map(len, texts[:-1])) < 100 for texts, _ in chunks)  # each stops at the row that reaches it
    assert chunks_digest.hexdigest() == whole_digest.hexdigest()


def test_a_line_or_row_longer_than_a_slice_reaches_the_tokenizer_in_slices_with_the_same_ids(tokenizer, monkeypatch):
    """A line or row can be a whole book, and the tokenizer takes some 50x what it is given at once: it gets at
    most SLICE_CHARS characters at a time, cut before whitespace, and the ids are the whole text's."""
    from truneg.data import corpus

    backend, sep = tokenizer.backend_tokenizer, tokenizer.sep_token_id
    book = " ".join(f"Chapter {i}: the primary road, colour and naïve café-owners\tran on." for i in range(40))
    texts = ["short line", book, "", "x" * 150, "another line"]  # a run of 150 without whitespace

    def whole(text: str) -> list[int]:  # the reference: the tokenizer given the whole text
        return backend.encode(text, add_special_tokens=False).ids

    monkeypatch.setattr(corpus, "SLICE_CHARS", 64)
    given = []
    real_encode = backend.encode_batch_fast
    spy = type("Spy", (),
               {"encode_batch_fast": lambda self, batch, **kw: given.append(batch) or real_encode(batch, **kw)})()
    lines = encoding.encode(spy, texts, sep, rows_are_documents=False)
    assert max(sum(map(len, batch)) for batch in given) <= 64 and len(given) > len(book) // 64
    slices = corpus.text_slices(book)
    assert "".join(slices) == book and all(len(s) <= 64 and s[0].isspace() for s in slices[1:])
    assert corpus.text_slices("x" * 150) == ["x" * 64, "x" * 64, "x" * 22]  # cut where the run ends the slice
    # the long line's ids are the whole line's: cut before whitespace, WordPiece splits the same words
    assert lines.tolist() == whole("short line") + whole(book) + [sep] + whole("x" * 64) * 2 + whole("x" * 22) + \
        whole("another line")
    rows = encoding.encode(spy, [book, "a row"], sep, rows_are_documents=True)  # one [SEP] a row, however sliced
    assert rows.tolist() == whole(book) + [sep] + whole("a row") + [sep]
    # rows keep their newlines; other scripts' spaces (U+3000) are whitespace to the tokenizer too
    for sep_char in ("\n", "\u3000"):
        text = sep_char.join(f"primary{i} road" for i in range(30))
        assert all(s[0] == sep_char or s[0] == " " for s in corpus.text_slices(text)[1:])
        assert encoding.encode(spy, [text], sep, rows_are_documents=True).tolist() == whole(text) + [sep]


def test_hf_sources_from_the_command_line(tmp_path, tokenizer):
    import datasets

    from truneg.train.config.args import parse_args

    folder = tmp_path / "ds"
    folder.mkdir()
    rows = {"train": ["the primary school was closed", "", "another row of text here"] * 4,
            "test": ["a test split with other words in it"] * 12}
    for split, texts in rows.items():  # train: three parquet files of two row groups each; test: one file
        for k, at in enumerate(range(0, len(texts), 4) if split == "train" else [0]):
            name = f"{split}-{k:05d}-of-00003.parquet" if split == "train" else "test.parquet"
            part = texts[at: at + 4] if split == "train" else texts
            datasets.Dataset.from_dict({"id": list(range(len(part))), "content": part}).to_parquet(
                folder / name, batch_size=2 if split == "train" else 1000)
    (folder / "json").mkdir()  # a format other than parquet: streamed by datasets, a file per unit
    (folder / "json" / "train.jsonl").write_text("".join(f'{{"content": "{t}"}}\n' for t in rows["train"]))
    cache = tmp_path / "cache"
    streams = {split: np.array([t for text in texts for t in tokenizer(text, add_special_tokens=False)["input_ids"]
                                + [tokenizer.sep_token_id]]) for split, texts in rows.items()}  # a row is a document
    opened = {}
    for split in ("train", "test"):
        args = parse_args(["--train-data", f"hf:{folder}@{split}#content", "--seq-len", "8", "--cache-dir", str(cache)])
        blocks, fingerprint = open_training_blocks(args.train_data, tokenizer, args.seq_len, cache_dir=args.cache_dir,
                                                   num_proc=1)
        assert_units_follow_stream(blocks.folder, streams[split], 8)
        assert len(blocks.index["shards"]) == (3 if split == "train" else 1), "a unit per data file here"
        opened[split] = fingerprint, blocks.folder
    assert opened["train"][0] != opened["test"][0] and opened["train"][1] != opened["test"][1], "splits do not collide"
    assert not list(cache.rglob("*.arrow")), "streamed: no arrow copy of the dataset"
    # Each row group a unit, prepared by two processes: each unit's blocks are its own rows' stream, in
    # file and row order (each unit packed alone, its tail dropped).
    many = prepare.prepare(f"hf:{folder}#content", tokenizer, 8, tmp_path / "many", 2, unit_bytes=40, progress=False)
    assert len(open_prepared(many).index["shards"]) == 6, "a unit per row group"
    assert_units_follow_stream(many, streams["train"], 8)
    jsonl = prepare.prepare(f"hf:{folder / 'json'}#content", tokenizer, 8, tmp_path / "jsonl", 1, progress=False)
    assert (open_prepared(jsonl)[np.arange(len(open_prepared(jsonl)))].tolist()
            == framed_blocks(streams["train"], 8, 101, 102))
    with pytest.raises(UserError, match="has no column 'text'"):
        open_training_blocks(parse_args(["--train-data", f"hf:{folder}"]).train_data, tokenizer, 8, cache_dir=cache,
                             num_proc=1)
    with pytest.raises(UserError, match="cannot load HF dataset"):
        open_training_blocks([f"hf:{tmp_path / 'no_such_dataset'}#text"], tokenizer, 8, cache_dir=cache, num_proc=1)


def test_bad_prepared_folders_are_one_line_errors_and_nothing_is_overwritten(tmp_path, corpus, tokenizer, capsys):
    out = prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "p", 1, unit_bytes=UNIT, progress=False)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    with pytest.raises(UserError, match="--seq-len 16, not 32"):
        open_training_blocks(str(out), tokenizer, 32)
    with pytest.raises(UserError, match="another tokenizer"):
        open_training_blocks(str(out), _word_tokenizer(100), SEQ)
    with pytest.raises(SystemExit) as exit_:  # the command line: another --seq-len into the same --out
        cli.main(["prepare", "--train-data", str(corpus), "--seq-len", "32", "--out", str(out), "--num-proc", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1 and "holds a preparation with another seq_len" in err[0]
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.md").write_text("keep me")
    with pytest.raises(UserError, match="not empty and holds no preparation"):
        prepare.prepare(str(corpus), tokenizer, SEQ, tmp_path / "notes", 1, progress=False)
    shard = sorted((out / "shards").glob("*.bin"))[1]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(UserError, match="truncated"):
        open_training_blocks(str(out), tokenizer, SEQ)
    (out / "index.json").unlink()
    with pytest.raises(UserError, match="unfinished preparation"):
        open_training_blocks(str(out), tokenizer, SEQ)


def test_a_tokenizer_of_the_same_vocab_that_splits_text_otherwise_prepares_its_own_folder(tmp_path, tokenizer):
    """The vocab and the lowercasing name a tokenizer's folder and runs; its accent stripping (and CJK options)
    also decide the ids. A copy of the tokenizer that keeps accents gets its own cache folder and is refused by
    the other's prepared folder, while the data fingerprint runs record stays what it was without the probe."""
    import json
    import shutil

    from truneg.data.blocks import DEFAULT_TOKENIZER, ensure_prepared

    folder = tmp_path / "accents"
    shutil.copytree(DEFAULT_TOKENIZER, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "strip_accents": False}))
    accents = load_tokenizer(folder)
    assert prepare.tokenizer_fingerprint(accents) == prepare.tokenizer_fingerprint(tokenizer)

    text = tmp_path / "text.txt"
    text.write_text("the caf\u00e9 on the corner was open late and the na\u00efve clerk sold tea " * 20)
    cache = tmp_path / "cache"
    stripped = ensure_prepared(str(text), tokenizer, SEQ, cache_dir=cache, num_proc=1)
    kept = ensure_prepared(str(text), accents, SEQ, cache_dir=cache, num_proc=1)
    assert stripped != kept and shard_bytes(stripped) != shard_bytes(kept)
    with pytest.raises(UserError, match="same vocab that splits text otherwise"):
        open_training_blocks(str(stripped), accents, SEQ)

    # Plain ASCII text comes out the same from both: so does the fingerprint runs record (the probe is not in it)
    text.write_text("the cafe on the corner was open late and the naive clerk sold tea " * 20)
    a = prepare.prepare(str(text), tokenizer, SEQ, tmp_path / "a", 1, progress=False)
    b = prepare.prepare(str(text), accents, SEQ, tmp_path / "b", 1, progress=False)
    assert open_prepared(a).index["tokenizer_probe"] != open_prepared(b).index["tokenizer_probe"]
    assert open_prepared(a).fingerprint == open_prepared(b).fingerprint


def test_two_launches_preparing_the_same_corpus_at_once_both_succeed(tmp_path):
    """Two runs (or the local rank 0 of several nodes on one shared cache) prepare the same corpus at the
    same time: each into a folder of its own, published by one rename; both read the same blocks."""
    from concurrent.futures import ThreadPoolExecutor

    from truneg.data.blocks import ensure_prepared

    tokenizer = load_tokenizer()
    corpus = tmp_path / "c.txt"
    corpus.write_text("The primary reason was clear. " * 400)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(lambda _: ensure_prepared([str(corpus)], tokenizer, SEQ, tmp_path / "cache", 1),
                                range(2)))
    assert folders[0] == folders[1]
    assert [p.name for p in folders[0].parent.iterdir()] == [folders[0].name], "no private folder is left behind"
    assert len(open_prepared(folders[0], tokenizer, SEQ)) > 0


def _kill_when_first_shard_commits(cmd: list[str], env: dict, shards: Path) -> set[str]:
    """Start `cmd`, kill -9 its process group once a shard is committed; the committed shard names."""
    from conftest import REPO, kill_group, wait_for

    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert wait_for(lambda: any(shards.rglob("shards/*.json")) or proc.poll() is not None, timeout=120,
                        interval=0.005)
        kill_group(proc)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"finished before the kill: {proc.stderr.read().decode()[-2000:]}"
    return {p.name for p in shards.rglob("shards/*.json")}


@pytest.fixture(scope="module")
def novels(tmp_path_factory) -> Path:
    """About 4 MB of the shared novels: four or five units of 1 MiB, a few seconds to prepare."""
    from conftest import NOVELS, need_shared

    files = sorted(need_shared(NOVELS).glob("*.txt"))[:6]
    folder = tmp_path_factory.mktemp("novels")
    for f in files:
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.fixture(scope="module")
def novels_prepared(novels, tokenizer, tmp_path_factory) -> Path:
    """The novels prepared in this process without interruption: what a killed and resumed preparation must equal."""
    return prepare.prepare(str(novels), tokenizer, 128, tmp_path_factory.mktemp("whole"), 1, progress=False)


def test_prepare_killed_by_signal_resumes_to_the_same_shards(tmp_path, novels, novels_prepared, launch_env):
    """A real `truneg prepare` (2 processes) killed with SIGKILL mid-way, run again: the shards equal an
    uninterrupted preparation's, and the shards committed before the kill are kept, not redone."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "truneg.cli", "prepare", "--train-data", str(novels), "--seq-len", "128",
           "--out", str(out), "--num-proc", "2"]
    committed = _kill_when_first_shard_commits(cmd, launch_env, out)
    assert committed and not (out / "index.json").exists()
    kept = {name: (out / "shards" / name).stat().st_mtime_ns for name in committed}
    subprocess.run(cmd, env=launch_env, check=True, capture_output=True)
    assert shard_bytes(out) == shard_bytes(novels_prepared) and len(shard_bytes(out)) > len(committed)
    assert {name: (out / "shards" / name).stat().st_mtime_ns for name in committed} == kept
    assert open_prepared(out).fingerprint == open_prepared(novels_prepared).fingerprint


def test_killed_automatic_preparation_is_taken_over_by_the_next_launch(tmp_path, novels, novels_prepared, tokenizer,
                                                                      launch_env):
    """A training launch killed while its local rank 0 prepares the corpus into the cache leaves its private
    folder; the next launch on that host continues it (committed shards kept) and leaves no folder behind."""
    from truneg.data.blocks import ensure_prepared

    cache = tmp_path / "cache"
    code = ("import sys; from truneg.data.blocks import ensure_prepared, load_tokenizer; "
            "ensure_prepared([sys.argv[1]], load_tokenizer(), 128, sys.argv[2], 1)")
    committed = _kill_when_first_shard_commits([sys.executable, "-c", code, str(novels), str(cache)], launch_env,
                                               cache / "prepared")
    (left,) = (cache / "prepared").iterdir()
    assert left.name.endswith(".tmp") and committed
    kept = {name: (left / "shards" / name).stat().st_mtime_ns for name in committed}
    folder = ensure_prepared([str(novels)], tokenizer, 128, cache, 1)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "the killed launch's folder is taken over"
    assert {name: (folder / "shards" / name).stat().st_mtime_ns for name in committed} == kept
    assert shard_bytes(folder) == shard_bytes(novels_prepared)
