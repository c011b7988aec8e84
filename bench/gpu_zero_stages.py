"""Where BERT-large's bf16 step time goes on one GPU: the same model and batch through truneg's DeepSpeed step
at ZeRO-0, 1 and 2, against a plain torch loop (bf16 weights, fused torch AdamW, no DeepSpeed) measured in
the same run. Prints samples/s and each one's ratio to the plain loop.

    python bench/gpu_zero_stages.py                 # on a GPU (bench/gpu_check.sh's wheel folder installed)
    python bench/gpu_zero_stages.py --immediate     # ZeRO-1 as shipped against DeepSpeed's bf16
                                                    # immediate_grad_update (its per-parameter casts and adds
                                                    # overlapped with the backward)
    python bench/gpu_zero_stages.py --timer-only    # ZeRO-1 with DeepSpeed's throughput timer synchronized
                                                    # (DeepSpeed's default) and not (truneg's default)

The micro-batch sweeps, the GPU's busy share and `--compile` are bench/gpu_mfu.py's (the one GPU call).

Several modes named run in that order in one process (one start-up), each printing its RESULT line; a mode
that fails prints its traceback and the next one runs, and the exit status is 1.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.gpu_runs import DS_CONFIGS, plain_step, read_records, start_memory_peak  # noqa: E402

MICRO, ACCUM = 64, 4
STEPS = 15 if len(sys.argv) == 1 else 25
LOG_STEPS = 5  # truneg's records: each the mean step of this many; the plain loop is timed the same way


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
                   flags: tuple[str, ...] = (), edits: dict | None = None, label: str = "") -> float:
    """truneg's step at a ZeRO stage: the shipped bf16 config of `model` with `edits` merged into its sections,
    `flags` added to the command line, at `micro` x as many micro-steps as make MICRO x ACCUM samples."""
    from truneg import pretrain

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
    held = start_memory_peak()
    pretrain.main(["--model", model, "--deepspeed_config", str(path), "--micro-batch-size", str(micro),
                   "--gradient-accumulation-steps", str(MICRO * ACCUM // micro), "--max-steps", str(STEPS),
                   "--log-steps", str(LOG_STEPS),
                   "--save-steps", "0", "--output-dir", str(out), "--overwrite", "--dropout", "0.1", *flags])
    records = read_records(out)
    peak = max(r["memory_max_allocated_gib"] for r in records)  # the run's own, reset at each log step
    print(f"MEMORY {name}: peak {peak:.1f} GiB ({held / 2**30:.1f} held before)", flush=True)
    rate = statistics.median(r["samples_per_sec"] for r in records[1:])
    print(f"RATE {name}: {rate:.1f} samples/s", flush=True)  # as it comes
    return rate


def plain_rate(micro: int = MICRO) -> float:
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
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        batch = {k: v.cuda() for k, v in mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id,
                                                      len(tokenizer), "bert", 0, 0, np.arange(micro), 20).items()}
        for _ in range(STEPS // LOG_STEPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(LOG_STEPS):
                plain_step(model, optimizer, batch, accum)
            torch.cuda.synchronize()
            intervals.append((time.perf_counter() - t0) / LOG_STEPS)
    del model, optimizer, batch
    torch.cuda.empty_cache()
    rate = micro * accum / statistics.median(intervals[1:])
    print(f"RATE plain_micro{micro}: {rate:.1f} samples/s", flush=True)
    return rate


def timer_only(work: Path) -> str:
    """The cost of DeepSpeed's synchronized throughput timer (its default) against truneg's unsynchronized one."""
    synced = deepspeed_rate(work, edits={"timers": {"throughput": {"synchronized": True}}}, label="_synced")
    unsynced = deepspeed_rate(work)
    return f"zero1_unsynchronized_timer_speedup={unsynced / synced:.3f} unsynchronized={unsynced:.1f}"


def immediate(work: Path) -> str:
    """BF16_Optimizer adds each bf16 gradient into its fp32 one after every micro-step's backward; with
    `immediate_grad_update` it does so from backward hooks, overlapped with the backward (the same work)."""
    shipped = deepspeed_rate(work)
    overlapped = deepspeed_rate(work, edits={"bf16": {"immediate_grad_update": True}}, label="_immediate")
    return f"zero1_immediate_grad_update_speedup={overlapped / shipped:.3f} shipped={shipped:.1f} (samples/s)"


def zero_stages(work: Path) -> str:
    plain = plain_rate()
    print(f"plain torch bf16 loop: {plain:.1f} samples/s", flush=True)
    rates = {}
    for stage in (0, 1, 2):
        rates[stage] = deepspeed_rate(work, stage)
        print(f"truneg + DeepSpeed ZeRO-{stage}: {rates[stage]:.1f} samples/s ({rates[stage] / plain:.2f}x the plain "
              "loop)",
              flush=True)
    return " ".join(f"zero{s}_rate_vs_plain={r / plain:.3f}" for s, r in rates.items()) + f" plain={plain:.1f}"


# In this order when several are named.
MODES = {"--immediate": immediate, "--timer-only": timer_only}


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
