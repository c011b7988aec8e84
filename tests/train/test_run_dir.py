"""The output folder's run record: what makes two invocations the same run, in one process (a world of one)."""
from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from conftest import free_port

from truneg.errors import UserError
from truneg.train.args import parse_args
from truneg.train.run_config import RunConfig
from truneg.train.run_dir import RUN_FILE, claim_output_dir, run_identity


@pytest.fixture(scope="module", autouse=True)
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def saved(checkpoints, step: int = 5) -> None:
    """A complete save, as every rank leaves it once truneg marks it (META, then `latest`)."""
    from truneg.train.checkpoint import META_FILE

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
        overwrite = RunConfig.from_args(parse_args(["--model", "bert-tiny", "--output-dir", str(tmp_path), "--overwrite"]))
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

    from truneg.train.run_dir import check_shared_output_dir

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
