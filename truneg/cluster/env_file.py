"""The env file DeepSpeed's multi-node runners read, and what a launch puts in it.

DeepSpeed's pdsh/ssh/MPI runners forward only some variables to the other nodes (PYTHON*, UCX_*, MV2_*,
and NCCL_* only when the launching node has a GPU); the rest come from the file `DS_ENV_FILE` names
(default `.deepspeed_env` in ~ or the current folder), one `NAME=value` a line, read by
deepspeed/launcher/runner.py with `line.split("=", 1)`: no comments or blank lines (a `#NAME=...` line
would become `export #NAME=...; ...` on each node, a shell comment that swallows the launch), and a value
is put in double quotes for the remote shell when it holds characters outside `[\\w@%+=:,./-]`. An absolute
DS_ENV_FILE replaces both default places, so the file written here carries their lines over first.
"""
from __future__ import annotations

import getpass
import os
import re
import sys
from pathlib import Path

from truneg.errors import UserError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# DeepSpeed's runner puts a value in double quotes for the remote shell; inside them these still act, and
# whitespace splits the `cd` and paths of pdsh's command line.
UNSAFE_VALUE = re.compile(r"[\s\"$`\\]")
# A value with another character DeepSpeed's runner puts in double quotes (multinode_runner.add_export): pdsh's
# remote shell removes them, its MPI and Slurm runners, which start no shell, pass them on to the ranks.
UNQUOTED_VALUE = re.compile(r"^[\w@%+=:,./-]*$")
# Each node's own PATH, expanded by its shell (pdsh's): the one `$` an env-file value may hold.
NODE_PATH = "$PATH"
# Forwarded by DeepSpeed only from a launching node with a GPU; the wrappers may launch from one without.
FORWARDED_PREFIXES = ("NCCL_", "TORCH_NCCL_")


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
        # truneg.synonyms.wordnet installs WordNet under the venv, the same path on every node
        "NLTK_DATA": environ.get("NLTK_DATA") or str(Path(sys.prefix) / "share" / "nltk_data"),
        "TORCH_EXTENSIONS_DIR": environ.get("TORCH_EXTENSIONS_DIR") or f"/tmp/torch_extensions_{user}",
    }


def forwarded_env(environ: dict[str, str] | None = None, venv_bin: str | Path | None = None,
                  launcher: str = "pdsh", remote: bool = True) -> dict[str, str]:
    """What this shell sets that the ranks on other nodes need and DeepSpeed does not forward:
    - its NCCL settings (DeepSpeed forwards them only from a node with a GPU; the wrappers may launch from
      one without) and CUDA_HOME (nvcc for the fused optimizers' JIT builds on each node);
    - MASTER_ADDR and MASTER_PORT, for the openmpi, mvapich and slurm runners, which set none: a rank
      without them would go to MPI discovery while the ranks with them would not, and wait there;
    - HF_HUB_CACHE and HF_HUB_OFFLINE: where each node finds a hub-named checkpoint, and whether it may download;
    - for a launch onto other nodes (`remote`), PATH with the venv's bin first (ninja for the JIT builds):
      each node's shell starts outside the venv. Over pdsh, `BIN:$PATH`, which DeepSpeed puts in double quotes
      and each node's shell expands to its own PATH, as DeepSpeed's --venv_script would leave it (not used:
      with it, the pdsh runner's kill command on Ctrl-C or a scheduler's SIGTERM names the wrong words of the
      remote command and stops no rank). The MPI and Slurm runners start no shell: there this shell's PATH,
      less the entries DeepSpeed would quote."""
    environ = dict(os.environ if environ is None else environ)
    names = ("CUDA_HOME", "MASTER_ADDR", "MASTER_PORT", "HF_HUB_CACHE", "HF_HUB_OFFLINE")
    forwarded = {k: v for k, v in sorted(environ.items()) if k.startswith(FORWARDED_PREFIXES) or k in names}
    if remote and "PATH" in environ:
        venv_bin = str(venv_bin or Path(sys.prefix) / "bin")
        if not UNQUOTED_VALUE.match(venv_bin):  # it would be left out below, and the nodes would find no ninja
            raise UserError(f"the venv's {venv_bin} holds a character DeepSpeed's {launcher} launcher would quote or "
                            "split in PATH; put the repo and its venv under a path of [A-Za-z0-9_@%+=:,./-]")
        if launcher == "pdsh":
            forwarded["PATH"] = f"{venv_bin}{os.pathsep}{NODE_PATH}"
        else:
            entries = [venv_bin] + [e for e in environ["PATH"].split(os.pathsep) if e and e != venv_bin]
            forwarded["PATH"] = os.pathsep.join(e for e in entries if UNQUOTED_VALUE.match(e))
    return forwarded


