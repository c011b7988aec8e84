"""Saving the report's figures: each carries the command and date that made it, in a footer."""
from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.figure import Figure


def save_with_footer(figure: Figure, footer: str, path: Path, width: int = 180, margin: float = 0.06) -> None:
    """The footer in small print along the bottom (`width` characters a line), the plot above its `margin`."""
    figure.text(0.01, 0.01, textwrap.fill(footer, width), fontsize=5)
    figure.tight_layout(rect=(0, margin, 1, 1))
    figure.savefig(path, dpi=120)
