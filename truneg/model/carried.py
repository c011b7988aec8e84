"""What a continued checkpoint holds beside the model being pre-trained: BERT's pooler.

A public BERT is BertForPreTraining weights: its MLM head, and the pooler (with NSP's head) that
BertForSequenceClassification starts from. Pre-training continues a BertForMaskedLM, which has no pooler, so the
pooler is carried beside it as loaded: no parameter of the engine (AdamW would decay it even at zero gradient), no
cast to the run's bf16 or fp16, saved once beside the checkpoints' configs and written into the export.
"""
from __future__ import annotations

from pathlib import Path

import torch
from huggingface_hub import load_torch_model
from torch import nn
from transformers import PretrainedConfig
from transformers.models.bert.modeling_bert import BertPooler
from transformers.utils import SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from truneg.errors import UserError

# Its keys in a BertForPreTraining's (and a classifier's) weights, and in a BertModel's (a sentence-transformers
# encoder's), which carry no `bert.` prefix; carried under the first either way.
POOLER_PREFIX = "bert.pooler."
BARE_POOLER_PREFIX = "pooler."


def load_pooler(folder: Path, config: PretrainedConfig, unexpected: set[str]) -> dict[str, torch.Tensor] | None:
    """The pooler's weights of a BERT checkpoint folder, in fp32 (`unexpected`: the keys BertForMaskedLM left
    unread, from_pretrained's loading info); None when the checkpoint has none (a model pre-trained from scratch)."""
    if any(key.startswith(POOLER_PREFIX) for key in unexpected):
        holder = nn.Module()  # the pooler under its checkpoint names, filled by huggingface_hub (sharded files too)
        holder.bert = nn.Module()
        holder.bert.pooler = BertPooler(config)
    elif any(key.startswith(BARE_POOLER_PREFIX) for key in unexpected):
        holder = nn.Module()
        holder.pooler = BertPooler(config)
    else:
        return None
    try:
        missing = load_torch_model(holder, folder, strict=False, safe=False).missing_keys  # safetensors, else .bin
    except ValueError:  # several weight files (a Trainer's training_args.bin beside pytorch_model.bin): the one
        # from_pretrained reads
        single = next((folder / name for name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME) if (folder / name).is_file()), None)
        if single is None:
            raise UserError(f"--init-from {folder}: cannot tell which of its weight files holds the pooler; keep one "
                            f"{SAFE_WEIGHTS_NAME} or {WEIGHTS_NAME} there") from None
        missing = load_torch_model(holder, single, strict=False, safe=False).missing_keys
    if missing:  # half a pooler: none rather than a random half
        return None
    prefix = "" if hasattr(holder, "bert") else "bert."
    return {prefix + name: value.detach().clone() for name, value in holder.state_dict().items()}
