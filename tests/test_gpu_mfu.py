"""bench/gpu_mfu.py --cpu-dry-run: every stage of the one GPU call, once each with tiny models on the CPU, in one
short process (`--in-process`: the driver's loop, the records and the budget; the GPU run puts each variant in a
process of its own)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gpu_mfu import DRY_VARIANTS, VARIANTS  # noqa: E402


def test_the_dry_run_takes_every_stage_and_appends_a_json_line_per_variant(tmp_path, launch_env):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gpu_mfu.jsonl").write_text(json.dumps({"variant": "an earlier run's"}) + "\n")
    proc = subprocess.run([sys.executable, "bench/gpu_mfu.py", "--cpu-dry-run", "--in-process"], cwd=REPO,
                          env={**launch_env, "OUT": str(out), "DS_ACCELERATOR": "cpu"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "gpu_mfu.jsonl").read_text().splitlines()]
    assert records[0] == {"variant": "an earlier run's"}  # appended, not overwritten
    records = {r["variant"]: r for r in records[1:]}
    assert list(records) == list(DRY_VARIANTS)
    names = [name for name, _, _ in VARIANTS]
    for stage in ("ceiling_gemm", "ceiling_sdpa", "ceiling_launch", "pretrain_bert_large", "plain_", "plain_layers_",
                  "plain_cuda_graphs_", "pretrain_electra_base"):  # the docstring's stages, each in the dry run
        assert any(n.startswith(stage) for n in names) and any(n.startswith(stage) for n in records), stage
    assert all(r["ok"] for r in records.values()), records
    assert records["pretrain_bert_large_compile_hcsr"]["zero"] == 1 and records["plain_64x4"]["samples_per_s"] > 0
    for name in ("plain_layers_256x1", "plain_cuda_graphs_64x4"):  # per-layer compile: 3 graphs, none broken
        assert (records[name]["graphs"], records[name]["graph_breaks"], records[name]["recompiles"]) == (3, 0, 0)
    assert records["plain_cuda_graphs_64x4"]["loss_rel_diff"] < 1e-6
    assert proc.stdout.splitlines()[-1].startswith(f"RESULT gpu_mfu variants={len(DRY_VARIANTS)} failed=0")
