"""What a continued checkpoint holds beside the model being pre-trained: BERT's (or RoBERTa's) pooler.

A public BERT is BertForPreTraining weights: its MLM head, and the pooler (with NSP's head) that
BertForSequenceClassification starts from (public RoBERTas hold one too). Pre-training continues a masked LM,
which has no pooler, so the
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

# Its keys in a BertForPreTraining's (and a classifier's) weights are `bert.pooler.` (RoBERTa's `roberta.pooler.`),
# and in a BertModel's (a sentence-transformers encoder's) `pooler.`; carried under the first either way.
BARE_POOLER_PREFIX = "pooler."


def load_pooler(folder: Path, config: PretrainedConfig, unexpected: set[str],
                base: str = "bert") -> dict[str, torch.Tensor] | None:
    """The pooler's weights of a checkpoint folder, in fp32 (`unexpected`: the keys the masked LM left unread,
    from_pretrained's loading info; `base`: its base model's prefix); None when the checkpoint has none (a model
    pre-trained from scratch). RoBERTa's pooler is BERT's (dense, tanh)."""
    if any(key.startswith(f"{base}.{BARE_POOLER_PREFIX}") for key in unexpected):
        holder = nn.Module()  # the pooler under its checkpoint names, filled by huggingface_hub (sharded files too)
        setattr(holder, base, nn.Module())
        getattr(holder, base).pooler = BertPooler(config)
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
    prefix = "" if hasattr(holder, base) else f"{base}."
    return {prefix + name: value.detach().clone() for name, value in holder.state_dict().items()}
