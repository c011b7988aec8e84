"""The training loop: the trainer's small state, one optimizer step (`train_step`, which holds the
micro-batches), and the loop that logs, checkpoints and stops cleanly on SIGTERM/SIGINT.

Inside a step nothing waits on the host: the forward, the objectives and the metric sums stay on the
device. Once per optimizer step, one small all-reduce carries the stop flag and the non-finite count; every
--replica-check-steps steps and before each checkpoint one more compares the replicas' weights (replicas.py), and a
watchdog thread times each step (watchdog.py).
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
from torch._dynamo.utils import counters

from truneg.data.blocks import ResumableSampler
from truneg.data.masking import MaskedBatches
from truneg.errors import UserError
from truneg.train.checkpointing import checkpoint, phases
from truneg.train.config.ds_config import MONITORS
from truneg.train.config.run_config import RunConfig
from truneg.train.observe.efficiency import Efficiency, TimedBatches, console_fields
from truneg.train.observe.metrics import MetricsLogger
from truneg.train.observe.profiling import StepProfiler
from truneg.train.ranks import replicas
from truneg.train.ranks.distributed import on_rank_zero, seed
from truneg.train.ranks.watchdog import EVAL, FIRST_STEP, LOAD, SAVE, STEP, StepWatchdog

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from truneg.data.blocks import PreparedBlocks
    from truneg.train.heldout import HeldOut

# Fault injection for tests: a comma-separated list of optimizer steps whose loss becomes NaN on rank 0.
INJECT_NONFINITE_ENV = "TRUNEG_INJECT_NONFINITE_STEPS"


@dataclass
class TrainState:
    """Everything the loop mutates besides the engine (which holds model, optimizer, scheduler and step)."""

    sampler: ResumableSampler
    batches: TimedBatches  # MaskedBatches, its input wait timed
    metrics: MetricsLogger
    rank: int
    nonfinite_in_a_row: int = 0
    heldout: HeldOut | None = None  # --eval-data's evaluation
    first_step: int = 0  # where --max-steps counts from: 0, or phase 1's last step for a phase 2

    def save(self, cfg: RunConfig, engine: DeepSpeedEngine, step: int) -> None:
        """A collective. The data position goes with DeepSpeed's client state, the RNG states and the metric
        accumulator per rank; then the oldest checkpoints beyond --keep-checkpoints go."""
        client_state = {"step": step, "sampler": self.batches.position}
        rank_state = {"rng": checkpoint.rng_state(), "metrics": self.metrics.state_dict()}
        checkpoint.save(engine, cfg.checkpoint_dir, step, client_state, rank_state)
        if cfg.keep_checkpoints > 0:
            on_rank_zero(lambda: checkpoint.remove_old(cfg.checkpoint_dir, cfg.keep_checkpoints),
                         f"remove old checkpoints in {cfg.checkpoint_dir}")


def start_state(cfg: RunConfig, engine: DeepSpeedEngine, blocks: PreparedBlocks, tokenizer: PreTrainedTokenizerBase,
                resume: checkpoint.ResumePoint | None, tag: str | None, phase1: phases.Phase1 | None = None
                ) -> TrainState:
    """The state at the first step: fresh, or restored from `tag` (weights, optimizer, scheduler, step,
    data position, RNG states and metric sums). Phase 2's start (`resume` the `phase1` tag) takes its weights,
    optimizer moments (--reset-optimizer: emptied) and counters, with phase 2's optimizer settings, a fresh LR
    schedule, data order, seeds and metric sums."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = ResumableSampler(len(blocks), engine.train_micro_batch_size_per_gpu(), world_size, rank, cfg.seed,
                               engine.gradient_accumulation_steps())
    metrics = MetricsLogger(engine, cfg.output_dir, cfg.seq_len, rank)
    seed(cfg.seed, rank)
    if resume is not None and resume.phase1:
        settings = phases.Settings(engine)  # phase 2's, as its config built them
        with StepWatchdog.timing(cfg.step_timeout, cfg.output_dir, checkpoint.step_of_tag(resume.tag), LOAD):
            checkpoint.load(engine, resume.load_dir(world_size), tag, resume.saved_world_size, own_run=False)
        settings.restore(engine)
        if cfg.reset_optimizer:
            phases.empty_moments(engine)
        if rank == 0:
            print(f"truneg: phase 2 from {resume.checkpoint_dir / resume.tag} at step {engine.global_steps}"
                  f"{' (optimizer moments emptied)' if cfg.reset_optimizer else ''}", flush=True)
    elif resume is not None:
        # timed as a save is (--step-timeout's long limit): a rank stuck in it is named before the collective timeout
        with StepWatchdog.timing(cfg.step_timeout, cfg.output_dir, checkpoint.step_of_tag(resume.tag), LOAD):
            client_state, rank_state = checkpoint.load(engine, resume.load_dir(world_size), tag,
                                                       resume.saved_world_size)
        sampler.load_state_dict(client_state["sampler"])
        step = engine.global_steps
        if rank_state is None:
            print(f"truneg: warning: rank {rank} has no RNG state for world size {world_size} in the checkpoint; "
                  "reseeding (the run continues, but not bitwise as on the old world size)", flush=True)
            seed(cfg.seed, rank, step)
        else:
            checkpoint.set_rng_state(rank_state["rng"])
            metrics.load_state_dict(rank_state["metrics"])
        if rank == 0:
            print(f"truneg: resumed from {resume.checkpoint_dir} at step {step}", flush=True)
    # What a killed run wrote after its last checkpoint is not history. A resume keeps the evaluation of its
    # checkpoint's step (it ran before that save).
    metrics.drop_after(engine.global_steps, int(engine.global_samples))
    batches = TimedBatches(MaskedBatches(blocks, sampler, tokenizer, cfg.mask_scheme(engine.module.scheme), cfg.seed,
                                         cfg.max_predictions, cfg.data_workers, device=engine.device,
                                         whole_words=cfg.whole_word_masking))
    metrics.efficiency = Efficiency.for_run(engine, batches, cfg.seq_len, cfg.max_predictions, cfg.peak_tflops, rank,
                                            world_size)
    return TrainState(sampler, batches, metrics, rank, first_step=phase1.step if phase1 else 0)


