"""The held-out evaluation in one process: its figures against independent computations (HF's models on the same
masked inputs, scikit-learn's metrics), its sharding over ranks, and the model's mode after it. (In real launches:
test_engine, test_reliability, test_analysis.)"""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, cli_in_process, hub_snapshot
from sklearn.metrics import accuracy_score, precision_score, recall_score, roc_auc_score

from truneg.data.blocks import load_tokenizer
from truneg.data.masking import default_max_predictions, mask_tokens
from truneg.model import pretrainers as models
from truneg.train.build import wordnet_table
from truneg.train.heldout import (
    EVAL_SEED,
    HeldOut,
    disc_sums,
    masked_logits,
    metrics_of,
    roc_auc,
    sample_with,
)

SEQ_LEN, COUNT, MICRO = 32, 37, 4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def blocks(tokenizer) -> np.ndarray:
    """[CLS] 30 tokens of the novel [SEP], as pre-training packs it."""
    text = (REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt").read_text()[:20_000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = SEQ_LEN - 2
    rows = [[tokenizer.cls_token_id, *ids[i:i + body], tokenizer.sep_token_id] for i in range(0, 60 * body, body)]
    return np.array(rows, dtype=np.int32)


def frequent_word_bias(mlm, tokenizer) -> None:
    """An untrained head predicts nothing right; this one's bias makes "the" its argmax and a few words likely, so
    that the accuracy and the loss are not trivial."""
    with torch.no_grad():
        for rank, word in enumerate(["the", ",", ".", "of", "and"]):
            mlm.cls.predictions.bias[tokenizer.convert_tokens_to_ids(word)] += 8.0 - rank


def reference_batch(blocks, tokenizer, scheme):
    """The first COUNT sequences masked by training's own function: seed 0, epoch 0, their indices."""
    return mask_tokens(blocks[:COUNT], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), scheme,
                       EVAL_SEED, 0, np.arange(COUNT), default_max_predictions(SEQ_LEN))


def near_pairs(scores: np.ndarray, labels: np.ndarray, spread: float) -> int:
    """The (positive, negative) pairs whose two scores lie within `spread` of each other."""
    positives, negatives = np.sort(scores[labels]), scores[~labels]
    return int((np.searchsorted(positives, negatives + spread, "right")
                - np.searchsorted(positives, negatives - spread, "left")).sum())


