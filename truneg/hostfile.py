"""Before a multi-node launch: check the DeepSpeed hostfile, and write the env file the other nodes read.
The preflight's checks of the nodes a launch gets (DeepSpeed's node filters, pdsh, ssh) are here too.

    python -m truneg.hostfile launch/hosts     # prints the nodes, or one line naming the bad line; exit 2
    python -m truneg.hostfile launch/hosts --env-file OUT/deepspeed_env    # and write the env file

DeepSpeed's pdsh/ssh/MPI runners forward only some variables to the other nodes (PYTHON*, UCX_*, MV2_*,
and NCCL_* only when the launching node has a GPU); the rest come from the file `DS_ENV_FILE` names
(default `.deepspeed_env` in ~ or the current folder), one `NAME=value` a line, read by
deepspeed/launcher/runner.py with `line.split("=", 1)`: no comments or blank lines (a `#NAME=...` line
would become `export #NAME=...; ...` on each node, a shell comment that swallows the launch), and a value
is put in double quotes for the remote shell when it holds characters outside `[\\w@%+=:,./-]`. An absolute
DS_ENV_FILE replaces both default places, so the file written here carries their lines over first.
"""
from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from truneg.errors import UserError, exit_on_user_error

# Open MPI's hostfiles (which its DeepSpeed runner hands to mpirun) may add max_slots=N (max-slots=N) and a comment.
LINE = re.compile(r"^(\S+)\s+slots=(\d+)(?:\s+max[-_]slots=\d+)?\s*(?:#.*)?$")


def check_hostfile(path: str | Path) -> dict[str, int]:
    """{host: slots} in file order. Stricter than DeepSpeed's parser, which accepts any trailing words and
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
        # truneg.wordnet_setup installs WordNet under the venv, the same path on every node
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
    - for a launch onto other nodes (`remote`), PATH with the venv's bin first (ninja for the JIT builds):
      each node's shell starts outside the venv. Over pdsh, `BIN:$PATH`, which DeepSpeed puts in double quotes
      and each node's shell expands to its own PATH, as DeepSpeed's --venv_script would leave it (not used:
      with it, the pdsh runner's kill command on Ctrl-C or a scheduler's SIGTERM names the wrong words of the
      remote command and stops no rank). The MPI and Slurm runners start no shell: there this shell's PATH,
      less the entries DeepSpeed would quote."""
    environ = dict(os.environ if environ is None else environ)
    names = ("CUDA_HOME", "MASTER_ADDR", "MASTER_PORT")
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


def _read_env_file(path: Path) -> dict[str, str]:
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
            merged.update(_read_env_file(extra))
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


def check_pdsh_paths(cwd: Path | None = None, python: str | None = None, repo: Path | None = None) -> None:
    """pdsh runs one command line in each node's shell, and DeepSpeed's runner writes this folder (`cd`), its
    Python and the script into it unquoted: a space (or $, ;, ...) in any of them breaks every node's start,
    and pdsh itself replaces %h, %n, %u there."""
    for what, path in (("this folder", cwd or Path.cwd()), ("the venv's Python", python or sys.executable),
                       ("the repo", repo or Path(__file__).resolve().parents[1])):
        if not UNQUOTED_VALUE.match(str(path)) or "%" in str(path):
            raise UserError(f"{what}, {path}, holds a character that DeepSpeed's pdsh launcher passes unquoted to each "
                            "node's shell; launch from, and keep the repo and its venv under, paths of "
                            "[A-Za-z0-9_@+=:,./-]")


def check_master_addr(environ: dict[str, str] | None = None) -> None:
    """A MASTER_ADDR exported for a launch onto other nodes (the launch scripts hand it to deepspeed, and to the
    ranks in the env file) must be reachable from them: a loopback one, left from work on one machine, would
    send every other node's ranks to itself, where they wait until the timeout."""
    import ipaddress

    address = dict(os.environ if environ is None else environ).get("MASTER_ADDR", "")
    try:
        loopback = address == "localhost" or ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback:
        raise UserError(f"MASTER_ADDR={address} is a loopback address, which the other nodes cannot reach: export the "
                        "first node's address, or unset it (over pdsh deepspeed finds one)")


# DeepSpeed's runners that start the ranks without a MASTER_ADDR (mpich and impi set one; pdsh's launch.py too)
NO_MASTER_ADDR_LAUNCHERS = ("openmpi", "mvapich", "slurm")


def _sets_master_addr(environ: dict[str, str], launcher_args: str) -> bool:
    """Whether every rank gets a MASTER_ADDR: from this shell (the launch scripts write it into the env
    file), an env file DeepSpeed reads, or the launcher's own options (`-x MASTER_ADDR=...`)."""
    if "MASTER_ADDR" in environ or "MASTER_ADDR" in launcher_args:
        return True
    for path in deepspeed_env_files(environ):
        try:
            if path.is_file() and "MASTER_ADDR" in _read_env_file(path):
                return True
        except UserError:
            continue  # DeepSpeed would stumble on the file itself; not this check's to say
    return False


