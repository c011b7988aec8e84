"""Before a multi-node launch: check the DeepSpeed hostfile, and write the env file the other nodes read
(truneg.cluster.env_file). The preflight's checks of the nodes a launch gets (DeepSpeed's node filters, pdsh, ssh,
MASTER_ADDR) are here too.

    python -m truneg.cluster.hostfile launch/hosts     # prints the nodes, or one line naming the bad line; exit 2
    python -m truneg.cluster.hostfile launch/hosts --env-file OUT/deepspeed_env    # and write the env file
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from truneg.cluster.env_file import (
    UNQUOTED_VALUE,
    deepspeed_env_files,
    forwarded_env,
    launch_env,
    read_env_file,
    write_env_file,
)
from truneg.errors import UserError, exit_on_user_error
from truneg.train.config.ds_config import GPU_ARCH_ENV

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
            raise UserError(f"{path}:{number}: {host} has slots={slots}; "
                            "give it the number of GPUs on that node (>= 1)")
        if host in pool:
            raise UserError(f"{path}:{number}: {host} is listed twice; keep one line per node")
        pool[host] = slots
    if not pool:
        raise UserError(f"hostfile {path} lists no node; write one `HOST slots=N` line per node")
    return pool


def check_pdsh_paths(cwd: Path | None = None, python: str | None = None, repo: Path | None = None) -> None:
    """pdsh runs one command line in each node's shell, and DeepSpeed's runner writes this folder (`cd`), its
    Python and the script into it unquoted: a space (or $, ;, ...) in any of them breaks every node's start,
    and pdsh itself replaces %h, %n, %u there."""
    for what, path in (("this folder", cwd or Path.cwd()), ("the venv's Python", python or sys.executable),
                       ("the repo", repo or Path(__file__).resolve().parents[2])):
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
    if not address:
        return
    try:  # an address, or what a name resolves to here (localhost, localhost.localdomain, ip6-localhost, ...)
        found = {info[4][0] for info in socket.getaddrinfo(address, None)}
    except OSError:  # a name this node cannot resolve: not its to judge
        return
    if found and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
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
            if path.is_file() and "MASTER_ADDR" in read_env_file(path):
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
            result = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout_s}", *port_args,
                                     host,
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
    parser = argparse.ArgumentParser(prog="python -m truneg.cluster.hostfile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hostfile")
    parser.add_argument("--env-file", type=Path, help="write the launch env file here (export DS_ENV_FILE=it)")
    parser.add_argument("--gpu-arch", help="the nodes' GPUs (sm70, sm80, sm90), for each rank to check its own against")
    parser.add_argument("--launcher-args", default="", help="the options given to deepspeed (its --launcher)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    pool = check_hostfile(args.hostfile)
    if args.env_file:

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
            # DeepSpeed reads the file only then
            remote = (options.force_multi or len(nodes) > 1) and not options.no_ssh
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
        print(f"{args.hostfile}: {len(pool)} nodes, {sum(pool.values())} slots: "
              + ", ".join(f"{h}={s}" for h, s in pool.items()))


if __name__ == "__main__":
    main()
