"""The MLM head's own stage (`--train-only head`) and the untied decoder (`--untie-decoder`): the encoder frozen at
ZeRO-1, 2 and 3 and in a bf16 recipe (bitwise unchanged, no optimizer state), the export of a frozen run, the next
stage from exactly its weights, a 2-rank run killed and resumed bitwise, the FLOPs and memory it counts, and its
refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    MAX_STEPS,
    REPO,
    SAVE_STEPS,
    comparable,
    free_port,
    killed_as_it_saves_then_resumed,
    read_metrics,
    started_as_mpirun,
)
from safetensors.torch import load_file
from transformers import BertConfig, BertForMaskedLM

from truneg.model.presets import BERT_PRESETS, common_config


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny BertForMaskedLM to continue (bert-tiny's sizes, the shipped vocab), saved as a hub model is."""
    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    BertForMaskedLM(BertConfig(**BERT_PRESETS["bert-tiny"], **common_config())).save_pretrained(folder)
    return folder


def config(folder: Path, stage: int, bf16: bool = False) -> Path:
    """cpu_zero2.json at another ZeRO stage; `bf16`: the bf16 recipes' precision (BF16_Optimizer at ZeRO-1, fp32
    gradient accumulation)."""
    written = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    written["zero_optimization"]["stage"] = stage
    if bf16:
        written.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    path = folder / f"zero{stage}{'_bf16' if bf16 else ''}.json"
    path.write_text(json.dumps(written))
    return path


def stage_args(init: Path, out: Path, corpus: Path, ds_config: Path, *extra: str, steps: int = 3) -> list[str]:
    return ["--init-from", str(init), "--deepspeed_config", str(ds_config), "--train-data", str(corpus),
            "--seq-len", "64", "--micro-batch-size", "4", "--max-steps", str(steps), "--save-steps", str(steps),
            "--output-dir", str(out), "--lr", "1e-2", *extra]


HEAD = ("cls.predictions.",)


@pytest.mark.parametrize("stage, bf16, untie", [(1, False, False), (2, False, True), (3, False, False),
                                                (1, True, True)])
def test_the_head_stage_trains_the_head_alone_and_exports_the_frozen_encoder_bitwise(
        checkpoint, world_of_one, small_corpus, tmp_path, monkeypatch, capsys, stage, bf16, untie):
    """Three steps of the head alone (the warmup's first two at lr 0): DeepSpeed's optimizer holds the head's
    parameters and no other (the checkpoint's `param_shapes`), the export loads as a BertForMaskedLM whose encoder and
    word embeddings are the checkpoint's bitwise (the frozen file's fp32 values, which zero_to_fp32 omits at ZeRO-1 and
    BF16_Optimizer never holds) and whose head moved; an untied decoder is exported untied, with one bias, and the
    next stage starts from exactly the export's weights. At ZeRO-1 the same folder without the flag is another run."""
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
    from truneg.pretrain import main
    from truneg.train.checkpointing.export import export

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    # ZeRO-3 replaces F.linear for the rest of the process ("unless manually reset"): put back after this test
    monkeypatch.setattr(torch.nn.functional, "linear", torch.nn.functional.linear)
    out = tmp_path / "head"
    argv = stage_args(checkpoint, out, small_corpus, config(tmp_path, stage, bf16), "--train-only", "head",
                      *(["--untie-decoder"] if untie else []))
    main(argv)
    tag = out / "checkpoints" / "global_step3"
    states = sorted(tag.glob("*model_states.pt"))[0]
    optimized = {name for group in torch.load(states, weights_only=False)["param_shapes"] for name in group}
    trained = {"mlm.cls.predictions.bias", "mlm.cls.predictions.transform.dense.weight",
               "mlm.cls.predictions.transform.dense.bias", "mlm.cls.predictions.transform.LayerNorm.weight",
               "mlm.cls.predictions.transform.LayerNorm.bias"} | ({"mlm.cls.predictions.decoder.weight"} if untie
                                                                   else set())
    assert optimized == trained
    written = export(out / "checkpoints", tmp_path / "hf")["mlm"]
    exported = BertForMaskedLM.from_pretrained(written).state_dict()
    original = load_file(checkpoint / "model.safetensors")
    for name, value in original.items():
        if name.startswith(HEAD) and not name.endswith("decoder.weight"):  # the tied decoder is the embeddings'
            assert not torch.equal(exported[name], value), name
        else:
            assert torch.equal(exported[name], value), name
    file = load_file(written / "model.safetensors")
    assert json.loads((written / "config.json").read_text()).get("tie_word_embeddings", True) is (not untie)
    if untie:  # its own decoder, moved from its copy of the embeddings; both bias keys, one value
        embeddings = original["bert.embeddings.word_embeddings.weight"]
        assert not torch.equal(file["cls.predictions.decoder.weight"], embeddings)
        assert torch.equal(file["cls.predictions.decoder.bias"], file["cls.predictions.bias"])
    following = build_pretrainer(None, ObjectiveConfig(), written)
    for name, value in following.mlm.state_dict().items():
        assert torch.equal(value, exported[name]), name
    if untie:
        owner = following.mlm.cls.predictions
        assert owner.decoder.bias is owner.bias and owner.decoder.weight is not following.word_embeddings.weight
    if stage == 1 and not bf16:  # the flag is the run's: the same folder without it is another run, in one line
        with pytest.raises(SystemExit) as stopped:
            main([a for a in argv if a not in ("--train-only", "head")])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("truneg: error: ") == 1, err
        assert "holds another run's checkpoints" in err and "(its run.json differs in train_only)" in err, err


