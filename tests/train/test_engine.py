"""Real 2-rank deepspeed launches: training, metrics, tensorboard, exact resume from a mid-run checkpoint, export."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (
    EVAL_SEQUENCES,
    MAX_STEPS,
    REPO,
    SAVE_STEPS,
    assert_resumed_as_the_reference,
    cli_in_process,
    comparable,
    deepspeed_cmd,
    free_port,
    hub_snapshot,
    mid_run_copy,
    read_metrics,
    resume_and_match,
    run,
    train_args,
)


def test_two_rank_launch_trains_logs_and_checkpoints(runs, tmp_path, small_corpus):
    out, proc = runs("electra-zero2")
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    for key in ("loss", "gen_loss", "disc_loss", "sr_loss", "lr", "samples_per_sec", "tokens_per_sec",
                "hc_iter_ratio", "hc_pred_ratio", "hc_corrected", "disc_accuracy", "mlm_accuracy",
                "mlm_argmax_accuracy", "mlm_sampled_accuracy", "nonfinite_steps", "skipped_steps", "hc_reach"):
        assert key in records[-1], key
    for r in records:  # ELECTRA's objective: the generator's MLM loss, 50 x the discriminator's, + SR (weight 1)
        assert r["loss"] == pytest.approx(r["gen_loss"] + 50 * r["disc_loss"] + r["sr_loss"], rel=1e-5), r
    for r in read_metrics(runs("bert-zero2")[0]):  # BERT's: MLM + SR
        assert r["loss"] == pytest.approx(r["mlm_loss"] + r["sr_loss"], rel=1e-5), r
    assert all(r["sr_loss"] > 0 for r in records)
    assert all(0 <= r["hc_iter_ratio"] <= 1 and 0 <= r["hc_pred_ratio"] <= 1 for r in records)
    assert all(0.05 < r["hc_reach"] < 0.6 for r in records)  # WordNet judges some masked words, not most pieces
    first, last = sum(r["loss"] for r in records[:4]) / 4, sum(r["loss"] for r in records[-4:]) / 4
    assert last < first * 0.9, (first, last)
    assert records[-1]["samples"] == MAX_STEPS * 4 * 2  # two ranks really trained
    tags = sorted(p.name for p in (out / "checkpoints").iterdir())
    # --keep-checkpoints 2: global_step8 went once global_step24 was complete
    assert tags == ["global_step16", "global_step24", "hf_config", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    shards = sorted(p.name for p in (out / "checkpoints" / "global_step24").iterdir())
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shards and "truneg_rank00001.pt" in shards
    for rank in range(2):  # truneg's own files, as a run writes them, pass torch's safe unpickler
        state = torch.load(out / "checkpoints" / "global_step24" / f"truneg_rank0000{rank}.pt", weights_only=True)
        assert set(state) >= {"rng", "metrics"}, set(state)
    assert "tensorboard --logdir" in proc.stdout
    # the console line: step out of the total, loss, lr, samples/s, ETA, and HC's ratios
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"step {MAX_STEPS}/{MAX_STEPS} "))
    for field in ("loss ", "lr ", "samples/s", "ETA ", "hc_iter_ratio ", "hc_pred_ratio "):
        assert field in line, line

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    loss_events = events.Scalars("Train/Samples/loss")
    assert [e.step for e in loss_events] == [r["samples"] for r in records]
    assert [round(e.value, 4) for e in loss_events] == [round(r["loss"], 4) for r in records]
    assert "Train/Samples/hc_iter_ratio" in events.Tags()["scalars"]

    # the held-out evaluations: at step 0, at each save and the last step, records of their own (no `loss`), the
    # official ELECTRA's eight under truneg's names and the live Table 2; `Eval/...` against samples; one line each
    evals = read_metrics(out, "eval")
    assert [(r["step"], r["samples"]) for r in evals] == [(s, s * 8) for s in range(0, MAX_STEPS + 1, SAVE_STEPS)]
    for r in evals:
        assert "loss" not in r and set(r) == {"step", "samples", "eval_mlm_loss", "eval_mlm_accuracy",
                                              "eval_mlm_sampled_accuracy", "eval_disc_loss", "eval_disc_auc",
                                              "eval_disc_accuracy", "eval_disc_precision", "eval_disc_recall",
                                              "eval_hc_iter_ratio", "eval_hc_pred_ratio", "eval_sequences",
                                              "eval_masked", "eval_mismatched", "eval_disc_replaced",
                                              "eval_disc_tokens", "eval_synonym_table", "eval_seconds"}, r
        # the AUC's positives and tokens: every token of the sequences, some of them replaced
        assert r["eval_disc_tokens"] == EVAL_SEQUENCES * 64 and 0 < r["eval_disc_replaced"] < r["eval_disc_tokens"]
        assert r["eval_synonym_table"].startswith("wordnet ")  # no --eval-synonyms: WordNet's, whatever --hc is
        assert r["eval_sequences"] == EVAL_SEQUENCES and 0 <= r["eval_disc_auc"] <= 1 and r["eval_seconds"] > 0
    assert evals[-1]["eval_mlm_loss"] < evals[0]["eval_mlm_loss"] and evals[-1]["eval_disc_auc"] > 0.5
    auc = events.Scalars("Eval/disc_auc")
    assert [(e.step, round(e.value, 6)) for e in auc] == [(r["samples"], round(r["eval_disc_auc"], 6)) for r in evals]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"eval step {MAX_STEPS} "))
    assert f"disc_auc {evals[-1]['eval_disc_auc']:.4f}" in line, line
    # `truneg eval` of the checkpoints folder (its two tags) in one process: the 2-rank run's records, exactly. The
    # same kernels (fp32, ZeRO-2 leaves F.linear alone) and the same shapes (--batch-size the run's micro-batch): a
    # row's figures depend on its own inputs only, whichever rank or batch it sits in
    proc = cli_in_process("eval", str(out / "checkpoints"), "--data", str(small_corpus), "--seq-len", "64",
                          "--eval-max-sequences", str(EVAL_SEQUENCES), "--batch-size", "4",
                          "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = json.loads((tmp_path / "eval.json").read_text())
    assert [r.pop("checkpoint").rsplit("/", 1)[-1] for r in offline] == ["global_step16", f"global_step{MAX_STEPS}"]
    assert comparable(offline) == comparable(evals[-2:])


def test_no_file_a_run_writes_pickles_a_class_of_truneg(runs):
    """truneg's rank files hold plain types (loaded with weights_only=True), and DeepSpeed's files no class of truneg's:
    moving truneg's modules can never break the resume of an older checkpoint. (ZeRO-2 BERT, ZeRO-3 ELECTRA.)"""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    for case in ("bert-zero2", "electra-zero3"):
        files = sorted((runs(case)[0] / "checkpoints").rglob("*.pt"))
        assert len(files) >= 10 and any(f.name.startswith("truneg_rank") for f in files), case
        found = {f"{f.parent.name}/{f.name}": g for f in files for g in get_unsafe_globals_in_checkpoint(f)
                 if g.startswith("truneg")}
        assert found == {}, case


