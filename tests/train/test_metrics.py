"""The training metrics' accumulator, in-process: its sums against plain Python floats, across a save and a
load, a constant number of ops per micro-step however many stats a model reports, and the records a resume
drops."""
from __future__ import annotations

import json
import math
import random
from collections import Counter
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.tensorboard import SummaryWriter

from truneg.train.observe.metrics import MetricsLogger


def logger(tmp_path) -> MetricsLogger:
    return MetricsLogger(engine=None, output_dir=tmp_path, seq_len=128, rank=0)


def micro_steps(names: list[str], count: int, nonfinite_at: int) -> list[tuple[dict, torch.Tensor]]:
    rng = random.Random(0)
    steps = []
    for i in range(count):
        loss = torch.tensor(float("nan") if i == nonfinite_at else rng.uniform(1, 9))
        steps.append(({name: torch.tensor(rng.uniform(0, 100)) for name in names}, loss))
    return steps


def add(metrics: MetricsLogger, steps) -> None:
    for stats, loss in steps:
        metrics.add(stats, loss, torch.isfinite(loss), samples=4)


def test_sums_equal_python_floats_and_survive_a_save_and_load(tmp_path):
    names = ["mlm_loss", "masked", "mismatched", "corrected", "sequences", "sequences_corrected", "sr_loss"]
    steps = micro_steps(names, count=7, nonfinite_at=2)
    reference: dict[str, float] = {}
    for stats, loss in steps:
        finite = bool(torch.isfinite(loss))
        for key, value in {"loss": loss, "finite_micro_steps": torch.tensor(1.0), **stats}.items():
            reference[key] = reference.get(key, 0.0) + (float(value) if finite else 0.0)

    whole = logger(tmp_path)
    add(whole, steps)
    assert whole.state_dict()["sums"] == reference  # bitwise: the same additions in the same order
    assert whole.state_dict()["micro_steps"] == 7

    # Saved after 4 micro-steps and loaded by a new logger (a resume); an older checkpoint's key order too.
    first = logger(tmp_path)
    add(first, steps[:4])
    saved = first.state_dict()
    for order in (list(saved["sums"]), sorted(saved["sums"])):
        resumed = logger(tmp_path)
        resumed.load_state_dict({**saved, "sums": {k: saved["sums"][k] for k in order}})
        add(resumed, steps[4:])
        assert resumed.state_dict()["sums"] == reference
    # a stat the resumed run no longer reports keeps its sum
    dropped = logger(tmp_path)
    dropped.load_state_dict(saved)
    stats, loss = steps[4]
    dropped.add({k: v for k, v in stats.items() if k != "sr_loss"}, loss, torch.isfinite(loss), samples=4)
    assert dropped.state_dict()["sums"]["sr_loss"] == saved["sums"]["sr_loss"]


class _OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_first_throughput_after_a_resume_counts_only_the_samples_trained_since(tmp_path, monkeypatch):
    """A checkpoint inside a log interval (a stop-and-save) carries the interval's sums, but not its samples:
    they were trained before the timer of the resumed process started."""
    now = [50.0]
    monkeypatch.setattr("truneg.train.observe.metrics.time.perf_counter", lambda: now[0])
    first = MetricsLogger(engine=None, output_dir=tmp_path, seq_len=128, rank=1)  # rank 1: writes nothing
    steps = micro_steps(["masked", "mismatched", "corrected", "sequences", "sequences_corrected"], 7, nonfinite_at=-1)
    add(first, steps[:4])
    now[0] = 100.0  # the resumed process starts its timer, and logs two seconds later
    events = []
    engine = SimpleNamespace(global_samples=28, get_lr=lambda: [1e-4], fp16_enabled=lambda: False, skipped_steps=0,
                             monitor=SimpleNamespace(write_events=events.extend))
    resumed = MetricsLogger(engine=engine, output_dir=tmp_path, seq_len=128, rank=0)
    resumed.load_state_dict(first.state_dict())
    add(resumed, steps[4:])
    now[0] = 102.0
    record = resumed.log(step=7)
    assert record["samples_per_sec"] == 3 * 4 / 2.0 and record["tokens_per_sec"] == 6.0 * 128
    assert record["loss"] == sum(float(loss) for _, loss in steps) / 7  # the sums themselves do carry over
    # tensorboard: DeepSpeed's engine writes lr (and fp16's loss_scale) at every step; they are not written twice
    tags = {tag for tag, _, _ in events}
    assert {"Train/Samples/loss", "Train/Samples/samples_per_sec"} <= tags and "Train/Samples/lr" not in tags
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["lr"] == 1e-4


