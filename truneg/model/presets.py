"""Model presets (sizes of BERT and ELECTRA) and loading HF checkpoints with their pre-training heads."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError
from transformers.utils import logging as hf_logging

from truneg.errors import UserError
from truneg.model.families import MODEL_TYPES, REFUSED_TYPES, head_prefix
from truneg.model.pair import model_type

VOCAB_SIZE = 30522
MAX_POSITIONS = 512

BERT_PRESETS = {
    "bert-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}
# (discriminator, generator); the generator is 1/4 (small) or 1/3 (base) as wide, same depth, and
# both share one embedding of `embedding_size`, as in the official ELECTRA.
ELECTRA_PRESETS = {
    "electra-tiny": (
        dict(embedding_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256),
        dict(embedding_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=1, intermediate_size=64),
    ),
    "electra-small": (
        dict(embedding_size=128, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024),
        dict(embedding_size=128, hidden_size=64, num_hidden_layers=12, num_attention_heads=1, intermediate_size=256),
    ),
    "electra-base": (
        dict(embedding_size=768, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
        dict(embedding_size=768, hidden_size=256, num_hidden_layers=12, num_attention_heads=4, intermediate_size=1024),
    ),
}
PRESETS = sorted(BERT_PRESETS) + sorted(ELECTRA_PRESETS)
DEFAULT_PRESET = "electra-tiny"


def is_electra(preset: str) -> bool:
    return preset.startswith("electra")


def check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise UserError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")


SIZE_KEYS = ("hidden_size", "num_hidden_layers")  # what a preset and a checkpoint are matched on


def preset_sizes(preset: str) -> dict:
    """A preset's SIZE_KEYS (an ELECTRA preset's: its discriminator's)."""
    spec = ELECTRA_PRESETS[preset][0] if is_electra(preset) else BERT_PRESETS[preset]
    return {k: spec[k] for k in SIZE_KEYS}


def is_electra_checkpoint(root: Path) -> bool:
    """An ELECTRA checkpoint is a folder with generator/ and discriminator/ (as `truneg export` writes)."""
    return (root / "discriminator" / "config.json").is_file()


def foreign_model_problem(root: Path, flag: str) -> str | None:
    """One line when a checkpoint folder's config.json (an export's generator/ and discriminator/ ones) names a
    model_type truneg does not build (a GPT-2, a T5, a DeBERTa: families.MODEL_TYPES), which from_pretrained would
    load into a BERT of default sizes with every weight missing; None otherwise. A config without a model_type (old
    BERT exports) or one that cannot be read passes: the load says what is wrong with the latter."""
    parts = [root / "generator", root / "discriminator"] if is_electra_checkpoint(root) else [root]
    for folder in parts:
        found = model_type(folder)
        if found is not None and found not in MODEL_TYPES:
            why = f": {REFUSED_TYPES[found]}" if found in REFUSED_TYPES else ""
            return (f"{flag} {folder} holds a {found} model (its config.json's model_type{why}); truneg continues only "
                    "model_type "
                    f"{', '.join(MODEL_TYPES[:-1])} or {MODEL_TYPES[-1]} (a BERT or RoBERTa MLM or encoder, an ELECTRA "
                    "generator and discriminator, or `truneg export`'s folder): pass one of those")
    return None


def matching_preset(root: Path, electra: bool | None = None) -> str | None:
    """The preset whose sizes an --init-from checkpoint has, read from its config.json alone (no weights);
    None when none matches or the config cannot be read. `electra` True: a discriminator's own folder (the
    --init-generator form); None: told by the folder's layout."""
    folder = is_electra_checkpoint(root)
    try:
        config = json.loads((root / "discriminator" / "config.json" if folder else root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if electra is None:  # (an ELECTRA discriminator alone has BERT-base's sizes: its model_type tells them apart)
        electra = folder or config.get("model_type") == "electra"
    return next((name for name in PRESETS if is_electra(name) == electra
                 and all(config.get(k) == v for k, v in preset_sizes(name).items())), None)


def common_config() -> dict:
    # SDPA attention explicitly: flash / memory-efficient kernels on GPUs, and a graph dynamo traces whole.
    return {"vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_POSITIONS, "type_vocab_size": 2,
            "attn_implementation": "sdpa"}




def load_pretrained(cls, path: str | Path, flag: str, **kwargs):
    """`cls.from_pretrained(path)`; a damaged or mismatched folder (a weights file cut short, a weight of another
    shape, a config that is not JSON) refused in one line that names the flag it came from."""
    try:
        return cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        raise UserError(f"{flag} {path}: cannot load it ({str(err)[:300]}); export the checkpoint again, or pass "
                        "another folder") from None


def from_pretrained_with_head(cls, path: Path, flag: str = "--init-from", new_head: bool = False) -> tuple:
    """(the model, the checkpoint's weights it does not hold: a BertForPreTraining's pooler, ...).

    `new_head` (BERT's --new-head): a checkpoint without the MLM head loads its encoder exactly, and the head
    starts as HF initialises it; a checkpoint that has the head is refused, so that no head is silently
    replaced or silently kept."""
    if not (path / "config.json").is_file():
        raise UserError(
            f"{flag}: {path} holds no HF model (config.json); pass an exported truneg folder "
            "(with generator/ and discriminator/ for ELECTRA) or an HF model folder"
        )
    if problem := foreign_model_problem(path, flag):  # before from_pretrained builds a BERT of default sizes
        raise UserError(problem)
    # --new-head expects the head missing: HF's load report (and its warning that the head's tied bias is absent)
    # would say as much in a dozen lines; truneg's own line says it in one
    verbosity = hf_logging.get_verbosity()
    if new_head:
        hf_logging.set_verbosity_error()
    try:
        model, info = load_pretrained(cls, path, flag, attn_implementation="sdpa", output_loading_info=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    # A checkpoint of another class (a BertModel, a classifier) loads with its head missing, which HF only logs:
    # pre-training would go on from a random head.
    # The MLM head is what --new-head starts as HF initialises it when a checkpoint lacks it (a BertModel export, a
    # sentence-transformers encoder); its decoder's weight is tied to the word embeddings.
    prefix = head_prefix(cls)
    missing = sorted(k for k in info["missing_keys"] if not k.endswith("position_ids"))
    head = [k for k in missing if k.startswith(prefix)]
    if new_head and not head:
        raise UserError(f"--new-head: {path} has its MLM head ({prefix}*); drop --new-head to continue it")
    encoder = [k for k in missing if not (new_head and k.startswith(prefix))]
    if encoder:
        fix = (" (a BertModel or a sentence-transformers encoder: pass --new-head to start the MLM head as HF "
               "initialises it)" if head and len(head) == len(encoder) else "")
        raise UserError(f"{flag}: {path} lacks {len(encoder)} weights of {cls.__name__} ({', '.join(encoder[:3])}"
                        f"{', ...' if len(encoder) > 3 else ''}), which would start random; pass a checkpoint with the "
                        f"pre-training head (a {cls.__name__} / BertForPreTraining, or `truneg export`'s folder){fix}")
    return model, set(info["unexpected_keys"])
