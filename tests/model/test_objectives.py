"""The objectives against slow pure-Python references, and HC on a crafted batch of real synonyms."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import model_inputs

from truneg.model import pretrainers as models
from truneg.model.objectives import (
    discriminator_loss,
    gumbel_max_sample,
    hard_correction,
    mlm_loss,
    replaced_token_labels,
    sentence_regularization,
    soft_regularization,
)
from truneg.model.pretrainers import BertPretrainer, ObjectiveConfig, build_pretrainer
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable


@pytest.fixture(scope="module")
def table() -> SynonymTable:
    return SynonymTable.load(SHIPPED_WORDNET_TABLE)


@pytest.fixture(scope="module")
def lookup(table) -> SynonymLookup:
    return SynonymLookup(table)


def ids(table, *words):
    return torch.tensor([table.token_to_id[w] for w in words])


def ref_log_softmax(row):
    top = max(row)
    log_sum = top + math.log(sum(math.exp(v - top) for v in row))
    return [v - log_sum for v in row]


@pytest.mark.parametrize("seed", range(3))
def test_mlm_loss_with_correction_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(12, 50, generator=gen, dtype=torch.float64)
    gold = torch.randint(0, 50, (12,), generator=gen)
    corrected = torch.rand(12, generator=gen) < 0.3
    kept = [-ref_log_softmax(logits[i].tolist())[gold[i]] for i in range(12) if not corrected[i]]
    assert abs(mlm_loss(logits, gold, ~corrected).item() - sum(kept) / len(kept)) < 1e-6
    everything = [-ref_log_softmax(logits[i].tolist())[gold[i]] for i in range(12)]
    assert abs(mlm_loss(logits, gold, torch.ones(12, dtype=torch.bool)).item() - sum(everything) / 12) < 1e-6
    assert mlm_loss(logits, gold, torch.zeros(12, dtype=torch.bool)).item() == 0.0
    # [B, P] slots: padding slots (keep False) count for nothing
    padded = mlm_loss(logits.reshape(3, 4, 50), gold.reshape(3, 4), (~corrected).reshape(3, 4))
    assert abs(padded.item() - sum(kept) / len(kept)) < 1e-6
    # train_step's global masked count: the kept positions' sum over it, a corrected position weighing 0, with no
    # gradient into its logits
    leaf = logits.clone().requires_grad_()
    over_global = mlm_loss(leaf, gold, ~corrected, torch.tensor(40.0))
    assert abs(over_global.item() - sum(kept) / 40) < 1e-6
    over_global.backward()
    assert not leaf.grad[corrected].any() and leaf.grad[~corrected].abs().sum(-1).gt(0).all()


@pytest.mark.parametrize("seed", range(3))
def test_soft_regularization_value_and_gradient_match_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    emb = torch.randn(30, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    gold = torch.randint(0, 30, (10,), generator=gen)
    pred = torch.randint(0, 30, (10,), generator=gen)
    value = soft_regularization(emb, gold, pred)
    # In a model the matrix is also the input embedding (a dense gradient); SR's own may be sparse (on the
    # CPU), and the parameter's gradient must still come out dense, as DeepSpeed and the optimizers take it.
    (value + (emb * 0).sum()).backward()
    assert emb.grad.layout == torch.strided
    E = emb.detach().numpy()
    ref_value, ref_grad = 0.0, np.zeros_like(E)
    for g, p in zip(gold.tolist(), pred.tolist()):
        a, b = E[g], E[p]
        na, nb = math.sqrt(a @ a), math.sqrt(b @ b)
        cos = (a @ b) / (na * nb)
        ref_value += (1 - cos) / len(gold)
        # d(1 - cos)/da = -(b / (|a||b|) - cos a / |a|^2), and symmetrically for b
        ref_grad[g] += -(b / (na * nb) - cos * a / na**2) / len(gold)
        ref_grad[p] += -(a / (na * nb) - cos * b / nb**2) / len(gold)
    assert abs(value.item() - ref_value) < 1e-6
    np.testing.assert_allclose(emb.grad.numpy(), ref_grad, atol=1e-6)
    assert (emb.grad[pred].abs().sum(1) > 0).all() and (emb.grad[gold].abs().sum(1) > 0).all()
    # SR alone: the same gradient, whatever its layout
    alone = emb.detach().clone().requires_grad_()
    soft_regularization(alone, gold, pred).backward()
    np.testing.assert_allclose(alone.grad.to_dense().numpy(), ref_grad, atol=1e-6)


def test_soft_regularization_leaves_out_a_zero_row():
    """HF zero-initialises the [PAD] row: a predicted [PAD] has no cosine, and must not blow up the gradient
    (cosine_similarity's eps would make it |E[gold]| / 1e-8); the other positions keep their mean."""
    gen = torch.Generator().manual_seed(0)
    emb = torch.randn(30, 8, generator=gen)
    emb[0] = 0.0
    emb.requires_grad_()
    gold, pred, valid = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 0, 11, 12]), torch.tensor([True, True, True,
                                                                                                False])
    value = soft_regularization(emb, gold, pred, valid)
    value.backward()
    expected = soft_regularization(emb.detach(), gold[[0, 2]], pred[[0, 2]])
    assert torch.allclose(value, expected)
    assert emb.grad.to_dense().abs().max() < 10 and not emb.grad.to_dense()[0].any()
    # over train_step's global masked count: the same two terms, summed over it (the zero row's weighs 0)
    over_global = soft_regularization(emb.detach(), gold, pred, valid, torch.tensor(9.0))
    assert torch.allclose(over_global, expected * 2 / 9)


