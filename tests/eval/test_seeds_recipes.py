"""`finetune --seeds`: one folder per seed, a killed run's seeds skipped, the median reported with its spread;
and the published recipes by model family and size. The fine-tuning itself is a spy: these are the CLI's
own decisions."""
from __future__ import annotations

import json
import statistics

import pytest
from transformers import BertConfig, ElectraConfig

from truneg.cli import main
from truneg.errors import UserError
from truneg.eval import glue
from truneg.eval.recipes import model_size, recipe_for
from truneg.eval.seeds import summarize

SCORES = {1: 0.60, 2: 0.70, 3: 0.66}


def tiny_model(folder, config) -> str:
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")  # resolve_model_dir looks for the file; the spy loads nothing
    return str(folder)


@pytest.fixture
def spy(monkeypatch):
    calls = []

    def finetune(task, model, data_dir, out, **kw):
        calls.append({"seed": kw["seed"], "out": out, **kw})
        results = {"task": task, "accuracy": SCORES[kw["seed"]], "f1": 2 * SCORES[kw["seed"]], "epochs": kw["epochs"],
                   "lr": kw["lr"], "batch_size": kw["batch_size"], "seed": kw["seed"],
                   "layerwise_decay": kw["layerwise_decay"]}
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results))
        return results

    monkeypatch.setattr(glue, "finetune", finetune)
    return calls


def test_seeds_run_each_into_its_folder_report_the_median_and_resume(tmp_path, spy, capsys):
    model = tiny_model(tmp_path / "m", BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2))
    out = tmp_path / "rte"
    argv = ["finetune", "glue", "--task", "rte", "--model", model, "--data-dir", "d", "--output-dir", str(out),
            "--seeds", "1,2,3"]
    main(argv)
    assert [(c["seed"], c["out"]) for c in spy] == [(s, out / f"seed-{s}") for s in (1, 2, 3)]
    results = json.loads((out / "results.json").read_text())
    assert json.loads(capsys.readouterr().out) == results
    assert results["reported"] == "median" and results["seeds"] == [1, 2, 3]
    assert results["median"]["accuracy"] == results["accuracy"] == 0.66
    assert results["mean"]["accuracy"] == pytest.approx(statistics.fmean(SCORES.values()))
    assert results["std"]["accuracy"] == pytest.approx(statistics.stdev(SCORES.values()))  # sample std: 0.0503
    assert results["median"]["f1"] == 1.32 and "lr" not in results["median"]
    assert {s: r["accuracy"] for s, r in results["per_seed"].items()} == {"1": 0.60, "2": 0.70, "3": 0.66}
    # a run killed during seed 3: seeds 1 and 2 are read back, not run again
    (out / "seed-3" / "results.json").unlink()
    (out / "seed-3").rmdir()
    spy.clear()
    main(argv)
    assert [c["seed"] for c in spy] == [3]
    assert json.loads((out / "results.json").read_text()) == results
    # killed while writing seed 3's results.json: the cut file is no finished seed, seed 3 runs again
    (out / "seed-3" / "results.json").write_text('{"task": "rte", "accur')
    spy.clear()
    main(argv)
    assert [c["seed"] for c in spy] == [3]
    assert json.loads((out / "results.json").read_text()) == results
    # continuing with another recipe would mix two recipes' seeds: one line, nothing run
    spy.clear()
    with pytest.raises(SystemExit) as exited:
        main([*argv[:-1], "1,2,3,4", "--lr", "1e-3"])
    assert exited.value.code == 2 and spy == []
    assert "was fine-tuned with lr 0.0001 (now 0.001)" in capsys.readouterr().err
    # --seed and --seeds together: argparse refuses
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--seed", "5"])
    assert exited.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_summary_of_an_even_count_and_of_mnli_mismatched():
    summary = summarize({1: {"accuracy": 0.8, "accuracy_mm": 0.7, "lr": 1e-4},
                         2: {"accuracy": 0.6, "accuracy_mm": 0.9, "lr": 1e-4}})
    assert summary["median"] == pytest.approx({"accuracy": 0.7, "accuracy_mm": 0.8})  # the two middles' mean
    assert summary["std"]["accuracy"] == pytest.approx(0.1414, abs=1e-4)
    assert summarize({7: {"accuracy": 0.5}})["std"] == {"accuracy": None}  # one seed: no spread
    # a NaN correlation (a constant prediction) is no score: left out, not sorted into the median
    nan = summarize({1: {"spearmanr": float("nan")}, 2: {"spearmanr": 0.7}, 3: {"spearmanr": 0.5}})
    assert (nan["median"]["spearmanr"], nan["std"]["spearmanr"]) == pytest.approx((0.6, 0.1414), abs=1e-4)


