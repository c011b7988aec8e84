"""Sub-commands of `truneg` for analysis: fn-stats and fn-cases (the paper's Table 2, Figure 3, Table 1)."""
from __future__ import annotations

from pathlib import Path

from truneg.errors import int_at_least


def _common(parser) -> None:
    parser.add_argument("--data", nargs="+", required=True, help="text files, folders or globs to run the MLM over")
    parser.add_argument("--synonyms", type=Path, help="synonym table (default: the shipped WordNet table)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.set_defaults(output_paths=[("out", "--out", True)])  # checked by cli.main, before the checkpoints run
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, [CLS] and [SEP] included")
    parser.add_argument("--segmentation", choices=["packed", "line", "article"], default="packed",
                        help="packed: blocks cut across lines and articles, as pre-training packs them; line / "
                             "article: no sequence crosses a line / an article (WikiText ` = Title = ` or a file), "
                             "padded. The paper's Table 2 does not say; see the README")
    parser.add_argument("--seed", type=int, default=0, help="masking and sampling seed")
    parser.add_argument("--prediction", choices=["default", "argmax", "sample"], default="default",
                        help="default: argmax for BERT, the generator's sample for ELECTRA (as in training)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=32)
    parser.add_argument("--max-sequences", type=int_at_least(1), help="stop after this many sequences")
    parser.add_argument("--tokenizer", help="tokenizer folder (default: the checkpoints' own, else bert-base-uncased)")


def _prepare(args, refs):
    from truneg.analysis import checkpoints_tokenizer, open_sequences
    from truneg.data import load_tokenizer
    from truneg.synonyms import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable

    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else checkpoints_tokenizer(refs)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    table = SynonymTable.load(args.synonyms or SHIPPED_WORDNET_TABLE, expect_tokens=tokens)
    blocks = open_sequences(args.data, tokenizer, args.seq_len, args.segmentation)
    return tokenizer, table, SynonymLookup(table), blocks


def _fn_stats(args) -> None:
    from truneg.analysis import discover_checkpoints, evaluate, format_table, load_mlm, write_stats

    refs = discover_checkpoints(args.checkpoints)
    tokenizer, _, lookup, blocks = _prepare(args, refs)
    results = []
    for ref in refs:
        counts, _ = evaluate(load_mlm(ref), blocks, tokenizer, lookup, args.prediction, args.seed, args.batch_size,
                             args.max_sequences, label=ref.label, step=ref.step)
        counts.segmentation, counts.seq_len = args.segmentation, args.seq_len
        results.append(counts)
        print(f"{ref.label}: {counts.corrected} false negatives", flush=True)
    print(format_table(results))
    for path in write_stats(results, args.out).values():
        print(f"wrote {path}")


def _fn_cases(args) -> None:
    from truneg.analysis import discover_checkpoints, evaluate, load_mlm, write_cases

    refs = discover_checkpoints([args.checkpoint])
    if len(refs) != 1:
        refs = refs[-1:]  # a checkpoints folder: its newest tag
    tokenizer, table, lookup, blocks = _prepare(args, refs)
    counts, cases = evaluate(load_mlm(refs[0]), blocks, tokenizer, lookup, args.prediction, args.seed,
                             args.batch_size, args.max_sequences, label=refs[0].label, step=refs[0].step,
                             max_cases=args.n, table=table)
    written = write_cases(cases, args.out)
    print(f"{len(cases)} cases of {counts.corrected} false negatives in {counts.sequences} sequences")
    for path in written.values():
        print(f"wrote {path}")


def add_commands(commands) -> None:
    stats = commands.add_parser("fn-stats", help="false-negative ratios per checkpoint (paper Table 2)")
    stats.add_argument("--checkpoints", nargs="+", required=True,
                       help="truneg checkpoints folders (every tag), tags, or exported HF MLM / generator folders")
    _common(stats)
    stats.set_defaults(func=_fn_stats)
    cases = commands.add_parser("fn-cases", help="dump corrected examples (paper Figure 3 / Table 1)")
    cases.add_argument("--checkpoint", required=True, help="a tag, a checkpoints folder (its newest tag) or an HF folder")
    cases.add_argument("-n", type=int_at_least(0), default=20, help="number of cases")
    _common(cases)
    cases.set_defaults(func=_fn_cases)
