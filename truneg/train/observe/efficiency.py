"""How well a run uses its devices, at each log step: `tflops` and `mfu` (truneg.train.observe.flops), the peak memory
of the interval (its largest over the ranks), `data_wait_fraction` and the last step's `grad_norm`.

Nothing here waits on the device inside a step: the input's wait is host time around `next()`, the peaks are the
allocator's (or the kernel's) counters, and the grad norm stays a device tensor until the log step's one
all-reduce, which carries these figures beside the metric sums (metrics.py).
"""
from __future__ import annotations

import math
import re
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from deepspeed.accelerator import get_accelerator

from truneg.train.observe.flops import model_train_flops, run_peak_tflops

if TYPE_CHECKING:
    from collections.abc import Iterator

    from deepspeed.runtime.engine import DeepSpeedEngine

GIB = 2**30
PROC_STATUS, CLEAR_REFS = Path("/proc/self/status"), Path("/proc/self/clear_refs")
# Keys whose first interval after a start or a resume holds the start-up (compile, allocator, data workers): that
# record is marked `"warmup": true`, and tensorboard leaves them out of its curves.
THROUGHPUT_KEYS = ("samples_per_sec", "tokens_per_sec", "tflops", "mfu", "data_wait_fraction")


class TimedBatches:
    """A rank's batches, with the time the training thread waited in `next()` for each (`waited_s`, since the
    last log step): reading and masking on the CPU ranks, the queue of the DataLoader's workers on GPUs."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]):
        self.batches, self.waited_s = batches, 0.0

    @property
    def position(self) -> dict:
        """The sampler's state after the last batch handed out (MaskedBatches.position): what a checkpoint keeps."""
        return self.batches.position

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        batch = next(self.batches)
        self.waited_s += time.perf_counter() - start
        return batch


class GradNormHook:
    """fp32 at ZeRO-0, where DeepSpeed computes no global norm: the gradients' 2-norm at each optimizer step, taken
    before its clipping (as DeepSpeed's is), on the device. The gradients are whole on every rank there (reduced
    in the backward), so the norm is the global one. One pass over the gradients, as DeepSpeed's clipping makes;
    each tensor's sum of squares accumulated in float64 (a float32 sum over an embedding's millions of entries
    drifts by 1e-4 on the CPU)."""

    def __init__(self, engine: DeepSpeedEngine):
        self.norm: torch.Tensor | None = None
        real_step = engine.step

        def step(*args, **kwargs):
            if engine.is_gradient_accumulation_boundary():
                norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float64) for p in engine.module.parameters()
                         if p.grad is not None]
                self.norm = torch.linalg.vector_norm(torch.stack(norms)) if norms else None
            return real_step(*args, **kwargs)

        engine.step = step

    @staticmethod
    def needed(engine: DeepSpeedEngine) -> bool:
        """fp32 at ZeRO-0, the one case where DeepSpeed computes no global norm. (Its optimizers cannot be probed
        for one: BF16_Optimizer, the bf16 ZeRO-1 recipes', sets its norm only inside its first step.)"""
        return not (engine.fp16_enabled() or engine.bfloat16_enabled()) and engine.zero_optimization_stage() == 0


def peak_rss_bytes() -> float:
    """This process's peak resident memory since the last reset_peak_rss (Linux: VmHWM; elsewhere since start)."""
    try:
        return 1024.0 * int(re.search(r"VmHWM:\s+(\d+) kB", PROC_STATUS.read_text()).group(1))
    except (OSError, AttributeError):
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


def reset_peak_rss() -> None:
    """Start a new peak: the kernel sets VmHWM to the current RSS (Linux's clear_refs, "5")."""
    try:
        CLEAR_REFS.write_text("5")
    except OSError:  # not Linux, or not allowed: the peak then runs from the process's start
        pass


