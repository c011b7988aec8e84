"""Sub-commands of `truneg` for analysis and evaluation (filled in as those land)."""
from __future__ import annotations


def add_commands(commands) -> None:
    return None
