"""Word starts of byte-level BPE and SentencePiece tokenizers, stored by `truneg prepare` (format 2), and whole-word
masking over them: the pre-tokenizer's words (line-initial and quoted words), whole words up to the count on the
shipped novel, a pure function of (seed, epoch, index), and older folders (format 1) refused with one line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from truneg.data import prepare, words
from truneg.data.blocks import DEMO_CORPUS, ResumableSampler, load_tokenizer, open_prepared, whole_word_problem
from truneg.data.masking import MaskedBatches, mask_scheme, mask_tokens
from truneg.errors import UserError

NOVEL = DEMO_CORPUS / "austen_pride_and_prejudice.txt"
KINDS = ("byte-level BPE", "SentencePiece")
SPECIALS = ["<s>", "</s>", "<pad>", "<mask>", "<unk>"]


def trained_tokenizer(kind: str, folder, texts: list[str], split: bool = True):
    """A BPE of 1,000 tokens trained on `texts`, with byte-level BPE's pre-tokenizer (RoBERTa's kind) or Metaspace's
    (SentencePiece's, as XLM-R's), RoBERTa's specials, loaded back through AutoTokenizer as a user's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if kind == "byte-level BPE":
        backend = Tokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend = Tokenizer(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(split=split)
        alphabet = []
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS,
                                                           initial_alphabet=alphabet, show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                            sep_token="</s>", pad_token="<pad>", mask_token="<mask>",
                            unk_token="<unk>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def kinds(tmp_path_factory) -> dict:
    """Each kind's tokenizer (folder, tokenizer) and the shipped novel prepared with it in blocks of 128."""
    lines = NOVEL.read_text().splitlines()
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind.replace(" ", "-"))
        tokenizer = trained_tokenizer(kind, root / "tokenizer", lines)
        prepared = prepare.prepare(str(NOVEL), tokenizer, 128, root / "prepared", 1, progress=False)
        out[kind] = root / "tokenizer", tokenizer, open_prepared(prepared, tokenizer, 128)
    return out


def spelled_words(tokenizer, ids: list[int], starts: list[bool]) -> list[str]:
    """The words the start bits cut a stream of tokens into, each spelled by its tokens (`Ġ` as a space)."""
    tokens = [t.replace("\u0120", " ") for t in tokenizer.convert_ids_to_tokens(ids)]
    out: list[str] = []
    for token, start in zip(tokens, starts):
        if start or not out:
            out.append(token)
        else:
            out[-1] += token
    return out


# The novel's first lines of dialogue: each starts with a quoted word, with no leading space.
LINES = ['"My dear Mr. Bennet," said his lady to him one day, "have you heard that Netherfield Park is let at last?"',
         "Mr. Bennet replied that he had not.",
         "\"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Don't."]
EXPECTED = {
    # GPT-2's pattern: letters, punctuation runs, spaces before a word, `'t` apart
    "byte-level BPE": ['"', "My", " dear", " Mr", ".", " Bennet", ',"', " said", " his", " lady", " to", " him", " one",
                       " day", ",", ' "', "have", " you", " heard", " that", " Netherfield", " Park", " is", " let",
                       " at", " last", '?"',
                       "Mr", ".", " Bennet", " replied", " that", " he", " had", " not", ".",
                       '"', "But", " it", " is", ',"', " returned", " she", ";", ' "', "for", " Mrs", ".", " Long",
                       " has", " just", " been", " here", ",", " and", " she", " told", " me", " all", " about", " it",
                       '."', " Don", "'t", "."],
    # Metaspace: a word from one space to the next, its punctuation and quotes with it
    "SentencePiece": ['▁"My', "▁dear", "▁Mr.", '▁Bennet,"', "▁said", "▁his", "▁lady", "▁to", "▁him", "▁one", "▁day,",
                      '▁"have', "▁you", "▁heard", "▁that", "▁Netherfield", "▁Park", "▁is", "▁let", "▁at", '▁last?"',
                      "▁Mr.", "▁Bennet", "▁replied", "▁that", "▁he", "▁had", "▁not.",
                      '▁"But', "▁it", '▁is,"', "▁returned", "▁she;", '▁"for', "▁Mrs.", "▁Long", "▁has", "▁just",
                      "▁been", "▁here,", "▁and", "▁she", "▁told", "▁me", "▁all", "▁about", '▁it."', "▁Don't."],
}


