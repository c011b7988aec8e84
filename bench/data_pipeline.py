"""Prepare a corpus: truneg's `prepare` against HF run_mlm's `group_texts` recipe and against the tokenizer alone.

    python bench/data_pipeline.py [--data ../shared/data/british-novels] [--num-proc 2] [--seq-len 128]

The corpus is read once into the page cache before anything is timed.
1. speedup: run_mlm (datasets' `text` builder, `map` of the tokenizer with special-token masks, then
   `group_texts` concatenating Python lists) against truneg's cold preparation of the same 1x corpus, with
   the same tokenizer and number of processes, fresh cache folders for both.
2. rss_growth: truneg prepares the corpus (1x) and the corpus concatenated eight times into one file (8x);
   in runs of their own (not the timed ones), a thread samples RssAnon (anonymous resident memory) of this
   process and of every worker every 20 ms.
   What preparing adds is the growth of this process's RssAnon over its value before (its imports are
   not), and each worker's whole peak (it exists for the preparation). The ratio is the largest growth at
   8x over that at 1x.
3. tokenizer_bound: our cold preparation time over the time of the same fast tokenizer's batched encode
   (`encode_batch_fast`, ids read out) of the same lines, in the same units as the preparation's, largest
   first, across the same number of spawned processes, with no packing or writing.
Last line: RESULT speedup=... rss_growth=... tokenizer_bound=...
"""
from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from itertools import chain
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from truneg.data import corpus, prepare  # noqa: E402  (no torch: the main process stays a small coordinator)


