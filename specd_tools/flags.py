"""Pieces of the command line shared by specd's commands (`specd_tools.cli` and `specd bench`,
`specd_tools.bench.cli`): help texts, argparse value types, and the "(default: X)" help."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

#: Configuration names whose flag is not the name with dashes (error messages name the flag).
FLAG_OF = {"target_timeout_s": "--target-timeout", "target_threads": "--threads",
           "num_threads": "--threads"}

#: The --model help of the commands that load a target.
MODEL_HELP = ("the target: a Llama-family .gguf file or a Hugging Face model directory "
              "(Llama, Mistral, Qwen2, Mixtral; config.json + safetensors + tokenizer) "
              "(default: SmolLM2-135M-Instruct, GGUF)")

#: The --auth-token help: a flag's value is visible to every local user in `ps`.
AUTH_HELP = ("bearer token{what} (default $SPECD_AUTH_TOKEN); a value given here is visible "
             "to every local user in ps and /proc: prefer the environment variable")


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's --help line names its default: appended as "(default: X)" unless the
    help already says it; options whose default is None or off say nothing more."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        help_text = action.help or ""
        default = action.default
        if ("default" in help_text or default is None or default is False
                or default is argparse.SUPPRESS or (isinstance(default, list) and not default)):
            continue
        shown = ",".join(default) if isinstance(default, list | tuple) else default
        action.help = (help_text + " " if help_text else "") + f"(default: {shown})"


def port(text: str) -> int:
    """A TCP port number, 0 (pick a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1: the argparse ``type`` of every such flag of ``specd`` and ``specd
    bench`` (``serve`` included, alone or in a comma-separated list).

    Raises:
        argparse.ArgumentTypeError: ``must be an integer >= 1, got ...``.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def ints(flag: str, values: Sequence[str]) -> tuple[int, ...]:
    """``values`` (a `csv` flag's) as integers.

    Raises:
        ValueError: naming ``--flag`` when one is not an integer.
    """
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ValueError(f"--{flag} must be integers, got {','.join(values)}") from None


def csv(text: str) -> tuple[str, ...]:
    """A comma-separated list, items stripped, empty ones dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())