@pytest.mark.parametrize("kind", KINDS)
def test_prepared_word_starts_are_the_pre_tokenizers_words(tmp_path, kinds, kind, monkeypatch):
    """Line-initial and quoted words start where the tokenizer's pre-tokenizer splits, whatever the marks say; the bits
    follow the ids through packing, a long line's slices, parts and merge; WordPiece stores none."""
    from truneg.data import corpus, encoding

    _, tokenizer, novel = kinds[kind]
    assert words.tokenizer_kind(tokenizer) == kind and novel.index["format"] == prepare.FORMAT
    text = tmp_path / "lines.txt"
    text.write_text("\n".join(LINES * 6) + "\n")
    out = prepare.prepare(str(text), tokenizer, 16, tmp_path / "p", 1, progress=False)
    blocks = open_prepared(out, tokenizer, 16)
    every = np.arange(len(blocks))
    ids, starts = blocks[every][:, 1:-1].reshape(-1), blocks.word_starts(every)[:, 1:-1].reshape(-1)
    assert spelled_words(tokenizer, ids.tolist(), starts.tolist())[:len(EXPECTED[kind])] == EXPECTED[kind]
    # [CLS] and [SEP] carry a set bit; what the bits are next to them is the ids' stream, cut as the ids are
    assert blocks.word_starts(every)[:, [0, -1]].all()
    # a line longer than a slice: cut before whitespace, the same words as the whole line
    backend = tokenizer.backend_tokenizer
    book = " ".join(LINES * 4)
    monkeypatch.setattr(corpus, "SLICE_CHARS", 64)
    sliced_ids, sliced_starts = encoding.encode_words(backend, [book], 0, rows_are_documents=False)
    whole = backend.encode(book, add_special_tokens=False)
    assert sliced_ids.tolist() == whole.ids
    assert sliced_starts.tolist() == list(words.encoding_starts(whole.word_ids))
    monkeypatch.undo()
    # two parts merged: the same bits (their paths kept relative to the merged folder)
    for i in range(2):
        prepare.prepare(str(text), tokenizer, 16, tmp_path / f"part{i}", 1, part=(i, 2), unit_bytes=1024,
                        progress=False)
    whole_units = open_prepared(prepare.prepare(str(text), tokenizer, 16, tmp_path / "units", 1, unit_bytes=1024,
                                                progress=False))
    merged = open_prepared(prepare.merge([tmp_path / "part0", tmp_path / "part1"], tmp_path / "merged"))
    every = np.arange(len(merged))
    assert len(merged.index["shards"]) > 1 and merged.has_word_starts
    assert (merged.word_starts(every) == whole_units.word_starts(every)).all()
    # a committed shard whose bits are lost is prepared again
    lost = tmp_path / "units" / whole_units.index["shards"][0]["starts"]
    kept = lost.read_bytes()
    lost.unlink()
    prepare.prepare(str(text), tokenizer, 16, tmp_path / "units", 1, unit_bytes=1024, progress=False)
    assert lost.read_bytes() == kept


