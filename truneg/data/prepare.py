"""`truneg prepare`: corpus -> a folder of packed token blocks that training memory-maps.

    truneg prepare --train-data SOURCE... --seq-len N --out DIR [--tokenizer DIR] [--num-proc N] [--part i/n]
    truneg prepare --merge DIR... --out DIR

Layout of DIR:
- `prepare.json`: the settings (format, seq_len, dtype, tokenizer fingerprint, the planned units). A second
  preparation into DIR with other settings is refused, so nothing is overwritten.
- `shards/NNNNNN.bin`: one per unit, raw [blocks, seq_len] ids (uint16 when the vocab fits), written to a
  temporary name and renamed; `shards/NNNNNN.json` beside it commits it (blocks, tokens, hashes). A
  killed preparation redoes only the units without a committed shard.
- `shards/NNNNNN.starts` beside it, for a byte-level BPE or SentencePiece tokenizer: each token's word-start bit,
  [blocks, ceil(seq_len / 8)] uint8 (np.packbits; the rule: truneg/data/words.py), for whole-word masking.
- `part-I-of-N.json`: the shards of a finished part; `index.json`: the finished preparation (after a
  whole preparation, or `--merge` of all parts). A folder with `index.json` is a prepared folder.

Blocks are `[CLS] t1 .. t_{L-2} [SEP]` cut from each unit's token stream; a unit's tail shorter than a
block is dropped (at most L-2 tokens per unit, of about a million).
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from truneg.data import corpus, words
from truneg.data.encoding import encode_words, pack_blocks
from truneg.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# 2: word-start bits beside the shards (byte-level BPE and SentencePiece). A WordPiece folder, which needs none, stays
# format 1, with its settings as they were: its preparations, cached or unfinished, go on as they are.
FORMAT = "truneg-prepared/2"
FORMAT_WITHOUT_STARTS = "truneg-prepared/1"
READABLE_FORMATS = (FORMAT_WITHOUT_STARTS, FORMAT)
# The data fingerprint names the ids, which format 2 left as they were: a folder prepared again in format 2 keeps
# the fingerprint its runs recorded (the word starts are a function of the same text and tokenizer).
IDS_LAYOUT = FORMAT_WITHOUT_STARTS
INDEX, SETTINGS, SHARDS = "index.json", "prepare.json", "shards"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    state = json.dumps([type(tokenizer).__name__, getattr(tokenizer, "do_lower_case", None), vocab])
    return hashlib.sha256(state.encode()).hexdigest()


# Text that each of BERT's normalisation and splitting options tokenizes differently: case, accents, CJK
# characters, control and odd whitespace, punctuation, digits, a long word.
PROBE_TEXT = ("Café naïve RÉSUMÉ Ångström 東京大学 don't e-mail,x.y;z (1.5%) \u00a0\t\x07 ÆØß "
              "supercalifragilisticexpialidocious 123456")


def tokenizer_probe(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the tokenizer makes of PROBE_TEXT. tokenizer_fingerprint sees the vocab and the lowercasing only: a
    tokenizer with the same vocab that strips accents, or splits CJK characters, differently would read the
    same folder. Its behaviour, not its serialization, so that a newer `tokenizers` keeps old folders valid."""
    ids = tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


def ids_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "int32"  # ids 0..65535 fit: half the disk and page cache


