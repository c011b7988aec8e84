"""Synonym tables on real WordNet (Debian's, through nltk), checked against nltk's own synset API."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import cli_in_process

from truneg.errors import UserError
from truneg.synonyms import sources as synonym_sources
from truneg.synonyms import table as synonyms
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable, eligible_token_ids
from truneg.synonyms.wordnet import load_wordnet

VOCAB = synonyms.Path(synonyms.__file__).parents[1] / "assets" / "vocab" / "vocab.txt"


@pytest.fixture(scope="module")
def tokens() -> list[str]:
    return synonyms.read_vocab(VOCAB)


@pytest.fixture(scope="module")
def shipped(tokens) -> SynonymTable:
    return SynonymTable.load(SHIPPED_WORDNET_TABLE, expect_tokens=tokens)


@pytest.fixture(scope="module")
def exact(tokens) -> SynonymTable:
    """The table of `truneg synonyms build --exact`: no lemmatisation."""
    return synonym_sources.build_from_wordnet(tokens, morphy=False)


def nltk_reference(tokens, morphy: bool) -> dict[str, set[str]]:
    """Slow reference through nltk's Synset objects: lemma_names of the word's synsets."""
    wn = load_wordnet()
    words = {tokens[i] for i in eligible_token_ids(tokens)}
    ref = {}
    for word in words:
        if morphy:
            synsets = wn.synsets(word)
        else:
            synsets = [wn.synset_from_pos_and_offset("a" if p == "s" else p, off)
                       for p, offs in wn._lemma_pos_offset_map.get(word, {}).items() for off in offs]
        names = {n.lower() for s in synsets for n in s.lemma_names() if "_" not in n}
        found = (names & words) - {word}
        if found:
            ref[word] = found
    return ref


def table_as_sets(table: SynonymTable) -> dict[str, set[str]]:
    return {table.tokens[i]: {table.tokens[j] for j in table.row(i)} for i in range(table.vocab_size)
            if len(table.row(i))}


def test_paper_pairs_present(shipped):
    assert {"main", "chief", "principal"} <= set(shipped.synonyms_of("primary"))
    assert {"remain", "continue"} <= set(shipped.synonyms_of("stay"))
    assert "primary" in shipped.synonyms_of("main")


def test_rows_hold_only_whole_words_and_never_the_word_itself(shipped):
    rows = np.repeat(np.arange(shipped.vocab_size), np.diff(shipped.indptr))
    assert not np.any(rows == shipped.indices), "a word is listed as its own synonym"
    used = set(rows.tolist()) | set(shipped.indices.tolist())
    bad = [shipped.tokens[i] for i in used if not shipped.tokens[i].isalpha() or len(shipped.tokens[i]) < 2
           or shipped.tokens[i].startswith(("##", "[")) or shipped.tokens[i] != shipped.tokens[i].lower()]
    assert bad == []
    for start, end in zip(shipped.indptr[:-1], shipped.indptr[1:]):
        assert np.all(np.diff(shipped.indices[start:end]) > 0), "rows must be sorted and unique"


def test_exact_table_is_symmetric_and_the_default_is_not(exact, shipped):
    for table, symmetric in ((exact, True), (shipped, False)):
        keys = set(table.keys().tolist())
        vocab = table.vocab_size
        assert all((k % vocab) * vocab + k // vocab in keys for k in keys) is symmetric
    # an inflection gets its lemma as a synonym, not the reverse
    assert "run" in shipped.synonyms_of("ran") and "ran" not in shipped.synonyms_of("run")


def test_exact_table_equals_nltk_synsets_and_size_matches_design(tokens, exact):
    assert table_as_sets(exact) == nltk_reference(tokens, morphy=False)
    assert 7_500 < exact.num_rows_with_synonyms < 8_500 and 26_000 < exact.num_entries < 29_000


def test_default_table_equals_wn_synsets(tokens, shipped, exact):
    assert table_as_sets(shipped) == nltk_reference(tokens, morphy=True)
    assert shipped.num_rows_with_synonyms > 1.5 * exact.num_rows_with_synonyms


@pytest.mark.parametrize("word, lemma", [("ran", "run"), ("stayed", "stay"), ("houses", "house"),
                                         ("children", "child"), ("better", "good"), ("mice", "mouse")])
def test_inflected_words_get_exactly_what_wn_synsets_gives(shipped, exact, word, lemma):
    # the reference is nltk's public API itself, imported as a user would, not truneg's reader
    from nltk.corpus import wordnet as wn

    vocab = set(shipped.tokens)
    expected = {n.lower() for s in wn.synsets(word) for n in s.lemma_names() if "_" not in n} & vocab - {word}
    got = set(shipped.synonyms_of(word))
    assert got == {w for w in expected if synonyms.word_of(w) is not None}
    assert lemma in got and lemma not in exact.synonyms_of(word)


def test_rebuilding_the_shipped_table_gives_identical_arrays(tokens, shipped):
    rebuilt = synonym_sources.build_from_wordnet(tokens)
    np.testing.assert_array_equal(rebuilt.indptr, shipped.indptr)
    np.testing.assert_array_equal(rebuilt.indices, shipped.indices)
    assert shipped.indptr.dtype == np.int64 and shipped.indices.dtype == np.int32
    assert shipped.source == "wordnet" and shipped.options["morphy"] is True
    assert rebuilt.content_sha256 == shipped.content_sha256


def test_content_hash_is_stable_and_sees_every_entry(tmp_path, shipped):
    path = tmp_path / "copy.npz"
    SynonymTable(shipped.indptr, shipped.indices, shipped.tokens, "tsv", {"other": 1}).save(path)
    assert SynonymTable.load(path).content_sha256 == shipped.content_sha256  # container, source, options: no
    assert len(shipped.content_sha256) == 64 and int(shipped.content_sha256, 16) >= 0
    changed = shipped.indices.copy()
    changed[-1] -= 1  # still sorted and unique: a real, valid, different table
    assert SynonymTable(shipped.indptr, changed, shipped.tokens, "wordnet").content_sha256 != shipped.content_sha256
    renamed = shipped.tokens[:-1] + ["zzzz"]
    assert SynonymTable(shipped.indptr, shipped.indices, renamed, "wordnet").content_sha256 != shipped.content_sha256


def write_raw_table(path, indptr, indices, tokens):
    np.savez(path, indptr=indptr, indices=indices, source=np.array("tsv"), options=np.array("{}"),
             vocab=np.frombuffer("\n".join(tokens).encode(), dtype=np.uint8),
             vocab_sha256=np.array(synonyms.vocab_sha256(tokens)))


BAD_TABLES = {
    # name: (indptr, indices, what the one-line error must say); vocab: [PAD] big large huge
    "unsorted row": ([0, 0, 2, 2, 2], [3, 2], "row 1 ('big') is not sorted and unique"),
    "duplicate in row": ([0, 0, 0, 2, 2], [1, 1], "row 2 ('large') is not sorted and unique"),
    "self pair": ([0, 0, 2, 2, 2], [1, 2], "row 1 ('big') lists the word as its own synonym"),
    "float indptr": (np.array([0, 0, 1, 1, 1], dtype=np.float64), [2], "indptr is float64 [5], expected int64 [5]"),
    "short indptr": ([0, 0, 1, 1], [2], "indptr is int64 [4], expected int64 [5]"),
    "int64 indices": ([0, 0, 1, 1, 1], np.array([2], dtype=np.int64), "indices is int64 [1], expected a 1-D int32"),
    "2-D indices": ([0, 0, 1, 1, 1], np.array([[2]], dtype=np.int32), "expected a 1-D int32"),
    "index out of vocab": ([0, 0, 1, 1, 1], [4], "indices must lie in [0, 4)"),
}


@pytest.mark.parametrize("name", list(BAD_TABLES))
def test_load_refuses_a_malformed_csr_with_one_clear_error(tmp_path, name):
    indptr, indices, message = BAD_TABLES[name]
    indptr = np.asarray(indptr, dtype=getattr(indptr, "dtype", np.int64))
    indices = np.asarray(indices, dtype=getattr(indices, "dtype", np.int32))
    write_raw_table(tmp_path / "bad.npz", indptr, indices, ["[PAD]", "big", "large", "huge"])
    with pytest.raises(UserError) as err:
        SynonymTable.load(tmp_path / "bad.npz")
    assert message in str(err.value) and "\n" not in str(err.value) and "rebuild it" in str(err.value)


def test_lookup_refuses_ids_outside_the_table_vocab(shipped):
    vocab = shipped.vocab_size
    keys = torch.from_numpy(shipped.keys())
    rows, cols = keys // vocab, keys % vocab
    # for each real pair (g + 1, k): (g, V + k) would read as that pair's key without the bound
    gold, pred = rows[rows > 0] - 1, cols[rows > 0] + vocab
    lookup = SynonymLookup(shipped)
    assert not lookup.is_synonym(gold, pred).any()
    # and the other side: gold = V + g with pred k aliases row g + 1... as key (V + g) * V + k; negatives too
    assert not lookup.is_synonym(rows + vocab, cols).any()
    assert not lookup.is_synonym(rows - vocab, cols).any() and not lookup.is_synonym(rows, cols - vocab).any()
    assert lookup.is_synonym(rows, cols).all()  # the real pairs still are


def test_lookup_agrees_with_python_sets_on_random_and_real_pairs(shipped):
    gen = torch.Generator().manual_seed(0)
    vocab = shipped.vocab_size
    real = torch.from_numpy(shipped.keys())
    real_pairs = torch.stack([real // vocab, real % vocab], 1)
    random_pairs = torch.randint(0, vocab, (100_000, 2), generator=gen)
    swapped = real_pairs[:, [0, 0]]  # the word with itself: never a synonym
    pairs = torch.cat([real_pairs, random_pairs, swapped])
    pairs = pairs[: len(pairs) // 7 * 7]  # reshaped to [-1, 7] below: the lookup keeps any shape
    reference = {(int(a), int(b)) for a, b in real_pairs}
    expected = torch.tensor([(int(a), int(b)) in reference for a, b in pairs])
    lookup = SynonymLookup(shipped)
    for module in (lookup, lookup.half(), lookup.bfloat16()):
        assert module.keys.dtype == torch.int64
        got = module.is_synonym(pairs[:, 0].reshape(-1, 7), pairs[:, 1].reshape(-1, 7)).reshape(-1)
        assert torch.equal(got, expected)
    assert "keys" not in lookup.state_dict()


def test_hc_can_judge_a_gold_token_with_a_row_that_ends_its_word(shipped):
    """HC's reach (`judgeable`) against the table and the vocab read as words: `big` has a row, `running` is pieces."""
    tokens = shipped.tokens
    ids = {t: tokens.index(t) for t in ("big", "large", "run", "##ning", "the", "[SEP]")}
    assert shipped.row(ids["big"]).size and not shipped.row(ids["the"]).size
    gold = torch.tensor([[ids["big"], ids["big"], ids["the"], ids["big"], ids["large"]]])
    following = torch.tensor([[ids["the"], ids["##ning"], ids["big"], ids["[SEP]"], len(tokens)]])
    got = SynonymLookup(shipped).judgeable(gold, following)
    assert got.tolist() == [[True, False, False, True, False]]  # (an id outside the vocab: never)
    # every token: a row, and no `##` continuing it, exactly
    lookup = SynonymLookup(shipped)
    every = torch.arange(shipped.vocab_size)
    expected = [bool(shipped.row(i).size) for i in range(shipped.vocab_size)]
    assert lookup.judgeable(every, torch.full_like(every, ids["the"])).tolist() == expected
    assert not lookup.judgeable(every, torch.full_like(every, ids["##ning"])).any()