def test_each_record_field_is_its_formula_over_both_ranks_sums(tmp_path, monkeypatch):
    """Two ranks (faked: the all-reduce doubles, as a second rank with the same sums would add them): the losses
    are means over finite micro-steps, the ratios are HC's and the accuracies are per masked / scored token, and the
    skipped steps, which every rank counts, are counted once."""
    monkeypatch.setattr("truneg.train.observe.metrics.dist",
                        SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 2,
                                                               all_reduce=lambda t: t.mul_(2)))
    engine = SimpleNamespace(global_samples=24, get_lr=lambda: [1e-4], fp16_enabled=lambda: False, skipped_steps=3,
                             monitor=SimpleNamespace(write_events=lambda events: None))
    now = [10.0]
    monkeypatch.setattr("truneg.train.observe.metrics.time.perf_counter", lambda: now[0])
    metrics = MetricsLogger(engine=engine, output_dir=tmp_path, seq_len=128, rank=0)
    sums = {"gen_loss": 0.0, "disc_loss": 0.0, "masked": 0.0, "mismatched": 0.0, "corrected": 0.0, "sequences": 0.0,
            "sequences_corrected": 0.0, "disc_correct": 0.0, "disc_tokens": 0.0, "mlm_argmax_correct": 0.0,
            "mlm_sampled_correct": 0.0, "hc_judgeable": 0.0, "mask_shortfall": 0.0}
    losses = [2.0, float("nan"), 4.0]
    for i, loss in enumerate(losses):
        stats = {"gen_loss": 1.5 + i, "disc_loss": 0.25 * i, "masked": 20.0, "mismatched": 8.0 + i, "corrected": 2.0,
                 "sequences": 4.0, "sequences_corrected": 1.0 + i, "disc_correct": 500.0 + i, "disc_tokens": 512.0,
                 "mlm_argmax_correct": 12.0, "mlm_sampled_correct": 9.0 + i, "hc_judgeable": 5.0 + i,
                 "mask_shortfall": float(i)}
        metrics.add({k: torch.tensor(v) for k, v in stats.items()}, torch.tensor(loss),
                    torch.isfinite(torch.tensor(loss)), samples=4)
        if math.isnan(loss):
            metrics.count_nonfinite()
        else:
            sums = {k: sums[k] + v for k, v in stats.items()}
    now[0] = 12.0
    record = metrics.log(step=3)
    assert record["loss"] == (2.0 + 4.0) / 2 and record["gen_loss"] == sums["gen_loss"] / 2
    assert record["disc_loss"] == sums["disc_loss"] / 2
    assert record["hc_corrected"] == 2 * sums["corrected"]  # both ranks' corrections
    assert record["hc_iter_ratio"] == sums["sequences_corrected"] / sums["sequences"]
    assert record["hc_pred_ratio"] == sums["corrected"] / sums["mismatched"]
    assert record["mlm_accuracy"] == 1 - sums["mismatched"] / sums["masked"]
    assert record["hc_reach"] == sums["hc_judgeable"] / sums["masked"]
    assert record["wwm_shortfall"] == 2 * sums["mask_shortfall"]  # both ranks' pieces short, summed
    assert record["mlm_argmax_accuracy"] == sums["mlm_argmax_correct"] / sums["masked"]
    assert record["mlm_sampled_accuracy"] == sums["mlm_sampled_correct"] / sums["masked"]
    assert record["disc_accuracy"] == sums["disc_correct"] / sums["disc_tokens"]
    assert record["nonfinite_steps"] == 1 and record["skipped_steps"] == 3
    assert record["samples_per_sec"] == 2 * 3 * 4 / 2.0  # both ranks' samples over the interval's 2 seconds


