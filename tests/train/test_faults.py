"""Silent faults, in one process: the checkpoint manifest and `truneg verify`, truneg's own files under torch's safe
unpickler, the replica check's fingerprint and message, the step watchdog's naming of the ranks behind, its dumps
and its fallback while the GIL is held. (The same with real ranks: test_reliability's and test_distributed's
launches.)"""
from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import REPO, cli_in_process, flip_tensor_byte

from truneg.errors import UserError
from truneg.train.checkpointing import checkpoint, integrity
from truneg.train.config.args import step_timeout_problem
from truneg.train.ranks import replicas
from truneg.train.ranks.watchdog import ACK_KEY, DONE_KEY, LOAD, SAVE, StepWatchdog


def test_truneg_rank_files_load_with_weights_only_and_older_ones_with_a_warning(tmp_path, capsys):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.randn()  # numpy caches a second gaussian: part of its state
    path = tmp_path / "truneg_rank00000.pt"
    torch.save({"rng": checkpoint.rng_state(), "metrics": {"sums": {"loss": 1.5}, "micro_steps": 3}}, path)
    expected = (random.random(), np.random.randn(), torch.rand(2))
    state = torch.load(path, weights_only=True)  # no numpy object, nothing but plain types and tensors
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    checkpoint.set_rng_state(state["rng"])
    again = (random.random(), np.random.randn(), torch.rand(2))
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2])
    assert checkpoint.load_rank_state(path)["metrics"] == state["metrics"] and capsys.readouterr().out == ""

    # the format before: numpy's own state, which torch's safe unpickler refuses; still loads, with a warning
    old = tmp_path / "truneg_rank00001.pt"
    torch.save({"rng": {**state["rng"], "numpy": np.random.get_state()}}, old)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(old, weights_only=True)
    loaded = checkpoint.load_rank_state(old)
    assert f"warning: {old} was written before truneg saved plain types" in capsys.readouterr().out
    checkpoint.set_rng_state(loaded["rng"])
    # but not in a tag saved since (it has a manifest): such a file is not truneg's, and is not unpickled
    (tmp_path / integrity.MANIFEST_FILE).write_text("{}")
    with pytest.raises(UserError, match=rf"^{old} holds more than tensors and plain types, which truneg does not "
                                        "write: it is not truneg's; resume only from checkpoints you trust$"):
        checkpoint.load_rank_state(old)


def make_tag(folder: Path) -> Path:
    tag = folder / "global_step8"
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "truneg_rank00000.pt"):
        (tag / name).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"module": torch.arange(4000.0), "name": name}, tag / name)
    torch.save({"state": torch.ones(1000)}, tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt",
               _use_new_zipfile_serialization=False)  # torch's legacy format: no zip, no CRC
    return tag


def test_a_save_writes_a_manifest_before_latest_and_verify_finds_a_changed_byte(tmp_path, world_of_one):
    """hash_share checksums the tag's files (one share per rank: here all), _commit writes the manifest, META and
    `latest`; a flipped bit inside a tensor, which the load pre-check's open misses, is named by the resume's check
    and by `truneg verify` (exit 2); so are a file cut short and a missing one."""
    folder = tmp_path / "checkpoints"
    tag = make_tag(folder)
    manifest = integrity.hash_share(tag)
    assert sorted(manifest) == sorted(integrity.tag_files(tag)) and len(manifest) == 4
    checkpoint._commit(folder, tag.name, 8, 1, manifest)
    assert integrity.read_manifest(tag) == manifest and checkpoint.latest_tag(folder) == tag.name
    proc = cli_in_process("verify", str(folder))
    assert proc.returncode == 0 and proc.stdout.strip() == f"{tag}: intact" and proc.stderr == "", proc
    integrity.verify_before_load(tag, 1)

    shard = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flip_tensor_byte(shard)
    integrity.check_readable([shard], tag)  # the file still opens: only the checksum finds it
    with pytest.raises(UserError, match=rf"^{shard} is damaged: its bytes changed since the save .*; resume from "
                                        "another tag with --resume DIR"):
        integrity.verify_before_load(tag, 1)
    legacy = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    legacy.write_bytes(legacy.read_bytes()[:500])
    (tag / "truneg_rank00000.pt").unlink()
    proc = cli_in_process("verify", str(folder), "--tag", tag.name)
    assert proc.returncode == 2, proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 3 and lines[0] == f"truneg: error: {tag / 'truneg_rank00000.pt'} is missing", lines
    assert lines[1].startswith(f"truneg: error: {shard} is damaged: its bytes changed since the save (checksum ")
    assert lines[2] == f"truneg: error: {legacy} is damaged: 500 bytes, {manifest[legacy.name]['size']} when saved"
    # the RNG states of ranks a load on another world size ignores are not checked by that load
    assert not integrity.read_by_load("truneg_rank00000.pt", 2, saved_world_size=1)
    assert cli_in_process("verify", str(folder), "--tag", "global_step9").returncode == 2