def test_a_cased_vocabulary_gets_its_capitalised_words_synonyms_in_their_case():
    """wn.synsets lower-cases its query; WordNet's index holds lower-case lemmas. A cased vocabulary's "Big"
    has large's synonyms written as it is: "Large", not "large" (a different token)."""
    table = synonym_sources.build_from_wordnet(["[PAD]", "Big", "large", "big", "Large", "Primary", "Main", "main",
                                                "USA", "US"])
    assert table.synonyms_of("Big") == ["Large"] and table.synonyms_of("big") == ["large"]
    assert table.synonyms_of("Primary") == ["Main"] and table.synonyms_of("USA") == ["US"]


def test_embedding_source_text_and_binary(tmp_path):
    tokens = ["[PAD]", "[UNK]", "big", "large", "huge", "tiny", "##s", "a"]
    vectors = {"big": [1, 0, 0], "large": [0.95, 0.1, 0], "huge": [0.9, 0.3, 0], "tiny": [-1, 0, 0], "##s": [1, 0, 0],
               "a": [1, 0, 0]}
    text = tmp_path / "vec.txt"
    text.write_text(f"{len(vectors)} 3\n" + "".join(f"{w} {' '.join(map(str, v))}\n" for w, v in vectors.items()))
    binary = tmp_path / "vec.bin"
    with open(binary, "wb") as fh:
        fh.write(f"{len(vectors)} 3\n".encode())
        fh.writelines(w.encode() + b" " + np.asarray(v, dtype=np.float32).tobytes() for w, v in vectors.items())
    for path in (text, binary):
        table = synonym_sources.build_from_embeddings(tokens, path, top_k=1, min_cosine=0.8)
        assert table.synonyms_of("big") == ["large"]
        assert table.synonyms_of("huge") == ["large"]
        assert table.synonyms_of("tiny") == []  # its nearest neighbour is below the threshold
        assert table.synonyms_of("##s") == [] and table.synonyms_of("a") == []
    # unusable embeddings: one line each (UserError), not a traceback
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(binary.read_bytes()[:-5])
    cased = tmp_path / "cased.txt"
    cased.write_text("2 3\nBig 1 0 0\nLarge 1 0 0\n")
    (tmp_path / "not_a_model").mkdir()
    for source, said in ((truncated, "ends after 5 of the 6 vectors"), (cased, "no word of the vocab has a vector"),
                         (tmp_path / "not_a_model", "cannot load model")):
        with pytest.raises(UserError, match=said):
            synonym_sources.build_from_embeddings(tokens, source, top_k=1)


