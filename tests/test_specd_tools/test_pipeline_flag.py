"""``--pipeline {auto,on,off}`` (and its alias ``--no-pipeline``) on ``specd serve`` and
``specd generate``: what each gives the service's `ServiceConfig` and the in-process path,
auto by default, and bad values refused naming the flag before anything starts."""

from __future__ import annotations

import pytest

from coordinator.cluster.config import ServiceConfig
from specd_tools import cli
from specd_tools.generate import GenerateOptions, embedded_service_config, pipeline_setting

TINY = "tiny-random:vocab=64,seed=0,layers=2"


class _Stop(Exception):
    """Raised by the fake service in place of starting anything."""


@pytest.fixture
def served(monkeypatch):
    """``specd serve``'s `ServiceConfig`, captured where the service would start."""
    from coordinator.cluster import service

    configs = []

    class Fake:
        def __init__(self, config):
            configs.append(config)
            raise _Stop

    monkeypatch.setattr(service, "Service", Fake)
    return configs


@pytest.mark.parametrize("flags, expected", [
    ([], "auto"), (["--pipeline", "auto"], "auto"), (["--pipeline", "on"], True),
    (["--pipeline", "off"], False), (["--no-pipeline"], False)])
def test_serve_gives_the_service_the_schedule_its_flags_ask_for(served, flags, expected):
    with pytest.raises(_Stop):
        cli.main(["serve", "--model", TINY, *flags])
    assert served[-1].pipeline == expected


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("flags, named", [
    (["--pipeline", "fast"], "argument --pipeline: invalid choice: 'fast'"),
    (["--pipeline", "on", "--no-pipeline"],
     "argument --no-pipeline: not allowed with argument --pipeline"),
])
def test_a_bad_or_contradictory_schedule_is_refused_naming_the_flag(capsys, served, command,
                                                                   flags, named):
    args = [command, *(["hi"] if command == "generate" else []), "--model", TINY, *flags]
    with pytest.raises(SystemExit) as info:
        cli.main(args)
    assert info.value.code == 2
    assert named in capsys.readouterr().err
    assert served == []  # refused before anything started


def test_generate_options_map_to_the_embedded_service_and_refuse_a_bad_value():
    assert GenerateOptions("x").pipeline == "auto"
    assert embedded_service_config(GenerateOptions("x", model=TINY)).pipeline == "auto"
    assert embedded_service_config(GenerateOptions("x", model=TINY, pipeline="on")).pipeline
    assert embedded_service_config(
        GenerateOptions("x", model=TINY, pipeline="auto", no_pipeline=True)).pipeline is False
    with pytest.raises(ValueError, match="--pipeline must be auto, on or off, got 'yes'"):
        pipeline_setting(GenerateOptions("x", pipeline="yes"))


def test_the_service_config_takes_a_bool_or_auto_and_names_a_bad_pipeline():
    assert ServiceConfig(model=TINY).pipeline == "auto"
    for value in (True, False, "auto"):
        assert ServiceConfig(model=TINY, pipeline=value).pipeline == value
    for bad in ("on", "fast", 1, None):
        with pytest.raises(ValueError, match=r"pipeline must be True \(on\), False \(off\)"):
            ServiceConfig(model=TINY, pipeline=bad)


@pytest.mark.parametrize("flags, pipelined", [([], False), (["--pipeline", "auto"], False),
                                              (["--pipeline", "on"], True),
                                              (["--no-pipeline"], False)])
def test_generate_in_process_runs_pipelined_only_when_asked(monkeypatch, capsys, flags,
                                                           pipelined):
    # In process nothing overlaps the forward (the drafter runs on the loop's thread), so
    # auto is the serial step there.
    seen = []
    import coordinator.step.speculative as speculative

    real = speculative.speculative_decode_with

    def spy(*args, **kwargs):
        seen.append(kwargs.get("pipeline"))
        return real(*args, **kwargs)

    monkeypatch.setattr(speculative, "speculative_decode_with", spy)
    assert cli.main(["generate", "hi", "--in-process", "--raw", "--model", TINY,
                     "--max-new-tokens", "4", "--no-adaptive", "--threads", "1",
                     *flags]) == 0
    capsys.readouterr()
    assert seen == [pipelined]