def _write_json(path: Path, obj) -> None:
    # the host too: parts on several machines (containers often share a pid) write prepare.json at once
    tmp = path.with_name(f"{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise UserError(f"cannot read {path} ({err}); prepare the folder again") from None


# Planning


def plan(train_data: str | Sequence[str], tokenizer: PreTrainedTokenizerBase, seq_len: int,
         hf_cache_dir: Path | None = None, unit_bytes: int | None = None) -> tuple[dict, list[dict], list]:
    """(settings, units, hf sources). Cheap: file sizes, one seek per unit, an hf: data file's footer."""
    if seq_len < 3:
        raise UserError(f"--seq-len {seq_len} leaves no room between [CLS] and [SEP]; use 3 or more")
    specs = [train_data] if isinstance(train_data, (str, Path)) else [str(s) for s in train_data]
    text_specs = [s for s in specs if not corpus.is_hf(s)]
    sources, units, datasets_ = [], [], []
    if text_specs:
        files = corpus.resolve_text_files(text_specs)
        text_units, size = corpus.plan_text_units(files, unit_bytes)
        stats = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
        sources.append({"kind": "text", "files": stats, "unit_bytes": size})
        units += [{"source": 0, **u} for u in text_units]
        datasets_.append(None)
    for spec in (corpus.HFSpec.parse(s) for s in specs if corpus.is_hf(s)):
        source = corpus.open_hf(spec, hf_cache_dir)
        hf_units, size = corpus.plan_hf_units(source, unit_bytes)
        sources.append({"kind": "hf", "spec": str(spec), "column": spec.column, "fingerprint": source.fingerprint,
                        "files": len(source.files), "unit_bytes": size})
        units += [{"source": len(datasets_), **u} for u in hf_units]
        datasets_.append(source)
    for i, unit in enumerate(units):
        unit["index"] = i
    vocab, with_starts = len(tokenizer), words.stores_word_starts(tokenizer)
    settings = {
        "format": FORMAT if with_starts else FORMAT_WITHOUT_STARTS, "seq_len": seq_len, "dtype": ids_dtype(vocab),
        "vocab_size": vocab,
        "tokenizer": tokenizer_fingerprint(tokenizer), "tokenizer_probe": tokenizer_probe(tokenizer),
        "cls_id": tokenizer.cls_token_id,
        "sep_id": tokenizer.sep_token_id, **({"word_starts": True} if with_starts else {}), "sources": sources,
        "units": hashlib.sha256(json.dumps(units).encode()).hexdigest(), "num_units": len(units),
    }
    return settings, units, datasets_


def settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


# Workers: one unit -> one shard

_WORKER: dict = {}


def _init_worker(tokenizer_json: str, datasets_: list, one_thread: bool) -> None:
    if one_thread:  # the processes are the parallelism, not the tokenizer's thread pool
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    backend = Tokenizer.from_str(tokenizer_json)  # a copy: the caller's tokenizer keeps its settings
    backend.no_truncation()
    backend.no_padding()
    _WORKER.update(tokenizer=backend, datasets=datasets_)


def _prepare_unit(job: dict) -> dict:
    """Tokenize and pack one unit into its shard; returns the shard's committed record."""
    unit, settings, folder = job["unit"], job["settings"], Path(job["folder"])
    seq_len = settings["seq_len"]
    dtype = np.dtype(settings["dtype"])
    kind = settings["source_kinds"][unit["source"]]
    backend = _WORKER["tokenizer"]
    source_digest, shard_digest = hashlib.sha256(), hashlib.sha256()
    if kind == "text":
        pieces = corpus.iter_text_unit(unit["segments"], source_digest)
    else:
        pieces = corpus.iter_hf_unit(_WORKER["datasets"][unit["source"]], unit, source_digest)
    name = f"{unit['index']:06d}"
    shard, starts_file = folder / SHARDS / f"{name}.bin", folder / SHARDS / f"{name}{words.STARTS_SUFFIX}"
    tmp = shard.with_name(f"{name}.bin.{os.getpid()}.tmp")
    starts_tmp = starts_file.with_name(f"{starts_file.name}.{os.getpid()}.tmp")
    with_starts = settings["word_starts"]  # (the worker's settings: `needed` in prepare)
    carry, carry_starts = np.empty(0, dtype=np.int64), np.empty(0, dtype=bool)
    blocks = tokens = replaced = 0
    with ExitStack() as files:
        handles = [files.enter_context(open(path, "wb")) for path in ([tmp, starts_tmp] if with_starts else [tmp])]
        fh = handles[0]
        for texts, bad in pieces:
            replaced += bad
            ids, starts = encode_words(backend, texts, settings["sep_id"], kind == "hf", with_starts)
            tokens += len(ids)
            out, carry = pack_blocks(np.concatenate([carry, ids]), seq_len, settings["cls_id"], settings["sep_id"],
                                     dtype)
            data = out.tobytes()
            fh.write(data)
            shard_digest.update(data)
            blocks += len(out)
            if starts is not None:  # cut as the ids are; [CLS] and [SEP] set
                bits, carry_starts = pack_blocks(np.concatenate([carry_starts, starts]), seq_len, True, True, bool)
                handles[1].write(words.pack_starts(bits).tobytes())
        for handle in handles:
            handle.flush()
            os.fsync(handle.fileno())
    if with_starts:
        starts_tmp.replace(starts_file)
    tmp.replace(shard)
    record = {"unit": unit["index"], "file": f"{SHARDS}/{name}.bin", "blocks": blocks, "tokens": tokens,
              "replaced_chars": replaced, "source_sha256": source_digest.hexdigest(),
              "sha256": shard_digest.hexdigest(), "settings": settings["key"], "unit_spec": unit,
              **({"starts": f"{SHARDS}/{starts_file.name}"} if with_starts else {})}
    _write_json(shard.with_suffix(".json"), record)  # the commit point
    return record


def _committed(folder: Path, unit: dict, settings: dict, key: str) -> dict | None:
    """The unit's committed record, if its shard is whole and was made with these settings (`key`)."""
    meta = folder / SHARDS / f"{unit['index']:06d}.json"
    if not meta.is_file():
        return None
    try:
        record = json.loads(meta.read_text(encoding="utf-8"))
    except ValueError:
        return None
    shard = folder / record["file"]
    size = record["blocks"] * settings["seq_len"] * np.dtype(settings["dtype"]).itemsize
    if record.get("settings") != key or record.get("unit_spec") != unit:
        return None
    if not shard.is_file() or shard.stat().st_size != size:
        return None
    if settings.get("word_starts"):
        starts = folder / record.get("starts", "")
        if not starts.is_file() or starts.stat().st_size != record["blocks"] * words.packed_width(settings["seq_len"]):
            return None
    return record


# Preparation, parts and merge


def _claim(folder: Path, settings: dict) -> None:
    """Create DIR/prepare.json, or check that DIR holds this same preparation; refuse anything else."""
    path = folder / SETTINGS
    if not path.is_file():
        # Parts on several machines may claim one shared folder at once: another's shards/, prepare.json (written
        # since the line above) and temporary files are fine; two that write it both write the same settings.
        if folder.is_dir() and any(p.name not in (SHARDS, SETTINGS) and not p.name.endswith(".tmp")
                                   for p in folder.iterdir()):
            raise UserError(f"{folder} is not empty and holds no preparation; choose an empty or new --out")
        (folder / SHARDS).mkdir(parents=True, exist_ok=True)
        _write_json(path, settings)
    old = _read_json(path)
    if old != settings:
        what = [k for k in ("seq_len", "tokenizer", "dtype", "sources", "units") if old.get(k) != settings.get(k)]
        raise UserError(f"{folder} holds a preparation with another {', '.join(what) or 'format'}; "
                        "choose another --out (or delete that folder to replace it)")


def _part_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]}-of-{part[1]}.json"