def test_a_killed_head_stage_resumes_bitwise(checkpoint, tmp_path, launch_env, small_corpus):
    """2 ranks at ZeRO-2, started as mpirun starts them (no launcher to pay for): the head stage killed (SIGKILL,
    both ranks) as its step-16 checkpoint is written, the same command resumes and every loss equals the unbroken
    run's, the frozen encoder loaded back with the rest."""
    def args(out):
        return [*stage_args(checkpoint, out, small_corpus, REPO / "ds_configs" / "cpu_zero2.json", "--train-only",
                            "head", steps=MAX_STEPS), "--save-steps", str(SAVE_STEPS), "--log-steps", "1"]

    reference_dir = tmp_path / "unbroken"
    codes, _ = started_as_mpirun(launch_env, free_port(), [args(reference_dir)] * 2)
    assert codes == [0, 0]
    reference = comparable(read_metrics(reference_dir))
    assert reference[-1]["loss"] < reference[2]["loss"] and all(r["hc_reach"] > 0 for r in reference)
    out = tmp_path / "killed"
    killed_as_it_saves_then_resumed(launch_env, args(out), out, "global_step16", reference)


def test_the_frozen_encoder_runs_without_dropout_and_counts_no_backward_nor_optimizer_state(checkpoint):
    """The head stage's encoder stays in eval mode whatever train() the run or its evaluation calls (its config keeps
    its dropout); the FLOPs count its forward alone and the head's forward and backward; the memory estimate holds
    the head's optimizer states and the frozen weights alone, and no encoder activations for a backward."""
    from truneg.train.build import build_model
    from truneg.train.config.args import parse_args
    from truneg.train.config.memory import ACTIVATION_BYTES, HEAD_BYTES, STATE_BYTES, estimate_gib, parameter_count
    from truneg.train.config.run_config import RunConfig
    from truneg.train.observe.flops import bert_head_flops, encoder_flops, model_sizes, model_train_flops

    cfg = RunConfig.from_args(parse_args(["--init-from", str(checkpoint), "--train-only", "head"]))
    model = build_model(cfg, None, vocab_size=30522)
    model.eval()
    model.train()
    assert not model.mlm.bert.training and model.mlm.cls.training
    assert all(not m.training for m in model.mlm.bert.modules()) and model.mlm.config.hidden_dropout_prob == 0.1
    size = model_sizes(model)["bert"]
    # the head's backward: the transform's weight gradient, the tied decoder's input gradient: 2 forwards' worth
    assert model_train_flops(model, 64, 12) == encoder_flops(size, 64) + 2 * bert_head_flops(size, 12)
    full, head = (estimate_gib("bert-base", "bf16", 128, 20, head_only=h) for h in (False, True))
    trained, total = parameter_count("bert-base", head_only=True), parameter_count("bert-base")
    assert trained == 768 * 768 + 768 + 2 * 768 + 30522  # the transform, its LayerNorm, the bias
    # an untied decoder: its 30,522 x 768 weights more, in the model and among what trains
    assert parameter_count("bert-base", untied=True) - total == 30522 * 768
    assert parameter_count("bert-base", head_only=True, untied=True) - trained == 30522 * 768
    assert head[0] == pytest.approx((trained * STATE_BYTES["bf16"] + (total - trained) * 2) / 2**30, rel=1e-12)
    # one layer's activations at a time, not twelve layers' saved; the head's logits as before
    assert head[1] == pytest.approx((ACTIVATION_BYTES * 768 * 128 + HEAD_BYTES * 20 * 30522) / 2**30, rel=1e-12)
    assert full[1] - head[1] == pytest.approx(11 * ACTIVATION_BYTES * 768 * 128 / 2**30, rel=1e-12)


@pytest.mark.parametrize("argv, expected", [
    (["--model", "electra-tiny", "--train-only", "head"], "--train-only head is for a BERT's (RoBERTa's) MLM head"),
    (["--model", "bert-tiny", "--train-only", "head", "--sr", "word"], "--sr word with --train-only head: SR reaches"),
    (["--model", "bert-tiny", "--train-only", "head", "--dropout", "0"], "--dropout with --train-only head"),
    (["--model", "electra-tiny", "--untie-decoder"], "--untie-decoder is for a BERT's (RoBERTa's) MLM head"),
    (["--model", "bert-tiny", "--train-only", "head"], "which a fresh model has not: pass --init-from"),
    (["--init-from", "x", "--train-only", "head", "--activation-checkpointing"],
     "--activation-checkpointing with --train-only head"),
    (["--init-from", "x", "--train-only", "head", "--phase1-checkpoint", "y"], "--train-only head with --phase1-chec"),
])
def test_what_the_head_stage_cannot_go_with_is_one_line(argv, expected, tmp_path, capsys):
    from truneg.pretrain import main

    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("truneg: error: ") == 1 and expected in err, err
    assert not (tmp_path / "run").exists()
