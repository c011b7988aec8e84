"""The models an evaluation command names (`truneg eval`, `fn-stats`, `fn-cases`): found, read with their own
tokenizer, and loaded whole (a pre-trainer) or as their masked LM.

A PATH is a truneg checkpoint tag, a checkpoints folder (each complete tag), an exported folder (BERT's, or
ELECTRA's `generator/` and `discriminator/`), or a model name of the HF hub; an ELECTRA pair on the hub takes the
generator's name second, as --init-generator does.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn
from transformers import AutoConfig, ElectraForMaskedLM

from truneg.data.blocks import DEFAULT_TOKENIZER, load_tokenizer
from truneg.errors import UserError
from truneg.model import hub
from truneg.model.families import MLM_CLASSES, ROBERTA_TYPES, saved_tokenizer
from truneg.model.pair import model_type
from truneg.model.presets import load_pretrained
from truneg.model.pretrainers import BertPretrainer, ElectraPretrainer, ObjectiveConfig, build_pretrainer
from truneg.train.checkpointing import checkpoint, integrity
from truneg.train.checkpointing.export import load_parts, run_tokenizer_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PARTS = ("discriminator", "generator")  # an exported ELECTRA's folders


@dataclass
class CheckpointRef:
    label: str
    step: int  # -1: not a truneg tag
    path: Path  # a truneg tag's folder, or an exported or hub folder
    kind: str  # "truneg" (a tag; its tokenizer and HC table beside its configs) or "hf" (a from_pretrained folder)
    generator: Path | None = None  # ELECTRA's generator named beside a hub discriminator


def discover_checkpoints(paths: list[str | Path], generator: str | None = None) -> list[CheckpointRef]:
    """The models the PATHs name, each checkpoints folder's tags oldest first."""
    if generator is not None:
        [path] = paths
        return [CheckpointRef(str(path), -1, hub.locate(str(path), "PATH").path, "hf",
                              hub.locate(generator, "GENERATOR").path)]
    found: list[CheckpointRef] = []
    for raw in paths:
        path = Path(raw)
        if any((folder / "config.json").is_file() for folder in (path, *(path / part for part in PARTS))):
            found.append(CheckpointRef(str(raw), -1, path, "hf"))
            continue
        try:
            folder, tag = checkpoint.resolve(path)
        except UserError:
            if path.exists() or not hub.is_hub_name(str(raw)):
                raise UserError(f"{raw} is neither a truneg checkpoints folder, a tag in one, an exported folder "
                                "(config.json), nor a model name of the HF hub; pass one of those") from None
            found.append(CheckpointRef(str(raw), -1, hub.locate(str(raw), "PATH").path, "hf"))
            continue
        tags = [tag] if tag else checkpoint.complete_tags(folder)
        if not tags:
            raise UserError(f"{folder} holds no complete checkpoint (a save in progress or cut short has no "
                            f"{checkpoint.META_FILE}); pass a tag, or wait for the run's first save")
        found.extend(CheckpointRef(f"{folder}/{t}", checkpoint.step_of_tag(t), folder / t, "truneg") for t in tags)
    return found


def saved_tokenizer_dir(ref: CheckpointRef) -> Path | None:
    """Where the checkpoint's tokenizer was saved: beside a truneg tag's configs, or in an exported or hub folder
    (or its ELECTRA parts'); None where none was."""
    return saved_tokenizer(run_tokenizer_dir(ref.path.parent) if ref.kind == "truneg" else ref.path)


def checkpoints_tokenizer(refs: list[CheckpointRef], given: str | None = None) -> PreTrainedTokenizerBase:
    """`given` (--tokenizer), else the tokenizer the checkpoints were trained with; bert-base-uncased's where none
    is saved (never for a RoBERTa or an XLM-R: one line). Checkpoints of different vocabularies are refused: their
    ratios would not be comparable, and one would read the other's token ids."""
    if given:
        return load_tokenizer(given)
    chosen, vocab, first = None, None, None
    for ref in refs:
        saved = saved_tokenizer_dir(ref)
        if saved is None and ref.kind == "hf" and model_type(ref.path) in ROBERTA_TYPES:
            raise UserError(f"{ref.label} holds a {model_type(ref.path)} without its tokenizer's files; pass "
                            "--tokenizer the one it was trained with")
        tokenizer = load_tokenizer(saved or Path(DEFAULT_TOKENIZER))
        if vocab is None:
            chosen, vocab, first = tokenizer, tokenizer.get_vocab(), ref.label
        elif tokenizer.get_vocab() != vocab:
            raise UserError(f"{ref.label} was trained with another vocabulary than {first}; analyse them apart, "
                            "or pass --tokenizer to read both with one")
    return chosen if chosen is not None else load_tokenizer(DEFAULT_TOKENIZER)


def load_pretrainer(ref: CheckpointRef) -> BertPretrainer | ElectraPretrainer:
    """The whole model, as a run's evaluation sees it: BERT's (RoBERTa's) MLM, or ELECTRA's generator and
    discriminator."""
    if ref.kind == "hf":
        return build_pretrainer(None, ObjectiveConfig(), ref.path, init_generator=ref.generator)
    parts, _ = load_parts(ref.path)
    if "mlm" in parts:
        return BertPretrainer(parts["mlm"], ObjectiveConfig())
    return ElectraPretrainer(parts["generator"], parts["discriminator"], ObjectiveConfig())


# the masked LMs an exported or hub folder's `architectures` may name
MLM_ARCHITECTURES = {cls.__name__: cls for cls in (*MLM_CLASSES.values(), ElectraForMaskedLM)}


def load_mlm(ref: CheckpointRef) -> nn.Module:
    """The masked LM of a checkpoint: BertForMaskedLM, RobertaForMaskedLM, XLMRobertaForMaskedLM, or ELECTRA's
    generator (ElectraForMaskedLM)."""
    if ref.kind == "truneg":
        parts, _ = load_parts(ref.path)
        return parts.get("mlm") or parts["generator"]
    folder = ref.generator or (ref.path / "generator" if (ref.path / "generator").is_dir() else ref.path)
    architectures = load_pretrained(AutoConfig, folder, "checkpoint").architectures or []
    found = next((MLM_ARCHITECTURES[name] for name in architectures if name in MLM_ARCHITECTURES), None)
    if found is None:
        raise UserError(f"{folder} holds a {architectures or 'model'} without an MLM head; pass a BERT or RoBERTa MLM, "
                        "or an ELECTRA generator")
    return load_pretrained(found, folder, "checkpoint")


def samples_of(ref: CheckpointRef) -> dict[str, int]:
    """{"samples": the samples a truneg tag had trained on}, as its META says; {} for another model. A tag written
    before META held them has DeepSpeed's model file read instead: checked against the tag's manifest, then with
    torch's safe unpickler."""
    if ref.kind != "truneg":
        return {}
    samples = checkpoint.saved_samples(ref.path.parent, ref.path.name)
    if samples is not None:
        return {"samples": samples}
    # ZeRO-0/1/2's one model file, or ZeRO-3's of rank 0
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    states = next((ref.path / name for name in names if (ref.path / name).is_file()), None)
    if states is None:
        return {}
    integrity.verify_before_reading(ref.path, [states.name])
    saved = integrity.load_deepspeed_file(states)
    return {"samples": int(saved["global_samples"])} if "global_samples" in saved else {}
