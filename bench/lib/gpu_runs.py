"""In-process runs of truneg for bench/gpu_check.py (and bench/gpu_mfu.py, bench/gpu_zero_stages.py,
bench/host_ops.py): the GPU check's and the dry run's settings (`Mode`), the dry run's stand-ins for the shipped
GPU configs, and `run_pretrain`, which runs truneg's own entry point (`truneg.pretrain.main`) in this process and
reports what DeepSpeed built. Imported as bench.lib.gpu_runs, after the script has put the repo root on sys.path."""
from __future__ import annotations

import contextlib
import copy
import gc
import json
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from truneg.data.blocks import DEMO_CORPUS as CORPUS
from truneg.train.config.ds_config import DS_CONFIGS

REPO = Path(__file__).resolve().parents[2]  # bench/lib/gpu_runs.py -> the repo root


@dataclass(frozen=True)
class Mode:
    """What differs between the GPU check and its CPU dry run; everything else is the same code."""

    dry_run: bool
    seq_len: int
    tiny_micro: int | None  # stage 1 micro-batch; None: the config's own
    accum_cap: int  # stages 1-2: at most this many micro-steps per step (the config's split is still reported)
    resume_micro: int
    sync_micro: int
    bench_micro: int | None  # stage 4; None: the config's own
    bench_accum: int
    bench_steps: int
    bench_log: int

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    def preset(self, family: str, large: bool) -> str:
        if self.dry_run or not large:
            return f"{family}-tiny"
        return "bert-large" if family == "bert" else "electra-base"


GPU = Mode(False, 128, None, 2, 16, 32, None, 4, 15, 5)
DRY = Mode(True, 32, 2, 2, 2, 2, 2, 2, 4, 2)


class Summary:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, line: str) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line + "\n")
        print(line, flush=True)


def shipped_gpu_configs() -> list[Path]:
    return sorted(p for p in DS_CONFIGS.glob("*.json") if not p.name.startswith("cpu_"))


def cpu_substitute(config: dict) -> dict:
    """The dry run's stand-in for a GPU config: fp32 and torch AdamW (no fused op to build), with the config's
    own ZeRO section, batch fields, scheduler, clipping and monitors."""
    out = copy.deepcopy(config)
    for section in ("fp16", "bf16", "amp"):
        out.pop(section, None)
    out.get("data_types", {}).pop("grad_accum_dtype", None)
    if out.get("data_types") == {}:
        out.pop("data_types")
    params = (config.get("optimizer") or {}).get("params", {})
    kept = {k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}
    out["optimizer"] = {"type": "AdamW", "params": {**kept, "torch_adam": True}}
    return out


def config_for(path: Path, mode: Mode, work: Path) -> Path:
    if not mode.dry_run:
        return path
    target = work / "configs" / path.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(cpu_substitute(json.loads(path.read_text())), indent=1))
    return target


def family_of(config: Path) -> str:
    return "electra" if config.name.startswith("electra") else "bert"


@contextlib.contextmanager
def patched(owner, name: str, value):
    real = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield real
    finally:
        setattr(owner, name, real)


@dataclass
class Run:
    error: str | None
    seconds: float
    records: list[dict]
    engine: dict  # what DeepSpeed built: ZeRO stage, precision, optimizer class

    @property
    def ok(self) -> bool:
        return self.error is None


def run_pretrain(argv: list[str], output_dir: Path) -> Run:
    """truneg.pretrain.main in this process; the engine it builds is caught on its way out of
    deepspeed.initialize and released afterwards."""
    import deepspeed

    from truneg import pretrain
    from truneg.errors import UserError

    engines = []

    def initialize(*args, **kwargs):
        result = real_initialize(*args, **kwargs)
        engines.append(result[0])
        return result

    import torch.nn.functional as F

    error, start = None, time.perf_counter()
    # DeepSpeed's ZeRO-3 replaces torch.nn.functional.linear process-wide and leaves it there: a later run in this
    # process (a compiled one: add(sparse, dense) in its backward) would run with ZeRO-3's linear
    with patched(deepspeed, "initialize", initialize) as real_initialize, patched(F, "linear", F.linear):
        try:
            getattr(pretrain.main, "__wrapped__", pretrain.main)(argv + ["--output-dir", str(output_dir)])
        except UserError as err:
            error = f"truneg: error: {err}"
        except Exception as err:  # any failure of one variant is that variant's result, not the stage's end
            error = f"{type(err).__name__}: {str(err)[:300]}"
            traceback.print_exc()
    seconds = time.perf_counter() - start
    facts = {}
    if engines:
        from truneg.train.loop import innermost_optimizer

        engine = engines[-1]
        precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
        facts = {"zero": engine.zero_optimization_stage(), "precision": precision,
                 "optimizer": type(innermost_optimizer(engine)).__name__}
    records = read_records(output_dir)
    engines.clear()
    release_memory()
    return Run(error, seconds, records, facts)


def plain_step(model, optimizer, batch: dict, accum: int) -> None:
    """One optimizer step of a plain torch loop (no DeepSpeed), the baseline the benchmarks set truneg beside:
    `accum` micro-steps on the same batch, then the update."""
    for _ in range(accum):
        loss, _ = model(**batch)
        (loss / accum).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def read_records(output_dir: Path) -> list[dict]:
    from truneg.train.config.run_config import METRICS

    metrics = output_dir / METRICS
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []


def release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def start_memory_peak(cuda: bool = True) -> int:
    """Frees what earlier runs in this process left where it can, and starts a new GPU peak: returns the bytes that
    stay held (0 without CUDA, or for a CPU dry run: which must not start a CUDA context), so that a peak can say
    how much of it was this run's."""
    import torch

    release_memory()
    if not (cuda and torch.cuda.is_available()):
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def common_args(mode: Mode, model: str, config: Path, micro: int, accum: int) -> list[str]:
    return ["--model", model, "--deepspeed_config", str(config), "--train-data", str(CORPUS),
            "--seq-len", str(mode.seq_len), "--micro-batch-size", str(micro), "--gradient-accumulation-steps",
            str(accum)]


def config_split(path: Path, world_size: int = 1) -> tuple[str, int, int]:
    """The config's own batch arithmetic on this world size, as truneg resolves it: (line, micro, accumulation)."""
    from truneg.train.config import ds_config as dsc

    resolved, choices = dsc.resolve(path, world_size, 10, Path("unused"))
    return choices[0], resolved["train_micro_batch_size_per_gpu"], resolved["gradient_accumulation_steps"]
