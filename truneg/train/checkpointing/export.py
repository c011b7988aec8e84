"""Export a truneg ZeRO checkpoint to HF `save_pretrained` folders.

The weights come from fp32_state_dict (any world size): DeepSpeed's zero_to_fp32 for ZeRO-1/2/3
partitions, BF16_Optimizer's fp32 masters for the bf16 recipes, and at ZeRO-0 the model file's weights as the
run held them (fp16 in an fp16 run). The HF configs were saved beside the checkpoints when the run started.

    truneg export runs/demo/checkpoints runs/demo/hf            # BERT, RoBERTa: one MLM folder
                                                                # ELECTRA: hf/generator and hf/discriminator
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, ElectraForMaskedLM, ElectraForPreTraining

from truneg.data.blocks import DEFAULT_TOKENIZER, load_tokenizer
from truneg.errors import UserError, check_output_path
from truneg.model.families import mlm_class
from truneg.model.pretrainers import ElectraPretrainer, ObjectiveConfig
from truneg.train.checkpointing import checkpoint, integrity
from truneg.train.checkpointing.checkpoint import HF_CONFIG_DIR

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# the pre-trainer's parts; "mlm" is the masked LM of the config's model_type (BertForMaskedLM, RobertaForMaskedLM, ...)
PARTS = {"mlm": None, "generator": ElectraForMaskedLM, "discriminator": ElectraForPreTraining}
TOKENIZER_DIR = "tokenizer"
POOLER_FILE = "pooler.safetensors"  # beside the configs: a continued BERT's pooler as loaded (model/carried.py)
# beside the configs: the frozen parameters of a --train-only head run in fp32 as the run started (every name of
# each, tied ones too), which zero_to_fp32 omits at ZeRO-1, BF16_Optimizer's partitions never hold, and a bf16 or
# fp16 model file holds rounded
FROZEN_FILE = "frozen.safetensors"


def frozen_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen parameters (`--train-only head`) under every name the state dict gives them (tied ones too), in
    fp32 on the host: taken before the engine partitions or casts them."""
    return {name: value.detach().float().cpu().clone() for name, value in model.state_dict(keep_vars=True).items()
            if isinstance(value, nn.Parameter) and not value.requires_grad}


def save_hf_configs(model: nn.Module, checkpoint_dir: Path, tokenizer: PreTrainedTokenizerBase,
                    resumed: bool = False, frozen: dict[str, torch.Tensor] | None = None) -> None:
    """Write the HF config of each part and the run's tokenizer, so export can rebuild the classes without
    the training flags and ship the vocab the model was trained on. A continued BERT's pooler, and the `frozen`
    parameters (frozen_weights'), are written at a start; a resume (`resumed`) keeps those its run started from."""
    for part in PARTS:
        if hasattr(model, part):
            getattr(model, part).config.save_pretrained(checkpoint_dir / HF_CONFIG_DIR / part)
    folder = checkpoint_dir / HF_CONFIG_DIR / TOKENIZER_DIR
    save_tokenizer(tokenizer, Path(tokenizer.name_or_path), folder)
    for tensors, saved in ((getattr(model, "pooler", None), checkpoint_dir / HF_CONFIG_DIR / POOLER_FILE),
                           (frozen or None, checkpoint_dir / HF_CONFIG_DIR / FROZEN_FILE)):
        if not resumed:  # never an earlier start's (one stopped before its first checkpoint, from another commit)
            saved.unlink(missing_ok=True)
        if tensors is not None and not saved.is_file():
            partial = saved.with_suffix(".tmp")  # a kill mid-write leaves no file that a resume would keep
            save_file(tensors, partial)
            partial.replace(saved)


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, source: Path, folder: Path) -> None:
    """The tokenizer, and its source folder's vocab.txt: transformers 5 writes only tokenizer.json, and older
    readers and the synonym tables want vocab.txt."""
    tokenizer.save_pretrained(folder)
    if (source / "vocab.txt").is_file():
        shutil.copyfile(source / "vocab.txt", folder / "vocab.txt")


