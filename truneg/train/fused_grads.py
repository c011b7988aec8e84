"""DeepSpeed's bf16 gradient accumulation in multi-tensor ops.

With bf16 and fp32 gradient accumulation (the bf16 recipes, ZeRO-1), DeepSpeed's `BF16_Optimizer` adds every
parameter's bf16 gradient into its fp32 one after each micro-step's backward, one parameter at a time from Python
(`hp_grad.data.add_(lp.grad.data.to(fp32).view(shape))`: five ATen ops a parameter, about 390 parameters in
BERT-large). `foreach_update_hp_grads` does the same additions as one `torch._foreach_add_` per parameter group
(fp32 += bf16 promotes exactly as the cast then the add: bitwise the same gradients). On a GPU the mixed-dtype
foreach op takes torch's per-tensor path in C++: a kernel a tensor still, without the Python and dispatcher work
around each.
"""
from __future__ import annotations

import types

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer


@torch.no_grad()
def foreach_update_hp_grads(self: BF16_Optimizer, clear_lp_grads: bool = False) -> None:
    """BF16_Optimizer.update_hp_grads with one multi-tensor add (and zero) per parameter group."""
    if self.immediate_grad_update:
        return
    if getattr(self, "autoep_folding_tp_group", None) is not None:  # its per-parameter correction: DeepSpeed's loop
        BF16_Optimizer.update_hp_grads(self, clear_lp_grads)
        return
    for i, group in enumerate(self.bf16_groups):
        hp_grads, lp_grads = [], []
        for j, lp in enumerate(group):
            if lp.grad is None:
                continue
            hp_grad = self.fp32_groups_gradients[i][j]
            hp_grads.append(hp_grad)
            lp_grads.append(lp.grad if lp.grad.shape == hp_grad.shape else lp.grad.view(hp_grad.shape))
            lp._hp_grad = hp_grad
            self.fp32_groups_has_gradients[i][j] = True
        if hp_grads:
            torch._foreach_add_(hp_grads, lp_grads)
            if clear_lp_grads:
                torch._foreach_zero_(lp_grads)


def fuse_bf16_grad_accumulation(optimizer: object) -> bool:
    """Give a BF16_Optimizer the multi-tensor accumulation (this instance only); False for any other optimizer."""
    if not isinstance(optimizer, BF16_Optimizer):
        return False
    optimizer.update_hp_grads = types.MethodType(foreach_update_hp_grads, optimizer)
    return True
