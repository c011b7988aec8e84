"""The efficiency figures, in this process: the one FLOP formula against DeepSpeed's flops profiler, the devices'
peaks, the record's keys over two ranks, the grad norm against an independent computation (DeepSpeed's at ZeRO-2,
truneg's own at fp32 ZeRO-0), the peak memory and the input's wait, and the profiler's window. (The same keys from
real 2-rank launches, and a profiled resume whose losses equal the unprofiled run's: test_distributed.)"""
from __future__ import annotations

import copy
import gc
import gzip
import json
import math
import mmap
import os
import re
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import REPO

from truneg.data.masking import default_max_predictions
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
from truneg.train.config.run_config import parse_profile_ranks, parse_profile_steps, profile_problems
from truneg.train.observe import efficiency
from truneg.train.observe.efficiency import Efficiency, TimedBatches, console_fields, peak_rss_bytes, reset_peak_rss
from truneg.train.observe.flops import dense_peak_tflops, model_train_flops, preset_train_flops, run_peak_tflops
from truneg.train.observe.profiling import StepProfiler

sys.path.insert(0, str(REPO))
from bench.flops import train_flops_per_sample as profiler_train_flops  # noqa: E402


@pytest.mark.parametrize("preset, seq_len, objective", [
    ("bert-tiny", 128, ObjectiveConfig()),
    ("electra-tiny", 128, ObjectiveConfig()),
    ("electra-small", 64, ObjectiveConfig()),
    ("bert-tiny", 64, ObjectiveConfig(sr="sent", sr_sent_target="original")),  # two extra encoder passes
    ("electra-tiny", 64, ObjectiveConfig(sr="sent")),  # one extra discriminator pass
])
def test_the_flop_formula_is_within_half_a_percent_of_deepspeeds_flops_profiler(preset, seq_len, objective):
    """bench/flops.py's way: DeepSpeed's profiler over one forward of the pre-trainer (the masked-only head, ELECTRA's
    generator and discriminator, SR_Sent's passes), times 3; the formula counts the products alone."""
    profiled = profiler_train_flops(preset, seq_len, objective)
    formula = preset_train_flops(preset, seq_len, sr=objective.sr, sr_sent_target=objective.sr_sent_target)
    assert formula == pytest.approx(profiled, rel=0.005), (formula, profiled)  # measured: 0.17-0.34 % apart
    assert formula <= profiled  # the elementwise ops are the profiler's alone
    model = build_pretrainer(preset, objective)  # a built model's count is the preset's
    assert model_train_flops(model, seq_len, default_max_predictions(seq_len)) == formula


def test_the_head_counts_the_gathered_positions_not_the_sequence():
    """BERT-large at 128: the 20 gathered rows cost 20 / 128 of a full head over the 30,522-token vocabulary."""
    full = preset_train_flops("bert-large", 128, max_predictions=128)
    masked = preset_train_flops("bert-large", 128)
    assert full - masked == pytest.approx(3 * 2 * (128 - 20) * (1024 * 1024 + 1024 * 30522))
    assert masked / 1e12 == pytest.approx(0.241, abs=5e-4)  # bench/flops.py's profiled figure (README)


