"""`truneg eval`: a checkpoint's held-out figures offline, the same as a run's live evaluation (truneg.train.heldout).

PATH is a truneg checkpoint tag, a checkpoints folder (each complete tag), an exported folder, or a model name of the
HF hub; an ELECTRA pair on the hub takes the generator's name second, as --init-generator does. The figures carry
metrics.jsonl's names: for the same step they equal the run's record (exactly on the CPU in fp32).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from truneg.data.blocks import DEFAULT_TOKENIZER, load_tokenizer, open_training_blocks
from truneg.errors import UserError
from truneg.model import hub
from truneg.model.pretrainers import BertPretrainer, ElectraPretrainer, ObjectiveConfig, build_pretrainer
from truneg.synonyms.table import SynonymTable
from truneg.train import checkpoint
from truneg.train.export import load_parts, run_tokenizer_dir
from truneg.train.heldout import HeldOut, console_line, run_table, wordnet_table
from truneg.train.run_config import EVAL_MAX_SEQUENCES


@dataclass
class Evaluated:
    label: str
    step: int  # -1: not a truneg tag
    checkpoint_dir: Path | None  # a truneg run's checkpoints folder (its tokenizer and HC table are beside)
    folder: Path | None = None  # an exported or hub folder
    generator: Path | None = None  # ELECTRA's generator beside a hub discriminator


def discover(path: str, generator: str | None = None) -> list[Evaluated]:
    """The models PATH names, oldest tag first."""
    if generator is not None:
        return [Evaluated(path, -1, None, hub.locate(path, "PATH").path, hub.locate(generator, "GENERATOR").path)]
    folder = Path(path)
    if (folder / "config.json").is_file() or (folder / "discriminator" / "config.json").is_file():
        return [Evaluated(path, -1, None, folder)]
    try:
        checkpoint_dir, tag = checkpoint.resolve(folder)
    except UserError:
        if folder.exists() or not hub.is_hub_name(path):
            raise UserError(f"{path} is neither a truneg checkpoint tag or checkpoints folder, an exported folder, nor "
                            "a model name of the HF hub; pass one of those") from None
        return [Evaluated(path, -1, None, hub.locate(path, "PATH").path)]
    tags = [tag] if tag else checkpoint.complete_tags(checkpoint_dir)
    if not tags:
        raise UserError(f"{checkpoint_dir} holds no complete checkpoint; pass a tag, or wait for the run's first save")
    return [Evaluated(f"{checkpoint_dir}/{t}", checkpoint.step_of_tag(t), checkpoint_dir) for t in tags]


def load_model(ref: Evaluated) -> BertPretrainer | ElectraPretrainer:
    if ref.checkpoint_dir is None:
        return build_pretrainer(None, ObjectiveConfig(), ref.folder, init_generator=ref.generator)
    parts, _ = load_parts(ref.checkpoint_dir / Path(ref.label).name)
    if "mlm" in parts:
        return BertPretrainer(parts["mlm"], ObjectiveConfig())
    return ElectraPretrainer(parts["generator"], parts["discriminator"], ObjectiveConfig())


def samples_of(ref: Evaluated) -> dict:
    """{"samples": the samples a truneg tag had trained on}, as its run's record says; {} for another model."""
    states = ref.checkpoint_dir / Path(ref.label).name / "mp_rank_00_model_states.pt" if ref.checkpoint_dir else None
    if states is None or not states.is_file():
        return {}
    saved = torch.load(states, map_location="cpu", weights_only=False, mmap=True)  # DeepSpeed's own file: its pickle
    return {"samples": int(saved["global_samples"])} if "global_samples" in saved else {}


def tokenizer_of(ref: Evaluated, given: str | None):
    if given:
        return load_tokenizer(given)
    folder = run_tokenizer_dir(ref.checkpoint_dir) if ref.checkpoint_dir is not None else ref.folder
    for candidate in (folder, folder / "discriminator" if folder else None):
        if candidate is not None and ((candidate / "tokenizer.json").is_file() or (candidate / "vocab.txt").is_file()):
            return load_tokenizer(candidate)
    return load_tokenizer(DEFAULT_TOKENIZER)


def evaluate_checkpoints(path: str, data: list[str], generator: str | None = None, seq_len: int = 128,
                         max_sequences: int = EVAL_MAX_SEQUENCES, synonyms: str | None = None,
                         tokenizer: str | None = None, batch_size: int = 32, out: Path | None = None) -> list[dict]:
    """Each model's figures, printed (one line each) and written to `out` as a JSON list of records."""
    refs = discover(path, generator)
    records = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for ref in refs:
        tok = tokenizer_of(ref, tokenizer)
        tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
        if synonyms:
            table = SynonymTable.load(synonyms, expect_tokens=tokens)
        else:  # what the run's live ratios counted with
            table = run_table(ref.checkpoint_dir, tok) if ref.checkpoint_dir is not None else wordnet_table(tok)
        model = load_model(ref).to(device)
        positions = (model.mlm if isinstance(model, BertPretrainer) else model.generator).config.max_position_embeddings
        if seq_len > positions:
            raise UserError(f"--seq-len {seq_len} is beyond the model's {positions} positions ({ref.label}); use "
                            f"{positions} or less")
        blocks, _ = open_training_blocks(data, tok, seq_len)
        started = time.perf_counter()
        figures = HeldOut(blocks, tok, model.scheme, max_sequences, batch_size, table, device).evaluate(model)
        record = {"checkpoint": ref.label, "step": ref.step, **samples_of(ref), **figures,
                  "eval_seconds": time.perf_counter() - started}
        print(f"{ref.label}: {console_line(record)}", flush=True)
        records.append(record)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return records
