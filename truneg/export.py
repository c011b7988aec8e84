"""Export a truneg ZeRO checkpoint to HF `save_pretrained` folders.

The weights come from checkpoint.fp32_state_dict (any world size): DeepSpeed's zero_to_fp32 for ZeRO-1/2/3
partitions, BF16_Optimizer's fp32 masters for the bf16 recipes, and at ZeRO-0 the model file's weights as the
run held them (fp16 in an fp16 run). The HF configs were saved beside the checkpoints when the run started.

    truneg export runs/demo/checkpoints runs/demo/hf            # BERT: one MLM folder
                                                                # ELECTRA: hf/generator and hf/discriminator
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn
from transformers import AutoConfig, BertForMaskedLM, ElectraForMaskedLM, ElectraForPreTraining

from truneg import checkpoint
from truneg.checkpoint import HF_CONFIG_DIR
from truneg.errors import UserError, check_output_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PARTS = {"mlm": BertForMaskedLM, "generator": ElectraForMaskedLM, "discriminator": ElectraForPreTraining}
TOKENIZER_DIR = "tokenizer"


def save_hf_configs(model: nn.Module, checkpoint_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """Write the HF config of each part and the run's tokenizer, so export can rebuild the classes without
    the training flags and ship the vocab the model was trained on."""
    for part in PARTS:
        if hasattr(model, part):
            getattr(model, part).config.save_pretrained(checkpoint_dir / HF_CONFIG_DIR / part)
    folder = checkpoint_dir / HF_CONFIG_DIR / TOKENIZER_DIR
    save_tokenizer(tokenizer, Path(tokenizer.name_or_path), folder)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, source: Path, folder: Path) -> None:
    """The tokenizer, and its source folder's vocab.txt: transformers 5 writes only tokenizer.json, and older
    readers and the synonym tables want vocab.txt."""
    tokenizer.save_pretrained(folder)
    if (source / "vocab.txt").is_file():
        shutil.copyfile(source / "vocab.txt", folder / "vocab.txt")


def load_parts(checkpoint_path: str | Path) -> tuple[dict, int]:
    """Rebuild the HF models of a checkpoint with its fp32 weights. Returns ({part: model}, step)."""
    from truneg.models import ElectraPretrainer, ObjectiveConfig

    checkpoint_dir, tag = checkpoint.resolve_tag(checkpoint_path)
    names = [p for p in PARTS if (checkpoint_dir / HF_CONFIG_DIR / p / "config.json").is_file()]
    if not names:
        raise UserError(f"{checkpoint_dir} has no {HF_CONFIG_DIR}/; it was not written by truneg pretrain")
    try:
        parts = {p: PARTS[p](AutoConfig.from_pretrained(checkpoint_dir / HF_CONFIG_DIR / p)) for p in names}
    except (OSError, ValueError) as err:  # transformers' own line names the file; a traceback would bury it
        raise UserError(f"cannot read the model configs in {checkpoint_dir / HF_CONFIG_DIR} ({str(err)[:200]}); "
                        "the checkpoint folder is damaged") from None
    if "generator" in parts:
        holder = ElectraPretrainer(parts["generator"], parts["discriminator"], ObjectiveConfig())
    else:  # the pre-trainer's `mlm.` keys onto a bare BertForMaskedLM
        holder = nn.Module()
        holder.mlm = parts["mlm"]
    checkpoint.load_into(holder, checkpoint.fp32_state_dict(checkpoint_dir, tag), str(checkpoint_dir / tag))
    return parts, checkpoint.step_of_tag(tag)


def run_tokenizer_dir(checkpoint_dir: Path) -> Path:
    """The run's own tokenizer, saved beside its configs (runs from before that: bert-base-uncased's)."""
    from truneg.data import DEFAULT_TOKENIZER

    saved = checkpoint_dir / HF_CONFIG_DIR / TOKENIZER_DIR
    return saved if saved.is_dir() else Path(DEFAULT_TOKENIZER)


def export(checkpoint_path: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> dict[str, Path]:
    """Write each part with save_pretrained (and the tokenizer beside it). Returns {part: folder}."""
    from truneg.data import load_tokenizer

    out_dir = Path(out_dir)
    check_output_path(out_dir, "export to")  # a file there, save_pretrained would only log it; before the reading
    if tokenizer_dir is None:
        tokenizer_dir = run_tokenizer_dir(checkpoint.resolve(checkpoint_path)[0])
    tokenizer = load_tokenizer(tokenizer_dir)  # before the consolidation, which takes minutes for BERT-large
    parts, _ = load_parts(checkpoint_path)
    written = {}
    for name, model in parts.items():
        folder = out_dir if name == "mlm" else out_dir / name
        model.save_pretrained(folder)
        save_tokenizer(tokenizer, Path(tokenizer_dir), folder)
        written[name] = folder
    return written
