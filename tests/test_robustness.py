"""SwapSynWordNet and the AddSentDiverse-style distractor, on real WordNet."""
from __future__ import annotations

import random

from truneg.robustness import WH_WORDS, add_sent_distractor, pos_tags, swap_syn, synonyms

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
    assert len(changed) == round(0.1 * len(words)) == 3
    for i in changed:
        assert words[i].lower() not in ENGLISH_STOP_WORDS and words[i].isalpha()
        assert new_words[i].lower() in {s.lower() for s in synonyms(words[i].lower(), tags[i])}
    # the same swaps against WordNet itself, with each word's part of speech written out here
    from nltk.corpus import wordnet

    swaps = {words[i]: (new_words[i], tags[i]) for i in changed}
    expected_pos = {"decision": wordnet.NOUN, "slow": wordnet.ADJ, "progress": wordnet.NOUN}
    assert set(swaps) == set(expected_pos)
    for word, (new, pos) in swaps.items():
        assert pos == expected_pos[word] and new != word
        assert new in {lemma.name() for synset in wordnet.synsets(word, expected_pos[word]) for lemma in synset.lemmas()}
    assert swap_syn(SENTENCE, random.Random(3)) == out  # a fixed seed gives the same transform


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


def test_add_sent_distractor_carries_the_fake_answer_without_the_question_word():
    distractor = add_sent_distractor("Which NFL team represented the AFC at Super Bowl 50?", "Chicago Bears",
                                     random.Random(1))
    assert distractor.endswith(".") and not any(w.lower().strip(".?") in WH_WORDS for w in distractor.split())
    assert "Chicago" in distractor or "Bears" in distractor or "Bear" in distractor
