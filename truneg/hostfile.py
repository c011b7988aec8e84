"""Before a multi-node launch: check the DeepSpeed hostfile, and write the env file the other nodes read.

    python -m truneg.hostfile launch/hosts     # prints the nodes, or one line naming the bad line; exit 2
    python -m truneg.hostfile launch/hosts --env-file OUT/deepspeed_env    # and write the env file

DeepSpeed's pdsh/ssh/MPI runners forward only some variables (NCCL_*, PYTHON*, ...) to the other nodes;
the rest come from the file `DS_ENV_FILE` names (default `.deepspeed_env` in ~ or the current folder),
one `NAME=value` a line, read by deepspeed/launcher/runner.py with `line.split("=", 1)`: no comments or
blank lines, and a value is quoted for the remote shell only when it holds characters outside
`[\\w@%+=:,./-]`. An absolute DS_ENV_FILE replaces both default places, so the file written here carries
their lines over first.
"""
from __future__ import annotations

import argparse
import getpass
import os
import re
import sys
from pathlib import Path

from truneg.errors import UserError, exit_on_user_error

LINE = re.compile(r"^(\S+)\s+slots=(\d+)$")


def check_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order. Stricter than DeepSpeed's parser, which accepts trailing words and
    slots=0, and names the line at fault."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"hostfile {path} does not exist; write one `HOST slots=N` line per node (see launch/hosts)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    pool: dict[str, int] = {}
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = LINE.match(line)
        if not match:
            raise UserError(f"{path}:{number}: {line!r} is not `HOST slots=N`; fix or comment out that line")
        host, slots = match.group(1), int(match.group(2))
        if slots < 1:
            raise UserError(f"{path}:{number}: {host} has slots={slots}; give it the number of GPUs on that node (>= 1)")
        if host in pool:
            raise UserError(f"{path}:{number}: {host} is listed twice; keep one line per node")
        pool[host] = slots
    if not pool:
        raise UserError(f"hostfile {path} lists no node; write one `HOST slots=N` line per node")
    return pool


SAFE_VALUE = re.compile(r"^[\w@%+=:,./-]+$")  # what DeepSpeed's runner passes on unquoted


def launch_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables every node needs, as set on this node or their defaults: the token cache (may stay
    node-local), HF's and nltk's data, and a node-local folder for JIT-built ops, so that the ranks of
    different nodes never race on one lock in a shared folder."""
    environ = dict(os.environ if environ is None else environ)
    home = Path(environ.get("HOME") or Path.home())
    user = environ.get("USER") or getpass.getuser()
    return {
        "TRUNEG_CACHE": environ.get("TRUNEG_CACHE") or str(home / ".cache" / "truneg"),
        "HF_HOME": environ.get("HF_HOME") or str(home / ".cache" / "huggingface"),
        # truneg.wordnet_setup installs WordNet under the venv, the same path on every node
        "NLTK_DATA": environ.get("NLTK_DATA") or str(Path(sys.prefix) / "share" / "nltk_data"),
        "TORCH_EXTENSIONS_DIR": environ.get("TORCH_EXTENSIONS_DIR") or f"/tmp/torch_extensions_{user}",
    }


def _read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if "=" in line:
            key, value = line.split("=", 1)
            values[key.strip()] = value.strip()
    return values


def write_env_file(path: str | Path, values: dict[str, str], carry_over: list[Path] | None = None) -> dict[str, str]:
    """Write `NAME=value` lines DeepSpeed's launcher reads (DS_ENV_FILE); the lines of `carry_over` files
    (default: ~/.deepspeed_env and ./.deepspeed_env, which an absolute DS_ENV_FILE hides) come first and
    `values` override them. Returns what was written."""
    path = Path(path)
    if carry_over is None:
        carry_over = [Path.home() / ".deepspeed_env", Path.cwd() / ".deepspeed_env"]
    merged: dict[str, str] = {}
    for extra in carry_over:
        if extra.is_file() and extra.resolve() != path.resolve():
            merged.update(_read_env_file(extra))
    merged.update(values)
    for key, value in merged.items():
        if not SAFE_VALUE.match(value):
            raise UserError(f"{key}={value!r} holds characters DeepSpeed's launcher would quote for the remote "
                            "shell (spaces, $, quotes...); choose a path of letters, digits and ._-/ only")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{key}={value}\n" for key, value in merged.items()), encoding="utf-8")
    tmp.replace(path)
    return merged


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m truneg.hostfile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hostfile")
    parser.add_argument("--env-file", type=Path, help="write the launch env file here (export DS_ENV_FILE=it)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    pool = check_hostfile(args.hostfile)
    if args.env_file:
        written = write_env_file(args.env_file, launch_env())
        print(f"{args.env_file}: " + " ".join(f"{k}={v}" for k, v in written.items()))
    else:
        print(f"{args.hostfile}: {len(pool)} nodes, {sum(pool.values())} slots: " + ", ".join(f"{h}={s}" for h, s in pool.items()))


if __name__ == "__main__":
    main()