class StopSignal:
    """SIGTERM/SIGINT set a flag; the step's all-reduce shares it, and every rank saves and exits."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum


def innermost_optimizer(engine: DeepSpeedEngine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ZeRO / bf16 / fp16 wrappers, each of which holds the next."""
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


class SkipGuard:
    """Skips the update of an optimizer step whose gradients are not finite on some rank.

    fp16's loss scaler and DeepSpeed's overflow check (bf16, and fp32 at ZeRO-1/2/3 through the grad norm)
    skip such steps themselves, count them in `engine.skipped_steps` and hold the LR schedule; at fp32
    ZeRO-0 nothing would. The guard sits on the innermost torch optimizer, so whichever way DeepSpeed wraps
    it, a flagged step leaves the weights and the optimizer's moments untouched; the step counter advances,
    and at fp32 ZeRO-0 the LR schedule too (DeepSpeed sees no overflow there)."""

    def __init__(self, engine: DeepSpeedEngine):
        inner = innermost_optimizer(engine)
        self.skip = False
        real_step = inner.step

        def guarded_step(*args, **kwargs):
            return None if self.skip else real_step(*args, **kwargs)

        inner.step = guarded_step


def backward_loss_scale(engine: DeepSpeedEngine) -> float:
    """What train_step multiplies the loss by before `engine.backward`: fp16's current loss scale at ZeRO
    stage 0, else 1. DeepSpeed 0.19's `engine.backward` scales the loss only for its ZeRO optimizers, while
    the fp16 optimizers of stage 0 (FP16_Optimizer, FP16_UnfusedOptimizer: the LAMB recipe) divide every
    gradient by the loss scale in their step (deepspeedai/DeepSpeed#8393, open): unscaled, the updates come
    65,536 times too small, and smaller each time the scale grows. A host float: no sync.
    `config.FP16_ZERO0_UNSCALED_DEEPSPEED` names the DeepSpeed versions this holds for."""
    if engine.fp16_enabled() and isinstance(engine.optimizer, (FP16_Optimizer, FP16_UnfusedOptimizer)):
        return float(engine.optimizer.loss_scale)
    return 1.0


def _injected_nonfinite_steps() -> set[int]:
    return {int(s) for s in os.environ.get(INJECT_NONFINITE_ENV, "").split(",") if s.strip()}