def test_sentence_regularization_matches_reference():
    gen = torch.Generator().manual_seed(0)
    h_p, h_s = torch.randn(2, 5, 6, generator=gen), torch.randn(2, 5, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    total, count = 0.0, 0
    for b in range(2):
        for t in range(5):
            if mask[b, t]:
                lp, ls = ref_log_softmax(h_p[b, t].tolist()), ref_log_softmax(h_s[b, t].tolist())
                total += sum(math.exp(x) * (x - y) for x, y in zip(lp, ls))
                count += 1
    assert abs(sentence_regularization(h_p, h_s, mask).item() - total / count) < 1e-6
    assert sentence_regularization(h_p, h_p, mask).item() < 1e-7


def test_discriminator_loss_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(3, 7, generator=gen), (torch.rand(3, 7, generator=gen) < 0.3).long()
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[2, 4:] = 0
    terms = [math.log(1 + math.exp(-x)) if y else math.log(1 + math.exp(x))
             for x, y, m in zip(logits.flatten().tolist(), labels.flatten().tolist(), mask.flatten().tolist()) if m]
    assert abs(discriminator_loss(logits, labels, mask).item() - sum(terms) / len(terms)) < 1e-6


def test_hard_correction_on_real_synonyms(table, lookup):
    gold = ids(table, "primary", "stay", "house", "primary", "happy", "ran", "run")
    pred = ids(table, "main", "remain", "house", "banana", "glad", "run", "ran")
    # The row read is the gold token's: "run" is in the row of "ran" (lemmatised), "ran" not in that of "run".
    assert hard_correction(gold, pred, lookup).tolist() == [True, True, False, False, True, True, False]


def test_gumbel_max_samples_follow_the_softmax():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0]])).repeat(60_000, 1)
    counts = torch.bincount(gumbel_max_sample(logits), minlength=3).float() / 60_000
    assert torch.allclose(counts, torch.tensor([1 / 6, 2 / 6, 3 / 6]), atol=0.01)


def crafted_batch(table):
    """Two sequences; masked positions hold primary, ran, house and happy. "run" is in the synonym row of
    "ran" but not "ran" in that of "run": a correction that read the prediction's row would miss it."""
    original = ids(table, "the", "primary", "ran", "was", "house", "long", "happy", "day").reshape(2, 4)
    labels = torch.full_like(original, -100)
    for b, t in [(0, 1), (0, 2), (1, 0), (1, 2)]:
        labels[b, t] = original[b, t]
    inputs = original.masked_fill(labels != -100, 103)
    return model_inputs(inputs, labels, original), labels


def forced_logits(table, words, vocab=30522):
    """Logits whose argmax and Gumbel sample are certainly `words`; differentiable like a real head."""
    logits = torch.zeros(len(words), vocab)
    logits[torch.arange(len(words)), ids(table, *words)] = 60.0
    return logits.reshape(2, -1, vocab).requires_grad_()  # [B, P, V]: two sequences, as crafted_batch


def test_hc_removes_exactly_the_synonym_positions_from_the_mlm_loss(table, lookup, monkeypatch):
    batch, labels = crafted_batch(table)
    preds = ["main", "run", "house", "sad"]  # two synonyms, one correct, one wrong
    logits = forced_logits(table, preds)
    model = BertPretrainer(build_pretrainer("bert-tiny", ObjectiveConfig()).mlm, ObjectiveConfig(hc_lookup=lookup))
    monkeypatch.setattr(model, "masked_logits", lambda *a: logits)
    loss, stats = model(**batch)
    gold = labels[labels != -100]
    kept = F.cross_entropy(logits.reshape(4, -1)[[2, 3]],
                           gold[[2, 3]])  # the correct and the wrong prediction keep their loss
    assert torch.allclose(loss, kept)
    assert stats["corrected"].item() == 2 and stats["mismatched"].item() == 3
    assert stats["sequences_corrected"].item() == 1  # only the first sequence holds corrections


