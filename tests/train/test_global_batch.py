"""A global batch is one batch: its accumulated gradient does not depend on how it is split into micro-batches
and ranks.

BERT (bert-tiny, dropout 0) with argmax HC and word-level SR, trained by truneg's own `train_step` on DeepSpeed's
real engine at ZeRO-0 and ZeRO-2: 8 sequences as 2 micro-batches of 4 and as 4 of 2 in one process, and as 2 ranks
x 2 micro-batches of 2, whose masked and kept counts differ from micro-batch to micro-batch. The gradient each
engine holds before its optimizer step is compared with an independent reference: one forward over the 8
sequences, the cross-entropy and 1 - cos summed over the global batch and divided by its masked count, by plain
autograd. (Not the weights after a step: Adam's first update is about lr * sign(g), which would hide the difference.)
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import REPO, finished, free_port

from truneg.data.masking import mask_tokens
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer, parameter_groups
from truneg.synonyms.table import SynonymLookup, SynonymTable
from truneg.train import loop
from truneg.train.observe.efficiency import TimedBatches
from truneg.train.observe.metrics import MetricsLogger

PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB, SEQ_LEN, SEQUENCES, MAX_PREDICTIONS = 64, 32, 8, 5
# real tokens per sequence: 15 % of them masked (at least 1, at most MAX_PREDICTIONS), so the counts differ
CONTENT = [30, 6, 20, 30, 10, 26, 4, 30]


def global_batch() -> dict[str, torch.Tensor]:
    """8 sequences ([CLS] tokens [SEP] [PAD]...), masked by truneg's own masking."""
    rng = np.random.default_rng(0)
    rows = np.full((SEQUENCES, SEQ_LEN), PAD)
    for row, length in enumerate(CONTENT):
        rows[row, 0], rows[row, 1 : length + 1], rows[row, length + 1] = CLS, rng.integers(4, VOCAB, length), SEP
    return mask_tokens(rows, [PAD, CLS, SEP, MASK], MASK, VOCAB, "bert", 0, 0, np.arange(SEQUENCES), MAX_PREDICTIONS)


def lookup() -> SynonymLookup:
    """A table in which a third of all pairs are synonyms: HC corrects a good share of the predictions."""
    rng = np.random.default_rng(1)
    pairs = [(a, b) for a in range(VOCAB) for b in range(VOCAB) if a != b and rng.random() < 1 / 3]
    return SynonymLookup(SynonymTable.from_pairs(pairs, [f"t{i}" for i in range(VOCAB)], "test", {}))


def split(batch: dict[str, torch.Tensor], micro: int) -> list[dict[str, torch.Tensor]]:
    starts = range(0, len(batch["input_ids"]), micro)
    return [{k: v[start : start + micro] for k, v in batch.items()} for start in starts]


def reference(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, int]]:
    """The global batch's loss by autograd, written out plainly: the MLM head over every position, the kept masked
    positions' cross-entropy and the counted ones' 1 - cos summed, both over the global masked count."""
    gold_all = batch["original_ids"]
    logits = model.mlm(input_ids=batch["input_ids"]).logits  # [B, L, V]
    rows = torch.arange(SEQUENCES)[:, None].expand_as(batch["masked_positions"])
    valid = batch["masked_valid"]
    logits, gold = logits[rows[valid], batch["masked_positions"][valid]], gold_all[rows[valid],
                                                                                 batch["masked_positions"][valid]]
    pred = logits.argmax(-1)
    corrected = model.hc_lookup.is_synonym(gold, pred) & (pred != gold)
    count = int(valid.sum())
    ce = F.cross_entropy(logits[~corrected], gold[~corrected], reduction="sum")
    emb = model.mlm.bert.embeddings.word_embeddings.weight
    a, b = emb[gold], emb[pred]
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    counted = (pred != PAD) & a.ne(0).any(-1) & b.ne(0).any(-1)
    loss = (ce + (1 - cos)[counted].sum()) / count
    return loss, {"masked": count, "corrected": int(corrected.sum())}


def flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def engine_step(model, stage: int, batches, metrics_dir: Path) -> tuple[torch.Tensor, dict]:
    """One train_step of a fresh engine over this rank's micro-batches: the gradient it holds before its optimizer
    step (as DeepSpeed reduced it over the ranks), and the logged record (rank 0's)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    micro = len(batches[0]["input_ids"])
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": len(batches),
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine = deepspeed.initialize(model=model, model_parameters=parameter_groups(model), config=config)[0]
    captured = {}
    real_step = engine.step

    def step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            captured["grad"] = torch.cat([safe_get_full_grad(p).flatten().clone() for p in model.parameters()])
        return real_step(*args, **kwargs)

    engine.step = step
    metrics = MetricsLogger(engine, metrics_dir, SEQ_LEN, rank=dist.get_rank())
    state = SimpleNamespace(batches=TimedBatches(iter(batches)), rank=dist.get_rank(), metrics=metrics)
    loop.train_step(engine, state, SimpleNamespace(received=None), loop.SkipGuard(engine), set())
    return captured["grad"], metrics.log(1)


def fresh_model():
    torch.manual_seed(0)
    return build_pretrainer("bert-tiny", ObjectiveConfig(hc_lookup=lookup(), sr="word"), dropout=0.0,
                            vocab_size=VOCAB)


def expected_step(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    plain = copy.deepcopy(model)
    loss, counts = reference(plain, batch)
    loss.backward()
    assert counts["corrected"] >= 3, counts  # HC is live
    return flat_grads(plain), loss.detach(), counts


def check(grad: torch.Tensor, record: dict, expected: torch.Tensor, loss: torch.Tensor, counts: dict, how) -> None:
    assert (grad - expected).norm() <= 2e-6 * expected.norm(), how
    # the logged loss is the global batch's, and still the sum of its parts
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-6), how
    assert record["loss"] == pytest.approx(record["mlm_loss"] + record["sr_loss"], rel=1e-6), how
    assert record["hc_corrected"] == counts["corrected"], how


def test_a_global_batch_gives_the_same_gradient_however_it_is_split(world_of_one, tmp_path):
    assert os.environ.get("TORCH_EXTENSIONS_DIR"), "run with the Makefile's environment (DeepSpeed's CPU comm op)"
    model, batch = fresh_model(), global_batch()
    expected, loss, counts = expected_step(model, batch)

    # The splits' micro-batches really differ in their masked counts, and in their kept counts after HC: a mean per
    # micro-batch (the old objective) gives another gradient for each split
    for micro in (4, 2):
        parts = split(batch, micro)
        assert len({int(p["masked_valid"].sum()) for p in parts}) > 1, micro
        old = copy.deepcopy(model)
        for part in parts:
            (old(**part)[0] / len(parts)).backward()
        kept = {int(s["masked"] - s["corrected"]) for s in (old(**p)[1] for p in parts)}
        assert len(kept) > 1, (micro, kept)
        assert (flat_grads(old) - expected).norm() > 3e-3 * expected.norm(), micro

    for stage in (0, 2):
        for micro in (4, 2):
            grad, record = engine_step(copy.deepcopy(model), stage, split(batch, micro), tmp_path)
            check(grad, record, expected, loss, counts, (stage, micro))


def run_rank(rank: int, port: int, out: Path) -> None:
    """A rank of the 2-rank split (this file run as a script): its 4 sequences as 2 micro-batches of 2."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model, half = fresh_model(), SEQUENCES // 2
    mine = {k: v[rank * half : (rank + 1) * half] for k, v in global_batch().items()}
    results = {stage: engine_step(copy.deepcopy(model), stage, split(mine, 2), out) for stage in (0, 2)}
    if rank == 0:
        torch.save(results, out / "results.pt")
    dist.destroy_process_group()


def test_two_ranks_give_the_global_batchs_gradient(tmp_path, launch_env):
    """DeepSpeed averages the ranks' gradients: each rank's share is its sum over the global count times the
    ranks (and the accumulation steps), whatever its own count (here unlike the other rank's)."""
    model, batch = fresh_model(), global_batch()
    expected, loss, counts = expected_step(model, batch)
    half = SEQUENCES // 2
    assert int(batch["masked_valid"][:half].sum()) != int(batch["masked_valid"][half:].sum())
    port = free_port()
    env = {**launch_env, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), launch_env.get("PYTHONPATH", "")])}
    ranks = [subprocess.Popen([sys.executable, __file__, str(rank), str(port), str(tmp_path)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    for proc, output in zip(ranks, finished(ranks)):
        assert proc.returncode == 0, output[-3000:]
    results = torch.load(tmp_path / "results.pt", weights_only=False)
    for stage, (grad, record) in results.items():
        check(grad, record, expected, loss, counts, (stage, "2 ranks"))


if __name__ == "__main__":
    run_rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