def run_mlm_recipe(files: list[Path], tokenizer, seq_len: int, num_proc: int, cache: Path) -> int:
    """examples/pytorch/language-modeling/run_mlm.py, line_by_line=False."""
    import datasets

    raw = datasets.load_dataset("text", data_files=[str(f) for f in files], split="train", cache_dir=str(cache))

    def tokenize_function(examples):
        return tokenizer(examples["text"], return_special_tokens_mask=True)

    tokenized = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=["text"])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples.keys()}
        total_length = len(concatenated[list(examples.keys())[0]])
        total_length = (total_length // seq_len) * seq_len
        return {k: [t[i: i + seq_len] for i in range(0, total_length, seq_len)] for k, t in concatenated.items()}

    grouped = tokenized.map(group_texts, batched=True, num_proc=num_proc)
    return len(grouped)


class PeakAnon:
    """Peak RssAnon per process of this process tree, sampled from /proc every 20 ms."""

    def __init__(self):
        self.peaks: dict[int, int] = {}
        self.main_before = self._anon(os.getpid())
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _anon(pid: int) -> int:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _run(self):
        import psutil  # imported by main() before any run: its import is not counted as growth

        me = psutil.Process()
        while not self._stop.is_set():
            for pid in [me.pid] + [c.pid for c in me.children(recursive=True)]:
                self.peaks[pid] = max(self.peaks.get(pid, 0), self._anon(pid))
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def main_and_workers(self) -> tuple[int, int]:
        """(this process's growth over its RssAnon before, the largest worker's peak)."""
        me = os.getpid()
        return (max(self.peaks.get(me, 0) - self.main_before, 0),
                max([v for k, v in self.peaks.items() if k != me] or [0]))


def _encode_only(segments: list) -> int:
    backend = prepare._WORKER["tokenizer"]
    tokens = 0
    for lines, _ in corpus.iter_text_unit(segments, hashlib.sha256()):
        tokens += sum(len(e.ids) for e in backend.encode_batch_fast(lines, add_special_tokens=False))
    return tokens


def tokenizer_only(files: list[Path], tokenizer, num_proc: int) -> tuple[float, int]:
    start = time.perf_counter()
    units, _ = corpus.plan_text_units(files, None)  # the units `prepare` plans, handed out largest first
    units.sort(key=lambda u: -u["bytes"])
    with ProcessPoolExecutor(num_proc, multiprocessing.get_context("spawn"), prepare._init_worker,
                             (tokenizer.backend_tokenizer.to_str(), [], True)) as pool:
        tokens = sum(pool.map(_encode_only, [u["segments"] for u in units]))
    return time.perf_counter() - start, tokens


def timed_prepare(data, tokenizer, seq_len, out, num_proc) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds of this process and its workers, the index): no memory sampler beside it."""
    import json

    start, cpu_start = time.perf_counter(), os.times()
    prepare.prepare(data, tokenizer, seq_len, out, num_proc, progress=False)
    seconds, cpu_end = time.perf_counter() - start, os.times()
    # the workers' CPU time reaches children_* once the pool has joined them (prepare returns after that)
    cpu = sum(cpu_end[i] - cpu_start[i] for i in range(4))  # user, system, children's user, children's system
    return seconds, cpu, json.loads((out / prepare.INDEX).read_text())


def sampled_prepare(data, tokenizer, seq_len, out, num_proc) -> tuple[int, int]:
    """main_and_workers' memory of a preparation, in a run of its own (the sampler thread takes CPU time)."""
    with PeakAnon() as peak:
        prepare.prepare(data, tokenizer, seq_len, out, num_proc, progress=False)
    return peak.main_and_workers()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "british-novels"))
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if not Path(args.data).exists():
        sys.exit(f"skipped: {args.data} is absent (the shared data folder)")
    import datasets
    import psutil  # noqa: F401  (the memory sampler's; imported before any measured run)
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    files = corpus.resolve_text_files(args.data)
    for f in files:  # into the page cache first: the first pipeline must not pay for the disk alone
        f.read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "truneg" / "assets" / "vocab"))
    mb = sum(f.stat().st_size for f in files) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        hf_blocks = run_mlm_recipe(files, tokenizer, args.seq_len, args.num_proc, tmp / "hf")
        hf_s = time.perf_counter() - start
        enc_s, enc_tokens = tokenizer_only(files, tokenizer, args.num_proc)
        one_s, one_cpu, one = timed_prepare(args.data, tokenizer, args.seq_len, tmp / "one", args.num_proc)
        start = time.perf_counter()
        prepare.prepare(args.data, tokenizer, args.seq_len, tmp / "one", args.num_proc, progress=False)
        warm_s = time.perf_counter() - start
        big = tmp / "x8" / "novels_x8.txt"
        big.parent.mkdir()
        with open(big, "wb") as fh:
            for _ in range(8):
                for f in files:
                    fh.write(f.read_bytes())
        eight_s, _, eight = timed_prepare(str(big), tokenizer, args.seq_len, tmp / "eight", args.num_proc)
        one_rss = sampled_prepare(args.data, tokenizer, args.seq_len, tmp / "one_sampled", args.num_proc)
        eight_rss = sampled_prepare(str(big), tokenizer, args.seq_len, tmp / "eight_sampled", args.num_proc)
        disk = {k: sum(p.stat().st_size for p in (tmp / k / "shards").glob("*.bin")) for k in ("one", "eight")}
    print(f"{len(files)} files, {mb:.1f} MB, seq {args.seq_len}, {args.num_proc} processes, {one['tokens']:,} tokens")
    print(f"{'pipeline':<44} {'seconds':>8} {'blocks':>9} {'M tok/s':>8} {'anon MB main growth/worker':>27}")
    print(f"{'HF run_mlm (tokenize + group_texts), 1x':<44} {hf_s:>8.1f} {hf_blocks:>9}")
    print(f"{'encode_batch_fast only, 1x':<44} {enc_s:>8.1f} {'':>9} {enc_tokens / enc_s / 1e6:>8.2f}")
    for name, s, idx, rss in (("truneg prepare, cold, 1x", one_s, one, one_rss),
                              ("truneg prepare, cold, 8x (one file)", eight_s, eight, eight_rss)):
        print(f"{name:<44} {s:>8.1f} {idx['blocks']:>9} {idx['tokens'] / s / 1e6:>8.2f} "
              f"{rss[0] / 1e6:>12.0f} / {rss[1] / 1e6:<10.0f}")
    print(f"{'truneg prepare, warm (already prepared), 1x':<44} {warm_s:>8.2f}")
    print(f"CPU: {one['tokens'] / one_cpu / 1e6:.2f} M tokens per CPU-second at 1x (this process and its workers)")
    print(f"per core: {eight['tokens'] / eight_s / args.num_proc / 1e6:.2f} M tokens/s at 8x; "
          f"disk {disk['one'] / one['tokens']:.2f} bytes/token ({disk['eight'] / 1e6:.0f} MB at 8x)")
    rss_growth = max(eight_rss) / max(one_rss)
    print(f"RESULT speedup={hf_s / one_s:.2f} rss_growth={rss_growth:.2f} tokenizer_bound={one_s / enc_s:.2f}")


if __name__ == "__main__":
    main()