def top_two_gaps(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def in_micro_batches(forward, *tensors: torch.Tensor) -> torch.Tensor:
    """`forward` over the eval's micro-batches of MICRO rows, concatenated: the eval's own shapes."""
    return torch.cat([forward(*(t[s:s + MICRO] for t in tensors)) for s in range(0, COUNT, MICRO)])


# The references below are HF's models in one forward of COUNT rows with the full MLM head; the eval runs MICRO-row
# micro-batches through the head at the masked slots: other shapes, so other roundings. Each comparison allows what
# a difference of at most d (the largest seen between the two computations' logits) can change, and no more: a
# cross-entropy moves by at most 2d, an argmax only where its top two logits lie within 2d, a threshold only where a
# score lies within d of it, and a (positive, negative) pair's order only where its two scores lie within 2d.


def test_bert_eval_equals_hf_bert_for_masked_lm_on_the_same_masked_inputs(blocks, tokenizer):
    torch.manual_seed(0)
    model = models.build_pretrainer("bert-tiny", models.ObjectiveConfig())
    frequent_word_bias(model.mlm, tokenizer)
    figures = HeldOut(blocks, tokenizer, "bert", COUNT, MICRO, None).evaluate(model)

    batch = reference_batch(blocks, tokenizer, "bert")
    labels = torch.full_like(batch["original_ids"], -100)
    rows = torch.arange(COUNT)[:, None].expand_as(batch["masked_positions"])
    at = batch["masked_valid"]
    labels[rows[at], batch["masked_positions"][at]] = batch["original_ids"][rows[at], batch["masked_positions"][at]]
    model.mlm.eval()
    with torch.no_grad():
        hf = model.mlm(input_ids=batch["input_ids"], labels=labels)  # HF's own loss: the full head, mean over labels
        ours = in_micro_batches(lambda ids, at: masked_logits(model.mlm, ids, at), batch["input_ids"],
                                batch["masked_positions"])
    model.mlm.train()
    labelled = labels != -100
    theirs = hf.logits[rows[at], batch["masked_positions"][at]]
    d = (ours[at] - theirs).abs().max().item()
    correct = int((hf.logits.argmax(-1)[labelled] == labels[labelled]).sum())
    flippable = int((top_two_gaps(theirs) <= 2 * d).sum())
    masked = int(labelled.sum())
    assert figures["eval_masked"] == masked and figures["eval_sequences"] == COUNT
    # (+ fp32's own rounding: a few ulps of the log-sum-exp of logits below 32, 2e-6 each, and HF's mean over n < 200
    # positions, n x 2^-24 relative)
    assert abs(figures["eval_mlm_loss"] - hf.loss.item()) <= 2 * d + 1e-5 * (1 + hf.loss.item())
    assert abs(figures["eval_mlm_accuracy"] * masked - correct) <= flippable + 1e-9
    assert 0.02 < figures["eval_mlm_accuracy"] < 1 and flippable < masked / 100
    assert figures["eval_perplexity"] == pytest.approx(math.exp(figures["eval_mlm_loss"]), rel=1e-12)


def test_electra_disc_metrics_equal_scikit_learns_on_the_same_scores(blocks, tokenizer):
    """The figures against scikit-learn's on the eval's own scores, exactly; and those scores against HF's models in one
    forward, by what their roundings can change (see above)."""
    torch.manual_seed(1)
    model = models.build_pretrainer("electra-tiny", models.ObjectiveConfig())
    with torch.no_grad():  # a discriminator that scores something: a replaced token reads as [MASK] does
        model.discriminator.discriminator_predictions.dense_prediction.bias += 0.3
    heldout = HeldOut(blocks, tokenizer, "electra", COUNT, MICRO, None)
    figures = heldout.evaluate(model)
    _, _, (own_scores, own_labels, counted) = heldout.local_sums(model)
    own_scores, own_labels = own_scores[counted].numpy(), own_labels[counted].numpy()  # sequences 0..COUNT-1, in order

    # the metrics of the eval's own scores: scikit-learn's, exactly
    assert 0 < own_labels.sum() < len(own_labels)
    assert (figures["eval_disc_replaced"], figures["eval_disc_tokens"]) == (own_labels.sum(), COUNT * SEQ_LEN)
    assert figures["eval_disc_auc"] == pytest.approx(roc_auc_score(own_labels, own_scores), rel=1e-12)
    assert figures["eval_disc_precision"] == pytest.approx(precision_score(own_labels, own_scores > 0), rel=1e-12)
    assert figures["eval_disc_recall"] == pytest.approx(recall_score(own_labels, own_scores > 0), rel=1e-12)
    assert figures["eval_disc_accuracy"] == pytest.approx(accuracy_score(own_labels, own_scores > 0), rel=1e-12)
    bce = F.binary_cross_entropy_with_logits(torch.from_numpy(own_scores), torch.from_numpy(own_labels).float())
    assert figures["eval_disc_loss"] == pytest.approx(bce.item(), rel=1e-6)  # (fixed point against a float mean)

    # HF's generator and discriminator in one forward each
    batch = reference_batch(blocks, tokenizer, "electra")
    slots = default_max_predictions(SEQ_LEN)
    uniforms = torch.from_numpy(np.stack([np.random.default_rng([EVAL_SEED, 0, i, 1]).random(slots)
                                          for i in range(COUNT)]).astype(np.float32))
    positions, valid = batch["masked_positions"], batch["masked_valid"]
    model.eval()
    with torch.no_grad():
        logits = model.generator(input_ids=batch["input_ids"]).logits  # HF's full head, gathered after
        at_masked = logits.gather(1, positions[..., None].expand(-1, -1, logits.shape[-1]))
        sample = sample_with(at_masked, uniforms)
        own_logits = in_micro_batches(lambda ids, at: masked_logits(model.generator, ids, at), batch["input_ids"],
                                      positions)
        filled = batch["input_ids"].clone()
        rows = torch.arange(COUNT)[:, None].expand_as(positions)
        filled[rows[valid], positions[valid]] = sample[valid]
        scores = model.discriminator(input_ids=filled).logits.flatten().numpy()
    model.train()
    labels = (filled != batch["original_ids"]).flatten().numpy()
    gold = batch["original_ids"].gather(1, positions)
    # a sample (inverse CDF) moves only where its uniform lies near a bound of its token's CDF interval: logits moved
    # by at most d scale each probability by at most e^(2d), so every CDF value moves by at most e^(2d) - 1
    d_gen = (own_logits - at_masked)[valid].abs().max().item()
    cdf = torch.softmax(at_masked.float(), -1).cumsum(-1)
    target = uniforms * cdf[..., -1]
    upper = cdf.gather(-1, sample[..., None]).squeeze(-1)
    lower = torch.where(sample > 0, cdf.gather(-1, (sample - 1).clamp(min=0)[..., None]).squeeze(-1), 0.0)
    flippable = valid & (torch.minimum(target - lower, upper - target) <= 2 * (math.expm1(2 * d_gen)))
    own_sample = sample_with(own_logits, uniforms)
    moved = valid & (own_sample != sample)
    assert not (moved & ~flippable).any() and int(flippable.sum()) < int(valid.sum()) / 20
    ce = F.cross_entropy(at_masked[valid], gold[valid])
    assert abs(figures["eval_mlm_loss"] - ce.item()) <= 2 * d_gen + 1e-5 * (1 + ce.item())
    hits = int((sample[valid] == gold[valid]).sum())
    assert abs(figures["eval_mlm_sampled_accuracy"] * int(valid.sum()) - hits) <= int(moved.sum()) + 1e-9

    # the discriminator's scores on the sequences whose samples agree (all of them, unless one moved): the AUC by
    # (positive, negative) pairs, the thresholded counts by scores within d of 0
    kept = np.repeat(~moved.any(1).numpy(), SEQ_LEN)
    assert (own_labels[kept] == labels[kept]).all()
    ours, theirs, labels = own_scores[kept], scores[kept], labels[kept].astype(bool)
    d = np.abs(ours - theirs).max()
    near = near_pairs(theirs, labels, 2 * d)
    pairs = int(labels.sum()) * int((~labels).sum())
    assert abs(roc_auc_score(labels, ours) - roc_auc_score(labels, theirs)) * pairs <= near + 1e-6
    assert near < pairs / 1000  # the two computations agree: a wrong forward's scores would not
    at_threshold = int((np.abs(theirs) <= d).sum())
    assert abs(int(((ours > 0) == labels).sum()) - int(((theirs > 0) == labels).sum())) <= at_threshold


def test_roc_auc_is_exact_with_ties():
    rng = np.random.default_rng(0)
    scores = np.round(rng.normal(size=2000), 1)  # many ties
    labels = rng.random(2000) < 1 / (1 + np.exp(-2 * scores))
    assert roc_auc(torch.from_numpy(scores).float(), torch.from_numpy(labels)) == pytest.approx(
        roc_auc_score(labels, scores.astype(np.float32)), rel=1e-12)
    assert math.isnan(roc_auc(torch.ones(3), torch.zeros(3)))


@pytest.mark.parametrize("preset", ["bert-tiny", "electra-tiny"])
def test_two_ranks_shares_add_up_to_one_ranks_bitwise_and_the_model_is_left_training(preset, blocks, tokenizer):
    """Sequence i on rank i % 2, each share padded to whole micro-batches with zero weight: the two ranks' sums
    (what the all-reduce adds) are one rank's, bit for bit, and so are the discriminator's scores; the generator's
    samples and the masks follow the sequence, not its rank or batch. Dropout is off in the eval (two evals agree)
    and on after it."""
    torch.manual_seed(2)
    model = models.build_pretrainer(preset, models.ObjectiveConfig(), dropout=0.1)
    table = wordnet_table(tokenizer)
    one = HeldOut(blocks, tokenizer, model.scheme, COUNT, MICRO, table)
    shares = [HeldOut(blocks, tokenizer, model.scheme, COUNT, MICRO, table, rank=r, world_size=2) for r in range(2)]
    assert [len(s.batches) for s in shares] == [5, 5]  # 19 sequences each, padded to 20
    keys, sums, scores = one.local_sums(model)
    parts = [share.local_sums(model) for share in shares]
    assert all(p[0] == keys for p in parts)
    assert torch.equal(parts[0][1] + parts[1][1], sums)
    figures = metrics_of(dict(zip(keys, sums.tolist())), None if scores is None else
                         roc_auc(scores[0][scores[2]], scores[1][scores[2]]))
    figures["eval_synonym_table"] = f"{table.source} {table.content_sha256[:16]}"  # the table counted with
    assert figures == one.evaluate(model) == one.evaluate(model)  # dropout off in the eval
    if scores is not None:
        order = np.argsort(np.r_[np.arange(0, COUNT, 2), np.arange(1, COUNT, 2)], kind="stable")
        counted = [p[2][0][p[2][2]].view(-1, SEQ_LEN) for p in parts]
        assert torch.equal(torch.cat(counted)[torch.from_numpy(order)], scores[0][scores[2]].view(-1, SEQ_LEN))
    assert model.training and all(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))
    model.eval()
    one.evaluate(model)
    assert not model.training  # the mode it was in


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_evaluates_as_its_fp32_self_within_rounding(dtype, blocks, tokenizer):
    """The weights as DeepSpeed's fp16 and bf16 engines hold them (the module cast; fp16's engine runs on GPUs
    only): every figure finite, the masks the same, and the MLM's figures the fp32 model's up to what its logits'
    largest difference d can change (a cross-entropy by 2d, an argmax only where its top two lie within 2d). The
    discriminator's head runs in fp32: on the same inputs its half-precision scores barely tie (a half-precision head's
    logits keep 8 or 11 bits, and ties count half in the AUC), and rank the (positive, negative) pairs as fp32's does
    but where a pair's scores lie within 2d."""
    for preset in ("bert-tiny", "electra-tiny"):
        torch.manual_seed(5)
        model = models.build_pretrainer(preset, models.ObjectiveConfig())
        if preset == "bert-tiny":
            frequent_word_bias(model.mlm, tokenizer)
        lowered = copy.deepcopy(model).to(dtype)
        heldout = HeldOut(blocks, tokenizer, model.scheme, COUNT, MICRO, wordnet_table(tokenizer))
        full, half = heldout.evaluate(model), heldout.evaluate(lowered)
        assert full.keys() == half.keys() and all(math.isfinite(v) for v in half.values() if not isinstance(v, str))
        assert [half[k] for k in ("eval_sequences", "eval_masked")] == [full[k] for k in ("eval_sequences",
                                                                                          "eval_masked")]
        mlm_of = (lambda m: m.mlm) if preset == "bert-tiny" else (lambda m: m.generator)
        with torch.no_grad():
            logits = [torch.cat([masked_logits(mlm_of(m).eval(), b["input_ids"], b["masked_positions"]).float()
                                 for b in heldout.batches]) for m in (model, lowered)]
        valid = torch.cat([b["masked_valid"] for b in heldout.batches])
        d = (logits[1] - logits[0])[valid].abs().max().item()
        flippable = int(((top_two_gaps(logits[0]) <= 2 * d) & valid).sum())
        assert abs(half["eval_mlm_loss"] - full["eval_mlm_loss"]) <= 2 * d + 1e-5 * (1 + full["eval_mlm_loss"])
        if preset == "bert-tiny":  # the argmax is BERT's prediction: its hits and Table 2's mismatches
            assert abs(half["eval_mlm_accuracy"] - full["eval_mlm_accuracy"]) * full["eval_masked"] <= flippable + 1e-9
            assert abs(half["eval_mismatched"] - full["eval_mismatched"]) <= flippable
            continue
        # ELECTRA: the discriminator of each model on one input, the fp32 generator's samples filled in
        scores = []
        for discriminator in (model.discriminator, lowered.discriminator):
            own = []
            for batch, gen_logits in zip(heldout.batches, logits[0].split(MICRO)):
                sample = sample_with(gen_logits, batch["uniforms"])
                with torch.no_grad():
                    _, disc_logits, labels = disc_sums(discriminator.eval(), batch, sample, batch["rows"][:, None]
                                                       .expand_as(batch["input_ids"]))
                own.append((disc_logits[batch["rows"]], labels[batch["rows"]]))
            scores.append((torch.cat([s for s, _ in own]).flatten().numpy(),
                           torch.cat([lab for _, lab in own]).flatten().numpy()))
        (fp32, labels), (lowered_scores, _) = scores
        assert len(np.unique(lowered_scores)) > 0.99 * len(lowered_scores)  # a half-precision head ties one in six here
        d = np.abs(lowered_scores - fp32).max()
        pairs = int(labels.sum()) * int((~labels).sum())
        moved = abs(roc_auc_score(labels, lowered_scores) - roc_auc_score(labels, fp32)) * pairs
        assert moved <= near_pairs(fp32, labels, 2 * d) + 1e-6 < pairs / 10


