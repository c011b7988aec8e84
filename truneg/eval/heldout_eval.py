"""`truneg eval`: a checkpoint's held-out figures offline, the same as a run's live evaluation (truneg.train.heldout).

PATH is a truneg checkpoint tag, a checkpoints folder (each complete tag), an exported folder, or a model name of the
HF hub; an ELECTRA pair on the hub takes the generator's name second, as --init-generator does. The figures carry
metrics.jsonl's names: for the same step they equal the run's record (exactly on the CPU in fp32).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from truneg.data.blocks import open_training_blocks
from truneg.errors import UserError
from truneg.eval.checkpoints import checkpoints_tokenizer, discover_checkpoints, load_pretrainer, samples_of
from truneg.model.families import max_positions
from truneg.model.pretrainers import BertPretrainer
from truneg.train.build import eval_table
from truneg.train.config.run_config import EVAL_MAX_SEQUENCES
from truneg.train.heldout import HeldOut, run_eval_table
from truneg.train.observe.records import console_line, dumps


def evaluate_checkpoints(path: str, data: list[str], generator: str | None = None, seq_len: int = 128,
                         max_sequences: int = EVAL_MAX_SEQUENCES, synonyms: str | None = None,
                         tokenizer: str | None = None, batch_size: int = 32, out: Path | None = None) -> list[dict]:
    """Each model's figures, printed (one line each) and written to `out` as a JSON list of records."""
    refs = discover_checkpoints([path], generator)
    records = []
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # One PATH: one model, or the tags of one run, read with one tokenizer and counted with one table
    tok = checkpoints_tokenizer(refs[:1], tokenizer)
    if synonyms or refs[0].kind != "truneg":
        table = eval_table(tok, synonyms)
    else:  # what the run's live ratios counted with: its --eval-synonyms table, else WordNet's (as a run's default)
        table = run_eval_table(refs[0].path.parent, tok)
    for ref in refs:
        model = load_pretrainer(ref).to(device)
        positions = max_positions((model.mlm if isinstance(model, BertPretrainer) else model.generator).config)
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
        out.write_text(dumps(records, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    return records