def prepare(train_data: str | Sequence[str], tokenizer: PreTrainedTokenizerBase, seq_len: int, out: str | Path,
            num_proc: int | None = None, part: tuple[int, int] = (0, 1), hf_cache_dir: Path | None = None,
            unit_bytes: int | None = None, progress: bool = True) -> Path:
    """Prepare a corpus (or part i of n of it) into `out`; resumes a killed run. Returns `out`."""
    out = Path(out)
    settings, units, datasets_ = plan(train_data, tokenizer, seq_len, hf_cache_dir, unit_bytes)
    if not units:
        raise UserError(f"the corpus {' '.join(map(str, [train_data] if isinstance(train_data, str) else train_data))} "
                        "has no text")
    _claim(out, settings)
    index, count = part
    mine = [u for u in units if u["index"] % count == index]
    key = settings_key(settings)  # once: the settings hold every source file's entry
    done = {u["index"]: r for u in mine if (r := _committed(out, u, settings, key))}
    todo = [u for u in mine if u["index"] not in done]
    for stale in (out / SHARDS).glob("*.tmp"):  # a killed run's half-written shards of this part
        if int(stale.name[:6]) % count == index:
            stale.unlink(missing_ok=True)
    # What a worker needs of the settings, and their key (the whole settings list every source file: not sent
    # and hashed again for each unit)
    needed = {k: settings[k] for k in ("seq_len", "dtype", "cls_id", "sep_id")}
    needed["word_starts"] = settings.get("word_starts", False)
    needed |= {"source_kinds": [source["kind"] for source in settings["sources"]], "key": key}
    jobs = [{"unit": u, "settings": needed, "folder": str(out)} for u in todo]
    # the CPUs this process may use (a scheduler's allotment), not the machine's
    num_proc = max(1, min(num_proc or len(os.sched_getaffinity(0)), len(jobs)))
    bar = tqdm(total=sum(u["bytes"] for u in mine), initial=sum(u["bytes"] for u in mine if u["index"] in done),
               unit="B", unit_scale=True, desc=f"prepare {out.name}", disable=not progress, mininterval=1.0)
    start, new_tokens = time.perf_counter(), 0

    def finished(record: dict) -> None:
        nonlocal new_tokens
        done[record["unit"]] = record
        new_tokens += record["tokens"]
        bar.update(record["unit_spec"]["bytes"])
        bar.set_postfix_str(f"{new_tokens / max(1e-9, time.perf_counter() - start) / 1e6:.2f}M tokens/s", refresh=False)

    if num_proc == 1:
        _init_worker(tokenizer.backend_tokenizer.to_str(), datasets_, one_thread=False)
        for job in jobs:
            finished(_prepare_unit(job))
    elif jobs:
        jobs.sort(key=lambda j: -j["unit"]["bytes"])  # largest first: the last process ends soonest
        # spawn: no fork of a process that holds tokenizer threads; a dead worker raises, never hangs
        with ProcessPoolExecutor(num_proc, multiprocessing.get_context("spawn"), _init_worker,
                                 (tokenizer.backend_tokenizer.to_str(), datasets_, True)) as pool:
            for future in as_completed([pool.submit(_prepare_unit, job) for job in jobs]):
                finished(future.result())
    bar.close()
    records = [done[u["index"]] for u in mine]
    replaced = sum(r["replaced_chars"] for r in records)
    if replaced and jobs:
        print(f"truneg: warning: {replaced} undecodable bytes in the corpus were replaced by U+FFFD", flush=True)
    _write_json(out / _part_name(part), {"settings": settings, "part": list(part), "shards": records})
    if count == 1:
        write_index(out, settings, records, out)
    return out


