"""A bad drafter head or config.json is refused by the CLI before anything starts: one line
``specd: error: <file>: <reason>``, exit 2, Ray never initialised (issue 39)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from eagle3_heads import save_random_head

from specd_tools import cli

TINY = "tiny-random:vocab=64,seed=0,layers=2"


@pytest.fixture
def no_ray(monkeypatch):
    """Fails the test if the service gets as far as starting Ray."""
    import ray

    from coordinator.cluster import service

    def started(*args, **kwargs):
        raise AssertionError("Ray was started")

    monkeypatch.setattr(service, "init_embedded_ray", started)
    monkeypatch.setattr(ray, "init", started)


def refused(capsys, head, drafter="eagle3") -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--model", TINY, "--drafter", drafter, "--drafter-path", str(head),
                  "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("specd: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _rewrite_header(path, edit) -> None:
    """Rewrites a safetensors file's JSON header with ``edit(header)`` (data unchanged)."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:])


def test_a_pickle_head_with_more_than_tensors_is_refused_naming_the_file(tmp_path, capsys,
                                                                         no_ray):
    head = save_random_head(tmp_path / "head")
    (head / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(2, 2), "extra": argparse_namespace()},
               head / "pytorch_model.bin")
    line = refused(capsys, head)
    assert f"{head / 'pytorch_model.bin'}: refused: not a plain tensor checkpoint" in line
    assert "argparse.Namespace" in line and "\x1b" not in line, line


def test_a_plain_pickle_head_is_refused_with_its_reason_and_no_torch_warning(tmp_path, capsys,
                                                                            no_ray):
    import pickle
    import warnings

    head = save_random_head(tmp_path / "head")
    (head / "model.safetensors").unlink()
    with open(head / "pytorch_model.bin", "wb") as f:
        pickle.dump({"fc.weight": [0.0]}, f, protocol=4)  # not torch.save's format
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = refused(capsys, head)
    assert "nothing in it ran):" in line and line.partition("nothing in it ran):")[2].strip(), \
        line  # a reason, not empty
    assert not [w for w in seen if "pickle protocol" in str(w.message)], seen


def argparse_namespace():
    import argparse

    return argparse.Namespace(x=1)  # an object weights_only=True will not unpickle


def test_a_head_safetensors_with_a_lying_shape_is_refused_naming_the_file(tmp_path, capsys,
                                                                          no_ray):
    head = save_random_head(tmp_path / "head")
    weights = head / "model.safetensors"

    def lie(header):
        name = next(k for k in header if k != "__metadata__")
        header[name]["shape"] = [s * 2 for s in header[name]["shape"]]

    _rewrite_header(weights, lie)
    line = refused(capsys, head)
    assert str(weights) in line, line


def test_a_truncated_head_safetensors_is_refused_naming_the_file(tmp_path, capsys, no_ray):
    head = save_random_head(tmp_path / "head")
    weights = head / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    line = refused(capsys, head)
    assert str(weights) in line, line


@pytest.mark.parametrize("field,value,words", [
    ("hidden_size", float("nan"), "is not a positive integer"),
    ("vocab_size", 1e12, "is over"),
    ("num_hidden_layers", -1, "is not a positive integer"),
])
def test_head_config_sizes_are_checked_naming_file_and_field(tmp_path, capsys, no_ray, field,
                                                             value, words):
    head = save_random_head(tmp_path / "head")
    config = head / "config.json"
    raw = json.loads(config.read_text())
    raw[field] = value
    config.write_text(json.dumps(raw))  # NaN is written as NaN, as Python's json reads it
    line = refused(capsys, head)
    assert line.startswith(f"specd: error: {config}: field {field!r}: ") and words in line, line


def test_an_eagle_head_cut_short_is_refused_naming_the_file(tmp_path, capsys, no_ray):
    from drafter_worker.eagle import DEFAULT_HEAD

    cut = tmp_path / "head.safetensors"
    data = open(DEFAULT_HEAD, "rb").read()
    cut.write_bytes(data[: len(data) // 2])
    line = refused(capsys, cut, drafter="eagle")
    assert str(cut) in line, line


def test_a_model_config_with_nan_or_absurd_sizes_is_refused_naming_file_and_field(
        tmp_path, capsys, no_ray):
    from hf_checkpoints import build_checkpoint, train_tokenizer

    model = build_checkpoint(tmp_path / "m", "llama", {}, None, train_tokenizer())
    config = model / "config.json"
    raw = json.loads(config.read_text())
    for field, value, words in [("hidden_size", float("nan"), "is not a positive integer"),
                                ("vocab_size", 1e12, "is over")]:
        config.write_text(json.dumps({**raw, field: value}))
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "--model", str(model), "--drafter", "none", "--port", "0"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"specd: error: {config}: field {field!r}: " in err and words in err, err


def test_a_model_larger_than_memory_is_refused_before_loading(tmp_path, capsys, no_ray,
                                                              monkeypatch):
    from specd_core import config_check

    monkeypatch.setattr(config_check, "available_memory_bytes", lambda: 1000)
    with pytest.raises(SystemExit) as info:
        cli.main(["serve", "--model", TINY, "--drafter", "none", "--port", "0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"specd: error: {TINY}: the model's weights take" in err
    assert "more than the 0.0 GiB of memory available" in err, err
