"""Process set-up: the ranks from any launcher, deepspeed.init_distributed (gloo on the CPU) and the device of
each GPU process, two workarounds for DeepSpeed's CPU comm op, and the run's seeding, in one place."""
from __future__ import annotations

import gc
import importlib.util
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from torch.utils.cpp_extension import _get_build_directory

from truneg.errors import UserError
from truneg.train.ranks.watchdog import enable_flight_recorder

STALE_BUILD_LOCK_S = 600


def _free_port() -> int:
    """A free port on 127.0.0.1, the MASTER_ADDR a world of one gets (torch's elastic get_free_port binds
    "localhost", which may be ::1 first, and logs a traceback where IPv6 is off)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# mpirun and srun start every process themselves and set no RANK (DeepSpeed's openmpi, mvapich and slurm
# runners leave the ranks to MPI discovery); their own variables: (world size, rank, local rank). srun's are
# the step's: a batch script also has SLURM_NTASKS and SLURM_PROCID=0, but is one process.
MPI_LAUNCHER_VARS = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),  # Open MPI
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK"),  # MVAPICH2
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),  # MPICH and Intel MPI (hydra); srun --mpi=pmi2
    ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"),  # srun
)
# Where the launcher's own local-rank variable is missing (srun's PMI2 plugin sets PMI_RANK but not
# MPI_LOCALRANKID), the first of these that is set.
LOCAL_RANK_FALLBACKS = ("SLURM_LOCALID", "PMI_LOCAL_RANK", "MPI_LOCALRANKID")


def _mpi_launcher() -> tuple[str, str, str] | None:
    """The variables of the MPI launcher or srun that started this process with others, if one did. The shell
    of `srun --pty bash` inherits the step's variables too, and is one process."""
    return next((names for names in MPI_LAUNCHER_VARS
                 if int(os.environ.get(names[0], "1")) > 1 and names[1] in os.environ
                 and not (names[0] == "SLURM_STEP_NUM_TASKS" and "SLURM_PTY_PORT" in os.environ)), None)


def _left_to_mpi_discovery() -> bool:
    return _mpi_launcher() is not None and not {"MASTER_ADDR", "LOCAL_RANK"} <= os.environ.keys()


def adopt_launcher_env() -> None:
    """RANK, WORLD_SIZE and LOCAL_RANK before anything reads them (the batch arithmetic, the corpus preparation
    per node, the process group). A launcher that sets them (DeepSpeed's pdsh launcher, torchrun) is taken as
    is; under mpirun or srun they come from that launcher's variables, and MASTER_ADDR from the environment or
    from DeepSpeed's MPI discovery (mpi4py); a process started by hand is a world of one, and its variables are
    set by init_distributed, all together (HF's Trainer, later in the same process, reads them too)."""
    if "RANK" in os.environ:
        return
    launcher = _mpi_launcher()
    if launcher is not None:
        size, rank, local = launcher
        os.environ.update(RANK=os.environ[rank], WORLD_SIZE=os.environ[size])
        local = next((name for name in (local, *LOCAL_RANK_FALLBACKS) if name in os.environ), None)
        if local is not None:
            os.environ["LOCAL_RANK"] = os.environ[local]
        if "MASTER_ADDR" in os.environ:
            os.environ.setdefault("MASTER_PORT", "29500")  # torch's and DeepSpeed's default
        if _left_to_mpi_discovery():
            if importlib.util.find_spec("mpi4py") is None:
                raise UserError(f"started by mpirun or srun ({size}={os.environ[size]}) without MASTER_ADDR: export "
                                "MASTER_ADDR and MASTER_PORT (rank 0's host and a free port) to every rank, or "
                                "pip install mpi4py so that DeepSpeed finds them")
            # DeepSpeed's discovery takes MPI's world as it is: one that cannot see the launcher's processes
            # makes each a rank 0 of one, all on one port (and one GPU) of their node
            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_size() != int(os.environ[size]):
                raise UserError(f"{size}={os.environ[size]}, but mpi4py's MPI sees {MPI.COMM_WORLD.Get_size()} "
                                "process(es): it cannot reach the launcher's (srun without --mpi=pmix or pmi2, or an "
                                "mpi4py built for another MPI); export MASTER_ADDR and MASTER_PORT (rank 0's host and "
                                "a free port) to every rank instead")