def test_peaks_by_full_device_name_and_precision():
    known = {("NVIDIA H100 80GB HBM3", "bf16"): 989.0, ("NVIDIA H100 PCIe", "bf16"): 756.0,
             ("NVIDIA H200", "bf16"): 989.0, ("NVIDIA A100-SXM4-80GB", "bf16"): 312.0,
             ("NVIDIA A100-PCIE-40GB", "fp16"): 312.0, ("NVIDIA A100 80GB PCIe", "bf16"): 312.0,
             ("Tesla V100-SXM2-32GB", "fp16"): 125.0, ("Tesla V100-PCIE-16GB", "fp16"): 112.0}
    assert {k: dense_peak_tflops(*k) for k in known} == known
    unknown = [("NVIDIA H100 NVL", "bf16"), ("NVIDIA H200 NVL", "bf16"), ("NVIDIA L40S", "bf16"),
               ("Tesla V100-SXM2-32GB", "bf16"), ("NVIDIA H100 80GB HBM3", "fp32"), ("cpu", "fp32")]
    assert [dense_peak_tflops(*k) for k in unknown] == [None] * len(unknown)
    assert run_peak_tflops("NVIDIA H200", "bf16", None) == (989.0, None)
    assert run_peak_tflops("NVIDIA L40S", "bf16", 362.0) == (362.0, None)  # the flag wins, no warning
    assert run_peak_tflops(None, "fp32", None) == (None, None)  # the CPU: no MFU, no warning
    assert run_peak_tflops(None, "fp32", 1.5) == (1.5, None)
    peak, warning = run_peak_tflops("NVIDIA L40S", "bf16", None)
    assert peak is None and "no dense peak known for NVIDIA L40S in bf16" in warning and "--peak-tflops" in warning


def fake_engine(device: str = "cpu", bf16: bool = False, norm=None, zero_stage: int = 1) -> SimpleNamespace:
    model = build_pretrainer("bert-tiny", ObjectiveConfig())
    return SimpleNamespace(device=torch.device(device), bfloat16_enabled=lambda: bf16, fp16_enabled=lambda: False,
                           module=model, optimizer=SimpleNamespace(_global_grad_norm=norm),
                           get_global_grad_norm=lambda: norm, zero_optimization_stage=lambda: zero_stage)


