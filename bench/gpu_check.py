"""The stages of bench/gpu_check.sh. Each appends its lines to the summary file as soon as it has them, so a
stage cut short by its timeout still leaves what it measured.

    python bench/gpu_check.py {info|configs|resume|syncs|throughput|locks} --summary FILE --work DIR [--cpu-dry-run]

Engines are built in-process through truneg's own entry point (bench/lib/gpu_runs.py): one process per stage,
every variant of a stage in it. `--cpu-dry-run` takes the same stages on the CPU with tiny models, each
shipped GPU config turned into fp32 with torch AdamW at its own ZeRO stage and batch fields. Stages 3 and 4
(inside the step) are in bench/lib/gpu_step.py.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib.gpu_runs import (  # noqa: E402
    CORPUS,
    DRY,
    DS_CONFIGS,
    GPU,
    REPO,
    Mode,
    Summary,
    common_args,
    config_for,
    config_split,
    family_of,
    read_records,
    run_pretrain,
    shipped_gpu_configs,
)
from bench.lib.gpu_step import stage_syncs, stage_throughput  # noqa: E402

RESUME_TOLERANCE = 1e-5  # relative, per logged loss


def stage_info(mode: Mode, note: Summary, work: Path) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for name in ("torch", "deepspeed", "transformers", "datasets", "nltk", "numpy"):
        try:
            versions.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            versions.append(f"{name} MISSING")
    note(f"python {sys.version.split()[0]}; " + "; ".join(versions))
    if mode.dry_run:  # no torch import: the dry run's info costs no second
        note(f"device: CPU dry run ({os.cpu_count()} cores), DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}")
    else:
        import torch

        if not torch.cuda.is_available():
            note("device: torch sees no CUDA GPU")
            return False
        props = torch.cuda.get_device_properties(0)
        note(f"device: {props.name}, sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
             f"{torch.cuda.device_count()} visible; torch CUDA {torch.version.cuda}, cuDNN "
             f"{torch.backends.cudnn.version()}")
    try:
        import nltk

        note(f"nltk wordnet: {nltk.data.find('corpora/wordnet')}")
    except (ImportError, LookupError) as err:
        note(f"nltk wordnet: not found ({type(err).__name__}); only needed for --hc wordnet on another vocab")
    return "MISSING" not in " ".join(versions[:3])


def stage_configs(mode: Mode, note: Summary, work: Path) -> bool:
    """Stage 1: every shipped GPU config starts and takes 10 steps (tiny model, HC+SR)."""
    configs = shipped_gpu_configs()
    note(f"stage 1: {len(configs)} shipped GPU configs, 10 steps each, tiny model, --hc wordnet --sr word, "
         f"seq {mode.seq_len}, at most {mode.accum_cap} micro-steps a step")
    passed = 0
    for shipped in configs:
        path = config_for(shipped, mode, work)
        own, own_micro, own_accum = config_split(path)
        micro = mode.tiny_micro or own_micro
        accum = min(own_accum, mode.accum_cap)
        argv = common_args(mode, mode.preset(family_of(shipped), large=False), path, micro, accum)
        argv += ["--max-steps", "10", "--save-steps", "0", "--log-steps", "10", "--hc", "wordnet", "--sr", "word",
                 "--overwrite"]
        run = run_pretrain(argv, work / "stage1" / shipped.stem)
        last = run.records[-1] if run.records else {}
        ok = run.ok and last.get("step") == 10 and math.isfinite(last.get("loss", math.nan))
        passed += ok
        engine = run.engine
        what = (f"{engine['precision']} ZeRO-{engine['zero']} {engine['optimizer']}" if engine else "no engine")
        detail = (f"step {last.get('step')}, loss {last.get('loss', math.nan):.4f}" if run.ok
                  else run.error)
        note(f"  {shipped.name}: {'PASS' if ok else 'FAIL'} {what}; {detail}; ran micro {micro} x accumulation "
             f"{accum}; the config's own: {own} ({run.seconds:.1f} s)")
    note(f"stage 1 configs: {passed}/{len(configs)} passed")
    return passed == len(configs)


def stage_resume(mode: Mode, note: Summary, work: Path) -> bool:
    """Stage 2: a run killed (SIGKILL) after its first checkpoint and started again matches an uninterrupted
    run step for step; two real processes of `python -m truneg.pretrain`, the reference beside it."""
    import torch

    from truneg.data.blocks import ensure_prepared, load_tokenizer
    from truneg.train.checkpointing.checkpoint import rank_state_file
    from truneg.train.config.run_config import CHECKPOINTS

    shipped = DS_CONFIGS / "electra_small_a100_bf16_zero1.json"
    config = config_for(shipped, mode, work)
    shutil.rmtree(work / "stage2", ignore_errors=True)
    # A cache of its own (stage 1 runs beside this one), prepared once here before two processes race on it.
    os.environ["TRUNEG_CACHE"] = str(work / "stage2" / "cache")
    ensure_prepared(str(CORPUS), load_tokenizer(), mode.seq_len)
    steps, save = int(os.environ.get("GPU_CHECK_RESUME_STEPS", 12)), 4  # more: how the tests make it outlast a timeout
    argv = common_args(mode, "electra-tiny", config, mode.resume_micro, mode.accum_cap)
    argv += ["--max-steps", str(steps), "--save-steps", str(save), "--log-steps", "1", "--hc", "wordnet", "--sr",
             "word"]
    ref_dir, killed_dir = work / "stage2" / "reference", work / "stage2" / "killed"

    def start(out: Path, log: str) -> subprocess.Popen:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "truneg.pretrain", *argv, "--output-dir", str(out)]
        return subprocess.Popen(cmd, cwd=REPO, stdout=open(out.parent / log, "w"), stderr=subprocess.STDOUT)

    reference, victim = start(ref_dir, "reference.log"), start(killed_dir, "killed.log")
    latest = killed_dir / CHECKPOINTS / "latest"
    while not latest.is_file() and victim.poll() is None:
        time.sleep(0.005)
    victim.kill()
    finished_first = victim.wait() == 0
    tag = latest.read_text().strip() if latest.is_file() else None
    if tag is None or finished_first:
        reference.kill()
        note(f"  resume: FAIL the run {'ended before' if finished_first else 'died before'} the kill "
             f"(log: {killed_dir}.log)")
        return False
    resumed = start(killed_dir, "resumed.log")
    codes = resumed.wait(), reference.wait()
    if any(codes):
        note(f"  resume: FAIL exit codes resumed {codes[0]}, reference {codes[1]} (logs in {killed_dir.parent})")
        return False
    resume_step = int(tag.removeprefix("global_step"))
    # the second process continued from the checkpoint (a run trained afresh would match the reference too)
    said = (killed_dir.parent / "resumed.log").read_text(errors="replace")
    if f"resumed from {killed_dir / CHECKPOINTS} at step {resume_step}" not in said or \
            f"done, {steps - resume_step} steps" not in said:
        note(f"  resume: FAIL the second run did not resume from {tag} (log: {killed_dir.parent / 'resumed.log'})")
        return False
    ref, got = ({r["step"]: r for r in read_records(out)} for out in (ref_dir, killed_dir))
    worst, compared = 0.0, 0
    for step in range(resume_step + 1, steps + 1):
        for key in ("loss", "gen_loss", "disc_loss", "sr_loss"):
            if key in ref.get(step, {}):
                a, b = got.get(step, {}).get(key, math.nan), ref[step][key]
                worst = max(worst, abs(a - b) / max(abs(b), 1e-12)) if math.isfinite(a) else math.inf
                compared += 1
    rank_state = torch.load(rank_state_file(killed_dir / CHECKPOINTS, tag, 0), weights_only=False)
    has_cuda_rng = "accelerator" in rank_state["rng"]
    ok = compared > 0 and worst <= RESUME_TOLERANCE and (has_cuda_rng or mode.dry_run)
    note(f"  resume: {'PASS' if ok else 'FAIL'} killed after {tag}, resumed to step {steps}; max relative loss "
         f"difference {worst:.2e} over {compared} losses of steps {resume_step + 1}-{steps} (limit "
         f"{RESUME_TOLERANCE:g}); "
         f"accelerator RNG in the checkpoint: {'yes' if has_cuda_rng else 'no (CPU)' if mode.dry_run else 'NO'}")
    return ok


def release_locks(mode: Mode, note: Summary, work: Path) -> bool:
    """After a stage was killed by its timeout: delete the JIT-build locks its processes held when they died
    (none that a live process holds), so that the stages after it, and the next check, do not wait on them."""
    from truneg.train.ranks.distributed import orphaned_build_locks

    for lock in orphaned_build_locks(Path(os.environ["TORCH_EXTENSIONS_DIR"])):
        lock.unlink(missing_ok=True)
        note(f"  deleted {lock}: a killed process held it")
    return True


STAGES = {"info": stage_info, "configs": stage_configs, "resume": stage_resume, "syncs": stage_syncs,
          "throughput": stage_throughput, "locks": release_locks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--cpu-dry-run", action="store_true")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    ok = STAGES[args.stage](DRY if args.cpu_dry_run else GPU, Summary(args.summary), args.work)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
