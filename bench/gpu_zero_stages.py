"""Where BERT-large's bf16 step time goes on one GPU: the same model and batch through truneg's DeepSpeed step
at ZeRO-0, 1 and 2, against a plain torch loop (bf16 weights, fused torch AdamW, no DeepSpeed) measured in
the same run. Prints samples/s and each one's ratio to the plain loop.

    python bench/gpu_zero_stages.py                 # on a GPU (bench/gpu_check.sh's wheel folder installed)
    python bench/gpu_zero_stages.py --host-bound    # ZeRO-1 as shipped, with DeepSpeed's bf16
                                                    # immediate_grad_update, and at micro-batch 128 x 2 and
                                                    # 256 x 1; the plain loop and ELECTRA-base at 256 x 1
                                                    # against 64 x 4: does less host work per sample (or
                                                    # overlapped) raise samples/s?
    python bench/gpu_zero_stages.py --profile       # BERT-large ZeRO-1, the plain loop and ELECTRA-base ZeRO-1
                                                    # under torch.profiler: the GPU's busy time in 2 steady
                                                    # steps and the top ops by GPU time (with OUT set, their
                                                    # traces go to $OUT/profile_*.json.gz)
    python bench/gpu_zero_stages.py --timer-only    # ZeRO-1 with DeepSpeed's throughput timer synchronized
                                                    # (DeepSpeed's default) and not (truneg's default)
    python bench/gpu_zero_stages.py --compile-only  # ZeRO-1 and the plain loop, each with/without torch.compile

Several modes named run in that order in one process (one start-up), each printing its RESULT line; a mode
that fails prints its traceback and the next one runs, and the exit status is 1.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_runs import DS_CONFIGS, patched, plain_step, read_records, start_memory_peak  # noqa: E402

MICRO, ACCUM = 64, 4
STEPS = 15 if len(sys.argv) == 1 else 25
LOG_STEPS = 5  # truneg's records: each the mean step of this many; the plain loop is timed the same way
PROFILED_STEPS = 2  # fewer events: the profiler's host work is smaller, and so is the trace
TRACE_LIMIT_BYTES = 15 * 2**20  # the device machine returns files up to 16 MiB


@contextlib.contextmanager
def profiled(label: str):
    """torch.profiler over PROFILED_STEPS steady optimizer steps (after 4 skipped and 1 warm-up): the caller calls
    `.step()` after each optimizer step. Prints how much of those steps' wall time the device was busy
    (the union of its kernels; a host-bound step leaves it idle) and the ops that took the most device time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities, schedule=schedule(wait=4, warmup=1, active=PROFILED_STEPS, repeat=1)) as prof:
        yield prof
    events = prof.events()
    # The steps' window on the host; on the device, kernels only: the profiler also puts its user annotations
    # there (a ProfilerStep spans a whole step's GPU work and would hide the idle gaps).
    steps = [e.time_range for e in events if e.name.startswith("ProfilerStep") and e.device_type == DeviceType.CPU]
    start, end = min(r.start for r in steps), max(r.end for r in steps)
    busy, reach = 0.0, start  # the union of the kernels' intervals inside the steps
    kernels = (e.time_range for e in events if e.device_type == DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False) and e.time_range.end > start)
    for r in sorted(kernels, key=lambda r: r.start):
        lo, hi = max(r.start, reach), min(r.end, end)
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    # The profiler's own host work slows the steps (+13-29 % on the CPU here): the busy milliseconds, set against
    # the unprofiled step time of the same run (256 samples / the RATE line's samples/s), say more than the share.
    per_step = (end - start) / PROFILED_STEPS / 1e3
    print(f"PROFILE {label}: device busy {busy / PROFILED_STEPS / 1e3:.1f} ms per step, {100 * busy / (end - start):.1f} % "
          f"of the {per_step:.1f} ms of a profiled step", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60),
          flush=True)
    if os.environ.get("OUT"):
        trace = Path(os.environ["OUT"]) / f"profile_{label}.json.gz"
        prof.export_chrome_trace(str(trace))
        if trace.stat().st_size > TRACE_LIMIT_BYTES:  # it would not come back from the device machine
            print(f"PROFILE {label}: trace of {trace.stat().st_size / 2**20:.0f} MiB left out", flush=True)
            trace.unlink()


@contextlib.contextmanager
def peak_memory(label: str):
    """Prints the GPU's peak allocated memory over the block: whether a larger micro-batch fits a 40 or 80 GB
    GPU is part of choosing it. What earlier runs in this process left is freed first, and what stays said."""
    held = start_memory_peak()
    yield
    peak = torch.cuda.max_memory_allocated()
    print(f"MEMORY {label}: peak {peak / 2**30:.1f} GiB, {(peak - held) / 2**30:.1f} GiB of it this run's "
          f"({held / 2**30:.1f} held before)", flush=True)


