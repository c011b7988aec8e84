"""Micro-batches by GPU memory: the estimate against docs/configs.md's table and the one H200 measurement, the
start-up's choice for a shipped recipe (global batch kept), and `truneg preflight --gpu-memory`. CPU only."""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from truneg.cluster import preflight
from truneg.data.masking import default_max_predictions
from truneg.train.config import checks, memory
from truneg.train.config import ds_config as dsc

REPO = Path(__file__).resolve().parents[2]


def _memory_table() -> list[tuple[str, list[str], int, list[int]]]:
    """docs/configs.md's micro-batch-by-memory rows: (preset, recipe stems, seq, micro per memory column)."""
    rows = []
    for line in (REPO / "docs" / "configs.md").read_text().splitlines():
        match = re.match(r"\| ([a-z-]+): (.*?) \([\d.]+ \+ [\d.]+\) \| (\d+) \| (.*) \|$", line)
        if match:
            stems = [s.rstrip("*").rstrip("_") for s in re.findall(r"`([^`]+)`", match[2])]
            rows.append((match[1], stems, int(match[3]), [int(c) for c in match[4].split(" | ")]))
    return rows


def test_the_documented_table_is_what_the_start_up_chooses():
    rows = _memory_table()
    assert len(rows) == 6 and {stem for _, stems, _, _ in rows for stem in stems} >= {"bert_large", "electra_base"}
    columns = [(16, "fp16"), (32, "fp16"), (40, "bf16"), (80, "bf16"), (141, "bf16")]
    for preset, _, seq, micros in rows:
        got = [memory.micro_for_memory(gib, preset, precision, seq, default_max_predictions(seq))[0]
               for gib, precision in columns]
        assert got == micros, (preset, seq)


def test_the_estimate_reproduces_the_h200_measurement_and_80_gb_takes_bert_large_at_256():
    # BERT-large HC+SR, bf16, micro 64, seq 128 peaked at 17.0 GiB on one H200 (2026-11-30)
    static, per_sample = memory.estimate_gib("bert-large", "bf16", 128, 20, "word")
    assert static + 64 * per_sample == pytest.approx(17.0, rel=0.05)
    assert memory.micro_for_memory(80, "bert-large", "bf16", 128, 20)[0] == 256
    assert memory.micro_for_memory(40, "bert-large", "bf16", 128, 20)[0] == 128
    # SR_Sent's extra encoder pass halves it; a card too small for one sample still gets 1
    assert memory.micro_for_memory(80, "bert-large", "bf16", 128, 20, "sent")[0] == 128
    assert memory.micro_for_memory(4, "bert-large", "bf16", 512, 80)[0] == 1


def test_activation_checkpointing_keeps_each_layers_input_and_one_layers_activations():
    """BERT-large at seq 512 (phase 2), bf16: every layer's input in half precision (24 x 1024 x 512 x 2 bytes), one
    layer's activations (57 x 1024 x 512) and the head's logits (80 x 30522 x 12) a sample; that raises the micro-batch
    the sizing picks on a 16 GB V100 from 8 to 64 (and to 256 on 80 GB)."""
    per_sample = (24 * 1024 * 512 * 2 + 57 * 1024 * 512 + 80 * 30522 * 12) / 2**30
    static, got = memory.estimate_gib("bert-large", "bf16", 512, 80, "none", checkpointing=True)
    assert got == pytest.approx(per_sample, rel=1e-12)
    assert static == memory.estimate_gib("bert-large", "bf16", 512, 80)[0]
    assert [memory.micro_for_memory(gib, "bert-large", precision, 512, 80, "none", ck)[0]
            for gib, precision in ((16, "fp16"), (80, "bf16")) for ck in (False, True)] == [8, 64, 64, 256]
    # the preflight's sizing takes the flag
    args = _args(seq_len=512, activation_checkpointing=True)
    config, choices = checks.resolve_config(args, 8, (7, 0), 16)
    assert config["train_micro_batch_size_per_gpu"] == 64 and "activation checkpointing" in " ".join(choices)


def _args(**changes) -> argparse.Namespace:
    args = preflight.build_parser().parse_args(["--model", "bert-large", "--max-steps", "100"])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize("world", [1, 8, 32])
def test_a_shipped_recipe_takes_the_memorys_micro_batch_and_keeps_its_global_batch(world, tmp_path):
    sm90 = (9, 0)
    for gib, micro in ((80, 256), (141, 256), (40, 128), (None, 64)):  # None: unknown, the file's 64
        config, choices = checks.resolve_config(_args(), world, sm90, gib)
        expected = min(micro, 8192 // world)
        assert config["train_micro_batch_size_per_gpu"] == expected, (gib, world)
        assert config["train_batch_size"] == 8192 == expected * config["gradient_accumulation_steps"] * world
        said = [line for line in choices if line.startswith("micro-batch at most")]
        assert len(said) == (gib is not None) and all(f"at most {micro} for {gib} GiB" in line for line in said)
    # --micro-batch-size wins; a config of one's own keeps its micro-batch; the CPU has no GPU memory
    assert checks.resolve_config(_args(micro_batch_size=32), world, sm90, 80)[0]["train_micro_batch_size_per_gpu"] == 32
    own = tmp_path / "own.json"
    own.write_text((dsc.DS_CONFIGS / "bert_large_a100_bf16_zero1.json").read_text())
    config, _ = checks.resolve_config(_args(deepspeed_config=str(own)), world, sm90, 80)
    assert config["train_micro_batch_size_per_gpu"] == min(64, 8192 // world)
    cpu, _ = checks.resolve_config(_args(), world, None, 80)
    cpu_micro = json.loads(dsc.CPU_CONFIG.read_text())["train_micro_batch_size_per_gpu"]
    assert cpu["train_micro_batch_size_per_gpu"] == cpu_micro


def test_preflight_takes_the_gpu_memory_and_prints_the_estimate(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(preflight.ds_config, "local_capability", lambda: None)  # no GPU here
    argv = ["--model", "bert-large", "--gpu-arch", "sm90", "--max-steps", "100", "--output-dir", str(tmp_path / "r")]
    assert preflight.run([*argv, "--gpu-memory", "80"]) == 0
    out = capsys.readouterr().out.splitlines()
    printed = dict(line.split(": ", 1) for line in out if not line.startswith("note"))
    assert printed["micro-batch"] == "256" and printed["gradient accumulation"] == "32"
    assert printed["GPU memory estimate"].startswith("50.7 GiB at micro-batch 256") and "of 80 GiB" in out[-1]
    assert preflight.run(argv) == 0  # unknown memory: the file's micro-batch, and the flag named
    printed = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines() if not line.startswith("note"))
    assert printed["micro-batch"] == "64" and printed["GPU memory estimate"].endswith("pass --gpu-memory for the "
                                                                                      "nodes' micro-batch")
    assert preflight.run([*argv, "--gpu-memory", "0"]) == 2
    assert capsys.readouterr().err.splitlines() == ["truneg: error: --gpu-memory must be a finite number >= 1, not 0.0"]
