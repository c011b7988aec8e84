"""False-negative statistics: counts against a hand-computed case, the CLI's files, bad paths."""
from __future__ import annotations

import csv
import json
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import EVAL_SEQUENCES, REPO, cli_in_process, comparable, read_metrics

from truneg.data.blocks import load_tokenizer
from truneg.eval.false_negatives import (
    FnCounts,
    evaluate,
    format_table,
    open_sequences,
    write_stats,
)
from truneg.model import pretrainers as models
from truneg.model.objectives import false_negative_counts
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable


def test_counts_match_a_hand_computed_case():
    # [B, P] slots of three sequences; the third has one masked position and one padding slot
    valid = torch.tensor([[True, True], [True, True], [True, False]])
    gold = torch.tensor([[10, 11], [12, 13], [14, 0]])
    pred = torch.tensor([[20, 21], [12, 23], [14, 99]])  # two mismatches in sequence 0, one in sequence 1
    corrected = torch.tensor([[True, True], [False, False], [False, True]])  # a padding slot never counts
    counts = {k: int(v) for k, v in false_negative_counts(gold, pred, corrected, valid).items()}
    assert counts == {"sequences": 3, "masked": 5, "mismatched": 3, "corrected": 2, "sequences_corrected": 1}
    total = FnCounts("x", 1, **counts)
    assert total.iter_ratio == pytest.approx(1 / 3) and total.pred_ratio == pytest.approx(2 / 3)


def predict_from_gold(patch: pytest.MonkeyPatch, predict) -> None:
    """Make the BERT head predict `predict(gold ids)` with certainty (argmax and sample alike): it reads the gold
    at the masked positions from the unmasked rows that masking is handed, captured here."""
    from truneg.data import masking
    from truneg.model import families
    from truneg.train import heldout  # fn-stats' forward and masking are the live evaluation's

    real_mask, seen = masking.mask_tokens, {}

    def capturing_mask(rows, *args, **kwargs):
        seen["original"] = torch.as_tensor(rows).long()
        return real_mask(rows, *args, **kwargs)

    def logits(mlm, hidden, positions):
        pred = predict(seen["original"].gather(1, positions))
        return 60.0 * torch.nn.functional.one_hot(pred, mlm.config.vocab_size).float()

    patch.setattr(families, "masked_logits", logits)
    patch.setattr(heldout, "mask_tokens", capturing_mask)


