"""specd's on-disk cache: its root (`cache_dir`), and the float32 safetensors copy of a GGUF
file's weights, so only the first load of a file pays for parsing and dequantizing it.

Layout under `cache_dir`: ``models/`` (the fetched default model, `target_worker.fetch`),
``weights/<stem>-<key>.safetensors`` (here: the `ModelConfig` in its ``specd_config``
metadata) and ``tokenizers/<stem>-<key>/`` (a ``save_pretrained`` folder,
`target_worker.loader.load_tokenizer`); ``<key>`` hashes the file's resolved path, size and
mtime, so a changed file is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from .config import ModelConfig, MoEConfig, RopeScaling
from .gguf import read_gguf

__all__ = [
    "cache_dir",
    "ensure_weights_cache",
    "load_stored_weights",
    "safetensors_config",
    "save_weights",
    "stored_weights_path",
    "tokenizer_cache_path",
    "weights_cache_path",
]

# Bump when the cached safetensors layout or the conversion changes.
_WEIGHTS_FORMAT = 1


def cache_dir() -> Path:
    """Root of specd's caches: ``$SPECD_CACHE`` if set and non-empty, else ``~/.cache/specd``."""
    env = os.environ.get("SPECD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd"


def _file_cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_WEIGHTS_FORMAT}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def tokenizer_cache_path(path: str | os.PathLike) -> Path:
    """Where `target_worker.loader.load_tokenizer` keeps a GGUF file's tokenizer (a
    ``save_pretrained`` folder)."""
    return cache_dir() / "tokenizers" / _file_cache_key(Path(path))


def save_weights(cached: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Write ``state`` (a Decoder state dict) and ``config`` (as ``specd_config`` metadata) to
    ``cached`` atomically."""
    from safetensors.torch import save_file

    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    save_file(state, tmp, metadata={"specd_config": json.dumps(asdict(config))})
    os.replace(tmp, cached)  # atomic: readers see no file or the whole file


def stored_weights_path(path: str | os.PathLike) -> Path:
    """Where `load_stored_weights` keeps a GGUF file's matrices as the file stores them."""
    return cache_dir() / "weights" / f"{_file_cache_key(Path(path))}.stored.safetensors"


def load_stored_weights(path: str | os.PathLike) -> dict:
    """A GGUF file's weight matrices as it stores them (`target_worker.gguf.read_gguf_stored`:
    name -> `target_worker.native.StoredWeight`), read from their cache copy, made first if
    absent (~2 s for SmolLM2, once; later loads ~0.1 s).

    Raises:
        FileNotFoundError, ValueError: as `target_worker.gguf.read_gguf_stored`.
    """
    import fcntl

    from safetensors import safe_open
    from safetensors.torch import save_file

    from .gguf import read_gguf_stored
    from .stored import StoredWeight

    path = Path(path)
    cached = stored_weights_path(path)
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(cached.with_name(cached.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cached.is_file():
                stored = read_gguf_stored(path)
                tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
                meta = {name: [w.type, w.n, w.k] for name, w in stored.items()}
                save_file({name: w.data for name, w in stored.items()}, tmp,
                          metadata={"specd_stored": json.dumps(meta)})
                os.replace(tmp, cached)
                return stored
    with safe_open(str(cached), framework="pt") as f:
        meta = json.loads((f.metadata() or {})["specd_stored"])
        return {name: StoredWeight(t, n, k, f.get_tensor(name))
                for name, (t, n, k) in meta.items()}


def weights_cache_path(path: str | os.PathLike) -> Path:
    """Where `target_worker.loader.load_gguf_decoder` caches a GGUF file's float32 weights
    (safetensors)."""
    return cache_dir() / "weights" / f"{_file_cache_key(Path(path))}.safetensors"


def safetensors_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` stored in a weights cache file's metadata (reads no tensors).

    Raises:
        ValueError: the file has no ``specd_config`` metadata.
    """
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        config_json = (f.metadata() or {}).get("specd_config")
    if config_json is None:
        raise ValueError(f"{path}: no specd_config metadata (not a specd weights file)")
    raw = json.loads(config_json)
    if raw.get("moe") is not None:
        raw["moe"] = MoEConfig(**raw["moe"])
    if raw.get("rope_scaling") is not None:
        raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    return ModelConfig(**raw)


def ensure_weights_cache(path: str | os.PathLike) -> Path:
    """The float32 safetensors cache of a GGUF file, converting it first if absent.

    Concurrent callers on one machine (the ranks of a tensor-parallel replica) convert once:
    an exclusive file lock serialises them, and the others then find the file. The converting
    process holds the whole model in memory while it writes (~4 bytes per parameter).

    Raises:
        FileNotFoundError: ``path`` does not exist. ValueError: see `target_worker.gguf.read_gguf`.
    """
    import fcntl

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = weights_cache_path(path)
    if cached.is_file():
        return cached
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.with_name(cached.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.is_file():
            print(f"[specd] converting {path.name} to float32 weights in {cached.parent} "
                  f"(first load only)...", file=sys.stderr, flush=True)
            config, state = read_gguf(path)
            save_weights(cached, config, state)
            del state
    return cached
