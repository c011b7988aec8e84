"""`--compile`'s modes.

`layers` (the default, and the bare flag) compiles each HF encoder layer, the embeddings and the heads in place,
each as one graph (`fullgraph=True`, as torchtitan compiles its blocks): the module tree, the parameters' names,
the state dict and the checkpoints stay those of eager HF models, and DeepSpeed's module hooks stay outside the
graphs. The objectives (a few dozen small ops at the masked positions) stay eager. `whole` compiles the
pre-trainer at once through DeepSpeed's `engine.compile()`.
"""
from __future__ import annotations

import torch
from torch import nn

from truneg.model.families import mlm_head

COMPILE_MODES = ("layers", "whole")
DEFAULT_MODE = "layers"
# Inductor's fused kernels; a CPU dry run or test sets "eager" / "aot_eager" (dynamo's trace without codegen).
BACKEND = "inductor"


def compiled_parts(model: nn.Module) -> list[nn.Module]:
    """The modules `layers` compiles, each once (ELECTRA's generator and discriminator share one embedding)."""
    if hasattr(model, "mlm"):  # BertPretrainer (a BERT or a RoBERTa)
        encoder = model.mlm.base_model
        parts = [encoder.embeddings, *encoder.encoder.layer, mlm_head(model.mlm)]
    else:  # ElectraPretrainer
        generator, discriminator = model.generator, model.discriminator
        parts = [discriminator.electra.embeddings, *generator.electra.encoder.layer,
                 *discriminator.electra.encoder.layer, generator.generator_predictions,
                 discriminator.discriminator_predictions]
    return list({id(part): part for part in parts}.values())


def compile_layers(model: nn.Module, backend: str | None = None, mode: str | None = None) -> int:
    """Compile each of `compiled_parts(model)` in place; returns how many.

    The module's `forward` is replaced by its compiled self, not the module by a wrapper: `_orig_mod.` never
    enters a parameter's name, and hooks (ZeRO's) run around the graph, not inside it. Static shapes: every
    micro-batch has the same shape (an exact number of masked positions, gathered), and layers of one shape
    share one graph (dynamo lifts their parameters to inputs). `mode`: torch.compile's (Inductor's
    "reduce-overhead": CUDA graphs)."""
    parts = compiled_parts(model)
    for part in parts:
        if not getattr(part.forward, "truneg_compiled", False):
            compiled = torch.compile(part.forward, fullgraph=True, dynamic=False, backend=backend or BACKEND, mode=mode)
            compiled.truneg_compiled = True
            part.forward = compiled
    return len(parts)
