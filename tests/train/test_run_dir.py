"""The output folder's run record: what makes two invocations the same run, in one process (a world of one)."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from conftest import free_port

from truneg.errors import UserError
from truneg.synonyms.table import SHIPPED_WORDNET_TABLE
from truneg.train.checkpointing.run_dir import RUN_FILE, claim_output_dir, run_identity
from truneg.train.config.args import parse_args
from truneg.train.config.run_config import RunConfig


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def saved(checkpoints, step: int = 5) -> None:
    """A complete save, as every rank leaves it once truneg marks it (META, then `latest`)."""
    from truneg.train.checkpointing.checkpoint import META_FILE

    (checkpoints / f"global_step{step}").mkdir(parents=True)
    (checkpoints / f"global_step{step}" / META_FILE).write_text("{}")
    (checkpoints / "latest").write_text(f"global_step{step}")


def identity(cfg: RunConfig, table_hash: str) -> dict:
    parts = {"architecture": {"family": "bert", "layers": 2}, "synonym_table": table_hash, "data": "prepared-abc"}
    return run_identity(cfg, {"optimizer": {"type": "AdamW"}}, parts)


def test_a_rebuilt_synonym_table_is_another_run_and_an_older_record_resumes_with_a_warning(tmp_path, capsys):
    cfg = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--hc", "wordnet", "--output-dir", str(tmp_path)]))
    claim_output_dir(cfg, identity(cfg, "table-1"), rank=0)
    record = json.loads((tmp_path / RUN_FILE).read_text())
    assert record["synonym_table"] == "table-1" and record["data"] == "prepared-abc"
    saved(tmp_path / "checkpoints")
    claim_output_dir(cfg, identity(cfg, "table-1"), rank=0)  # the same run resumes
    watched = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--hc", "wordnet", "--output-dir", str(tmp_path),
                                              "--eval-data", "held-out.txt", "--eval-steps", "5",
                                              "--eval-max-sequences", "64", "--eval-synonyms",
                                              str(SHIPPED_WORDNET_TABLE)]))
    claim_output_dir(watched, identity(watched, "table-1"), rank=0)  # with (other) evaluation flags too
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(cfg, identity(cfg, "table-2"), rank=0)  # same --hc string, another table
    # a record an older truneg wrote, before the table's hash, the architecture and the data were recorded
    older = {k: v for k, v in record.items() if k not in ("synonym_table", "architecture", "data", "max_predictions",
                                                           "sr_sent_target")}
    (tmp_path / RUN_FILE).write_text(json.dumps(older))
    claim_output_dir(cfg, identity(cfg, "table-1"), rank=0)
    assert "predates the fields" in capsys.readouterr().out
    assert json.loads((tmp_path / RUN_FILE).read_text())["synonym_table"] == "table-1"
    older["seed"] = 7  # but a real difference is still refused
    (tmp_path / RUN_FILE).write_text(json.dumps(older))
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(cfg, identity(cfg, "table-1"), rank=0)


def test_a_relative_and_an_absolute_path_to_the_same_init_or_table_are_the_same_run(tmp_path, monkeypatch):
    """The launch scripts make INIT and HC absolute; a run started by hand with relative ones resumes through them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    out = tmp_path / "run"

    def cfg(init: str, hc: str) -> RunConfig:
        return RunConfig.from_args(parse_args(["--model", "bert-tiny", "--init-from", init, "--hc", hc,
                                               "--output-dir", str(out)]))

    claim_output_dir(cfg("ckpt", "my.npz"), identity(cfg("ckpt", "my.npz"), "t"), rank=0)
    saved(out / "checkpoints")
    absolute = cfg(str(tmp_path / "ckpt"), str(tmp_path / "my.npz"))
    claim_output_dir(absolute, identity(absolute, "t"), rank=0)
    other = cfg(str(tmp_path / "other"), str(tmp_path / "my.npz"))
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(other, identity(other, "t"), rank=0)


def test_new_head_is_recorded_only_when_set_and_a_resume_repeats_it(tmp_path):
    """run.json records `new_head` only for a --new-head run, so that runs recorded before the flag still resume; a
    --new-head run resumes with the flag and is refused without it (its model is rebuilt from --init-from)."""
    (tmp_path / "ckpt").mkdir()

    def cfg(*flags: str) -> RunConfig:
        return RunConfig.from_args(parse_args(["--init-from", str(tmp_path / "ckpt"), *flags,
                                               "--output-dir", str(tmp_path / "run")]))

    assert "new_head" not in identity(cfg(), "t") and identity(cfg("--new-head"), "t")["new_head"] is True
    claim_output_dir(cfg("--new-head"), identity(cfg("--new-head"), "t"), rank=0)
    saved(tmp_path / "run" / "checkpoints")
    claim_output_dir(cfg("--new-head"), identity(cfg("--new-head"), "t"), rank=0)
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(cfg(), identity(cfg(), "t"), rank=0)