def check_multi_node_launch(train_data: list[str], launcher: str, environ: dict[str, str] | None = None,
                            launcher_args: str = "") -> list[str]:
    """What a launch over several nodes trips on before its first step. The openmpi, mvapich and slurm runners
    set no MASTER_ADDR: without one (or mpi4py, for DeepSpeed's MPI discovery) every rank stops at start-up.
    Over pdsh (DeepSpeed's default): pdsh itself (there is no ssh fallback), and a glob: pdsh hands each
    argument without a space unquoted to every node's shell, which expands it itself (bash's `**` is `*`:
    fewer files than this node's Python finds)."""
    import importlib.util

    environ = dict(os.environ if environ is None else environ)
    if launcher in NO_MASTER_ADDR_LAUNCHERS and not _sets_master_addr(environ, launcher_args) \
            and importlib.util.find_spec("mpi4py") is None:
        return [f"deepspeed's {launcher} launcher gives the ranks no MASTER_ADDR: export MASTER_ADDR=<the first node's "
                "address> (and MASTER_PORT, default 29500) here, which the launch scripts' env file carries to every "
                "node, or pip install mpi4py for DeepSpeed's MPI discovery"]
    if launcher != "pdsh":  # the MPI and Slurm runners pass the arguments on as they are, through no shell
        return []
    problems = []
    if shutil.which("pdsh") is None:
        problems.append("pdsh is not installed here, and DeepSpeed's launcher starts the other nodes through it: "
                        "install pdsh (apt/dnf install pdsh), or launch with --launcher openmpi|slurm|mvapich")
    for spec in train_data:
        if any(c in str(spec) for c in "*?["):
            problems.append(f"--train-data {spec} is a glob, which each node's shell expands on its own (`**` as "
                            "`*`); pass its folder, or prepare the corpus first (truneg prepare) and pass that")
    return problems


def is_this_machine_one_of(hosts: list[str]) -> bool:
    """Whether this machine is one of `hosts`: by its name (full or short), or by an address it can bind (a
    name that resolves to one of its addresses, an IP of its own, localhost)."""
    names = {socket.gethostname(), socket.getfqdn(), "localhost"}
    names |= {name.split(".")[0] for name in names}
    if any(host in names or host.split(".")[0] in names for host in hosts if not host[:1].isdigit()):
        return True
    for host in hosts:
        try:
            with socket.socket() as probe:
                probe.bind((host, 0))
            return True
        except OSError:  # not resolved, or not an address of this machine
            continue
    return False


def check_ssh(hosts: list[str], timeout_s: int = 10, port: int | None = None) -> list[str]:
    """Hosts that passwordless ssh (on `port`: deepspeed's --ssh_port) does not reach (pdsh needs it)."""
    problems = []
    for host in hosts:
        port_args = ["-p", str(port)] if port is not None else []
        try:
            result = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}", *port_args, host,
                                     "true"],
                                    capture_output=True, text=True, timeout=timeout_s + 5)
            failed = result.returncode != 0
            detail = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        except (OSError, subprocess.TimeoutExpired) as err:
            failed, detail = True, str(err)
        if failed:
            problems.append(f"ssh to {host} failed ({detail}); set up passwordless ssh from this node")
    return problems


def launcher_options(launcher_args: str) -> argparse.Namespace:
    """The options given to `deepspeed` itself (the launch scripts' LAUNCHER_ARGS), as its own parser reads
    them, the string split as a shell splits it (the scripts do, so `--launcher_args "--mca ..."` stays
    one value)."""
    import contextlib
    import io
    import shlex

    from deepspeed.launcher import runner

    said = io.StringIO()
    try:
        words = shlex.split(launcher_args)
        with contextlib.redirect_stderr(said):
            return runner.parse_args([*words, "pretrain.py"])
    except (SystemExit, ValueError) as err:
        reason = (said.getvalue().strip().splitlines() or [str(err)])[-1].split("error: ", 1)[-1]
        raise UserError(f"LAUNCHER_ARGS {launcher_args!r}: {reason}; see deepspeed --help") from None


class Launched(NamedTuple):
    nodes: dict[str, int]  # node -> ranks
    launcher: str | None  # the launcher LAUNCHER_ARGS name (None: they name none)
    options: argparse.Namespace  # DeepSpeed's own parse of LAUNCHER_ARGS