def test_an_unknown_gpu_gets_one_warning_and_no_mfu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    monkeypatch.setattr(efficiency, "get_accelerator", lambda: SimpleNamespace(reset_peak_memory_stats=lambda d: None))
    unknown = Efficiency.for_run(fake_engine("cuda", bf16=True), TimedBatches(iter([])), 128, 20, None, 0, 2)
    Efficiency.for_run(fake_engine("cuda", bf16=True), TimedBatches(iter([])), 128, 20, None, 1, 2)  # rank 1: silent
    out = capsys.readouterr().out
    assert out.count("truneg: warning:") == 1 and "NVIDIA L40S in bf16" in out, out
    assert unknown.peak_tflops is None and "mfu" not in unknown.record([1.0, 2.0, 0.1, 3.0] + [0.0] * 4, 64, 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert Efficiency.for_run(fake_engine("cuda", bf16=True), TimedBatches(iter([])), 128, 20, None, 0, 2
                              ).peak_tflops == 756.0
    assert capsys.readouterr().out == ""


def test_the_records_keys_over_two_ranks(monkeypatch):
    """Each rank's values in its slot (the log's all-reduce sums them): the memory and the wait are the largest
    over the ranks, tflops is per device, mfu needs a peak, and the first interval is marked."""
    engine = fake_engine(norm=torch.tensor(2.5))
    eff = Efficiency(engine, TimedBatches(iter([])), flops_per_sample=3e9, peak_tflops=0.5, rank=1, world_size=2)
    eff.batches.waited_s = 0.25
    slots = eff.rank_values(torch.device("cpu")).tolist()  # [rank 0's 3 values (zero here), rank 1's]
    assert slots[:3] == [0.0] * 3 and slots[4:] == [0.25, 2.5] and 0 < slots[3] <= peak_rss_bytes() / 2**30
    rank0 = [1.5, 0.5, 2.5]  # rank 0's RSS peak (GiB), its wait, the grad norm
    first = eff.record(rank0 + slots[3:], samples=400, elapsed=2.0)
    assert first["warmup"] is True and first["memory_max_rss_gib"] == max(1.5, slots[3])
    assert first["tflops"] == 400 * 3e9 / 2.0 / 2 / 1e12 and first["mfu"] == first["tflops"] / 0.5
    assert first["data_wait_fraction"] == 0.5 / 2.0 and first["grad_norm"] == 2.5
    assert "warmup" not in eff.record(rank0 + slots[3:], samples=400, elapsed=2.0)
    engine.get_global_grad_norm = lambda: None  # ZeRO-1/2 with DeepSpeed's norm switched off
    solo = Efficiency(engine, TimedBatches(iter([])), flops_per_sample=3e9, peak_tflops=None, rank=0, world_size=1)
    later = solo.record(solo.rank_values(torch.device("cpu")).tolist(), samples=400, elapsed=2.0)
    assert "mfu" not in later and "grad_norm" not in later and later["tflops"] == 400 * 3e9 / 2.0 / 1e12
    gpu = {"tflops": 412.3, "mfu": 0.417, "memory_max_allocated_gib": 61.2, "memory_max_reserved_gib": 70.0,
           "data_wait_fraction": 0.012, "grad_norm": 1.25, "warmup": True}
    assert console_fields(gpu) == "  412.3 TFLOP/s  MFU 41.7%  mem 61.2/70.0 GiB  data wait 1.2%  grad_norm 1.25  " \
                                  "(warm-up)"
    assert console_fields(first) == ""  # the CPU's line stays as it was


def test_the_rss_peak_is_reset_each_interval_and_the_input_wait_is_timed():
    if not efficiency.CLEAR_REFS.exists():
        pytest.skip("no /proc/self/clear_refs (not Linux)")
    def resident() -> float:  # VmRSS: what the process holds now, beside the peak
        return 1024.0 * int(re.search(r"VmRSS:\s+(\d+) kB", efficiency.PROC_STATUS.read_text()).group(1))

    # The peak is checked against the resident memory of the moment, so that memory an earlier test's objects free
    # meanwhile cannot hide the block; the collector is held off too. (The kernel batches its RSS counters: slack.)
    # The block is its own anonymous mapping: malloc could serve it from memory a grown worker already holds.
    slack = 8 * 2**20
    gc.collect()
    gc.disable()
    try:
        reset_peak_rss()
        assert peak_rss_bytes() < resident() + slack
        block = mmap.mmap(-1, 200 * 2**20)
        np.frombuffer(block, dtype=np.uint8)[:] = 1  # 200 MiB, touched
        with_block, high = resident(), peak_rss_bytes()
        block.close()
        assert high > with_block - slack and resident() < with_block - 190 * 2**20
        assert peak_rss_bytes() > high - slack  # the peak outlives the memory
        reset_peak_rss()
        assert peak_rss_bytes() < high - 150 * 2**20
    finally:
        gc.enable()

    class Slow:  # MaskedBatches' interface: batches, and the position a checkpoint keeps
        def __init__(self):
            self.position = 0

        def __next__(self):
            if self.position == 3:
                raise StopIteration
            time.sleep(0.05)
            self.position += 1
            return {"i": self.position}

    timed = TimedBatches(Slow())
    assert [b["i"] for b in timed] == [1, 2, 3] and timed.waited_s >= 0.15 and timed.position == 3


def test_grad_norm_is_the_unclipped_global_norm(world_of_one):
    """fp32 at ZeRO-0 (truneg's own norm, DeepSpeed computes none) and at ZeRO-2 (DeepSpeed's): the norm of the
    gradients a plain copy of the model gets on the same batch, summed in float64, before a clipping to 0.01. (Both
    engines in one process group: DeepSpeed keeps its groups for the process.)"""
    import deepspeed

    from truneg.data.blocks import load_tokenizer
    from truneg.data.masking import mask_tokens
    from truneg.model.pretrainers import parameter_groups

    assert os.environ.get("TORCH_EXTENSIONS_DIR"), "run with the Makefile's environment (DeepSpeed's CPU comm op)"
    tokenizer = load_tokenizer()
    rows = np.random.default_rng(0).integers(1000, 30000, (4, 32))
    rows[:, 0], rows[:, -1] = tokenizer.cls_token_id, tokenizer.sep_token_id
    batch = mask_tokens(rows, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", 0, 0,
                        np.arange(4), 5)
    for stage in (0, 2, "bf16"):
        torch.manual_seed(0)
        model = build_pretrainer("bert-tiny", ObjectiveConfig(), dropout=0.0)
        plain = copy.deepcopy(model)
        plain(**batch)[0].backward()
        expected = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in plain.parameters()
                                 if p.grad is not None))
        # the bf16 ZeRO-1 recipes' BF16_Optimizer (fp32 accumulation), over 2 micro-steps of the same batch: DeepSpeed
        # averages them (the loss over the accumulation steps) in its own buffers, while each parameter's bf16 .grad
        # holds one micro-step's share: the norm is DeepSpeed's, the batch's own
        bf16 = stage == "bf16"
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2 if bf16 else 1,
                  "gradient_clipping": 0.01, "zero_optimization": {"stage": 1 if bf16 else stage},
                  "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  **({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {})}
        engine = deepspeed.initialize(model=model, model_parameters=parameter_groups(model), config=config)[0]
        eff = Efficiency(engine, TimedBatches(iter([])), 1.0, None, 0, 1)
        assert (eff.grad_norm_hook is not None) == (stage == 0)  # the others have DeepSpeed's own
        for _ in range(2 if bf16 else 1):
            engine.backward(engine(**batch)[0])
            engine.step()
        record = eff.record(eff.rank_values(torch.device("cpu")).tolist(), samples=4, elapsed=1.0)
        if bf16:
            assert type(engine.optimizer).__name__ == "BF16_Optimizer"
            assert record["grad_norm"] == pytest.approx(expected, rel=0.02)  # bf16's own rounding
            continue
        assert record["grad_norm"] == pytest.approx(expected, rel=1e-5 if stage else 1e-12), stage
        assert expected > 1.0  # far above the clipping: the norm is taken before it


