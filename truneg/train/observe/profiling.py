"""--profile-steps A:B: torch.profiler (CPU and, on GPUs, CUDA activities) over optimizer steps A to B inclusive,
numbered as in metrics.jsonl, on the ranks of --profile-ranks (default: all). Each writes
OUTPUT/profile/stepA-B/rankR.pt.trace.json.gz (Chrome trace format: TensorBoard's profiler plugin and Perfetto
read it), and the first profiled rank (rank 0 by default) prints its top operators by self time. The profiler only
observes: a profiled run's losses are an unprofiled one's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

TOP_OPERATORS = 15


class StepProfiler:
    """`with profiler.step(n):` around optimizer step n; a context manager for the run, which writes what it
    recorded if the run stops inside the window (a signal, the last step)."""

    def __init__(self, window: tuple[int, int] | None, ranks: tuple[int, ...] | None, rank: int, profile_dir: Path,
                 device: torch.device):
        self.span = window  # every rank's, profiled or not
        self.window = window if window is not None and (ranks is None or rank in ranks) else None
        self.rank, self.profile_dir, self.cuda = rank, profile_dir, device.type == "cuda"
        self.prints = rank == (ranks[0] if ranks else 0)  # one table: the first profiled rank's
        self.prof: profile | None = None
        self.first = self.last = 0

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, traceback: object) -> None:
        if self.prof is not None:
            self.prof.stop()
            if kind is None:  # a failing run writes nothing more
                self._write()
            self.prof = None

    def writes_during(self, step: int) -> bool:
        """Whether traces are written in this step (the window's last) or while it waits on the ranks that write
        them (the next): the watchdog gives both the long limit."""
        return self.span is not None and step in (self.span[1], self.span[1] + 1)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            yield
            return
        if self.prof is None:  # the window's first step, or the first a resume inside it trains
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof, self.first = profile(activities=activities), step
            self.prof.start()
        with record_function(f"truneg optimizer step {step}"):
            yield
        self.last = step
        if step == self.window[1]:
            self.prof.stop()
            self._write()
            self.prof = None

    def _write(self) -> None:
        folder = self.profile_dir / f"step{self.first}-{self.last}"
        folder.mkdir(parents=True, exist_ok=True)
        trace = folder / f"rank{self.rank}.pt.trace.json.gz"
        self.prof.export_chrome_trace(str(trace))  # gzipped for a .gz name
        if self.prints:
            sort_by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            table = self.prof.key_averages().table(sort_by=sort_by, row_limit=TOP_OPERATORS)
            print(f"truneg: profiled steps {self.first}-{self.last} into {folder} (rank {self.rank}'s top operators by "
                  f"self {'CUDA' if self.cuda else 'CPU'} time):\n{table}", flush=True)
