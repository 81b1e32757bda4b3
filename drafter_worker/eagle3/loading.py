"""Loading EAGLE-3 heads: the head directory, its weight files (safetensors, sharded, or
``pytorch_model.bin`` read with ``weights_only=True``), `inspect_eagle3` (config and shapes,
no weights) and `load_eagle3`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..eagle import HEADS_DIR
from .config import (
    BIN_FILE,
    BIN_INDEX,
    CONFIG_FILE,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    Eagle3Config,
    _check_tensor_names,
    _normalise_names,
    _parse_config,
    check_fits,
)
from .head import Eagle3Head

#: the speculators layout (`Eagle3Head.save`).
DEFAULT_EAGLE3_HEAD = HEADS_DIR / "smollm2-135m-instruct-eagle3"


def resolve_head_dir(path: str | os.PathLike | None) -> Path:
    """The head directory of ``path``: a directory, or a ``config.json`` / weights file inside
    one; None: `DEFAULT_EAGLE3_HEAD`.

    Raises:
        FileNotFoundError: no such directory or file, or no ``config.json`` in it.
    """
    given = Path(DEFAULT_EAGLE3_HEAD if path is None else path)
    p = given.parent if given.is_file() else given
    if not p.is_dir():
        hint = " (the default head; give --drafter-path DIR)" if path is None else ""
        raise FileNotFoundError(f"EAGLE-3 head not found: {p}{hint}")
    if not (p / CONFIG_FILE).is_file():
        # Name what was given: a stray file's directory (often ".") says nothing.
        where = given if given == p else f"{given} (a file: its directory {p.resolve()})"
        raise FileNotFoundError(f"EAGLE-3 head {where}: no {CONFIG_FILE} in it")
    return p


def _weight_files(directory: Path) -> tuple[str, list[Path]]:
    """(kind "safetensors" | "bin", files) of a head directory; safetensors preferred.

    Raises:
        FileNotFoundError: none of model.safetensors, its index, pytorch_model.bin or its
            index. ValueError: an index that is not JSON with a ``weight_map``.
    """
    for kind, single, index in (("safetensors", SAFETENSORS_FILE, SAFETENSORS_INDEX),
                                ("bin", BIN_FILE, BIN_INDEX)):
        if (directory / single).is_file():
            return kind, [directory / single]
        if (directory / index).is_file():
            try:
                weight_map = json.loads((directory / index).read_text())["weight_map"]
                names = sorted(set(weight_map.values()))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{directory / index}: not a weight index ({exc})") from None
            files = [directory / n for n in names]
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"{directory / index}: shard {missing[0].name} is "
                                        "missing")
            return kind, files
    raise FileNotFoundError(f"EAGLE-3 head {directory}: no weights ({SAFETENSORS_FILE}, "
                            f"{SAFETENSORS_INDEX}, {BIN_FILE} or {BIN_INDEX})")


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    """A ``pytorch_model.bin``'s tensors, unpickled with ``weights_only=True`` (plain tensors
    and containers only: a checkpoint never runs code).

    Raises:
        ValueError: anything else in the file (named), or not a name -> tensor mapping.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses, named
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: refused: not a plain tensor checkpoint (read with "
                         f"weights_only=True, nothing in it runs): {first}") from None
    if not isinstance(state, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path}: refused: not a mapping of tensor names to tensors")
    return state


def _read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    kind, files = _weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        if kind == "safetensors":
            from safetensors.torch import load_file

            part = load_file(str(f))
        else:
            part = _read_bin(f)
        state.update(part)
    return state, files


