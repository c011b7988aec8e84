"""Presets and wiring: the masked-only head equals HF's full-vocab MLM loss; ELECTRA shares and ties."""
from __future__ import annotations

import pytest
import torch
from conftest import hub_snapshot, model_inputs, sentence_transformers_folder
from transformers import BertConfig, BertForMaskedLM

from truneg.model.pretrainers import BertPretrainer, ObjectiveConfig, build_pretrainer, parameter_groups


def masked_batch(seed=0, batch=4, length=32, vocab=30522):
    gen = torch.Generator().manual_seed(seed)
    original = torch.randint(1000, vocab, (batch, length), generator=gen)
    selected = torch.rand(batch, length, generator=gen) < 0.15
    selected[:, 1] = True
    labels = torch.where(selected, original, torch.full_like(original, -100))
    inputs = original.masked_fill(selected, 103)
    return inputs, torch.ones_like(inputs), labels, original


def test_masked_only_head_equals_hf_full_head_loss():
    torch.manual_seed(0)
    hf = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=128)).eval()
    inputs, attention, labels, original = masked_batch()
    reference = hf(input_ids=inputs, attention_mask=attention, labels=labels).loss
    ours, stats = BertPretrainer(hf, ObjectiveConfig())(**model_inputs(inputs, labels, original))
    assert abs(ours.item() - reference.item()) < 1e-5
    assert stats["masked"].item() == (labels != -100).sum().item()


def test_electra_generator_loss_equals_hf_electra_mlm_loss():
    torch.manual_seed(0)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(), dropout=0.0).eval()
    inputs, attention, labels, original = masked_batch(1)
    reference = model.generator(input_ids=inputs, attention_mask=attention, labels=labels).loss
    _, stats = model(**model_inputs(inputs, labels, original))
    assert abs(stats["gen_loss"].item() - reference.item()) < 1e-5


def test_electra_shares_embeddings_and_ties_the_generator_head():
    model = build_pretrainer("electra-tiny", ObjectiveConfig())
    assert model.generator.electra.embeddings is model.discriminator.electra.embeddings
    assert model.generator.generator_lm_head.weight is model.discriminator.electra.embeddings.word_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert sum("embeddings.word_embeddings" in n for n in names) == 1  # one shared matrix, counted once
    assert not any("generator_lm_head.weight" in n for n in names)


def test_presets_build_the_official_sizes_on_the_meta_device():
    """The built modules, not the preset constants: generator 1/4 (small) or 1/3 (base) as wide, same depth,
    one shared embedding; BERT-large 24 x 1024 with 335M parameters. On the meta device: no memory, no time."""
    with torch.device("meta"):
        for preset, ratio in (("electra-small", 4), ("electra-base", 3)):
            model = build_pretrainer(preset, ObjectiveConfig())
            disc, gen = model.discriminator.electra, model.generator.electra
            width = lambda encoder: encoder.layer[0].attention.self.query.out_features  # noqa: E731
            assert width(disc.encoder) == ratio * width(gen.encoder)
            assert len(disc.encoder.layer) == len(gen.encoder.layer) == 12
        assert model.discriminator.config.hidden_size == 768 and model.word_embeddings.weight.shape == (30522, 768)
        large = build_pretrainer("bert-large", ObjectiveConfig())
    assert len(large.mlm.bert.encoder.layer) == 24 and large.mlm.bert.encoder.layer[0].output.dense.out_features == 1024
    assert 330e6 < sum(p.numel() for p in large.parameters()) < 340e6
    assert large.mlm.config._attn_implementation == "sdpa"