def masked_denominator(engine: DeepSpeedEngine, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor | None:
    """The models' `masked_denominator` for a step's micro-batches: the global batch's count of masked positions
    (every micro-batch of every data-parallel rank) over the factor DeepSpeed divides the summed gradients by, so that
    the step's gradient is the global batch's summed cross-entropy (and word-level SR) over its masked count, however
    it is split. DeepSpeed 0.19 divides by the accumulation steps in `engine.backward` (scale_wrt_gas) and by the
    data-parallel ranks where it averages (`gradient_allreduce_op` mean): engine.allreduce_bucket (ZeRO-0, bf16),
    stage_1_and_2's gradient_reduction_w_predivide / average_tensor, stage3's __avg_scatter_contiguous_grads; a
    gradient_predivide_factor divides and multiplies back. One all-reduce of a 0-d tensor, no host sync (NCCL runs
    it in the stream). None for a model with no masked slots."""
    if "masked_valid" not in batches[0]:
        return None
    count = torch.stack([batch["masked_valid"].sum() for batch in batches]).sum().float()
    dist.all_reduce(count, group=engine.data_parallel_group)
    averaged_over = engine.gradient_accumulation_steps() * (engine.dp_world_size if engine.gradient_average else 1)
    return count.clamp(min=1) / averaged_over  # a global batch with nothing masked has a sum of 0 to divide


def train_step(engine: DeepSpeedEngine, state: TrainState, stop: StopSignal, guard: SkipGuard,
               inject: set[int]) -> tuple[bool, bool]:
    """One optimizer step over gradient_accumulation_steps micro-batches. Returns (stop requested on some
    rank, step skipped for a non-finite loss on some rank)."""
    device = engine.device
    micro_batches = engine.gradient_accumulation_steps()
    nonfinite = torch.zeros((), device=device)
    poison = engine.global_steps + 1 in inject and state.rank == 0
    scale = backward_loss_scale(engine)  # changes only in engine.step()
    # All the step's micro-batches first (on the device; their copies queued at once): the global batch's masked
    # count divides every micro-batch's loss. The sampler position a checkpoint keeps is still the step's end.
    batches = [next(state.batches) for _ in range(micro_batches)]
    denominator = masked_denominator(engine, batches)
    extra = {} if denominator is None else {"masked_denominator": denominator}
    for micro, batch in enumerate(batches):
        loss, stats = engine(**batch, **extra)
        if poison:
            loss = loss * float("nan")
        finite = torch.isfinite(loss.detach())
        nonfinite = nonfinite + (~finite).float()
        engine.backward(loss * scale if scale != 1.0 else loss)
        state.metrics.add(stats, loss, finite, engine.train_micro_batch_size_per_gpu())
        if micro == micro_batches - 1:
            # The step's one host sync: the stop flag and the non-finite count of every rank, before the update.
            flags = torch.stack([nonfinite.new_tensor(1.0 if stop.received else 0.0), nonfinite])
            dist.all_reduce(flags)
            stop_requested, nonfinite_count = flags.tolist()
            guard.skip = nonfinite_count > 0
        engine.step()
    return stop_requested > 0, nonfinite_count > 0


def _console_line(step: int, total: int, record: dict, eta_s: float, hc: bool) -> str:
    line = (f"step {step}/{total}  loss {record.get('loss', float('nan')):.4f}  lr {record['lr']:.2e}  "
            f"{record['samples_per_sec']:.1f} samples/s  ETA {time.strftime('%H:%M:%S', time.gmtime(max(eta_s, 0)))}")
    if hc:
        line += f"  hc_iter_ratio {record['hc_iter_ratio']:.4f}  hc_pred_ratio {record['hc_pred_ratio']:.4f}"
    if record["nonfinite_steps"]:
        line += f"  nonfinite_steps {record['nonfinite_steps']}"
    return line


def compile_summary() -> str:
    """What torch.compile made of the run: no break, and one graph (`--compile whole`) or one per kind of part
    (`layers`: BERT 3, ELECTRA 5; layers of one shape share theirs). More graphs mean recompiles (a guard failed)."""
    graphs, breaks = counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())
    return f"compile: {graphs} graph(s), {breaks} graph break(s)"


def _evaluate(state: TrainState, engine: DeepSpeedEngine, step: int, watchdog: StepWatchdog | None) -> None:
    """The held-out evaluation of the weights after `step` updates, timed by the watchdog as a phase of its own
    (the caller ends it, or the next phase replaces it)."""
    if watchdog is not None:
        watchdog.started(step, EVAL)
    state.metrics.write_eval(state.heldout.run(engine, step))


def train(cfg: RunConfig, engine: DeepSpeedEngine, state: TrainState) -> None:
    window = cfg.profile_steps and (cfg.profile_steps[0] + state.first_step, cfg.profile_steps[1] + state.first_step)
    profiler = StepProfiler(window, cfg.profile_ranks, state.rank, cfg.profile_dir, engine.device)
    with StepWatchdog.running(cfg.step_timeout, cfg.output_dir) as watchdog, profiler:
        _train(cfg, engine, state, watchdog, profiler)


