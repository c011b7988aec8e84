"""`truneg prepare`'s command line (the preparation itself: truneg/data/prepare.py)."""
from __future__ import annotations

import json
from pathlib import Path

from truneg.data import prepare as preparation
from truneg.errors import UserError, int_at_least


def _parse_part(text: str) -> tuple[int, int]:
    i, _, n = text.partition("/")
    try:
        part = int(i), int(n)
    except ValueError:
        part = (-1, 0)
    if not 0 <= part[0] < part[1]:
        raise UserError(f"--part {text!r}: write i/n with 0 <= i < n, e.g. --part 0/4 on the first of 4 machines")
    return part


def _run(args) -> None:
    if args.merge:
        out = preparation.merge(args.merge, args.out)
    else:
        if not args.train_data:
            raise UserError("give --train-data SOURCE... (or --merge PART_DIRS...)")
        from truneg.data.blocks import load_tokenizer

        part = _parse_part(args.part)
        tokenizer = load_tokenizer(args.tokenizer)
        out = preparation.prepare(args.train_data, tokenizer, args.seq_len, args.out, args.num_proc, part)
        if part[1] > 1:
            print(f"{out}: part {part[0]}/{part[1]} done; when every part is, run "
                  f"`truneg prepare --merge PART_DIRS... --out DIR`")
            return
    index = json.loads((Path(out) / preparation.INDEX).read_text(encoding="utf-8"))
    print(f"{out}: {index['blocks']} blocks of {index['seq_len']} ({index['tokens']} tokens, {index['dtype']}) "
          f"in {len(index['shards'])} shards{', with word starts' if index.get('word_starts') else ''}; "
          f"fingerprint {index['fingerprint'][:16]}")


def add_command(commands) -> None:
    """Register `truneg prepare` on the `truneg` command's subparsers."""
    from truneg.data.blocks import DEFAULT_TOKENIZER

    cmd = commands.add_parser("prepare", help="tokenize and pack a corpus once into a prepared folder",
                              description=preparation.__doc__.split("\n\n")[0])
    cmd.add_argument("--train-data", nargs="+", help="text files, folders or globs, or hf:NAME[:CONFIG][@SPLIT]#COLUMN")
    cmd.add_argument("--seq-len", type=int_at_least(3), default=128)
    cmd.add_argument("--out", required=True, type=Path, help="the prepared folder (or this part's folder)")
    cmd.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                     help="tokenizer folder (default: bert-base-uncased)")
    cmd.add_argument("--num-proc", type=int_at_least(0),
                     help="tokenizer processes (default, or 0: the CPUs this process may use)")
    cmd.add_argument("--part", default="0/1", help="i/n: prepare the i-th (0-based) of n parts, e.g. one per machine")
    cmd.add_argument("--merge", nargs="+", metavar="DIR", help="join the finished parts in these folders into --out")
    cmd.set_defaults(func=_run, output_paths=[("out", "--out", True)])