def test_a_baseline_and_an_hc_run_from_the_same_weights_and_seed_evaluate_alike_at_step_0(runs):
    """bert-zero2 trains with HC and SR, bert-deterministic is its baseline (neither, no dropout), from the same weights
    and seed: their step-0 evaluations are the same, false-negative ratios included (both count with the one eval
    table, WordNet's); training then parts them. bert-zero3 (ZeRO-3, HC and Table 2 live by another table): the same
    MLM figures up to what two kernels can change."""
    hc, baseline, zero3 = (comparable(read_metrics(runs(case)[0], "eval"))
                           for case in ("bert-zero2", "bert-deterministic", "bert-zero3"))
    assert hc[0] == baseline[0] and hc[0]["step"] == 0 and hc[1] != baseline[1]
    assert zero3[0]["eval_synonym_table"] != hc[0]["eval_synonym_table"]  # its --eval-synonyms, recorded
    # ZeRO-3 replaces F.linear in its processes (matmul, then the bias added: two roundings where addmm has one), so
    # the figures are two kernels': the masks are data (exact); the loss within fp32 rounding (a logit moves by a few
    # ulps per layer, a position's cross-entropy by at most twice its largest logit's move: 1e-5 relative bounds
    # that with a wide margin); the accuracy by at most 2 argmax flips (a flip needs the top two logits within those
    # ulps: about 1e-4 of this model's positions, 0.1 expected of its ~900)
    assert zero3[0]["eval_masked"] == hc[0]["eval_masked"]
    assert zero3[0]["eval_mlm_loss"] == pytest.approx(hc[0]["eval_mlm_loss"], rel=1e-5)
    assert zero3[0]["eval_perplexity"] == pytest.approx(hc[0]["eval_perplexity"], rel=1e-4)
    assert abs(zero3[0]["eval_mlm_accuracy"] - hc[0]["eval_mlm_accuracy"]) * hc[0]["eval_masked"] <= 2 + 1e-9