def test_wordpiece_folders_store_no_bits_and_keep_their_fingerprint(tmp_path):
    """WordPiece's `##` tells its words: no bits, and its folder stays format 1, its fingerprint the one runs recorded.
    A byte-level BPE's unfinished preparation of format 1 (no bits) in --out is not continued in format 2."""
    tokenizer = load_tokenizer()
    text = tmp_path / "t.txt"
    text.write_text("The primary reason was clear, and the naive clerk sold tea. " * 40)
    blocks = open_prepared(prepare.prepare(str(text), tokenizer, 16, tmp_path / "p", 1, progress=False))
    assert blocks.index["format"] == prepare.FORMAT_WITHOUT_STARTS and not blocks.has_word_starts
    assert not list((tmp_path / "p" / "shards").glob(f"*{words.STARTS_SUFFIX}"))
    assert blocks.fingerprint == "06110dda855af80d4ab69f2b79f9a1860928c65aa7e36c46c7a7c2891794dd20"
    # the settings a preparation is claimed and cached by are those of format 1: the same key
    assert "word_starts" not in prepare.plan(str(text), tokenizer, 16)[0]
    from conftest import bpe_tokenizer

    bpe, unfinished = bpe_tokenizer(tmp_path / "bpe"), tmp_path / "unfinished"
    settings = prepare.plan(str(text), bpe, 16)[0]
    prepare._claim(unfinished, {k: v for k, v in settings.items() if k != "word_starts"}
                   | {"format": prepare.FORMAT_WITHOUT_STARTS})
    with pytest.raises(UserError, match="holds a preparation with another format"):
        prepare.prepare(str(text), bpe, 16, unfinished, 1, progress=False)
    # training's whole-word masking of a WordPiece folder: `##`, as mask_tokens reads it
    from truneg.synonyms.table import continuing_pieces

    epoch, at = next(iter(ResumableSampler(len(blocks), 4, 1, 0, seed=1)))
    batch = next(MaskedBatches(blocks, ResumableSampler(len(blocks), 4, 1, 0, seed=1), tokenizer, "bert", 0, 4,
                               whole_words=True))
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    direct = mask_tokens(blocks[at], sorted(tokenizer.all_special_ids), tokenizer.mask_token_id, len(tokenizer),
                         "bert", 0, epoch, at, 4, continuing_pieces(vocab))
    assert batch.keys() == direct.keys() and all(torch.equal(batch[k], direct[k]) for k in direct)


def stored_words(starts: list[bool], special: list[bool]) -> list[list[int]]:
    """The reference reading of a row's words, position by position: a non-special position starts a word where its
    bit is set or the position before is special."""
    out: list[list[int]] = []
    for p, (start, is_special) in enumerate(zip(starts, special)):
        if is_special:
            continue
        if start or p == 0 or special[p - 1]:
            out.append([p])
        else:
            out[-1].append(p)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_whole_word_masking_by_stored_starts_takes_whole_words_up_to_the_count(kinds, kind):
    _, tokenizer, blocks = kinds[kind]
    indices = np.arange(len(blocks))
    rows, starts = blocks[indices].astype(np.int64), blocks.word_starts(indices)
    rows[::7, 60] = tokenizer.sep_token_id  # a special mid-row: no word spans it, the token after it starts one
    special_ids = tokenizer.all_special_ids

    def masked(at: np.ndarray) -> dict:
        return mask_tokens(rows[at], special_ids, tokenizer.mask_token_id, len(tokenizer),
                           mask_scheme("bert", None, 1.0, 0.0), 5, 0, indices[at], 20, word_starts=starts[at])

    batch = masked(indices)
    target, valid = batch["masked_target"].numpy(), batch["masked_valid"].numpy()
    counts = valid.sum(axis=1)
    special = np.isin(rows, special_ids)
    assert (target == np.minimum(20, np.rint(0.15 * (~special).sum(axis=1)))).all() and (counts <= target).all()
    assert (counts == target).mean() >= 0.99, (counts == target).mean()
    for row in range(len(rows)):
        picked = set(batch["masked_positions"][row][valid[row]].tolist())
        for word in stored_words(starts[row].tolist(), special[row].tolist()):
            assert set(word) <= picked or not set(word) & picked, (row, word)  # never part of a word
        assert not special[row, sorted(picked)].any()
        assert (batch["input_ids"][row, sorted(picked)] == tokenizer.mask_token_id).all()
    # a pure function of (seed, epoch, index): the same rows in another batch, as another rank or a resume reads them
    again = masked(indices[5:9])
    assert all(torch.equal(again[k], batch[k][5:9]) for k in again)