def test_sampling_follows_the_softmax():
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.3]])).expand(20000, 3)
    uniforms = torch.from_numpy(np.random.default_rng(0).random(20000).astype(np.float32))
    counts = torch.bincount(sample_with(logits[:, None], uniforms[:, None]).flatten(), minlength=3) / 20000
    assert torch.allclose(counts, torch.tensor([0.1, 0.6, 0.3]), atol=0.01)


def test_the_eval_runs_the_layers_compile_adds_its_graphs_to_the_summary_and_leaves_trainings_alone(blocks, tokenizer):
    """--compile layers (ELECTRA: both encoders and all three heads compiled): the eval calls the compiled parts (eval
    mode, no grad: graphs of its own, which the run's compile summary counts), with no graph break and the eager
    figures; training afterwards compiles nothing new."""
    preset = "electra-tiny"
    from torch._dynamo.utils import counters

    from truneg.model.compile import compile_layers
    from truneg.train.loop import compile_summary

    torch.manual_seed(3)
    eager = models.build_pretrainer(preset, models.ObjectiveConfig())
    compiled = models.build_pretrainer(preset, models.ObjectiveConfig())
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compile_layers(compiled, backend="eager")  # dynamo's graphs and guards, without AOTAutograd's seconds
    batch = mask_tokens(blocks[:MICRO], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                        compiled.scheme, 0, 0, np.arange(MICRO), default_max_predictions(SEQ_LEN))
    compiled(**batch)[0].backward()
    trained_graphs = counters["stats"]["unique_graphs"]
    heldout = HeldOut(blocks, tokenizer, compiled.scheme, 8, MICRO, None)
    figures = heldout.evaluate(compiled)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > trained_graphs and not sum(counters["graph_break"].values())
    assert compile_summary() == f"compile: {graphs} graph(s), 0 graph break(s)"
    expected = heldout.evaluate(eager)
    assert figures.keys() == expected.keys()
    assert all(figures[k] == pytest.approx(expected[k], rel=1e-6) for k in figures)
    compiled(**batch)[0].backward()
    assert counters["stats"]["unique_graphs"] == graphs


