"""Peak memory of tokenizing one very long line (a whole book on one line), as `truneg prepare` does it
(`encoding.encode`: slices of at most corpus.SLICE_CHARS characters) against the tokenizer given the whole line
at once, each in a fresh process (peak RSS, Linux), side by side in one run, on the shared British novels.

    OMP_NUM_THREADS=1 python bench/long_line_memory.py [--mb 20]

Last line: `RESULT sliced_vs_whole_peak=<ratio> whole_mib=<MiB> sliced_mib=<MiB> same_ids=<true|false>`.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOVELS = REPO.parent / "shared" / "data" / "british-novels"


def _kib(field: str) -> int:
    """VmRSS or VmHWM (the peak) of this process, in KiB."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def measure(how: str, megabytes: int) -> dict:
    """In this process: peak RSS growth (MiB) of tokenizing the line `how` says, and a digest of its ids. The
    peak is reset after the line is built (Linux: /proc/self/clear_refs), so the building's temporaries do not
    hide the tokenizer's own growth."""
    import hashlib

    import numpy as np

    from truneg.data import encoding
    from truneg.data.blocks import load_tokenizer

    backend = load_tokenizer().backend_tokenizer
    text = " ".join(p.read_text(encoding="utf-8", errors="replace").replace("\n", " ") for p
                    in sorted(NOVELS.glob("*.txt")))
    line = (text * (1 + megabytes * 10**6 // len(text)))[:megabytes * 10**6]
    del text
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) back to the current RSS
    before = _kib("VmRSS")
    if how == "whole":
        ids = np.asarray(backend.encode_batch_fast([line], add_special_tokens=False)[0].ids, dtype=np.int64)
    else:
        ids = encoding.encode(backend, [line], 0, rows_are_documents=False)
    grown = (_kib("VmHWM") - before) / 1024
    return {"mib": grown, "tokens": len(ids), "ids": hashlib.sha256(ids.tobytes()).hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=20, help="the line's length in millions of characters")
    parser.add_argument("--measure", choices=["whole", "sliced"], help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.mb)))
        return
    results = {}
    for how in ("whole", "sliced"):
        out = subprocess.run([sys.executable, __file__, "--mb", str(args.mb), "--measure", how], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
        results[how] = json.loads(out.strip().splitlines()[-1])
        print(f"{how:>6}: {results[how]['tokens']} tokens, peak RSS +{results[how]['mib']:.0f} MiB", flush=True)
    same = results["whole"]["ids"] == results["sliced"]["ids"]
    print(f"RESULT sliced_vs_whole_peak={results['sliced']['mib'] / results['whole']['mib']:.3f} "
          f"whole_mib={results['whole']['mib']:.0f} sliced_mib={results['sliced']['mib']:.0f} "
          f"same_ids={str(same).lower()}")


if __name__ == "__main__":
    main()