def test_tsv_source(tmp_path, tokens):
    tsv = tmp_path / "syn.tsv"
    tsv.write_text("primary\tmain\nmain\t##s\nfoo_bar\tmain\n")
    table = synonym_sources.build_from_tsv(tokens, tsv)
    assert table.synonyms_of("primary") == ["main"] and table.num_entries == 1


def test_save_load_roundtrip(tmp_path, shipped, tokens):
    path = tmp_path / "t.npz"
    shipped.save(path)
    loaded = SynonymTable.load(path, expect_tokens=tokens)
    assert np.array_equal(loaded.indices, shipped.indices) and loaded.options == shipped.options


def test_bad_inputs_are_clear_errors(tmp_path, shipped, tokens, monkeypatch):
    other_vocab = tokens[:-1] + ["zzzz"]
    with pytest.raises(UserError, match=r"built for vocab sha256 07eced375cec.*vocab is sha256 [0-9a-f]{12}"):
        SynonymTable.load(SHIPPED_WORDNET_TABLE, expect_tokens=other_vocab)
    data = SHIPPED_WORDNET_TABLE.read_bytes()
    (tmp_path / "trunc.npz").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.npz").write_bytes(b"not a zip at all")
    for name in ("trunc.npz", "garbage.npz"):
        with pytest.raises(UserError, match="corrupt or truncated"):
            SynonymTable.load(tmp_path / name)
    with pytest.raises(UserError, match="does not exist"):
        SynonymTable.load(tmp_path / "missing.npz")
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(UserError, match="no `word<TAB>synonym` pair"):
        synonym_sources.build_from_tsv(tokens, tmp_path / "empty.tsv")


