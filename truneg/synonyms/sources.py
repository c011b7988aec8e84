"""Where synonym tables come from: WordNet (through nltk), embedding nearest neighbours, or a user's TSV.

Each builder returns a `truneg.synonyms.table.SynonymTable` over the given vocabulary; `truneg synonyms build` saves it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModel

from truneg.errors import UserError
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymTable, eligible_token_ids, vocab_sha256, word_of
from truneg.synonyms.wordnet import load_wordnet


def build_from_wordnet(tokens: Sequence[str], morphy: bool = True, progress: bool = False,
                       kind: str = "WordPiece") -> SynonymTable:
    """Synonyms = single-word lemma names of the word's synsets that are whole vocab tokens (`word_of` for the
    tokenizer's `kind`: a BPE vocab's rows and synonyms are its word-start tokens, `Ġbig` -> `Ġlarge`).

    With `morphy` (the default) the word's synsets are exactly `nltk.corpus.wordnet.synsets(word)`, which
    lemmatises first: "ran" gets run's synsets, and so "run" becomes a synonym of "ran" (not the reverse:
    the table is not symmetric). The paper retrieves synonyms "for each token from model vocabulary" with
    WordNet and counts "tokens ... written in different forms" among reasonable predictions. Without it
    (`truneg synonyms build --exact`) only synsets listing the word itself count, a symmetric relation.
    As `wn.synsets` does, a word is looked up lower-cased; in a cased vocabulary its synonyms are the tokens
    written in its case ("Big" -> "Large", "big" -> "large").

    nltk's index (`lemma -> pos -> synset offsets`) is loaded eagerly; parsing synsets is lazy and is
    what makes a per-word `wn.synsets()` build slow. Two lemmas share a synset iff they share a
    (pos, offset) in that index, so we invert it once instead of parsing synsets.
    """
    wn = load_wordnet()
    lemma_index = wn._lemma_pos_offset_map  # its lemmas are lower-case
    eligible = eligible_token_ids(tokens, kind).tolist()
    words = {i: word_of(tokens[i], kind) for i in eligible}
    word_to_id = {word: i for i, word in words.items()}

    # synset (pos, offset) -> its single-word lemmas that the vocab holds in some case; 's' (satellite) lives
    # in data.adj.
    in_vocab = {word.lower() for word in word_to_id}
    members: dict[tuple[str, int], list[str]] = {}
    for lemma, offsets_by_pos in lemma_index.items():
        if lemma not in in_vocab:  # also every multi-word lemma ("_"): no whole-word token has one
            continue
        for pos, offsets in offsets_by_pos.items():
            for offset in offsets:
                members.setdefault(("a" if pos == "s" else pos, offset), []).append(lemma)

    def written_as(word: str, lemma: str) -> str:
        """The lemma in the word's case (a cased vocab: "Big" -> "Large", "USA" -> "AMERICA")."""
        return lemma.upper() if word.isupper() and len(word) > 1 else lemma.capitalize() if word[0].isupper() else lemma

    def synsets_of(word: str) -> set[tuple[str, int]]:
        found = {("a" if pos == "s" else pos, off) for pos, offs in lemma_index.get(word, {}).items() for off in offs}
        if morphy:
            # As `wn.synsets(word)` does: each base form contributes its synsets of that part of speech.
            for pos in "nvar":
                for base in wn._morphy(word, pos):
                    found.update((pos, off) for off in lemma_index[base].get(pos, ()))
        return found

    rows, cols = [], []
    for token_id in tqdm(eligible, desc="wordnet", disable=not progress, unit="word"):
        word = words[token_id]
        for synset in synsets_of(word.lower()):  # as `wn.synsets` lower-cases its query
            synonyms = [word_to_id.get(written_as(word, lemma)) for lemma in members.get(synset, ())]
            synonyms = [j for j in synonyms if j is not None]
            rows.extend([token_id] * len(synonyms))
            cols.extend(synonyms)
    options = {"morphy": morphy, "wordnet_version": str(wn.get_version()), **kind_option(kind)}
    return SynonymTable.from_arrays(np.array(rows), np.array(cols), tokens, "wordnet", options)


def kind_option(kind: str) -> dict:
    """The table's record of its tokenizer's kind (a WordPiece table, as every table written before, records none)."""
    return {} if kind == "WordPiece" else {"tokenizer_kind": kind}


def wordnet_for_vocab(tokens: Sequence[str], kind: str = "WordPiece") -> SynonymTable:
    """The WordNet table of a vocab: the shipped one when it is this vocab's (instant), else built (about 3 s)."""
    shipped = SynonymTable.load(SHIPPED_WORDNET_TABLE) if SHIPPED_WORDNET_TABLE.is_file() else None
    if shipped is not None and shipped.sha256 == vocab_sha256(tokens) and kind == "WordPiece":
        return shipped
    return build_from_wordnet(tokens, kind=kind)