def _train(cfg: RunConfig, engine: DeepSpeedEngine, state: TrainState, watchdog: StepWatchdog | None,
           profiler: StepProfiler) -> None:
    stop, guard, inject = StopSignal(), SkipGuard(engine), _injected_nonfinite_steps()
    diverge_at = replicas.injected_step()  # tests: rank 1 perturbs a weight after it (read on every rank)
    check_replicas = cfg.replica_check_steps > 0 and replicas.applies(engine)
    start_step, last_step = engine.global_steps, state.first_step + cfg.max_steps
    # The phase's first step, before its first update. A resume evaluates its step only where that was due and has no
    # record: a stop at an eval step saves without evaluating (a scheduler's grace is short).
    if state.heldout is not None and (start_step == state.first_step or state.heldout.due(start_step)) \
            and not state.metrics.has_evaluation(start_step):
        _evaluate(state, engine, start_step, watchdog)
        if watchdog is not None:
            watchdog.ended()
    started = time.perf_counter()
    state.metrics.interval_start = started  # the throughput counts training, not the start-up or a resume's load
    step = start_step
    while step < last_step:
        if watchdog is not None:  # the launch's first step may compile, a profiled window's end writes traces (the
            # writing ranks in its last step, the others waiting in the next): the long limit
            long = step == start_step or profiler.writes_during(step + 1)
            watchdog.started(step + 1, FIRST_STEP if long else STEP)
        with profiler.step(step + 1):
            stop_requested, skipped = train_step(engine, state, stop, guard, inject)
        step = engine.global_steps
        if state.rank == 1 and step == diverge_at:
            replicas.perturb(engine)
        # A non-finite loss, in any precision (fp16's scaler overflows are non-finite gradients of a finite loss,
        # which DeepSpeed skips and counts in skipped_steps; a loss scale cannot bring a non-finite loss back).
        if skipped:
            state.nonfinite_in_a_row += 1
            state.metrics.count_nonfinite()
            if state.nonfinite_in_a_row >= cfg.max_nonfinite_steps:
                last = checkpoint.latest_tag(cfg.checkpoint_dir) or "none yet"
                raise UserError(
                    f"{state.nonfinite_in_a_row} non-finite losses in a row at step {step}; stopped. "
                    f"The last good checkpoint ({last}) is intact: lower --lr or check the data, then resume"
                )
        else:
            state.nonfinite_in_a_row = 0
        if step % cfg.log_steps == 0 or step == last_step:
            record = state.metrics.log(step)
            if state.rank == 0 and record:
                eta = (last_step - step) * (time.perf_counter() - started) / max(step - start_step, 1)
                print(_console_line(step, last_step, record, eta, hc=cfg.hc != "none") + console_fields(record),
                      flush=True)
        # No checkpoint inside a run of skipped steps: `latest` stays the last good one.
        saving = cfg.save_steps > 0 and (step % cfg.save_steps == 0 or step == last_step) \
            and not state.nonfinite_in_a_row
        # nor of diverged replicas: checked before every save too (a collective, under the step's limit)
        if check_replicas and (step % cfg.replica_check_steps == 0 or saving or stop_requested):
            with state.metrics.paused():  # (not training: left out of the throughput, as the eval and the save)
                replicas.check(engine, step, checkpoint.latest_tag(cfg.checkpoint_dir))
        # before the step's save; a stop leaves it to the resume
        if state.heldout is not None and state.heldout.due(step) and not stop_requested:
            _evaluate(state, engine, step, watchdog)
        if saving or stop_requested:
            if watchdog is not None:
                watchdog.started(step, SAVE)
            with state.metrics.paused():
                state.save(cfg, engine, step)
        if watchdog is not None:
            watchdog.ended()
        if stop_requested:
            if state.rank == 0:
                print(f"truneg: stopped by signal at step {step}; checkpoint saved in {cfg.checkpoint_dir}. "
                      "Run the same command to resume.", flush=True)
            return
    if state.rank == 0:
        elapsed = time.perf_counter() - started
        print(f"truneg: done, {engine.global_steps - start_step} steps in {elapsed:.0f} s\n"
              f"  checkpoints: {cfg.checkpoint_dir} (resume: run the same command)\n"
              f"  metrics:     {cfg.metrics_file}\n"
              f"  tensorboard: tensorboard --logdir {cfg.output_dir / MONITORS['tensorboard']}", flush=True)
        if cfg.compile:
            print(f"truneg: {compile_summary()}", flush=True)