def test_missing_wordnet_is_one_clear_error(tmp_path, monkeypatch, tokens):
    import nltk

    from truneg.synonyms import wordnet as wordnet_setup

    load_wordnet.cache_clear()
    monkeypatch.setattr(nltk.data, "path", [str(tmp_path)])
    monkeypatch.setattr(wordnet_setup, "default_root", lambda: tmp_path)
    try:
        with pytest.raises(UserError, match="apt-get install wordnet-base"):
            synonym_sources.build_from_wordnet(tokens)
    finally:
        load_wordnet.cache_clear()


def test_cli_show_and_vocab_refusal(tmp_path):
    out = cli_in_process("synonyms", "show", str(SHIPPED_WORDNET_TABLE), "primary", "stay", "--vocab", str(VOCAB))
    assert out.returncode == 0, out.stderr
    out = out.stdout.splitlines()
    assert out[0].split("\t")[0] == "primary" and "main" in out[0].split("\t")[1].split()
    assert out[1].startswith("stay\t") and "remain" in out[1].split("\t")[1].split()
    other = tmp_path / "vocab.txt"
    other.write_text("[PAD]\n[UNK]\nhello\n")
    proc = cli_in_process("synonyms", "show", str(SHIPPED_WORDNET_TABLE), "primary", "--vocab", str(other))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "rebuild the table" in proc.stderr and "Traceback" not in proc.stderr
    write_raw_table(tmp_path / "unsorted.npz", np.array([0, 0, 2, 2], dtype=np.int64), np.array([2, 1], dtype=np.int32),
                    ["[PAD]", "big", "large"])
    proc = cli_in_process("synonyms", "show", str(tmp_path / "unsorted.npz"), "big")
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("truneg: error: synonym table") and "not sorted and unique" in proc.stderr