def test_masked_batches_read_the_stored_starts_alike_on_one_and_two_ranks_and_after_a_resume(kinds):
    """MaskedBatches on the prepared blocks (as training builds them): two ranks' micro-batches are the halves of one
    rank's, a resumed sampler gives the same batches, and so do workers (which get the blocks pickled)."""
    import pickle

    _, tokenizer, blocks = kinds["byte-level BPE"]
    take = {}

    def batches(world: int, rank: int, micro: int, n: int, state=None, workers: int = 0, source=blocks) -> list:
        sampler = ResumableSampler(len(blocks), micro, world, rank, seed=3)
        if state:
            sampler.load_state_dict(state)
        it = MaskedBatches(source, sampler, tokenizer, "bert", seed=0, max_predictions=20, workers=workers,
                           whole_words=True)
        out = [next(it) for _ in range(n)]
        take[(world, rank, workers)] = it.position
        return out

    one = batches(1, 0, 8, 6)
    two = [batches(2, r, 4, 6) for r in range(2)]
    assert "masked_target" in one[0]
    for step in range(6):
        for key in one[step]:
            assert torch.equal(one[step][key], torch.cat([two[0][step][key], two[1][step][key]])), (step, key)
    resumed = batches(1, 0, 8, 3, state={"epoch": 0, "offset": 24})
    assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, one[3:]) for k in a)
    unpickled = pickle.loads(pickle.dumps(blocks))
    ahead = batches(1, 0, 8, 6, workers=1, source=unpickled)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(ahead, one) for k in a)


def test_whole_word_masking_where_word_starts_cannot_be_told_is_one_line(tmp_path, kinds, capsys, monkeypatch):
    """A folder prepared before word starts were stored (format 1), with a byte-level BPE tokenizer: one line, exit 2,
    nothing written; without the flag it trains as before. A tokenizer of another kind, or whose pre-tokenizer does
    not split words, is one line too."""
    import shutil

    from truneg.errors import exit_on_user_error
    from truneg.train.build import checked_start

    folder, tokenizer, blocks = kinds["byte-level BPE"]
    old = tmp_path / "old"
    shutil.copytree(blocks.folder, old)
    index = json.loads((old / prepare.INDEX).read_text())
    index["format"] = prepare.FORMAT_WITHOUT_STARTS  # as a preparation before format 2 wrote it
    del index["word_starts"]
    for shard in index["shards"]:
        (old / shard.pop("starts")).unlink()
    (old / prepare.INDEX).write_text(json.dumps(index))
    reopened = open_prepared(old, tokenizer, 128)
    assert not reopened.has_word_starts and reopened.fingerprint == blocks.fingerprint
    every = np.arange(len(blocks))
    assert (reopened[every] == blocks[every]).all()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    argv = ["--model", "bert-tiny", "--tokenizer", str(folder), "--train-data", str(old), "--seq-len", "128",
            "--whole-word-masking", "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(checked_start)(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"truneg: error: --whole-word-masking: {old} was prepared in format 'truneg-prepared/1'")
    assert "truneg prepare --train-data CORPUS" in err[0] and "--out NEW_DIR" in err[0]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()
    with pytest.raises(UserError, match="the prepared blocks hold no word starts"):
        MaskedBatches(reopened, ResumableSampler(len(reopened), 4, 1, 0, 0), tokenizer, "bert", 0, 20,
                      whole_words=True)
    # the prepared folder of format 2 passes
    assert whole_word_problem(tokenizer, str(folder), str(blocks.folder), 128) is None
    # a pre-tokenizer that makes one word of a line (Metaspace without its split, as Llama's), and a kind truneg
    # reads no words of (a word-level vocab)
    unsplit = trained_tokenizer("SentencePiece", tmp_path / "unsplit", LINES, split=False)
    assert "does not split text into words" in whole_word_problem(unsplit, "U", str(NOVEL), 128)
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    level = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert "--tokenizer W is WordLevel, whose word starts truneg cannot tell" in whole_word_problem(level, "W", "x", 8)


def test_a_run_with_a_byte_level_bpe_tokenizer_masks_whole_words(world_of_one, kinds, tmp_path, monkeypatch):
    """pretrain.py in this process, 2 steps: the corpus prepared into the cache with its word starts, and whole-word
    masking over them (no piece short of the count)."""
    from truneg.pretrain import main

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    folder, _, _ = kinds["byte-level BPE"]
    main(["--model", "bert-tiny", "--tokenizer", str(folder), "--train-data", str(NOVEL), "--seq-len", "64",
          "--micro-batch-size", "4", "--max-steps", "2", "--save-steps", "2", "--whole-word-masking",
          "--output-dir", str(tmp_path / "run")])
    prepared = list((tmp_path / "cache" / "prepared").iterdir())
    assert len(prepared) == 1 and open_prepared(prepared[0]).has_word_starts
    assert json.loads((tmp_path / "run" / "run.json").read_text())["whole_word_masking"] is True
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["wwm_shortfall"] == 0