def test_a_micro_step_costs_the_same_few_ops_however_many_stats(tmp_path):
    # On a GPU every op is a kernel launch on the training thread: the count must not grow with the stats.
    counts = []
    for names in (["mlm_loss", "masked"], [f"stat_{i}" for i in range(14)]):
        metrics = logger(tmp_path)
        steps = micro_steps(names, count=2, nonfinite_at=-1)
        add(metrics, steps[:1])
        (stats, loss), finite = steps[1], torch.isfinite(steps[1][1])
        with _OpCount() as counter:
            metrics.add(stats, loss, finite, samples=4)
        counts.append(sum(counter.ops.values()))
    assert counts[0] == counts[1] <= 8, counts  # 4 per stat before: 58 for ELECTRA's 12 stats


def test_a_resume_drops_the_csv_monitor_rows_after_its_checkpoint(tmp_path, monkeypatch):
    """DeepSpeed's csv monitor appends, and a new process writes each file's header again: after a resume
    from 16 samples, each file has one header, its rows up to 16, then the resumed run's."""
    import deepspeed.comm
    from deepspeed.monitor.config import CSVConfig
    from deepspeed.monitor.csv_monitor import csvMonitor

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda: 0)  # rank 0 writes; no process group here
    config = CSVConfig(enabled=True, output_path=str(tmp_path), job_name="run")
    killed = csvMonitor(config)
    for samples in (8, 16, 24, 32):
        killed.write_events([("Train/Samples/loss", 1.0 / samples, samples), ("Train/Samples/lr", 0.1, samples)])
    with open(tmp_path / "run" / "Train_Samples_lr.csv", "a") as torn:
        torn.write("40,0.")  # a kill during the append
    (tmp_path / "run" / "Train_Samples_empty.csv").write_text("")  # killed between the open and the header
    resumed = csvMonitor(config)
    metrics = MetricsLogger(engine=SimpleNamespace(monitor=SimpleNamespace(csv_monitor=resumed)), output_dir=tmp_path,
                            seq_len=8, rank=0)
    metrics.purge_monitors_after(16)
    resumed.write_events([("Train/Samples/loss", 0.5, 24)])
    assert (tmp_path / "run" / "Train_Samples_loss.csv").read_text().splitlines() == [
        "step,loss", "8,0.125", "16,0.0625", "24,0.5"]
    assert (tmp_path / "run" / "Train_Samples_lr.csv").read_text().splitlines() == ["step,lr", "8,0.1", "16,0.1"]
    assert not (tmp_path / "run" / "Train_Samples_empty.csv").exists()


