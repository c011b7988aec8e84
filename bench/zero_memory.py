"""ZeRO stages 0-3 with 2 CPU ranks: step time, peak memory and per-rank model-state memory.

    python bench/zero_memory.py [--preset bert-base] [--steps 4]

For each stage it launches `deepspeed --num_gpus 2` on this file in worker mode (the real launcher and
engine, AdamW, fp32, micro batch 2, seq 128). Each rank reports, in MiB, its parameter bytes (its ZeRO-3
partition, or the whole model), its optimizer bytes (Adam moments plus ZeRO-1/2's fp32 master partition;
at ZeRO-3 in fp32 the master partition is the parameter partition itself, counted once, as a parameter),
its peak RSS and the median step time. Gradients are not counted, so ZeRO-2's partitioning of them does
not show. Last line:
RESULT zero3_over_zero0_model_states=<ratio> (per-rank parameter + optimizer bytes, ZeRO-3 / ZeRO-0)
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if hasattr(t, "numel"))


def model_state_bytes(engine) -> tuple[int, int]:
    params = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch optimizer
    moments = [v for state in base.state.values() for v in state.values() if hasattr(v, "numel") and v.dim() > 0]
    master = [p for g in base.param_groups for p in g["params"]] if base is not engine.optimizer else []
    return tensor_bytes(params), tensor_bytes(moments) + tensor_bytes(master)


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from bench.lib.masked_batch import real_batch
    from truneg.data.blocks import load_tokenizer
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
    from truneg.train.config.ds_config import DS_CONFIGS, resolve
    from truneg.train.ranks.distributed import init_distributed

    init_distributed()
    config, _ = resolve(DS_CONFIGS / "cpu_zero2.json", dist.get_world_size(), 100, Path(args.out),
                        micro_batch=2, grad_accum=1)
    config["zero_optimization"] = {"stage": args.stage}
    config.pop("tensorboard", None)
    torch.manual_seed(0)
    model = build_pretrainer(args.preset, ObjectiveConfig())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    batch = real_batch(load_tokenizer(), 2, 128, model.scheme)
    times = []
    for step in range(args.steps + 1):
        start = time.perf_counter()
        loss, _ = engine(**batch)
        engine.backward(loss)
        engine.step()
        if step:
            times.append(time.perf_counter() - start)
    params, optimizer = model_state_bytes(engine)
    record = {"stage": args.stage, "rank": dist.get_rank(), "params_mb": params / 2**20,
              "optimizer_mb": optimizer / 2**20,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "step_ms": 1e3 * statistics.median(times)}
    with open(Path(args.out) / f"stage{args.stage}_rank{dist.get_rank()}.json", "w") as fh:
        json.dump(record, fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    deepspeed_bin = Path(sys.executable).parent / "deepspeed"
    with tempfile.TemporaryDirectory() as out:
        for stage in range(4):
            subprocess.run([str(deepspeed_bin), "--num_gpus", "2", __file__, "--worker", "--stage", str(stage),
                            "--preset", args.preset, "--steps", str(args.steps), "--out", out],
                           env=env, check=True, capture_output=True, cwd=REPO)
        records = [json.loads(p.read_text()) for p in sorted(Path(out).glob("stage*_rank*.json"))]
    print(f"{args.preset}, 2 CPU ranks, fp32, AdamW, micro batch 2, seq 128; per rank (rank 0 / rank 1 max)")
    print(f"{'stage':<6} {'params MiB':>10} {'optim MiB':>10} {'states MiB':>10} {'peak RSS MiB':>12} {'step ms':>9}")
    states = {}
    for stage in range(4):
        rows = [r for r in records if r["stage"] == stage]
        worst = {k: max(r[k] for r in rows) for k in ("params_mb", "optimizer_mb", "peak_rss_mb", "step_ms")}
        states[stage] = worst["params_mb"] + worst["optimizer_mb"]
        print(f"{stage:<6} {worst['params_mb']:>10.0f} {worst['optimizer_mb']:>10.0f} {states[stage]:>10.0f} "
              f"{worst['peak_rss_mb']:>12.0f} {worst['step_ms']:>9.0f}")
    print(f"RESULT zero3_over_zero0_model_states={states[3] / states[0]:.3f}")


if __name__ == "__main__":
    main()