def test_parameter_groups_exclude_biases_and_layernorm_from_weight_decay():
    model = build_pretrainer("electra-tiny", ObjectiveConfig())
    decay, no_decay = parameter_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert no_decay["weight_decay"] == 0.0 and "weight_decay" not in decay
    assert all(names[id(p)].endswith("bias") or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert all(not names[id(p)].endswith("bias") and "LayerNorm" not in names[id(p)] for p in decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert any("embeddings.LayerNorm.weight" in names[id(p)] for p in no_decay["params"])
    assert any("word_embeddings" in names[id(p)] for p in decay["params"])


def test_vocab_size_follows_the_tokenizer():
    model = build_pretrainer("bert-tiny", ObjectiveConfig(), vocab_size=1000)
    assert model.word_embeddings.weight.shape[0] == 1000 and model.mlm.cls.predictions.decoder.out_features == 1000


def test_init_from_keeps_or_applies_dropout_and_refuses_a_contradicting_preset(tmp_path):
    from truneg.errors import UserError
    from truneg.model.pretrainers import architecture

    build_pretrainer("bert-tiny", ObjectiveConfig(), dropout=0.2).mlm.save_pretrained(tmp_path / "bert")
    kept = build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "bert")
    assert kept.mlm.config.hidden_dropout_prob == 0.2 and kept.mlm.bert.embeddings.dropout.p == 0.2
    assert all(m.training for m in kept.modules())  # from_pretrained's eval mode would turn the dropout off
    inputs, _, labels, original = masked_batch(3)
    batch = model_inputs(inputs, labels, original)
    assert kept(**batch)[0].item() != kept(**batch)[0].item()  # dropout draws anew
    applied = build_pretrainer("bert-tiny", ObjectiveConfig(), init_from=tmp_path / "bert", dropout=0.0)
    assert all(m.p == 0.0 for m in applied.modules() if isinstance(m, torch.nn.Dropout))
    assert architecture(applied) == {"family": "bert", "layers": 2, "hidden": 64, "vocab_size": 30522, "dropout": 0.0}
    with pytest.raises(UserError, match="contradicts"):
        build_pretrainer("bert-base", ObjectiveConfig(), init_from=tmp_path / "bert")
    with pytest.raises(UserError, match="holds a BERT checkpoint"):
        build_pretrainer("electra-tiny", ObjectiveConfig(), init_from=tmp_path / "bert")
    # the preset a checkpoint matches (preflight's default config for it), from its config.json alone
    from truneg.model.presets import matching_preset

    electra = build_pretrainer("electra-tiny", ObjectiveConfig())
    electra.generator.save_pretrained(tmp_path / "electra" / "generator")
    electra.discriminator.save_pretrained(tmp_path / "electra" / "discriminator")
    assert matching_preset(tmp_path / "bert") == "bert-tiny"
    assert matching_preset(tmp_path / "electra") == "electra-tiny"
    assert all(m.training for m in build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "electra").modules())
    assert matching_preset(tmp_path / "nothing") is None
    # a checkpoint without the pre-training head (a BertModel: sentence encoders, classifiers' bodies) would start
    # the head random, which HF only logs; a tokenizer larger than the embeddings would index past them
    kept.mlm.bert.save_pretrained(tmp_path / "body")
    with pytest.raises(UserError, match=r"lacks \d+ weights of BertForMaskedLM \(cls\.predictions"):
        build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "body")
    with pytest.raises(UserError, match="the tokenizer has 30600 tokens, --init-from's embeddings 30522 rows"):
        build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "bert", vocab_size=30600)


def test_electra_logs_argmax_and_sampled_generator_accuracy(monkeypatch):
    """The generator's argmax and its Gumbel sample are right at different, known slots: each stat counts its own."""
    import truneg.model.pretrainers

    torch.manual_seed(0)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(), dropout=0.0).eval()
    inputs, _, labels, original = masked_batch(3)
    batch = model_inputs(inputs, labels, original)
    gold, valid = original.gather(1, batch["masked_positions"]), batch["masked_valid"]
    slot = torch.arange(gold.shape[1]).expand_as(gold)
    argmax = torch.where(slot % 2 == 0, gold, (gold + 1) % 30522)  # right at even slots
    sample = torch.where(slot % 3 == 0, gold, (gold + 2) % 30522)  # right at every third slot
    logits = torch.zeros(*gold.shape, 30522).scatter(-1, argmax.unsqueeze(-1), 9.0).requires_grad_()
    monkeypatch.setattr(model, "masked_logits", lambda *a: logits)
    monkeypatch.setattr(truneg.model.pretrainers, "gumbel_max_sample", lambda given: sample)
    _, stats = model(**batch)
    assert stats["mlm_argmax_correct"].item() == (valid & (slot % 2 == 0)).sum().item() > 0
    assert stats["mlm_sampled_correct"].item() == (valid & (slot % 3 == 0)).sum().item() > 0