def test_an_electra_run_recorded_with_sr_sent_target_original_resumes_without_the_flag(tmp_path):
    """--sr-sent-target is refused for ELECTRA now (it changed nothing there); a run recorded with it resumes."""
    cfg = RunConfig.from_args(parse_args(["--model", "electra-tiny", "--sr", "sent", "--output-dir", str(tmp_path)]))
    parts = {"architecture": {"family": "electra", "layers": 2}, "synonym_table": None, "data": "prepared-abc"}
    claim_output_dir(cfg, run_identity(cfg, {}, parts), rank=0)
    saved(tmp_path / "checkpoints")
    record = json.loads((tmp_path / RUN_FILE).read_text())
    (tmp_path / RUN_FILE).write_text(json.dumps({**record, "sr_sent_target": "original"}))  # as an older truneg wrote
    claim_output_dir(cfg, run_identity(cfg, {}, parts), rank=0)
    (tmp_path / RUN_FILE).write_text(json.dumps({**record, "sr": "word"}))  # another run is still refused
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(cfg, run_identity(cfg, {}, parts), rank=0)


def test_what_a_run_left_before_its_first_complete_save_is_named_as_such_and_a_damaged_record_is_one_line(tmp_path):
    """A run that failed after its start (hf_config/ and run.json written, perhaps a first save cut short), or one
    still running towards its first save: another run there is refused in a line that says so and how to go on
    (--overwrite), not told to resume checkpoints that do not exist; the same run starts again."""
    failed = RunConfig.from_args(parse_args(["--model", "electra-tiny", "--output-dir", str(tmp_path)]))
    corrected = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path)]))
    for left in ("hf_config/generator/config.json", "global_step100/zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        claim_output_dir(failed, identity(failed, "t"), rank=0)
        (tmp_path / "checkpoints" / left).parent.mkdir(parents=True)
        (tmp_path / "checkpoints" / left).write_text("left behind")
        with pytest.raises(UserError, match="holds what another run left before its first complete checkpoint"):
            claim_output_dir(corrected, identity(corrected, "t"), rank=0)
        assert (tmp_path / "checkpoints" / left).is_file()  # nothing deleted without --overwrite
        claim_output_dir(failed, identity(failed, "t"), rank=0)  # the same run goes on
        overwrite = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path),
                                                    "--overwrite"]))
        claim_output_dir(overwrite, identity(overwrite, "t"), rank=0)
        assert not (tmp_path / "checkpoints").exists()
    # a complete checkpoint of another run is refused as such, and one beside a damaged run.json is not guessed at
    claim_output_dir(failed, identity(failed, "t"), rank=0)
    saved(tmp_path / "checkpoints")
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(corrected, identity(corrected, "t"), rank=0)
    (tmp_path / RUN_FILE).write_bytes(b"\xff\xfe[1, 2]")
    with pytest.raises(UserError, match="run.json is damaged, so the checkpoints in"):
        claim_output_dir(corrected, identity(corrected, "t"), rank=0)
    (tmp_path / RUN_FILE).write_text("[1, 2]")
    with pytest.raises(UserError, match="run.json is damaged"):
        claim_output_dir(corrected, identity(corrected, "t"), rank=0)
    assert (tmp_path / "checkpoints" / "global_step5").is_dir()


