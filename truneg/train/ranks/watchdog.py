"""Hang diagnosis: --step-timeout. A rank that stops inside a step (a dead NIC, a stuck data loader, a GPU off the
bus, a stopped process) leaves every other rank waiting in its next collective until the collective timeout,
which then says nothing of who was behind or where.

Each rank's watchdog thread beats in the process group's store (on rank 0, reached through a connection of its
own with short timeouts, so it keeps working while the collectives hang; gloo's and NCCL's waits release the
GIL): the step the rank is in and a counter. When a step has run past the timeout, every rank that can still run
writes its Python stack (faulthandler, every thread) and, on GPUs, NCCL's flight recorder into
OUTPUT/hang/, and rank 0 names the ranks that are behind (in an earlier step) or not running (their beat stopped)
in one line. Every running rank hears it at its next beat (within its own limit or not), writes its stack and
exits; rank 0 exits last, since its exit closes the store. A rank whose main thread holds the GIL cannot run
its watchdog: faulthandler's own timer dumps its stack to stderr and ends it a little later.

Covered by --step-timeout: each optimizer step (forward, backward, update, its all-reduces, the log and the replica
check). The first step of each launch (a compile, the collectives' set-up), each held-out evaluation, each checkpoint
save and a resume's load (its checksums too) take as long as the model and the checkpoint's size ask: their limit
is the collective timeout less a minute, so that the stacks and the names still come before it ends the run. Not
covered: a universal conversion (rank 0 alone, before the engine; the other ranks wait for it in an all-reduce, so its
limit is the collective timeout's).
"""
from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from deepspeed.constants import default_pg_timeout

HANG_DIR = "hang"
STORE_TIMEOUT_S = 5.0
# The GIL-held fallback fires this long after the watchdog thread would have spoken (its beats, the store's reads
# and rank 0's wait for the others included), so that it never pre-empts the thread's diagnosis.
FALLBACK_GRACE_S = 20.0
KEY = "truneg/beat/{rank}"
DONE_KEY = "truneg/hang_diagnosed"  # rank 0 has spoken: the step it diagnosed
ACK_KEY = "truneg/hang_acks"  # the running ranks that have heard it (rank 0 then exits, taking its store along)
NCCL_TRACE_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"
STEP, FIRST_STEP, SAVE, LOAD = "step", "first step", "save", "load"  # the phases started() times
EVAL = "eval"  # a held-out evaluation (truneg.train.heldout): after its step's training, before its save
STAGE = {EVAL: 1, SAVE: 2}  # where in its step a rank is (the rest: 0, its training), as its beat says