def test_a_resume_drops_the_records_after_its_checkpoint_and_a_line_a_kill_cut_short(tmp_path):
    """Rank 0 rewrites metrics.jsonl on resume; a torn last line (kill -9 during the append) must not stop it."""
    metrics = logger(tmp_path)
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)] + ['{"step": 5, "lo']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    metrics.truncate_after(2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[:2]


def test_a_starts_first_interval_is_marked_and_left_out_of_the_throughput_curves(tmp_path):
    """The efficiency figures ride in the log's record: the first interval of a process (a start, a resume) is
    marked `warmup` in metrics.jsonl, and its throughput figures are no point of tensorboard's curves."""
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
    from truneg.train.observe.efficiency import THROUGHPUT_KEYS, Efficiency, TimedBatches

    events = []
    engine = SimpleNamespace(global_samples=0, get_lr=lambda: [1e-4], fp16_enabled=lambda: False, skipped_steps=0,
                             bfloat16_enabled=lambda: False, zero_optimization_stage=lambda: 1,
                             monitor=SimpleNamespace(write_events=events.extend), device=torch.device("cpu"),
                             module=build_pretrainer("bert-tiny", ObjectiveConfig()),
                             optimizer=SimpleNamespace(_global_grad_norm=1.5), get_global_grad_norm=lambda: 1.5)
    metrics = MetricsLogger(engine=engine, output_dir=tmp_path, seq_len=128, rank=0)
    metrics.efficiency = Efficiency(engine, TimedBatches(iter([])), 1e9, None, rank=0, world_size=1)
    for step in (1, 2):
        add(metrics, micro_steps(["masked", "mismatched", "corrected", "sequences", "sequences_corrected"], 2, -1))
        engine.global_samples = 8 * step
        metrics.log(step)
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["warmup"] is True and "warmup" not in second
    for record in (first, second):
        assert set(THROUGHPUT_KEYS) - {"mfu"} <= set(record) and record["grad_norm"] == 1.5, record
    tags = {samples: {tag for tag, _, at in events if at == samples} for samples in (8, 16)}
    throughput = {f"Train/Samples/{k}" for k in THROUGHPUT_KEYS if k != "mfu"}
    assert {"Train/Samples/loss", "Train/Samples/grad_norm", "Train/Samples/memory_max_rss_gib"} <= tags[8]
    assert not throughput & tags[8] and throughput <= tags[16] and "Train/Samples/warmup" not in tags[8]


def test_a_relaunch_before_the_first_save_writes_its_step_0_evaluation_once(tmp_path, monkeypatch):
    """A run killed before its first checkpoint starts over: its step-0 evaluation, written again at 0 samples,
    replaces the killed run's in tensorboard and metrics.jsonl rather than doubling it."""
    import itertools

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    # Event files are read in the order of their names: the second, then the process's writer count as a string. A
    # relaunch is a new process, whose count starts again; in one process (this test, after others made writers) a
    # count passing 9 -> 10 within a second would sort the relaunch's files first. Counted zero-padded here.
    uids = itertools.count()
    monkeypatch.setattr(event_file_writer._global_uid, "get", lambda: f"{next(uids):06d}")

    def relaunch(steps: int, samples: int) -> None:
        writer = SummaryWriter(log_dir=str(tmp_path / "tb"))
        monitor = SimpleNamespace(tb_monitor=SimpleNamespace(summary_writer=writer))
        # as DeepSpeed's monitor writes: through the writer it holds now (drop_after reopens it)
        monitor.write_events = lambda events: [monitor.tb_monitor.summary_writer.add_scalar(*e) for e in events]
        engine = SimpleNamespace(monitor=monitor)
        metrics = MetricsLogger(engine=engine, output_dir=tmp_path, seq_len=8, rank=0)
        metrics.drop_after(steps, samples)
        metrics.write_eval({"step": 0, "samples": 0, "eval_mlm_loss": 5.0, "eval_seconds": 0.1})
        for at in (8, 16, 24):
            engine.monitor.write_events([("Train/Samples/loss", 1.0 / at, at)])
        engine.monitor.tb_monitor.summary_writer.close()

    relaunch(0, 0)
    relaunch(0, 0)  # killed before its first save: started over
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("Eval/mlm_loss")] == [0]
    assert [e.step for e in events.Scalars("Train/Samples/loss")] == [8, 16, 24]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0]


def test_a_save_is_left_out_of_the_throughput_and_a_non_finite_figure_is_written_as_null(tmp_path, monkeypatch):
    """Work between steps that is not training (a save, a replica check: loop.py runs them under `paused`) takes no
    time of the interval, as an evaluation does, so samples/s (and the TFLOP/s, MFU and data-wait share made of the
    same time) dips at no save. A figure that does not exist (samples/s of an interval of no time) is JSON's null,
    which a strict parser reads, and is not drawn."""
    now = [10.0]
    monkeypatch.setattr("truneg.train.observe.metrics.time.perf_counter", lambda: now[0])
    events = []
    engine = SimpleNamespace(global_samples=8, get_lr=lambda: [1e-4], fp16_enabled=lambda: False, skipped_steps=0,
                             monitor=SimpleNamespace(write_events=events.extend))
    metrics = MetricsLogger(engine=engine, output_dir=tmp_path, seq_len=128, rank=0)
    stats = {k: torch.tensor(1.0) for k in ("masked", "mismatched", "corrected", "sequences", "sequences_corrected")}
    metrics.add(stats, torch.tensor(2.0), torch.tensor(True), samples=8)
    now[0] = 12.0  # 2 s of training
    with metrics.paused():
        now[0] = 50.0  # a 38 s save
    now[0] = 51.0  # 1 s more
    assert metrics.log(step=1)["samples_per_sec"] == 8 / 3.0
    metrics.add(stats, torch.tensor(2.0), torch.tensor(True), samples=8)
    assert math.isnan(metrics.log(step=2)["samples_per_sec"])  # no time passed
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    second = json.loads(lines[1], parse_constant=refuse)
    assert second["samples_per_sec"] is None and second["tokens_per_sec"] is None and second["loss"] == 2.0
    assert ("Train/Samples/samples_per_sec", 8 / 3.0, 8) in events
    assert [e for e in events if e[0] == "Train/Samples/samples_per_sec"] == [("Train/Samples/samples_per_sec",
                                                                               8 / 3.0, 8)]
