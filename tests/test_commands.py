"""Every command the README and docs/ show runs as written: its sub-command and flags parse, its module,
script or make target exists."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from truneg import cli
from truneg.cluster import preflight
from truneg.train.config import args as pretrain_args

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
PLACEHOLDER = re.compile(r"\.\.\.|\[|\$")  # `[--exact]`, `...`, `$(nproc)`: shown, not runnable as written


def documented_commands() -> list[tuple[str, str]]:
    """(file, command) for each command line of the fenced shell blocks, continuations joined."""
    found = []
    for doc in DOCS:
        blocks = re.findall(r"```(\w*)\n(.*?)```", doc.read_text(), re.S)
        for kind, body in blocks:
            if kind not in ("", "bash", "sh"):
                continue
            pending = ""
            for line in body.replace("\\\n", " ").splitlines():
                line = pending + line if pending else line.split("  #", 1)[0].strip()
                if not line or line.startswith("#"):
                    continue
                try:
                    shlex.split(line)
                except ValueError:  # a quoted argument over several lines (python -c '...')
                    pending = line + "\n"
                    continue
                pending = ""
                found.append((doc.name, line))
    return found


def words_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    return words


def parses(parser, argv: list[str]) -> None:
    """argparse accepts argv (exit 0 for --help), or the test fails with its message."""
    try:
        parser.parse_args(argv)
    except SystemExit as stop:
        assert stop.code == 0, f"{argv} does not parse"


def check(command: str, capsys) -> None:
    words = words_of(command)
    if not words:  # assignments alone: M=...
        return
    runnable = not PLACEHOLDER.search(command)
    if words[0] == "truneg":
        rest = words[1:]
        if rest[0] == "preflight":
            parses(preflight.build_parser(), rest[1:] if runnable else ["--help"])
            return
        subs = [w for w in rest[:2] if not w.startswith("-")]
        parses(cli.build_parser(), rest if runnable else [*subs, "--help"])
    elif words[0] in ("deepspeed", "python") and "truneg/pretrain.py" in words or words[:3] == ["python", "-m",
                                                                                                  "truneg.pretrain"]:
        script = words.index("truneg/pretrain.py") + 1 if "truneg/pretrain.py" in words else 3
        parses(pretrain_args.build_parser(), words[script:] if runnable else ["--help"])
    elif words[:2] == ["python", "-c"]:
        compile(words[2], "<documented python -c>", "exec")
    elif words[:2] == ["python", "-m"] and words[2].startswith("truneg."):
        done = subprocess.run([sys.executable, "-m", words[2], "--help"], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-500:]
    elif words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
        assert all(w in targets for w in words[1:] if "=" not in w), command
    elif words[0] in ("bash", "python"):
        path = next(w for w in words[1:] if not w.startswith("-"))
        assert (REPO / path).is_file(), f"{path} does not exist"
    elif words[0].startswith(("launch/", "bench/")):  # a script run by its path
        assert (REPO / words[0]).is_file(), f"{words[0]} does not exist"
    elif words[0] == "tensorboard":
        return
    else:
        pytest.fail(f"a documented command this test does not know how to check: {command}")
    capsys.readouterr()


@pytest.mark.parametrize("doc, command", documented_commands())
def test_each_documented_command_runs_as_written(doc, command, capsys):
    check(command, capsys)


def test_the_check_fails_on_a_flag_or_sub_command_that_does_not_exist(capsys):
    for wrong in ("truneg synonyms build --vocab V --out o.npz --no-such-flag", "truneg no-such-command --help",
                  "deepspeed truneg/pretrain.py --no-such-flag 1", "make no-such-target", "bash launch/nothing.sh"):
        with pytest.raises(AssertionError):
            check(wrong, capsys)


def test_every_code_path_the_docs_name_exists():
    """Each backticked `truneg/...py` and `bench/...` path in README.md and docs/ is a file or folder of the repo:
    a module that moved leaves no reader at a dead path."""
    named = {(doc.name, path) for doc in DOCS
             for path in re.findall(r"`((?:truneg/[\w/]+\.py|bench/[\w./-]*))(?::\w+)?[` ]", doc.read_text())}
    assert len(named) > 20
    missing = sorted((doc, path) for doc, path in named if not (REPO / path.split(" ")[0]).exists())
    assert missing == []


def test_truneg_report_imports_neither_torch_transformers_nor_deepspeed(tmp_path):
    """`truneg report` only reads JSON: in a fresh interpreter, a run's records reported, none of the three is
    imported (their start-up is seconds and half a GB: docs/performance.md)."""
    run = tmp_path / "base"
    run.mkdir()
    record = {"step": 0, "samples": 0, "eval_mlm_loss": 9.0, "eval_mlm_accuracy": 0.1, "eval_hc_iter_ratio": 0.0,
              "eval_hc_pred_ratio": 0.0, "eval_sequences": 8, "eval_masked": 10, "eval_mismatched": 9,
              "eval_seconds": 0.1}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    script = ("import sys\nfrom truneg import cli\n"
              f"cli.main(['report', 'baseline={run}', '--out', '{tmp_path / 'out'}'])\n"
              "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]" and (tmp_path / "out" / "eval.csv").is_file()