def write_index(out: Path, settings: dict, records: list[dict], base: Path) -> dict:
    """index.json: the shards of every unit in unit order, paths relative to `out`."""
    records = sorted(records, key=lambda r: r["unit"])
    if [r["unit"] for r in records] != list(range(settings["num_units"])):
        raise UserError(f"the shards in {base} do not cover every unit of the corpus; prepare the missing parts")
    source = hashlib.sha256("".join(r["source_sha256"] for r in records).encode()).hexdigest()
    shards = [{"file": os.path.relpath(base / r["file"], out), "blocks": r["blocks"], "tokens": r["tokens"],
               "sha256": r["sha256"], **({"starts": os.path.relpath(base / r["starts"], out)} if "starts" in r else {})}
              for r in records]
    total = sum(r["blocks"] for r in records)
    if total == 0:
        raise UserError(f"the corpus has {sum(r['tokens'] for r in records)} tokens, fewer than one block of "
                        f"--seq-len {settings['seq_len']}")
    # (the parts' format: parts prepared before format 2 merge into a folder of format 1)
    index = {"format": settings["format"], "seq_len": settings["seq_len"], "dtype": settings["dtype"],
             "tokenizer": settings["tokenizer"], "source_fingerprint": source, "sources": settings["sources"],
             "blocks": total, "tokens": sum(r["tokens"] for r in records), "shards": shards}
    index["tokenizer_probe"] = settings["tokenizer_probe"]
    if settings.get("word_starts"):
        index["word_starts"] = True
    # The data's identity: its blocks, not the probe (a tokenizer check, which the index records beside it).
    index["fingerprint"] = hashlib.sha256(json.dumps(
        [IDS_LAYOUT, settings["seq_len"], settings["dtype"], settings["tokenizer"], source,
         [s["sha256"] for s in shards]]).encode()).hexdigest()
    target = out / INDEX
    if target.is_file() and _read_json(target).get("fingerprint") != index["fingerprint"]:
        raise UserError(f"{target} already indexes another preparation; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(target, index)
    return index


def merge(dirs: Sequence[str | Path], out: str | Path) -> Path:
    """Join the finished parts found in `dirs` into `out`/index.json (shards stay where they are)."""
    out = Path(out)
    found: list[tuple[Path, dict]] = []
    for d in map(Path, dirs):
        parts = sorted(d.glob("part-*-of-*.json"))
        if not parts:
            raise UserError(f"{d} holds no finished part (part-I-of-N.json); finish its `truneg prepare --part` first")
        found += [(d, _read_json(p)) for p in parts]
    settings = found[0][1]["settings"]
    if any(p["settings"] != settings for _, p in found):
        raise UserError("the parts were prepared with different corpora, tokenizers or --seq-len; merge parts of one "
                        "preparation")
    count = found[0][1]["part"][1]
    have = {p["part"][0] for _, p in found if p["part"][1] == count}
    if any(p["part"][1] != count for _, p in found) or have != set(range(count)):
        missing = sorted(set(range(count)) - have)
        raise UserError(f"parts {', '.join(f'{i}/{count}' for i in missing) or 'of another split'} are missing; "
                        "prepare them, or give their folders to --merge")
    records = []
    for d, p in found:
        for r in p["shards"]:
            shard = d / r["file"]
            if not shard.is_file():
                raise UserError(f"{shard} is missing; prepare part {p['part'][0]}/{count} again")
            records.append({**r, "file": os.path.relpath(shard.resolve(), out.resolve())})
            if "starts" in r:
                records[-1]["starts"] = os.path.relpath((d / r["starts"]).resolve(), out.resolve())
    if (out / SETTINGS).is_file() and _read_json(out / SETTINGS) != settings:
        raise UserError(f"{out} holds another preparation; choose another --out")
    write_index(out, settings, records, out)
    return out