def test_sentence_sr_reuses_the_masked_encoding_and_is_zero_for_identical_sentences(monkeypatch):
    """SR_Sent (BERT, default target "masked"): one extra encoder pass, and KL 0 when the predictions fill the
    masked sentence with what it already holds (dropout off)."""
    torch.manual_seed(0)
    model = build_pretrainer("bert-tiny", ObjectiveConfig(sr="sent"), dropout=0.0).eval()
    inputs, _, labels, original = masked_batch(4)
    batch = model_inputs(inputs, labels, original)
    calls = []
    real_encode = model.encode
    monkeypatch.setattr(model, "encode", lambda *a: calls.append(1) or real_encode(*a))
    _, stats = model(**batch)
    assert len(calls) == 2, "the MLM pass and H_p only"
    # predictions equal to the masked sentence's own tokens at the masked positions: s_p == s
    vocab = model.mlm.config.vocab_size
    current = inputs.gather(1, batch["masked_positions"])
    forced = torch.full((*current.shape, vocab), -30.0).scatter(-1, current.unsqueeze(-1), 30.0)
    monkeypatch.setattr(model, "masked_logits", lambda *a: forced)
    _, stats = model(**batch)
    assert stats["sr_loss"].item() < 1e-7
    model.set_objective(ObjectiveConfig(sr="sent", sr_sent_target="original"))
    calls.clear()
    _, stats = model(**batch)
    assert len(calls) == 3 and stats["sr_loss"].item() > 1e-6


def test_word_sr_leaves_out_a_predicted_pad():
    """[PAD]'s row is tiny but not zero once the tied head has moved it: SR would pull it with a gradient of
    about 1 / |row|. A predicted [PAD] is left out; the other positions keep their mean."""
    model = build_pretrainer("electra-tiny", ObjectiveConfig(sr="word"))
    pad = model.word_embeddings.padding_idx
    with torch.no_grad():
        model.word_embeddings.weight[pad] = 1e-4
    gold, pred = torch.tensor([[2000, 2001, 2002]]), torch.tensor([[2100, pad, 2102]])
    valid = torch.ones_like(gold, dtype=torch.bool)
    stats = {}
    total = model.add_soft_regularization(torch.zeros(()), stats, gold, pred, valid, None)
    total.backward()
    from truneg.model.objectives import soft_regularization

    expected = soft_regularization(model.word_embeddings.weight.detach(), gold[:, [0, 2]], pred[:, [0, 2]])
    assert torch.allclose(stats["sr_loss"], expected)
    assert model.word_embeddings.weight.grad.to_dense()[pad].abs().max() == 0


def test_electra_discriminator_labels_the_replaced_masked_tokens_and_teaches_the_generator_nothing(monkeypatch):
    """google-research/electra: the discriminator's labels are (sampled input != original), token by token; a
    row's padding slots (it has fewer masked positions than another) mark nothing, though they point at
    position 0; and the sample is not differentiated: no gradient of the discriminator's loss reaches the
    generator's own weights."""
    import truneg.model.pretrainers

    torch.manual_seed(0)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(), dropout=0.0)
    inputs, _, labels, original = masked_batch(5)
    batch = model_inputs(inputs, labels, original)
    positions, valid = batch["masked_positions"], batch["masked_valid"]
    assert (~valid).any()  # rows of unequal masked counts: padding slots
    gold = original.gather(1, positions)
    slot = torch.arange(gold.shape[1]).expand_as(gold)
    sample = torch.where(slot % 2 == 0, gold, (gold + 1) % 30522)  # a replacement at odd slots, padding ones too
    expected = torch.zeros_like(original)
    for row in range(len(original)):
        for k in range(positions.shape[1]):
            if valid[row, k] and k % 2 == 1:
                expected[row, positions[row, k]] = 1
    seen = []
    discriminator_loss = truneg.model.pretrainers.discriminator_loss

    def recorded(logits, disc_labels, attention_mask):
        seen.append(disc_labels)
        return discriminator_loss(logits, disc_labels, attention_mask)

    with monkeypatch.context() as patch:
        patch.setattr(truneg.model.pretrainers, "gumbel_max_sample", lambda logits: sample)
        patch.setattr(truneg.model.pretrainers, "discriminator_loss", recorded)
        model(**batch)
    assert torch.equal(seen[0].long(), expected) and expected.sum() > 0
    # the discriminator's loss alone (the generator's MLM loss zeroed): the generator's own weights get nothing
    monkeypatch.setattr(truneg.model.pretrainers, "mlm_loss", lambda logits, *a: logits.sum() * 0)
    loss, _ = model(**batch)
    loss.backward()
    own = {n: p for n, p in model.generator.named_parameters() if "embeddings" not in n and "lm_head" not in n}
    assert own and all(p.grad is None or not p.grad.any() for p in own.values())
    assert model.word_embeddings.weight.grad.abs().sum() > 0  # shared with the discriminator: it learns