def enable_flight_recorder(output_dir: Path) -> None:
    """On GPUs, before the process group: NCCL's flight recorder keeps the last collectives of each rank, for the
    dump (and torch's own dump on NCCL's timeout, into OUTPUT/nccl_trace_rank_R rather than /tmp of each node)."""
    os.environ.setdefault(NCCL_TRACE_ENV, "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(Path(output_dir) / "nccl_trace_rank_"))


class StepWatchdog:
    """`started(step, phase)` before each step or save, `ended()` after it; a thread does the rest."""

    def __init__(self, timeout_s: float, output_dir: Path, rank: int, world_size: int, store: dist.Store,
                 exit_: Callable[[int], None] = os._exit, beat_s: float | None = None, fallback: bool = True,
                 long_limit_s: float | None = None):
        self.timeout_s, self.rank, self.world_size = timeout_s, rank, world_size
        # the first step's, a save's and a load's limit: the collective timeout less a minute
        collective = default_pg_timeout.total_seconds()
        self.long_limit_s = long_limit_s or max(timeout_s, collective - min(60.0, collective / 10))
        self.phase, self.limit_s = STEP, timeout_s
        self._timing: tuple[float, float, int] | None = None  # (since, limit, step): one read for the thread
        self.hang_dir = Path(output_dir) / HANG_DIR
        self.store, self.exit, self.fallback = store, exit_, fallback
        self.beat_s = beat_s or min(2.0, max(timeout_s / 5, 0.2))
        self.store.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        self.step, self.since, self.beats = 0, None, 0
        self.paused = threading.Event()  # tests: a stopped process's thread stops beating
        self.speaking = threading.Event()  # the thread is saying why the run stops, then ends the process
        self._stop = threading.Event()
        self._beat()  # at once: a rank stopped before the thread's first beat is still told from one never started
        self._thread = threading.Thread(target=self._run, name="truneg-step-watchdog", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, timeout_s: float, output_dir: Path) -> StepWatchdog | None:
        """The run's watchdog on its process group's store, or None when --step-timeout is 0."""
        if timeout_s <= 0:
            return None
        store = dist.distributed_c10d._get_default_store().clone()  # a connection of its own
        return cls(timeout_s, output_dir, dist.get_rank(), dist.get_world_size(), store)

    @classmethod
    @contextmanager
    def running(cls, timeout_s: float, output_dir: Path) -> Iterator[StepWatchdog | None]:
        """The run's watchdog (None when --step-timeout is 0) for the block, closed after it and told whether the
        block left on an exception (see close)."""
        watchdog = cls.for_run(timeout_s, output_dir)
        failed = True
        try:
            yield watchdog
            failed = False
        finally:
            if watchdog is not None:
                watchdog.close(failed)

    @classmethod
    @contextmanager
    def timing(cls, timeout_s: float, output_dir: Path, step: int, phase: str) -> Iterator[None]:
        """One phase outside the steps (a resume's load) under the long limit, by a watchdog of its own."""
        with cls.running(timeout_s, output_dir) as watchdog:
            if watchdog is not None:
                watchdog.started(step, phase)
            yield

    def started(self, step: int, phase: str = STEP) -> None:
        self.step, self.phase = step, phase
        self.limit_s = self.timeout_s if phase == STEP else self.long_limit_s
        self.since = time.monotonic()
        self._timing = (self.since, self.limit_s, step)  # one assignment: never one phase's start with another's limit
        # if the main thread holds the GIL, this thread cannot run: faulthandler's timer needs no GIL
        if self.fallback:
            try:
                faulthandler.dump_traceback_later(self.fallback_s(), exit=True, file=sys.__stderr__)
            except (AttributeError, ValueError, OSError, RuntimeError):  # no stderr with a file descriptor
                self.fallback = False

    def fallback_s(self) -> float:
        """When faulthandler's timer dumps the stacks and ends the process, counted from the phase's start."""
        return self.limit_s + 4 * self.beat_s + 3 * STORE_TIMEOUT_S + FALLBACK_GRACE_S

    def ended(self) -> None:
        self.since = self._timing = None
        if self.fallback:
            faulthandler.cancel_dump_traceback_later()

    def close(self, failed: bool = False) -> None:
        """`failed`: the main thread is leaving on an exception, which may be a collective that failed because
        other ranks left after rank 0 spoke: then this rank says so as they do (no traceback)."""
        if threading.current_thread() is not self._thread:
            if self.speaking.is_set():
                self._thread.join(timeout=self.fallback_s())  # it ends the process
            elif failed and self.rank != 0 and not self.paused.is_set():
                heard = self._rank_zero_spoke()
                if heard is not None:
                    self._hear(heard)
        self.ended()
        self._stop.set()
        if threading.current_thread() is not self._thread:  # no late beat after a watchdog that follows it
            self._thread.join(timeout=self.beat_s + STORE_TIMEOUT_S)

    def _beat(self) -> None:
        self.beats += 1
        try:
            self.store.set(KEY.format(rank=self.rank), f"{self.step} {STAGE.get(self.phase, 0)} {self.beats}")
        except Exception:  # rank 0's store gone or stuck: the timeout still names what it can
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self.paused.is_set():
                continue
            self._beat()
            heard = self._rank_zero_spoke() if self.rank != 0 else None
            if heard is not None:  # rank 0 found a hang while this rank's own limit had not passed: leave with it
                self._hear(heard)
                return
            timing = self._timing
            if timing is not None and time.monotonic() - timing[0] > timing[1]:
                self._diagnose(timing[2])
                return

    def _stacks(self, step: int) -> str:
        """Where this rank's stacks went: the hang folder, or stderr when it cannot be written (a full disk)."""
        try:
            return f"in {self._dump(step).parent}"
        except OSError as err:
            faulthandler.dump_traceback(sys.__stderr__, all_threads=True)
            return f"on its stderr ({self.hang_dir}: {err.strerror or err})"

    def _dump(self, step: int) -> Path:
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        stacks = self.hang_dir / f"step{step}_rank{self.rank:05d}.stacks.txt"
        with open(stacks, "w") as handle:
            faulthandler.dump_traceback(handle, all_threads=True)
        dump_nccl = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
        if torch.cuda.is_available() and dump_nccl is not None and os.environ.get(NCCL_TRACE_ENV):
            try:
                (self.hang_dir / f"step{step}_rank{self.rank:05d}.nccl_trace.pickle").write_bytes(dump_nccl())
            except Exception:  # the recorder is torch's private API: the stacks above are the diagnosis
                pass
        return stacks

    def _read_beats(self) -> dict[int, tuple[int, int, int] | None]:
        beats = {}
        for rank in range(self.world_size):
            key = KEY.format(rank=rank)
            try:  # `check` first: a get of a key never set would wait the store's timeout
                beat = self.store.get(key).decode().split() if self.store.check([key]) else None
                beats[rank] = None if beat is None else tuple(int(v) for v in beat)  # step, its STAGE, count
            except Exception:  # never beat, or the store did not answer in time
                beats[rank] = None
        return beats

    def behind(self, step: int, stage: int = 0) -> tuple[list[str], int]:
        """Rank 0: what each rank that is not in `step` and running is doing, read twice a few beats apart; and how
        many of the other ranks are running (they beat)."""
        first = self._read_beats()
        time.sleep(2.5 * self.beat_s)
        second = self._read_beats()
        found, running = [], 0
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            before, now = first[rank], second[rank]
            if now is None:
                found.append(f"rank {rank} does not answer")
                continue
            if before is not None and now[2] == before[2]:
                found.append(f"rank {rank} stopped running (last seen in step {now[0]})")
                continue
            running += 1
            if now[:2] < (step, stage):
                within = " (its training)" if now[1] == 0 else " (its eval)"
                found.append(f"rank {rank} is still in step {now[0]}" + (within if now[0] == step else ""))
        return found, running

    def _rank_zero_spoke(self) -> int | None:
        """The step rank 0 diagnosed, once it has; None before, or when its store does not answer."""
        try:
            return int(self.store.get(DONE_KEY)) if self.store.check([DONE_KEY]) else None
        except Exception:
            return None

    def _await_rank_zero(self) -> bool:
        deadline = time.monotonic() + 3 * self.beat_s + 2 * STORE_TIMEOUT_S + 5
        while time.monotonic() < deadline:
            self._beat()
            try:
                if self.store.check([DONE_KEY]):
                    return True
            except Exception:  # rank 0's store is gone: it is the one behind
                return False
            time.sleep(self.beat_s)
        return False

    def _await_others(self, running: int) -> None:
        """Rank 0, after speaking: the running ranks hear it within a beat; its exit would close the store first."""
        deadline = time.monotonic() + 3 * self.beat_s + STORE_TIMEOUT_S
        while running and time.monotonic() < deadline:
            try:
                if self.store.add(ACK_KEY, 0) >= running:
                    return
            except Exception:
                return
            time.sleep(self.beat_s / 4)

    def _hear(self, step: int) -> None:
        """A rank other than 0, still within its own limit, once rank 0 has spoken: leave with it."""
        self.speaking.set()
        self._leave(f"truneg: error: rank 0 found step {step} past its limit and names the ranks behind; this rank's "
                    f"stack is {self._stacks(self.step)}", heard=True)

    def _leave(self, line: str, heard: bool) -> None:
        """A rank other than 0: tell rank 0 it has heard (only then: rank 0 counts the ranks that did), say the
        line, exit."""
        if heard:
            try:
                self.store.add(ACK_KEY, 1)
            except Exception:
                pass
        print(line, file=sys.stderr, flush=True)
        if self.fallback:
            faulthandler.cancel_dump_traceback_later()
        self.exit(2)

    def _what(self, step: int) -> str:
        if self.phase == STEP:
            return f"step {step} ran past --step-timeout {self.timeout_s:g} s"
        what = {FIRST_STEP: f"step {step}, the launch's first,", SAVE: f"step {step}'s checkpoint save",
                LOAD: f"the resume's load of step {step}'s checkpoint", EVAL: f"step {step}'s held-out evaluation"
                }[self.phase]
        return f"{what} ran past {self.limit_s:g} s (the collective timeout less a minute)"

    def _diagnose(self, step: int) -> None:
        self.speaking.set()
        where = self._stacks(step)
        if self.rank != 0:
            # rank 0 names the ranks behind: wait for it (beating meanwhile, as a running rank)
            if self._await_rank_zero():
                self._leave(f"truneg: error: {self._what(step)}: rank 0 names the ranks behind; this rank's stack is "
                            f"{where}", heard=True)
            else:
                self._leave(f"truneg: error: {self._what(step)} and rank 0's store does not answer: rank 0 (or its "
                            f"node) is the one behind; this rank's stack is {where}", heard=False)
            return
        found, running = self.behind(step, STAGE.get(self.phase, 0))
        who = "; ".join(found) if found else "every rank is in it (their stacks say where)"
        print(f"truneg: error: {self._what(step)}: {who}; every running rank's stack is {where}. Resume from the "
              "last checkpoint once the node is replaced", file=sys.stderr, flush=True)
        try:
            self.store.set(DONE_KEY, str(step))
        except Exception:
            pass
        self._await_others(running)  # they exit with their own line, before this rank's exit closes the store
        if self.fallback:
            faulthandler.cancel_dump_traceback_later()
        self.exit(2)
