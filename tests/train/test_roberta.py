"""RoBERTa-family continued pre-training: a tiny RoBERTa saved in an HF cache laid out as the hub's (offline), its
positions past a drawn `<pad>`, its head, weight decay and compile, 2 ranks at ZeRO-2 with HC and SR killed and
resumed bitwise, export and reload, `truneg eval` and fn-stats, and the refusals."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import (
    EVAL_SEQUENCES,
    MAX_STEPS,
    REPO,
    SAVE_STEPS,
    cli_in_process,
    comparable,
    deepspeed_cmd,
    free_port,
    hub_snapshot,
    killed_as_it_saves_then_resumed,
    read_metrics,
    roberta_folder,
    run,
)
from torch._dynamo.utils import counters

from truneg.data.masking import mask_tokens
from truneg.model import families
from truneg.model.compile import compile_layers
from truneg.model.pretrainers import BertPretrainer, ObjectiveConfig, build_pretrainer, parameter_groups

NAME = "test-org/roberta-tiny"  # as a user names roberta-base


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(the HF cache, the snapshot folder of NAME in it, its tokenizer)."""
    cache = tmp_path_factory.mktemp("roberta-hub")
    folder = hub_snapshot(cache, NAME)
    _, tokenizer = roberta_folder(folder)
    return cache, folder, tokenizer


def masked(tokenizer, rows: int = 2, length: int = 32, seed: int = 0) -> dict:
    """A batch of the shipped novel's text as training masks it (RoBERTa's <s> ... </s>, 80/10/10)."""
    text = (REPO / "truneg" / "assets" / "corpus" / "austen_pride_and_prejudice.txt").read_text()[5000:9000]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = length - 2
    blocks = np.array([[tokenizer.cls_token_id, *ids[i * body:(i + 1) * body], tokenizer.sep_token_id]
                       for i in range(rows)])
    return mask_tokens(blocks, tokenizer.all_special_ids, tokenizer.mask_token_id, len(tokenizer), "bert", seed, 0,
                       np.arange(rows), max_predictions=8)


def frequent_words_table(tokenizer, folder, tmp_path, words: int = 60):
    """A table of the byte-level vocab in which each of its first `words` words is a synonym of every other (a test
    table, not a thesaurus: HC then corrects often), built with `truneg synonyms build --tokenizer`."""
    found = [t[1:] for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
             if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 2][:words]
    tsv, table = tmp_path / "pairs.tsv", tmp_path / "frequent.npz"
    tsv.write_text("".join(f"{a}\t{b}\n" for a in found for b in found if a != b))
    proc = cli_in_process("synonyms", "build", "--tokenizer", str(folder), "--source", "tsv", "--tsv", str(tsv),
                          "--out", str(table))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return table


def test_a_drawn_pad_shifts_no_position_and_the_masked_head_is_hfs(hub):
    """RoBERTa counts positions past `<pad>` tokens from the ids: a `<pad>` that random replacement drew (or SR_Sent
    filled in) would shift every later position. truneg's encoding keeps the positions of the unmasked block, and
    its masked-only head gives HF's full-head loss."""
    _, folder, tokenizer = hub
    model = build_pretrainer(None, ObjectiveConfig(), folder, vocab_size=len(tokenizer)).eval()
    assert type(model.mlm).__name__ == "RobertaForMaskedLM" and model.pooler is not None
    batch = masked(tokenizer)
    ids = batch["input_ids"].clone()
    ids[:, 5] = tokenizer.pad_token_id  # a <pad> mid-block
    roberta = model.mlm.roberta
    with torch.no_grad():
        ours = families.encode(model.mlm, ids)
        own_positions = roberta.embeddings.create_position_ids_from_input_ids(batch["original_ids"], 1)
        assert torch.equal(ours, roberta(input_ids=ids, position_ids=own_positions).last_hidden_state)
        assert not torch.allclose(ours[:, 6:], roberta(input_ids=ids).last_hidden_state[:, 6:])  # HF's own: shifted
        # the masked-only head against HF's full head (labels at the masked positions, -100 elsewhere)
        labels, positions = torch.full_like(batch["original_ids"], -100), batch["masked_positions"]
        gold = batch["original_ids"].gather(1, positions)
        labels.scatter_(1, positions, torch.where(batch["masked_valid"], gold, -100))
        reference = model.mlm(input_ids=batch["input_ids"], labels=labels).loss
        loss, _ = model(**batch)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-6)


