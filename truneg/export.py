"""Export a truneg ZeRO checkpoint to HF `save_pretrained` folders.

The fp32 weights come from DeepSpeed's zero_to_fp32 utilities (any ZeRO stage, any world size); the
HF configs were saved beside the checkpoints when the run started.

    truneg export runs/demo/checkpoints runs/demo/hf            # BERT: one MLM folder
                                                                # ELECTRA: hf/generator and hf/discriminator
"""
from __future__ import annotations

import shutil
from pathlib import Path

from transformers import AutoConfig, BertForMaskedLM, ElectraForMaskedLM, ElectraForPreTraining

from truneg.errors import UserError

HF_CONFIG_DIR = "hf_config"
PARTS = {"mlm": BertForMaskedLM, "generator": ElectraForMaskedLM, "discriminator": ElectraForPreTraining}


def save_hf_configs(model, checkpoint_dir: Path) -> None:
    """Write the HF config of each part, so export can rebuild the classes without the training flags."""
    for part in PARTS:
        if hasattr(model, part):
            getattr(model, part).config.save_pretrained(checkpoint_dir / HF_CONFIG_DIR / part)


def resolve_checkpoint_dir(path: str | Path) -> tuple[Path, str | None]:
    """A run's output folder, its checkpoints folder, or one tag folder -> (checkpoints folder, tag)."""
    path = Path(path)
    if (path / "checkpoints" / "latest").is_file():
        return path / "checkpoints", None
    if (path / "latest").is_file():
        return path, None
    if path.is_dir() and (path.parent / HF_CONFIG_DIR).is_dir():
        return path.parent, path.name
    raise UserError(f"{path} is not a truneg checkpoint folder (no `latest`); pass <output-dir>/checkpoints or a tag in it")


def load_parts(checkpoint_path: str | Path) -> tuple[dict, int]:
    """Rebuild the HF models of a checkpoint with its fp32 weights. Returns ({part: model}, step)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from truneg.models import ElectraPretrainer, ObjectiveConfig

    checkpoint_dir, tag = resolve_checkpoint_dir(checkpoint_path)
    tag = tag or (checkpoint_dir / "latest").read_text(encoding="utf-8").strip()
    names = [p for p in PARTS if (checkpoint_dir / HF_CONFIG_DIR / p / "config.json").is_file()]
    if not names:
        raise UserError(f"{checkpoint_dir} has no {HF_CONFIG_DIR}/; it was not written by truneg pretrain")
    parts = {p: PARTS[p](AutoConfig.from_pretrained(checkpoint_dir / HF_CONFIG_DIR / p)) for p in names}
    try:
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    except Exception as err:  # zero_to_fp32 raises ValueError, FileNotFoundError, pickle errors, ...
        raise UserError(f"cannot read checkpoint {checkpoint_dir / tag} ({type(err).__name__}: {str(err)[:200]})") from None
    if "generator" in parts:
        wrapper = ElectraPretrainer(parts["generator"], parts["discriminator"], ObjectiveConfig())
    else:
        wrapper = _BertHolder(parts["mlm"])
    missing, unexpected = wrapper.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UserError(f"checkpoint {checkpoint_dir / tag} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    step = int(tag.replace("global_step", "")) if tag.startswith("global_step") else -1
    return parts, step


class _BertHolder:
    """Maps the pre-trainer's `mlm.` keys onto a bare BertForMaskedLM."""

    def __init__(self, mlm):
        self.mlm = mlm

    def load_state_dict(self, state_dict: dict, strict: bool = False):
        inner = {k[len("mlm."):]: v for k, v in state_dict.items() if k.startswith("mlm.")}
        result = self.mlm.load_state_dict(inner, strict=strict)
        extra = [k for k in state_dict if not k.startswith("mlm.")]
        return result.missing_keys, list(result.unexpected_keys) + extra


def export(checkpoint_path: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> dict[str, Path]:
    """Write each part with save_pretrained (and the tokenizer beside it). Returns {part: folder}."""
    from truneg.data import DEFAULT_TOKENIZER, load_tokenizer

    parts, _ = load_parts(checkpoint_path)
    tokenizer = load_tokenizer(tokenizer_dir or DEFAULT_TOKENIZER)
    out_dir = Path(out_dir)
    written = {}
    for name, model in parts.items():
        folder = out_dir if name == "mlm" else out_dir / name
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        vocab = Path(tokenizer_dir or DEFAULT_TOKENIZER) / "vocab.txt"
        if vocab.is_file():  # transformers 5 writes only tokenizer.json; older readers and synonyms want vocab.txt
            shutil.copyfile(vocab, folder / "vocab.txt")
        written[name] = folder
    return written
