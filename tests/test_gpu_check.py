"""bench/gpu_check.sh --cpu-dry-run: the GPU check's stages with tiny models on the CPU, so that the script's
logic (stages, timeouts, the summary, the config substitution, resume, sync counting, throughput) runs in CI.

Two runs, shared by the tests: stages 1, 2 and 4; and stages 2 and 3 (side by side, as the script runs them)
with stage 2 cut by its timeout, so that every stage runs once in full, and the cut is seen to leave no process
behind and the stage beside it unharmed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GPU_CONFIGS = sorted(p for p in (REPO / "ds_configs").glob("*.json") if not p.name.startswith("cpu_"))
EARLIER = "a summary line of an earlier run\n"


def _dry_run(tmp_path: Path, launch_env: dict, **extra: str) -> tuple[subprocess.CompletedProcess, Path, str]:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("not the check's")
    (out / "gpu_check.txt").write_text(EARLIER)
    # The stages' limits are sized for an H200; the suite's 2 workers share 2 cores. A test's own wins.
    limits = {f"STAGE{n}_TIMEOUT_S": "400" for n in (1, 2, 3, 4)}
    # A JIT-build folder of its own (a copy of the built comm op, without locks): a cut stage's lock clean-up,
    # and the check of it, must not meet the locks that the other test worker's launches hold in the shared one.
    extensions, built = tmp_path / "torch_extensions", Path(launch_env["TORCH_EXTENSIONS_DIR"])
    if built.is_dir():
        shutil.copytree(built, extensions, ignore=shutil.ignore_patterns("lock"))
    env = {**launch_env, "OUT": str(out), "WORK": str(tmp_path / "work"), "TORCH_EXTENSIONS_DIR": str(extensions),
           **limits, **extra}
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu-dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    return proc, out, (out / "gpu_check.txt").read_text()


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, launch_env):
    return _dry_run(tmp_path_factory.mktemp("gpu_check"), launch_env, STAGES="1,2,4,5")


@pytest.fixture(scope="module")
def cut_run(tmp_path_factory, launch_env):
    """Stage 2 killed by its timeout while its training processes run; then stage 3."""
    tmp_path = tmp_path_factory.mktemp("gpu_check_cut")
    # 2,000 steps: stage 2 cannot end before its 15 s, however quiet the machine
    return (*_dry_run(tmp_path, launch_env, STAGES="2,3", STAGE2_TIMEOUT_S="15", GPU_CHECK_RESUME_STEPS="2000"),
            tmp_path / "work")


def test_every_stage_passes_and_out_is_only_appended_to(dry_run):
    proc, out, summary = dry_run
    assert proc.returncode == 0, summary + proc.stdout[-3000:]
    assert (out / "keep.txt").read_text() == "not the check's"
    assert summary.startswith(EARLIER)
    for n, name in [(1, "configs"), (2, "resume"), (4, "throughput")]:
        assert re.search(rf"^stage {n} {name}: PASS in \d+ s$", summary, re.M), name
    assert "stage 5 mfu: SKIPPED (CUDA only" in summary  # named first, said first, and not run on the CPU
    assert summary.index("stage 5 mfu") < summary.index("stage 1 configs")
    assert "every stage passed" in summary.splitlines()[-1]


def test_stage1_starts_every_shipped_gpu_config_at_its_own_zero_stage_and_batch(dry_run):
    _, _, summary = dry_run
    assert f"stage 1 configs: {len(GPU_CONFIGS)}/{len(GPU_CONFIGS)} passed" in summary
    for path in GPU_CONFIGS:
        raw = json.loads(path.read_text())
        stage = raw.get("zero_optimization", {}).get("stage", 0)
        line = next(line for line in summary.splitlines() if line.startswith(f"  {path.name}: "))
        # substituted: fp32 and torch AdamW, but the config's own ZeRO stage and global batch
        assert f"PASS fp32 ZeRO-{stage} AdamW; step 10, loss " in line, line
        assert f"the config's own: global batch {raw['train_batch_size']} = micro-batch " in line, line


def test_stage2_resume_after_kill_matches_the_uninterrupted_run(dry_run):
    _, _, summary = dry_run
    line = next(line for line in summary.splitlines() if line.startswith("  resume: "))
    match = re.search(r"PASS killed after global_step(\d+), resumed to step 12; max relative loss difference "
                      r"(\S+) over (\d+) losses", line)
    assert match, line
    assert int(match[1]) < 12 and int(match[3]) >= 12 - int(match[1]) and float(match[2]) <= 1e-5
    # the script's verdict checked from the two runs' own records: every step after the kill, in both
    stage2 = dry_run[1].parent / "work" / "stage2"
    resumed = (stage2 / "resumed.log").read_text()  # the second process continued from the checkpoint
    assert f"resumed from {stage2 / 'killed' / 'checkpoints'} at step {match[1]}" in resumed
    assert f"done, {12 - int(match[1])} steps" in resumed
    ref, got = ({r["step"]: r for r in map(json.loads, (stage2 / run / "metrics.jsonl").read_text().splitlines())}
                for run in ("reference", "killed"))
    assert set(range(int(match[1]) + 1, 13)) <= set(got) and len(ref) == 12
    for step in range(int(match[1]) + 1, 13):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step


def test_stage3_counts_no_host_sync_in_forward_and_backward(cut_run):
    _, _, summary, _ = cut_run
    counts = re.search(r"syncs \(bert-tiny HC\+SR, fp32 ZeRO-1.*\): (.*)$", summary, re.M)
    assert counts, summary
    phases = dict(item.rsplit(" ", 1) for item in counts[1].split(", "))
    assert phases["forward"] == "0" and phases["backward"] == "0", phases
    # the counter does see syncs: DeepSpeed's grad-norm check and torch AdamW's step counters, in the update
    assert int(phases["whole train_step"]) >= 1, phases


def test_stage4_measures_every_variant(dry_run):
    _, _, summary = dry_run
    variants = ["bert zero1 baseline", "bert zero1 hc+sr", "electra zero1 baseline", "electra zero1 hc+sr",
                "bert zero3 baseline", "bert zero3 hc+sr",
                "bert zero1 hc+sr compile"]  # compile last: a timeout cuts it
    lines = summary.splitlines()
    order = [next(i for i, line in enumerate(lines) if line.startswith(f"  {variant}: ")) for variant in variants]
    assert order == sorted(order)
    for variant in variants:
        line = next(line for line in summary.splitlines() if line.startswith(f"  {variant}: "))
        zero = "3" if "zero3" in variant else "1"
        assert re.search(rf"fp32 ZeRO-{zero} AdamW: \d+\.\d samples/s; MFU \d+\.\d% of the GEMM ", line), line
    assert summary.count("HC+SR step time / baseline: ") == 3
    assert "--compile speed-up: " in summary
    # the bare --compile (layers) through the real pretrain path, HC+SR at ZeRO-1: BERT's embeddings, one graph its
    # layers share, and its head; no break
    assert "    compile: 3 graph(s), 0 graph break(s)" in summary.splitlines()


def test_a_stage_cut_by_its_timeout_leaves_no_process_and_the_stage_beside_it_passes(cut_run):
    proc, out, summary, work = cut_run
    assert proc.returncode == 1
    assert "stage 2 resume: TIMEOUT after 15 s" in summary
    assert re.search(r"^stage 3 syncs: PASS", summary, re.M)
    assert "1 stage(s) did not pass" in summary.splitlines()[-1]
    assert (work / "stage2" / "killed.log").is_file()  # its training processes had started
    leftovers = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(work) in cmdline.read_bytes().decode(errors="replace"):
                leftovers.append(cmdline.parent.name)
        except OSError:
            pass
    assert not leftovers, f"processes of the killed stage still run: {leftovers}"
    # nor ran on: nothing in stage 2's folder changed after its result was written
    killed_at = (work / "status.2").stat().st_mtime
    late = [p for p in (work / "stage2").rglob("*") if p.is_file() and p.stat().st_mtime > killed_at + 1]
    assert not late, f"stage 2's processes wrote after its timeout: {late[:3]}"
    # nor left a JIT-build lock that would stop every later load of DeepSpeed's comm op (the suite's next launch)
    from truneg.train.ranks.distributed import orphaned_build_locks

    assert orphaned_build_locks(work.parent / "torch_extensions") == []
    assert (out / "keep.txt").is_file() and (out / "gpu_check.log").is_file()
