"""Micro-batches by GPU memory: an estimate of one GPU's memory in a training step, and the largest micro-batch a
shipped recipe takes on a GPU of a given memory.

The estimate (GiB = 2**30 bytes, as torch reports a GPU's memory):
  - weights, gradients and optimizer states, per parameter: bf16 (ZeRO-1, fp32 gradient accumulation) 2 bf16
    weights + 2 bf16 gradients + 4 fp32 accumulated gradients + 12 fp32 master and two moments = 20 bytes; fp16
    (ZeRO-2, LAMB at ZeRO-0) 16; fp32 16. Counted unpartitioned, as on one GPU: ZeRO's shards only lower it.
  - with --train-only head only the head's parameters hold gradients and optimizer states; the frozen ones hold
    their weights alone (2 bytes in half precision, 4 in fp32), and the frozen encoder saves no activations (one
    layer's at a time).
  - activations, per sample: ACTIVATION_BYTES per token, hidden unit and layer of each encoder pass (Korthikanti
    et al. count 34 bytes in half precision without attention scores, which SDPA's flash kernel never stores;
    measured on one H200, BERT-large HC+SR at micro 64, seq 128, bf16: 17.0 GiB at its peak, 2026-11-30, which
    this reproduces), twice that in fp32; plus the masked-only head's logits (its positions x the vocab x
    HEAD_BYTES). With --activation-checkpointing each layer keeps only its input (INPUT_BYTES per token and hidden
    unit) and one layer at a time is recomputed in full: the inputs of every layer plus the widest layer's activations.
The micro-batch is the largest power of two whose estimate fits USABLE of the memory less HEADROOM_GIB (CUDA's
context, the allocator's fragmentation, NCCL's buffers), at most MAX_MICRO.
"""
from __future__ import annotations

import functools
import os

import torch

from truneg.model.head import head_prefix, untie_decoder
from truneg.model.presets import BERT_PRESETS, ELECTRA_PRESETS, VOCAB_SIZE, is_electra
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer

STATE_BYTES = {"bf16": 20, "fp16": 16, "fp32": 16}
ACTIVATION_BYTES = 57  # half precision; fp32 doubles it
INPUT_BYTES = 2  # a layer's input, in half precision, which activation checkpointing keeps
HEAD_BYTES = 12  # a logit in half precision, its fp32 copy for the loss and the loss's gradient
USABLE, HEADROOM_GIB = 0.9, 2.0
# The goal for >= 80 GB GPUs: BERT-large at 256 x 128 tokens a micro-step (32k rows a GEMM fills an H200);
# larger is not measured.
MAX_MICRO = 256


def local_memory_gib() -> float | None:
    """This machine's first CUDA GPU's memory in GiB; None without one (or under DS_ACCELERATOR=cpu)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


@functools.cache
def parameter_count(preset: str, vocab_size: int = VOCAB_SIZE, head_only: bool = False, untied: bool = False) -> int:
    """Trainable parameters of a preset (shared embeddings once) at a vocabulary size (an --init-from's own: a
    RoBERTa's 50k rows, XLM-R's 250k), built on the meta device: no memory. `head_only`: the MLM head's alone
    (--train-only head); `untied`: the decoder a parameter of its own (--untie-decoder, an untied checkpoint)."""
    with torch.device("meta"):
        model = build_pretrainer(preset, ObjectiveConfig(), vocab_size=vocab_size)
        if untied:
            untie_decoder(model.mlm)
    if head_only:  # (named once each: a tied decoder under the word embeddings' name)
        return sum(p.numel() for name, p in model.named_parameters() if name.startswith(head_prefix(model)))
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def estimate_gib(preset: str, precision: str, seq_len: int, max_predictions: int, sr: str = "none",
                 checkpointing: bool = False, vocab_size: int = VOCAB_SIZE, head_only: bool = False,
                 untied: bool = False) -> tuple[float, float]:
    """(weights and optimizer states, activations per sample) in GiB for one GPU; `checkpointing`: with
    --activation-checkpointing; `vocab_size`: the model's rows (the preset's sizes, a checkpoint's vocabulary);
    `head_only`: --train-only head; `untied`: an untied decoder (parameter_count's)."""
    if is_electra(preset):
        encoders = [(s["num_hidden_layers"], s["hidden_size"]) for s in ELECTRA_PRESETS[preset]]
        extra = [encoders[0]] if sr == "sent" else []  # SR_Sent: the discriminator encodes the original too
    else:
        size = BERT_PRESETS[preset]
        encoders = [(size["num_hidden_layers"], size["hidden_size"])]
        extra = encoders if sr == "sent" else []  # the filled-in sentence
    scale = 2 if precision == "fp32" else 1
    tokens = sum(layers * hidden for layers, hidden in encoders + extra) * seq_len
    head = max_predictions * vocab_size
    if head_only:  # the frozen encoder keeps nothing for a backward: one layer's activations at a time
        layers = ACTIVATION_BYTES * max(hidden for _, hidden in encoders) * seq_len
    elif checkpointing:  # every layer's input, and one layer's activations during its recompute
        layers = INPUT_BYTES * tokens + ACTIVATION_BYTES * max(hidden for _, hidden in encoders) * seq_len
    else:
        layers = ACTIVATION_BYTES * tokens
    per_sample = scale * (layers + HEAD_BYTES * head)
    total = parameter_count(preset, vocab_size, untied=untied)
    if not head_only:
        return total * STATE_BYTES[precision] / 2**30, per_sample / 2**30
    trained = parameter_count(preset, vocab_size, head_only=True, untied=untied)
    weight_bytes = 4 if precision == "fp32" else 2
    return (trained * STATE_BYTES[precision] + (total - trained) * weight_bytes) / 2**30, per_sample / 2**30


def micro_for_memory(memory_gib: float, preset: str, precision: str, seq_len: int, max_predictions: int,
                     sr: str = "none", checkpointing: bool = False, vocab_size: int = VOCAB_SIZE,
                     head_only: bool = False, untied: bool = False) -> tuple[int, str]:
    """The largest power-of-two micro-batch (at most MAX_MICRO, at least 1) whose estimate fits the GPU, and a line
    with the estimate."""
    static, per_sample = estimate_gib(preset, precision, seq_len, max_predictions, sr, checkpointing, vocab_size,
                                      head_only, untied)
    budget = USABLE * memory_gib - HEADROOM_GIB
    micro = MAX_MICRO
    while micro > 1 and static + micro * per_sample > budget:
        micro //= 2
    line = (f"micro-batch at most {micro} for {memory_gib:g} GiB of GPU memory (estimate "
            f"{static + micro * per_sample:.1f} GiB of {budget:.1f} usable: weights and optimizer states {static:.1f} "
            f"GiB + {per_sample:.3f} GiB a sample at seq {seq_len}"
            f"{', activation checkpointing' if checkpointing else ''}{', the head alone' if head_only else ''})")
    return micro, line