def test_the_heads_layer_norm_takes_no_weight_decay_and_layers_compile_trains_as_eager(hub):
    """RoBERTa's head names its LayerNorm `layer_norm`: no weight decay, as BERT's `LayerNorm`. --compile layers
    traces the embeddings, one graph the layers share and `lm_head` (aot_eager), and trains as eager with SR_Sent,
    whose filled-in sentence takes the same positions."""
    _, folder, tokenizer = hub
    torch.manual_seed(0)
    model = build_pretrainer(None, ObjectiveConfig(sr="sent"), folder, vocab_size=len(tokenizer))
    decay, no_decay = ({id(p) for p in group["params"]} for group in parameter_groups(model))
    names = {n: id(p) for n, p in model.named_parameters()}
    assert names["mlm.lm_head.layer_norm.weight"] in no_decay and names["mlm.lm_head.dense.weight"] in decay
    assert names["mlm.roberta.encoder.layer.0.attention.output.LayerNorm.weight"] in no_decay
    eager, compiled = model, build_pretrainer(None, ObjectiveConfig(sr="sent"), folder, vocab_size=len(tokenizer))
    compiled.load_state_dict(eager.state_dict())
    torch._dynamo.reset()
    counters.clear()
    assert compile_layers(compiled, backend="aot_eager") == 4
    batch, losses = masked(tokenizer), {}
    for name, part in (("eager", eager), ("compiled", compiled)):
        optimizer = torch.optim.AdamW(part.parameters(), lr=1e-3)
        losses[name] = []
        for step in range(2):
            torch.manual_seed(100 + step)
            loss, _ = part(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[name].append(loss.item())
    assert counters["stats"].get("unique_graphs", 0) == 3 and not counters["graph_break"]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-6, abs=0) and len(set(losses["eager"])) == 2


def test_roberta_takes_its_recipe_and_its_own_vocabulary_in_the_memory_estimate(hub):
    from truneg.eval.recipes import ROBERTA_GLUE, model_recipe
    from truneg.train.config import memory
    from truneg.train.config.args import parse_args
    from truneg.train.config.checks import memory_shape

    _, folder, _ = hub
    recipe = model_recipe(folder, "glue")
    assert (recipe.lr, recipe.batch_size, recipe.epochs, recipe.warmup_ratio, recipe.source) == (1e-5, 32, 10, 0.06,
                                                                                                ROBERTA_GLUE)
    assert memory_shape(parse_args(["--init-from", str(folder)])) == {"vocab_size": 1000, "head_only": False,
                                                                      "untied": False}
    small, large = (memory.estimate_gib("bert-base", "bf16", 512, 80, vocab_size=v) for v in (30522, 50265))
    # roberta-base's 50,265 rows: 19,743 x (768 + the head's bias) more parameters at 20 bytes, and 80 x 19,743 more
    # logits a sample
    assert large[0] - small[0] == pytest.approx(19743 * 769 * 20 / 2**30, rel=1e-9)
    assert large[1] - small[1] == pytest.approx(12 * 80 * 19743 / 2**30, rel=1e-9)


