"""metrics.jsonl's records in plain Python (no torch): which lines are evaluations, their console line, and strict
JSON, so that `truneg report` and other readers need nothing but the standard library."""
from __future__ import annotations

import json
import math

EVAL_PREFIX = "eval_"


def is_eval_record(record: dict) -> bool:
    """An evaluation's line in metrics.jsonl (it has no `loss`; a training interval of skipped steps has none too)."""
    return any(key.startswith(EVAL_PREFIX) for key in record)


def strict(value):
    """`value` with every NaN or infinite float replaced by None: JSON's `null`, which every language's parser
    reads (Python's json writes `NaN` and `Infinity`, which are not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps of `value` as strict JSON (a non-finite float is `null`)."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def console_line(record: dict) -> str:
    """An evaluation's one console line."""
    shown = ("eval_mlm_loss", "eval_mlm_accuracy", "eval_perplexity", "eval_disc_auc", "eval_disc_accuracy",
             "eval_hc_iter_ratio", "eval_hc_pred_ratio")
    figures = "  ".join(f"{k.removeprefix(EVAL_PREFIX)} {'n/a' if record[k] is None else format(record[k], '.4f')}"
                        for k in shown if k in record)
    return f"eval step {record['step']}  {figures}  ({record['eval_seconds']:.1f} s)"
