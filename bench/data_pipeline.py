"""Tokenize and pack a corpus: truneg's pipeline against HF run_mlm's `group_texts` recipe.

    python bench/data_pipeline.py [--data ../shared/data/british-novels] [--num-proc 2] [--seq-len 128]

Same tokenizer, same processes, cold caches (fresh folders) for both; the text is loaded with
datasets' `text` builder in both. truneg tokenizes without special tokens, cuts the arrow column's flat
token buffer into blocks with numpy and memory-maps the result; run_mlm tokenizes with special-token
masks and concatenates Python lists in `group_texts`. Also reports truneg's warm-cache time.
Last line: RESULT speedup=<run_mlm cold time / truneg cold time>
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from itertools import chain
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from truneg.data import build_blocks, load_tokenizer, open_blocks, resolve_text_files  # noqa: E402


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "british-novels"))
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    if not Path(args.data).exists():
        sys.exit(f"skipped: {args.data} is absent (the shared data folder)")
    import datasets

    datasets.disable_progress_bars()
    files = resolve_text_files(args.data)
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        hf_blocks = run_mlm_recipe(files, tokenizer, args.seq_len, args.num_proc, Path(tmp) / "hf")
        hf_s = time.perf_counter() - start
        start = time.perf_counter()
        path = build_blocks(args.data, tokenizer, args.seq_len, Path(tmp) / "truneg", args.num_proc)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        assert build_blocks(args.data, tokenizer, args.seq_len, Path(tmp) / "truneg", args.num_proc) == path
        blocks = open_blocks(path)
        warm_s = time.perf_counter() - start
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    print(f"{len(files)} files, {size_mb:.1f} MB, seq {args.seq_len}, {args.num_proc} processes")
    print(f"{'pipeline':<36} {'seconds':>8} {'blocks':>8}")
    print(f"{'HF run_mlm (tokenize + group_texts)':<36} {hf_s:>8.1f} {hf_blocks:>8}")
    print(f"{'truneg build_blocks, cold':<36} {ours_s:>8.1f} {len(blocks):>8}")
    print(f"{'truneg build_blocks, warm cache':<36} {warm_s:>8.2f} {len(blocks):>8}")
    print(f"RESULT speedup={hf_s / ours_s:.2f}")


if __name__ == "__main__":
    main()
