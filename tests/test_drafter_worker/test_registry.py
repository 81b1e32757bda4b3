"""The drafter registry: one list of names, one set of defaults, capabilities that match what
the built drafters declare, and the command line offering exactly the registered names."""

from __future__ import annotations

import pytest

from drafter_worker.registry import (
    DRAFTERS,
    LOOKUP_ADAPTIVE_DRAFT_LEN,
    LOOKUP_DRAFT_LEN,
    REGISTRY,
    SERVED_DRAFTERS,
    build_drafter,
    check_drafter,
    default_draft_len,
)
from specd_core.draft import drafter_capabilities
from specd_tools.cli import build_parser


def _choices(parser, command: str, flag: str) -> tuple[str, ...]:
    sub = next(a for a in parser._actions if a.dest == "command")
    action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
    return tuple(action.choices)


def test_the_command_line_offers_exactly_the_registered_drafters():
    parser = build_parser()
    for command in ("generate", "serve"):
        assert _choices(parser, command, "--drafter") == DRAFTERS
    assert "none" in DRAFTERS and "none" not in SERVED_DRAFTERS


def test_defaults_and_capabilities_come_from_the_registry():
    assert build_drafter("none") is None
    check_drafter("none")
    lookup = build_drafter("prompt-lookup")
    caps = drafter_capabilities(lookup)
    assert caps.max_draft_len == LOOKUP_DRAFT_LEN == default_draft_len("prompt-lookup")
    assert default_draft_len("prompt-lookup", adaptive=True) == LOOKUP_ADAPTIVE_DRAFT_LEN
    spec = REGISTRY["prompt-lookup"].capabilities
    assert (caps.wants_hidden, caps.sessions, caps.samples) == (
        spec.wants_hidden, spec.sessions, spec.samples)
    assert default_draft_len("none") is None


def test_an_unknown_name_is_refused_with_the_choices():
    for call in (lambda: build_drafter("medusa"), lambda: check_drafter("medusa"),
                 lambda: default_draft_len("medusa")):
        with pytest.raises(ValueError, match="unknown drafter 'medusa'; choices: prompt-lookup"):
            call()
    with pytest.raises(ValueError, match="drafter_path"):
        check_drafter("prompt-lookup", drafter_path="head.safetensors")
