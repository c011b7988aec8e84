"""Checkpoint integrity: a manifest of every file's size and checksum, written when a save completes and verified
before a resume (a share per rank) and by `truneg verify`.

torch.save's zip records carry CRC32s too, but reading them finds neither a file missing from a tag nor a changed
byte in a file of torch's legacy format or DeepSpeed's other files, and zlib's crc32 runs at a fifth of xxh3's speed
here (bench/checkpoint_integrity.py): the manifest hashes every file with xxh3-64. `truneg verify` reads those CRCs
for a tag written before the manifest: they need no unpickling.

A manifest is integrity, not safety: a folder from elsewhere can carry a forged one. Where truneg itself unpickles
DeepSpeed's files (`load_deepspeed_file`), torch's safe unpickler does, with the few DeepSpeed classes those files
hold allowed (DEEPSPEED_GLOBALS).
"""
from __future__ import annotations

import json
import os
import pickle
import re
import sys
import zipfile
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from truneg.errors import UserError
from truneg.train.ranks.distributed import on_every_rank

MANIFEST_FILE = "truneg_manifest.json"
META_FILE = "truneg_meta.json"  # written after the manifest: not in it
RANK_STATE_PREFIX = "truneg_rank"  # each rank's own file in a tag: truneg_rank00000.pt
UNIVERSAL_SUFFIX = "_universal"
CHUNK = 8 << 20


def tag_files(tag_dir: Path) -> list[str]:
    """The tag's files (relative, sorted) that its manifest covers: everything a save wrote, not truneg's META and
    manifest (written after) nor a leftover `*.tmp`."""
    skip = {MANIFEST_FILE, META_FILE}
    return sorted(p.relative_to(tag_dir).as_posix() for p in tag_dir.rglob("*")
                  if p.is_file() and p.name not in skip and not p.name.endswith(".tmp"))


def checksum(path: Path) -> dict:
    """{"size", "xxh3_64"} of a file, read in chunks into one buffer."""
    digest, size = xxhash.xxh3_64(), 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            digest.update(view[:read])
            size += read
    return {"size": size, "xxh3_64": digest.hexdigest()}


def checksums(tag_dir: Path, names: list[str]) -> dict[str, dict]:
    return {name: checksum(tag_dir / name) for name in names}


def write_manifest(tag_dir: Path, entries: dict[str, dict]) -> None:
    tmp = tag_dir / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps({"algorithm": "xxh3_64", "files": dict(sorted(entries.items()))}, indent=1) + "\n",
                   encoding="utf-8")
    os.replace(tmp, tag_dir / MANIFEST_FILE)  # atomic: whole or absent


def read_manifest(tag_dir: Path) -> dict[str, dict] | None:
    """The tag's {file: {size, xxh3_64}}, or None for a tag written before truneg checksummed its checkpoints."""
    path = tag_dir / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
    except OSError as err:
        raise UserError(f"cannot read {path} ({err.strerror or err}); check its permissions and file system") from None
    except (ValueError, KeyError, TypeError):
        files = None
    if not (isinstance(files, dict) and files and all(
            isinstance(entry, dict) and isinstance(entry.get("size"), int) and isinstance(entry.get("xxh3_64"), str)
            for entry in files.values())):
        raise UserError(f"{path} is damaged; resume from another tag with --resume DIR")
    return files


def problems(tag_dir: Path, names: list[str], manifest: dict[str, dict]) -> list[str]:
    """One line per file of `names` that is missing, of another size, or whose bytes changed since the save."""
    found = []
    for name in names:
        path, expected = tag_dir / name, manifest[name]
        try:
            actual = checksum(path)
        except FileNotFoundError:
            found.append(f"{tag_dir / name} is missing")
            continue
        except OSError as err:
            found.append(f"{tag_dir / name} cannot be read ({err.strerror or err}); check its permissions and file "
                         "system")
            continue
        if actual["size"] != expected["size"]:
            found.append(f"{tag_dir / name} is damaged: {actual['size']} bytes, {expected['size']} when saved")
        elif actual["xxh3_64"] != expected["xxh3_64"]:
            found.append(f"{tag_dir / name} is damaged: its bytes changed since the save (checksum "
                         f"{actual['xxh3_64']}, {expected['xxh3_64']} when saved)")
    return found


