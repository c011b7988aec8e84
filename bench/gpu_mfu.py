"""The one GPU call: how far BERT-large and ELECTRA-base are from 50 % MFU on one GPU, and why.

    OUT=$OUT python bench/gpu_mfu.py            # on the GPU machine, bench/gather_wheels.sh's folder installed
    python bench/gpu_mfu.py --cpu-dry-run       # every stage once, with tiny models on the CPU (tests/test_gpu_mfu.py)

Stages, in this order (so that a cut run still answers the first questions), each variant in its own process
under its own timeout (at most VARIANT_LIMIT_S) inside BUDGET_S (540 s), a JSON line appended to
$OUT/gpu_mfu.jsonl as each ends:
  1. ceilings: bf16 GEMMs at BERT-large's shapes (micro 256 x seq 128 tokens), SDPA forward + backward, and one
     tiny kernel's launch cost, eager against CUDA-graph replay (no DeepSpeed);
  2. truneg/pretrain.py itself under DeepSpeed ZeRO-1 with the shipped recipe (its micro-batch by the GPU's
     memory), `--compile` (layers) off and on, HC+SR off and on;
  3. a plain eager loop (bf16 weights, fused torch AdamW, no DeepSpeed) at 64 x 4, 128 x 2 and 256 x 1, the GPU's
     busy share of the step from torch.profiler;
  4. the same loop with `--compile layers` at 256 x 1 and 64 x 4, graph breaks and recompiles counted;
  5. CUDA graphs (the layers compiled with Inductor's "reduce-overhead") at 64 x 4, its first loss against eager's
     (dropout 0: CUDA graphs' dropout draws are Inductor's own);
  6. ELECTRA-base through pretrain.py at seq 128 and at its recipe's seq 512.
Samples/s as truneg records them (the median of the logged intervals after the first; the plain loop's timed the
same way), MFU against the GPU's dense bf16 peak (truneg.train.observe.flops: 989 TFLOP/s on an H100 SXM or an
H200) with truneg's FLOPs per sample, the formula behind the runs' own `tflops` and `mfu`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.lib.gpu_runs import CORPUS, DS_CONFIGS, cpu_substitute, patched, plain_step, run_pretrain  # noqa: E402
from bench.lib.gpu_step import tflops_per_sample  # noqa: E402

BUDGET_S = int(os.environ.get("BUDGET_S", 540))
VARIANT_LIMIT_S = 150  # one variant's most (a compile of BERT-large's parts takes about a minute): a hung one
# leaves the others their time
STEPS, LOG = 15, 5  # the plain loops: the median of LOG-step intervals after the first
PRETRAIN_STEPS = 3  # pretrain.py at the recipe's global batch (8192 for BERT-large): 32 micro-steps a step at 256


def _tiny(dry: bool, preset: str) -> str:
    return {"bert-large": "bert-tiny", "electra-base": "electra-tiny"}[preset] if dry else preset


def _sync(dry: bool) -> None:
    if not dry:
        import torch

        torch.cuda.synchronize()


def _timed(fn, dry: bool, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls after 3 warm ones."""
    times = []
    for i in range(repeats + 3):
        _sync(dry)
        t0 = time.perf_counter()
        fn()
        _sync(dry)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ceiling_gemm(dry: bool) -> dict:
    import torch

    tokens, hidden = (64, 64) if dry else (256 * 128, 1024)
    dtype, device = (torch.float32, "cpu") if dry else (torch.bfloat16, "cuda")
    result = {}
    for name, (k, n) in {"qkv": (hidden, 3 * hidden), "ffn_up": (hidden, 4 * hidden),
                         "ffn_down": (4 * hidden, hidden)}.items():
        a, b = torch.randn(tokens, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        result[f"{name}_tflops"] = round(2 * tokens * k * n / _timed(lambda a=a, b=b: a @ b, dry, 10) / 1e12, 2)
    return result


def ceiling_sdpa(dry: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from truneg.train.observe.flops import TRAINING_FACTOR, attention_flops

    batch, heads, seq, dim = (2, 2, 32, 32) if dry else (256, 16, 128, 64)
    dtype, device = (torch.float32, "cpu") if dry else (torch.bfloat16, "cuda")
    q, k, v = (torch.randn(batch, heads, seq, dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))

    def step():
        F.scaled_dot_product_attention(q, k, v).sum().backward()

    # model FLOPs, as MFU counts them: 3x the forward's products (a flash backward's recompute is not counted)
    flops = TRAINING_FACTOR * batch * attention_flops(seq, heads * dim)
    return {"sdpa_fwd_bwd_tflops": round(flops / _timed(step, dry, 10) / 1e12, 2)}


def ceiling_launch(dry: bool) -> dict:
    """One tiny kernel's host cost: eager launches against a CUDA graph's replay of the same 1,000."""
    import torch

    x = torch.zeros(1, device="cpu" if dry else "cuda")
    n = 1000

    def eager():
        for _ in range(n):
            x.add_(1)

    result = {"eager_us_per_kernel": round(1e6 * _timed(eager, dry, 5) / n, 2)}
    if dry:
        return {**result, "graph_us_per_kernel": None}  # no CUDA graphs on the CPU
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        eager()  # warm on a side stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        eager()
    return {**result, "graph_us_per_kernel": round(1e6 * _timed(graph.replay, dry, 5) / n, 3)}


def _mfu(rate: float, preset: str, seq: int, dry: bool) -> float | None:
    if dry:  # tiny models: no MFU to speak of
        return None
    import torch

    from truneg.train.observe.flops import dense_peak_tflops

    peak = dense_peak_tflops(torch.cuda.get_device_name(), "bf16")
    return None if peak is None else round(rate * tflops_per_sample(preset, seq) / peak, 4)


def pretrain_variant(dry: bool, preset: str, seq: int, compiled: bool, hc_sr: bool) -> dict:
    """truneg/pretrain.py's own step (in this process), the shipped recipe of `preset` as the start-up picks it."""
    from truneg.model import compile as model_compile

    work = Path(tempfile.mkdtemp(prefix="gpu_mfu_"))
    model = _tiny(dry, preset)
    argv = ["--model", model, "--seq-len", str(32 if dry else seq), "--max-steps", str(PRETRAIN_STEPS),
            "--log-steps", "1", "--save-steps", "0", "--overwrite", "--train-data", str(CORPUS)]
    if dry:  # the recipe made fp32 with torch AdamW, at 2 x 2
        config = work / "config.json"
        stem = "bert_large" if preset == "bert-large" else "electra_base"
        config.write_text(json.dumps(cpu_substitute(json.loads((DS_CONFIGS / f"{stem}_a100_bf16_zero1.json")
                                                                 .read_text()))))
        argv += ["--deepspeed_config", str(config), "--micro-batch-size", "2", "--gradient-accumulation-steps", "2"]
    argv += ["--compile"] if compiled else []
    argv += ["--hc", "wordnet", "--sr", "word"] if hc_sr else []
    with patched(model_compile, "BACKEND", "eager" if dry else model_compile.BACKEND):
        run = run_pretrain(argv, work / "run")
    if not run.ok:
        raise RuntimeError(run.error)
    rate = statistics.median(r["samples_per_sec"] for r in run.records[1:])
    first = run.records[0]
    return {"model": model, "samples_per_s": round(rate, 1), "mfu": _mfu(rate, preset, seq, dry), **run.engine,
            "samples_per_step": first["samples"], "first_step_s": round(first["samples"] / first["samples_per_sec"], 1)}


@contextlib.contextmanager
def _busy_share(dry: bool, out: dict):
    """The GPU's busy share of the profiled steps (the union of its kernels over the steps' wall time)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if dry else [ProfilerActivity.CUDA])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter_ns() // 1000
        yield
        _sync(dry)
        wall = time.perf_counter_ns() // 1000 - t0
    busy, reach = 0, 0
    kernels = sorted((e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA
                      and not getattr(e, "is_user_annotation", False)), key=lambda r: r.start)
    for r in kernels:
        lo = max(r.start, reach)
        if r.end > lo:
            busy, reach = busy + r.end - lo, r.end
    out["gpu_busy_share"] = None if dry else round(busy / max(wall, 1), 3)
    out["host_ops_profiled"] = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def plain_variant(dry: bool, micro: int, accum: int, compiled: str | None = None, profile: bool = False,
                  preset: str = "bert-large") -> dict:
    """The plain loop: bf16 weights, fused AdamW, one masked batch, `micro` x `accum` a step; `compiled`: None,
    "layers" or "graphs" (the layers with Inductor's reduce-overhead, CUDA graphs)."""
    import numpy as np
    import torch
    from torch._dynamo.utils import counters

    from truneg.data.blocks import load_tokenizer
    from truneg.data.masking import default_max_predictions, mask_tokens
    from truneg.model.compile import compile_layers
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer

    seq, device = (32, "cpu") if dry else (128, "cuda")
    micro = max(1, micro // 32) if dry else micro
    tokenizer = load_tokenizer()
    rows = np.random.default_rng(0).integers(1000, 30000, (micro, seq))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    batch = {k: v.to(device) for k, v in mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id,
                                                     len(tokenizer), "bert", 0, 0, np.arange(micro),
                                                     default_max_predictions(seq)).items()}
    dropout = 0.0 if compiled == "graphs" else 0.1
    torch.manual_seed(0)
    model = build_pretrainer(_tiny(dry, preset), ObjectiveConfig(), dropout=dropout).to(device)
    model = model.to(torch.float32 if dry else torch.bfloat16).train()
    result: dict = {"micro": micro, "accum": accum}
    if compiled == "graphs":  # the eager loss first, on the same weights and batch
        result["eager_loss"] = model(**batch)[0].item()
    torch._dynamo.reset()
    counters.clear()
    if compiled:
        backend = "eager" if dry else "inductor"
        compile_layers(model, backend=backend, mode="reduce-overhead" if compiled == "graphs" and not dry else None)
    if compiled == "graphs":
        result["loss"] = model(**batch)[0].item()
        result["loss_rel_diff"] = abs(result["loss"] - result["eager_loss"]) / abs(result["eager_loss"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not dry)
    intervals = []
    for _ in range((STEPS if not dry else 4) // (LOG if not dry else 2)):
        _sync(dry)
        t0 = time.perf_counter()
        for _ in range(LOG if not dry else 2):
            plain_step(model, optimizer, batch, accum)
        _sync(dry)
        intervals.append((time.perf_counter() - t0) / (LOG if not dry else 2))
    rate = micro * accum / statistics.median(intervals[1:])
    result.update(samples_per_s=round(rate, 1), mfu=_mfu(rate, preset, 128, dry))
    if profile:
        with _busy_share(dry, result):
            for _ in range(2):
                plain_step(model, optimizer, batch, accum)
    if compiled:
        result["graphs"] = counters["stats"].get("unique_graphs", 0)
        result["graph_breaks"] = sum(counters["graph_break"].values())
        result["recompiles"] = max(result["graphs"] - 3, 0)  # BERT's parts: embeddings, a layer, the head
    if not dry:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    return result


# (name, function, kwargs): in this order; a cut run keeps what came first
VARIANTS = [
    ("ceiling_gemm", ceiling_gemm, {}),
    ("ceiling_sdpa", ceiling_sdpa, {}),
    ("ceiling_launch", ceiling_launch, {}),
    *[(f"pretrain_bert_large{'_compile' if c else ''}{'_hcsr' if h else ''}", pretrain_variant,
       {"preset": "bert-large", "seq": 128, "compiled": c, "hc_sr": h}) for c in (False, True) for h in (False, True)],
    *[(f"plain_{m}x{a}", plain_variant, {"micro": m, "accum": a, "profile": True}) for m, a in ((64, 4), (128, 2),
                                                                                              (256, 1))],
    *[(f"plain_layers_{m}x{a}", plain_variant, {"micro": m, "accum": a, "compiled": "layers"}) for m, a in
      ((256, 1), (64, 4))],
    ("plain_cuda_graphs_64x4", plain_variant, {"micro": 64, "accum": 4, "compiled": "graphs"}),
    *[(f"pretrain_electra_base_seq{s}", pretrain_variant, {"preset": "electra-base", "seq": s, "compiled": False,
                                                           "hc_sr": False}) for s in (128, 512)],
]

# The dry run takes every stage once: the variant that sets the most flags of each
DRY_VARIANTS = ("ceiling_gemm", "ceiling_sdpa", "ceiling_launch", "pretrain_bert_large_compile_hcsr", "plain_64x4",
                "plain_layers_256x1", "plain_cuda_graphs_64x4", "pretrain_electra_base_seq512")


def run_variant(name: str, dry: bool) -> dict:
    _, fn, kwargs = next(v for v in VARIANTS if v[0] == name)
    t0 = time.perf_counter()
    try:
        return {"variant": name, "ok": True, **fn(dry, **kwargs), "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as err:  # one variant's failure is its result, not the run's end
        traceback.print_exc()
        return {"variant": name, "ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}",
                "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu-dry-run", action="store_true", help="every stage with tiny models on the CPU")
    parser.add_argument("--in-process", action="store_true", help="every variant in this process (the test's)")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # one variant, in the process the driver started
    args = parser.parse_args(argv)
    if args.variant:
        print("VARIANT " + json.dumps(run_variant(args.variant, args.cpu_dry_run)), flush=True)
        return 0
    out = Path(os.environ.get("OUT") or REPO / "runs" / "gpu_mfu")
    out.mkdir(parents=True, exist_ok=True)
    jsonl, start, failed = out / "gpu_mfu.jsonl", time.monotonic(), 0
    names = [name for name, _, _ in VARIANTS if not args.cpu_dry_run or name in DRY_VARIANTS]
    for name in names:
        left = BUDGET_S - (time.monotonic() - start)
        if left < 10:
            record = {"variant": name, "ok": False, "error": f"not reached: the {BUDGET_S} s budget is spent"}
        elif args.in_process:
            record = run_variant(name, args.cpu_dry_run)
        else:
            record = _in_own_process(name, args.cpu_dry_run, min(left, VARIANT_LIMIT_S))
        failed += not record["ok"]
        with open(jsonl, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in record.items() if k != "variant"), flush=True)
    print(f"RESULT gpu_mfu variants={len(names)} failed={failed} (JSON lines: {jsonl})", flush=True)
    return 1 if failed else 0


def _in_own_process(name: str, dry: bool, limit_s: float) -> dict:
    """One variant in a process of its own under `limit_s` (a hung kernel or an OOM kill ends it alone)."""
    cmd = [sys.executable, __file__, "--variant", name] + (["--cpu-dry-run"] if dry else [])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"variant": name, "ok": False, "error": f"TIMEOUT after {limit_s:.0f} s", "seconds": round(limit_s)}
    line = next((x for x in proc.stdout.splitlines() if x.startswith("VARIANT ")), None)
    if line is None:
        return {"variant": name, "ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-300:]}",
                "seconds": round(time.perf_counter() - t0, 1)}
    return json.loads(line[len("VARIANT "):])


if __name__ == "__main__":
    sys.exit(main())