@pytest.mark.parametrize("case", ["bert-zero3", "electra-zero3"])
def test_resume_from_a_mid_run_checkpoint_gives_bitwise_equal_losses(case, runs, tmp_path, launch_env, small_corpus,
                                                                     frequent_table):
    """The reference run's folder as it stood at its step-16 checkpoint, resumed: the records it had after that
    step are dropped, and steps 17-24 come out bitwise equal to the uninterrupted run's, HC's corrections
    included. (BERT at ZeRO-2, with masking in a DataLoader worker, is resumed so by two processes started as
    mpirun starts them: test_distributed.) BERT resumes with --activation-checkpointing, which is not the run's
    identity and changes no bit: ZeRO-3's hooks gather each module's weights around HF's checkpointed `forward`, in
    the recompute too."""
    reference_dir, _ = runs(case)
    reference = comparable(read_metrics(reference_dir))
    reference_evals = comparable(read_metrics(reference_dir, "eval"))
    out = tmp_path / "run"
    resumed_from = mid_run_copy(reference_dir, out)
    # HC is live in these runs (their table corrects frequent words), in the steps trained again too: the resume
    # must give the same corrections
    assert sum(r["hc_corrected"] for r in reference if r["step"] > resumed_from) > 0, reference
    assert all(0 <= r["hc_iter_ratio"] <= 1 and 0 <= r["hc_pred_ratio"] <= 1 for r in reference)
    checkpointing = ["--activation-checkpointing"] if case == "bert-zero3" else []
    resume_and_match(train_args(case, out, small_corpus, frequent_table) + checkpointing, out, resumed_from, reference,
                     launch_env, reference_evals)


def test_a_run_trains_the_same_without_eval_data(runs, tmp_path, launch_env, small_corpus):
    """The held-out evaluation changes nothing of training (no RNG draw, no weight, no metric sum): bert-zero2 (dropout
    on, so any RNG the eval took would show) resumed at step 16 without --eval-data trains steps 17-24 bitwise as the
    run that evaluated at steps 16 and 24."""
    reference_dir, _ = runs("bert-zero2")
    reference = comparable(read_metrics(reference_dir))
    out = tmp_path / "run"
    resumed_from = mid_run_copy(reference_dir, out)
    proc = run(deepspeed_cmd(*train_args("bert-zero2", out, small_corpus, evaluate=False), port=free_port()),
               launch_env)
    assert_resumed_as_the_reference(proc.stdout, out, resumed_from, reference)
    assert [r["step"] for r in read_metrics(out, "eval")] == [0, 8, 16]  # the reference's, none of this process