def test_recipe_defaults_follow_electra_and_bert_by_size():
    assert [model_size(h) for h in (64, 256, 512, 768, 1024)] == ["small", "small", "small", "base", "large"]
    # ELECTRA Appendix A: lr 3e-4 / 1e-4 / 5e-5, layer-wise decay 0.8 / 0.8 / 0.9, batch 32, warmup 0.1
    electra = {h: recipe_for("electra", h, "glue") for h in (256, 768, 1024)}
    assert [(r.lr, r.layerwise_decay, r.batch_size, r.warmup_ratio, r.epochs) for r in electra.values()] == [
        (3e-4, 0.8, 32, 0.1, None), (1e-4, 0.8, 32, 0.1, None), (5e-5, 0.9, 32, 0.1, None)]
    squad = recipe_for("electra", 768, "squad")
    assert (squad.max_seq_len, squad.doc_stride, squad.epochs) == (512, 128, 2)
    # BERT: no layer-wise decay (24 layers x 0.8 would leave BERT-large's embeddings at about 3e-7)
    bert = recipe_for("bert", 1024, "glue")
    assert (bert.lr, bert.layerwise_decay, bert.epochs, bert.batch_size) == (2e-5, 1.0, 3, 32)
    assert recipe_for("bert", 768, "squad").max_seq_len == 384
    # RoBERTa's sweep point (its Table 10): lr 1e-5, batch 32, 10 epochs, warmup 6 %, no layer-wise decay
    roberta = recipe_for("roberta", 1024, "glue")
    assert (roberta.lr, roberta.layerwise_decay, roberta.epochs, roberta.batch_size, roberta.warmup_ratio) == (
        1e-5, 1.0, 10, 32, 0.06)
    with pytest.raises(UserError, match="--recipe deberta: choose auto, electra, bert or roberta"):
        recipe_for("deberta", 768, "glue")


def test_the_cli_takes_the_models_recipe_and_a_given_flag_wins(tmp_path, spy):
    small = tiny_model(tmp_path / "electra", ElectraConfig(embedding_size=32, hidden_size=256, num_hidden_layers=2,
                                                           num_attention_heads=4, intermediate_size=64))
    base = ["finetune", "glue", "--task", "rte", "--model", small, "--data-dir", "d"]
    main([*base, "--output-dir", str(tmp_path / "a"), "--seed", "1"])
    main([*base, "--output-dir", str(tmp_path / "b"), "--seed", "2", "--lr", "1e-5", "--layerwise-decay", "1"])
    main([*base, "--output-dir", str(tmp_path / "c"), "--seed", "3", "--recipe", "bert"])
    recipe = ("lr", "layerwise_decay", "epochs", "batch_size", "warmup_ratio", "max_seq_len")
    assert [tuple(c[k] for k in recipe) for c in spy] == [(3e-4, 0.8, None, 32, 0.1, 128),  # ELECTRA-small's
                                                         (1e-5, 1.0, None, 32, 0.1, 128),
                                                         (1e-4, 1.0, 4, 32, 0.1, 128)]  # BERT's compact models'
    assert spy[0]["out"] == tmp_path / "a"  # one seed: straight into --output-dir, as before


def test_squad_seeds_at_electras_lengths(tmp_path, monkeypatch):
    """`finetune squad --seeds`: an ELECTRA-base-sized model takes ELECTRA's SQuAD recipe (512 tokens, stride 128,
    2 epochs, lr 1e-4, decay 0.8), each seed into its folder, exact match and F1 summarised."""
    from truneg.eval import squad

    calls = []

    def finetune_squad(model, train, dev, out, **kw):
        calls.append(kw)
        return {"exact_match": 70.0 + kw["seed"], "f1": 80.0 + kw["seed"], **kw}

    monkeypatch.setattr(squad, "finetune_squad", finetune_squad)
    model = tiny_model(tmp_path / "m", ElectraConfig(embedding_size=32, hidden_size=768, num_hidden_layers=1,
                                                     num_attention_heads=12, intermediate_size=64))
    main(["finetune", "squad", "--model", model, "--train", "t", "--dev", "d", "--output-dir", str(tmp_path / "q"),
          "--seeds", "3,1,2"])
    assert [(c["seed"], c["max_seq_len"], c["doc_stride"], c["epochs"], c["lr"], c["layerwise_decay"])
            for c in calls] == [(s, 512, 128, 2, 1e-4, 0.8) for s in (3, 1, 2)]
    results = json.loads((tmp_path / "q" / "results.json").read_text())
    assert (results["exact_match"], results["f1"], results["seeds"]) == (72.0, 82.0, [3, 1, 2])
    assert results["std"]["f1"] == pytest.approx(1.0)
