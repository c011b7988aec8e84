"""The replica check: data-parallel ranks hold weights that must be bitwise the same (at ZeRO-0 each rank's own
full copy, updated by each; at ZeRO-1/2 the bf16/fp16/fp32 weights DeepSpeed gathers after each step). A bad GPU,
a rank-local bug or a step skipped on one rank alone makes them drift while the averaged loss looks fine.

Every --replica-check-steps steps, and before every checkpoint, each rank reduces each parameter to one exact
integer (the sum of its bytes read as 64-bit integers) and one all-reduce of those ~400 integers, by max of (v, -v),
gives every rank the max and the min of each: any difference stops every rank, naming the rank and the first
parameter. At ZeRO-3 each rank holds only its partition of the weights, so there is nothing shared to compare.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from truneg.errors import UserError

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

# Fault injection for tests: the optimizer step after whose update rank 1 perturbs one weight.
INJECT_DIVERGE_ENV = "TRUNEG_INJECT_DIVERGE"


def applies(engine: DeepSpeedEngine) -> bool:
    return dist.get_world_size() > 1 and engine.zero_optimization_stage() < 3


def _bits_sum(param: torch.Tensor) -> torch.Tensor:
    raw = param.detach().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    try:
        words = raw[:whole].view(torch.int64)
    except RuntimeError:  # not 8-byte aligned in its storage (a view into a flat buffer at an odd offset)
        words = raw[:whole].clone().view(torch.int64)
    return words.sum() + raw[whole:].to(torch.int64).sum()


def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """One int64 per parameter: the sum, wrapping modulo 2**64, of its bytes read as 64-bit integers. Exact (no
    rounding: equal weights give equal sums in any order of summation) and changed by any single flipped bit; at
    memory speed (read as int32 widened to int64 it was 20 times slower on this CPU)."""
    return torch.stack([_bits_sum(p) for p in params])


def check(engine: DeepSpeedEngine, step: int, last_good: str | None) -> None:
    """A collective: stop every rank with one line if the ranks' weights differ. `last_good` is the checkpoint
    to resume from, for the message."""
    named = [(name, p) for name, p in engine.module.named_parameters()]
    mine = fingerprint([p for _, p in named])
    bounds = torch.cat([mine, -mine])
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    differs = (bounds[: len(named)] != -bounds[len(named):]).nonzero()
    if len(differs) == 0:
        return
    first = int(differs[0])
    # who differs, only once something does: each rank's sum of that parameter, against the most common one
    every = [torch.zeros_like(mine[first]) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine[first])
    values = [int(v) for v in every]
    counts = Counter(values)
    common = values[0] if counts[values[0]] == max(counts.values()) else counts.most_common(1)[0][0]
    odd = [rank for rank, v in enumerate(values) if v != common]
    who = f"rank {odd[0]}'s" if len(odd) == 1 else f"ranks {', '.join(map(str, odd))}'"
    raise UserError(f"the data-parallel replicas diverged by step {step}: {who} weights differ from rank "
                    f"{values.index(common)}'s, first in {named[first][0]} ({len(differs)} parameter(s) differ); "
                    f"stopped without saving. The last good checkpoint ({last_good or 'none yet'}) is intact: check "
                    "that rank's node (GPU, memory) and resume")


def injected_step() -> int | None:
    """TRUNEG_INJECT_DIVERGE's step (for the tests), read on every rank so that a bad value stops them all."""
    value = os.environ.get(INJECT_DIVERGE_ENV, "").strip()
    if value and not re.fullmatch(r"[0-9]+", value):
        raise UserError(f"{INJECT_DIVERGE_ENV}={value} is not a step number; unset it, or give the step after "
                        "which rank 1 changes a weight")
    return int(value) if value else None


def perturb(engine: DeepSpeedEngine) -> None:
    """For the tests: one weight changed on this rank alone, after the step's update and DeepSpeed's gather."""
    with torch.no_grad():
        first = next(engine.module.parameters())
        first.view(-1)[0] += 1.0