def test_a_shared_folder_rank_0_cannot_write_in_stops_every_rank_with_one_line(tmp_path, monkeypatch):
    """The shared-folder check's probe is written by rank 0 alone: a full or read-only folder there must reach
    the other ranks (on other nodes they would wait in the next collective until the timeout). A world of one
    run as rank 0 of two: the outcome is shared by the same all-reduce."""
    from pathlib import Path

    from truneg.train.checkpointing.run_dir import check_shared_output_dir

    check_shared_output_dir(tmp_path / "out", rank=0, world_size=2)  # the probe written, read and removed
    assert list((tmp_path / "out").iterdir()) == []
    real_write = Path.write_text

    def full_disk(path, *args, **kwargs):
        if path.name.startswith(".truneg-shared-"):
            raise OSError(28, "No space left on device")
        return real_write(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(UserError, match=r"cannot write in .*/out: OSError: \[Errno 28\] No space left on device"):
        check_shared_output_dir(tmp_path / "out", rank=0, world_size=2)


def test_a_hub_name_is_downloaded_by_each_nodes_local_rank_0_first_and_recorded_with_its_commit(
        offline_hub, tmp_path, monkeypatch):
    """Rank 0 resolves the name (and would download) before a collective; the other nodes' local rank 0 then take its
    commit (downloading what their cache lacks), and the other ranks after them read their node's cache only.
    run.json keeps the name and the commit; a resume after the branch moved is the same run, and keeps the commit
    the run started from."""
    import types

    from conftest import hub_snapshot

    from truneg.model import hub, pretrainers
    from truneg.train import build
    from truneg.train.ranks import distributed

    snapshot = hub_snapshot(offline_hub, "org/tiny-bert", "c0" * 20)
    pretrainers.build_pretrainer("bert-tiny", pretrainers.ObjectiveConfig()).mlm.save_pretrained(snapshot)
    events = []
    real_download, real_collective = hub.snapshot_download, distributed.on_every_rank

    def download(*args, local_files_only=False, **kwargs):
        events.append(("cache only" if local_files_only else "may download", kwargs.get("revision")))
        return real_download(*args, local_files_only=local_files_only, **kwargs)

    def collective(action, what):
        real_collective(action, what)
        events.append("collective")

    def as_rank(rank: int):  # torch.distributed as build.py sees it, on another rank of a world of several
        def broadcast_object_list(objects, src):  # rank 0's commit
            objects[0] = objects[0] if rank == 0 else "c0" * 20
        return types.SimpleNamespace(get_rank=lambda: rank, get_world_size=dist.get_world_size,
                                     all_gather_object=dist.all_gather_object,
                                     broadcast_object_list=broadcast_object_list)

    monkeypatch.setattr(hub, "snapshot_download", download)
    monkeypatch.setattr(distributed, "on_every_rank", collective)
    cfg = RunConfig.from_args(parse_args(["--init-from", "org/tiny-bert", "--output-dir", str(tmp_path / "run")]))
    orders = {}
    for rank, local_rank in ((0, "0"), (1, "0"), (1, "1")):
        events.clear()
        monkeypatch.setattr(build, "dist", as_rank(rank))
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        init = build.locate_init(cfg)
        orders[rank, local_rank] = list(events)
        assert init["init_from"] == hub.Checkpoint("org/tiny-bert", snapshot, "c0" * 20)
    pinned = "c0" * 20  # the other ranks resolve rank 0's commit, not the branch (which may have moved since)
    assert orders == {(0, "0"): [("may download", None), "collective", "collective", "collective"],
                      (1, "0"): ["collective", ("may download", pinned), "collective", "collective"],
                      (1, "1"): ["collective", "collective", ("cache only", pinned), "collective"]}
    # a relative folder on one node only: a hub name on the others, which no commit can reconcile
    folder_elsewhere = {**vars(as_rank(0)), "all_gather_object": lambda out, value: out.__setitem__(slice(None),
                                                                                                  [value, None])}
    monkeypatch.setattr(build, "dist", types.SimpleNamespace(**folder_elsewhere))
    with pytest.raises(UserError, match="is a folder on some nodes and a hub name on others"):
        build.locate_init(cfg)
    monkeypatch.setattr(build, "dist", dist)
    assert build.init_record(init) == {"init_revision": "c0" * 20}
    pair = RunConfig.from_args(parse_args(["--init-from", str(snapshot), "--init-generator", "org/tiny-bert@main"]))
    found = build.locate_init(pair)  # ELECTRA's pair: the generator's commit too (a folder has none)
    assert found["init_generator"].path == snapshot and build.init_record(found) == {
        "init_generator_revision": "c0" * 20}

    parts = {"architecture": {"family": "bert", "layers": 2}, "synonym_table": None, "data": "d",
             **build.init_record(init)}
    claim_output_dir(cfg, run_identity(cfg, {}, parts), rank=0)
    record = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    assert (record["init_from"], record["init_revision"]) == ("org/tiny-bert", "c0" * 20)
    saved(tmp_path / "run" / "checkpoints")
    claim_output_dir(cfg, run_identity(cfg, {}, {**parts, "init_revision": "c1" * 20}), rank=0)
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["init_revision"] == "c0" * 20
    other = RunConfig.from_args(parse_args(["--init-from", "org/other", "--output-dir", str(tmp_path / "run")]))
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(other, run_identity(other, {}, parts), rank=0)


def test_a_start_from_the_checkpoint_records_and_carries_what_it_loaded_and_a_resume_what_the_run_started_from(
        tmp_path):
    """A run cut before its first checkpoint starts again from --init-from: run.json takes the commit resolved now
    (a branch may have moved), and the pooler file is this start's; a resume keeps both from the run's start."""
    import torch

    from truneg.data.blocks import DEFAULT_TOKENIZER, load_tokenizer
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
    from truneg.train.checkpointing.export import POOLER_FILE, save_hf_configs

    cfg = RunConfig.from_args(parse_args(["--init-from", "org/tiny-bert", "--output-dir", str(tmp_path / "cut")]))
    parts = {"architecture": {"family": "bert", "layers": 2}, "synonym_table": None, "data": "d"}
    claim_output_dir(cfg, run_identity(cfg, {}, {**parts, "init_revision": "c0" * 20}), rank=0)
    claim_output_dir(cfg, run_identity(cfg, {}, {**parts, "init_revision": "c1" * 20}), rank=0)
    assert json.loads((tmp_path / "cut" / RUN_FILE).read_text())["init_revision"] == "c1" * 20

    model, tokenizer = build_pretrainer("bert-tiny", ObjectiveConfig()), load_tokenizer(DEFAULT_TOKENIZER)
    written = cfg.checkpoint_dir / "hf_config" / POOLER_FILE
    for value, resumed, kept in ((1.0, False, 1.0), (2.0, True, 1.0), (3.0, False, 3.0)):
        model.pooler = {"bert.pooler.dense.bias": torch.full((4,), value)}
        save_hf_configs(model, cfg.checkpoint_dir, tokenizer, resumed=resumed)
        assert load_file_value(written) == kept, (value, resumed)
    model.pooler = None
    save_hf_configs(model, cfg.checkpoint_dir, tokenizer)  # a start without a pooler leaves no earlier one
    assert not written.exists()


def load_file_value(path) -> float:
    from safetensors.torch import load_file

    return float(load_file(path)["bert.pooler.dense.bias"][0])


def test_the_profilers_and_mfus_flags_are_not_the_runs_identity_and_overwrite_clears_profile(tmp_path):
    """--profile-steps, --profile-ranks and --peak-tflops watch a run: a resume may change them. --overwrite deletes
    an earlier run's traces with its checkpoints."""
    plain = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path)]))
    watched = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path), "--profile-steps",
                                              "2:3", "--profile-ranks", "3,0", "--peak-tflops", "989"]))
    assert (watched.profile_steps, watched.profile_ranks, watched.peak_tflops) == ((2, 3), (0, 3), 989.0)
    assert (plain.profile_steps, plain.profile_ranks, plain.peak_tflops) == (None, None, None)
    assert identity(plain, "t") == identity(watched, "t")
    claim_output_dir(plain, identity(plain, "t"), rank=0)
    saved(tmp_path / "checkpoints")
    trace = watched.profile_dir / "step2-3" / "rank0.pt.trace.json.gz"
    trace.parent.mkdir(parents=True)
    trace.write_bytes(b"an earlier trace")
    claim_output_dir(watched, identity(watched, "t"), rank=0)  # the same run, resumed: nothing deleted
    assert trace.is_file() and (tmp_path / "checkpoints" / "latest").is_file()
    overwrite = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path), "--overwrite"]))
    claim_output_dir(overwrite, identity(overwrite, "t"), rank=0)
    assert not (tmp_path / "profile").exists() and not (tmp_path / "checkpoints").exists()