def test_hc_relabels_exactly_the_synonym_samples_as_original_for_the_discriminator(table, lookup, monkeypatch):
    batch, _ = crafted_batch(table)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(hc_lookup=lookup))
    monkeypatch.setattr(model, "masked_logits", lambda *a: forced_logits(table, ["main", "run", "house", "sad"]))
    captured = {}

    def spy(logits, labels, attention_mask=None):
        captured["labels"] = labels
        return discriminator_loss(logits, labels, attention_mask)

    monkeypatch.setattr(models, "discriminator_loss", spy)
    model(**batch)
    # replaced: primary->main (synonym: original), ran->run (synonym: original), house->house (same), happy->sad
    # (replaced)
    assert captured["labels"].tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]
    without_hc = build_pretrainer("electra-tiny", ObjectiveConfig())
    monkeypatch.setattr(without_hc, "masked_logits", lambda *a: forced_logits(table, ["main", "run", "house", "sad"]))
    without_hc(**batch)
    assert captured["labels"].tolist() == [[0, 1, 1, 0], [0, 0, 1, 0]]


def test_replaced_token_labels_reference():
    original = torch.tensor([[5, 6, 7, 8]])
    disc_input = torch.tensor([[5, 9, 7, 10]])
    corrected = torch.tensor([[False, True, False, False]])
    assert replaced_token_labels(disc_input, original, corrected).tolist() == [[0, 0, 0, 1]]
    assert replaced_token_labels(disc_input, original, None).tolist() == [[0, 1, 0, 1]]


def test_baseline_path_is_the_plain_cross_entropy_up_to_float_rounding():
    torch.manual_seed(0)
    mlm = build_pretrainer("bert-tiny", ObjectiveConfig(), dropout=0.0).mlm.eval()
    gen = torch.Generator().manual_seed(1)
    original = torch.randint(1000, 30000, (3, 16), generator=gen)
    labels = torch.full_like(original, -100)
    labels[:, [2, 5, 9]] = original[:, [2, 5, 9]]
    inputs = original.masked_fill(labels != -100, 103)
    loss, stats = BertPretrainer(mlm, ObjectiveConfig())(**model_inputs(inputs, labels, original))
    hidden = mlm.bert(input_ids=inputs, attention_mask=torch.ones_like(inputs)).last_hidden_state
    masked = labels != -100
    # HF's own loss, with boolean indexing and an all-ones attention mask: equal up to float rounding
    assert torch.allclose(loss, F.cross_entropy(mlm.cls(hidden[masked]), labels[masked]), rtol=0, atol=1e-6)
    assert "sr_loss" not in stats and stats["corrected"].item() == 0


@pytest.mark.parametrize("preset", ["bert-tiny", "electra-tiny"])
def test_the_global_masked_count_divides_the_mlm_loss_and_word_sr(preset, table, lookup, monkeypatch):
    """train_step's `masked_denominator` (the global batch's masked count): the MLM / generator cross-entropy over
    the kept positions and word-level SR over the counted ones, each summed and divided by it; without it, means
    over the micro-batch. The discriminator's loss (a mean over the micro-batch's tokens) is the same either way."""
    torch.manual_seed(0)
    objective = ObjectiveConfig(hc_lookup=lookup, hc_prediction="argmax", sr="word", sr_weight=2.0)
    model = build_pretrainer(preset, objective, dropout=0.0).eval()
    batch, labels = crafted_batch(table)
    predicted = ["main", "run", "house", "sad"]  # two synonyms (corrected), one correct, one wrong
    logits = forced_logits(table, predicted)
    monkeypatch.setattr(model, "masked_logits", lambda *a: logits)
    torch.manual_seed(5)
    _, mean_stats = model(**batch)
    torch.manual_seed(5)  # the same Gumbel noise: the same ELECTRA sample
    loss, stats = model(**batch, masked_denominator=torch.tensor(10.0))

    gold = labels[labels != -100]
    kept_ce = F.cross_entropy(logits.reshape(4, -1)[[2, 3]].detach(), gold[[2, 3]], reduction="sum")
    rows = model.word_embeddings.weight.detach()
    one_minus_cos = 1 - F.cosine_similarity(rows[gold], rows[ids(table, *predicted)], dim=-1)
    mlm = "mlm_loss" if preset.startswith("bert") else "gen_loss"
    assert torch.allclose(stats[mlm], kept_ce / 10) and torch.allclose(mean_stats[mlm], kept_ce / 2)
    assert torch.allclose(stats["sr_loss"], one_minus_cos.sum() / 10)
    assert torch.allclose(mean_stats["sr_loss"], one_minus_cos.mean())
    disc = 50 * stats["disc_loss"] if "disc_loss" in stats else 0.0
    if "disc_loss" in stats:
        assert torch.equal(stats["disc_loss"], mean_stats["disc_loss"])
    assert torch.allclose(loss, stats[mlm] + disc + 2.0 * stats["sr_loss"])


