"""SwapSynWordNet and AddSentDiverse (without CoreNLP), on real WordNet."""
from __future__ import annotations

import random
import re

from truneg.eval.robustness import (
    WH_WORDS,
    add_sent_distractor,
    alter_question,
    insert_before_answer,
    pos_tags,
    swap_syn,
    swap_syn_squad,
    synonyms,
)

SENTENCE = ("The committee will postpone the final decision because several members remain worried about the "
            "large budget and the slow progress of the new bridge over the river .")


def test_swap_syn_replaces_ten_percent_with_same_pos_synonyms():
    from nltk.tokenize import TreebankWordTokenizer
    from sklearn.feature_extraction.text import ENGLISH_STOP_WORDS

    words = TreebankWordTokenizer().tokenize(SENTENCE)
    tags = pos_tags(words)
    out = swap_syn(SENTENCE, random.Random(3))
    new_words = TreebankWordTokenizer().tokenize(out)
    assert len(new_words) == len(words)
    changed = [i for i, (a, b) in enumerate(zip(words, new_words)) if a != b]
    assert len(changed) == int(0.1 * len(words)) == 2  # TextFlint's count: int(10 %), not rounded
    for i in changed:
        assert words[i].lower() not in ENGLISH_STOP_WORDS and words[i].isalpha()
        assert new_words[i].lower() in {s.lower() for s in synonyms(words[i].lower(), tags[i])}
    # the same swaps against WordNet itself, with each word's part of speech written out here
    from nltk.corpus import wordnet

    swaps = {words[i]: (new_words[i], tags[i]) for i in changed}
    expected_pos = {"decision": wordnet.NOUN, "progress": wordnet.NOUN}
    assert set(swaps) == set(expected_pos)
    for word, (new, pos) in swaps.items():
        assert pos == expected_pos[word] and new != word
        assert new in {lemma.name() for synset in wordnet.synsets(word, expected_pos[word]) for lemma
                       in synset.lemmas()}
    assert swap_syn(SENTENCE, random.Random(3)) == out  # a fixed seed gives the same transform


def test_swap_syn_changes_only_the_swapped_words_characters():
    """The rest of the text stays as written: no Treebank re-spelling of quotes or contractions (SST-2 is
    written `do n't`, ``quoted'')."""
    text = "you do n't have to know `` jazz '' to enjoy the film 's lovely music and its gentle humor ."
    out = swap_syn(text, random.Random(0))
    words, new_words = text.split(" "), out.split(" ")
    assert len(words) == len(new_words)  # each swap a single word: the spaces where they were
    changed = [(a, b) for a, b in zip(words, new_words) if a != b]
    assert len(changed) == int(0.1 * len(words)) and all(a.isalpha() for a, _ in changed), changed
    assert "do n't" in out and "`` " in out and " ''" in out and "film 's" in out


def changed_words(before: str, after: str) -> int:
    from nltk.tokenize import TreebankWordTokenizer

    a, b = TreebankWordTokenizer().tokenize(before), TreebankWordTokenizer().tokenize(after)
    assert len(a) == len(b)
    return sum(x != y for x, y in zip(a, b))


def test_swap_syn_bounds_and_drop_out():
    short = "The river is cold ."
    assert changed_words(short, swap_syn(short, random.Random(0))) == 1  # at least one
    long = " ".join(["the quick brown fox jumps over the lazy dog and"] * 20)
    assert changed_words(long, swap_syn(long, random.Random(0))) == 10  # at most ten
    assert swap_syn("the of and , .", random.Random(0)) is None  # no candidate: the sentence drops out


def test_swap_syn_on_a_squad_context_leaves_the_answers_alone():
    context = ("The ancient bridge crossed the wide river near the old market. Its builders used large stones "
               "carried from distant quarries by strong horses.")
    answers = ["large stones", "ancient bridge"]
    example = {"id": "q", "question": "What did they use?", "context": context, "answers": answers,
               "answer_starts": [context.index(a) for a in answers]}
    for seed in range(20):
        changed = swap_syn_squad(example, random.Random(seed))
        assert changed["context"] != context
        for start, answer in zip(changed["answer_starts"], answers):
            assert changed["context"][start: start + len(answer)] == answer
        assert {**changed, "context": context, "answer_starts": example["answer_starts"]} == example
    assert swap_syn_squad({**example, "context": "the of and .", "answers": [], "answer_starts": []},
                          random.Random(0)) is None


def test_add_sent_alters_the_question_so_that_the_distractor_does_not_answer_it():
    """TextFlint's AddSentDiverse alters the question (antonyms, nearby numbers, other proper nouns) before
    it states it with a fake answer: a distractor that kept the question's meaning would answer it too."""
    from nltk.corpus import wordnet

    rng = random.Random(0)
    altered = alter_question("Which team had the largest stadium in Paris in 1998?", rng, ["London", "Paris"])
    words = re.findall(r"\w+", altered)  # one word for one: Which team had the largest stadium in Paris in 1998
    assert words[:2] == ["Which", "team"] and words[5] == "stadium"
    # an inflected word takes its base form's antonym (largest -> large -> small)
    assert words[4] in {a.name() for s in wordnet.synsets("large", wordnet.ADJ) for lemma in s.lemmas()
                        for a in lemma.antonyms()}
    assert words[7] == "London" and 1988 <= int(words[9]) <= 2008 and words[9] != "1998"
    assert alter_question("What is it?", rng, ["London"]) is None  # nothing to alter: the question drops out
    assert alter_question("What is the area in km ²?", rng, []) is None  # a digit that is no number: no crash
    distractor = add_sent_distractor(altered, "Chicago Bears Inc.")
    assert distractor.endswith("Chicago Bears Inc.") and not distractor.endswith("..")  # the fake answer whole
    assert not any(w.lower() in WH_WORDS for w in re.findall(r"\w+", distractor))


def test_the_distractor_goes_before_the_answers_sentence():
    context = "First comes one thing. Then the Broncos won the game! Last, a third sentence."
    example = {"id": "q", "question": "Who won?", "context": context, "answers": ["Broncos", "the Broncos"],
               "answer_starts": [context.index("Broncos"), context.index("the Broncos")]}
    changed = insert_before_answer(example, "The Bears lost the game.")
    assert changed["context"] == ("First comes one thing. The Bears lost the game. Then the Broncos won the game! "
                                  "Last, a third sentence.")
    for start, answer in zip(changed["answer_starts"], changed["answers"]):
        assert changed["context"][start: start + len(answer)] == answer
    first = insert_before_answer({**example, "answer_starts": [0], "answers": ["First"]}, "X.")
    assert first["context"] == "X. " + context and first["answer_starts"] == [3]


def test_sentences_do_not_end_at_abbreviations_and_capitals_inside_a_synonym_stay():
    from truneg.eval.robustness import _cased, sentence_starts

    text = "It was in St. Louis, home of the U.S. Army. Dr. Who left! Then J. Smith came (late). End."
    assert [text[i:].split()[0] for i in sentence_starts(text)] == ["It", "Dr.", "Then", "End."]
    assert _cased("CA", "California") == "CA" and _cased("state", "State") == "State" and _cased("ca", "ca") == "ca"
    # a piece the tokenizer cut out of a word ("got" of "gotta") is not a word to swap
    for seed in range(10):
        assert "gotta" in swap_syn("you gotta love this movie , it is great .", random.Random(seed))
