"""Presets and wiring: the masked-only head equals HF's full-vocab MLM loss; ELECTRA shares and ties."""
from __future__ import annotations

import torch
from transformers import BertConfig, BertForMaskedLM

from truneg.models import ELECTRA_PRESETS, BertPretrainer, ObjectiveConfig, build_pretrainer


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
    hf = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)).eval()
    inputs, attention, labels, original = masked_batch()
    reference = hf(input_ids=inputs, attention_mask=attention, labels=labels).loss
    ours, stats = BertPretrainer(hf, ObjectiveConfig())(inputs, attention, labels, original)
    assert abs(ours.item() - reference.item()) < 1e-5
    assert stats["masked"].item() == (labels != -100).sum().item()


def test_electra_generator_loss_equals_hf_electra_mlm_loss():
    torch.manual_seed(0)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(), dropout=0.0).eval()
    inputs, attention, labels, original = masked_batch(1)
    reference = model.generator(input_ids=inputs, attention_mask=attention, labels=labels).loss
    _, stats = model(inputs, attention, labels, original)
    assert abs(stats["gen_loss"].item() - reference.item()) < 1e-5


def test_electra_shares_embeddings_and_ties_the_generator_head():
    model = build_pretrainer("electra-tiny", ObjectiveConfig())
    assert model.generator.electra.embeddings is model.discriminator.electra.embeddings
    assert model.generator.generator_lm_head.weight is model.discriminator.electra.embeddings.word_embeddings.weight
    names = [n for n, _ in model.named_parameters()]
    assert sum("embeddings.word_embeddings" in n for n in names) == 1  # one shared matrix, counted once
    assert not any("generator_lm_head.weight" in n for n in names)


def test_electra_preset_sizes_follow_the_official_ratios():
    for preset, ratio in (("electra-small", 4), ("electra-base", 3)):
        disc, gen = ELECTRA_PRESETS[preset]
        assert disc["hidden_size"] == ratio * gen["hidden_size"]
        assert disc["num_hidden_layers"] == gen["num_hidden_layers"] and disc["embedding_size"] == gen["embedding_size"]
    assert ELECTRA_PRESETS["electra-base"][0]["hidden_size"] == 768


def test_bert_large_preset_shape():
    model = build_pretrainer("bert-large", ObjectiveConfig())
    assert model.mlm.config.num_hidden_layers == 24 and model.mlm.config.hidden_size == 1024
    assert 330e6 < sum(p.numel() for p in model.parameters()) < 340e6
