"""The training forward traces as one graph: static shapes, no boolean indexing, no host sync (issue: a GPU step).

torch.compile(fullgraph=True) raises at the first graph break; the "eager" backend runs dynamo only, so this
stays fast on the CPU while checking what Inductor and CUDA graphs need on a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from truneg.data.blocks import load_tokenizer
from truneg.data.masking import mask_tokens
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable


@pytest.fixture(scope="module")
def batch():
    tokenizer = load_tokenizer()
    rows = np.random.default_rng(0).integers(1000, 30000, (2, 32))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    return mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", 0, 0,
                       np.arange(2), max_predictions=8)


@pytest.mark.parametrize("preset", ["bert-tiny", "electra-tiny"])
@pytest.mark.parametrize("objective", [dict(hc=True, sr="word"), dict(hc=False, sr="sent")])
def test_training_forward_compiles_without_a_graph_break(preset, objective, batch):
    lookup = SynonymLookup(SynonymTable.load(SHIPPED_WORDNET_TABLE)) if objective["hc"] else None
    torch.manual_seed(0)
    model = build_pretrainer(preset, ObjectiveConfig(hc_lookup=lookup, sr=objective["sr"])).train()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager", dynamic=False)
    torch.manual_seed(1)
    loss, stats = compiled(**batch)
    torch.manual_seed(1)
    eager_loss, eager_stats = model(**batch)
    assert torch.allclose(loss, eager_loss) and stats.keys() == eager_stats.keys()
    loss.backward()
    assert model.word_embeddings.weight.grad is not None