def test_the_masking_is_the_runs_and_a_record_without_it_still_resumes(tmp_path, capsys):
    cfg = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path)]))
    claim_output_dir(cfg, identity(cfg, "t"), rank=0)
    record = json.loads((tmp_path / RUN_FILE).read_text())
    assert record["masking"] == [0.15, 0.8, 0.1] and record["max_predictions"] == 20
    saved(tmp_path / "checkpoints")
    for flags in (["--mlm-probability", "0.3"], ["--mask-replace-prob", "0.9", "--random-replace-prob", "0"]):
        other = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path), *flags]))
        with pytest.raises(UserError, match="holds another run's checkpoints"):
            claim_output_dir(other, identity(other, "t"), rank=0)
    older = {k: v for k, v in record.items() if k != "masking"}  # written before the masking was recorded
    (tmp_path / RUN_FILE).write_text(json.dumps(older))
    claim_output_dir(cfg, identity(cfg, "t"), rank=0)  # it masked with the defaults: resumed, and now recorded
    assert json.loads((tmp_path / RUN_FILE).read_text())["masking"] == [0.15, 0.8, 0.1]
    (tmp_path / RUN_FILE).write_text(json.dumps(older))
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        claim_output_dir(other, identity(other, "t"), rank=0)  # not with another split
