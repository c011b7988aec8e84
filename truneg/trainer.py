"""The stages of `pretrain.py`: processes, config, output folder, data, engine, resume and the loop.

The trainer's state is small and explicit (`TrainState`): the engine holds the model, optimizer,
scheduler and step; the sampler holds the data position; the metric accumulator and the RNG states
are per rank. All of it goes into checkpoints.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from truneg import checkpoint
from truneg.errors import UserError
from truneg.export import save_hf_configs

RUN_FILE = "run.json"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed() -> tuple[int, int]:
    """deepspeed.init_distributed with gloo on the CPU; `python -m truneg.pretrain` runs as a world of one."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "gloo" if get_accelerator().device_name() == "cpu" else None
    if backend == "gloo":
        _refuse_stale_build_lock("deepspeed_shm_comm")
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    if backend == "gloo":
        _unlink_shm_allreduce_buffer()
    return dist.get_rank(), dist.get_world_size()


STALE_BUILD_LOCK_S = 600


def _refuse_stale_build_lock(extension: str) -> None:
    """torch takes a lock file on every load of a JIT-built op; a process killed in that second leaves it
    behind, and every later launch would wait on it forever without a word. A build takes about a minute."""
    try:  # torch's own rule for where the op is built (a private helper, hence the guard)
        from torch.utils.cpp_extension import _get_build_directory

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


def deepspeed_config(args, world_size: int) -> dict:
    from truneg.config import default_config_path, prepare_config

    path = args.deepspeed_config or default_config_path()
    config = prepare_config(
        path, world_size, args.max_steps, args.output_dir,
        micro_batch=args.micro_batch_size, grad_accum=args.gradient_accumulation_steps, lr=args.lr,
    )
    if config.get("fp16", {}).get("enabled"):
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            raise UserError(f"{path} enables fp16, which the CPU does not support; use ds_configs/cpu_zero2.json")
    return config


def run_identity(args, ds_config: dict) -> dict:
    """What makes two invocations the same run: everything but lengths, intervals and monitor paths."""
    per_world = ("tensorboard", "csv_monitor", "wandb", "comet", "train_micro_batch_size_per_gpu",
                 "gradient_accumulation_steps", "checkpoint")
    config = {k: copy.deepcopy(v) for k, v in ds_config.items() if k not in per_world}
    scheduler = config.get("scheduler", {}).get("params", {})
    scheduler.pop("total_num_steps", None)
    return {
        "model": args.model, "train_data": sorted(str(Path(p).resolve()) for p in args.train_data),
        "tokenizer": str(args.tokenizer), "seq_len": args.seq_len, "seed": args.seed,
        "init_from": args.init_from, "hc": args.hc, "hc_prediction": args.hc_prediction, "sr": args.sr,
        "sr_weight": args.sr_weight, "dropout": args.dropout, "ds_config": config,
    }


def claim_output_dir(args, ds_config: dict, rank: int) -> None:
    """Refuse an --output-dir holding another run's checkpoints unless --overwrite; record this run."""
    out: Path = args.output_dir
    identity = json.loads(json.dumps(run_identity(args, ds_config)))
    run_file = out / RUN_FILE
    has_checkpoints = (out / "checkpoints").is_dir() and any((out / "checkpoints").iterdir())
    if run_file.is_file():
        try:
            previous = json.loads(run_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            previous = None
        different = previous != identity
    else:
        different = has_checkpoints
    fresh_start = args.resume == "none" and has_checkpoints
    if (different and has_checkpoints or fresh_start) and not args.overwrite:
        what = "another run's checkpoints" if different else "checkpoints of this run"
        raise UserError(
            f"{out} holds {what}; resume it with --resume auto and the same arguments, choose another "
            "--output-dir, or pass --overwrite to delete them"
        )
    dist.barrier()  # every rank has read run.json before rank 0 rewrites it
    if rank == 0:
        if args.overwrite:
            for name in ("checkpoints", "tensorboard", "csv"):
                shutil.rmtree(out / name, ignore_errors=True)
            (out / "metrics.jsonl").unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        tmp = run_file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(identity, indent=2) + "\n", encoding="utf-8")
        tmp.replace(run_file)
    dist.barrier()


def load_blocks(args):
    """Tokenizer and the memory-mapped blocks; each node's local rank 0 builds the cache first."""
    from truneg.data import build_blocks, load_tokenizer, open_blocks

    tokenizer = load_tokenizer(args.tokenizer)
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        path = build_blocks(args.train_data, tokenizer, args.seq_len, args.cache_dir, args.num_proc)
    dist.barrier()
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        path = build_blocks(args.train_data, tokenizer, args.seq_len, args.cache_dir, args.num_proc)
    return tokenizer, open_blocks(path)


