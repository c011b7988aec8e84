"""`truneg report`'s start-up on one run's records: wall time and peak memory of a fresh interpreter that reports a
run's metrics.jsonl, and which of torch, transformers and deepspeed it imported. With `--before DIR` (another
checkout of truneg, e.g. `git worktree add DIR COMMIT`), that checkout's the same way, taking turns, for the ratio.

    python bench/report_startup.py [--before DIR] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORD = {"step": 0, "samples": 0, "eval_mlm_loss": 9.0, "eval_mlm_accuracy": 0.1, "eval_hc_iter_ratio": 0.0,
          "eval_hc_pred_ratio": 0.0, "eval_sequences": 96, "eval_masked": 900, "eval_mismatched": 880,
          "eval_seconds": 0.3}
SCRIPT = ("import sys\nfrom truneg import cli\ncli.main(['report', 'baseline={run}', '--out', '{out}'])\n"
          "print('IMPORTED', sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")


def one(checkout: Path, run: Path, out: Path) -> tuple[float, float, str]:
    """(seconds, peak RSS in MiB, the heavy modules imported) of one `truneg report` in a fresh interpreter."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", SCRIPT.format(run=run, out=out)], cwd=checkout,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
    seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"truneg report in {checkout} exited {child.returncode}")
    return seconds, usage.ru_maxrss / 1024, stdout.rsplit("IMPORTED", 1)[1].strip()  # (Linux: KiB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="another checkout of truneg to measure beside this one")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        lines = [{**RECORD, "step": s, "samples": 8 * s} for s in range(0, 100, 10)]
        lines += [{"step": s, "samples": 8 * s, "loss": 9.0 - s / 100, "lr": 1e-4} for s in range(1, 100)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        checkouts = {"after": REPO, **({"before": args.before.resolve()} if args.before else {})}
        times, peaks, imported = {name: [] for name in checkouts}, {name: [] for name in checkouts}, {}
        for _ in range(args.rounds):  # taking turns, so that a slow minute slows both
            for name, checkout in checkouts.items():
                seconds, peak, imported[name] = one(checkout, run, Path(tmp) / f"out-{name}")
                times[name].append(seconds)
                peaks[name].append(peak)
    for name in times:
        print(f"{name}: median {statistics.median(times[name]):.2f} s, peak RSS {max(peaks[name]):.0f} MiB over "
              f"{args.rounds} runs; imported {imported[name]}")
    print(f"RESULT report_startup_s={statistics.median(times['after']):.2f}"
          + (f" before_s={statistics.median(times['before']):.2f} "
             f"ratio={statistics.median(times['after']) / statistics.median(times['before']):.3f}"
             if "before" in times else ""))


if __name__ == "__main__":
    main()