def launch_world_size() -> int:
    """The world size the launcher set up (1 without a launcher), readable before any process group."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(output_dir: Path | None = None) -> tuple[int, int]:
    """deepspeed.init_distributed with gloo on the CPU; `python -m truneg.pretrain` runs as a world of one.

    On GPUs each process is bound to its own, cuda:LOCAL_RANK, before any collective: DeepSpeed does it only
    inside deepspeed.initialize, and NCCL refuses a tensor on cuda:0 (the default device) from a rank whose
    process group is bound to another GPU, as DeepSpeed binds it on torch >= 2.3. `output_dir`: on GPUs, where
    NCCL's flight recorder dumps on NCCL's own timeout."""
    adopt_launcher_env()
    if "RANK" not in os.environ:  # no launcher: a world of one, on a port of its own
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    accelerator = get_accelerator()
    backend = "gloo" if accelerator.device_name() == "cpu" else None
    if backend is None and output_dir is not None:
        enable_flight_recorder(output_dir)  # for --step-timeout's dump; read when the process group starts
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=_left_to_mpi_discovery())
    if backend == "gloo":
        _unlink_shm_allreduce_buffer()
    else:
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    return dist.get_rank(), dist.get_world_size()


def on_rank_zero(action: Callable[[], object], what: str) -> None:
    """A collective: `action` runs on rank 0 alone, then one all-reduce (also the barrier after it) tells every
    rank whether it worked. A failure there (a full disk, a conversion that fails) stops every rank with one
    line, where the other ranks would wait in their next collective until the timeout (10 minutes) on other
    nodes: on one node the launcher kills them, across nodes nothing does."""
    _share_outcome(_attempt(action) if dist.get_rank() == 0 else None, what)


def on_every_rank(action: Callable[[], object], what: str) -> None:
    """A collective: `action` runs on every rank, then one all-reduce tells each whether all of them managed. A
    failure on some ranks alone (a file only they read is damaged) stops every rank with one line, where the
    others would go on into a collective that the failed ranks never join."""
    _share_outcome(_attempt(action), what)


def _attempt(action: Callable[[], object]) -> Exception | None:
    try:
        action()
    except Exception as err:  # whatever it is, the other ranks must hear of it
        return err
    return None


def _share_outcome(error: Exception | None, what: str) -> None:
    """One all-reduce of which ranks failed; each failed rank says why, every other names them."""
    failed = torch.zeros(dist.get_world_size(), device=get_accelerator().current_device_name())
    if error is not None:
        failed[dist.get_rank()] = 1
    dist.all_reduce(failed)
    if isinstance(error, UserError):
        raise error
    if error is not None:
        raise UserError(f"cannot {what}: {type(error).__name__}: {error}")
    ranks = failed.nonzero().flatten().tolist()
    if ranks:
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        raise UserError(f"{who} could not {what} ({'its own line says' if len(ranks) == 1 else 'their own lines say'} "
                        "why); every rank stopped")


def shutdown(clean: bool = True) -> None:
    """Destroy every process group before the interpreter is torn down: torch's, and DeepSpeed's clone of the world
    (its ZeRO optimizer's group), which destroy_process_group leaves running, threads and all, while DeepSpeed's
    module, its engine and every parameter hold it. A gloo group alive in the interpreter's teardown makes a rank
    abort now and then at exit ("terminate called without an active exception", exit status -6): seen here in a
    60-step run that finished, and in rank 0 of a run whose replicas diverged, after its one-line error's
    sys.exit(2) (once in 48 runs of that pair, 2026-12-06; its group was alive at exit in all 48).

    `clean`: the run ended. A rank that leaves on an error (its one line, or a traceback) skips the barrier: the
    other ranks may have left already, or wait in a collective that a barrier would not match; a destroy with a
    peer gone, or waiting in a collective, takes milliseconds (that peer's collective then fails at once, where
    it would wait the collective timeout). DeepSpeed's group is freed only if the engine is gone by now: destroyed
    (pretrain.main does it: its ZeRO optimizer's gradient hooks, held by autograd, keep it past gc) and
    unreachable (`run_then_exit` drops main's frames first)."""
    if dist.is_initialized():
        # gloo's barrier first waits for this rank's collectives still queued or running (an async ZeRO-3
        # all-gather, say), so none is torn down with the group: a ZeRO-3 rank aborted so at exit, after
        # finishing its run, in 2 of about 25 runs of a test here (2026-12-01)
        if clean:
            dist.barrier()
        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()  # torch's, then DeepSpeed's own references to its groups
        else:
            dist.destroy_process_group()
    # the last references to DeepSpeed's group: the engine's, its optimizer's and its parameters' (reference
    # cycles); freeing the group joins its threads, and rank 0's store with it
    gc.collect()


def run_then_exit(main: Callable[[], object]) -> NoReturn:
    """A rank's process: `main`, then its process groups destroyed on every way out (the run's end, a UserError's
    one line and exit 2, a traceback), then its exit status. Out of the `except` first: the exception's traceback
    holds main's frames, and through them the engine and DeepSpeed's group. (The watchdog leaves by os._exit,
    which tears nothing down.)"""
    try:
        main()
    except SystemExit as leaving:  # exit_on_user_error's, after the one line
        status = leaving.code
    except KeyboardInterrupt:  # before the loop's own handler, or after it
        traceback.print_exc()
        status = 130
    except BaseException:  # noqa: BLE001  (printed as the interpreter prints it)
        traceback.print_exc()
        status = 1
    else:
        status = 0
    shutdown(clean=status in (0, None))
    sys.exit(status)


def refuse_stale_build_lock(extension: str) -> None:
    """torch takes a lock file on every load of a JIT-built op; a process killed in that second leaves it
    behind, and every later launch would wait on it forever without a word. A build takes about a minute."""
    try:  # torch's own rule for where the op is built (a private helper, hence the guard)
        lock = Path(_get_build_directory(extension, verbose=False)) / "lock"
    except (ImportError, AttributeError, TypeError):
        return
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_BUILD_LOCK_S:
        raise UserError(f"{lock} is {age / 60:.0f} minutes old, left by a process killed while loading DeepSpeed's "
                        f"{extension} op; delete it if no build is running")


def orphaned_build_locks(root: Path) -> list[Path]:
    """The JIT-build locks under `root` (torch's FileBaton, `EXTENSION/lock`) that no process on this host holds.

    torch keeps the lock's file descriptor open from creating the file to deleting it, while it loads or builds
    the op; a lock that no process has open was left by one killed in between, and every later load of that op
    would wait on it forever. A holder on another host sharing the folder is not seen from here."""
    locks = {path.resolve() for path in Path(root).glob("*/lock")}
    if not locks:
        return []
    held = set()
    for fd in Path("/proc").glob("[0-9]*/fd/*"):
        try:
            held.add(Path(os.readlink(fd)))
        except OSError:  # the process or descriptor is gone, or another user's
            continue
    return sorted(locks - held)


def _unlink_shm_allreduce_buffer() -> None:
    """Drop the name of this rank's shared-memory allreduce buffer once every local rank has mapped it.

    DeepSpeed's CPU comm op creates /dev/shm/deepspeed_allreduce_buffer_* (69 MB a rank) and never
    unlinks it, so every run, and every kill -9, would leave RAM-backed files behind until the machine
    fills. The mappings stay valid after the unlink, and the kernel frees the memory when the last rank exits.
    """
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}"
            f"_{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank has opened every peer's buffer by now
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def plain_cuda_arch_list() -> None:
    """DeepSpeed 0.19's op builder parses TORCH_CUDA_ARCH_LIST as `major.minor` integers, so an image's
    `9.0a` (the arch-specific Hopper target) fails every fused-optimizer build with "invalid literal for
    int(): '0a'". Keep the plain targets; the fused optimizers need nothing arch-specific."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return
    entries = value.replace(";", " ").split()
    plain = [e.rstrip("af") if e[:1].isdigit() else e for e in entries]
    if plain != entries:
        os.environ["TORCH_CUDA_ARCH_LIST"] = " ".join(dict.fromkeys(plain))
        if os.environ.get("RANK", "0") == "0":
            print(f"truneg: TORCH_CUDA_ARCH_LIST {value!r} -> {os.environ['TORCH_CUDA_ARCH_LIST']!r} "
                  "(DeepSpeed's op builder reads plain major.minor targets)", flush=True)


def seed(run_seed: int, rank: int | None = None, step: int | None = None) -> None:
    """The run's seeding, all of it:
    - `seed(s)`: before the model is built, the same on every rank (identical initial weights; ZeRO-3
      partitions each rank's copy);
    - `seed(s, rank)`: for training, different per rank (dropout and Gumbel noise);
    - `seed(s, rank, step)`: a resume that has no saved RNG state for this rank (another world size).
    Masking draws from its own generators, a pure function of (seed, epoch, sequence), and needs none of this."""
    if rank is None:
        value = run_seed
    elif step is None:
        value = run_seed + rank
    else:
        value = run_seed * 1_000_003 + step * 1_009 + rank
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)