def test_two_ranks_continue_a_roberta_with_hc_and_sr_resume_bitwise_after_kill_9_and_export(hub, tmp_path,
                                                                                            launch_env, small_corpus):
    """`--init-from` a hub name of a RoBERTa, offline, its own tokenizer the default: 2 ranks at ZeRO-2 with HC (a
    table of the byte-level vocab's frequent words, so that it corrects) and word-level SR. Killed (SIGKILL, both
    ranks) as its step-16 checkpoint is written, the same command resumes and every loss and evaluation equals the
    unbroken run's. The export loads as a RobertaForMaskedLM with the run's fp32 weights, its tokenizer and the
    checkpoint's pooler, bitwise; `truneg eval` of the checkpoints gives the live evaluations, and fn-stats counts the
    export as its tag."""
    cache, folder, tokenizer = hub
    env = {**launch_env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    table = frequent_words_table(tokenizer, folder, tmp_path)

    def args(out):
        return ["--init-from", NAME, "--deepspeed_config", str(REPO / "ds_configs" / "cpu_zero2.json"),
                "--train-data", str(small_corpus), "--seq-len", "64", "--micro-batch-size", "4", "--max-steps",
                str(MAX_STEPS), "--save-steps", str(SAVE_STEPS), "--log-steps", "1", "--output-dir", str(out),
                "--hc", str(table), "--sr", "word", "--lr", "2e-3", "--eval-data", str(small_corpus),
                "--eval-max-sequences", str(EVAL_SEQUENCES)]

    reference_dir = tmp_path / "unbroken"
    run(deepspeed_cmd(*args(reference_dir), port=free_port()), env)
    record = json.loads((reference_dir / "run.json").read_text())
    assert record["tokenizer"] == NAME and record["init_revision"] == "0" * 40  # its own, as given
    assert record["architecture"]["model_type"] == "roberta" and record["architecture"]["vocab_size"] == 1000
    reference, reference_evals = (comparable(read_metrics(reference_dir, kind)) for kind in ("train", "eval"))
    assert sum(r["hc_corrected"] for r in reference) > 0 and all(r["sr_loss"] > 0 for r in reference)
    assert all(r["loss"] == pytest.approx(r["mlm_loss"] + r["sr_loss"], rel=1e-5) for r in reference)
    assert reference_evals[-1]["eval_mlm_loss"] < reference_evals[0]["eval_mlm_loss"]

    out = tmp_path / "killed"
    killed_as_it_saves_then_resumed(env, args(out), out, "global_step16", reference, reference_evals)

    from safetensors.torch import load_file
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    from truneg.train.checkpointing.export import fp32_state_dict

    assert cli_in_process("export", str(out / "checkpoints"), str(tmp_path / "hf")).returncode == 0
    exported = AutoModelForMaskedLM.from_pretrained(tmp_path / "hf")
    assert type(exported).__name__ == "RobertaForMaskedLM"
    trained = fp32_state_dict(out / "checkpoints", f"global_step{MAX_STEPS}")
    for name, value in exported.state_dict().items():
        assert torch.equal(value, trained[f"mlm.{name}"]), name
    saved, original = load_file(tmp_path / "hf" / "model.safetensors"), load_file(folder / "model.safetensors")
    assert all(torch.equal(saved[k], original[k]) for k in ("roberta.pooler.dense.weight", "roberta.pooler.dense.bias"))
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").get_vocab() == tokenizer.get_vocab()

    proc = cli_in_process("eval", str(out / "checkpoints"), "--data", str(small_corpus), "--seq-len", "64",
                          "--eval-max-sequences", str(EVAL_SEQUENCES), "--batch-size", "4",
                          "--out", str(tmp_path / "eval.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    offline = json.loads((tmp_path / "eval.json").read_text())
    assert [r.pop("checkpoint").rsplit("/", 1)[-1] for r in offline] == [f"global_step{s}" for s in (8, 16, 24)]
    assert comparable(offline) == reference_evals[1:]
    proc = cli_in_process("fn-stats", "--checkpoints", str(tmp_path / "hf"),
                          str(out / "checkpoints" / f"global_step{MAX_STEPS}"), "--data", str(small_corpus),
                          "--seq-len", "64", "--out", str(tmp_path / "fn"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = [{k: v for k, v in r.items() if k not in ("checkpoint", "step")}
              for r in json.loads((tmp_path / "fn" / "fn_stats.json").read_text())]
    assert counts[0] == counts[1] and counts[0]["masked"] > 0


def test_what_truneg_cannot_continue_or_read_with_a_roberta_is_one_line(hub, world_of_one, small_corpus, tmp_path,
                                                                       capsys, monkeypatch):
    """Each refused before anything is written: a DeBERTa-v2 (no trained MLM head in its public checkpoints), a
    table of RoBERTa's vocabulary against BERT's, another kind of tokenizer than the checkpoint's, a sequence past
    its positions, and --new-head on a RoBERTa that has its head; and a RoBERTa encoder without its head takes
    --new-head, `lm_head` started as HF initialises it."""
    from transformers import AutoConfig, RobertaModel

    from truneg.pretrain import main

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))
    _, folder, tokenizer = hub
    deberta = tmp_path / "deberta"
    deberta.mkdir()
    (deberta / "config.json").write_text(json.dumps({"model_type": "deberta-v2", "hidden_size": 64}))
    table = frequent_words_table(tokenizer, folder, tmp_path, words=3)
    out = tmp_path / "run"
    common = ["--train-data", str(small_corpus), "--seq-len", "64", "--max-steps", "1", "--output-dir", str(out)]
    cases = [
        (["--init-from", str(deberta)],
         "holds a deberta-v2 model (its config.json's model_type: its public checkpoints carry no trained MLM head)"),
        (["--model", "bert-tiny", "--hc", str(table)], "was built for vocab sha256"),
        (["--init-from", str(folder), "--tokenizer", str(REPO / "truneg" / "assets" / "vocab")],
         "is a WordPiece of 30522 tokens, and --init-from"),
        (["--init-from", str(folder), "--seq-len", "128"], "--seq-len 128 is beyond the 64 positions of --init-from"),
        (["--init-from", str(folder), "--new-head"], "has its MLM head (lm_head.*); drop --new-head"),
    ]
    for argv, expected in cases:
        with pytest.raises(SystemExit) as stopped:
            main([*common, *argv])
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.count("truneg: error: ") == 1, (expected, err)
        assert err.splitlines()[-1].startswith("truneg: error: ") and expected in err.splitlines()[-1], (expected, err)
        assert not out.exists(), expected

    # `truneg preflight` says the same before any launch
    from truneg.cluster import preflight

    assert preflight.run([*common, *cases[2][0]]) == 2 and cases[2][1] in capsys.readouterr().err
    assert preflight.run([*common, *cases[3][0]]) == 2 and cases[3][1] in capsys.readouterr().err
    # a RoBERTa saved in the older layout (vocab.json and merges.txt, no tokenizer.json): its own tokenizer still
    classic = tmp_path / "classic"
    shutil.copytree(folder, classic, ignore=lambda _, names: [n for n in names if n.startswith("tokenizer")])
    tokenizer.backend_tokenizer.model.save(str(classic))
    from truneg.data.blocks import load_tokenizer
    from truneg.train.config.args import parse_args
    from truneg.train.config.run_config import RunConfig

    cfg = RunConfig.from_args(parse_args(["--init-from", str(classic)]))
    assert cfg.tokenizer == str(classic) and load_tokenizer(cfg.tokenizer).get_vocab() == tokenizer.get_vocab()
    assert not (out.exists() or capsys.readouterr().err.count("error"))

    encoder = tmp_path / "encoder"  # a RoBERTa without its MLM head (a RobertaModel, a sentence encoder)
    torch.manual_seed(0)
    RobertaModel(AutoConfig.from_pretrained(folder)).save_pretrained(encoder)
    tokenizer.save_pretrained(encoder)
    model = build_pretrainer(None, ObjectiveConfig(), encoder, vocab_size=1000, new_head=True)
    assert isinstance(model, BertPretrainer) and model.mlm.lm_head.decoder.weight is model.word_embeddings.weight
