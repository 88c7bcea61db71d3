"""The command line's value types and its parser: every number is checked where it is parsed, and every
parse error is one line that names the flag."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import NoReturn

from tracer.errors import UserError

# Beyond any model's context window (Llama 4 Scout: 10M tokens) and any batch one GPU holds.
MAX_SEQ_LEN = 16_777_216
MAX_COUNT = 1_048_576
# plan --pipeline: search pipeline-parallel layouts when no other layout fits, always, or never.
PIPELINE_SEARCH = ("auto", "on", "off")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is a :class:`UserError` (one line, exit status 2) instead of the usage text.
    ``commands``: each command's parser, by name."""

    commands: dict[str, argparse.ArgumentParser]

    def error(self, message: str) -> NoReturn:
        named = re.fullmatch(r"argument (\S+?): (.*)", message, flags=re.DOTALL)
        if named:  # "argument --seq-len: must be at least 1" -> "--seq-len must be at least 1"
            flag, reason = named.groups()
            message = f"{flag} {reason}" if reason.startswith(("must", "takes")) else f"{flag}: {reason}"
        raise UserError(f"{message} (see {self.prog} --help)")


def count(minimum: int = 1, maximum: int = MAX_COUNT) -> Callable[[str], int]:
    """A whole number in [minimum, maximum]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {value:,}")
        return value

    parse.__name__ = "count"
    return parse


def counts(text: str) -> tuple[int, ...]:
    """Whole numbers of at least 1, separated by commas ("20,20,20,20")."""
    parse = count()
    return tuple(parse(part.strip()) for part in text.split(","))


def rate(text: str) -> float:
    """A finite positive number (a bandwidth, a throughput)."""
    value = _number(text, "a number")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite positive number, got {text!r}")
    return value


def share(text: str) -> float:
    """A fraction in [0, 1)."""
    value = _number(text, "a number in [0, 1)")
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return value


def _number(text: str, expected: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes {expected}, got {text!r}") from None


def settings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action | None]:
    """What a command takes, by dest: its flags' actions, and None for a setting without a flag (a
    ``set_defaults`` a config file may fill)."""
    actions: dict[str, argparse.Action | None] = {action.dest: action for action in parser._actions}
    return {dest: None for dest in parser._defaults} | actions
