"""User-facing errors: one line that says what is wrong and how to fix it."""
from __future__ import annotations

import argparse
import functools
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class UserError(Exception):
    """A mistake in the user's input. Printed as one line, exit status 2, no traceback."""


def exit_on_user_error(fn: F) -> F:
    """Turn a UserError raised by a command's entry point into `truneg: error: ...` and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as err:
            print(f"truneg: error: {err}", file=sys.stderr, flush=True)
            sys.exit(2)

    return wrapper  # type: ignore[return-value]


def out_of_range(value: float, low: float, high: float = math.inf, *, low_open: bool = False,
                 high_open: bool = False) -> str | None:
    """What is wrong with a number outside its range (None when it is inside): the one wording of every range
    check, whether argparse's types below refuse a flag or pretrain's preflight lists every flag at once."""
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if (not isinstance(value, float) or math.isfinite(value)) and above and below:  # (an int of any size is finite)
        return None
    bounds = [f"{'>' if low_open else '>='} {low:g}"] + ([f"{'<' if high_open else '<='} {high:g}"]
                                                          if math.isfinite(high) else [])
    kind = "a finite number " if isinstance(value, float) else ""
    return f"must be {kind}{' and '.join(bounds)}, not {value}"


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse `type` for an integer flag with a floor: below it, argparse's own one-line error and exit 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if problem := out_of_range(value, least):
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = f"int >= {least}"  # how argparse names the type in its errors
    return parse


def float_between(low: float, high: float = math.inf, *, low_open: bool = True) -> Callable[[str], float]:
    """An argparse `type` for a finite float in (low, high] ([low, high] with low_open=False)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
        if problem := out_of_range(value, low, high, low_open=low_open):
            raise argparse.ArgumentTypeError(problem)
        return value

    parse.__name__ = "float"
    return parse


def check_output_path(path: str | Path, flag: str, *, folder: bool = True) -> None:
    """Refuse, before any work, an output folder (or file, folder=False) that cannot be made: the path is a file
    where a folder is wanted (or a folder where a file is), or a file stands where one of its parents must be."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise UserError(f"{flag} {path} is a {'file' if folder else 'folder'}; pass a {'folder' if folder else 'file'} "
                        "path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UserError(f"{flag} {path}: {parent} is a file, not a folder; choose another path")
            return
