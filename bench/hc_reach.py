"""HC's reach: the share of masked positions that are words of their own with synonyms (the gold token has a row in the
table and the next original token does not continue its word), as training's `hc_reach` counts it, on a corpus
masked as training masks it (seed 42, epoch 0), against the share of masked positions that are whole-word tokens at
all, side by side.
bert-base-uncased's WordPiece by default; `--bpe-vocab N`: a byte-level BPE of N tokens (RoBERTa's kind) trained on
the same text here (nothing is downloaded), with the WordNet table built for it.

    python bench/hc_reach.py [--data ../shared/data/wikitext-2-raw/wiki.valid.raw] [--seq-len 128]
        [--mlm-probability 0.15] [--whole-word-masking] [--bpe-vocab 30000] [--table FILE.npz]
RESULT hc_reach=<share> whole_words=<share> masked=<positions>
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from truneg.data.blocks import load_tokenizer, open_training_blocks  # noqa: E402
from truneg.data.masking import default_max_predictions, mask_scheme, mask_tokens, word_boundaries  # noqa: E402
from truneg.data.words import tokenizer_kind  # noqa: E402
from truneg.synonyms.sources import wordnet_for_vocab  # noqa: E402
from truneg.synonyms.table import (  # noqa: E402
    SynonymLookup,
    SynonymTable,
    eligible_token_ids,
)


def bpe_tokenizer(data: str, size: int, folder: Path):
    """A byte-level BPE tokenizer of `size` tokens trained on `data`, with RoBERTa's specials, as AutoTokenizer loads
    it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<s>", "<pad>", "</s>", "<mask>"]
    bpe.train([data], trainers.BpeTrainer(vocab_size=size, special_tokens=specials,
                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
                            pad_token="<pad>", mask_token="<mask>").save_pretrained(folder / "bpe")
    return AutoTokenizer.from_pretrained(folder / "bpe")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.valid.raw"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--mlm-probability", type=float, default=0.15)
    parser.add_argument("--whole-word-masking", action="store_true")
    parser.add_argument("--bpe-vocab", type=int, help="a byte-level BPE of this many tokens, trained on --data")
    parser.add_argument("--table", help="default: the WordNet table of the vocabulary (the shipped one for BERT's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        tokenizer = bpe_tokenizer(args.data, args.bpe_vocab, Path(cache)) if args.bpe_vocab else load_tokenizer()
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        kind = tokenizer_kind(tokenizer)
        table = SynonymTable.load(args.table, expect_tokens=tokens) if args.table else wordnet_for_vocab(tokens, kind)
        lookup = SynonymLookup(table)
        whole = torch.zeros(len(tokens), dtype=torch.bool)
        whole[torch.from_numpy(eligible_token_ids(tokens, kind))] = True
        slots = default_max_predictions(args.seq_len, args.mlm_probability)
        blocks, _ = open_training_blocks([args.data], tokenizer, args.seq_len, cache_dir=Path(cache))
        judged = whole_words = masked = 0
        # whole words as training takes them: WordPiece's by `##`, a BPE's by the starts its preparation stored
        continues, stored = word_boundaries(tokenizer, blocks) if args.whole_word_masking else (None, False)
        for start in range(0, len(blocks), 256):
            indices = np.arange(start, min(start + 256, len(blocks)))
            batch = mask_tokens(blocks[indices], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                                mask_scheme("bert", args.mlm_probability), 42, 0, indices, slots, continues,
                                blocks.word_starts(indices) if stored else None)
            original, positions, valid = batch["original_ids"], batch["masked_positions"], batch["masked_valid"]
            gold = original.gather(1, positions)
            following = original.gather(1, (positions + 1).clamp(max=original.shape[1] - 1))
            judged += int((lookup.judgeable(gold, following) & valid).sum())
            whole_words += int((whole[gold] & valid).sum())
            masked += int(valid.sum())
    vocab = f"a {kind} of {len(tokens)} tokens" if args.bpe_vocab else "bert-base-uncased WordPiece"
    print(f"{args.data}: {len(blocks)} blocks of {args.seq_len} tokens, {masked} masked positions at "
          f"{args.mlm_probability:g} ({'whole-word' if args.whole_word_masking else 'token'} masking, {vocab}); "
          f"whole-word tokens {whole_words / masked:.1%}, judgeable by the {table.source} table "
          f"{judged / masked:.1%}")
    print(f"RESULT hc_reach={judged / masked:.4f} whole_words={whole_words / masked:.4f} masked={masked}")


if __name__ == "__main__":
    main()
