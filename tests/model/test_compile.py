"""The training forward traces as one graph: static shapes, no boolean indexing, no host sync (issue: a GPU step);
and `--compile layers` traces each encoder layer, the embeddings and the heads whole, and trains as eager.

torch.compile(fullgraph=True) raises at the first graph break; the "eager" backend runs dynamo only and
"aot_eager" AOTAutograd's forward and backward graphs too, without Inductor's codegen, so this stays fast on the
CPU while checking what Inductor and CUDA graphs need on a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters
from transformers import ElectraForMaskedLM, ElectraForPreTraining

from truneg.data.blocks import load_tokenizer
from truneg.data.masking import mask_tokens
from truneg.model.compile import compile_layers
from truneg.model.pretrainers import ElectraPretrainer, ObjectiveConfig, build_pretrainer
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable
from truneg.train.checkpointing.export import load_into
from truneg.train.config.args import parse_args
from truneg.train.config.checks import resolve_config, start_problems


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


STEPS = 3  # optimizer steps compared with eager


def _graphs_and_breaks() -> tuple[int, int]:
    return counters["stats"].get("unique_graphs", 0), sum(counters["graph_break"].values())


@pytest.mark.parametrize("preset", ["bert-tiny", "electra-tiny"])
@pytest.mark.parametrize("objective", [dict(hc=True, sr="word"), dict(hc=False, sr="sent")])
def test_layers_compile_traces_each_part_whole_and_trains_as_eager(preset, objective, batch, tmp_path):
    """--compile layers through AOTAutograd (aot_eager: the forward and backward graphs Inductor gets, without its
    codegen): no graph break, one graph per kind of part, the eager state-dict keys, and STEPS steps of losses and
    weights equal to eager's (bitwise here: aot_eager runs the same ATen kernels, dropout's draws in the same
    order; Inductor's kernels on a GPU differ in rounding and in dropout's random numbers)."""
    lookup = SynonymLookup(SynonymTable.load(SHIPPED_WORDNET_TABLE)) if objective["hc"] else None
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_pretrainer(preset, ObjectiveConfig(hc_lookup=lookup, sr=objective["sr"])).train())
    eager, compiled = models
    torch._dynamo.reset()
    counters.clear()
    parts = compile_layers(compiled, backend="aot_eager")
    assert parts == (4 if preset == "bert-tiny" else 7)  # 2 layers (x2 for ELECTRA) + embeddings + head(s)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(STEPS):
            torch.manual_seed(100 + step)  # the same dropout masks and Gumbel draws on both sides
            loss, _ = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    # embeddings, a graph all layers share, and the head(s): ELECTRA's generator and discriminator layers differ
    assert _graphs_and_breaks() == ((3, 0) if preset == "bert-tiny" else (5, 0))
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-6, abs=0), losses
    assert len(set(losses["eager"])) == STEPS  # it trained: the losses moved
    for (name, p), q in zip(eager.state_dict().items(), compiled.state_dict().values()):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-7), name


def test_a_layers_compiled_model_exports_and_loads_with_from_pretrained(batch, tmp_path):
    """A compiled model's weights take export's path (its strict key check, then save_pretrained) and load back
    with from_pretrained: `--compile layers` leaves no `_orig_mod.` in a checkpoint's keys."""
    torch.manual_seed(0)
    model = build_pretrainer("electra-tiny", ObjectiveConfig(sr="word")).train()
    torch._dynamo.reset()
    compile_layers(model, backend="aot_eager")
    loss, _ = model(**batch)
    loss.backward()
    holder = ElectraPretrainer(ElectraForMaskedLM(model.generator.config),
                               ElectraForPreTraining(model.discriminator.config), ObjectiveConfig())
    load_into(holder, model.state_dict(), "the compiled model")
    for part in ("generator", "discriminator"):
        getattr(holder, part).save_pretrained(tmp_path / part)
    loaded = ElectraForPreTraining.from_pretrained(tmp_path / "discriminator")
    for name, value in model.discriminator.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert ElectraForMaskedLM.from_pretrained(tmp_path / "generator").config.hidden_size == 16


@pytest.mark.parametrize("argv, mode", [([], None), (["--compile"], "layers"), (["--compile", "whole"], "whole"),
                                        (["--compile", "--seed", "3"], "layers")])
def test_the_bare_compile_flag_means_layers(argv, mode):
    assert parse_args(argv).compile == mode


def test_layers_compile_at_zero3_is_refused_in_one_line(tmp_path):
    for config, refused in (("cpu_zero3.json", True), ("cpu_zero2.json", False)):
        args = parse_args(["--compile", "--deepspeed_config", f"ds_configs/{config}", "--output-dir", str(tmp_path)])
        problems = start_problems(args, resolve_config(args, 1, None)[0], 1, None)
        assert any(p.startswith("--compile layers is not checked at ZeRO-3") for p in problems) == refused, problems