def test_export_round_trip_bert(runs, tmp_path):
    from transformers import BertForMaskedLM

    out, _ = runs("bert-zero2")
    exported = tmp_path / "hf"
    proc = cli_in_process("export", str(out / "checkpoints"), str(exported))
    assert proc.returncode == 0, proc.stderr
    model = BertForMaskedLM.from_pretrained(exported)
    engine_weights = torch.load(out / "checkpoints" / "global_step24" / "mp_rank_00_model_states.pt",
                                weights_only=False)["module"]
    state = model.state_dict()
    compared = 0
    for key, value in engine_weights.items():
        assert key.startswith("mlm.")
        assert torch.equal(state[key[len("mlm."):]], value.float()), key
        compared += 1
    assert compared > 20
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(exported)) == 30522 and (exported / "vocab.txt").is_file()


def test_export_writes_the_runs_own_tokenizer(runs, tmp_path):
    """The tokenizer saved beside the run's configs, not bert-base-uncased's, goes with the weights."""

    from transformers import AutoTokenizer

    from truneg.train.checkpointing.export import TOKENIZER_DIR, export

    out, _ = runs("bert-zero2")
    copy = tmp_path / "checkpoints"
    shutil.copytree(out / "checkpoints", copy)
    saved = copy / "hf_config" / TOKENIZER_DIR
    assert (saved / "vocab.txt").read_text() == (REPO / "truneg" / "assets" / "vocab" / "vocab.txt").read_text()
    vocab = (saved / "vocab.txt").read_text().splitlines()
    vocab[2000], vocab[2001] = vocab[2001], vocab[2000]  # another vocab of the same size
    (saved / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (saved / "tokenizer.json").unlink()
    written = export(copy, tmp_path / "hf")
    exported = AutoTokenizer.from_pretrained(written["mlm"])
    assert exported.convert_ids_to_tokens([2000, 2001]) == [vocab[2000], vocab[2001]]
    # an out_dir that is a file: one line (save_pretrained only logs it, and the copy of the vocab raised)
    from truneg.errors import UserError

    (tmp_path / "afile").write_text("keep me")
    with pytest.raises(UserError, match="is a file; pass a folder"):
        export(copy, tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_export_round_trip_electra_zero3(runs, tmp_path, small_corpus, frequent_table, monkeypatch):
    from transformers import ElectraForMaskedLM, ElectraForPreTraining

    from truneg.train.checkpointing.export import export

    out, _ = runs("electra-zero3")
    written = export(out / "checkpoints", tmp_path / "hf")
    generator = ElectraForMaskedLM.from_pretrained(written["generator"])
    discriminator = ElectraForPreTraining.from_pretrained(written["discriminator"])
    # The checkpoint's own consolidation (DeepSpeed's checkpoint-folder script) is the reference.
    script = out / "checkpoints" / "zero_to_fp32.py"
    subprocess.run([sys.executable, str(script), str(out / "checkpoints"), str(tmp_path / "fp32")], check=True,
                   capture_output=True, cwd=tmp_path)
    reference = torch.load(next((tmp_path / "fp32").glob("*.bin")), weights_only=False)
    models = {"generator": generator, "discriminator": discriminator}
    for key, value in reference.items():
        part, _, name = key.partition(".")
        assert torch.equal(models[part].state_dict()[name], value), key
    # and no exported weight is one from_pretrained made up: every one was compared (tied ones too)
    for part, model in models.items():
        assert set(model.state_dict()) == {k.partition(".")[2] for k in reference if k.startswith(part + ".")}, part
    shared = "electra.embeddings.word_embeddings.weight"
    assert torch.equal(generator.state_dict()[shared], discriminator.state_dict()[shared])
    assert torch.equal(generator.generator_lm_head.weight, generator.electra.embeddings.word_embeddings.weight)

    # `truneg eval` of the exported folder (one process): the ZeRO-3 run's own evaluation of step 24 on 2 ranks,
    # every figure exactly. Its kernels: ZeRO-3 replaced F.linear in the run's processes by DeepSpeed's function
    # (matmul, then the bias added), which rounds otherwise than F.linear's addmm, and a last-bit change of a score
    # moves a rank statistic (the AUC) by whole pairs; this process takes the same function. Its shapes: the run's
    # micro-batch (a row's figures depend on its own inputs only). Its table: the run's --eval-synonyms, which the
    # exported folder lacks: given.
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    proc = cli_in_process("eval", str(tmp_path / "hf"), "--data", str(small_corpus), "--seq-len", "64",
                          "--eval-max-sequences", str(EVAL_SEQUENCES), "--synonyms", str(frequent_table),
                          "--batch-size", "4", "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    [offline] = json.loads((tmp_path / "eval.json").read_text())
    live = comparable(read_metrics(out, "eval"))[-1]
    assert (offline.pop("checkpoint"), offline.pop("step"), live.pop("samples")) == (str(tmp_path / "hf"), -1, 192)
    live.pop("step")
    [offline] = comparable([offline])
    assert offline == live and live["eval_hc_pred_ratio"] > 0 and live["eval_disc_auc"] > 0.5
    assert (out / "checkpoints" / "hf_config" / "eval_synonyms.npz").is_file()


def test_export_reads_the_bf16_recipes_checkpoints(tmp_path, launch_env, small_corpus):
    """The bf16 recipes (bf16 at ZeRO-1, fp32 gradient accumulation) run DeepSpeed's BF16_Optimizer, whose
    partitions zero_to_fp32 does not read. The exported weights are its fp32 masters: the same as DeepSpeed's
    ds_to_universal takes out of them, and the bf16 weights the model ran with, rounded."""
    from transformers import ElectraForMaskedLM, ElectraForPreTraining

    from truneg.train.checkpointing.checkpoint import convert_to_universal
    from truneg.train.checkpointing.export import export

    config = json.loads((REPO / "ds_configs" / "electra_small_a100_bf16_zero1.json").read_text())
    cpu = json.loads((REPO / "ds_configs" / "cpu_zero2.json").read_text())
    config.update(optimizer=cpu["optimizer"], scheduler=cpu["scheduler"])  # torch's AdamW: no GPU build here
    (tmp_path / "bf16.json").write_text(json.dumps(config))
    out = tmp_path / "bf16"
    run(deepspeed_cmd(*train_args("electra-zero2", out, small_corpus), "--deepspeed_config",
                      str(tmp_path / "bf16.json"),
                      "--max-steps", "4", "--save-steps", "4", "--micro-batch-size", "2", port=free_port()), launch_env)
    checkpoints = out / "checkpoints"
    assert len(list((checkpoints / "global_step4").glob("bf16_zero_pp_rank_*_optim_states.pt"))) == 2
    written = export(checkpoints, tmp_path / "hf")
    models = {"generator": ElectraForMaskedLM.from_pretrained(written["generator"]).state_dict(),
              "discriminator": ElectraForPreTraining.from_pretrained(written["discriminator"]).state_dict()}
    universal = convert_to_universal(checkpoints, "global_step4") / "zero"
    states = torch.load(checkpoints / "global_step4" / "mp_rank_00_model_states.pt", weights_only=False)

    def exported(name: str) -> torch.Tensor:
        part, _, key = name.partition(".")
        return models[part][key]

    optimized = [name for group in states["param_shapes"] for name in group]
    for name in optimized:
        assert torch.equal(exported(name), torch.load(universal / name / "fp32.pt", weights_only=False)["param"]), name
    for name in [*optimized, *states["shared_params"]]:  # all of it, tied weights too: what the model ran with
        assert torch.equal(exported(name).bfloat16(), states["module"][name]), name
    # tied: the generator's embeddings are the discriminator's, and its LM head's weight is the word embeddings
    assert len(optimized) > 20 and len(states["shared_params"]) == 6
    for name, source in states["shared_params"].items():
        assert torch.equal(exported(name), exported(source)), name


def test_every_ds_config_is_valid_for_deepspeed():
    from deepspeed.runtime.config import DeepSpeedConfig

    from truneg.train.config.ds_config import resolve

    configs = sorted((REPO / "ds_configs").glob("*.json"))
    assert len(configs) >= 6
    for path in configs:
        config = DeepSpeedConfig(resolve(path, 1, 1000, Path("/tmp/unused"))[0])
        raw = json.loads(path.read_text())
        assert config.train_batch_size == config.train_micro_batch_size_per_gpu * config.gradient_accumulation_steps
        stage = config.zero_optimization_stage
        assert path.stem.endswith(f"zero{stage}")  # the file name says its ZeRO stage
        if "v100" in path.name:
            assert config.float16_config.enabled and config.float16_config.loss_scale == 0  # dynamic scaling
            # LAMB only unpartitioned (ZeRO-0): DeepSpeed's ZeRO does not support FusedLamb
            assert (raw["optimizer"]["type"], stage) in (("Lamb", 0), ("AdamW", 2))
        if "bf16" in path.name:  # ZeRO-1 by default, ZeRO-3 kept for who needs it; fp32 gradient accumulation
            assert config.bfloat16_config.enabled and stage in (1, 3) and config.grad_accum_dtype == "fp32"
        if path.name.startswith("cpu"):
            assert raw["optimizer"]["params"]["torch_adam"] is True
        assert config.gradient_clipping > 0 and raw["scheduler"]["params"]["total_num_steps"] == "auto"


def test_continued_pretraining_from_a_hub_name_keeps_the_pooler_into_the_export(runs, tmp_path, launch_env,
                                                                                 small_corpus, offline_hub):
    """An exported run, saved as BertForPreTraining weights (MLM head and pooler, as a public BERT) into an HF cache
    laid out as the hub's, continues from its hub name offline; run.json keeps the name and the commit, and the
    pooler comes out of training into the export bitwise as loaded, where fine-tuning starts from it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, BertForPreTraining

    from truneg.eval.glue import resolve_model_dir
    from truneg.model.presets import load_pretrained
    from truneg.train.checkpointing.export import export

    out, _ = runs("bert-zero2")
    exported = tmp_path / "hf"
    export(out / "checkpoints", exported)
    public = BertForPreTraining.from_pretrained(exported)  # the pooler (absent there) starts random: any weights do
    public.save_pretrained(hub_snapshot(offline_hub, "org/tiny-bert", "e0" * 20))
    continued = tmp_path / "continued"
    # (three steps: the warmup's rate is 0 at the first two)
    run(deepspeed_cmd(*train_args("bert-zero2", continued, small_corpus), "--max-steps", "3", "--init-from",
                      "org/tiny-bert", num_gpus=1, port=free_port()),
        {**launch_env, "HF_HUB_CACHE": str(offline_hub), "HF_HUB_OFFLINE": "1"})
    fresh_first, trained_last = read_metrics(out)[0]["mlm_loss"], read_metrics(out)[-1]["mlm_loss"]
    first = read_metrics(continued)[0]["mlm_loss"]
    assert first < fresh_first - 1.0 and abs(first - trained_last) < 1.0, (fresh_first, trained_last, first)
    record = json.loads((continued / "run.json").read_text())
    assert (record["init_from"], record["init_revision"]) == ("org/tiny-bert", "e0" * 20)

    again = export(continued / "checkpoints", tmp_path / "hf-continued")["mlm"]
    weights, loaded = load_file(again / "model.safetensors"), public.state_dict()
    assert not torch.equal(weights["bert.encoder.layer.0.output.dense.weight"],
                           loaded["bert.encoder.layer.0.output.dense.weight"])  # trained, weight decay too
    for key in ("bert.pooler.dense.weight", "bert.pooler.dense.bias"):
        assert weights[key].dtype == torch.float32 and torch.equal(weights[key], loaded[key]), key
    classifier = load_pretrained(AutoModelForSequenceClassification, resolve_model_dir(again), "--model", num_labels=2)
    assert torch.equal(classifier.bert.pooler.dense.weight, loaded["bert.pooler.dense.weight"])  # finetune's start