def test_evaluate_counts_synonym_predictions_of_a_stub_mlm(monkeypatch):
    tokenizer = load_tokenizer()
    table = SynonymTable.load(SHIPPED_WORDNET_TABLE)
    # "run" is in the synonym row of "ran", not "ran" in that of "run": the row read must be the gold token's
    ran, run, house = (table.token_to_id[w] for w in ("ran", "run", "house"))
    rng = np.random.default_rng(0)
    blocks = rng.choice([ran, house], size=(40, 16)).astype(np.int32)
    blocks[:, 0], blocks[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id

    from truneg.data import masking

    real_mask = masking.mask_tokens
    # predicts "run" where the gold is "ran", and the gold itself elsewhere
    predict_from_gold(monkeypatch, lambda gold: torch.where(gold == ran, torch.full_like(gold, run), gold))
    mlm = models.build_pretrainer("bert-tiny", models.ObjectiveConfig()).mlm
    counts, cases = evaluate(mlm, blocks, tokenizer, SynonymLookup(table), seed=3, batch_size=16, max_cases=3,
                             table=table)
    # the hand reference: the same masks, drawn by the same pure function
    batch = real_mask(blocks, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", 3, 0,
                      np.arange(40), masking.default_max_predictions(16))
    gold = batch["original_ids"].gather(1, batch["masked_positions"])
    labels = torch.where(batch["masked_valid"], gold, -100).numpy()
    expected_fn = int((labels == ran).sum())
    assert counts.masked == int((labels != -100).sum()) and counts.sequences == 40
    assert counts.corrected == counts.mismatched == expected_fn > 0
    assert counts.sequences_corrected == int((labels == ran).any(axis=1).sum())
    # the argmax is right everywhere but at "ran": the accuracy over all masked positions
    assert counts.mlm_correct == counts.masked - expected_fn
    assert counts.mlm_accuracy == pytest.approx(1 - expected_fn / counts.masked) and counts.mlm_accuracy < 1
    assert len(cases) == 3 and all(c.gold == "ran" and c.pred == "run" and "run" in c.synonyms for c in cases)


def test_fn_stats_and_fn_cases_on_a_trained_run(runs, tmp_path, small_corpus, frequent_table, monkeypatch):
    run_dir, _ = runs("bert-zero2")
    exported = tmp_path / "hf"
    assert cli_in_process("export", str(run_dir / "checkpoints"), str(exported)).returncode == 0
    out = tmp_path / "fn"
    checkpoints = tmp_path / "checkpoints"  # as a running job's folder: a save in progress is not read
    shutil.copytree(run_dir / "checkpoints", checkpoints)
    (checkpoints / "global_step32").mkdir()
    (checkpoints / "global_step32" / "truneg_rank00000.pt").write_bytes(b"")
    # --batch-size the run's micro-batch: the live evaluation's shapes, so the same figures below (a row's figures
    # depend on its own inputs only)
    proc = cli_in_process("fn-stats", "--checkpoints", str(checkpoints), str(exported), "--data", str(small_corpus),
                          "--seq-len", "64", "--max-sequences", "96", "--batch-size", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "fn_stats.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == ["checkpoint", "step", "segmentation", "seq_len", "sequences", "masked", "mismatched",
                             "corrected", "iter_ratio", "pred_ratio", "mlm_accuracy"]
    assert [int(r["step"]) for r in rows] == [16, 24, -1]  # the run keeps its 2 newest checkpoints
    assert {(r["segmentation"], r["seq_len"]) for r in rows} == {("packed", "64")}
    for row in rows:
        assert int(row["sequences"]) == 96 and 0 < int(row["mismatched"]) <= int(row["masked"])
        assert float(row["pred_ratio"]) == pytest.approx(int(row["corrected"]) / int(row["mismatched"]))
        # BERT's prediction is the argmax: what it gets right is what it does not mismatch
        assert float(row["mlm_accuracy"]) == pytest.approx(1 - int(row["mismatched"]) / int(row["masked"]))
    assert rows[1]["masked"] == rows[2]["masked"] and rows[1]["mismatched"] == rows[2]["mismatched"], \
        "the exported model is the step-24 checkpoint: same masks, same predictions"
    stats = json.loads((out / "fn_stats.json").read_text())
    assert [s["corrected"] for s in stats] == [int(r["corrected"]) for r in rows]
    assert [s["mlm_accuracy"] for s in stats] == [float(r["mlm_accuracy"]) for r in rows]
    png = (out / "fn_stats.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    import matplotlib.image

    assert matplotlib.image.imread(out / "fn_stats.png").shape[0] > 100
    assert "iter %" in proc.stdout and "pred %" in proc.stdout and "acc %" in proc.stdout

    # the run's live evaluations (its first 96 sequences of the same text, counted with WordNet's table, as fn-stats'
    # default): the same Table 2 and accuracy for the same checkpoints
    live = {r["step"]: r for r in comparable(read_metrics(run_dir, "eval"))}
    for row in rows[:2]:
        record = live[int(row["step"])]
        assert [record[f"eval_{k}"] for k in ("sequences", "masked", "mismatched")] == [
            int(row[k]) for k in ("sequences", "masked", "mismatched")]
        assert record["eval_hc_iter_ratio"] == float(row["iter_ratio"])
        assert record["eval_hc_pred_ratio"] == float(row["pred_ratio"])
        assert record["eval_mlm_accuracy"] == float(row["mlm_accuracy"])
    # ... and ELECTRA's, whose counted prediction is the generator's sample (drawn per sequence in both), with the
    # run's --eval-synonyms table: false negatives found in both, the same. The run was ZeRO-3's, whose processes
    # compute F.linear by DeepSpeed's function (another rounding of the bias add, which can move a sample): this one
    # too, for the same kernels
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    electra_dir, _ = runs("electra-zero3")
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
        proc = cli_in_process("fn-stats", "--checkpoints", str(electra_dir / "checkpoints"), "--data",
                              str(small_corpus), "--seq-len", "64", "--max-sequences", str(EVAL_SEQUENCES),
                              "--synonyms", str(frequent_table), "--batch-size", "4", "--out",
                              str(tmp_path / "fn-electra"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    live = {r["step"]: r for r in read_metrics(electra_dir, "eval")}
    rows = json.loads((tmp_path / "fn-electra" / "fn_stats.json").read_text())
    assert [r["step"] for r in rows] == [16, 24] and all(r["corrected"] > 0 for r in rows), rows
    for row in rows:
        assert live[row["step"]]["eval_hc_iter_ratio"] == row["iter_ratio"]
        assert live[row["step"]]["eval_hc_pred_ratio"] == row["pred_ratio"]
        assert live[row["step"]]["eval_mlm_accuracy"] == row["mlm_accuracy"]
    live = {r["step"]: r for r in comparable(read_metrics(run_dir, "eval"))}
    # `truneg eval` offline: the in-run record of step 24, exactly (the same kernels, fp32 at ZeRO-2, and shapes)
    offline = cli_in_process("eval", str(checkpoints / "global_step24"), "--data", str(small_corpus), "--seq-len", "64",
                             "--eval-max-sequences", str(EVAL_SEQUENCES), "--batch-size", "4",
                             "--out", str(tmp_path / "eval.json"))
    assert offline.returncode == 0, offline.stderr[-3000:]
    [record] = json.loads((tmp_path / "eval.json").read_text())
    assert record.pop("checkpoint").endswith("global_step24") and "eval step 24 " in offline.stdout
    assert comparable([record]) == [live[24]]

    # fn-cases, with the head made to predict each masked word's first WordNet synonym (the tiny model predicts
    # none): -n of the false negatives found are shown
    table = SynonymTable.load(SHIPPED_WORDNET_TABLE)
    first_synonym = torch.arange(table.vocab_size)
    has_one = np.nonzero(table.indptr[1:] > table.indptr[:-1])[0]
    first_synonym[has_one] = torch.from_numpy(table.indices[table.indptr[has_one]]).long()
    predicted_synonyms = []  # the reference count: positions whose prediction is a synonym, not the gold itself

    def predict(gold: torch.Tensor) -> torch.Tensor:
        predicted_synonyms.append(int((first_synonym[gold] != gold).sum()))
        return first_synonym[gold]

    with pytest.MonkeyPatch.context() as patch:
        predict_from_gold(patch, predict)
        cases = cli_in_process("fn-cases", "--checkpoint", str(exported), "--data", str(small_corpus), "--seq-len",
                               "64", "-n", "5", "--out", str(tmp_path / "cases"), "--prediction", "sample")
    assert cases.returncode == 0, cases.stderr[-3000:]
    shown, found = map(int, re.search(r"(\d+) cases of (\d+) false negatives", cases.stdout).groups())
    assert found == sum(predicted_synonyms) > 5 and shown == 5, cases.stdout
    page = (tmp_path / "cases" / "cases.html").read_text()
    assert page.startswith("<!doctype html>") and page.count("<tr><td>") == shown
    assert (tmp_path / "cases" / "cases.txt").is_file()


def test_bad_paths_are_clear_errors(tmp_path, small_corpus):
    for args, expected in [
        (["fn-stats", "--checkpoints", str(tmp_path / "nope"), "--data", str(small_corpus), "--out",
          str(tmp_path / "o")],
         "is neither a truneg checkpoints folder"),
        (["fn-cases", "--checkpoint", str(tmp_path), "--data", str(small_corpus), "--out", str(tmp_path / "o")],
         "is neither a truneg checkpoints folder"),
    ]:
        proc = cli_in_process(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith("truneg: error:") and expected in proc.stderr
    (tmp_path / "config.json").write_text("{}")
    proc = cli_in_process("fn-stats", "--checkpoints", str(tmp_path), "--data", str(tmp_path / "missing.txt"), "--out",
                          str(tmp_path / "o"))
    assert proc.returncode == 2 and "no text files found" in proc.stderr and "Traceback" not in proc.stderr


# A WikiText-like file: article titles ` = T = `, a section ` = = S = = `, blank lines between paragraphs.
WIKI = """
 = Apple Orchard =

 the apple tree grew near the old farm house .
 = = History = =

 apples were sold at the market every week .

 = River Bank =

 the river ran past the mill and the bridge .
"""
ARTICLES = [
    " = Apple Orchard =\n the apple tree grew near the old farm house .\n = = History = =\n"
    " apples were sold at the market every week .",
    " = River Bank =\n the river ran past the mill and the bridge .",
]


def test_line_and_article_sequences_never_cross_their_segment(tmp_path):
    tokenizer = load_tokenizer()
    (tmp_path / "a.txt").write_text(WIKI)
    (tmp_path / "b.txt").write_text("no title here , one article per file .\nsecond line of it .\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    pad = tokenizer.pad_token_id

    def unpadded(sequences):
        return [row[row != pad].tolist() for row in np.asarray(sequences)]

    # long enough for every segment: one sequence each, exactly what the tokenizer makes of the segment alone
    lines = [line for text in (WIKI, (tmp_path / "b.txt").read_text()) for line in text.splitlines() if line.strip()]
    articles = ARTICLES + ["no title here , one article per file .\nsecond line of it ."]
    for segmentation, segments in (("line", lines), ("article", articles)):
        sequences = open_sequences(files, tokenizer, 64, segmentation)
        assert sequences.shape == (len(segments), 64) and sequences.dtype == np.int32
        assert unpadded(sequences) == [tokenizer(text)["input_ids"] for text in segments]

    # short: a segment spans several sequences, in order, and a sequence holds one segment's tokens only
    sequences = unpadded(open_sequences(files, tokenizer, 8, "article"))
    assert all(len(seq) <= 8 and seq[0] == tokenizer.cls_token_id and seq[-1] == tokenizer.sep_token_id
               for seq in sequences)
    bodies = [seq[1:-1] for seq in sequences]
    expected = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in articles]
    rebuilt, start = [], 0
    for ids in expected:
        count = -(-len(ids) // 6)
        rebuilt.append(sum(bodies[start:start + count], []))
        start += count
    assert start == len(bodies) and rebuilt == expected

    # packed blocks cross both: one block holds the river article and the next file
    packed = unpadded(open_sequences(files, tokenizer, 32, "packed"))
    river, per_file = tokenizer.convert_tokens_to_ids(["river", "file"])
    assert any(river in seq and per_file in seq for seq in packed)


def test_segmentation_and_length_are_recorded(tmp_path):
    results = [FnCounts("a", 8, "line", 512, sequences=10, masked=40, mismatched=20, corrected=2, sequences_corrected=1)
               ,
               FnCounts("b", 16, "line", 512, sequences=10, masked=40, mismatched=10, corrected=1,
                        sequences_corrected=1)]
    write_stats(results, tmp_path)
    with open(tmp_path / "fn_stats.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["segmentation"], r["seq_len"]) for r in rows] == [("line", "512")] * 2
    stats = json.loads((tmp_path / "fn_stats.json").read_text())
    assert [(s["segmentation"], s["seq_len"], s["iter_ratio"]) for s in stats] == [("line", 512, 0.1)] * 2
    assert "line/512" in format_table(results)


def test_fn_stats_line_segmentation_pads_and_never_attends_to_padding(tmp_path, monkeypatch):
    """In-process `truneg fn-stats --segmentation line` on a tiny HF BERT: the MLM sees [PAD] as padding."""
    from transformers import BertConfig, BertForMaskedLM

    from truneg import cli

    tokenizer = load_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64)
    BertForMaskedLM(config).save_pretrained(tmp_path / "hf")
    (tmp_path / "wiki.raw").write_text(WIKI)
    seen = []

    def record(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append((input_ids.clone(), kwargs["attention_mask"].clone()))

    real_from_pretrained = BertForMaskedLM.from_pretrained.__func__

    def hooked(cls, *args, **kwargs):
        model = real_from_pretrained(cls, *args, **kwargs)
        model.bert.register_forward_pre_hook(record, with_kwargs=True)
        return model

    monkeypatch.setattr(BertForMaskedLM, "from_pretrained", classmethod(hooked))
    cli.main(["fn-stats", "--checkpoints", str(tmp_path / "hf"), "--data", str(tmp_path / "wiki.raw"),
              "--segmentation", "line", "--seq-len", "32", "--out", str(tmp_path / "out")])
    stats = json.loads((tmp_path / "out" / "fn_stats.json").read_text())
    assert len(stats) == 1 and stats[0]["segmentation"] == "line" and stats[0]["seq_len"] == 32
    assert stats[0]["sequences"] == 6  # the six non-blank lines, each short enough for one sequence
    inputs = torch.cat([ids for ids, _ in seen])
    masks = torch.cat([mask for _, mask in seen])
    assert inputs.shape == (6, 32) and (inputs == tokenizer.pad_token_id).any()
    assert torch.equal(masks.bool(), inputs != tokenizer.pad_token_id)  # masking never puts a token on [PAD]


def test_fn_stats_reads_with_the_checkpoints_own_tokenizer(tmp_path):
    """The tokenizer saved with a run (beside its tags' configs, or in an exported folder) reads its corpus;
    bert-base-uncased's only where none was saved; two vocabularies at once are refused."""
    from truneg.data.blocks import load_tokenizer
    from truneg.errors import UserError
    from truneg.eval.checkpoints import CheckpointRef, checkpoints_tokenizer

    base = load_tokenizer()
    vocab = (REPO / "truneg" / "assets" / "vocab" / "vocab.txt").read_text().splitlines()
    vocab[2000], vocab[2001] = vocab[2001], vocab[2000]  # another vocab of the same size
    own = tmp_path / "checkpoints" / "hf_config" / "tokenizer"
    base.save_pretrained(own)  # as pretrain saves it, then with another vocab of the same size
    (own / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (own / "tokenizer.json").unlink()
    base.save_pretrained(tmp_path / "exported")
    truneg_ref = CheckpointRef("run", 8, tmp_path / "checkpoints" / "global_step8", "truneg")
    exported_ref = CheckpointRef("hf", -1, tmp_path / "exported", "hf")
    bare_ref = CheckpointRef("bare", -1, tmp_path / "bare", "hf")  # no tokenizer saved
    assert checkpoints_tokenizer([truneg_ref]).convert_ids_to_tokens([2000, 2001]) == [vocab[2000], vocab[2001]]
    assert checkpoints_tokenizer([exported_ref, bare_ref]).get_vocab() == base.get_vocab()
    with pytest.raises(UserError, match="run was trained with another vocabulary than hf"):
        checkpoints_tokenizer([exported_ref, truneg_ref])
