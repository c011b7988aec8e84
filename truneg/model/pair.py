"""ELECTRA from its two public checkpoints (google/electra-base-discriminator and -generator): the two are tied
into one embedding, as the official ELECTRA trains them, when their embeddings have the same shapes."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import ElectraForMaskedLM, ElectraForPreTraining

from truneg.errors import UserError

# What the shared embedding module's shapes depend on: word, position and token-type tables of one width.
TIED_SIZES = ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size")


def model_type(folder: Path) -> str | None:
    """The config.json's model_type; None when it cannot be read (from_pretrained_with_head says what is wrong)."""
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def refuse_lone_electra(folder: Path) -> None:
    """One line for an ELECTRA model given alone as a BERT's --init-from (google/electra-base-discriminator without
    its generator), which would load as a BertForMaskedLM with every weight missing."""
    if model_type(folder) == "electra":
        raise UserError(f"--init-from {folder} holds one ELECTRA model, not a BERT; pass its generator beside it with "
                        "--init-generator (google/electra-base-generator for google/electra-base-discriminator), or a "
                        "folder with generator/ and discriminator/")


def check_electra_folder(folder: Path, flag: str) -> None:
    """One line when a folder of the pair holds no ELECTRA model (a BERT checkpoint would load with its weights
    missing, which the head check would name less plainly)."""
    if (found := model_type(folder)) not in (None, "electra"):
        raise UserError(f"{flag} {folder} holds a {found} model; --init-from and --init-generator take ELECTRA's "
                        "discriminator (ElectraForPreTraining) and generator (ElectraForMaskedLM)")


def check_tieable(generator: ElectraForMaskedLM, discriminator: ElectraForPreTraining, names: tuple[str, str]) -> None:
    """Refuse, in one line, a pair whose embeddings cannot be one module (`names`: the generator's and the
    discriminator's as given)."""
    differ = [f"{key} {getattr(generator.config, key)} vs {getattr(discriminator.config, key)}" for key in TIED_SIZES
              if getattr(generator.config, key) != getattr(discriminator.config, key)]
    if differ:
        raise UserError(f"the generator {names[0]} and the discriminator {names[1]} cannot share one embedding "
                        f"({', '.join(differ)}); pass the generator trained with that discriminator")


def differing_embeddings(generator: ElectraForMaskedLM, discriminator: ElectraForPreTraining) -> list[str]:
    """The embedding weights whose values differ between the two (empty for a pair trained together)."""
    own, kept = generator.electra.embeddings.state_dict(), discriminator.electra.embeddings.state_dict()
    return [name for name, value in own.items() if name in kept and not torch.equal(value, kept[name])]


def note_kept_copy(differ: list[str]) -> None:
    """Rank 0's one line naming the copy kept, when the two copies differ."""
    if differ and os.environ.get("RANK", "0") == "0":
        print(f"truneg: note: the generator's and the discriminator's embeddings differ ({', '.join(differ)}); the "
              "discriminator's copy is kept and shared, as ELECTRA shares one", flush=True)
