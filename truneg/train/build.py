"""Building the run's parts: the data, the synonym lookup for HC, and the model on a DeepSpeed engine."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from truneg.data.blocks import ensure_prepared, load_tokenizer, open_prepared, whole_word_problem
from truneg.data.words import tokenizer_kind
from truneg.errors import UserError
from truneg.model import hub
from truneg.model.compile import compile_layers
from truneg.model.head import freeze_all_but_the_head, untie_decoder
from truneg.model.pretrainers import ObjectiveConfig, build_pretrainer, checkpoint_activations, parameter_groups
from truneg.synonyms.sources import build_from_embeddings, wordnet_for_vocab
from truneg.synonyms.table import WORD_STARTS, SynonymLookup, SynonymTable
from truneg.train.checkpointing import checkpoint, phases
from truneg.train.config.args import parse_args
from truneg.train.config.checks import deepspeed_optimizer, resolve_config, start_problems
from truneg.train.config.run_config import HC_SOURCES, RunConfig
from truneg.train.fused_grads import fuse_bf16_grad_accumulation
from truneg.train.ranks import distributed

if TYPE_CHECKING:
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine
    from transformers import PreTrainedTokenizerBase

    from truneg.data.blocks import PreparedBlocks


def deepspeed_config(cfg: RunConfig, world_size: int, load_universal: bool = False) -> dict:
    """The DeepSpeed config as deepspeed.initialize gets it: the file (or the default for the preset and the
    hardware), the batch split for this world size, the command-line overrides, and the checkpoint format
    to load. The same checks as `truneg preflight`; rank 0 prints what was chosen."""
    config, choices = resolve_config(cfg, world_size)
    problems = start_problems(cfg, config, world_size)
    if problems:
        raise UserError(problems[0] if len(problems) == 1 else "; ".join(problems))
    if os.environ.get("RANK", "0") == "0":
        for line in choices:
            print(f"truneg: {line}", flush=True)
    if load_universal:
        config.setdefault("checkpoint", {})["load_universal"] = True
    return config


@dataclass
class Start:
    """What the checks before any process group found: every later stage starts from it."""

    ds_config: dict
    tokenizer: PreTrainedTokenizerBase
    table: SynonymTable | None
    resume: checkpoint.ResumePoint | None  # this run's checkpoint, or (phase 2's start) the phase-1 tag
    prepared: Path | None = None  # the prepared folder of --train-data, on each node's local rank 0
    phase1: phases.Phase1 | None = None  # --phase1-checkpoint's
    eval_table: SynonymTable | None = None  # Table 2 live's, and HC's reach without HC (start_eval_table)


# DeepSpeed's fused optimizers, built just in time (and loaded under a lock) by the op of this name.
JIT_OPTIMIZER_OPS = {"FusedAdam": "fused_adam", "FusedLamb": "fused_lamb"}


def checked_start(argv: list[str] | None = None) -> tuple[RunConfig, Start]:
    """Parse pretrain.py's arguments and run every check that needs no process group (see check_start)."""
    distributed.adopt_launcher_env()  # RANK, WORLD_SIZE, LOCAL_RANK from mpirun/srun, before anything reads them
    cfg = RunConfig.from_args(parse_args(argv))
    afresh = cfg.overwrite or cfg.resume == "none"  # (not from the tag a phase 2 there recorded)
    phase1 = phases.find_phase1(cfg.phase1_checkpoint, cfg.output_dir, pinned=not afresh) \
        if cfg.phase1_checkpoint else None
    if phase1 is not None:
        cfg = phases.adopt(cfg, phase1)
    start = check_start(cfg, distributed.launch_world_size(), phase1)
    return cfg, start


def check_start(cfg: RunConfig, world_size: int, phase1: phases.Phase1 | None = None) -> Start:
    """Everything that needs no process group, before `deepspeed.init_distributed`: the DeepSpeed config for
    this world size, the resume point (phase 2's own checkpoint, else the `phase1` tag it starts from), the
    tokenizer, the synonym table, and the corpus (prepared here on each node's local rank 0: a collective would
    time out while a large corpus is tokenized). A mistake is one line on every rank, before any rank waits on
    another."""
    if get_accelerator().device_name() == "cpu":
        distributed.refuse_stale_build_lock("deepspeed_shm_comm")  # gloo ranks load DeepSpeed's CPU comm op
    else:
        distributed.plain_cuda_arch_list()
    if cfg.profile_ranks and cfg.profile_ranks[-1] >= world_size:
        raise UserError(f"--profile-ranks {','.join(map(str, cfg.profile_ranks))} names a rank beyond this launch's "
                        f"{world_size} (global ranks 0 to {world_size - 1}); name ranks below {world_size}")
    if cfg.resume not in ("auto", "none") and (problem := phases.resume_across_lengths_problem(cfg.resume,
                                                                                               cfg.seq_len)):
        raise UserError(problem)
    fresh = cfg.resume == "none" or cfg.overwrite
    resume = None if fresh else checkpoint.find_resume_point(cfg.resume, cfg.output_dir)
    if resume is None and phase1 is not None:
        resume = phase1.resume_point(cfg.output_dir)
    ds_config = deepspeed_config(cfg, world_size, load_universal=bool(resume and resume.universal(world_size)))
    jit_op = JIT_OPTIMIZER_OPS.get(deepspeed_optimizer(ds_config)[0])
    if jit_op and get_accelerator().device_name() != "cpu":
        distributed.refuse_stale_build_lock(jit_op)  # built on each node on first use, in its node-local folder
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.whole_word_masking and (problem := whole_word_problem(tokenizer, cfg.tokenizer, cfg.train_data,
                                                                 cfg.seq_len)):
        raise UserError(problem)
    table = synonym_table(cfg, tokenizer)
    if phase1 is not None and (problem := phases.config_problem(phase1, ds_config, table_fingerprint(table))):
        raise UserError(problem)
    prepared = None
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        prepared = ensure_prepared(cfg.train_data, tokenizer, cfg.seq_len, cfg.cache_dir, cfg.num_proc)
    return Start(ds_config, tokenizer, table, resume, prepared, phase1, start_eval_table(cfg, tokenizer, table))


