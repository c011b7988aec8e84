"""Stages 3 and 4 of bench/gpu_check.sh, inside the training step: host syncs per phase, and throughput
(samples/s, MFU, peak memory) of BERT-large and ELECTRA-base."""
from __future__ import annotations

import contextlib
import functools
import statistics
import time
import traceback
from collections import Counter
from pathlib import Path

from bench.lib.gpu_runs import (
    DS_CONFIGS,
    Mode,
    Summary,
    common_args,
    config_for,
    config_split,
    patched,
    run_pretrain,
    start_memory_peak,
)


class SyncCounter:
    """Host syncs per phase. Implicit ones on CUDA: torch.cuda.set_sync_debug_mode("warn") and the warnings it
    raises; on the CPU (dry run), a proxy: the ATen ops that make the host wait for the device (item, nonzero,
    masked_select, boolean indexing, ...), seen by a TorchDispatchMode. Explicit ones, which the debug mode
    does not report, in both: calls of the accelerator's and torch.cuda's synchronize (DeepSpeed's
    synchronized throughput timer makes two per micro-step)."""

    def __init__(self, cuda: bool):
        self.cuda, self.counts, self.where = cuda, {}, {}

    @contextlib.contextmanager
    def phase(self, name: str):
        import torch

        sites: Counter = Counter()
        if self.cuda:
            import warnings

            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught, _explicit_syncs(sites):
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            for w in caught:
                if "synchroniz" in str(w.message):
                    sites[f"{_short(w.filename)}:{w.lineno}"] += 1
        else:
            with _CpuSyncOps(sites), _explicit_syncs(sites):
                yield
        self.counts[name], self.where[name] = sum(sites.values()), sites


@contextlib.contextmanager
def _explicit_syncs(sites: Counter):
    """Count calls of get_accelerator().synchronize and torch.cuda.synchronize (one per call, by its caller)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    inside = []

    def counting(real):
        @functools.wraps(real)
        def synchronize(*args, **kwargs):
            if not inside:  # the accelerator's calls torch.cuda's: one sync
                frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                              if "/accelerator/" not in f.filename and "/torch/cuda/" not in f.filename), None)
                sites[f"synchronize at {_short(frame.filename)}:{frame.lineno}" if frame else "synchronize"] += 1
            inside.append(1)
            try:
                return real(*args, **kwargs)
            finally:
                inside.pop()
        return synchronize

    accelerator = get_accelerator()
    with patched(accelerator, "synchronize", counting(accelerator.synchronize)), \
            patched(torch.cuda, "synchronize", counting(torch.cuda.synchronize)):
        yield


def _short(filename: str) -> str:
    parts = Path(filename).parts
    for anchor in ("truneg", "deepspeed", "transformers", "torch"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor) - 1:])
    return Path(filename).name


class _CpuSyncOps:
    def __init__(self, sites: Counter):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        aten = torch.ops.aten
        syncing = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
                   aten._unique2, aten.unique_consecutive, aten.unique_dim, aten.repeat_interleave}
        indexing = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                packet = func.overloadpacket
                bool_index = packet in indexing and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
                if packet in syncing or bool_index:
                    frame = next((f for f in reversed(traceback.extract_stack()[:-1])
                                  if "/torch/" not in f.filename and not f.filename.endswith("gpu_step.py")), None)
                    sites[f"{packet.__name__} at {_short(frame.filename)}:{frame.lineno}" if frame
                          else packet.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __enter__(self):
        return self.mode.__enter__()

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def stage_syncs(mode: Mode, note: Summary, work: Path) -> bool:
    """Stage 3: one BERT-large HC+SR step (bf16 ZeRO-1), host syncs counted per phase; the goal is 0 in the
    forward and the backward. The real loop's set-up (truneg.pretrain.main) with the loop replaced."""
    import torch

    from truneg.train import loop

    shipped = DS_CONFIGS / "bert_large_a100_bf16_zero1.json"
    model = mode.preset("bert", large=True)
    argv = common_args(mode, model, config_for(shipped, mode, work), mode.sync_micro, 1)
    argv += ["--max-steps", "10", "--save-steps", "0", "--hc", "wordnet", "--sr", "word", "--overwrite"]
    counter = SyncCounter(cuda=not mode.dry_run)

    def measure(cfg, engine, state) -> None:
        stop, guard = loop.StopSignal(), loop.SkipGuard(engine)
        for _ in range(2):  # warm-up: allocator, library handles, lazy initialisation
            loop.train_step(engine, state, stop, guard, set())
        with counter.phase("input copy"):  # the next micro-batch, copied to the device
            batch = next(state.batches)
        with counter.phase("forward"):
            loss, stats = engine(**batch)
        with counter.phase("metrics"):
            state.metrics.add(stats, loss, torch.isfinite(loss.detach()), engine.train_micro_batch_size_per_gpu())
        with counter.phase("backward"):
            engine.backward(loss)
        with counter.phase("optimizer step"):
            engine.step()
        with counter.phase("whole train_step"):
            loop.train_step(engine, state, stop, guard, set())

    with patched(loop, "train", measure):
        run = run_pretrain(argv, work / "stage3")
    if not run.ok or "whole train_step" not in counter.counts:
        note(f"  syncs: FAIL {run.error or 'the step did not run'}")
        return False
    how = "torch.cuda.set_sync_debug_mode" if counter.cuda else "CPU proxy: ATen ops that wait on the device"
    note(f"  syncs ({model} HC+SR, {run.engine['precision']} ZeRO-{run.engine['zero']}, micro {mode.sync_micro}; "
         f"{how}): "
         + ", ".join(f"{name} {n}" for name, n in counter.counts.items()))
    for name, sites in counter.where.items():
        if sites:
            note(f"    {name}: " + "; ".join(f"{site} x{n}" for site, n in sites.most_common(4)))
    ok = counter.counts["forward"] == 0 and counter.counts["backward"] == 0
    note(f"  syncs: {'PASS' if ok else 'FAIL'} forward {counter.counts['forward']}, backward "
         f"{counter.counts['backward']} (goal 0)")
    return ok