def hash_share(tag_dir: Path) -> dict[str, dict] | str | None:
    """A collective after a save's barrier: every rank lists the tag's files and all get the union (one list: a
    node's cached listing of a network file system may lack a file another node has just written, which its writer
    sees), every rank hashes its share, and rank 0 gets them all (None elsewhere). DeepSpeed does not say which rank
    wrote which file, so the shares are by position, as the load pre-check splits them. A rank that could not list
    or read its share makes it a line saying so, for rank 0's commit to stop every rank with."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:  # a failure travels in the gathers, not raised on one rank alone (the others would wait for it)
        listed: list[str] | str = tag_files(tag_dir)
    except OSError as err:
        listed = f"cannot list {tag_dir}: {err}"
    listings: list = [None] * world_size
    dist.all_gather_object(listings, listed)
    mine: dict | str = next((part for part in listings if isinstance(part, str)), {})
    if not mine:
        try:
            mine = checksums(tag_dir, sorted(set().union(*listings))[rank::world_size])
        except OSError as err:  # every rank must hear of it: the outcome travels in the gather
            mine = f"cannot checksum {tag_dir}: {err}"
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    failed = next((part for part in gathered if isinstance(part, str)), None)
    return failed if failed else {name: entry for part in gathered for name, entry in part.items()}


def verify_shared(tag_dir: Path, names: list[str], manifest: dict[str, dict]) -> None:
    """A collective: every rank checks its share of `names` against the manifest, and every rank learns every
    problem, so that each stops with the same line naming the file."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mine = problems(tag_dir, names[rank::world_size], manifest)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    found = [line for lines in everyone for line in lines]
    if found:
        more = f" (and {len(found) - 1} more: `truneg verify {tag_dir}` lists them)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; resume from another tag with --resume DIR, or start afresh with "
                        "--resume none --overwrite")


def check_readable(files: list[Path], tag_dir: Path) -> None:
    """Each file opens as torch.save wrote it: memory-mapped (its zip directory and pickle, not the tensors'
    bytes), or read whole where that cannot be (a file in torch's legacy format, `checkpoint_serialization:
    false`; a file system without mmap). For tags without a manifest (written before it, or a universal form).
    DeepSpeed's files open with the safe unpickler (a pickle that is not DeepSpeed's is refused before DeepSpeed's
    load runs it); truneg's own rank files are load_rank_state's (older ones are pickles, loaded with a warning)."""
    for path in files:
        try:
            if not path.name.startswith(RANK_STATE_PREFIX):
                load_deepspeed_file(path)
                continue
            try:
                torch.load(path, map_location="cpu", mmap=True, weights_only=False)
            except Exception:
                torch.load(path, map_location="cpu", weights_only=False)
        except UserError:
            raise
        except OSError as err:  # not the file's fault: permissions, memory, the file system
            raise UserError(f"cannot read checkpoint {tag_dir}: {path.relative_to(tag_dir)}: {err}; check its "
                            "permissions and file system, or resume from another tag with --resume DIR") from None
        except Exception as err:  # a file cut short, or not torch.save's
            raise UserError(f"cannot read checkpoint {tag_dir}: {path.relative_to(tag_dir)} is damaged "
                            f"({type(err).__name__}: {str(err)[:200]}); resume from another tag with --resume DIR, "
                            "or start afresh with --resume none --overwrite") from None


LEGACY = "legacy"  # zip_problem's answer for a file in torch's legacy format: no CRCs to read
ZIP_START = b"PK\x03\x04"
LEGACY_START = pickle.dumps(torch.serialization.MAGIC_NUMBER, protocol=2)  # what torch's legacy format begins with


