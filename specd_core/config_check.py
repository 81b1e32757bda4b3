"""Checks on model and head files' numbers before anything is allocated: ``config.json``
sizes (finite positive integers within sane bounds, named by file and field) and a model's
or head's bytes against the memory the machine has. Shared by the target's loader
(`target_worker.hf`) and the drafter heads' check (`drafter_worker.head_check`); a
ValueError here is one line the CLI prints as ``specd: error: <file>: <reason>`` (exit 2).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

__all__ = ["SIZE_BOUNDS", "available_memory_bytes", "check_config_sizes",
           "check_fits_memory"]

#: ``config.json`` size fields (transformers' names, the EAGLE-3 layouts' too) and the
#: largest value accepted: far above any released model (Llama-3.1-405B: hidden 16,384,
#: 126 layers, vocabulary 128,256; the largest vocabularies are ~262k), far below what
#: would overflow or allocate petabytes.
SIZE_BOUNDS: dict[str, int] = {
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 20,
    "num_hidden_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 23,
    "draft_vocab_size": 1 << 23,
    "target_hidden_size": 1 << 17,
    "max_position_embeddings": 1 << 26,
    "sliding_window": 1 << 26,
    "num_local_experts": 1 << 12,
    "num_experts_per_tok": 1 << 12,
}


def check_config_sizes(raw: Mapping, where: str | os.PathLike,
                       bounds: Mapping[str, int] = SIZE_BOUNDS) -> None:
    """Every size field of ``raw`` (a parsed ``config.json``, and its nested
    ``transformer_layer_config`` / ``text_config``) that is set is a finite positive integer
    no larger than its bound (a float with an integral value, such as ``1e3``, counts as
    that integer).

    Raises:
        ValueError: ``"<where>: field '<name>': <value> ..."`` for the first that is not.
    """
    for key, bound in bounds.items():
        if key not in raw or raw[key] is None:
            continue
        value = raw[key]
        ok = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            ok, value = True, int(value)
        if not ok or value < 1:
            raise ValueError(f"{where}: field {key!r}: {raw[key]!r} is not a positive integer")
        if value > bound:
            raise ValueError(f"{where}: field {key!r}: {raw[key]!r} is over {bound:,}, beyond "
                             "any model this server loads")
    for nested in ("transformer_layer_config", "text_config"):
        if isinstance(raw.get(nested), Mapping):
            check_config_sizes(raw[nested], f"{where}: {nested}", bounds)


def available_memory_bytes() -> int | None:
    """The memory this machine can give a new allocation now, bytes: Linux's
    ``MemAvailable`` (``/proc/meminfo``), or the physical memory elsewhere; None when neither
    is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits_memory(nbytes: int, where: str | os.PathLike, what: str) -> None:
    """Refuses ``nbytes`` (``what`` of ``where``) larger than the memory available, before
    anything is allocated.

    Raises:
        ValueError: ``"<where>: <what> take N GiB, more than the M GiB of memory available"``.
    """
    available = available_memory_bytes()
    if available is not None and nbytes > available:
        raise ValueError(f"{where}: {what} take {nbytes / 2**30:.1f} GiB, more than the "
                         f"{available / 2**30:.1f} GiB of memory available")
