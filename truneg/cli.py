"""The `truneg` command: synonym tables, export, false-negative analysis, fine-tuning and evaluation.

Pre-training itself runs under the deepspeed launcher: `deepspeed truneg/pretrain.py ...`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from truneg.data import commands as data_commands
from truneg.errors import UserError, check_output_path, exit_on_user_error, float_between, int_at_least
from truneg.eval import commands as eval_commands


def _synonyms_build(args) -> None:
    import time

    from truneg.synonyms import sources as synonym_sources

    tokens, kind, normalize = _table_vocab(args)
    start = time.perf_counter()
    if args.source == "wordnet":
        table = synonym_sources.build_from_wordnet(tokens, morphy=not args.exact, progress=True, kind=kind)
    elif args.source == "embedding":
        if not args.embeddings:
            raise UserError("--source embedding needs --embeddings (a word2vec file or an HF model folder)")
        table = synonym_sources.build_from_embeddings(tokens, args.embeddings, args.top_k, args.min_cosine, kind)
    else:
        if not args.tsv:
            raise UserError("--source tsv needs --tsv FILE (one `word<TAB>synonym` per line)")
        table = synonym_sources.build_from_tsv(tokens, args.tsv, kind, normalize)
    table.save(args.out)
    print(f"{args.out}: {table.num_rows_with_synonyms} words with synonyms, {table.num_entries} entries, "
          f"source {table.source}, built in {time.perf_counter() - start:.1f} s")


def _table_vocab(args) -> tuple[list[str], str, object]:
    """--vocab FILE (WordPiece) or --tokenizer DIR|NAME: its tokens as training lists them (`convert_ids_to_tokens` in
    id order: the table's vocab hash is over them), its kind, and its normaliser for TSV words (None: as written)."""
    from truneg.data.blocks import load_tokenizer
    from truneg.data.words import tokenizer_kind
    from truneg.synonyms import table as synonyms

    if args.vocab:
        return synonyms.read_vocab(args.vocab), "WordPiece", None
    tokenizer = load_tokenizer(args.tokenizer)
    kind = tokenizer_kind(tokenizer)
    if kind not in synonyms.WORD_STARTS:
        raise UserError(f"--tokenizer {args.tokenizer} is {kind or 'of no kind truneg can read'}; synonym tables read "
                        f"{', '.join(synonyms.WORD_STARTS)} vocabularies")
    normalizer = tokenizer.backend_tokenizer.normalizer
    return (tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))), kind,
            normalizer.normalize_str if normalizer is not None else None)


def _synonyms_show(args) -> None:
    from truneg.synonyms import table as synonyms

    expect = _table_vocab(args)[0] if args.vocab or args.tokenizer else None
    table = synonyms.SynonymTable.load(args.table, expect_tokens=expect)
    for word in args.words:
        print(f"{word}\t{' '.join(table.synonyms_of(word))}")


def _export(args) -> None:
    from truneg.train.checkpointing.export import export

    for part, folder in export(args.checkpoint, args.out_dir, args.tokenizer).items():
        print(f"{part}: {folder}")


def _verify(args) -> None:
    from truneg.train.checkpointing import checkpoint, integrity

    if args.tag:
        checkpoint_dir, tag = Path(args.checkpoints), args.tag
        if not (checkpoint_dir / tag).is_dir():
            raise UserError(f"{checkpoint_dir / tag} does not exist; pass a checkpoints folder and one of its tags")
    else:
        checkpoint_dir, tag = checkpoint.resolve_tag(args.checkpoints)
    found, warning = integrity.verify_offline(checkpoint_dir / tag)
    if warning:
        print(f"truneg: warning: {warning}", file=sys.stderr)
    for line in found:
        print(f"truneg: error: {line}", file=sys.stderr)
    if found:
        sys.exit(2)
    print(f"{checkpoint_dir / tag}: intact")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="truneg", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    # The `deepspeed` launcher puts --local_rank=N before the command (`deepspeed -m truneg.cli finetune glue
    # ...`); the rank is read from LOCAL_RANK, as HF's Trainer does.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    syn = commands.add_parser("synonyms", help="build or inspect synonym tables").add_subparsers(dest="action",
                                                                                                 required=True)
    build = syn.add_parser("build", help="build a CSR synonym table (.npz)")
    vocab = build.add_mutually_exclusive_group(required=True)
    vocab.add_argument("--vocab", help="a WordPiece vocab.txt, or a tokenizer folder holding one")
    vocab.add_argument("--tokenizer", help="a tokenizer (folder or hub name) of any kind truneg reads: its tokens as "
                       "training lists them")
    build.add_argument("--source", choices=["wordnet", "embedding", "tsv"], default="wordnet")
    build.add_argument("--tsv", help="for --source tsv: word<TAB>synonym lines")
    build.add_argument("--embeddings", help="for --source embedding: word2vec file (text or binary) or HF model folder")
    build.add_argument("--top-k", type=int_at_least(1), default=10)
    build.add_argument("--min-cosine", type=float_between(-1, 1, low_open=False), default=0.6)
    forms = build.add_mutually_exclusive_group()
    forms.add_argument("--exact", action="store_true",
                       help="WordNet: only synsets that list the word itself (no lemmatisation; symmetric)")
    forms.add_argument("--morphy", action="store_true",
                       help="WordNet: synsets as wn.synsets(word) gives them, lemmatised (the default; kept for old "
                            "scripts)")
    build.add_argument("--out", required=True, type=Path)
    build.set_defaults(func=_synonyms_build, output_paths=[("out", "--out", False)])
    show = syn.add_parser("show", help="print the synonyms of words")
    show.add_argument("table", type=Path)
    show.add_argument("words", nargs="+")
    show.add_argument("--vocab", help="refuse a table built for another vocab")
    show.add_argument("--tokenizer", help="refuse a table built for another tokenizer's vocab")
    show.set_defaults(func=_synonyms_show)

    exp = commands.add_parser("export", help="ZeRO checkpoint -> HF save_pretrained folder(s)")
    exp.add_argument("checkpoint", help="<output-dir>/checkpoints, a tag folder in it, or the output dir")
    exp.add_argument("out_dir")
    exp.add_argument("--tokenizer", help="tokenizer folder to save beside the weights (default: the run's own)")
    exp.set_defaults(func=_export)

    ver = commands.add_parser("verify", help="check a checkpoint's files against the checksums written at its save")
    ver.add_argument("checkpoints", help="<output-dir>/checkpoints (its `latest` tag) or a tag folder in it")
    ver.add_argument("--tag", help="the tag to check (default: the one `latest` names)")
    ver.set_defaults(func=_verify)

    # preflight takes pretrain.py's arguments, parsed by truneg.cluster.preflight itself (see main)
    commands.add_parser("preflight", add_help=False,
                        help="check a pre-training run before launching it: truneg preflight --help")

    data_commands.add_command(commands)
    eval_commands.add_commands(commands)
    return parser


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:
        from truneg.cluster import preflight

        sys.exit(preflight.run(argv[1:]))
    args = build_parser().parse_args(argv)
    # Each command's output paths (its `output_paths` default: dest, flag, folder or file), checked before any work
    for dest, flag, folder in getattr(args, "output_paths", ()):
        if getattr(args, dest) is not None:  # an optional output left out (`truneg eval` without --out)
            check_output_path(getattr(args, dest), flag, folder=folder)
    args.func(args)


if __name__ == "__main__":
    main()
    if "torch.distributed" in sys.modules:  # `finetune glue --deepspeed_config` set up a process group
        from truneg.train.ranks.distributed import shutdown

        shutdown()
