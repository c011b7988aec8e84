"""Training metrics: summed over the micro-steps of a log interval and over ranks, then written by rank 0
to DeepSpeed's monitor (tensorboard / csv / wandb, as the config says) and to `metrics.jsonl`.

Events go against the number of samples seen, as DeepSpeed's own `Train/Samples/*` events do, so that
after a resume one purge step cleans the tensorboard history of both.
"""
from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.utils.tensorboard import SummaryWriter

from truneg.train.config.run_config import METRICS
from truneg.train.observe.efficiency import THROUGHPUT_KEYS
from truneg.train.observe.records import EVAL_PREFIX, console_line, dumps, is_eval_record

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from truneg.train.observe.efficiency import Efficiency


def _step_of(line: str) -> float:
    """A record's step; a line a kill cut short (it was being written after the checkpoint) counts as later."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf


class MetricsLogger:
    def __init__(self, engine: DeepSpeedEngine, output_dir: Path, seq_len: int, rank: int):
        self.engine, self.seq_len, self.rank = engine, seq_len, rank
        self.jsonl = output_dir / METRICS
        # The interval's sums: one float64 tensor on the device, named by `keys` (the first micro-step's).
        self.keys: list[str] = []
        self.sums: torch.Tensor | None = None
        self.micro_steps = 0
        self.nonfinite_steps = 0
        self.interval_start = time.perf_counter()
        self.interval_samples = 0
        self.efficiency: Efficiency | None = None  # tflops, mfu, memory, data wait, grad norm (loop.start_state)

    def add(self, stats: dict[str, torch.Tensor], loss: torch.Tensor, finite: torch.Tensor, samples: int) -> None:
        """Accumulate one micro-step (stats are detached 0-d tensors; no host sync here). A micro-step whose
        loss is not finite adds nothing but its samples: its optimizer step is skipped.

        The values go into one tensor first: 7 ops (kernel launches on a GPU) per micro-step however many
        stats there are; summed one by one, each stat took 4 (a cast, a zeros, a `where`, an add)."""
        # The float32 count makes the stack at least float32, which holds a bf16/fp16 loss and a micro-batch's
        # counts exactly; stacking straight into float64 would copy each value separately on a GPU.
        values = {"loss": loss.detach(), "finite_micro_steps": torch.ones_like(loss, dtype=torch.float32), **stats}
        packed = torch.where(finite, torch.stack(list(values.values())).double(), 0.0)
        keys = list(values)
        if self.sums is None:
            self.keys, self.sums = keys, packed
        else:
            if self.keys[: len(keys)] != keys or self.sums.device != packed.device:  # sums loaded from a checkpoint
                carried = dict(zip(self.keys, self.sums.tolist()))
                self.keys = keys + [k for k in carried if k not in values]  # a stat no longer reported keeps its sum
                self.sums = torch.tensor([carried.get(k, 0.0) for k in self.keys], dtype=torch.float64,
                                         device=packed.device)
            if len(self.keys) > len(keys):
                packed = torch.cat([packed, packed.new_zeros(len(self.keys) - len(keys))])
            self.sums = self.sums + packed
        self.micro_steps += 1
        self.interval_samples += samples

    def count_nonfinite(self) -> None:
        """An optimizer step skipped for a non-finite loss on some rank (known after the step's all-reduce)."""
        self.nonfinite_steps += 1

    # The accumulator is part of a rank's resumable state, so a resume logs the same numbers.
    def state_dict(self) -> dict:
        return {
            "sums": dict(zip(self.keys, self.sums.tolist())) if self.sums is not None else {},
            "micro_steps": self.micro_steps,
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.keys = list(state["sums"])
        self.sums = torch.tensor(list(state["sums"].values()), dtype=torch.float64) if self.keys else None
        self.micro_steps = state["micro_steps"]
        self.nonfinite_steps = state["nonfinite_steps"]
        # not interval_samples: the throughput is the samples this process trained over the time it took

    def _reduced(self) -> tuple[dict[str, float], list[float]]:
        """(the sums over ranks, each rank's efficiency values side by side): one all-reduce, one sync."""
        counters = torch.tensor(
            [self.micro_steps, self.nonfinite_steps, self.interval_samples], dtype=torch.float64,
            device=self.sums.device
        )
        ranks = self.efficiency.rank_values(self.sums.device) if self.efficiency else self.sums.new_zeros(0)
        packed = torch.cat([self.sums, counters, ranks])
        if dist.is_initialized():
            dist.all_reduce(packed)
        values, names = packed.tolist(), self.keys + ["micro_steps", "nonfinite_steps", "samples"]
        return dict(zip(names, values)), values[len(names):]

    def log(self, step: int) -> dict | None:
        """All-reduce the interval's sums (a collective: every rank calls it) and write on rank 0."""
        if self.sums is None:
            return None
        totals, rank_values = self._reduced()
        elapsed = time.perf_counter() - self.interval_start
        finite = totals["finite_micro_steps"]
        record = {"step": step, "samples": int(self.engine.global_samples)}
        # A micro-step's MLM / generator loss and word-level SR are its summed terms over the global batch's masked
        # count times the step's micro-steps x ranks (loop.masked_denominator), and disc_loss a mean over as many
        # tokens in each: the mean over a step's micro-steps and ranks is the global batch's loss, and `loss` is still
        # the sum of the parts.
        for key in ("loss", "mlm_loss", "gen_loss", "disc_loss", "sr_loss"):
            if key in totals and finite > 0:  # an interval of skipped steps only has no loss to show
                record[key] = totals[key] / finite
        if "disc_tokens" in totals:
            record["disc_accuracy"] = totals["disc_correct"] / max(totals["disc_tokens"], 1.0)
        record["hc_corrected"] = int(totals["corrected"])
        record["hc_iter_ratio"] = totals["sequences_corrected"] / max(totals["sequences"], 1.0)
        record["hc_pred_ratio"] = totals["corrected"] / max(totals["mismatched"], 1.0)
        record["mlm_accuracy"] = 1.0 - totals["mismatched"] / max(totals["masked"], 1.0)  # of the prediction HC judges
        if "mask_shortfall" in totals:  # --whole-word-masking: masked pieces short of the rate's count, per rank summed
            record["wwm_shortfall"] = int(totals["mask_shortfall"])
        if "hc_judgeable" in totals:  # the masked positions that are whole words with synonyms (HC's reach)
            record["hc_reach"] = totals["hc_judgeable"] / max(totals["masked"], 1.0)
        if "mlm_argmax_correct" in totals:  # ELECTRA's generator, as the official code logs it
            record["mlm_argmax_accuracy"] = totals["mlm_argmax_correct"] / max(totals["masked"], 1.0)
            record["mlm_sampled_accuracy"] = totals["mlm_sampled_correct"] / max(totals["masked"], 1.0)
        record["lr"] = self.engine.get_lr()[0]
        scale = self.engine._get_optimizer_loss_scale() if self.engine.fp16_enabled() else None  # as DeepSpeed logs it
        if scale is not None:
            record["loss_scale"] = float(scale)
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        record["nonfinite_steps"] = int(totals["nonfinite_steps"]) // ranks  # counted on every rank
        record["skipped_steps"] = int(self.engine.skipped_steps)  # DeepSpeed's running total: its own check's skips
        record["samples_per_sec"] = totals["samples"] / elapsed if elapsed > 0 else math.nan
        record["tokens_per_sec"] = record["samples_per_sec"] * self.seq_len
        if self.efficiency is not None:
            record.update(self.efficiency.record(rank_values, totals["samples"], elapsed))
        # lr and loss_scale: DeepSpeed's engine writes them itself at every step; a warm-up's throughput is no point
        # of the curves
        left_out = ("step", "samples", "lr", "loss_scale", "warmup", *(THROUGHPUT_KEYS if "warmup" in record else ()))
        if self.rank == 0:
            self.engine.monitor.write_events([(f"Train/Samples/{k}", v, record["samples"]) for k, v in record.items()
                                              if k not in left_out and _plottable(v)])
            with open(self.jsonl, "a", encoding="utf-8") as fh:
                fh.write(dumps(record) + "\n")
        self.keys, self.sums, self.micro_steps, self.nonfinite_steps, self.interval_samples = [], None, 0, 0, 0
        if self.efficiency is not None:
            self.efficiency.reset()
        self.interval_start = time.perf_counter()
        return record

    def write_eval(self, record: dict) -> None:
        """A held-out evaluation's record (truneg.train.heldout), on rank 0: a line of its own in metrics.jsonl (no
        `loss` key), `Eval/...` events against the samples seen, beside DeepSpeed's `Train/Samples/*`, and one
        console line. Its time is left out of the training throughput (every rank)."""
        self.interval_start += record["eval_seconds"]
        if self.rank != 0:
            return
        self.engine.monitor.write_events([(f"Eval/{k.removeprefix(EVAL_PREFIX)}", v, record["samples"])
                                          for k, v in record.items() if k not in ("step", "samples") and _plottable(v)])
        with open(self.jsonl, "a", encoding="utf-8") as fh:
            fh.write(dumps(record) + "\n")
        print(console_line(record), flush=True)

    @contextlib.contextmanager
    def paused(self):
        """Work between steps that is not training (a save, a replica check) is left out of the interval's time,
        as an evaluation's is, so that samples/s, TFLOP/s, MFU and the data-wait share dip at no save."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.interval_start += time.perf_counter() - started

    def has_evaluation(self, step: int) -> bool:
        """Whether metrics.jsonl holds an evaluation of `step` (rank 0 reads it; a collective: every rank learns)."""
        found = False
        if self.rank == 0 and self.jsonl.is_file():
            found = any(_step_of(line) == step and is_eval_record(json.loads(line))
                        for line in self.jsonl.read_text(encoding="utf-8").splitlines())
        flag = torch.tensor([1.0 if found else 0.0], device=self.engine.device)
        dist.broadcast(flag, 0)
        return bool(flag.item())

    def drop_after(self, steps: int, samples: int) -> None:
        """On a start from a checkpoint of `steps` and `samples` (0: none): drop the records and monitor events a
        killed run wrote after it, or before its first save (its step-0 evaluation too), rather than double them."""
        self.truncate_after(steps if steps else -1)
        self.purge_monitors_after(samples if steps else -1)

    def truncate_after(self, step: int) -> None:
        """On resume from `step`: drop the records the interrupted run wrote after it (rank 0)."""
        if self.rank != 0 or not self.jsonl.is_file():
            return
        _replace_lines(self.jsonl, [line for line in self.jsonl.read_text(encoding="utf-8").splitlines()
                                    if _step_of(line) <= step])

    def purge_monitors_after(self, samples: int) -> None:
        """Hide, rather than double, the events the interrupted run wrote after the checkpoint: DeepSpeed's
        tensorboard writer reopens with a purge step, and its csv files lose those rows (it appends, and a new
        process would write each file's header again)."""
        if self.rank != 0:
            return
        csv_monitor = getattr(self.engine.monitor, "csv_monitor", None)
        if csv_monitor is not None and csv_monitor.enabled:
            for path in sorted(Path(csv_monitor.log_dir).glob("*.csv")):
                lines = path.read_text(encoding="utf-8").splitlines()
                if not lines or not lines[0].startswith("step,"):
                    path.unlink()  # empty or torn at its start by a kill: written anew, header first
                    continue
                _replace_lines(path, [lines[0], *(row for row in lines[1:] if _csv_step(row) <= samples)])
                csv_monitor.filenames.append(path.stem)  # its header is there
        tb = getattr(self.engine.monitor, "tb_monitor", None)
        if tb is None or tb.summary_writer is None:
            return
        log_dir = tb.summary_writer.log_dir
        tb.summary_writer.close()
        tb.summary_writer = SummaryWriter(log_dir=log_dir, purge_step=samples + 1)


def _plottable(value) -> bool:
    """A number a monitor can draw: not the eval table's label, nor a figure that does not exist (null)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _replace_lines(path: Path, lines: list[str]) -> None:
    """Rewrite `path` with these lines, whole or not at all (a kill leaves the old file or the new one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)


def _csv_step(row: str) -> float:
    """A csv monitor row's step; a row a kill cut short (no value, or not a number) sorts after every step."""
    step, _, value = row.partition(",")
    try:
        float(value)
        return int(step)
    except ValueError:
        return float("inf")