def test_the_save_shares_out_the_union_of_the_files_each_rank_lists(tmp_path, monkeypatch):
    """Rank 0's cached listing of a network file system may lack a file another node has just written: the shares
    are cut from the union of every rank's listing (rank 1, simulated, lists all). Rank 0 hashes the 1st and 3rd."""
    tag = make_tag(tmp_path / "checkpoints")
    everything = integrity.tag_files(tag)
    stale = [name for name in everything if name != "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    monkeypatch.setattr(integrity, "tag_files", lambda folder: stale)
    monkeypatch.setattr(integrity.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(integrity.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(integrity.dist, "all_gather_object", lambda out, mine: out.__setitem__(slice(None),
                                                                                             [mine, everything]))
    monkeypatch.setattr(integrity.dist, "gather_object", lambda mine, out, dst: out.__setitem__(slice(None),
                                                                                               [mine, {}]))
    assert sorted(integrity.hash_share(tag)) == sorted(everything)[0::2]


class Planted:
    """A pickle that runs code when loaded: it creates the file `marker`."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_a_checkpoint_without_a_manifest_resumes_and_verifies_by_its_zip_crcs_without_unpickling(tmp_path,
                                                                                                  world_of_one, capsys):
    """A tag written before the manifest resumes and verifies with a warning; verify reads torch.save's own CRC32s
    (a changed byte inside a tensor and a file cut short are found; its legacy-format file is said unchecked) and
    unpickles nothing: a planted pickle does not run."""
    folder = tmp_path / "checkpoints"
    tag = make_tag(folder)
    torch.save({"rng": Planted(tmp_path / "ran")}, tag / "truneg_rank00001.pt")
    checkpoint._commit(folder, tag.name, 8, 1)  # as truneg wrote them before the manifest
    proc = cli_in_process("verify", str(tag))
    assert proc.returncode == 0 and proc.stderr == (
        f"truneg: warning: {tag} has no truneg_manifest.json (written before truneg checksummed its checkpoints): "
        "its files' own CRCs were read instead (1 file(s) in torch's legacy format unchecked)\n"), proc.stderr
    assert not (tmp_path / "ran").exists()
    integrity.verify_before_load(tag, 1)
    assert f"warning: {tag} has no truneg_manifest.json" in capsys.readouterr().out
    flipped, cut = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / "mp_rank_00_model_states.pt"
    flip_tensor_byte(flipped)
    cut.write_bytes(cut.read_bytes()[:1000])
    (tag / "truneg_rank00002.pt").write_bytes(b"")  # emptied, or its first block zeroed: not read as legacy
    (tag / "truneg_rank00003.pt").write_bytes(b"\0" * 4096 + (tag / "truneg_rank00000.pt").read_bytes()[4096:])
    header = tag / "truneg_rank00004.pt"  # a changed byte in the zip's central directory: one line, no traceback
    torch.save({"x": torch.ones(3)}, header)
    data = bytearray(header.read_bytes())
    at = data.rindex(b"PK\x01\x02") + 10  # the last directory entry's compression method
    data[at] = 99
    header.write_bytes(bytes(data))
    proc = cli_in_process("verify", str(tag))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 6 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[1].startswith(f"truneg: error: {cut} is damaged (") and lines[5].startswith(
        f"truneg: error: {flipped} is damaged: its record ") and lines[5].endswith(" fails its CRC32"), lines
    assert lines[2:4] == [f"truneg: error: {tag / name} is damaged: it does not begin as a torch.save file does"
                          for name in ("truneg_rank00002.pt", "truneg_rank00003.pt")], lines
    assert lines[4].startswith(f"truneg: error: {header} is damaged (NotImplementedError"), lines


def test_verify_refuses_an_incomplete_tag_and_a_manifest_of_the_wrong_shape_in_one_line(tmp_path, world_of_one):
    folder = tmp_path / "checkpoints"
    tag = make_tag(folder)  # files, but no META: a save cut before its end
    proc = cli_in_process("verify", str(folder), "--tag", tag.name)
    assert proc.returncode == 2 and proc.stderr == (
        f"truneg: error: {tag} is incomplete: it has no truneg_meta.json (a save cut short, or not a truneg "
        "checkpoint)\n"), proc.stderr
    checkpoint._commit(folder, tag.name, 8, 1, integrity.hash_share(tag))
    for damaged in ('{"files": []}', '{"files": {}}', '{"files": {"x.pt": {}}}', '[1]', "{"):
        (tag / integrity.MANIFEST_FILE).write_text(damaged)
        proc = cli_in_process("verify", str(folder))
        assert proc.returncode == 2 and proc.stderr == (f"truneg: error: {tag / integrity.MANIFEST_FILE} is damaged; "
                                                        "resume from another tag with --resume DIR\n"), damaged


def test_the_replica_fingerprint_is_exact_and_a_difference_names_the_rank_and_the_parameter(monkeypatch):
    flat = torch.randn(100)  # a view at an odd offset of a flat buffer, as ZeRO's parameters are
    params = [torch.randn(300, 7), torch.randn(5).to(torch.bfloat16), torch.randn(9).half(), flat[3:9].view(2, 3)]
    mine = replicas.fingerprint(params)
    assert mine.dtype == torch.int64 and torch.equal(mine, replicas.fingerprint([p.clone() for p in params]))
    nudged = [p.clone() for p in params]
    nudged[0][123, 4] = torch.nextafter(nudged[0][123, 4], torch.tensor(1e9))  # one ulp
    nudged[1][2] = -nudged[1][2]  # one sign bit of a bf16
    nudged[3][1, 2] = torch.nextafter(nudged[3][1, 2], torch.tensor(-1e9))
    assert (replicas.fingerprint(nudged) != mine).tolist() == [True, True, False, True]

    # two ranks, simulated: rank 0 holds the model, "rank 1" the same with the second parameter changed
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    engine = type("Engine", (), {"module": model})()
    other = replicas.fingerprint(list(model.parameters()))
    other[1] += 1
    monkeypatch.setattr(replicas.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(replicas.dist, "all_reduce",
                        lambda t, op: t.copy_(torch.maximum(t, torch.cat([other, -other]))))
    monkeypatch.setattr(replicas.dist, "all_gather", lambda out, t: [out[0].copy_(t), out[1].copy_(other[1])])
    with pytest.raises(UserError, match=r"replicas diverged by step 12: rank 1's weights differ from rank 0's, "
                                        r"first in 0.bias \(1 parameter\(s\) differ\); stopped without saving. The "
                                        r"last good checkpoint \(global_step8\) is intact"):
        replicas.check(engine, 12, "global_step8")
    other[1] -= 1
    replicas.check(engine, 12, "global_step8")  # the same weights: nothing said


def watchdogs(tmp_path: Path, world_size: int, ranks: int, timeouts: list[float], long_limit_s: float = 30.0,
              exiting: int = 2):
    """`ranks` of a world of `world_size` on one store (as rank 0 hosts it), their exits recorded in order; an event
    set once `exiting` have exited; and the store's server, to be kept alive."""
    server = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    exits, done = {}, threading.Event()

    def exit_of(rank):
        def record(code):
            exits[rank] = code
            if len(exits) == exiting:
                done.set()
        return record

    dogs = [StepWatchdog(timeouts[rank], tmp_path, rank, world_size, server.clone(), exit_=exit_of(rank), beat_s=0.2,
                         fallback=False, long_limit_s=long_limit_s) for rank in range(ranks)]
    return dogs, exits, done, server


def test_the_step_watchdog_names_a_stopped_rank_and_those_behind(tmp_path, capfd):
    """Rank 1's process stopped (its beat stops), rank 2 still in the step before, rank 3 in step 7 but started
    later (its limit not yet passed), rank 4 never started. Rank 0's step runs past the timeout: it writes its stack,
    names ranks 1, 2 and 4, and exits 2 after every running rank has heard it (its exit closes the store): rank 2,
    past its timeout too, and rank 3 at its next beat, each with its own stack and line. Then a save, timed by the
    long limit: rank 0 in step 7's save names rank 1, still in step 7's training."""
    dogs, exits, done, _server = watchdogs(tmp_path, 5, 4, [1.0, 1.0, 1.0, 30.0], exiting=3)
    try:
        time.sleep(0.5)
        dogs[1].started(7)
        time.sleep(0.3)  # one beat in step 7, then the process stops
        dogs[1].paused.set()
        dogs[2].started(6)
        dogs[3].started(7)
        dogs[0].started(7)
        assert done.wait(20), exits
    finally:
        for dog in dogs:
            dog.close()
    assert exits == {0: 2, 2: 2, 3: 2} and list(exits)[-1] == 0, exits  # rank 0 last
    err = capfd.readouterr().err
    [line] = [line for line in err.splitlines() if "step 7 ran past" in line]
    assert line.startswith("truneg: error: step 7 ran past --step-timeout 1 s: rank 1 stopped running (last seen in "
                           "step 7); rank 2 is still in step 6; rank 4 does not answer; every running rank's stack "
                           "is in"), line
    assert "step 6 ran past --step-timeout 1 s: rank 0 names the ranks behind" in err
    assert "truneg: error: rank 0 found step 7 past its limit and names the ranks behind; this rank's stack" in err
    stacks = (tmp_path / "hang" / "step7_rank00000.stacks.txt").read_text()
    assert "test_the_step_watchdog_names_a_stopped_rank_and_those_behind" in stacks  # the main thread, waiting
    assert (tmp_path / "hang" / "step6_rank00002.stacks.txt").is_file()
    assert (tmp_path / "hang" / "step7_rank00003.stacks.txt").is_file()
    assert not (tmp_path / "hang" / "step7_rank00001.stacks.txt").exists()

    dogs, exits, done, _server = watchdogs(tmp_path / "save", 2, 2, [30.0, 1.0], long_limit_s=1.0)
    try:
        dogs[1].started(7)
        dogs[0].started(7, SAVE)
        assert done.wait(20), exits
    finally:
        for dog in dogs:
            dog.close()
    err = capfd.readouterr().err
    assert ("truneg: error: step 7's checkpoint save ran past 1 s (the collective timeout less a minute): rank 1 is "
            "still in step 7 (its training); every running rank's stack") in err, err
    assert "step 7 ran past --step-timeout 1 s: rank 0 names the ranks behind" in err


def test_a_rank_whose_collective_fails_after_rank_0_spoke_says_so_as_the_others_do(tmp_path, capfd):
    """Ranks leaving after rank 0's diagnosis can make another rank's collective fail before its next beat: its
    main thread, leaving on that exception, closes the watchdog as failed, which says the same line (no
    traceback), acknowledges, and exits 2. A full disk puts the stacks on stderr, and the line says so."""
    dogs, exits, _done, _server = watchdogs(tmp_path, 3, 3, [60.0] * 3)
    try:
        dogs[1].hang_dir.write_text("")  # a file where the folder goes: the stacks cannot be written
        dogs[0].store.set(DONE_KEY, "7")
        dogs[1].close(failed=True)
        dogs[2].close()  # a run's normal end: nothing said
    finally:
        for dog in dogs:
            dog.close()
    assert exits == {1: 2} and int(dogs[0].store.add(ACK_KEY, 0)) == 1, exits
    err = capfd.readouterr().err
    assert ("truneg: error: rank 0 found step 7 past its limit and names the ranks behind; this rank's stack is on "
            f"its stderr ({tmp_path / 'hang'}: ") in err, err
    assert "test_a_rank_whose_collective_fails_after_rank_0_spoke" in err  # the stacks themselves


def test_on_a_gpu_the_hang_dump_adds_nccls_flight_recorder_beside_the_stacks(tmp_path, monkeypatch):
    """The recorder is switched on before the process group (a user's own buffer size kept) and its trace written
    beside each rank's stacks; without CUDA, or with the recorder off, the stacks alone. (NCCL's own trace is only
    on GPUs: here torch's dump function stands in for it.)"""
    from truneg.train.ranks.watchdog import NCCL_TRACE_ENV, enable_flight_recorder

    for name in ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(NCCL_TRACE_ENV, "500")
    enable_flight_recorder(tmp_path)
    assert [os.environ[name] for name in (NCCL_TRACE_ENV, "TORCH_NCCL_DUMP_ON_TIMEOUT",
                                          "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")] == [
        "500", "1", f"{tmp_path}/nccl_trace_rank_"]  # NCCL's own dump: into the output folder, not /tmp
    monkeypatch.setattr(torch._C._distributed_c10d, "_dump_nccl_trace", lambda: b"the last collectives",
                        raising=False)
    dog = StepWatchdog(60, tmp_path, 3, 4, dist.HashStore(), exit_=lambda code: None, fallback=False)
    try:
        for cuda, recorder, folder in ((False, "500", "cpu"), (True, "", "off"), (True, "500", "gpu")):
            monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
            monkeypatch.setenv(NCCL_TRACE_ENV, recorder)
            dog.hang_dir = tmp_path / folder
            stacks = dog._dump(9)
            assert stacks == tmp_path / folder / "step9_rank00003.stacks.txt" and "_dump" in stacks.read_text()
            assert {p.name for p in (tmp_path / folder).iterdir()} == {
                stacks.name, *(["step9_rank00003.nccl_trace.pickle"] if folder == "gpu" else [])}, folder
        assert (tmp_path / "gpu" / "step9_rank00003.nccl_trace.pickle").read_bytes() == b"the last collectives"
    finally:
        dog.close()


GIL_HELD = """
import sys, time, torch.distributed as dist
from truneg.train.ranks import watchdog
watchdog.STORE_TIMEOUT_S, watchdog.FALLBACK_GRACE_S = 0.1, 0.5
dog = watchdog.StepWatchdog(0.5, sys.argv[1], 0, 2, dist.HashStore(), beat_s=0.1)
dog.started(3)
print(dog.fallback_s(), flush=True)
def a_step_holding_the_gil():
    return sum(range(10 ** 12))  # one C call: the watchdog thread never gets the GIL back
a_step_holding_the_gil()
"""


def test_a_step_that_holds_the_gil_is_ended_by_faulthandlers_timer_with_its_stack(tmp_path):
    """The watchdog thread cannot run while the main thread holds the GIL: faulthandler's own timer (a C thread)
    writes the main thread's stack to stderr and ends the process, past the thread's own deadline."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", GIL_HELD, str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - t0
    fallback_s = float(proc.stdout.split()[0])
    assert proc.returncode == 1 and elapsed >= fallback_s, (proc.returncode, elapsed, proc.stderr[-2000:])
    assert "Timeout" in proc.stderr and "a_step_holding_the_gil" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "hang").exists()  # the thread never ran its diagnosis


def test_a_resumes_load_is_timed_by_the_long_limit_with_a_watchdog_of_its_own(tmp_path, capfd, world_of_one):
    """The load phase: past the long limit (not --step-timeout), rank 0 names the rank whose beat stopped; the run's
    own load is timed by a watchdog that is gone, thread and all, when the load ends."""
    dogs, exits, _done, _server = watchdogs(tmp_path, 2, 2, [0.5, 0.5], long_limit_s=2.0)
    try:
        dogs[1].started(8, LOAD)
        time.sleep(0.4)
        dogs[1].paused.set()
        began = time.monotonic()
        dogs[0].started(8, LOAD)
        while 0 not in exits and time.monotonic() < began + 20:
            time.sleep(0.05)
        assert exits == {0: 2} and time.monotonic() - began >= 2.0, exits
    finally:
        for dog in dogs:
            dog.close()
    err = capfd.readouterr().err
    assert ("truneg: error: the resume's load of step 8's checkpoint ran past 2 s (the collective timeout less a "
            "minute): rank 1 stopped running (last seen in step 8); every running rank's stack") in err, err
    assert (tmp_path / "hang" / "step8_rank00000.stacks.txt").is_file()

    with StepWatchdog.timing(300.0, tmp_path / "run", 8, LOAD):
        [dog] = [t for t in threading.enumerate() if t.name == "truneg-step-watchdog"]
    assert not dog.is_alive()
    with StepWatchdog.timing(0, tmp_path / "run", 8, LOAD):  # --step-timeout 0: none
        assert not any(t.name == "truneg-step-watchdog" for t in threading.enumerate())


def test_the_step_timeout_stays_below_the_collective_timeout():
    assert step_timeout_problem(0) is None and step_timeout_problem(300) is None
    assert step_timeout_problem(-1.0) == "--step-timeout must be a finite number >= 0, not -1.0"
    said = step_timeout_problem(900)
    assert said.startswith("--step-timeout 900 is not below the collective timeout (600 s, DEEPSPEED_TIMEOUT=10 "
                           "minutes)") and said.endswith("export DEEPSPEED_TIMEOUT=20"), said


def tag_of_the_reference(runs, tmp_path: Path) -> Path:
    """A copy of the bert-zero2 reference run's checkpoints folder (ZeRO-2: zero_to_fp32 reads its optimizer
    shards), and its last tag in it."""
    import shutil

    reference_dir, _ = runs("bert-zero2")
    shutil.copytree(reference_dir / "checkpoints", tmp_path / "checkpoints")
    return tmp_path / "checkpoints" / checkpoint.latest_tag(tmp_path / "checkpoints")


def torch_loads(monkeypatch, tag: Path) -> list[str]:
    """The files of `tag` that anything (truneg, DeepSpeed's zero_to_fp32) hands to torch.load from now on."""
    loaded, real = [], torch.load

    def spy(f, *args, **kwargs):
        if Path(f).parent == tag:
            loaded.append(Path(f).name)
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    return loaded


def test_eval_fn_stats_and_export_read_a_tag_only_once_its_manifest_matches(runs, tmp_path, small_corpus,
                                                                            monkeypatch, capsys):
    """A changed byte in DeepSpeed's model file, or a file the save did not write (zero_to_fp32 reads every
    *_optim_states.pt it finds), is one line naming it, exit 2, before any of the tag's files is unpickled. The
    samples `truneg eval` reports come from META; a tag without a manifest is read with a warning."""
    from truneg.eval.checkpoints import discover_checkpoints, samples_of

    tag = tag_of_the_reference(runs, tmp_path)
    [ref] = discover_checkpoints([str(tag)])
    loaded = torch_loads(monkeypatch, tag)
    assert samples_of(ref) == {"samples": 24 * 4 * 2} and loaded == []  # META's: no pickle read
    model_file = tag / "mp_rank_00_model_states.pt"
    intact = model_file.read_bytes()
    flip_tensor_byte(model_file)
    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))  # fn-stats prepares the corpus first
    changed = f"truneg: error: {model_file} is damaged: its bytes changed since the save (checksum "
    for command in (("export", str(tag), str(tmp_path / "hf")),
                    ("eval", str(tag), "--data", str(small_corpus), "--seq-len", "64", "--eval-max-sequences", "4"),
                    ("fn-stats", "--checkpoints", str(tag), "--data", str(small_corpus), "--seq-len", "64",
                     "--max-sequences", "4", "--out", str(tmp_path / "fn"))):
        proc = cli_in_process(*command)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith(changed) and last.endswith(
            "; nothing was read from it: pass another tag, or this one as it was saved"), (command, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and loaded == [], command
    assert not (tmp_path / "hf").exists()

    model_file.write_bytes(intact)
    extra = tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    extra.write_bytes((tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").read_bytes())
    proc = cli_in_process("export", str(tag), str(tmp_path / "hf"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        f"truneg: error: {extra} is not in {integrity.MANIFEST_FILE}: it was added after the save; nothing was read "
        "from it: pass another tag, or this one as it was saved") and loaded == [], proc.stderr[-2000:]

    # a tag written before the manifest and before META held the samples: read, with a warning; the samples from
    # DeepSpeed's model file, with the safe unpickler
    extra.unlink()
    (tag / integrity.MANIFEST_FILE).unlink()
    (tag / checkpoint.META_FILE).write_text('{"step": 24, "world_size": 2}\n')
    capsys.readouterr()
    assert samples_of(ref) == {"samples": 24 * 4 * 2} and loaded == ["mp_rank_00_model_states.pt"]
    assert capsys.readouterr().err == (f"truneg: warning: {tag} has no {integrity.MANIFEST_FILE} (written before "
                                       "truneg checksummed its checkpoints): its files are read unchecked\n")
    proc = cli_in_process("export", str(tag), str(tmp_path / "hf"))
    assert proc.returncode == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), proc.stderr[-2000:]


def test_a_forged_pickle_is_refused_by_the_safe_unpickler_even_with_a_manifest_that_matches(runs, tmp_path,
                                                                                           monkeypatch):
    """A manifest is integrity, not safety: a folder can carry one written for forged files. DeepSpeed's model file
    and its ZeRO optimizer shard (which zero_to_fp32 would unpickle whole) each forged to run code, the manifest
    rewritten to match: export, the samples' fallback and the resume's pre-check refuse them in one line, and the
    code never runs. DeepSpeed's real files load with the classes allowed."""
    from truneg.eval.checkpoints import CheckpointRef, samples_of

    tag = tag_of_the_reference(runs, tmp_path)
    for path in sorted(tag.glob("*_states.pt")):  # what DeepSpeed 0.19 pickles: the allowed classes suffice
        integrity.load_deepspeed_file(path)
    marker = tmp_path / "ran"
    manifest = integrity.read_manifest(tag)
    for name in ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"):
        forged = tag / name
        saved = torch.load(forged, map_location="cpu", weights_only=False)
        torch.save({**saved, "global_samples": Planted(marker)}, forged)
        manifest[name] = integrity.checksum(forged)
        integrity.write_manifest(tag, manifest)
        proc = cli_in_process("export", str(tag), str(tmp_path / "hf"))
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith(f"truneg: error: {forged} holds ") and last.endswith(
            ", which DeepSpeed's checkpoints do not (truneg unpickles tensors, plain types and "
            "deepspeed.runtime.fp16.loss_scaler.LossScaler, deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler, "
            "deepspeed.runtime.zero.config.ZeroStageEnum, deepspeed.utils.tensor_fragment.fragment_address); it was "
            "not unpickled: read only checkpoints you trust"), proc.stderr[-2000:]
        assert not marker.exists() and not (tmp_path / "hf").exists()
    (tag / checkpoint.META_FILE).write_text('{"step": 24, "world_size": 2}\n')  # no samples: the model file's
    with pytest.raises(UserError, match=" holds .*it was not unpickled"):
        samples_of(CheckpointRef(str(tag), 24, tag, "truneg"))
    with pytest.raises(UserError, match=" holds .*it was not unpickled"):  # resume's pre-check of a tag without one
        integrity.check_readable([tag / "mp_rank_00_model_states.pt"], tag)
    assert not marker.exists()
