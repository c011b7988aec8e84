"""Checkpoints named as on the HF hub, resolved offline from an HF cache laid out as huggingface_hub's."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from conftest import hub_snapshot

from truneg.errors import UserError
from truneg.model import hub
from truneg.model.pretrainers import ObjectiveConfig, architecture, build_pretrainer

COMMIT = "a1" * 20


def test_a_hub_name_resolves_offline_to_its_cached_snapshot_and_one_that_cannot_is_one_line(offline_hub, tmp_path,
                                                                                           monkeypatch):
    from truneg.eval.glue import resolve_model_dir
    from truneg.train.checks import effective_preset, path_problems

    snapshot = hub_snapshot(offline_hub, "org/tiny-bert", COMMIT)
    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.save_pretrained(snapshot)
    found = hub.locate("org/tiny-bert", "--init-from")
    assert (found.path, found.revision, found.is_hub) == (snapshot, COMMIT, True)
    assert hub.locate(f"org/tiny-bert@{COMMIT}", "--init-from").path == snapshot  # a commit as the revision
    assert architecture(build_pretrainer(None, ObjectiveConfig(), init_from=found.path))["layers"] == 2
    # before any download: the checks read the cached config (the preset it matches), and a name is not a path
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(model=None, init_from="org/tiny-bert", output_dir=tmp_path / "run", train_data=[])
    assert effective_preset(args) == "bert-tiny" and path_problems(args) == []
    assert resolve_model_dir("org/tiny-bert") == snapshot  # finetune's and robustness' --model
    # a folder stays a folder, even one whose name could be a hub name
    (tmp_path / "org" / "tiny-bert").mkdir(parents=True)
    assert hub.locate("org/tiny-bert", "--init-from") == hub.Checkpoint("org/tiny-bert", Path("org/tiny-bert"))

    offline = "HF_HUB_OFFLINE is set but the HF cache"
    for spec in ("org/absent", "org/tiny-bert@v2", "bert-base-uncased"):
        with pytest.raises(UserError, match=offline):
            hub.locate(spec, "--init-from")
        assert offline in hub.problem(spec, "--init-from")
    assert "nor a model name of the HF hub" in hub.problem("runs/x/hf", "--init-from")  # two slashes: a path
    assert hub.problem("org/tiny-bert", "--init-from") is None
    # a cached config without the weights (an AutoConfig.from_pretrained left only that): one line, not a traceback
    bare = hub_snapshot(offline_hub, "org/config-only")
    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.config.save_pretrained(bare)
    with pytest.raises(UserError, match="without its weights"):
        hub.locate("org/config-only", "--model")


def test_a_gpu_recipe_follows_the_size_of_a_hub_name_not_downloaded_yet(offline_hub, tmp_path, monkeypatch):
    """Online, a name not in the cache yet has its config fetched (not its weights) before the recipe is chosen:
    the first start must not take another size's recipe (its micro-batch) than a resume, once it is cached."""
    from huggingface_hub import constants

    from truneg.train.args import parse_args
    from truneg.train.checks import resolve_config

    mlm = build_pretrainer("bert-tiny", ObjectiveConfig()).mlm
    fetched = []

    def hf_hub_download(name, filename, revision=None):  # the hub: the config alone, into the cache's layout
        fetched.append((name, filename, revision))
        mlm.config.save_pretrained(hub_snapshot(offline_hub, name, COMMIT))
        return str(hub_snapshot(offline_hub, name, COMMIT) / filename)

    monkeypatch.setattr(hub, "hf_hub_download", hf_hub_download)
    args = parse_args(["--init-from", "org/new-bert", "--output-dir", str(tmp_path / "run")])
    # nor is a name not cached yet taken for the default preset's ELECTRA by the flags' checks
    assert parse_args(["--init-from", "org/new-bert", "--sr", "sent", "--sr-sent-target", "original"])
    resolve_config(args, 1, capability=None, memory_gib=None)
    assert fetched == []  # the CPU's config is one for every size, and offline nothing is fetched
    assert "default for this checkpoint" in resolve_config(args, 1, capability=(8, 0), memory_gib=None)[1][0]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    line = resolve_config(args, 1, capability=(8, 0), memory_gib=None)[1][0]
    assert fetched == [("org/new-bert", "config.json", None)] and "default for bert-tiny continued" in line, line
    assert hub.folder_or_cached("org/new-bert") == hub_snapshot(offline_hub, "org/new-bert", COMMIT)


def test_pretrain_and_preflight_stop_on_a_name_they_cannot_resolve_offline_in_one_line(offline_hub, tmp_path, capsys):
    from truneg.cluster import preflight
    from truneg.pretrain import main

    argv = ["--init-from", "google/electra-base-discriminator", "--output-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "HF_HUB_OFFLINE is set" in err, err
    assert not (tmp_path / "run").exists()
    assert preflight.run(argv) == 2 and "HF_HUB_OFFLINE is set" in capsys.readouterr().err


def test_a_download_cut_off_after_the_hubs_retries_is_one_line(offline_hub, monkeypatch):
    """huggingface_hub lets its HTTP client's errors (httpx's) through once its retries are spent: finetune's --model,
    resolved outside any collective, says so in one line too."""
    from huggingface_hub import constants

    class ReadTimeout(Exception):
        pass

    ReadTimeout.__module__ = "httpx2"

    def cut(*args, **kwargs):
        raise ReadTimeout("The read operation timed out")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "snapshot_download", cut)
    with pytest.raises(UserError, match=r"org/big-bert: cannot download it from the HF hub \(ReadTimeout: The read"):
        hub.locate("org/big-bert", "--model")
    monkeypatch.setattr(hub, "snapshot_download", lambda *a, **k: 1 / 0)  # a bug stays a traceback
    with pytest.raises(ZeroDivisionError):
        hub.locate("org/big-bert", "--model")
