"""The report's figures: the false-negatives panels, and each figure saved with the command and date that made it."""
from __future__ import annotations

import textwrap
from pathlib import Path

from matplotlib.figure import Figure


def save_with_footer(figure: Figure, footer: str, path: Path, width: int = 180, margin: float = 0.06) -> None:
    """The footer in small print along the bottom (`width` characters a line), the plot above its `margin`."""
    figure.text(0.01, 0.01, textwrap.fill(footer, width), fontsize=5)
    figure.tight_layout(rect=(0, margin, 1, 1))
    figure.savefig(path, dpi=120)


FN_LEVELS = ("iter", "pred")  # the two panels of a false-negatives figure, by the records' keys


def false_negative_panels(xlabel: str) -> tuple[Figure, list]:
    """A false-negatives figure: its iteration-level and prediction-level panels (FN_LEVELS' order), labelled, with
    `xlabel` along each."""
    figure = Figure(figsize=(8, 3.6))
    axes = list(figure.subplots(1, 2))
    for ax, title in zip(axes, ("iteration level (% of sequences)", "prediction level (% of mismatches)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("false negatives (%)")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
    return figure, axes