def _weight_shapes(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """Tensor name -> shape from safetensors headers (no tensor read); None for .bin."""
    kind, files = _weight_files(directory)
    if kind != "safetensors":
        return None
    from safetensors import safe_open

    shapes = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                shapes[name] = tuple(h.get_slice(name).get_shape())
    return shapes


def inspect_eagle3(path: str | os.PathLike | None, target_config=None
                   ) -> tuple[Eagle3Config, dict]:
    """Checks a head without loading its weights: the config (any layout), for safetensors
    every tensor's name and shape from the file headers, and with ``target_config`` (a
    `target_worker.ModelConfig`) that it fits that target (`check_fits`; what a service
    checks before any worker starts).

    Returns:
        ``(config, info)`` as `load_eagle3` (``aux_layers`` None when the config names none;
        ``embedding`` "own", "target", or None for a ``.bin`` head, whose tensors are not
        read here).

    Raises:
        FileNotFoundError: as `resolve_head_dir`, or no weights file.
        ValueError: naming the file and field or tensor (and both values for a misfit).
    """
    directory = resolve_head_dir(path)
    where = str(directory / CONFIG_FILE)
    try:
        raw = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: not readable JSON ({exc})") from None
    config, info = _parse_config(raw, where)
    shapes = _weight_shapes(directory)
    own = None
    if shapes is not None:
        shapes = _normalise_names(shapes, str(directory))
        _check_tensor_names(shapes, config, str(directory))
        own = "embed_tokens.weight" in shapes
    info["directory"] = str(directory)
    info["embedding"] = None if own is None else "own" if own else "target"
    if target_config is not None:
        try:
            check_fits(config, target_config, own)
        except ValueError as exc:
            raise ValueError(f"{directory}: {exc}") from None
    return config, info


def load_eagle3(path: str | os.PathLike | None, target_config=None
                ) -> tuple[Eagle3Head, dict]:
    """Loads an EAGLE-3 head in any supported layout (module docstring), float32, eval.

    Args:
        path: the head directory, or a config/weights file inside it; None:
            `DEFAULT_EAGLE3_HEAD`.
        target_config: the target's `target_worker.ModelConfig`: resolves the default
            ``aux_layers`` and runs `Eagle3Head.validate_against` (None: neither).

    Returns:
        ``(head, info)``: info is a dict with ``layout`` ("eagle", "speculators",
        "specforge"), ``directory``, ``weights`` (file names), ``aux_layers_source``,
        ``embedding`` ("own" or "target") and ``notes`` (list of str).

    Raises:
        FileNotFoundError: no such head, config or weights file.
        ValueError: naming the file and the field or tensor, with both values, for anything
            not supported or not matching (module docstring; `Eagle3Head.validate_against`).
    """
    config, info = inspect_eagle3(path)
    directory = Path(info["directory"])
    raw, files = _read_weights(directory)
    where = str(directory)
    state = _normalise_names(raw, where)
    _check_tensor_names({k: tuple(v.shape) for k, v in state.items()}, config, where)
    own = "embed_tokens.weight" in state
    head = Eagle3Head(config, own_embedding=own)
    values = {}
    for name, value in state.items():
        if name == "d2t":
            if value.dtype.is_floating_point or value.dtype == torch.bool:
                raise ValueError(f"{where}: tensor 'd2t' has dtype {value.dtype}, must be "
                                 "integer offsets")
            value = value.to(torch.long)
        elif name == "t2d":
            if value.dtype.is_floating_point:
                raise ValueError(f"{where}: tensor 't2d' has dtype {value.dtype}, must be "
                                 "bool")
            if value.dtype != torch.bool and bool(((value != 0) & (value != 1)).any()):
                raise ValueError(f"{where}: tensor 't2d' holds values other than 0/1")
            value = value.to(torch.bool)
        elif value.dtype.is_floating_point:
            value = value.float()
        else:
            raise ValueError(f"{where}: tensor {name!r} has dtype {value.dtype}, must be "
                             "floating point")
        values[name] = value
    if "d2t" in values and "t2d" not in values:  # derived (vLLM reads no t2d either)
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        mapped = torch.arange(config.draft_vocab_size) + values["d2t"]
        t2d[mapped.clamp(0, config.vocab_size - 1)] = True
        values["t2d"] = t2d
        info["notes"].append("t2d absent: derived from d2t")
    missing, unexpected = head.load_state_dict(values, strict=False)
    assert not unexpected, unexpected  # _check_tensor_names refused them
    try:
        head.check()
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if target_config is not None:
        try:
            head.validate_against(target_config)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        head.resolve_aux_layers(target_config.n_layers)
    info.update(weights=[f.name for f in files], embedding="own" if own else "target")
    return head.eval(), info


