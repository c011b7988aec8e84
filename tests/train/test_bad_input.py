"""Bad input to the `truneg` sub-commands, in this process: one line that says what is wrong, exit status 2, no
traceback, and before any expensive work (a consolidation, a fine-tuning, an evaluation) is spent on it."""
from __future__ import annotations

import json
import shutil

import pytest
from conftest import MINILM, REPO, cli_in_process

ASSETS = REPO / "truneg" / "assets"


def one_line(proc, expected: str) -> None:
    """truneg's own refusal: `truneg: error: ...` as the last line, exit 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("truneg: error: ") and expected in last, last


def argparse_refusal(proc, flag: str, expected: str) -> None:
    """argparse's own: `... error: argument FLAG: ...` as the last line, exit 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    last = proc.stderr.strip().splitlines()[-1]
    assert f"error: argument {flag}: " in last and expected in last, last


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    (root / "afile.txt").write_text("a file, not a folder")
    (root / "binary").write_bytes(b"\xff\xfe\x00\x81 not text")
    (root / "bad.w2v").write_text("2 3\nhouse 0.1 0.2 0.3\nhome 0.1 x 0.3\n")
    (root / "outdir.npz").mkdir()
    qa = {"id": "q1", "question": "Who?", "answers": [{"text": "Ann", "answer_start": "0"}]}
    squad = {"data": [{"paragraphs": [{"context": "Ann came.", "qas": [qa]}]}]}
    (root / "squad_str_start.json").write_text(json.dumps(squad))
    qa = {**qa, "answers": [{"text": "Ann", "answer_start": 0}]}
    (root / "squad_ok.json").write_text(json.dumps({"data": [{"paragraphs": [{"context": "Ann came.", "qas": [qa]}]}]}))
    (root / "squad_empty.json").write_text(json.dumps({"version": "1.1", "data": []}))
    (root / "rte_empty").mkdir()
    (root / "rte_empty" / "train.tsv").write_text("")
    (root / "rte_header_only").mkdir()  # a header, no example
    (root / "rte_header_only" / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    (root / "config_only").mkdir()
    if (MINILM / "config.json").is_file():
        shutil.copy(MINILM / "config.json", root / "config_only" / "config.json")
    ck = root / "ck" / "checkpoints"  # a run's first save, cut short: a tag without its META
    (ck / "global_step1").mkdir(parents=True)
    (ck / "latest").write_text("global_step1")
    return root


def test_paths_and_files_that_cannot_be_used(files):
    tsv = files / "pairs.tsv"
    tsv.write_text("big\tlarge\n")
    vocab = str(ASSETS / "vocab")
    one_line(cli_in_process("synonyms", "build", "--vocab", vocab, "--source", "tsv", "--tsv", str(tsv), "--out",
                            str(files / "outdir.npz")), "is a folder; pass a file path")
    assert not list(files.glob("outdir.npz.tmp*"))
    one_line(cli_in_process("synonyms", "build", "--vocab", str(files / "binary"), "--source", "tsv", "--tsv", str(tsv),
                            "--out", str(files / "t.npz")), "is not UTF-8 text")
    one_line(cli_in_process("synonyms", "build", "--vocab", vocab, "--source", "embedding", "--embeddings",
                            str(files / "bad.w2v"), "--out", str(files / "t.npz")),
             "bad.w2v:3: the vector of 'home' holds a value that is not a number")
    argparse_refusal(cli_in_process("synonyms", "build", "--vocab", vocab, "--min-cosine", "5", "--out", "t.npz"),
                     "--min-cosine", "must be a finite number >= -1 and <= 1, not 5.0")
    one_line(cli_in_process("prepare", "--train-data", str(ASSETS / "corpus"), "--out", str(files / "afile.txt")),
             "--out " + str(files / "afile.txt") + " is a file; pass a folder path")
    # checked before the checkpoint is read (which is where the time goes)
    one_line(cli_in_process("export", str(files / "nowhere"), str(files / "afile.txt" / "hf")),
             f"{files / 'afile.txt'} is a file, not a folder")
    one_line(cli_in_process("fn-cases", "--checkpoint", str(files / "ck" / "checkpoints"), "--data",
                            str(ASSETS / "corpus"),
                            "--out", str(files / "cases")), "holds no complete checkpoint")
    one_line(cli_in_process("fn-stats", "--checkpoints", str(files / "ck" / "checkpoints"), "--data",
                            str(ASSETS / "corpus"), "--out", str(files / "stats")), "holds no complete checkpoint")
    assert not (files / "stats").exists()
    one_line(cli_in_process("fn-cases", "--checkpoint", str(files / "nowhere"), "--data", str(ASSETS / "corpus"),
                            "--out", str(files / "afile.txt")), "is a file; pass a folder path")
    argparse_refusal(cli_in_process("fn-stats", "--checkpoints", "x", "--data", "y", "--out", "z", "--max-sequences",
                                    "-5"),
                     "--max-sequences", "must be >= 1, not -5")
    assert (files / "afile.txt").read_text() == "a file, not a folder" and not (files / "cases").exists()


def test_every_command_refuses_an_output_path_it_cannot_make_before_any_work(files):
    """cli.main checks each command's declared output paths (`output_paths`) before the command runs: with every
    other input missing, the output path's line must still be the one printed."""
    afile, folder = str(files / "afile.txt"), str(files)
    commands = {  # each command's name: its argv with every other input missing
        "finetune glue": ["finetune", "glue", "--task", "rte", "--model", "m", "--data-dir", "d", "--output-dir", afile]
        ,
        "finetune squad": ["finetune", "squad", "--model", "m", "--train", "t", "--dev", "d", "--output-dir", afile],
        "robustness swap-syn": ["robustness", "swap-syn", "--task", "rte", "--model", "m", "--data-dir", "d",
                                "--output-dir", afile],
        "robustness add-sent": ["robustness", "add-sent", "--model", "m", "--dev", "d", "--output-dir", afile],
        "fn-stats": ["fn-stats", "--checkpoints", "c", "--data", "d", "--out", afile],
        "fn-cases": ["fn-cases", "--checkpoint", "c", "--data", "d", "--out", afile],
        "prepare": ["prepare", "--train-data", "d", "--out", afile],
    }
    for argv in commands.values():
        one_line(cli_in_process(*argv), f"{argv[-2]} {afile} is a file; pass a folder path")
        assert (files / "afile.txt").read_text() == "a file, not a folder", argv[:2]
    one_line(cli_in_process("synonyms", "build", "--vocab", "v", "--out", folder), f"--out {folder} is a folder")


def test_every_output_option_of_every_command_is_declared_for_cli_main_to_check():
    """A command added later with an --out/--output-dir that it does not declare in `output_paths` would go
    unchecked: walk every sub-command. `export` and `ablation` check theirs in their own functions (APIs too)."""
    import argparse

    from truneg.cli import build_parser

    def leaves(parser: argparse.ArgumentParser, name: str):
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            yield name, parser
        for action in subs:
            for sub_name, sub in action.choices.items():
                yield from leaves(sub, f"{name} {sub_name}".strip())

    undeclared = []
    for name, parser in leaves(build_parser(), ""):
        declared = {dest for dest, _, _ in parser.get_default("output_paths") or ()}
        outputs = {a.dest for a in parser._actions if a.dest in ("out", "output_dir", "out_dir")}
        if name not in ("export", "ablation"):
            undeclared += [f"{name}: {dest}" for dest in outputs - declared]
    assert not undeclared, undeclared


def test_a_damaged_exported_model_is_one_line(tmp_path, monkeypatch):
    """An exported MLM whose weights file was cut short (a copy that failed): fn-stats says which folder."""
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer

    monkeypatch.setenv("TRUNEG_CACHE", str(tmp_path / "cache"))  # the corpus is prepared before the model loads

    build_pretrainer("bert-tiny", ObjectiveConfig()).mlm.save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    one_line(cli_in_process("fn-stats", "--checkpoints", str(tmp_path / "hf"), "--data", str(ASSETS / "corpus"),
                            "--tokenizer", str(ASSETS / "vocab"), "--max-sequences", "4", "--out", str(tmp_path / "fn"))
                            ,
             f"checkpoint {tmp_path / 'hf'}: cannot load it")


def test_a_damaged_latest_is_one_line(tmp_path):
    from truneg.errors import UserError
    from truneg.train.checkpointing.checkpoint import latest_tag

    (tmp_path / "latest").write_bytes(b"\x80\x81\xfe")
    with pytest.raises(UserError, match="latest is damaged"):
        latest_tag(tmp_path)


@pytest.mark.skipif(not (MINILM / "config.json").is_file(), reason="`make setup` installs the MiniLM checkpoint")
def test_fine_tuning_and_robustness_refuse_bad_values_before_any_work(files):
    model, out = str(MINILM), str(files / "out")
    squad, glue = ("finetune", "squad", "--model", model), ("finetune", "glue", "--task", "rte", "--model", model)
    ok = str(files / "squad_ok.json")
    # a stride (the tokens windows share) that leaves no context: up front, or beside a long question (the
    # tokenizer would stop there, naming no flag); both from squad.check_doc_stride. 64 of 128 is a valid pair
    # (a stride is not the windows' distance)
    no_context = ("--doc-stride {} (the tokens consecutive windows share) leaves no context in a window of "
                  "--max-seq-len 128")
    one_line(cli_in_process(*squad, "--train", ok, "--dev", ok, "--output-dir", out, "--max-seq-len", "128"),
             no_context.format(128) + "; use --doc-stride below 125")
    from truneg.eval.squad import check_doc_stride

    check_doc_stride(128, 64)
    check_doc_stride(256, 128)
    long_question = files / "squad_long_question.json"
    qa = {"id": "q2", "question": "which " * 60 + "?", "answers": [{"text": "Ann", "answer_start": 0}]}
    long_question.write_text(json.dumps({"data": [{"paragraphs": [{"context": "Ann came. " * 40, "qas": [qa]}]}]}))
    one_line(cli_in_process(*squad, "--train", str(long_question), "--dev", ok, "--output-dir", out, "--max-seq-len",
                            "128", "--doc-stride", "64"),
                            no_context.format(64) + " beside the longest question (61 tokens)")
    one_line(cli_in_process(*squad, "--train", ok, "--dev", str(files / "squad_empty.json"), "--output-dir", out),
             "squad_empty.json has no question")
    one_line(cli_in_process(*squad, "--train", str(files / "squad_str_start.json"), "--dev", ok, "--output-dir", out),
             "question 'q1' is not SQuAD v1.1")
    one_line(cli_in_process("robustness", "add-sent", "--model", model, "--dev", str(files / "squad_empty.json"),
                            "--output-dir", out), "has no question")
    one_line(cli_in_process(*glue, "--data-dir", str(files / "rte_empty"), "--output-dir", out), "train.tsv is empty")
    one_line(cli_in_process(*glue, "--data-dir", str(files / "rte_empty"), "--output-dir", str(files / "afile.txt")),
             "is a file; pass a folder path")
    one_line(cli_in_process("finetune", "glue", "--task", "rte", "--model", str(files / "config_only"), "--data-dir",
                            str(files / "rte_empty"), "--output-dir", out), "has a config.json but no weights")
    for flag, value, expected in [("--lr", "-1", "must be a finite number > 0, not -1.0"),
                                  ("--max-train-samples", "0", "must be >= 1, not 0"),
                                  ("--max-seq-len", "0", "must be >= 8, not 0"),
                                  ("--layerwise-decay", "1.5", "must be a finite number > 0 and <= 1, not 1.5")]:
        argparse_refusal(cli_in_process(*glue, "--data-dir", "d", "--output-dir", out, flag, value), flag, expected)
    damaged, rte = files / "damaged_model", files / "rte_tiny"  # a weights file cut short (a copy that failed)
    shutil.copytree(MINILM, damaged)
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rte.mkdir()
    for name in ("train.tsv", "dev.tsv"):
        (rte / name).write_text("index\tsentence1\tsentence2\tlabel\n0\tA cat.\tAn animal.\tentailment\n")
    one_line(cli_in_process(*glue[:-2], "--model", str(damaged), "--data-dir", str(rte), "--output-dir", out),
             f"--model {damaged}: cannot load it")
    one_line(cli_in_process("robustness", "swap-syn", "--task", "rte", "--model", model, "--data-dir",
                            str(files / "rte_header_only"), "--output-dir", out), "dev.tsv holds no examples")
    argparse_refusal(cli_in_process("robustness", "swap-syn", "--task", "rte", "--model", model, "--data-dir", "d",
                                    "--output-dir", out, "--max-eval-samples", "0"), "--max-eval-samples",
                                    "must be >= 1, not 0")
    # swap-syn takes SQuAD (--task squad --dev) or a GLUE task (--data-dir), each with its own inputs
    swap = ("robustness", "swap-syn", "--model", model, "--output-dir", out)
    one_line(cli_in_process(*swap, "--task", "squad", "--data-dir", "d"), "swap-syn --task squad takes --dev FILE")
    one_line(cli_in_process(*swap, "--task", "rte", "--dev", ok), "swap-syn --task rte takes --data-dir")
    one_line(cli_in_process(*swap, "--task", "rte", "--data-dir", "d", "--doc-stride", "64"),
             "not --dev or --doc-stride")
    one_line(cli_in_process(*swap, "--task", "squad", "--dev", str(files / "squad_empty.json")), "has no question")
    assert not (files / "out").exists()  # nothing was started


def test_what_stays_accepted_and_a_sequence_longer_than_the_model(tmp_path):
    """The checks refuse only what cannot work: HF Trainer's "auto" values in a fine-tuning config, `--num-proc 0`
    (every CPU); pre-training's config takes no "auto" stage. fn-stats' --seq-len is bounded by the model's own
    positions, not by 512."""
    import numpy as np

    from truneg.cli import build_parser
    from truneg.errors import UserError
    from truneg.eval import false_negatives as analysis
    from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer
    from truneg.train.config.ds_config import read_config

    hf_style = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "auto"},
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "bf16": {"enabled": "auto"}}
    (tmp_path / "hf.json").write_text(json.dumps(hf_style))
    assert read_config(tmp_path / "hf.json", for_trainer=True) == hf_style
    with pytest.raises(UserError, match='zero_optimization.stage is "auto"; it must be an integer'):
        read_config(tmp_path / "hf.json")
    assert build_parser().parse_args(["prepare", "--train-data", "x", "--out", "y", "--num-proc", "0"]).num_proc == 0
    mlm = build_pretrainer("bert-tiny", ObjectiveConfig()).mlm
    mlm.config.max_position_embeddings = 64
    with pytest.raises(UserError, match="--seq-len 128 is beyond the model's 64 positions"):
        analysis.evaluate(mlm, np.zeros((2, 128), dtype=np.int32), None, None)