class Efficiency:
    """The log step's efficiency figures. `rank_values()` goes into the log's all-reduce in this rank's slot of a
    vector as long as the world (a sum then leaves every rank's values side by side: one collective, no second
    sync); `record()` turns all ranks' values into the record's keys."""

    def __init__(self, engine: DeepSpeedEngine, batches: TimedBatches, flops_per_sample: float,
                 peak_tflops: float | None, rank: int, world_size: int):
        self.engine, self.batches, self.rank, self.world_size = engine, batches, rank, world_size
        self.flops_per_sample, self.peak_tflops = flops_per_sample, peak_tflops
        self.gpu = engine.device.type != "cpu"
        self.memory_keys = (["memory_max_allocated_gib", "memory_max_reserved_gib"] if self.gpu
                            else ["memory_max_rss_gib"])
        self.grad_norm_hook = GradNormHook(engine) if GradNormHook.needed(engine) else None
        self.first_interval = True  # of this process: a start's or a resume's
        self.reset()

    @classmethod
    def for_run(cls, engine: DeepSpeedEngine, batches: TimedBatches, seq_len: int, max_predictions: int,
                peak_tflops: float | None, rank: int, world_size: int) -> Efficiency:
        """The run's, with the peak of its device and precision (one warning on rank 0 where none is known)."""
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        device_name = None if engine.device.type == "cpu" else torch.cuda.get_device_name(engine.device)
        peak, warning = run_peak_tflops(device_name, precision, peak_tflops)
        if warning and rank == 0:
            print(f"truneg: warning: {warning}", flush=True)
        flops = model_train_flops(engine.module, seq_len, max_predictions)
        return cls(engine, batches, flops, peak, rank, world_size)

    def reset(self) -> None:
        """A new interval: the input's wait and the memory peaks start again."""
        self.batches.waited_s = 0.0
        if self.gpu:
            get_accelerator().reset_peak_memory_stats(self.engine.device)
        else:
            reset_peak_rss()

    def grad_norm(self) -> float | torch.Tensor | None:
        """The last optimizer step's global gradient norm before clipping, as DeepSpeed computed it (inf for a step
        its overflow check skipped; None where its ZeRO-1/2 norm is switched off), or the hook's at fp32 ZeRO-0."""
        return self.grad_norm_hook.norm if self.grad_norm_hook is not None else self.engine.get_global_grad_norm()

    def rank_values(self, device: torch.device) -> torch.Tensor:
        """[memory peaks..., seconds waited for input, grad norm (nan: none)] in this rank's slot of a zero vector
        of world_size slots (float64, on `device`)."""
        if self.gpu:
            memory = [get_accelerator().max_memory_allocated(self.engine.device),
                      get_accelerator().max_memory_reserved(self.engine.device)]
        else:
            memory = [peak_rss_bytes()]
        values = torch.tensor([*(m / GIB for m in memory), self.batches.waited_s], dtype=torch.float64,
                              device=device)
        norm = self.grad_norm()
        norm = torch.as_tensor(math.nan if norm is None else norm).to(device=device, dtype=torch.float64)
        values = torch.cat([values, norm.reshape(1)])
        slots = values.new_zeros(self.world_size, len(values))
        slots[self.rank] = values
        return slots.flatten()

    def record(self, all_ranks: list[float], samples: float, elapsed: float) -> dict:
        """The record's keys from every rank's `rank_values` (summed: each in its slot), the interval's samples
        over all ranks and its seconds."""
        width = len(all_ranks) // self.world_size
        ranks = [all_ranks[r * width:(r + 1) * width] for r in range(self.world_size)]
        out: dict = {"warmup": True} if self.first_interval else {}
        self.first_interval = False
        if elapsed > 0:
            out["tflops"] = samples * self.flops_per_sample / elapsed / self.world_size / 1e12  # per device
            if self.peak_tflops:
                out["mfu"] = out["tflops"] / self.peak_tflops
            out["data_wait_fraction"] = min(max(r[len(self.memory_keys)] for r in ranks) / elapsed, 1.0)
        for i, key in enumerate(self.memory_keys):
            out[key] = max(r[i] for r in ranks)
        if not math.isnan(ranks[0][-1]):  # the same on every rank
            out["grad_norm"] = ranks[0][-1]
        return out


def console_fields(record: dict) -> str:
    """The GPU run's efficiency on the console line (a CPU run's record has `memory_max_rss_gib`, and its line
    stays as it was)."""
    if "memory_max_allocated_gib" not in record:
        return ""
    line = f"  {record['tflops']:.1f} TFLOP/s" if "tflops" in record else ""
    line += f"  MFU {record['mfu']:.1%}" if "mfu" in record else ""
    line += (f"  mem {record['memory_max_allocated_gib']:.1f}/{record['memory_max_reserved_gib']:.1f} GiB  "
             f"data wait {record.get('data_wait_fraction', math.nan):.1%}")
    line += f"  grad_norm {record['grad_norm']:.3g}" if "grad_norm" in record else ""
    return line + ("  (warm-up)" if record.get("warmup") else "")