def test_a_continued_bert_carries_its_checkpoints_pooler_outside_the_trained_module(tmp_path):
    """A BertForPreTraining checkpoint's pooler (which BertForMaskedLM drops) is kept as loaded: no parameter (no
    optimizer, no decay), not in the module's state (no bf16 or fp16 copy). A model from scratch, or a checkpoint
    without a pooler, has none."""
    from transformers import BertForPreTraining

    from truneg.model.presets import BERT_PRESETS

    public = BertForPreTraining(BertConfig(**BERT_PRESETS["bert-tiny"], vocab_size=1000))
    public.save_pretrained(tmp_path / "public")
    model = build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "public", vocab_size=1000)
    loaded = {f"bert.pooler.{k}": v for k, v in public.bert.pooler.state_dict().items()}
    assert model.pooler.keys() == loaded.keys() and all(torch.equal(model.pooler[k], v) for k, v in loaded.items())
    carried = {id(t) for t in model.pooler.values()}
    assert not carried & {id(p) for group in parameter_groups(model) for p in group["params"]}
    assert not carried & {id(p) for p in model.parameters()} and not any("pooler" in k for k in model.state_dict())
    model.to(torch.bfloat16)  # as DeepSpeed casts the module for a bf16 run
    assert all(v.dtype == torch.float32 and torch.equal(v, loaded[k]) for k, v in model.pooler.items())
    assert build_pretrainer("bert-tiny", ObjectiveConfig()).pooler is None
    model.mlm.save_pretrained(tmp_path / "mlm")
    assert build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "mlm", vocab_size=1000).pooler is None


def test_electra_from_its_two_checkpoints_shares_one_embedding_and_refuses_a_pair_that_cannot(tmp_path, capsys,
                                                                                             offline_hub):
    """--init-from DISCRIMINATOR --init-generator GENERATOR, each a folder or a hub name (the public ELECTRA is two
    repos): tied as the official ELECTRA shares them, the discriminator's copy kept and named when they differ."""
    import argparse

    from transformers import ElectraConfig, ElectraForMaskedLM

    from truneg.errors import UserError
    from truneg.model import hub
    from truneg.model.presets import BERT_PRESETS, ELECTRA_PRESETS
    from truneg.train.checkpointing.run_dir import run_identity
    from truneg.train.config.args import parse_args
    from truneg.train.config.checks import effective_preset
    from truneg.train.config.run_config import RunConfig

    pair = build_pretrainer("electra-tiny", ObjectiveConfig())
    disc_snapshot = hub_snapshot(offline_hub, "org/tiny-electra-discriminator")
    pair.discriminator.save_pretrained(disc_snapshot)
    pair.generator.save_pretrained(tmp_path / "gen")
    disc = hub.locate("org/tiny-electra-discriminator", "--init-from").path

    def load(generator) -> object:
        return build_pretrainer(None, ObjectiveConfig(), init_from=disc, init_generator=generator)

    model = load(tmp_path / "gen")
    assert model.generator.electra.embeddings is model.discriminator.electra.embeddings
    assert model.generator.generator_lm_head.weight is model.word_embeddings.weight
    assert sum("word_embeddings" in name for name, _ in model.named_parameters()) == 1  # one parameter
    assert torch.equal(model.word_embeddings.weight, pair.word_embeddings.weight) and capsys.readouterr().out == ""
    # a generator whose copy differs: one line names what differs and which copy is kept
    other = ElectraForMaskedLM(pair.generator.config)
    other.load_state_dict(pair.generator.state_dict())
    other.electra.embeddings.word_embeddings.weight.data += 1.0
    other.save_pretrained(tmp_path / "gen-differs")
    kept = load(tmp_path / "gen-differs")
    note = capsys.readouterr().out
    assert note.count("\n") == 1 and "word_embeddings.weight" in note and "the discriminator's copy is kept" in note
    assert torch.equal(kept.word_embeddings.weight, model.word_embeddings.weight)
    # pairs that cannot be tied, and folders of the wrong kind: one line each
    small = ElectraConfig(**{**ELECTRA_PRESETS["electra-tiny"][1], "embedding_size": 32, "vocab_size": 1000})
    ElectraForMaskedLM(small).save_pretrained(tmp_path / "gen-small")
    with pytest.raises(UserError, match=r"cannot share one embedding \(vocab_size 1000 vs 30522, embedding_size 32 vs "
                                        r"64\)"):
        load(tmp_path / "gen-small")
    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.save_pretrained(tmp_path / "bert")
    with pytest.raises(UserError, match="--init-generator .* holds a bert model"):
        load(tmp_path / "bert")
    pair.generator.save_pretrained(tmp_path / "both" / "generator")
    pair.discriminator.save_pretrained(tmp_path / "both" / "discriminator")
    with pytest.raises(UserError, match="holds its own generator/"):
        build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "both", init_generator=tmp_path / "gen")
    other.save_pretrained(tmp_path / "both-differ" / "generator")  # the one-folder form names the copy kept too
    pair.discriminator.save_pretrained(tmp_path / "both-differ" / "discriminator")
    capsys.readouterr()
    build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "both-differ")
    assert "the discriminator's copy is kept" in capsys.readouterr().out
    for preset in (None, "electra-tiny"):  # the discriminator alone: not read as a BERT with every weight missing
        with pytest.raises(UserError, match="holds one ELECTRA model, not a BERT; pass its generator beside it"):
            build_pretrainer(preset, ObjectiveConfig(), init_from=disc)
    # the flags: the generator needs its discriminator, makes an ELECTRA run, and is part of the run's identity
    with pytest.raises(UserError, match="pass --init-from too"):
        parse_args(["--init-generator", str(tmp_path / "gen")])
    with pytest.raises(UserError, match="--model bert-tiny a BERT one"):
        parse_args(["--init-from", str(disc), "--init-generator", str(tmp_path / "gen"), "--model", "bert-tiny"])
    args = parse_args(["--init-from", "org/tiny-electra-discriminator", "--init-generator", str(tmp_path / "gen")])
    # the discriminator is ELECTRA's by its model_type, with its generator or alone (which the start then refuses):
    # never the BERT preset of its sizes (electra-tiny's has bert-tiny's, google/electra-base-discriminator BERT-base's)
    alone = argparse.Namespace(**{**vars(args), "init_generator": None})
    assert effective_preset(args) == effective_preset(alone) == "electra-tiny"
    assert all(pair.discriminator.config.to_dict()[k] == v for k, v in BERT_PRESETS["bert-tiny"].items())
    assert run_identity(RunConfig.from_args(args), {}, {})["init_generator"] == str(tmp_path / "gen")