def load_parts(checkpoint_path: str | Path) -> tuple[dict, int]:
    """Rebuild the HF models of a checkpoint with its fp32 weights. Returns ({part: model}, step)."""
    checkpoint_dir, tag = checkpoint.resolve_tag(checkpoint_path)
    names = [p for p in PARTS if (checkpoint_dir / HF_CONFIG_DIR / p / "config.json").is_file()]
    if not names:
        raise UserError(f"{checkpoint_dir} has no {HF_CONFIG_DIR}/; it was not written by truneg pretrain")
    try:
        configs = {p: AutoConfig.from_pretrained(checkpoint_dir / HF_CONFIG_DIR / p) for p in names}
    except (OSError, ValueError) as err:  # transformers' own line names the file; a traceback would bury it
        raise UserError(f"cannot read the model configs in {checkpoint_dir / HF_CONFIG_DIR} ({str(err)[:200]}); "
                        "the checkpoint folder is damaged") from None
    parts = {p: (PARTS[p] or mlm_class(config.model_type))(config) for p, config in configs.items()}
    if "generator" in parts:
        holder = ElectraPretrainer(parts["generator"], parts["discriminator"], ObjectiveConfig())
    else:  # the pre-trainer's `mlm.` keys onto a bare masked LM
        holder = nn.Module()
        holder.mlm = parts["mlm"]
    weights = fp32_state_dict(checkpoint_dir, tag)
    frozen = checkpoint_dir / HF_CONFIG_DIR / FROZEN_FILE
    if frozen.is_file():  # a --train-only head run's frozen weights, in fp32 as they started: bitwise
        weights.update(load_file(frozen))
    load_into(holder, weights, str(checkpoint_dir / tag))
    return parts, checkpoint.step_of_tag(tag)


def run_tokenizer_dir(checkpoint_dir: Path) -> Path:
    """The run's own tokenizer, saved beside its configs (runs from before that: bert-base-uncased's)."""
    saved = checkpoint_dir / HF_CONFIG_DIR / TOKENIZER_DIR
    return saved if saved.is_dir() else Path(DEFAULT_TOKENIZER)


def export(checkpoint_path: str | Path, out_dir: str | Path, tokenizer_dir: str | Path | None = None) -> dict[str,
                                                                                                              Path]:
    """Write each part with save_pretrained (and the tokenizer beside it). Returns {part: folder}."""
    out_dir = Path(out_dir)
    check_output_path(out_dir, "export to")  # a file there, save_pretrained would only log it; before the reading
    if tokenizer_dir is None:
        tokenizer_dir = run_tokenizer_dir(checkpoint.resolve(checkpoint_path)[0])
    tokenizer = load_tokenizer(tokenizer_dir)  # before the consolidation, which takes minutes for BERT-large
    parts, _ = load_parts(checkpoint_path)
    pooler_file = checkpoint.resolve(checkpoint_path)[0] / HF_CONFIG_DIR / POOLER_FILE
    pooler = load_file(pooler_file) if pooler_file.is_file() else {}  # the fp32 tensors as saved: bitwise
    written = {}
    for name, model in parts.items():
        folder = out_dir if name == "mlm" else out_dir / name
        # a continued BERT's (RoBERTa's) pooler beside its MLM head, as in its public weights (finetune starts from it)
        model.save_pretrained(folder, **({"state_dict": {**model.state_dict(), **pooler}} if name == "mlm" and pooler
                                         else {}))
        save_tokenizer(tokenizer, Path(tokenizer_dir), folder)
        written[name] = folder
    return written


# ---------------------------------------------------------------------------------------------------
# A tag's fp32 weights (export, analysis, continued pre-training from an export)
# ---------------------------------------------------------------------------------------------------