def synonym_lookup(args, tokenizer):
    """--hc none | wordnet | embedding | FILE.npz -> SynonymLookup (or None)."""
    from truneg.synonyms import SHIPPED_WORDNET_TABLE, SynonymLookup, SynonymTable, build_from_embeddings

    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if args.hc == "none":
        return None
    if args.hc == "wordnet":
        from truneg.synonyms import build_from_wordnet, vocab_sha256

        shipped = SynonymTable.load(SHIPPED_WORDNET_TABLE) if SHIPPED_WORDNET_TABLE.is_file() else None
        if shipped is not None and shipped.sha256 == vocab_sha256(tokens):
            return SynonymLookup(shipped)
        return SynonymLookup(build_from_wordnet(tokens))  # another vocab: about 3 s
    if args.hc == "embedding":
        if not args.hc_embeddings:
            raise UserError("--hc embedding needs --hc-embeddings (a word2vec file or an HF model folder)")
        return SynonymLookup(build_from_embeddings(tokens, args.hc_embeddings))
    if not args.hc.endswith(".npz"):
        raise UserError(f"--hc {args.hc!r}: use none, wordnet, embedding or a FILE.npz built by `truneg synonyms build`")
    return SynonymLookup(SynonymTable.load(args.hc, expect_tokens=tokens))


def build_engine(args, ds_config: dict, tokenizer):
    import deepspeed

    from truneg.models import ObjectiveConfig, build_pretrainer

    objective = ObjectiveConfig(synonym_lookup(args, tokenizer), args.hc_prediction, args.sr, args.sr_weight)
    torch.manual_seed(args.seed)  # identical initial weights on every rank (ZeRO-3 partitions each rank's copy)
    model = build_pretrainer(args.model, objective, args.init_from, args.dropout)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    except (AssertionError, ValueError) as err:
        raise UserError(f"DeepSpeed rejected the config: {str(err)[:300]}") from None
    if args.compile:
        engine.compile(compile_kwargs={"dynamic": True})  # the masked-only head has a varying row count
    if dist.get_rank() == 0:
        save_hf_configs(model, args.output_dir / "checkpoints")
    return engine


@dataclass
class ResumePoint:
    checkpoint_dir: Path
    tag: str
    universal: bool  # written on another world size: loaded through DeepSpeed's universal checkpoint


def find_resume_point(args, ds_config: dict, world_size: int) -> ResumePoint | None:
    """Where --resume points; on a world size other than the checkpoint's, convert it to a universal
    checkpoint (DeepSpeed's ds_to_universal, once, on rank 0) and switch the config to load it."""
    if args.resume == "none":
        return None
    checkpoint_dir, tag = args.output_dir / "checkpoints", None
    if args.resume != "auto":
        checkpoint_dir, tag = _resume_target(Path(args.resume))
    tag = tag or checkpoint.latest_tag(checkpoint_dir)
    if tag is None and args.resume == "auto":
        return None
    if tag is None or not (checkpoint_dir / tag).is_dir():
        raise UserError(f"checkpoint {checkpoint_dir / str(tag)} does not exist; pass --resume a checkpoints folder or a tag in it")
    saved_world = checkpoint.saved_world_size(checkpoint_dir, tag)
    if saved_world in (None, world_size):
        return ResumePoint(checkpoint_dir, tag, universal=False)
    if dist.get_rank() == 0:
        checkpoint.convert_to_universal(checkpoint_dir, tag)
    dist.barrier()
    ds_config.setdefault("checkpoint", {})["load_universal"] = True
    if dist.get_rank() == 0:
        print(f"truneg: {tag} was written by {saved_world} ranks; loading its universal form on {world_size}", flush=True)
    return ResumePoint(checkpoint_dir, checkpoint.universal_tag(tag), universal=True)