def test_range_checks_share_one_wording_and_refuse_what_is_not_finite():
    """errors.out_of_range words every range check (argparse's types and pretrain's preflight list alike)."""
    from truneg.errors import float_between, int_at_least, out_of_range

    inf, nan = float("inf"), float("nan")
    assert [out_of_range(v, 0, 1, high_open=True) for v in (0.0, 0.5, 1.0, -0.1, nan, inf)] == [
        None, None, "must be a finite number >= 0 and < 1, not 1.0", "must be a finite number >= 0 and < 1, not -0.1",
        "must be a finite number >= 0 and < 1, not nan", "must be a finite number >= 0 and < 1, not inf"]
    assert [out_of_range(v, 1) for v in (1, 10**400, 0, -3)] == [None, None, "must be >= 1, not 0",
                                                                 "must be >= 1, not -3"]
    assert out_of_range(-10**400, 0) == f"must be >= 0, not {-10**400}"  # no OverflowError on a huge int
    assert out_of_range(0.0, 0, low_open=True) == "must be a finite number > 0, not 0.0"
    assert float_between(-1, 1, low_open=False)("-1") == -1.0 and int_at_least(8)("8") == 8
    import argparse

    for parse, text, words in [(int_at_least(1), "0", "must be >= 1, not 0"), (int_at_least(1), "x", "invalid int"),
                               (float_between(0), "nan", "must be a finite number > 0, not nan"),
                               (float_between(0, 1), "1.5", "must be a finite number > 0 and <= 1, not 1.5")]:
        with pytest.raises(argparse.ArgumentTypeError, match=words):
            parse(text)