def measure_gemm(cuda: bool) -> float:
    """TFLOP/s of a large bf16 GEMM (CUDA, random data, events, median of 20) or of an fp32 one on the CPU."""
    import torch

    n = 8192 if cuda else 512
    dtype, device = (torch.bfloat16, "cuda") if cuda else (torch.float32, "cpu")
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    times = []
    for i in range(23):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            a @ b
            seconds = time.perf_counter() - t0
        if i >= 3:
            times.append(seconds)
    return 2 * n**3 / statistics.median(times) / 1e12


BENCH_VARIANTS = [  # (name, family, config, HC+SR, --compile); in this order, so a timeout cuts the least needed
    ("bert zero1 baseline", "bert", "bert_large_a100_bf16_zero1.json", False, False),
    ("bert zero1 hc+sr", "bert", "bert_large_a100_bf16_zero1.json", True, False),
    ("electra zero1 baseline", "electra", "electra_base_a100_bf16_zero1.json", False, False),
    ("electra zero1 hc+sr", "electra", "electra_base_a100_bf16_zero1.json", True, False),
    ("bert zero3 baseline", "bert", "bert_large_a100_bf16_zero3.json", False, False),
    ("bert zero3 hc+sr", "bert", "bert_large_a100_bf16_zero3.json", True, False),
    # measured twice already (0.96x, 0.92x), and its compile takes about 85 s before the first interval: last
    ("bert zero1 hc+sr compile", "bert", "bert_large_a100_bf16_zero1.json", True, True),
]