@pytest.mark.parametrize("preset", ["bert-tiny", "electra-tiny"])
@pytest.mark.parametrize("sr", ["word", "sent"])
def test_sr_and_hc_combine_and_add_to_the_loss(preset, sr, table, lookup, monkeypatch):
    """With real synonym predictions (two of four corrected), HC still changes the loss when SR is on, and SR
    adds sr_weight x its own term to whatever HC left."""
    torch.manual_seed(0)
    model = build_pretrainer(preset, ObjectiveConfig(), dropout=0.0).eval()
    batch, _ = crafted_batch(table)
    logits = forced_logits(table, ["main", "run", "house", "sad"])  # two synonyms, one correct, one wrong
    monkeypatch.setattr(model, "masked_logits", lambda *a: logits)

    def loss_and_stats(objective: ObjectiveConfig):
        model.set_objective(objective)
        torch.manual_seed(5)  # the same Gumbel noise and the same ELECTRA sample in every call
        return model(**batch)

    with_sr, stats = loss_and_stats(ObjectiveConfig(hc_lookup=lookup, sr=sr, sr_weight=2.0))
    hc_only, hc_stats = loss_and_stats(ObjectiveConfig(hc_lookup=lookup))
    neither, _ = loss_and_stats(ObjectiveConfig())
    assert stats["corrected"].item() == hc_stats["corrected"].item() == 2
    assert not torch.allclose(hc_only, neither)  # HC took the two synonyms out of the loss
    assert stats["sr_loss"].item() > 0
    assert torch.allclose(with_sr, hc_only + 2.0 * stats["sr_loss"], atol=1e-5)


def test_hc_prediction_chooses_what_hc_judges_and_the_discriminator_always_sees_the_sample(table, lookup, monkeypatch):
    """--hc-prediction argmax for ELECTRA: the generator's loss drops the positions whose argmax is a synonym, while
    the discriminator's labels follow its input, the sample. --hc-prediction sample for BERT: HC judges the sample."""
    batch, labels = crafted_batch(table)  # gold: primary, ran, house, happy
    argmax = ["main", "banana", "house", "glad"]  # synonyms at 0 and 3
    sample = ids(table, "sad", "run", "house", "glad").reshape(2, 2)  # synonyms at 1 and 3
    monkeypatch.setattr(models, "gumbel_max_sample", lambda logits: sample)
    captured = {}

    def spy(logits, labels, attention_mask=None):
        captured["labels"] = labels
        return discriminator_loss(logits, labels, attention_mask)

    monkeypatch.setattr(models, "discriminator_loss", spy)
    gold = labels[labels != -100]
    electra = build_pretrainer("electra-tiny", ObjectiveConfig(hc_lookup=lookup, hc_prediction="argmax"), dropout=0.0)
    logits = forced_logits(table, argmax)
    monkeypatch.setattr(electra, "masked_logits", lambda *a: logits)
    _, stats = electra(**batch)
    assert torch.allclose(stats["gen_loss"], F.cross_entropy(logits.reshape(4, -1)[[1, 2]], gold[[1, 2]]))
    assert stats["corrected"].item() == 2
    # the sample: primary->sad replaced, ran->run a synonym (original), house the same, happy->glad a synonym
    assert captured["labels"].tolist() == [[0, 1, 0, 0], [0, 0, 0, 0]]

    bert = BertPretrainer(build_pretrainer("bert-tiny", ObjectiveConfig()).mlm,
                          ObjectiveConfig(hc_lookup=lookup, hc_prediction="sample"))
    monkeypatch.setattr(bert, "masked_logits", lambda *a: logits)
    loss, stats = bert(**batch)  # argmax would keep positions 1 and 2; the sample keeps 0 and 2
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(4, -1)[[0, 2]], gold[[0, 2]]))


def test_the_run_config_reaches_the_model(tmp_path):
    """What the command line asks for is what the model's objective holds (build_model)."""
    from truneg.synonyms.table import SHIPPED_WORDNET_TABLE
    from truneg.train.build import build_model
    from truneg.train.config.args import parse_args
    from truneg.train.config.run_config import RunConfig

    cfg = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--hc", "wordnet", "--hc-prediction", "sample",
                                          "--sr", "sent", "--sr-weight", "0.25", "--sr-sent-target", "original",
                                          "--output-dir", str(tmp_path)]))
    model = build_model(cfg, SynonymTable.load(SHIPPED_WORDNET_TABLE), 30522)
    objective = model.objective
    assert isinstance(objective.hc_lookup, SynonymLookup) and model.prediction == "sample"
    assert (objective.sr, objective.sr_weight, objective.sr_sent_target) == ("sent", 0.25, "original")
