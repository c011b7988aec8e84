"""Checkpoints given as a folder or as a model name of the HF hub (`bert-base-uncased`,
`google/electra-base-discriminator`, either with `@REVISION`: a branch, a tag or a commit).

A name resolves through huggingface_hub to its snapshot folder in the HF cache (HF_HOME, HF_HUB_CACHE), downloading
what the cache lacks unless HF_HUB_OFFLINE is set, so that everything after it reads a folder. The snapshot's name
is the commit it resolved to, which the run record keeps.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, hf_hub_download, snapshot_download, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from truneg.errors import UserError

# What a start reads: configs, the tokenizer's files and the weights, safetensors before PyTorch's pickles (as
# from_pretrained prefers them); never a repo's TF, Flax, ONNX or Core ML copies.
READ_PATTERNS = ["*.json", "*.txt", "*.model", "*.safetensors"]
PICKLED_WEIGHTS = ["*pytorch_model*.bin"]
CONFIG_FILES = ("config.json", "discriminator/config.json")  # a model's, or a `truneg export` ELECTRA's


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint as given (`spec`) and the folder it is: the given one, or a hub name's cached snapshot."""

    spec: str
    path: Path
    revision: str | None = None  # the commit a hub name resolved to; None for a folder

    @property
    def is_hub(self) -> bool:
        return self.revision is not None


def split_revision(spec: str) -> tuple[str, str | None]:
    """`NAME@REVISION` -> (NAME, REVISION); a name without one -> (NAME, None): the hub's main branch."""
    name, at, revision = spec.partition("@")
    return (name, revision) if at and revision else (spec, None)


def is_hub_name(spec: str) -> bool:
    """Whether `spec` is read as a hub model name: nothing of that name here, and a valid repo id."""
    if not spec or Path(spec).exists() or spec.startswith(("/", ".", "~")):
        return False
    try:
        validate_repo_id(split_revision(spec)[0])
    except HFValidationError:
        return False
    return True


def cached_snapshot(spec: str) -> Path | None:
    """The snapshot folder of a hub name if the HF cache already holds its config (no download, no request);
    None otherwise. For the checks that run before anything is downloaded (the preset a checkpoint matches)."""
    if not is_hub_name(spec):
        return None
    name, revision = split_revision(spec)
    for config in CONFIG_FILES:
        found = try_to_load_from_cache(name, config, revision=revision)
        if isinstance(found, str):
            return Path(found).parents[config.count("/")]
    return None


def fetch_config(spec: str) -> Path | None:
    """A hub name's snapshot folder holding its config alone (a few kB, into the HF cache), for the choices made by
    the model's size before its weights are downloaded (a GPU recipe and its micro-batch); None offline, or when it
    cannot be fetched: the start's download then says why, in one line."""
    if not is_hub_name(spec) or constants.HF_HUB_OFFLINE:
        return None
    name, revision = split_revision(spec)
    for config in CONFIG_FILES:
        try:
            found = hf_hub_download(name, config, revision=revision)
        except LocalEntryNotFoundError:  # no network (a node without one waits out a timeout per file): said later
            return None
        except EntryNotFoundError:  # a `truneg export` ELECTRA: its discriminator's config, next
            continue
        except Exception:  # noqa: BLE001  (no such repo or revision, ...: best effort, the start says which)
            return None
        return Path(found).parents[config.count("/")]
    return None


def folder_or_cached(spec: str) -> Path | None:
    """A folder as given, or a hub name's cached snapshot; None if neither exists yet."""
    return cached_snapshot(spec) if is_hub_name(spec) else Path(spec) if Path(spec).is_dir() else None


def problem(spec: str, flag: str) -> str | None:
    """One line when `spec` can be neither a folder nor a hub name resolvable here; None when it can. Reads the
    cache only: online, a name not cached yet is fetched at the start (`locate`)."""
    if Path(spec).is_dir():
        return None
    if Path(spec).exists():
        return f"{flag} {spec} is a file; pass an HF checkpoint folder or a model name of the HF hub"
    if not is_hub_name(spec):
        return (f"{flag} {spec}: no such folder, nor a model name of the HF hub (ORG/NAME[@REVISION]); pass an HF "
                "checkpoint folder or a hub name")
    if constants.HF_HUB_OFFLINE and cached_snapshot(spec) is None:
        return _offline_line(spec, flag)
    return None


def _offline_line(spec: str, flag: str) -> str:
    return (f"{flag} {spec}: no such folder, and HF_HUB_OFFLINE is set but the HF cache ({constants.HF_HUB_CACHE}) "
            f"does not hold this model; download it where there is a network (`hf download {split_revision(spec)[0]}`"
            ", with the same HF_HOME), or unset HF_HUB_OFFLINE")


def locate(spec: str, flag: str, cache_only: bool = False) -> Checkpoint:
    """The checkpoint's folder: the given one, or the hub name's snapshot, downloaded into the HF cache if it lacks
    it (unless `cache_only` or HF_HUB_OFFLINE). A name that cannot be resolved is one line (UserError)."""
    line = problem(spec, flag)
    if line:
        raise UserError(line)
    if not is_hub_name(spec):
        return Checkpoint(spec, Path(spec))
    name, revision = split_revision(spec)
    try:
        folder = Path(snapshot_download(name, revision=revision, allow_patterns=READ_PATTERNS,
                                        local_files_only=cache_only))
        if not any(folder.rglob("*.safetensors")):  # an older repo: PyTorch's pickled weights only
            folder = Path(snapshot_download(name, revision=folder.name, allow_patterns=PICKLED_WEIGHTS,
                                            local_files_only=cache_only))
    except RevisionNotFoundError:
        raise UserError(f"{flag} {spec}: the HF hub has no revision {revision!r} of {name}") from None
    except RepositoryNotFoundError:  # (also a gated or private one without a token)
        raise UserError(f"{flag} {spec}: no such folder, and the HF hub has no model of that name, or one you may "
                        "not read (private or gated: log in with `hf auth login`)") from None
    except LocalEntryNotFoundError as err:
        if type(err).__name__ == "IncompleteSnapshotError":  # a download cut short, found offline (newer hubs)
            raise UserError(f"{flag} {spec}: the HF cache holds a download of it cut short ({str(err)[:200]}); "
                            f"complete it where there is a network (`hf download {name}`)") from None
        if constants.HF_HUB_OFFLINE:
            raise UserError(_offline_line(spec, flag)) from None
        if cache_only:
            raise UserError(f"{flag} {spec}: not in this rank's HF cache ({constants.HF_HUB_CACHE}) after its node's "
                            "local rank 0 downloaded it; give every rank of a node the same HF_HOME") from None
        raise UserError(f"{flag} {spec}: cannot reach the HF hub and the HF cache does not hold this model "
                        f"({str(err).splitlines()[0][:200]})") from None
    except Exception as err:  # a full disk, a network error mid-download (the HTTP client's own, httpx's, once
        # huggingface_hub's retries are spent), ...
        if not isinstance(err, (OSError, ValueError)) and not type(err).__module__.startswith("httpx"):
            raise
        raise UserError(f"{flag} {spec}: cannot download it from the HF hub ({type(err).__name__}: "
                        f"{str(err)[:200]})") from None
    if not any(folder.rglob("*.safetensors")) and not any(folder.rglob(PICKLED_WEIGHTS[0])):
        raise UserError(f"{flag} {spec}: the HF cache holds snapshot {folder.name} of {name} without its weights; "
                        f"download them (`hf download {name}`), or unset HF_HUB_OFFLINE")
    return Checkpoint(spec, folder, revision=folder.name)  # the cache names each snapshot by its commit
