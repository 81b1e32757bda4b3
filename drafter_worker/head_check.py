"""Drafter heads checked whole before anything starts: what `drafter_worker.registry.
check_drafter` runs in the CLI's process, before Ray, so that a bad head is one line naming
its file and the reason (``specd: error: <file>: <reason>``, exit 2), as the target's loader
answers a bad model, never an actor's traceback after Ray, the target and the drafter
started.

A head is opened and every tensor read, as the drafter will read it: safetensors through
``safetensors`` (a header that lies about a tensor's shape or offsets, or a file cut short,
is refused naming the file), a pickle ``.bin`` through ``torch.load(weights_only=True)``
(nothing in it runs; anything but plain tensors is refused), then the names, shapes and dtypes
against the head's config and the target's (`drafter_worker.eagle3.load_eagle3`,
`drafter_worker.eagle.EagleHead.load`). Before reading, the head's size (from the headers, or
the files' sizes) is checked against the memory the machine has
(`specd_core.config_check.check_fits_memory`), so a head that would not fit is refused before
anything is allocated.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from specd_core.config_check import check_config_sizes, check_fits_memory

__all__ = ["check_eagle3_head", "check_eagle_head"]

_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
                "BF16": 2, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1,
                "F8_E5M2": 1}


def _safetensors_bytes(path: Path) -> int:
    """The bytes a safetensors file's tensors take once read, from its header alone.

    Raises:
        ValueError: a header safetensors cannot read (naming the file).
    """
    from safetensors import SafetensorError, safe_open

    total = 0
    try:
        with safe_open(str(path), framework="pt") as h:
            for name in h.keys():
                part = h.get_slice(name)
                count = 1
                for n in part.get_shape():
                    count *= int(n)
                total += count * _DTYPE_BYTES.get(str(part.get_dtype()), 8)
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    return total


def _check_pickle(path: Path) -> None:
    """Unpickles a ``.bin`` with ``weights_only=True`` (nothing in it runs).

    Raises:
        ValueError: anything but plain tensors, naming the file and what the unpickler
            refused (its one reason line, not its advice).
    """
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # torch warns of pickle protocols; the refusal says
            warnings.simplefilter("ignore")
            torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever the unpickler refuses, named
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
                 for line in str(exc).splitlines() if line.strip()]
        at = next((i for i, line in enumerate(lines) if "Unpickler error:" in line), None)
        reason = lines[0] if lines else type(exc).__name__
        if at is not None:  # the reason follows "...Unpickler error:", or is the next line
            reason = lines[at].split("error:", 1)[1].strip() or (
                lines[at + 1] if at + 1 < len(lines) else type(exc).__name__)
        reason = reason.split(". ")[0]  # the reason, not torch's advice on allowlisting
        raise ValueError(f"{path}: refused: not a plain tensor checkpoint (read with "
                         f"weights_only=True, nothing in it ran): {reason}") from None


def _weights_bytes(directory: Path) -> int:
    from .eagle3.loading import _weight_files

    kind, files = _weight_files(directory)
    if kind == "safetensors":
        return sum(_safetensors_bytes(f) for f in files)
    total = sum(f.stat().st_size for f in files)  # a pickle: its tensors are its bytes
    check_fits_memory(total, directory, "the head's tensors")
    for f in files:
        _check_pickle(f)
    return total


def _named(exc: BaseException, where: Path | str) -> ValueError:
    """``exc`` as one ValueError line that names ``where`` (once)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ValueError(text if str(where) in text else f"{where}: {text}")


def check_eagle3_head(path: str | os.PathLike | None, target_config=None) -> None:
    """Opens, reads and checks an EAGLE-3 head (any layout, safetensors or pickle ``.bin``)
    against ``target_config`` (a `target_worker.ModelConfig`, or None: the head alone).

    Raises:
        FileNotFoundError: no such head, config or weights file.
        ValueError: one line naming the file and the reason (a field, a tensor, a misfit
            with the target, a file that is truncated, lies in its header or is not plain
            tensors, or a head larger than the memory available).
    """
    from safetensors import SafetensorError

    from .eagle3 import inspect_eagle3, load_eagle3, resolve_head_dir
    from .eagle3.config import CONFIG_FILE

    config_file = resolve_head_dir(path) / CONFIG_FILE
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file}: not readable JSON ({exc})") from None
    if isinstance(raw, dict):
        check_config_sizes(raw, config_file)
    directory = config_file.parent
    try:
        # Each weights file opened alone first (a header that lies or a file cut short is
        # named), and its size held against the memory available, before any tensor is read.
        check_fits_memory(_weights_bytes(directory), directory, "the head's tensors")
        inspect_eagle3(path, target_config)  # config, names and shapes, the fit: cheap
        load_eagle3(directory, target_config)  # every tensor read and checked
    except SafetensorError as exc:
        raise _named(exc, directory) from None
    except (RuntimeError, EOFError) as exc:  # torch's reader on a cut or corrupt file
        raise _named(exc, directory) from None


def check_eagle_head(path: str | os.PathLike) -> None:
    """Opens, reads and checks an EAGLE head file (`drafter_worker.eagle.EagleHead.load`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: one line naming the file and the reason.
    """
    from safetensors import SafetensorError

    from .eagle import EagleHead

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"EAGLE head not found: {path}")
    try:
        check_fits_memory(_safetensors_bytes(path), path, "the head's tensors")
        EagleHead.load(path)
    except SafetensorError as exc:
        raise _named(exc, path) from None
    except (RuntimeError, TypeError, KeyError, EOFError) as exc:
        # load_state_dict's missing/unexpected/shape errors, a config with other fields
        raise _named(exc, path) from None