def read_env_file(path: Path) -> dict[str, str]:
    """`NAME=value` lines; blank lines and `#` comments are dropped (DeepSpeed's reader would export them)."""
    values = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not ENV_NAME.match(key.strip()):
            raise UserError(f"{path}:{number}: {raw!r} is not `NAME=value`; fix it or start it with #")
        values[key.strip()] = value.strip()
    return values


def deepspeed_env_files(environ: dict[str, str] | None = None) -> list[Path]:
    """The env files DeepSpeed's runner reads, as it finds them: DS_ENV_FILE (default .deepspeed_env) in the
    home folder, then in the current one (an absolute DS_ENV_FILE is both)."""
    environ = dict(os.environ if environ is None else environ)
    name = environ.get("DS_ENV_FILE", ".deepspeed_env")
    home = Path(environ.get("HOME") or Path.home())
    return list(dict.fromkeys(folder / name for folder in (home, Path.cwd())))


def write_env_file(path: str | Path, values: dict[str, str], carry_over: list[Path] | None = None,
                   forwarded: dict[str, str] | None = None, defaults: dict[str, str] | None = None,
                   launcher: str = "pdsh", environ: dict[str, str] | None = None,
                   runner_exports: tuple[str, ...] = ()) -> dict[str, str]:
    """Write `NAME=value` lines DeepSpeed's launcher reads (DS_ENV_FILE), each over the ones before:
    `defaults`, `forwarded` (this shell's), the lines of `carry_over` files (default: ~/.deepspeed_env and
    ./.deepspeed_env, which an absolute DS_ENV_FILE hides; over the forwarded ones as in DeepSpeed's runner),
    then `values` (what this shell sets). Returns what was written.

    The launchers other than pdsh start no remote shell: a value DeepSpeed quotes (NCCL_SOCKET_IFNAME=^lo) would
    reach the ranks with its quotes, and is refused. The slurm launcher hands the lines to `srun
    --export=ALL,NAME=value,...`, which also cuts a value at its first comma (NCCL_IB_HCA=mlx5_0,mlx5_1 would
    reach the ranks as mlx5_0): there such lines are left out where this shell (`environ`) holds the same
    value, which --export=ALL passes whole. `launcher` is "pdsh" where DeepSpeed reads no env file (one node).
    `runner_exports`: the prefixes of the variables DeepSpeed's runner passes on from this shell itself
    (PYTHON*, UCX*, ...; NCCL* from a node with a GPU), checked the same way."""
    path = Path(path)
    environ = dict(os.environ if environ is None else environ)
    if carry_over is None:
        carry_over = deepspeed_env_files({k: v for k, v in environ.items() if k != "DS_ENV_FILE"})
    merged: dict[str, str] = {**(defaults or {}), **(forwarded or {})}
    for extra in carry_over:
        if extra.is_file() and extra.resolve() != path.resolve():
            merged.update(read_env_file(extra))
    merged.update(values)
    for key, value in merged.items():
        if key == "PATH" and launcher == "pdsh" and value.endswith(os.pathsep + NODE_PATH):
            value = value.removesuffix(NODE_PATH)  # forwarded_env's: the venv's bin before the node's own PATH
        if UNSAFE_VALUE.search(value):
            raise UserError(f"{key}={value!r} holds a space, quote, $, ` or \\, which the remote shell of DeepSpeed's "
                            "launcher would split or expand; choose a value without them")
    if launcher != "pdsh":
        def mangled(value: str) -> bool:  # quoted by DeepSpeed; over srun also cut at a comma
            return not UNQUOTED_VALUE.match(value) or (launcher == "slurm" and "," in value)

        how = ("srun's --export (its slurm launcher) would cut it or keep the quotes" if launcher == "slurm" else
               f"DeepSpeed quotes it, and its {launcher} launcher starts no shell to remove the quotes")
        for key, value in sorted(environ.items()):
            if key.startswith(runner_exports) and mangled(value):
                raise UserError(f"{key}={value} would reach the ranks mangled: DeepSpeed passes this shell's {key} on "
                                f"itself, and {how}; unset it here (NCCL_*: set it in ~/.nccl.conf on every node)")
        for key, value in [(k, v) for k, v in merged.items() if mangled(v)]:
            if launcher != "slurm" or environ.get(key) != value:
                raise UserError(f"{key}={value} would reach the ranks mangled: {how}; choose a value of "
                                "[A-Za-z0-9_@%+=:./-] (over slurm: or export it in this shell, which --export=ALL "
                                "passes whole)")
            del merged[key]  # srun's --export=ALL passes this shell's own value whole
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{key}={value}\n" for key, value in merged.items()), encoding="utf-8")
    tmp.replace(path)
    return merged