def read_word2vec(path: Path) -> dict[str, np.ndarray]:
    """word2vec text (`N d` header, then `word v1 .. vd`) or binary format."""
    with open(path, "rb") as fh:
        header = fh.readline().split()
        if len(header) != 2 or not all(h.isdigit() for h in header):
            raise UserError(f"{path} is not a word2vec file (first line must be `<count> <dim>`)")
        count, dim = int(header[0]), int(header[1])
        rest = fh.read()
    vectors: dict[str, np.ndarray] = {}
    try:
        text_lines = rest.decode("utf-8").splitlines()
        is_text = all(len(line.split()) == dim + 1 for line in text_lines[: min(5, count)])
    except UnicodeDecodeError:
        is_text = False
    if is_text:
        for number, line in enumerate(text_lines, 2):
            parts = line.rstrip().split(" ")
            if len(parts) == dim + 1:
                try:
                    vectors[parts[0]] = np.asarray(parts[1:], dtype=np.float32)
                except ValueError:
                    raise UserError(f"{path}:{number}: the vector of {parts[0]!r} holds a value that is not a number; "
                                    "fix or re-export the word2vec file") from None
    else:
        pos = 0
        try:
            for _ in range(count):
                end = rest.index(b" ", pos)
                word = rest[pos:end].decode("utf-8", errors="replace").strip()
                vectors[word] = np.frombuffer(rest, dtype=np.float32, count=dim, offset=end + 1).copy()
                pos = end + 1 + 4 * dim
        except ValueError:  # no word left before the end, or fewer than `dim` floats after it
            raise UserError(f"{path} ends after {len(vectors)} of the {count} vectors its header promises: a truncated "
                            "or damaged binary word2vec file") from None
    if not vectors:
        raise UserError(f"{path} holds no vectors of dimension {dim}")
    return vectors


def embedding_matrix_for_vocab(source: str | Path, tokens: Sequence[str]) -> np.ndarray:
    """[V, d] float32 matrix, rows of zeros for tokens the source lacks.

    `source` is a word2vec file or an HF model folder (its input embeddings, which must match the vocab).
    """
    source = Path(source)
    if source.is_dir():
        try:
            weight = AutoModel.from_pretrained(source).get_input_embeddings().weight.detach().float().numpy()
        except (OSError, ValueError) as err:  # no config.json, weights or a model type transformers knows
            raise UserError(f"cannot load model {source} for its embeddings ({str(err).splitlines()[0][:160]}); pass "
                            "an HF model folder or a word2vec file") from None
        if weight.shape[0] < len(tokens):
            raise UserError(f"model {source} has {weight.shape[0]} embeddings, fewer than the vocab's {len(tokens)}")
        return weight[: len(tokens)]
    if not source.is_file():
        raise UserError(f"embeddings {source} do not exist; pass a word2vec file or an HF model folder")
    vectors = read_word2vec(source)
    dim = len(next(iter(vectors.values())))
    matrix = np.zeros((len(tokens), dim), dtype=np.float32)
    for i, tok in enumerate(tokens):
        vec = vectors.get(tok)
        if vec is not None:
            matrix[i] = vec
    return matrix


def build_from_embeddings(
    tokens: Sequence[str], embeddings: str | Path | np.ndarray, top_k: int = 10, min_cosine: float = 0.6,
    kind: str = "WordPiece",
) -> SynonymTable:
    """The paper's Word2Vec variant: each eligible token's top-k eligible neighbours with cosine >= min_cosine (a
    word2vec file's vectors are looked up by the tokens' words, `word_of`)."""
    words = [word_of(token, kind) or token for token in tokens]
    matrix = embeddings if isinstance(embeddings, np.ndarray) else embedding_matrix_for_vocab(embeddings, words)
    ids = eligible_token_ids(tokens, kind)
    vecs = torch.from_numpy(np.ascontiguousarray(matrix[ids], dtype=np.float32))
    norms = vecs.norm(dim=1, keepdim=True)
    ids, vecs = ids[(norms.squeeze(1) > 0).numpy()], vecs[norms.squeeze(1) > 0] / norms[norms.squeeze(1) > 0]
    if len(ids) == 0:
        raise UserError(f"no word of the vocab has a vector in {embeddings}; are they cased vectors for an "
                        "uncased vocab, or another language's?")
    rows, cols = [], []
    k = min(top_k + 1, len(ids))
    for start in range(0, len(ids), 4096):
        sims = vecs[start : start + 4096] @ vecs.T
        sims[torch.arange(sims.shape[0]), torch.arange(start, start + sims.shape[0])] = -2.0  # not itself
        values, neighbours = sims.topk(k, dim=1)
        keep = (values >= min_cosine) & (torch.arange(k) < top_k)
        r, c = keep.nonzero(as_tuple=True)
        rows.append(ids[start + r.numpy()])
        cols.append(ids[neighbours[r, c].numpy()])
    source = str(embeddings) if not isinstance(embeddings, np.ndarray) else "array"
    options = {"top_k": top_k, "min_cosine": min_cosine, "embeddings": source, **kind_option(kind)}
    return SynonymTable.from_arrays(np.concatenate(rows), np.concatenate(cols), tokens, "embedding", options)


def build_from_tsv(tokens: Sequence[str], tsv: str | Path, kind: str = "WordPiece",
                   normalize: Callable[[str], str] | None = None) -> SynonymTable:
    """One `word<TAB>synonym` per line; pairs whose words are not whole vocab tokens are skipped. Each word passes
    through `normalize` first (the tokenizer's normaliser: uncased BERT lower-cases and strips accents, so `Naïve`
    is the token `naive`)."""
    tsv = Path(tsv)
    if not tsv.is_file():
        raise UserError(f"TSV {tsv} does not exist; pass a file with one `word<TAB>synonym` per line")
    eligible = eligible_token_ids(tokens, kind).tolist()
    word_to_id = {word_of(tokens[i], kind): i for i in eligible}
    normalize = normalize or (lambda word: word)
    pairs = []
    for number, line in enumerate(tsv.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) != 2:
            raise UserError(f"{tsv}:{number}: expected `word<TAB>synonym`, got {line[:60]!r}")
        word, synonym = (word_to_id.get(normalize(p.strip())) for p in parts)
        if word is not None and synonym is not None:
            pairs.append((word, synonym))
    if not pairs:
        raise UserError(f"TSV {tsv} has no `word<TAB>synonym` pair of whole vocab tokens; check its format and vocab")
    return SynonymTable.from_pairs(pairs, tokens, "tsv", {"tsv": str(tsv), **kind_option(kind)})