def test_the_eval_under_the_whole_compile_runs_eager_and_adds_no_graph(blocks, tokenizer):
    """--compile whole (DeepSpeed's engine.compile: the pre-trainer's forward compiled in place, as
    nn.Module.compile does): the eval calls the encoders and heads, not that forward, so it runs them eager, with
    the eager figures bitwise and no graph of its own; training's graph is left alone."""
    from torch._dynamo.utils import counters

    torch.manual_seed(3)
    eager = models.build_pretrainer("bert-tiny", models.ObjectiveConfig())
    compiled = models.build_pretrainer("bert-tiny", models.ObjectiveConfig())
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled.compile(backend="eager", dynamic=False)  # engine.compile(compile_kwargs={"dynamic": False})
    batch = mask_tokens(blocks[:MICRO], tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer),
                        compiled.scheme, 0, 0, np.arange(MICRO), default_max_predictions(SEQ_LEN))
    compiled(**batch)[0].backward()
    trained_graphs = counters["stats"]["unique_graphs"]
    heldout = HeldOut(blocks, tokenizer, compiled.scheme, 8, MICRO, None)
    assert trained_graphs >= 1 and heldout.evaluate(compiled) == heldout.evaluate(eager)
    compiled(**batch)[0].backward()
    assert counters["stats"]["unique_graphs"] == trained_graphs and not sum(counters["graph_break"].values())


