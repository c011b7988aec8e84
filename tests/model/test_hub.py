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
    from truneg.train.config.checks import effective_preset, path_problems

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

    from truneg.train.config.args import parse_args
    from truneg.train.config.checks import resolve_config

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


def test_a_checkpoint_of_a_model_type_truneg_does_not_build_is_refused_before_any_model_is_built(
        offline_hub, tmp_path, monkeypatch, capsys):
    """A GPT-2 or a T5 given as --init-from (a folder, or a cached hub name) would load into a BERT of default sizes
    with every weight missing: refused in one line naming its model_type and the accepted ones, by the checks
    before the start (pretrain.py's and `truneg preflight`'s) and by the load itself, before any model is built.
    A config without a model_type (old BERT exports) and a sentence-transformers BERT still pass."""
    import json

    from conftest import sentence_transformers_folder
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config
    from transformers.modeling_utils import PreTrainedModel

    from truneg.cluster import preflight
    from truneg.model.presets import foreign_model_problem
    from truneg.pretrain import main
    from truneg.train.config.checks import path_problems

    gpt2, t5 = tmp_path / "gpt2", hub_snapshot(offline_hub, "org/tiny-t5")
    tiny = dict(n_layer=1, n_embd=8, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(GPT2Config(**tiny)).save_pretrained(gpt2)
    T5Config(d_model=8, num_layers=1, num_heads=2, vocab_size=100).save_pretrained(t5)
    built = []
    real_init = PreTrainedModel.__init__
    monkeypatch.setattr(PreTrainedModel, "__init__", lambda self, *a, **k: (built.append(type(self).__name__),
                                                                             real_init(self, *a, **k))[1])
    accepted = "truneg continues only model_type bert, electra, roberta or xlm-roberta"
    with pytest.raises(UserError, match=rf"^--init-from {gpt2} holds a gpt2 model \(its config.json's model_type: a "
                                        rf"causal LM, not a masked one\); "
                                        rf"{accepted} \("):
        build_pretrainer(None, ObjectiveConfig(), init_from=gpt2)
    assert built == []  # not a BertForMaskedLM of default sizes, then "lacks 204 weights"

    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(model=None, init_from="org/tiny-t5", init_generator=str(gpt2),
                              output_dir=tmp_path / "run", train_data=[])
    assert [line.split(";")[0] for line in path_problems(args)] == [
        f"--init-from {t5} holds a t5 model (its config.json's model_type: a sequence-to-sequence model, not a masked "
        "LM)",
        f"--init-generator {gpt2} holds a gpt2 model (its config.json's model_type: a causal LM, not a masked one)"]
    argv = ["--init-from", str(gpt2), "--output-dir", str(tmp_path / "run")]
    capsys.readouterr()  # (save_pretrained's progress bar)
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "holds a gpt2 model" in err and accepted in err, err
    assert not (tmp_path / "run").exists() and built == []
    assert preflight.run(argv) == 2 and "holds a gpt2 model" in capsys.readouterr().err

    # an ELECTRA export whose generator/ is of another type; a BERT without model_type, and an ST encoder: accepted
    electra = tmp_path / "electra"
    (electra / "discriminator").mkdir(parents=True)
    (electra / "discriminator" / "config.json").write_text(json.dumps({"model_type": "electra"}))
    GPT2Config(**tiny).save_pretrained(electra / "generator")
    assert foreign_model_problem(electra, "--init-from").startswith(f"--init-from {electra / 'generator'} holds a gpt2")
    monkeypatch.setattr(PreTrainedModel, "__init__", real_init)
    old = tmp_path / "old-bert"
    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.save_pretrained(old)
    config = json.loads((old / "config.json").read_text())
    del config["model_type"]
    (old / "config.json").write_text(json.dumps(config))
    assert path_problems(argparse.Namespace(init_from=str(old), output_dir=tmp_path / "run2", train_data=[])) == []
    assert architecture(build_pretrainer(None, ObjectiveConfig(), init_from=old))["layers"] == 2
    sentence_transformers_folder(tmp_path / "st")
    assert foreign_model_problem(tmp_path / "st", "--init-from") is None