@dataclass
class TrainState:
    """Everything the loop mutates besides the engine."""

    sampler: object
    batches: object
    metrics: object
    rank: int
    world_size: int
    checkpoint_dir: Path

    @classmethod
    def start(cls, args, engine, blocks, tokenizer, resume: ResumePoint | None) -> TrainState:
        from truneg.data import MaskedBatches, ResumableSampler
        from truneg.metrics import MetricsLogger

        rank, world_size = dist.get_rank(), dist.get_world_size()
        micro = engine.train_micro_batch_size_per_gpu()
        sampler = ResumableSampler(len(blocks), micro, world_size, rank, args.seed)
        metrics = MetricsLogger(engine, args.output_dir, args.seq_len, rank)
        torch.manual_seed(args.seed + rank)  # dropout and Gumbel noise differ across ranks
        if resume is not None:
            client_state, rank_state = checkpoint.load(engine, resume.checkpoint_dir, resume.tag)
            sampler.load_state_dict(client_state["sampler"])
            step = engine.global_steps
            if rank_state is None:
                print(f"truneg: warning: rank {rank} has no RNG state for world size {world_size} in the checkpoint; "
                      "reseeding (the run continues, but not bitwise as on the old world size)", flush=True)
                torch.manual_seed(args.seed * 1_000_003 + step * 1_009 + rank)
            else:
                checkpoint.set_rng_state(rank_state["rng"])
                metrics.load_state_dict(rank_state["metrics"])
            if rank == 0:
                print(f"truneg: resumed from {resume.checkpoint_dir} at step {step}", flush=True)
        # Records a killed run wrote after its last checkpoint (or before its first) are not history.
        metrics.truncate_after(engine.global_steps)
        metrics.purge_tensorboard_after(int(engine.global_samples))
        batches = MaskedBatches(blocks, sampler, tokenizer, engine.module.scheme, args.seed)
        return cls(sampler, batches, metrics, rank, world_size, args.output_dir / "checkpoints")

    def save(self, engine, step: int) -> None:
        client_state = {"step": step, "sampler": self.sampler.state_dict(), "world_size": self.world_size}
        rank_state = {"rng": checkpoint.rng_state(), "metrics": self.metrics.state_dict()}
        checkpoint.save(engine, self.checkpoint_dir, step, client_state, rank_state)


def _resume_target(path: Path) -> tuple[Path, str | None]:
    """--resume DIR: a checkpoints folder (its `latest`) or one tag folder inside it."""
    if (path / "latest").is_file():
        return path, None
    if path.is_dir() and path.parent.is_dir():
        return path.parent, path.name
    raise UserError(f"--resume {path}: no such checkpoint folder; pass a checkpoints folder or one of its tags")


class StopSignal:
    """SIGTERM/SIGINT set a flag; the loop all-reduces it at each step boundary, saves and exits."""

    def __init__(self):
        self.received: int | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def any_rank(self, device) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)


def _all_finite(loss: torch.Tensor) -> bool:
    flag = torch.isfinite(loss.detach()).float().reshape(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def train(args, engine, state: TrainState) -> None:
    device = engine.device
    stop = StopSignal()
    check_finite = not engine.fp16_enabled()  # in fp16 the loss scaler owns overflow
    nonfinite_in_a_row = 0
    micro_batch = engine.train_micro_batch_size_per_gpu()
    started, start_step = time.perf_counter(), engine.global_steps
    step = start_step
    while engine.global_steps < args.max_steps:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(state.batches).items()}
        loss, stats = engine(**batch)
        if check_finite and not _all_finite(loss):
            # Skip this micro-batch on every rank: no backward, no optimizer step, counted in the metrics.
            nonfinite_in_a_row += 1
            state.metrics.count_nonfinite()
            if nonfinite_in_a_row >= args.max_nonfinite_steps:
                last = checkpoint.latest_tag(state.checkpoint_dir) or "none yet"
                raise UserError(
                    f"{nonfinite_in_a_row} non-finite losses in a row at step {engine.global_steps}; stopped. "
                    f"The last good checkpoint ({last}) is intact: lower --lr or check the data, then resume"
                )
            continue
        nonfinite_in_a_row = 0
        engine.backward(loss)
        engine.step()
        state.metrics.add(stats, loss, micro_batch)
        if engine.global_steps == step:
            continue  # inside gradient accumulation
        step = engine.global_steps
        if step % args.log_steps == 0 or step == args.max_steps:
            record = state.metrics.log(step)
            if state.rank == 0 and record:
                print(f"step {step}: loss {record['loss']:.4f}  lr {record['lr']:.2e}  "
                      f"{record['samples_per_sec']:.1f} samples/s", flush=True)
        saving = args.save_steps > 0 and (step % args.save_steps == 0 or step == args.max_steps)
        if saving:
            state.save(engine, step)
        if stop.any_rank(device):
            if not saving:
                state.save(engine, step)
            if state.rank == 0:
                print(f"truneg: stopped by signal at step {step}; checkpoint saved in {state.checkpoint_dir}. "
                      "Run the same command to resume.", flush=True)
            return
    if state.rank == 0:
        elapsed = time.perf_counter() - started
        out = args.output_dir
        print(f"truneg: done, {engine.global_steps - start_step} steps in {elapsed:.0f} s\n"
              f"  checkpoints: {out / 'checkpoints'} (resume: run the same command)\n"
              f"  metrics:     {out / 'metrics.jsonl'}\n"
              f"  tensorboard: tensorboard --logdir {out / 'tensorboard'}", flush=True)