def test_pretrain_refuses_bad_profile_and_peak_flags_before_any_process_group(tmp_path, capsys, monkeypatch):
    """--profile-steps malformed or past --max-steps, --profile-ranks malformed, alone or beyond the launch's world
    size (here 1), a --peak-tflops that is no
    peak: one line and exit 2 from pretrain.py's first stage (shared with `truneg preflight`), nothing written."""
    import subprocess

    import torch.distributed as dist

    from truneg.errors import exit_on_user_error
    from truneg.train.build import checked_start

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["--model", "bert-tiny", "--max-steps", "10", "--output-dir", str(tmp_path / "out")]
    cases = [(["--profile-steps", "5"], "--profile-steps takes A:B, optimizer steps with 1 <= A <= B (e.g. 10:12), "
                                        "not '5'"),
             (["--profile-steps", "6:4"], "not '6:4'"), (["--profile-steps", "0:2"], "not '0:2'"),
             (["--profile-steps", "8:12"], "--profile-steps 8:12 ends past --max-steps 10"),
             (["--profile-steps", "1:2", "--profile-ranks", "0,a"], "--profile-ranks takes global ranks separated by "
                                                                    "commas (e.g. 0,3), not '0,a'"),
             (["--profile-ranks", "0"], "--profile-ranks chooses the ranks --profile-steps profiles"),
             (["--profile-steps", "1:2", "--profile-ranks", "0,1"], "--profile-ranks 0,1 names a rank beyond this "
                                                                    "launch's 1 (global ranks 0 to 0)"),
             (["--peak-tflops", "0"], "--peak-tflops must be a finite number > 0, not 0.0"),
             (["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0, not nan")]
    for extra, expected in cases:
        with pytest.raises(SystemExit) as exited:
            exit_on_user_error(checked_start)([*base, *extra])
        one_line(subprocess.CompletedProcess([], exited.value.code, "", capsys.readouterr().err), expected)
    assert not dist.is_initialized() and not (tmp_path / "out").exists()
