"""--activation-checkpointing's memory and step time against the same step without it, side by side on this CPU:
BERT-base's training step (forward, backward, AdamW) at seq 512, each variant in a fresh process (its peak RSS is
its own), taking turns. The activations saved for the backward are counted too (torch's saved-tensor hooks; a
weight the backward keeps is not counted): what a GPU's memory would hold of them.

    python bench/activation_checkpointing.py [--preset bert-base] [--seq-len 512] [--micro-batch 4] [--steps 3]
        [--rounds 2]
RESULT saved_ratio=<with / without> rss_ratio=<with / without> step_ratio=<with / without>
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(preset: str, seq_len: int, micro: int, steps: int, checkpointing: bool) -> None:
    """One variant in this process: the saved activations of one step, then `steps` steps timed after one untimed."""
    sys.path.insert(0, str(REPO))
    import torch

    from bench.lib.masked_batch import real_batch
    from truneg.data.blocks import load_tokenizer
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer, checkpoint_activations

    torch.manual_seed(0)
    model = build_pretrainer(preset, ObjectiveConfig()).train()
    if checkpointing:
        checkpoint_activations(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = real_batch(load_tokenizer(), micro, seq_len, model.scheme)
    weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, []

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            saved.append(tensor.numel() * tensor.element_size())
        return tensor

    times = []
    for step in range(steps + 1):
        started = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack if step == 0 else (lambda t: t), lambda t: t):
            loss, _ = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - started)
    print(json.dumps({"saved_mib": sum(saved) / 2**20, "step_s": statistics.median(times)}))


def run(args: argparse.Namespace, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--worker", *(["--checkpointing"] if checkpointing else []), "--preset",
           args.preset, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--steps",
           str(args.steps)]
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")})
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the {'checkpointed' if checkpointing else 'plain'} step failed")
    return {**json.loads(out.strip().splitlines()[-1]), "rss_mib": usage.ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bert-base")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.preset, args.seq_len, args.micro_batch, args.steps, args.checkpointing)
        return
    results = {False: [], True: []}
    for _ in range(args.rounds):  # taking turns, so that a slow minute slows both
        for checkpointing in (False, True):
            results[checkpointing].append(run(args, checkpointing))
    figures = {}
    for checkpointing, runs in results.items():
        name = "checkpointed" if checkpointing else "plain"
        figures[checkpointing] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        f = figures[checkpointing]
        print(f"{name}: {args.preset} seq {args.seq_len} micro-batch {args.micro_batch}: saved activations "
              f"{f['saved_mib']:.0f} MiB, peak RSS {f['rss_mib']:.0f} MiB, step {f['step_s']:.2f} s (median of "
              f"{args.rounds} x {args.steps} steps)")
    on, off = figures[True], figures[False]
    print(f"RESULT saved_ratio={on['saved_mib'] / off['saved_mib']:.3f} rss_ratio={on['rss_mib'] / off['rss_mib']:.3f} "
          f"step_ratio={on['step_s'] / off['step_s']:.3f}")


if __name__ == "__main__":
    main()