def launched_resources(hosts: dict[str, int], local_gpus: int, launcher_args: str,
                       visible_devices: str = "") -> Launched:
    """The nodes and GPU counts `deepspeed` itself would start for these options, the launcher they name and
    the options as DeepSpeed parsed them (one parse for every caller): the hostfile's slots (or this machine's
    GPUs without one) narrowed by --include/--exclude, --num_nodes and --num_gpus, with DeepSpeed's own
    parser, filters and its runners' own checks of them. `visible_devices`: CUDA_VISIBLE_DEVICES, which
    deepspeed reads only without a hostfile."""
    from deepspeed.launcher import runner
    from deepspeed.launcher.constants import PDSH_LAUNCHER  # deepspeed's default --launcher

    options = launcher_options(launcher_args)
    launcher = options.launcher.lower() if options.launcher != PDSH_LAUNCHER else None
    if (options.num_nodes >= 0 or options.num_gpus >= 0) and (options.include or options.exclude):
        raise UserError("LAUNCHER_ARGS: deepspeed refuses --num_nodes/--num_gpus together with --include/--exclude; "
                        "use one or the other")
    if not hosts and visible_devices:  # deepspeed turns it into --include localhost:..., or drops it
        if options.include or options.exclude or options.num_nodes > 1 or options.num_gpus > 0:
            raise UserError(f"deepspeed ignores CUDA_VISIBLE_DEVICES={visible_devices} when LAUNCHER_ARGS picks GPUs "
                            "(--include/--exclude/--num_gpus/--num_nodes) and uses every GPU: unset one of the two")
        if options.num_nodes >= 0 or options.num_gpus >= 0:
            raise UserError(f"deepspeed refuses --num_nodes/--num_gpus with CUDA_VISIBLE_DEVICES={visible_devices} "
                            "(it reads the variable as --include); drop them from LAUNCHER_ARGS")
        return Launched({"localhost": len(visible_devices.split(","))}, launcher, options)
    if options.num_nodes > 1 and not hosts:
        raise UserError(f"LAUNCHER_ARGS: --num_nodes {options.num_nodes} without a hostfile; name the nodes in one")
    pool = dict(hosts) or {"localhost": local_gpus}
    try:
        active = runner.parse_inclusion_exclusion(pool, options.include, options.exclude)
    except ValueError as err:
        raise UserError(f"LAUNCHER_ARGS: {err}") from None
    active = runner.apply_num_nodes_and_gpus(active, options.num_nodes, options.num_gpus)
    # what the chosen runner refuses at launch (the MPI runners take no node filter, srun no uneven slots)
    runner_class = runner.LAUNCHER_CLASSES.get(options.launcher.lower())
    try:
        if runner_class is not None:
            runner_class.validate_active_resources(active)
            hosts_left = len([slots for slots in active.values() if slots])
            if (options.force_multi or hosts_left > 1) and not options.no_ssh:  # deepspeed builds a runner only then
                probe = runner_class.__new__(runner_class)
                probe.args = options
                probe.validate_args()
    except ValueError as err:
        raise UserError(f"LAUNCHER_ARGS: deepspeed's {options.launcher.lower()} launcher refuses them: {err}") from None
    return Launched({host: len(slots) for host, slots in active.items() if slots}, launcher, options)


@exit_on_user_error
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m truneg.hostfile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hostfile")
    parser.add_argument("--env-file", type=Path, help="write the launch env file here (export DS_ENV_FILE=it)")
    parser.add_argument("--gpu-arch", help="the nodes' GPUs (sm70, sm80, sm90), for each rank to check its own against")
    parser.add_argument("--launcher-args", default="", help="the options given to deepspeed (its --launcher)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    pool = check_hostfile(args.hostfile)
    if args.env_file:
        from truneg.preflight import GPU_ARCH_ENV

        defaults = launch_env()
        values = {k: v for k, v in os.environ.items() if k in defaults and v}
        if args.gpu_arch:
            values[GPU_ARCH_ENV] = args.gpu_arch
        # deepspeed's default launcher without options (its parser costs an import of deepspeed)
        launcher, runner_exports, remote = "pdsh", (), len(pool) > 1
        if args.launcher_args.strip():
            from deepspeed.accelerator import get_accelerator
            from deepspeed.launcher.runner import EXPORT_ENVS

            nodes, _, options = launched_resources(pool, 0, args.launcher_args)
            remote = (options.force_multi or len(nodes) > 1) and not options.no_ssh  # DeepSpeed reads the file only then
            if remote:
                launcher = options.launcher.lower()
                runner_exports = tuple(EXPORT_ENVS + get_accelerator().export_envs())
        if remote and launcher == "pdsh":
            check_pdsh_paths()
        if remote:
            check_master_addr()
        written = write_env_file(args.env_file, values, defaults=defaults,
                                 forwarded=forwarded_env(launcher=launcher, remote=remote), launcher=launcher,
                                 runner_exports=runner_exports)
        print(f"{args.env_file}: " + " ".join(f"{k}={v}" for k, v in written.items()))
    else:
        print(f"{args.hostfile}: {len(pool)} nodes, {sum(pool.values())} slots: " + ", ".join(f"{h}={s}" for h, s in pool.items()))


if __name__ == "__main__":
    main()