def test_profile_flags_and_the_profilers_window(tmp_path, capsys):
    assert parse_profile_steps("3:5") == (3, 5) and parse_profile_ranks("3,0,3") == (0, 3)
    assert profile_problems("2:4", "0,1", max_steps=4) == []
    for steps, ranks, words in [("5", None, "takes A:B"), ("4:2", None, "takes A:B"), ("0:2", None, "takes A:B"),
                                ("a:b", None, "takes A:B"), ("2:9", None, "ends past --max-steps 4"),
                                ("1:2", "0,x", "--profile-ranks takes global ranks"),
                                ("1:2", "-1", "--profile-ranks takes global ranks"),
                                (None, "0", "pass --profile-steps A:B too")]:
        [problem] = profile_problems(steps, ranks, max_steps=4)
        assert words in problem, problem

    x = torch.randn(64, 64)
    # rank 1 is not among --profile-ranks 0; rank 2 is the first of --profile-ranks 2,3, and prints their table
    for rank, ranks in ((0, None), (1, (0,)), (2, (2, 3))):
        with StepProfiler((2, 3), ranks, rank, tmp_path / f"rank{rank}", torch.device("cpu")) as profiler:
            for step in range(1, 6):
                with profiler.step(step):
                    x = (x @ x).tanh()
    trace = tmp_path / "rank0" / "step2-3" / "rank0.pt.trace.json.gz"
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"truneg optimizer step 2", "truneg optimizer step 3"} <= names and "truneg optimizer step 4" not in names
    assert "aten::mm" in names
    assert not (tmp_path / "rank1").exists()
    # every rank, profiled or not, gives the window's last step and the next the watchdog's long limit (traces written)
    assert [s for s in range(1, 6) if profiler.writes_during(s)] == [3, 4]
    out = capsys.readouterr().out
    assert f"truneg: profiled steps 2-3 into {trace.parent} (rank 0's" in out and "aten::mm" in out
    assert f"truneg: profiled steps 2-3 into {tmp_path / 'rank2' / 'step2-3'} (rank 2's" in out