def test_truneg_eval_takes_an_electra_pair_of_hub_names_as_init_generator_does(tmp_path, offline_hub, monkeypatch):
    """`truneg eval DISCRIMINATOR GENERATOR`: two hub names (an offline HF cache), tied into one model as a run
    continuing them would be, and its figures those of the model they were saved from; `fn-stats` of the
    generator's name counts the same false negatives."""
    from truneg.data.blocks import open_training_blocks

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer()
    torch.manual_seed(4)
    model = models.build_pretrainer("electra-tiny", models.ObjectiveConfig())
    model.discriminator.save_pretrained(hub_snapshot(offline_hub, "org/tiny-discriminator", "d1" * 20))
    model.generator.save_pretrained(hub_snapshot(offline_hub, "org/tiny-generator", "e1" * 20))
    text = tmp_path / "held-out.txt"
    text.write_text((REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt").read_text()[:30_000])
    proc = cli_in_process("eval", "org/tiny-discriminator", "org/tiny-generator", "--data", str(text), "--seq-len",
                          str(SEQ_LEN), "--eval-max-sequences", str(COUNT), "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [record] = json.loads((tmp_path / "eval.json").read_text())
    blocks, _ = open_training_blocks([str(text)], tokenizer, SEQ_LEN)
    expected = HeldOut(blocks, tokenizer, "electra", COUNT, 32, wordnet_table(tokenizer)).evaluate(model)
    assert (record.pop("checkpoint"), record.pop("step")) == ("org/tiny-discriminator", -1)
    record.pop("eval_seconds")
    assert record == expected and record["eval_sequences"] == COUNT
    # fn-stats finds the generator's hub name as `truneg eval` does: the same Table 2 of its samples
    proc = cli_in_process("fn-stats", "--checkpoints", "org/tiny-generator", "--data", str(text), "--seq-len",
                          str(SEQ_LEN), "--max-sequences", str(COUNT), "--out", str(tmp_path / "fn"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [row] = json.loads((tmp_path / "fn" / "fn_stats.json").read_text())
    assert (row["checkpoint"], row["sequences"], row["mismatched"]) == ("org/tiny-generator", COUNT,
                                                                        record["eval_mismatched"])
    assert (row["iter_ratio"], row["pred_ratio"]) == (record["eval_hc_iter_ratio"], record["eval_hc_pred_ratio"])
