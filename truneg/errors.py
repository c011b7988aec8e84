"""User-facing errors: one line that says what is wrong and how to fix it."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
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


def int_at_least(least: int) -> Callable[[str], int]:
    """An argparse `type` for an integer flag with a floor: below it, argparse's own one-line error and exit 2."""
    import argparse

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        return value

    parse.__name__ = f"int >= {least}"  # how argparse names the type in its errors
    return parse