def test_a_byte_level_bpe_vocabs_table_holds_its_word_start_tokens_only(tmp_path):
    """A byte-level BPE vocabulary (RoBERTa's kind: `Ġbig` starts a word, `ain` continues one): the table's rows and
    synonyms are its word-start tokens, looked up by their words (`Ġbig` -> `Ġlarge`), never a word-internal piece
    (`ain`, or `the` glued to a line's start, which the WordPiece rule would take for words); HC's reach reads
    `ain` as a continuation. A tokenizer whose kind cannot be read is one line with --hc."""
    from types import SimpleNamespace

    from conftest import bpe_tokenizer

    from truneg.data.words import tokenizer_kind
    from truneg.train.build import synonym_table

    loaded = bpe_tokenizer(tmp_path / "bpe")
    tokens = loaded.convert_ids_to_tokens(list(range(len(loaded))))
    assert tokenizer_kind(loaded) == "byte-level BPE" and {"Ġbig", "Ġlarge", "ain", "the"} <= set(tokens)
    table = synonym_table(SimpleNamespace(hc="wordnet", tokenizer="my-bpe"), loaded)
    rows = [i for i in range(table.vocab_size) if table.row(i).size]
    assert rows and all(tokens[i].startswith("Ġ") and tokens[i][1:].isalpha() for i in rows)
    assert all(tokens[j].startswith("Ġ") for i in rows for j in table.row(i))
    assert "Ġlarge" in table.synonyms_of("Ġbig") and table.options["tokenizer_kind"] == "byte-level BPE"
    lookup = SynonymLookup(table)
    big, ain, comma = (torch.tensor([tokens.index(t)]) for t in ("Ġbig", "ain", ","))
    assert lookup.judgeable(big, comma).item() and not lookup.judgeable(big, ain).item()
    assert synonym_table(SimpleNamespace(hc="none", tokenizer="my-bpe"), loaded) is None

    class Unreadable:  # a slow tokenizer: no backend to read its kind from
        def __len__(self):
            return 3

        def convert_ids_to_tokens(self, ids):
            return ["a", "b", "c"]

    with pytest.raises(UserError, match="is of no kind truneg can read"):
        synonym_table(SimpleNamespace(hc="wordnet", tokenizer="slow"), Unreadable())


def test_letters_of_any_script_make_words_and_tsv_words_pass_the_tokenizers_normaliser(tmp_path):
    from truneg.data.blocks import load_tokenizer
    from truneg.synonyms.sources import build_from_tsv

    assert [synonyms.word_of(t) for t in ("naïve", "привет", "big", "##ing", "a", "x2", "[CLS]")] == [
        "naïve", "привет", "big", None, None, None, None]
    assert synonyms.word_of("Ġbig", "byte-level BPE") == "big" and synonyms.word_of("big", "byte-level BPE") is None
    assert synonyms.word_of("▁Big", "SentencePiece") == "Big"
    tokenizer = load_tokenizer()  # uncased: lower-cases and strips accents
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tsv = tmp_path / "pairs.tsv"
    tsv.write_text("Naïve\tSimple\nCAFÉ\trestaurant\n")
    table = build_from_tsv(tokens, tsv, normalize=tokenizer.backend_tokenizer.normalizer.normalize_str)
    assert table.synonyms_of("naive") == ["simple"] and table.synonyms_of("cafe") == ["restaurant"]


def test_synonyms_build_takes_a_tokenizer_and_lists_its_tokens_as_training_does(tmp_path, shipped):
    """`truneg synonyms build/show --tokenizer`: bert-base-uncased's gives the shipped table, the same content; a
    byte-level BPE tokenizer's, a table training takes for it (its vocab hash is over the tokens training lists)."""
    from conftest import bpe_tokenizer

    from truneg.data.blocks import DEFAULT_TOKENIZER

    out = tmp_path / "bert.npz"
    assert cli_in_process("synonyms", "build", "--tokenizer", str(DEFAULT_TOKENIZER), "--out", str(out)).returncode == 0
    assert SynonymTable.load(out).content_sha256 == shipped.content_sha256
    loaded = bpe_tokenizer(tmp_path / "bpe")
    bpe = tmp_path / "bpe.npz"
    assert cli_in_process("synonyms", "build", "--tokenizer", str(tmp_path / "bpe"), "--out", str(bpe)).returncode == 0
    table = SynonymTable.load(bpe, expect_tokens=loaded.convert_ids_to_tokens(list(range(len(loaded)))))
    assert "Ġlarge" in table.synonyms_of("Ġbig")
    shown = cli_in_process("synonyms", "show", str(bpe), "Ġbig", "--tokenizer", str(tmp_path / "bpe"))
    assert shown.returncode == 0 and "Ġlarge" in shown.stdout
    refused = cli_in_process("synonyms", "show", str(bpe), "big", "--tokenizer", str(DEFAULT_TOKENIZER))
    assert refused.returncode == 2 and "vocab" in refused.stderr
