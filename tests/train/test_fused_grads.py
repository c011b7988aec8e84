"""The bf16 recipes' gradient accumulation in multi-tensor ops: bitwise DeepSpeed's own, in far fewer host ops.
(The whole path, a bf16 ZeRO-1 run on the CPU, is test_engine.py's bf16 export test.)"""
from __future__ import annotations

import types

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from torch.utils._python_dispatch import TorchDispatchMode

from truneg.train.fused_grads import foreach_update_hp_grads, fuse_bf16_grad_accumulation


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _optimizer_state(seed: int) -> types.SimpleNamespace:
    """What BF16_Optimizer's accumulation reads: bf16 parameters with gradients (one without), and fp32 gradients
    as views of a flat buffer per group, as DeepSpeed lays them out."""
    torch.manual_seed(seed)
    shapes = [[(8, 4), (4,), (3, 2, 2)], [(5,), (2, 3)]]
    state = types.SimpleNamespace(immediate_grad_update=False, autoep_folding_tp_group=None, bf16_groups=[],
                                  fp32_groups_gradients=[], fp32_groups_has_gradients=[])
    for group in shapes:
        params = [torch.nn.Parameter(torch.randn(shape).bfloat16()) for shape in group]
        flat = torch.randn(sum(p.numel() for p in params))
        views, offset = [], 0
        for p in params:
            views.append(flat.narrow(0, offset, p.numel()).view(p.shape))
            offset += p.numel()
            p.grad = torch.randn(p.shape).bfloat16()
        params[1].grad = None  # a parameter the step did not reach
        state.bf16_groups.append(params)
        state.fp32_groups_gradients.append(views)
        state.fp32_groups_has_gradients.append([False] * len(params))
    state._update_hp_grad = types.MethodType(BF16_Optimizer._update_hp_grad, state)
    return state


def test_the_multi_tensor_accumulation_is_deepspeeds_bitwise_in_fewer_ops():
    ours, theirs = _optimizer_state(0), _optimizer_state(0)
    counts = []
    for clear in (False, True):  # two micro-steps: the second also clears the bf16 gradients
        with _Count() as mine:
            foreach_update_hp_grads(ours, clear_lp_grads=clear)
        with _Count() as deepspeeds:
            BF16_Optimizer.update_hp_grads.__wrapped__(theirs, clear_lp_grads=clear)
        counts.append((mine.ops, deepspeeds.ops))
    for a, b in zip(sum(ours.fp32_groups_gradients, []), sum(theirs.fp32_groups_gradients, [])):
        assert torch.equal(a, b)
    assert ours.fp32_groups_has_gradients == theirs.fp32_groups_has_gradients == [[True, False, True], [True, False]]
    for group_a, group_b in zip(ours.bf16_groups, theirs.bf16_groups):
        for a, b in zip(group_a, group_b):
            assert (a.grad is None) == (b.grad is None) and (a.grad is None or torch.equal(a.grad, b.grad))
            assert getattr(a, "_hp_grad", None) is not None or a.grad is None
    assert all(grad.grad is None or not grad.grad.any() for grad in ours.bf16_groups[0])  # cleared
    # one add per group (and one zero when clearing), where DeepSpeed dispatches several ops a parameter
    assert counts[0][0] == 2 and counts[1][0] == 4 and counts[0][1] >= 4 * 3, counts


def test_only_a_bf16_optimizer_takes_it():
    assert not fuse_bf16_grad_accumulation(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