def zip_problem(path: Path) -> str | None:
    """What is wrong with a torch.save file by its zip's own CRC32 per record, read without unpickling anything
    (a checkpoint from elsewhere may be code); None when intact. A file in torch's legacy format has no CRCs:
    LEGACY."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(len(LEGACY_START))
        if start == LEGACY_START:
            return LEGACY
        if not start.startswith(ZIP_START):
            return "is damaged: it does not begin as a torch.save file does"
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    except Exception as err:  # cut short (no central directory), or a header whose bytes changed
        return f"is damaged ({type(err).__name__}: {str(err)[:200]})"
    return None if bad is None else f"is damaged: its record {bad} fails its CRC32"


def verify_offline(tag_dir: Path) -> tuple[list[str], str | None]:
    """`truneg verify`: (one line per bad file, a warning or None). A tag without a manifest (written before it)
    has each file's own zip CRCs read instead: a changed byte in torch's legacy format is not found."""
    manifest = read_manifest(tag_dir)
    if manifest is not None:
        return problems(tag_dir, sorted(manifest), manifest), None
    if not (tag_dir / META_FILE).is_file():
        return [f"{tag_dir} is incomplete: it has no {META_FILE} (a save cut short, or not a truneg checkpoint)"], None
    found, legacy = [], 0
    for name in tag_files(tag_dir):
        problem = zip_problem(tag_dir / name) if name.endswith(".pt") else None
        if problem == LEGACY:
            legacy += 1
        elif problem:
            found.append(f"{tag_dir / name} {problem}")
    unchecked = f" ({legacy} file(s) in torch's legacy format unchecked)" if legacy else ""
    return found, (f"{tag_dir} has no {MANIFEST_FILE} (written before truneg checksummed its checkpoints): its files' "
                   f"own CRCs were read instead{unchecked}")


def read_by_load(name: str, world_size: int, saved_world_size: int | None) -> bool:
    """Whether a load on `world_size` ranks reads the tag's file `name` (relative): its own *.pt (the ranks' RNG
    states only when the tag was written by this world size: the load ignores them otherwise) and, in a universal
    tag, those under zero/ (not ds_to_universal's leftover tmp/)."""
    if name.startswith("zero/"):
        return name.endswith(".pt")
    rank_state = re.fullmatch(rf"{RANK_STATE_PREFIX}(\d+)\.pt", name)
    if rank_state is not None:
        return saved_world_size == world_size and int(rank_state[1]) < world_size
    return "/" not in name and name.endswith(".pt")


def files_to_load(tag_dir: Path, world_size: int, saved_world_size: int | None) -> list[Path]:
    """The tag's files that a load on `world_size` ranks reads (see read_by_load)."""
    return sorted(p for p in [*tag_dir.glob("*.pt"), *tag_dir.glob("zero/**/*.pt")]
                  if read_by_load(p.relative_to(tag_dir).as_posix(), world_size, saved_world_size))


def verify_before_load(tag_dir: Path, saved_world_size: int | None) -> None:
    """A collective before DeepSpeed's load, a share per rank, the outcome shared: a damaged file that one rank
    alone reads (its optimizer shard, its RNG state) would otherwise stop that rank inside the load while the others
    go on into a collective it never joins (across nodes: until the timeout). With a manifest, every file the load
    reads is checksummed against it (a changed byte, a missing file); without one (written before truneg wrote
    manifests, or a universal form) each file is only opened."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    manifest = read_manifest(tag_dir)
    if manifest is not None:
        verify_shared(tag_dir, [n for n in manifest if read_by_load(n, world_size, saved_world_size)], manifest)
        return
    if rank == 0 and not tag_dir.name.endswith(UNIVERSAL_SUFFIX):
        print(f"truneg: warning: {tag_dir} has no {MANIFEST_FILE} (written before truneg checksummed its "
              "checkpoints): its files are only opened, a changed byte is not found", flush=True)
    files = files_to_load(tag_dir, world_size, saved_world_size)
    on_every_rank(lambda: check_readable(files[rank::world_size], tag_dir), f"read checkpoint {tag_dir}")


# ---------------------------------------------------------------------------------------------------
# Reading DeepSpeed's files in truneg's commands (eval, fn-stats, export): the manifest, then the safe unpickler
# ---------------------------------------------------------------------------------------------------

# What DeepSpeed 0.19 pickles beside tensors and plain types (torch.serialization.get_unsafe_globals_in_checkpoint on
# ZeRO-1/2/3, bf16 and universal tags): ZeRO's optimizer states hold the loss scaler (static in fp32 and bf16, dynamic
# in fp16) and the stage as an enum, BF16_Optimizer's each parameter's fragment_address. Each is a record of numbers
# whose unpickling sets attributes, calling nothing a file chooses.
DEEPSPEED_GLOBALS = (LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address)
_warned: set[Path] = set()


def load_deepspeed_file(path: Path) -> dict:
    """One of DeepSpeed's files (model_states, optim_states, a universal form's) with torch's safe unpickler and
    DEEPSPEED_GLOBALS, memory-mapped where its format allows (the tensors' bytes are read as used). A pickle that
    needs more (code, as a forged file holds) is refused in one line, unpickled no further."""
    try:
        with torch.serialization.safe_globals(list(DEEPSPEED_GLOBALS)):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:  # torch's legacy format (`checkpoint_serialization: false`) has no mmap
                if "mmap can only be used" not in str(err):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        # (torch words it "unsupported GLOBAL x ..." or "Unsupported global: GLOBAL x ...")
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found is None:  # a pickle cut short or garbled: the caller says the file is damaged
            raise
        allowed = ", ".join(f"{g.__module__}.{g.__qualname__}" for g in DEEPSPEED_GLOBALS)
        raise UserError(f"{path} holds {found[1]}, which DeepSpeed's checkpoints do not (truneg unpickles tensors, "
                        f"plain types and {allowed}); it was not unpickled: read only checkpoints you trust") from None


def verify_before_reading(tag_dir: Path, names: list[str] | None = None) -> None:
    """Before a truneg command unpickles a tag's files: `names` (default: the tag's every file, those the manifest
    lacks too: DeepSpeed's zero_to_fp32 reads every *_states.pt it finds) checked against the manifest. A mismatch is
    one line (UserError); a tag without a manifest, a warning on stderr (once per tag), as resume warns."""
    manifest = read_manifest(tag_dir)
    if manifest is None:
        if tag_dir not in _warned:
            _warned.add(tag_dir)
            print(f"truneg: warning: {tag_dir} has no {MANIFEST_FILE} (written before truneg checksummed its "
                  "checkpoints): its files are read unchecked", file=sys.stderr, flush=True)
        return
    names = sorted(set(tag_files(tag_dir)) | set(manifest)) if names is None else names
    found = [f"{tag_dir / name} is not in {MANIFEST_FILE}: it was added after the save" for name in names
             if name not in manifest]
    found += problems(tag_dir, [name for name in names if name in manifest], manifest)
    if found:
        more = f" (and {len(found) - 1} more: `truneg verify {tag_dir}` lists them)" if len(found) > 1 else ""
        raise UserError(f"{found[0]}{more}; nothing was read from it: pass another tag, or this one as it was saved")