def open_blocks(cfg: RunConfig, start: Start) -> tuple[PreparedBlocks, dict]:
    """The memory-mapped blocks on every rank, once each node's local rank 0 has prepared them (a collective).
    Returns (blocks, the run-record entry naming the prepared data)."""

    # Every rank learns where its node's local rank 0 found or made the folder: finding it again would plan
    # the corpus on every rank (for an `hf:` dataset on the Hub, a request per rank and file at once).
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (socket.gethostname(), start.prepared and str(start.prepared)))
    folder = start.prepared or next((Path(f) for host, f in found if host == socket.gethostname() and f), None)
    if folder is None or not folder.is_dir():  # no local rank 0 on this host (an odd rank mapping)
        folder = ensure_prepared(cfg.train_data, start.tokenizer, cfg.seq_len, cfg.cache_dir, cfg.num_proc,
                                 prepare=False)
    blocks = open_prepared(folder, start.tokenizer, cfg.seq_len)
    return blocks, {"data": blocks.fingerprint}


def synonym_table(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase) -> SynonymTable | None:
    """--hc none | wordnet | embedding | FILE.npz -> SynonymTable (or None)."""

    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if cfg.hc == "none":
        return None
    if (kind := tokenizer_kind(tokenizer)) not in WORD_STARTS:
        raise UserError(f"--hc {cfg.hc}: --tokenizer {cfg.tokenizer} is {kind or 'of no kind truneg can read'}, and "
                        f"truneg's synonym tables read {', '.join(WORD_STARTS)} vocabularies only, whose whole words "
                        "they can tell; train without --hc, or with a tokenizer of those kinds")
    if cfg.hc == "wordnet":
        table = wordnet_for_vocab(tokens, kind)
        if table.num_entries == 0:
            raise UserError(f"--hc wordnet: no word of the vocab of --tokenizer {cfg.tokenizer} has a WordNet synonym "
                            "in it, so HC would correct nothing; it needs whole words as tokens")
        return table
    if cfg.hc == "embedding":
        if not cfg.hc_embeddings:
            raise UserError("--hc embedding needs --hc-embeddings (a word2vec file or an HF model folder)")
        return build_from_embeddings(tokens, cfg.hc_embeddings, kind=kind)
    if not cfg.hc.endswith(".npz"):
        raise UserError(f"--hc {cfg.hc!r}: use {', '.join(HC_SOURCES)} or a FILE.npz built by `truneg synonyms build`")
    return SynonymTable.load(cfg.hc, expect_tokens=tokens)


def wordnet_table(tokenizer: PreTrainedTokenizerBase) -> SynonymTable:
    """What Table 2 live counts with by default: the shipped WordNet table, or one built for another vocab."""
    kind = tokenizer_kind(tokenizer)  # (one truneg cannot read: as WordPiece)
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return wordnet_for_vocab(tokens, kind if kind in WORD_STARTS else "WordPiece")


def eval_table(tokenizer: PreTrainedTokenizerBase, path: str | Path | None = None) -> SynonymTable:
    """The one table every run's Table 2 live counts with, whatever its own HC table (so that a kNN run's ratios
    compare with its baseline's): `path` (--eval-synonyms), else WordNet's."""
    if path is None:
        return wordnet_table(tokenizer)
    return SynonymTable.load(path, expect_tokens=tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))


def start_eval_table(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase,
                     table: SynonymTable | None) -> SynonymTable | None:
    """The run's eval table, found once: what Table 2 live counts with (--eval-synonyms, else WordNet's: for a
    `--hc wordnet` run the HC table it already built) and, without HC, what HC's reach is counted with. None where
    neither needs one, or where only the reach would and WordNet is not installed (no `hc_reach` then)."""
    if cfg.hc == "wordnet" and not cfg.eval_synonyms:
        return table
    if not cfg.eval_data and table is not None:
        return None
    try:
        return eval_table(tokenizer, cfg.eval_synonyms)
    except UserError as err:
        if not cfg.eval_data:
            return None
        raise UserError(f"--eval-synonyms: {err}" if cfg.eval_synonyms else str(err)) from None