def fp32_state_dict(checkpoint_dir: Path, tag: str) -> dict:
    """The consolidated fp32 weights of a tag (any ZeRO stage, any world size): DeepSpeed's zero_to_fp32 for
    ZeRO-1/2/3. It reads ZeRO partitions only; a ZeRO-0 tag (the LAMB recipe's) has none, and its one model file
    holds the whole model as it ran (in fp16 runs, the fp16 weights; their fp32 masters are optimizer state).
    Nor does it read BF16_Optimizer's partitions (the bf16 recipes': bf16 at ZeRO-1, fp32 accumulation).

    The tag's files are checked against its manifest before any is unpickled, and unpickled with torch's safe
    unpickler (integrity.load_deepspeed_file): zero_to_fp32's own full unpickling reads only files that passed it."""
    tag_dir = checkpoint_dir / tag
    integrity.verify_before_reading(tag_dir)
    try:
        model_file = tag_dir / "mp_rank_00_model_states.pt"  # ZeRO-3 writes one per rank instead
        if model_file.is_file():
            states = integrity.load_deepspeed_file(model_file)
            if (states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0) == 0:
                return {name: value.float() for name, value in states["module"].items()}
            partitions = _bf16_optimizer_partitions(tag_dir)
            if partitions:
                return _bf16_optimizer_weights(states, partitions)
            del states
        for path in sorted(tag_dir.glob("*_states.pt")):  # what zero_to_fp32 unpickles (memory-mapped here: cheap)
            integrity.load_deepspeed_file(path)
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    except UserError:
        raise
    except Exception as err:  # zero_to_fp32 raises ValueError, FileNotFoundError, pickle errors, ...
        raise UserError(f"cannot read checkpoint {checkpoint_dir / tag} "
                        f"({type(err).__name__}: {str(err)[:200]})") from None


BF16_PARTITION = "bf16_zero_pp_rank_"  # a bf16 run's partitions: bf16_zero_pp_rank_{dp rank}_mp_rank_00_optim_states.pt


def _bf16_optimizer_partitions(tag_dir: Path) -> list[dict]:
    """BF16_Optimizer's optimizer states, in data-parallel rank order (memory-mapped), or [] when the tag has
    none. DeepSpeed names every bf16 run's partitions so; only BF16_Optimizer's lack the ZeRO stage that
    zero_to_fp32 reads (a bf16 run without fp32 accumulation has ZeRO's own optimizer)."""
    paths = sorted(tag_dir.glob(f"{BF16_PARTITION}*_optim_states.pt"),
                   key=lambda f: int(f.name.removeprefix(BF16_PARTITION).split("_")[0]))
    partitions: list[dict] = []
    for path in paths:
        partitions.append(integrity.load_deepspeed_file(path)["optimizer_state_dict"])
        if "zero_stage" in partitions[0]:
            return []
    return partitions


def _bf16_optimizer_weights(states: dict, partitions: list[dict]) -> dict:
    """The fp32 master weights of BF16_Optimizer's partitions, in data-parallel rank order. Each rank holds
    consecutive slices of every flat parameter group, and `param_slice_mappings` names the fragment
    (start, numel) of each parameter in its slice; buffers and tied parameters come as zero_to_fp32 takes
    them (the model file's `buffer_names` and `shared_params`)."""
    fragments: dict[str, list[torch.Tensor]] = {}
    for optimizer in partitions:
        for flat, mapping in zip(optimizer["single_partition_of_fp32_groups"], optimizer["param_slice_mappings"]):
            for name, fragment in mapping.items():
                fragments.setdefault(name, []).append(flat.narrow(0, fragment.start, fragment.numel))
    weights = {}
    for group in states["param_shapes"]:
        for name, shape in group.items():
            flat = torch.cat(fragments.get(name, [torch.empty(0)]))
            if flat.numel() != shape.numel():
                raise ValueError(f"{name}: {flat.numel()} values in {len(partitions)} partitions for shape "
                                 f"{tuple(shape)}")
            weights[name] = flat.view(shape).clone()
    weights.update({name: value.float() if value.is_floating_point() else value
                    for name, value in states["module"].items() if name in states["buffer_names"]})
    for name, shared in states["shared_params"].items():
        if shared in weights:  # (a frozen one is not in the partitions: the run's frozen file holds it)
            weights[name] = weights[shared]
    return weights


def load_into(module: torch.nn.Module, state_dict: dict, where: str) -> None:
    """load_state_dict with a strict key check and one clear line on a mismatch (DeepSpeed's own
    load_state_dict_from_zero_checkpoint loads with strict=False and would hide it)."""
    missing, unexpected = module.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UserError(f"checkpoint {where} does not match its config: missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]}")
