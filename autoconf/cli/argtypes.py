"""argparse types of the command line: a bad value is one line naming it, exit 2."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return v


VIRTUAL_STAGES_HELP = ("the most chunks per device (virtual stages) tried, or all: up to one layer per chunk, "
                       "fully modular (default 8; each chunk more costs search time)")


def virtual_stages(text: str) -> int | None:
    """--max-virtual-stages: a positive integer, or "all" (None: up to one layer per chunk)."""
    if text == "all":
        return None
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: a positive number of chunks per device, or all "
                                         "(one layer per chunk)") from None


def non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return v


def seconds(text: str) -> float:
    from autoconf.cli.trial import seconds_arg
    return seconds_arg(text)


def fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a fraction in [0, 1)")
    return v


def int_list(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be integers separated by commas, like 1,3") from None


def recompute_modules(text: str) -> tuple:
    from autoconf.space.config import RECOMPUTE_MODULES
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in RECOMPUTE_MODULES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: valid modules, separated by commas: "
                                         f"{', '.join(RECOMPUTE_MODULES)}")
    return names


def port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} must be a TCP port, 1 to 65535")
    return v


def framework_name(text: str) -> str:
    """A framework, or ``framework:recipe`` (``specs.frameworks.RECIPES``), as given."""
    from autoconf.errors import UserError
    from autoconf.specs.frameworks import framework
    try:
        framework(text)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