def deepspeed_rate(work: Path, stage: int = 1, *, model: str = "bert-large", micro: int = MICRO,
                   flags: tuple[str, ...] = (), edits: dict | None = None, label: str = "",
                   profile: bool = False) -> float:
    """truneg's step at a ZeRO stage: the shipped bf16 config of `model` with `edits` merged into its sections,
    `flags` added to the command line, at `micro` x as many micro-steps as make MICRO x ACCUM samples."""
    from truneg import pretrain
    from truneg.train import loop

    config = json.loads((DS_CONFIGS / f"{model.replace('-', '_')}_a100_bf16_zero1.json").read_text())
    # the shipped settings (overlap_comm, contiguous_gradients, 5e7 buckets) at another stage; until 2026-12-01 this
    # replaced the section, so the H200 figures of 2026-11-30 ran DeepSpeed's defaults for them
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": stage}
    if stage == 0:  # DeepSpeed refuses fp32 gradient accumulation with bf16 at stage 0
        config.pop("data_types", None)
    for section, values in (edits or {}).items():
        config[section] = {**config.get(section, {}), **values}
    name = f"{model}_zero{stage}_micro{micro}{label}{''.join(flags).replace('-', '_')}"
    path = work / f"{name}.json"
    path.write_text(json.dumps(config))
    out = work / name
    with contextlib.ExitStack() as stack:
        stack.enter_context(peak_memory(name))
        if profile:  # prof.step() after each of truneg's optimizer steps
            prof = stack.enter_context(profiled(f"{model}_zero{stage}"))
            real_step = loop.train_step

            def profiled_step(*args, **kwargs):
                result = real_step(*args, **kwargs)
                prof.step()
                return result

            stack.enter_context(patched(loop, "train_step", profiled_step))
        pretrain.main(["--model", model, "--deepspeed_config", str(path), "--micro-batch-size", str(micro),
                       "--gradient-accumulation-steps", str(MICRO * ACCUM // micro), "--max-steps", str(STEPS), "--log-steps", str(LOG_STEPS),
                       "--save-steps", "0", "--output-dir", str(out), "--overwrite", "--dropout", "0.1", *flags])
    records = read_records(out)
    rate = statistics.median(r["samples_per_sec"] for r in records[1:])
    print(f"RATE {name}{'_profiled' if profile else ''}: {rate:.1f} samples/s", flush=True)  # as it comes
    return rate


def plain_rate(compiled: bool = False, profile: bool = False, micro: int = MICRO) -> float:
    import numpy as np

    from truneg.data.blocks import load_tokenizer
    from truneg.data.masking import mask_tokens
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer

    tokenizer = load_tokenizer()
    accum = MICRO * ACCUM // micro  # the same samples per optimizer step at any micro-batch
    rows = np.random.default_rng(0).integers(1000, 30000, (micro, 128))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    intervals = []  # as truneg's records: the mean step of each LOG_STEPS, the median over those after the first
    # the peak counts this run's weights and batch as its own, as truneg's runs do (their engine is built inside)
    with peak_memory(f"plain_micro{micro}"):
        model = build_pretrainer("bert-large", ObjectiveConfig()).cuda().to(torch.bfloat16).train()
        if compiled:
            model.compile(dynamic=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        batch = {k: v.cuda() for k, v in mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id,
                                                      len(tokenizer), "bert", 0, 0, np.arange(micro), 20).items()}
        with (profiled("plain") if profile else contextlib.nullcontext()) as prof:
            for _ in range(STEPS // LOG_STEPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(LOG_STEPS):
                    plain_step(model, optimizer, batch, accum)
                    if prof is not None:
                        prof.step()
                torch.cuda.synchronize()
                intervals.append((time.perf_counter() - t0) / LOG_STEPS)
    del model, optimizer, batch
    torch.cuda.empty_cache()
    rate = micro * accum / statistics.median(intervals[1:])
    print(f"RATE plain_micro{micro}{'_compiled' if compiled else ''}{'_profiled' if profile else ''}: {rate:.1f} "
          "samples/s", flush=True)
    return rate


def timer_only(work: Path) -> str:
    """The cost of DeepSpeed's synchronized throughput timer (its default) against truneg's unsynchronized one."""
    synced = deepspeed_rate(work, edits={"timers": {"throughput": {"synchronized": True}}}, label="_synced")
    unsynced = deepspeed_rate(work)
    return f"zero1_unsynchronized_timer_speedup={unsynced / synced:.3f} unsynchronized={unsynced:.1f}"


def profile_only(work: Path) -> str:
    """Where the device idles: ZeRO-1 against the plain loop, and ELECTRA-base."""
    zero1, plain = deepspeed_rate(work, profile=True), plain_rate(profile=True)
    electra = deepspeed_rate(work, model="electra-base", profile=True)
    return f"profiled bert_large_zero1={zero1:.1f} plain={plain:.1f} electra_base_zero1={electra:.1f} (samples/s)"


def compile_only(work: Path) -> str:
    """ZeRO-1 and the plain loop, each with and without torch.compile."""
    rates = {flags: deepspeed_rate(work, flags=flags) for flags in ((), ("--compile",))}
    plain = {compiled: plain_rate(compiled) for compiled in (False, True)}
    return (f"zero1_compile_speedup={rates[('--compile',)] / rates[()]:.3f} "
            f"plain_compile_speedup={plain[True] / plain[False]:.3f}")


def host_bound(work: Path) -> str:
    """If the step is bound by the host's work (launching kernels, and BF16_Optimizer's per-parameter casts and
    adds after each backward and its clipping), overlapping the per-parameter work with the backward, or more
    samples per micro-step (the same 256 a step), raises samples/s. bench/host_floor.py measures that floor on
    the CPU: at micro 64 x 4 it came to 0.5-0.9 of the step times the H200 measured."""
    shipped = deepspeed_rate(work)
    # BF16_Optimizer adds each bf16 gradient into its fp32 one from a backward hook, overlapped with the backward
    immediate = deepspeed_rate(work, edits={"bf16": {"immediate_grad_update": True}}, label="_immediate")
    larger = {micro: deepspeed_rate(work, micro=micro) for micro in (2 * MICRO, 4 * MICRO)}
    plain = {micro: plain_rate(micro=micro) for micro in (MICRO, 4 * MICRO)}  # the ceiling without DeepSpeed
    electra = {micro: deepspeed_rate(work, model="electra-base", micro=micro) for micro in (MICRO, 4 * MICRO)}
    return (f"zero1_immediate_grad_update_speedup={immediate / shipped:.3f} "
            + " ".join(f"zero1_micro{m}_speedup={r / shipped:.3f}" for m, r in larger.items())
            + f" plain_micro{4 * MICRO}_speedup={plain[4 * MICRO] / plain[MICRO]:.3f}"
            + f" electra_base_micro{4 * MICRO}_speedup={electra[4 * MICRO] / electra[MICRO]:.3f}"
            + f" shipped={shipped:.1f} zero1_micro{4 * MICRO}={larger[4 * MICRO]:.1f}"
            + f" plain_micro{4 * MICRO}={plain[4 * MICRO]:.1f} (samples/s)")


def zero_stages(work: Path) -> str:
    plain = plain_rate()
    print(f"plain torch bf16 loop: {plain:.1f} samples/s", flush=True)
    rates = {}
    for stage in (0, 1, 2):
        rates[stage] = deepspeed_rate(work, stage)
        print(f"truneg + DeepSpeed ZeRO-{stage}: {rates[stage]:.1f} samples/s ({rates[stage] / plain:.2f}x the plain loop)",
              flush=True)
    return " ".join(f"zero{s}_rate_vs_plain={r / plain:.3f}" for s, r in rates.items()) + f" plain={plain:.1f}"


# In this order when several are named: the likeliest lever first, so a short booking measures it.
MODES = {"--host-bound": host_bound, "--profile": profile_only, "--timer-only": timer_only,
         "--compile-only": compile_only}


def main() -> None:
    """The modes named on the command line, in this order, in one process (one start-up for all); a mode that
    fails prints its traceback and the next one runs; exit status 1 if any failed. None named: the ZeRO-stage
    comparison."""
    work = Path(tempfile.mkdtemp(prefix="zero_stages_"))
    chosen = [run for flag, run in MODES.items() if flag in sys.argv] or [zero_stages]
    failed = []
    for run in chosen:
        try:
            print(f"RESULT {run(work)}", flush=True)
        except (Exception, SystemExit):  # pretrain's one-line errors exit: the next mode still runs
            traceback.print_exc()
            print(f"RESULT {run.__name__} failed", flush=True)
            failed.append(run.__name__)
    if failed:  # gpu_check.sh's stage 5 then says FAIL, not PASS
        sys.exit(1)


if __name__ == "__main__":
    main()
