"""False-negative statistics: counts against a hand-computed case, the CLI's files, bad paths."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO

from truneg import models
from truneg.analysis import FnCounts, count_false_negatives, evaluate
from truneg.data import load_tokenizer
from truneg.synonyms import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable


def test_counts_match_a_hand_computed_case():
    masked = torch.tensor([[False, True, True, False], [True, False, False, True], [True, False, False, False]])
    gold = torch.tensor([10, 11, 12, 13, 14])
    pred = torch.tensor([20, 21, 12, 23, 14])  # two mismatches in sequence 0, one in sequence 1
    corrected = torch.tensor([True, True, False, False, False])  # both of sequence 0 are synonyms
    counts = count_false_negatives(gold, pred, corrected, masked)
    assert counts == {"sequences": 3, "masked": 5, "mismatched": 3, "corrected": 2, "sequences_corrected": 1}
    total = FnCounts("x", 1, **counts)
    assert total.iter_ratio == pytest.approx(1 / 3) and total.pred_ratio == pytest.approx(2 / 3)


def test_evaluate_counts_synonym_predictions_of_a_stub_mlm(monkeypatch):
    tokenizer = load_tokenizer()
    table = SynonymTable.load(SHIPPED_WORDNET_TABLE)
    primary, main, house = (table.token_to_id[w] for w in ("primary", "main", "house"))
    rng = np.random.default_rng(0)
    blocks = rng.choice([primary, house], size=(40, 16)).astype(np.int32)
    blocks[:, 0], blocks[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id

    def stub_logits(mlm, input_ids, attention_mask, masked):
        # predicts "main" where the gold is "primary", and the gold itself elsewhere: reads the gold from
        # the unmasked blocks, which the stub captures below
        gold = stub_logits.original[masked]
        pred = torch.where(gold == primary, torch.full_like(gold, main), gold)
        logits = torch.zeros(len(pred), len(tokenizer))
        logits[torch.arange(len(pred)), pred] = 1.0
        return logits

    from truneg import data

    real_mask = data.mask_tokens

    def capturing_mask(rows, *args, **kwargs):
        stub_logits.original = torch.as_tensor(rows)
        return real_mask(rows, *args, **kwargs)

    monkeypatch.setattr(models, "bert_masked_logits", stub_logits)
    monkeypatch.setattr(data, "mask_tokens", capturing_mask)
    mlm = models.build_pretrainer("bert-tiny", models.ObjectiveConfig()).mlm
    counts, cases = evaluate(mlm, blocks, tokenizer, SynonymLookup(table), seed=3, batch_size=16, max_cases=3, table=table)
    # the hand reference: the same masks, drawn by the same pure function
    _, labels = real_mask(blocks, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", 3, 0,
                          np.arange(40))
    labels = labels.numpy()
    expected_fn = int((labels == primary).sum())
    assert counts.masked == int((labels != -100).sum()) and counts.sequences == 40
    assert counts.corrected == counts.mismatched == expected_fn > 0
    assert counts.sequences_corrected == int((labels == primary).any(axis=1).sum())
    assert len(cases) == 3 and all(c.gold == "primary" and c.pred == "main" and "main" in c.synonyms for c in cases)


def truneg_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "truneg.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_fn_stats_and_fn_cases_on_a_trained_run(runs, tmp_path, small_corpus):
    run_dir, _ = runs("bert-zero2")
    exported = tmp_path / "hf"
    assert truneg_cli("export", str(run_dir / "checkpoints"), str(exported)).returncode == 0
    out = tmp_path / "fn"
    proc = truneg_cli("fn-stats", "--checkpoints", str(run_dir / "checkpoints"), str(exported), "--data", str(small_corpus),
                      "--seq-len", "64", "--max-sequences", "96", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "fn_stats.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["checkpoint", "step", "sequences", "masked", "mismatched", "corrected", "iter_ratio", "pred_ratio"]
    assert [int(r["step"]) for r in rows] == [8, 16, 24, -1]
    for row in rows:
        assert int(row["sequences"]) == 96 and 0 < int(row["mismatched"]) <= int(row["masked"])
        assert float(row["pred_ratio"]) == pytest.approx(int(row["corrected"]) / int(row["mismatched"]))
    assert rows[2]["masked"] == rows[3]["masked"] and rows[2]["mismatched"] == rows[3]["mismatched"], \
        "the exported model is the step-24 checkpoint: same masks, same predictions"
    stats = json.loads((out / "fn_stats.json").read_text())
    assert [s["corrected"] for s in stats] == [int(r["corrected"]) for r in rows]
    png = (out / "fn_stats.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    assert matplotlib.image.imread(out / "fn_stats.png").shape[0] > 100
    assert "iter %" in proc.stdout and "pred %" in proc.stdout

    cases = truneg_cli("fn-cases", "--checkpoint", str(exported), "--data", str(small_corpus), "--seq-len", "64",
                       "-n", "5", "--out", str(tmp_path / "cases"), "--prediction", "sample")
    assert cases.returncode == 0, cases.stderr[-3000:]
    assert (tmp_path / "cases" / "cases.html").read_text().startswith("<!doctype html>")
    assert (tmp_path / "cases" / "cases.txt").is_file()


def test_bad_paths_are_clear_errors(tmp_path, small_corpus):
    for args, expected in [
        (["fn-stats", "--checkpoints", str(tmp_path / "nope"), "--data", str(small_corpus), "--out", str(tmp_path / "o")],
         "is neither a truneg checkpoints folder"),
        (["fn-cases", "--checkpoint", str(tmp_path), "--data", str(small_corpus), "--out", str(tmp_path / "o")],
         "is neither a truneg checkpoints folder"),
    ]:
        proc = truneg_cli(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("truneg: error:") and expected in proc.stderr
    (tmp_path / "config.json").write_text("{}")
    proc = truneg_cli("fn-stats", "--checkpoints", str(tmp_path), "--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o"))
    assert proc.returncode == 2 and "no text files found" in proc.stderr and "Traceback" not in proc.stderr
