"""Shipped DeepSpeed recipes: batch arithmetic at any world size, optimizer vs ZeRO stage against DeepSpeed's
own code, precision by GPU generation. In-process, CPU only (the launch scripts and `truneg preflight`:
test_launch.py)."""
from __future__ import annotations

import json
import os
import re
import types
from pathlib import Path

import pytest
import torch

from truneg.cluster.hostfile import check_hostfile
from truneg.errors import UserError
from truneg.train.config import checks
from truneg.train.config import ds_config as dsc

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
GPU_CONFIGS = [p for p in CONFIGS if not p.name.startswith("cpu")]
HOSTS_WORLD = sum(check_hostfile(REPO / "launch" / "hosts").values())


def _raw(path: Path) -> dict:
    return json.loads(path.read_text())


def _splits(total: int, cap: int, world: int) -> list[tuple[int, int]]:
    """Every exact (micro, accumulation) split, by enumeration: the reference for resolve_batch_sizes."""
    return [(m, total // (m * world)) for m in range(1, cap + 1) if total % (m * world) == 0]


@pytest.mark.parametrize("world", sorted({1, 8, HOSTS_WORLD}))
def test_every_gpu_recipe_splits_its_global_batch_at_1_8_and_the_hostfile(world):
    from deepspeed.runtime.config import DeepSpeedConfig

    assert HOSTS_WORLD == 32 and len(GPU_CONFIGS) >= 15
    for path in GPU_CONFIGS:
        raw = _raw(path)
        config, choices = dsc.resolve(path, world, 1000, Path("/tmp/unused"))
        total, cap = raw["train_batch_size"], raw["train_micro_batch_size_per_gpu"]
        expected = max(_splits(total, cap, world))  # the largest micro-batch that fits: fewest accumulation steps
        got = (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"])
        assert got == expected and config["train_batch_size"] == total, (path.name, world, got)
        assert choices[0].startswith(f"global batch {total} = micro-batch {got[0]} x gradient accumulation {got[1]}")
        # DeepSpeed parses it (its own world size is 1 without a process group: give it micro and accumulation)
        parsed = DeepSpeedConfig({k: v for k, v in config.items() if k != "train_batch_size"})
        assert parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * world == total


def test_batch_split_errors_name_the_numbers_and_overrides_keep_the_global_batch():
    base = {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 16}
    with pytest.raises(UserError,
                       match=r"train_batch_size 128 does not split over 24 ranks.*--micro-batch-size M") as err:
        dsc.resolve_batch_sizes(dict(base), 24, None, None)
    assert "\n" not in str(err.value)
    with pytest.raises(UserError, match=r"--micro-batch-size 24 does not divide train_batch_size 128 / 8 ranks = 16"):
        dsc.resolve_batch_sizes(dict(base), 8, 24, None)
    with pytest.raises(UserError, match=r"--gradient-accumulation-steps 3 does not divide"):
        dsc.resolve_batch_sizes(dict(base), 8, None, 3)
    with pytest.raises(UserError, match=r"^--micro-batch-size must be >= 1, not 0$"):  # errors.out_of_range's words
        dsc.resolve_batch_sizes(dict(base), 8, 0, None)
    config = dict(base)
    dsc.resolve_batch_sizes(config, 8, 4, None)  # keeps 128: accumulation follows
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (4, 4, 128)
    config = dict(base)
    dsc.resolve_batch_sizes(config, 8, None, 8)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (2, 8)
    config = dict(base)
    line = dsc.resolve_batch_sizes(config, 1, 32, 1)  # both: the user sets the global batch
    assert config["train_batch_size"] == 32 and "replaced" in line
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1}  # per-rank (CPU) configs
    dsc.resolve_batch_sizes(config, 2, None, None)
    assert config["train_batch_size"] == 32
    # the two configs the issue found broken: 256 over 32 ranks at micro 32, 256 < 64 x 8
    for name, world in (("electra_base_v100_fp16_zero2.json", 32), ("electra_base_a100_bf16_zero3.json", 8)):
        config, _ = dsc.resolve(REPO / "ds_configs" / name, world, 100, Path("/tmp/unused"))
        assert config["train_batch_size"] == 256 and config["gradient_accumulation_steps"] >= 1


class _EngineShim:
    """DeepSpeedEngine's own methods on a parsed config, without a model: _configure_basic_optimizer picks
    the optimizer class and _do_optimizer_sanity_check gives DeepSpeed's verdict on it."""

    def __init__(self, config: dict):
        from deepspeed.runtime.config import DeepSpeedConfig

        self._config = DeepSpeedConfig({k: v for k, v in config.items() if k != "train_batch_size"})
        self.client_optimizer, self.zenflow, self.global_rank, self.pipeline_parallelism = None, False, 0, False

    def __getattr__(self, name):
        from deepspeed.runtime.engine import DeepSpeedEngine

        return types.MethodType(getattr(DeepSpeedEngine, name), self)


@pytest.fixture
def no_op_builds(monkeypatch):
    """Fused optimizers keep their class but build no op (their __init__ would JIT-compile CUDA/C++)."""
    import deepspeed.comm
    from deepspeed.ops.adam import FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import FusedLion

    def plain_init(self, params, **kwargs):
        torch.optim.Optimizer.__init__(self, params, {"lr": kwargs.get("lr", 1e-3)})

    for cls in (FusedAdam, FusedLamb, FusedLion):
        monkeypatch.setattr(cls, "__init__", plain_init)
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)


def _deepspeed_verdict(config: dict) -> tuple[type, str | None]:
    shim = _EngineShim(config)
    optimizer = shim._configure_basic_optimizer([torch.nn.Parameter(torch.zeros(2))])
    try:
        shim._do_optimizer_sanity_check(optimizer)
    except (AssertionError, NotImplementedError, ValueError) as err:
        return type(optimizer), str(err)
    return type(optimizer), None


def _variant(path: str, **changes) -> dict:
    config = _raw(REPO / "ds_configs" / path)
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            config.setdefault(section, {})[field] = value
        else:
            config[section] = value
    return config


def test_optimizer_and_zero_stage_agree_with_deepspeed_for_every_shipped_config(no_op_builds):
    from deepspeed.runtime.zero.utils import ZERO_SUPPORTED_OPTIMIZERS

    cases = {p.name: dsc.resolve(p, 8, 1000, Path("/tmp/unused"))[0] for p in CONFIGS}
    lamb = "bert_large_v100_fp16_lamb_zero0.json"
    cases.update({  # what a user might write; DeepSpeed's verdict on each is the reference
        "lamb_zero2": _variant(lamb, zero_optimization={"stage": 2}),
        "lamb_zero1": _variant(lamb, zero_optimization={"stage": 1}),
        "sgd_zero2": _variant("cpu_zero2.json", optimizer={"type": "SGD", "params": {"lr": 0.1}}),
        "sgd_zero2_untested": _variant("cpu_zero2.json", optimizer={"type": "SGD", "params": {"lr": 0.1}},
                                       zero_allow_untested_optimizer=True),
        "bf16_zero0_fp32_accum": _variant("bert_large_a100_bf16_zero1.json", zero_optimization={"stage": 0}),
        "bf16_zero0": _variant("bert_large_a100_bf16_zero1.json", zero_optimization={"stage": 0}, data_types={}),
        "adagrad_zero3": _variant("cpu_zero3.json", optimizer={"type": "Adagrad", "params": {"lr": 0.1}}),
    })
    for name, config in cases.items():
        cls, refused = _deepspeed_verdict(config)
        assert checks.deepspeed_optimizer(config) == (cls.__name__, cls), name
        mine = checks.check_optimizer(config)
        assert (mine is not None) == (refused is not None), (name, mine, refused)
        if name.endswith(".json"):
            assert mine is None, (name, mine)  # every shipped config starts
            stage = config.get("zero_optimization", {}).get("stage", 0)
            assert stage == 0 or cls in ZERO_SUPPORTED_OPTIMIZERS, name
    assert "ZeRO stage 2" in checks.check_optimizer(cases["lamb_zero2"])
    # LAMB under ZeRO with zero_allow_untested_optimizer: DeepSpeed runs it, with a per-shard trust ratio
    untested = _variant(lamb, zero_optimization={"stage": 2}, zero_allow_untested_optimizer=True)
    assert _deepspeed_verdict(untested)[1] is None and "per shard" in checks.check_optimizer(untested)


def test_the_stale_lock_check_knows_the_fused_optimizer_of_every_gpu_recipe(tmp_path, monkeypatch):
    """Each node builds FusedAdam / FusedLamb on first use and loads them under torch's lock file; a process
    killed then leaves the lock, and every later start on that node would wait on it without a word. The check
    must look where DeepSpeed's builder of each shipped recipe's optimizer builds."""
    import time

    from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder  # the CUDA builders (this CPU has stubs)
    from deepspeed.ops.op_builder.fused_lamb import FusedLambBuilder

    from truneg.train.build import JIT_OPTIMIZER_OPS
    from truneg.train.ranks.distributed import refuse_stale_build_lock

    assert JIT_OPTIMIZER_OPS == {"FusedAdam": FusedAdamBuilder.NAME, "FusedLamb": FusedLambBuilder.NAME}
    assert {checks.deepspeed_optimizer(_raw(p))[0] for p in GPU_CONFIGS} == set(JIT_OPTIMIZER_OPS)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "fused_lamb" / "lock"
    lock.parent.mkdir()
    lock.touch()
    refuse_stale_build_lock("fused_lamb")  # a build may be running: a young lock is waited on
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    with pytest.raises(UserError, match="fused_lamb op; delete it if no build is running"):
        refuse_stale_build_lock("fused_lamb")


def test_bf16_accumulates_in_fp32_under_zero_and_the_lamb_recipe_stays_fp16():
    for path in CONFIGS:
        config, choices = dsc.resolve(path, 1, 1000, Path("/tmp/unused"))
        stage = config["zero_optimization"]["stage"]
        if dsc.precision_of(config) == "bf16":
            assert stage >= 1 and config["data_types"]["grad_accum_dtype"] == "fp32", path.name
        if config["optimizer"]["type"] == "Lamb":
            assert stage == 0 and dsc.precision_of(config) == "fp16", path.name
    # a bf16 config at ZeRO-0 says that it accumulates in bf16
    user = REPO / "ds_configs" / "bert_large_a100_bf16_zero1.json"
    raw = {**_raw(user), "zero_optimization": {"stage": 0}}
    raw.pop("data_types")
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"bf16_zero0_{os.getpid()}.json"
    tmp.write_text(json.dumps(raw))
    try:
        _, choices = dsc.resolve(tmp, 1, 1000, Path("/tmp/unused"))
    finally:
        tmp.unlink()
    assert any("accumulate in bf16" in line for line in choices)


def _documented_config_rows() -> list[tuple[list[str], list[str]]]:
    """docs/configs.md's config table: per row, the file names it stands for (`a_{x,y}` brace lists expanded)
    and its cells."""
    section = (REPO / "docs" / "configs.md").read_text()
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        names = []
        for pattern in re.findall(r"`([^`]+)`", cells[0]):
            head, _, rest = pattern.partition("{")
            options, _, tail = rest.partition("}")
            names += [head + option + tail for option in options.split(",")] if rest else [pattern]
        rows.append((names, cells))
    return rows


def test_the_documented_config_table_names_every_shipped_config_with_its_stage_batch_lr_and_precision():
    """The table users choose a recipe from: every file once, no file that does not exist, and per file (in the
    order of its brace list) the ZeRO stage, micro-batch, global batch, learning rate and precision it holds."""
    rows = _documented_config_rows()
    named = [name for names, _ in rows for name in names]
    assert sorted(named) == sorted(p.stem for p in CONFIGS)
    for names, cells in rows:
        # "2 / 1" gives each file of the brace list its own value; a single value holds for all of them
        per_file = [values if len(values) == len(names) else values * len(names)
                    for values in (cells[j].split(" / ") for j in (8, 9, 7))]
        for name, stage, micro, precision in zip(names, *per_file):
            config = _raw(REPO / "ds_configs" / f"{name}.json")
            assert int(stage) == config["zero_optimization"]["stage"], name
            assert int(micro) == config["train_micro_batch_size_per_gpu"], name
            assert precision.split()[0] == dsc.precision_of(config), name
            if "train_batch_size" in config:
                assert int(cells[3].replace(",", "")) == config["train_batch_size"], name
            lr = re.search(r"\d(?:\.\d+)?e-\d", cells[4])
            if lr:  # "as above" repeats the row before
                assert float(lr.group()) == config["optimizer"]["params"]["lr"], name


def test_deepspeeds_throughput_timer_does_not_synchronize_the_device_unless_asked(tmp_path):
    """DeepSpeed's timer, synchronized by default, would make the host wait for the GPU twice per micro-step
    (bench/lib/gpu_step.py's counter sees it in the forward). Read back with DeepSpeed's own config parser."""
    from deepspeed.utils.config import get_timers_config

    for path in CONFIGS:
        timers = get_timers_config(dsc.resolve(path, 1, 1000, Path("/tmp/unused"))[0])
        assert timers.enabled and not timers.synchronized, path.name
    asked = tmp_path / "asked.json"
    asked.write_text(json.dumps({**_raw(CONFIGS[0]), "timers": {"throughput": {"synchronized": True}}}))
    assert get_timers_config(dsc.resolve(asked, 1, 1000, Path("/tmp/unused"))[0]).synchronized


@pytest.fixture
def gpu(monkeypatch):
    """A patched GPU: set its capability and torch's arch list."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    state = {}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: state["arch_list"])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # as on a V100, through emulation
    return state


def test_precision_follows_compute_capability_not_emulation(gpu):
    gpu["arch_list"] = ["sm_70", "sm_80", "sm_90"]
    for capability, precision in (((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"), ((8, 6), "bf16"),
                                  ((9, 0), "bf16")):
        gpu["capability"] = capability
        assert dsc.local_capability() == capability
        for preset in ("electra-small", "electra-base", "bert-base", "bert-large", "bert-tiny", "electra-tiny"):
            for continued in (False, True):
                path = dsc.default_config_path(preset, continued=continued)
                config, choices = dsc.resolve(path, 8, 300, Path("/tmp/unused"))
                assert dsc.precision_of(config) == precision and config["zero_optimization"]["stage"] == (1
                                                                                                          if precision
                                                                                                          == "bf16"
                                                                                                          else 2), path
                assert config["scheduler"]["params"]["warmup_num_steps"] < 300, path  # fits the default --max-steps
                assert checks.check_precision(config, capability) == []
        assert ("continued" in dsc.default_config_path("bert-large", continued=True).name)
    bf16 = dsc.resolve(REPO / "ds_configs" / "bert_large_a100_bf16_zero1.json", 8, 300, Path("/tmp/unused"))[0]
    [line] = checks.check_precision(bf16, (7, 0))
    assert "sm_70 only emulates" in line and "v100_fp16" in line
    assert dsc.default_config_path("bert-large", capability=None) == dsc.CPU_CONFIG


def test_a_gpu_missing_from_the_torch_build_names_the_build_to_install(gpu):
    gpu["arch_list"] = ["sm_80", "sm_90", "sm_100", "sm_120"]  # the CUDA 12.8 wheels of torch >= 2.11
    problem = checks.cuda_arch_problem((7, 0))
    assert "sm_70" in problem and "whl/cu126" in problem and "\n" not in problem
    assert checks.cuda_arch_problem((8, 6)) is None  # sm_80 cubins run on sm_86
    assert checks.cuda_arch_problem((9, 0)) is None
    gpu["arch_list"] = ["sm_70", "sm_80"]
    assert checks.cuda_arch_problem((7, 0)) is None
    assert "sm_90" in checks.cuda_arch_problem((9, 0))  # no sm_9x cubin: Hopper does not run sm_80 ones
    gpu["arch_list"] = []  # a CPU build: nothing to say
    assert checks.cuda_arch_problem((7, 0)) is None