def table_fingerprint(table: SynonymTable | None) -> str | None:
    """The synonym table's content hash for the run record: a rebuilt table is another run."""
    return None if table is None else table.content_sha256


# The run's checkpoint flags: RunConfig field -> flag, and the run record's field for a hub name's commit.
INIT_FLAGS = {"init_from": ("--init-from", "init_revision"),
              "init_generator": ("--init-generator", "init_generator_revision")}


def locate_on_each_node(spec: str, flag: str) -> hub.Checkpoint:
    """A collective: a folder, or a hub name's snapshot in the HF cache. Rank 0 resolves the name first (downloading
    what its cache lacks), and every rank then takes that commit: the other nodes' local rank 0 next (downloading
    only what their node's cache lacks: nothing where the HF cache is shared, so no two nodes write one file), then
    the other ranks from their node's cache only. One download per node at most, never one per rank, and one commit
    on every rank even if the hub's branch moves meanwhile."""
    rank, first = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)) == 0
    found: list[hub.Checkpoint] = []
    distributed.on_every_rank(lambda: found.extend([hub.locate(spec, flag)] if rank == 0 else []), f"resolve {flag}")
    commit = [found[0].revision if found else None]
    dist.broadcast_object_list(commit, src=0)
    pinned = spec if commit[0] is None else f"{hub.split_revision(spec)[0]}@{commit[0]}"
    distributed.on_every_rank(lambda: found.extend([hub.locate(pinned, flag)] if first and rank != 0 else []),
                              f"resolve {flag} on each node")
    distributed.on_every_rank(lambda: found.extend([] if first else [hub.locate(pinned, flag, cache_only=True)]),
                              f"resolve {flag} from the node's HF cache")
    commits = [None] * dist.get_world_size()
    dist.all_gather_object(commits, found[0].revision)
    if len(set(commits)) > 1:  # a folder on rank 0's node, and no such folder elsewhere (or the other way round)
        raise UserError(f"{flag} {spec} is a folder on some nodes and a hub name on others (no such folder there): "
                        "pass an absolute path every node sees, or a hub name that no node holds as a folder")
    return hub.Checkpoint(spec, found[0].path, found[0].revision)


def locate_init(cfg: RunConfig) -> dict[str, hub.Checkpoint]:
    """The run's checkpoints to start from (--init-from ...) as folders: {RunConfig field: Checkpoint}."""
    return {field: locate_on_each_node(getattr(cfg, field), flag) for field, (flag, _) in INIT_FLAGS.items()
            if getattr(cfg, field)}


def init_record(init: dict[str, hub.Checkpoint]) -> dict:
    """The run record's commits of the hub names among them (a folder has none)."""
    return {INIT_FLAGS[field][1]: found.revision for field, found in init.items() if found.is_hub}


def build_model(cfg: RunConfig, table: SynonymTable | None, vocab_size: int,
                init: dict[str, hub.Checkpoint] | None = None, reach_table: SynonymTable | None = None
                ) -> torch.nn.Module:
    """The model of the run; `init` is locate_init's (the folders of a run started from checkpoints); `reach_table`
    the table HC's reach is counted with where the run has no HC table."""
    lookup = None if table is None else SynonymLookup(table)
    reach = lookup if lookup is not None or reach_table is None else SynonymLookup(reach_table)
    objective = ObjectiveConfig(hc_lookup=lookup, reach_lookup=reach, hc_prediction=cfg.hc_prediction, sr=cfg.sr,
                                sr_weight=cfg.sr_weight, sr_sent_target=cfg.sr_sent_target)
    distributed.seed(cfg.seed)  # identical initial weights on every rank
    init = init or {}
    folders = {field: init[field].path if field in init else getattr(cfg, field) for field in INIT_FLAGS}
    model = build_pretrainer(cfg.model, objective, folders["init_from"], cfg.dropout, vocab_size,
                             init_generator=folders["init_generator"], new_head=cfg.new_head)
    if cfg.untie_decoder:
        untie_decoder(model.mlm)
    if cfg.train_only == "head":
        freeze_all_but_the_head(model)
    if cfg.activation_checkpointing:
        checkpoint_activations(model)
    return model


def build_engine(cfg: RunConfig, model: torch.nn.Module, ds_config: dict) -> DeepSpeedEngine:
    """deepspeed.initialize with two parameter groups (no weight decay on biases and LayerNorm)."""
    groups = parameter_groups(model)
    try:
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    except (AssertionError, ValueError, TypeError) as err:  # its parser, and a value of the wrong type in a section
        # (betas as a string, ...) that reaches the optimizer it builds
        raise UserError(f"DeepSpeed rejected the config ({type(err).__name__}): {str(err)[:300]}") from None
    fuse_bf16_grad_accumulation(engine.optimizer)  # the bf16 recipes: one multi-tensor add a group, not one a parameter
    if cfg.compile == "whole":
        # Static shapes (an exact number of masked positions, gathered): one graph, no recompiles.
        engine.compile(compile_kwargs={"dynamic": False})
    elif cfg.compile == "layers":
        compile_layers(engine.module)
    return engine