def test_new_head_continues_an_encoder_without_its_mlm_head(tmp_path):
    """--new-head: the encoder's weights load bitwise, its bare-keyed pooler is carried under BERT's names, the
    head starts as HF initialises it (the same under the same seed), tied to the embeddings, and trains. Without
    the flag the encoder is refused naming it; a checkpoint that has its head refuses the flag."""
    from truneg.errors import UserError

    encoder = sentence_transformers_folder(tmp_path / "st")
    with pytest.raises(UserError, match=r"lacks 6 weights of BertForMaskedLM .* pass --new-head"):
        build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "st")
    torch.manual_seed(1)
    model = build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "st", new_head=True, dropout=0.0)
    loaded = model.mlm.bert.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in encoder.state_dict().items() if not k.startswith("pooler."))
    assert set(model.pooler) == {"bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert torch.equal(model.pooler["bert.pooler.dense.weight"], encoder.pooler.dense.weight)
    head = model.mlm.cls.predictions
    assert head.decoder.weight is model.word_embeddings.weight
    assert torch.equal(head.transform.LayerNorm.weight, torch.ones(64))
    assert not head.transform.LayerNorm.bias.any() and not head.bias.any() and not head.transform.dense.bias.any()
    assert 0.015 < head.transform.dense.weight.std().item() < 0.025  # normal(0, initializer_range 0.02)
    torch.manual_seed(1)
    again = build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "st", new_head=True, dropout=0.0)
    assert torch.equal(again.mlm.cls.predictions.transform.dense.weight, head.transform.dense.weight)
    inputs, _, labels, original = masked_batch(5, vocab=2000)
    batch = model_inputs(inputs, labels, original)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(5):
        loss = model(**batch)[0]
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert losses[-1] < losses[0] - 0.1
    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.save_pretrained(tmp_path / "with-head")
    with pytest.raises(UserError, match="has its MLM head .* drop --new-head"):
        build_pretrainer(None, ObjectiveConfig(), init_from=tmp_path / "with-head", new_head=True)


def test_new_head_is_for_bert_continued_runs():
    from truneg.errors import UserError
    from truneg.train.config.args import parse_args

    with pytest.raises(UserError, match="--new-head starts the MLM head a checkpoint lacks: pass --init-from"):
        parse_args(["--new-head"])
    with pytest.raises(UserError, match="ELECTRA's generator is its MLM"):
        parse_args(["--new-head", "--init-from", "a", "--init-generator", "b"])