def stage_throughput(mode: Mode, note: Summary, work: Path) -> bool:
    """Stage 4: samples/s, MFU and peak memory of BERT-large and ELECTRA-base at seq 128 in bf16."""
    import torch

    cuda = not mode.dry_run
    gemm = measure_gemm(cuda)
    from truneg.train.observe.flops import dense_peak_tflops

    name = torch.cuda.get_device_name() if cuda else "CPU"
    note(f"  GEMM: {gemm:.3g} TFLOP/s ({'bf16 8192^3' if cuda else 'fp32 512^3'}); dense bf16 peak of {name}: "
         f"{(dense_peak_tflops(name, 'bf16') if cuda else None) or 'n/a'}")
    if mode.dry_run:
        from deepspeed.runtime.engine import DeepSpeedEngine

        real_compile = DeepSpeedEngine.compile
        # Dynamo with the eager backend: the graph capture is checked, Inductor's minutes of C++ are not paid.
        DeepSpeedEngine.compile = lambda self, backend=None, **kw: real_compile(self, backend="eager", **kw)
        from truneg.model import compile as model_compile

        model_compile.BACKEND = "eager"  # --compile's default mode, layers
    rates: dict[str, float] = {}
    all_ok = True
    for variant, family, config_name, hc_sr, compiled in BENCH_VARIANTS:
        shipped = DS_CONFIGS / config_name
        config = config_for(shipped, mode, work)
        model = mode.preset(family, large=True)
        micro = mode.bench_micro or config_split(config)[1]
        argv = common_args(mode, model, config, micro, mode.bench_accum)
        argv += ["--max-steps", str(mode.bench_steps), "--log-steps", str(mode.bench_log), "--save-steps", "0",
                 "--overwrite"]
        argv += ["--hc", "wordnet", "--sr", "word"] if hc_sr else []
        argv += ["--compile"] if compiled else []
        held = start_memory_peak(cuda)  # what earlier variants left is freed where it can be, and said where it cannot
        run = run_pretrain(argv, work / "stage4" / variant.replace(" ", "_").replace("+", ""))
        timed = [r["samples_per_sec"] for r in run.records[1:]]  # the first interval holds warm-up and compile
        if not run.ok or not timed:
            all_ok = False
            note(f"  {variant}: FAIL {run.error or 'no timed interval'}")
            continue
        rate = rates[variant] = statistics.median(timed)
        first_s = run.records[0]["samples"] / run.records[0]["samples_per_sec"]
        # the run's own peaks (each interval's, reset at every log step): the largest over its records
        peak_gib = max(r["memory_max_allocated_gib" if cuda else "memory_max_rss_gib"] for r in run.records)
        memory = (f"peak {peak_gib:.1f} GiB ({held / 2**30:.1f} held before)" if cuda
                  else f"process peak RSS {peak_gib:.1f} GiB")
        per_sample = tflops_per_sample(model, mode.seq_len)
        peak = dense_peak_tflops(name, run.engine["precision"]) if cuda else None  # the run's precision
        mfu = f"MFU {rate * per_sample / peak:.1%} of {peak:g}, " if peak else "MFU "
        mfu += f"{rate * per_sample / gemm:.1%} of the GEMM ({per_sample:.3g} TFLOPs a sample)"
        note(f"  {variant}: {model} seq {mode.seq_len} micro {micro} x {mode.bench_accum}, {run.engine['precision']} "
             f"ZeRO-{run.engine['zero']} {run.engine['optimizer']}: {rate:.1f} samples/s; {mfu}; {memory}; "
             f"first {mode.bench_log} steps {first_s:.1f} s")
        base = variant.replace(" hc+sr", " baseline").replace(" compile", "")
        if compiled:
            from truneg.train.loop import compile_summary

            note(f"    {compile_summary()}")
        if variant.endswith("compile") and variant.replace(" compile", "") in rates:
            note(f"    --compile speed-up: {rate / rates[variant.replace(' compile', '')]:.3f}x")
        elif "hc+sr" in variant and base in rates:
            note(f"    HC+SR step time / baseline: {rates[base] / rate:.3f} (goal <= 1.01)")
    return all_ok


def tflops_per_sample(preset: str, seq_len: int) -> float:
    """Training TFLOPs per sample at the run's default --max-predictions: truneg's one formula
    (truneg.train.observe.flops, checked against DeepSpeed's flops profiler by tests/train/test_efficiency.py;
    tolerance: docs/pretraining.md)."""
    from truneg.train.observe.flops import preset_train_flops

    return preset_train_flops(preset, seq_len) / 1e12

