"""Load a target model: a Llama-family GGUF file (`target_worker.gguf`), a Hugging Face
checkpoint directory (`target_worker.hf`), or the tiny random test model
(`target_worker.testing`), into a :class:`~target_worker.model.Decoder` and its tokenizer.

With no source, the default model is fetched once (`target_worker.fetch`). A GGUF file's
float32 weights are cached as safetensors (`target_worker.disk_cache`) and its tokenizer (with
the file's chat template) as a ``save_pretrained`` folder, so only the first load of a file pays
for parsing it. A Hugging Face directory is read in place (its safetensors memory-mapped), with
no cache copy.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specd_core.config_check import check_fits_memory

from .config import ModelConfig
from .disk_cache import (
    load_stored_weights,
    safetensors_config,
    save_weights,
    tokenizer_cache_path,
    weights_cache_path,
)
from .fetch import default_model_path
from .gguf import gguf_config, read_gguf, read_gguf_stored
from .hf import HFSource, check_tokenizer_fits, is_hf_dir, load_hf_tokenizer, read_hf_config
from .model import Decoder
from .native import fingerprint, native_compiler, native_enabled
from .testing import is_tiny_random_spec, load_tiny_random, tiny_random_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DTYPES",
    "QUANTIZED_TYPES",
    "load_decoder",
    "load_gguf_decoder",
    "load_hf_decoder",
    "load_model",
    "load_tokenizer",
    "model_config",
    "model_path",
    "needs_conversion",
    "cpu_has_bf16_dot",
    "cpu_prefers_bf16",
    "native_mode_for",
    "resolve_dtype",
    "validate_model",
]

#: ``--dtype`` choices. On a CPU with a C compiler the target runs the native forward
#: (`target_worker.native`): "float32" in float32, "q8" with activations rounded to 8-bit
#: blocks against a GGUF file's Q4_0 / Q4_1 / Q8_0 weights (llama.cpp's arithmetic; float16
#: KV cache), and "auto" is "q8" for such a file, else "float32". "bfloat16" / "float16" run
#: the torch forward; so does everything without the native forward, where "auto" is
#: bfloat16 on CUDA and on CPUs where that is faster (`cpu_prefers_bf16`), else float32.
DTYPES = ("auto", "float32", "q8", "bfloat16", "float16")

#: ggml types the "q8" arithmetic multiplies in integers.
QUANTIZED_TYPES = (2, 3, 8)

#: CPU feature flags (``/proc/cpuinfo``) that compute bfloat16 dot products in hardware:
#: x86's AVX512-BF16 (``vdpbf16ps``) and AMX-BF16 tiles, Arm's BF16 extension (``bfdot``).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

#: The flags with which "auto" takes bfloat16: AMX-BF16 tiles (x86) and Arm's BF16 extension.
#: Batch invariance runs reduced precision on the CPU at one call shape (32-row oneDNN
#: tiles: `target_worker.invariant.REDUCED_LINEAR_KERNELS`), which AMX computes cheaply (an
#: AMX Xeon, one thread: bfloat16 72.8 ms per SmolLM2 token against float32 87.4) but
#: AVX512-BF16 alone does not (an AMD EPYC Zen 4, 2 threads, 2026-12-03, `python
#: scripts/verify_cost.py`: bfloat16 79.6 ms for one token and 98.2 for 9, float32 63.5 and
#: 81.6). Arm's BF16 is unmeasured and kept as it was.
BF16_AUTO_FLAGS = ("amx_bf16", "bf16")


def _cpu_flags(cpuinfo: str | None) -> set[str]:
    """The first processor's ``flags``/``Features`` in ``cpuinfo`` (default
    ``/proc/cpuinfo``); empty where unknown."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_bf16_dot(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 dot products natively (`BF16_DOT_FLAGS` among the
    first processor's ``flags``/``Features`` in ``cpuinfo``, default ``/proc/cpuinfo``).
    Without them a bf16 matmul converts every weight to float32 first: on an AVX2 CPU here
    one row took 16.7 ms for SmolLM2's layers but 8 rows 110 ms (float32: 37 / 51 ms), so
    verification would cost a row each (`scripts/verify_cost.py`). False where unknown."""
    return bool(_cpu_flags(cpuinfo).intersection(BF16_DOT_FLAGS))


def cpu_prefers_bf16(cpuinfo: str | None = None) -> bool:
    """Whether "auto" takes bfloat16 on this CPU: `BF16_AUTO_FLAGS` (AMX-BF16, Arm BF16),
    where the batch-invariant bfloat16 forward measured faster than float32. False where
    unknown."""
    return bool(_cpu_flags(cpuinfo).intersection(BF16_AUTO_FLAGS))


def _decoder_from_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> Decoder:
    model = Decoder(config)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if config.tie_embeddings:
        # assign=True replaced the embedding Parameter: point the head at the new one.
        model.lm_head.weight = model.embed_tokens.weight
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.requires_grad_(False)
    return model.eval()


def _say(message: str) -> None:
    """One line on stderr before a wait of several seconds (in an actor: its log)."""
    print(f"[specd] {message}", file=sys.stderr, flush=True)


def load_gguf_decoder(path: str | os.PathLike, use_cache: bool = True) -> Decoder:
    """Decoder with the weights of a GGUF file, dequantized to float32.

    With ``use_cache`` the converted weights are stored under ``<cache_dir>/weights/`` as
    safetensors keyed by the file's resolved path, size and mtime, so later loads skip GGUF
    parsing and dequantization (~0.3 s instead of ~5 s for SmolLM2).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: see `target_worker.gguf.read_gguf`.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = weights_cache_path(path)
    if use_cache and cached.is_file():
        model = _decoder_from_state(safetensors_config(cached), load_file(cached))
    else:
        _say(f"converting {path.name} to float32 weights" +
             (f" in {cached.parent} (first load only)" if use_cache else "") + "...")
        config, state = read_gguf(path)
        model = _decoder_from_state(config, state)
        if use_cache:
            save_weights(cached, config, state)
    if native_enabled():
        # The file's own blocks, for the native forward (4-6x fewer bytes per token).
        model.stored_weights = (load_stored_weights(path) if use_cache
                                else read_gguf_stored(path))
        model.stored_fingerprint = fingerprint(model)
    return model


def model_config(source: str | os.PathLike | None = None) -> ModelConfig:
    """The `ModelConfig` of a `load_model` source without loading its weights: the tiny-random
    spec, the weights cache's metadata when present, else the GGUF metadata (~3 s to open); a
    Hugging Face directory's ``config.json``, checked against its safetensors headers.

    Raises:
        As `load_model`.
    """
    if is_tiny_random_spec(source):
        return tiny_random_config(source)[0]
    path = model_path(source)
    if path.is_dir():
        config, arch = read_hf_config(path)
        HFSource(path, config, arch)  # checks the weights' names and shapes (headers only)
        return config
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = weights_cache_path(path)
    if cached.is_file():
        return safetensors_config(cached)
    return gguf_config(path)


def load_tokenizer(path: str | os.PathLike, use_cache: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer (and chat template) embedded in a GGUF file, via transformers; or a
    Hugging Face directory's own (checked to fit its ``config.json`` ``vocab_size``).

    The first load of a GGUF parses the file's vocabulary (~16 s for SmolLM2); with
    ``use_cache`` the result is saved under ``<cache_dir>/tokenizers/`` and later loads take
    well under a second.

    Raises:
        FileNotFoundError: if ``path`` does not exist. ValueError: a directory whose tokenizer
            is missing, does not load, or has more tokens than the embedding has rows.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if path.is_dir():
        tok = load_hf_tokenizer(path)
        check_tokenizer_fits(tok, path, read_hf_config(path)[0])
        return tok
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = tokenizer_cache_path(path)
    if use_cache and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
    _say(f"reading {path.name}'s tokenizer" + (" (first load only)" if use_cache else "")
         + "...")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if use_cache:
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tok.save_pretrained(tmp)
        shutil.rmtree(cached, ignore_errors=True)
        try:
            os.replace(tmp, cached)
        except OSError:  # another process (a concurrent actor) cached it first
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def load_model(
    source: str | os.PathLike | None = None,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Decoder, PreTrainedTokenizerBase]:
    """Load a target model and its tokenizer.

    Args:
        source: None for the default SmolLM2-135M-Instruct (fetched once, see
            `target_worker.fetch.default_model_path`), the path of a ``.gguf`` file (llama or
            qwen2), a Hugging Face checkpoint directory (`target_worker.hf.ARCHITECTURES`), or
            ``"tiny-random[:vocab=V,seed=S,layers=L]"`` for a tiny random test model with a
            `target_worker.testing.TinyTokenizer` (see `target_worker.testing`).
        dtype: the decoder's weights and compute dtype, one of `DTYPES` (`resolve_dtype`,
            `native_mode_for`; default "auto": bfloat16 on CUDA).
        device: where the weights, KV caches and forwards live: ``"cpu"`` or a CUDA device
            (``"cuda"``, ``"cuda:1"``); the engine over the decoder follows it.

    Returns:
        ``(decoder, tokenizer)``; the tokenizer carries the source's ``eos_token_id`` and chat
        template.

    Raises:
        ValueError: if ``source`` is neither a ``.gguf`` path, a directory nor a valid
            tiny-random spec, or it is unsupported or inconsistent (naming file and field);
            a CUDA ``device`` where torch has none.
        FileNotFoundError: if the ``.gguf`` file does not exist.
        RuntimeError: if fetching the default model fails.
    """
    if is_tiny_random_spec(source):
        decoder, tokenizer = load_tiny_random(source)
        decoder = _placed(_cast(decoder, resolve_dtype(dtype, str(device))), device)
        return _configured(decoder, dtype), tokenizer
    path = model_path(source)
    tokenizer = load_tokenizer(path) if path.is_dir() else None  # checked before the weights
    decoder = load_decoder(path, dtype, device)
    return decoder, tokenizer if tokenizer is not None else load_tokenizer(path)


def model_path(source: str | os.PathLike | None) -> Path:
    """The GGUF file or checkpoint directory a `load_model` source names (fetching the
    default model if needed).

    Raises:
        ValueError: neither a ``.gguf`` path nor a directory. RuntimeError: the default
            model's fetch failed.
    """
    if source is None:
        return default_model_path()
    path = Path(source)
    if is_hf_dir(path):
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"unsupported model source {str(source)!r}: expected a .gguf file or "
                         "a Hugging Face model directory (config.json + safetensors)")
    return path


def resolve_dtype(dtype: str | torch.dtype | None, device: str = "cpu") -> torch.dtype:
    """The torch dtype for a ``--dtype`` value: ``"auto"`` or None is bfloat16 on CUDA and
    on a CPU where it is the faster forward (`cpu_prefers_bf16`: AMX, Arm BF16), else
    float32; otherwise one of `DTYPES` (or a torch float dtype). Norms, softmax and sampling
    stay float32.

    Raises:
        ValueError: naming the value when it is not one of `DTYPES`.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        if str(device).startswith("cuda"):
            return torch.bfloat16
        if native_enabled() and native_compiler() is not None:
            return torch.float32  # the native forward, float32 or q8: faster than either
        return torch.bfloat16 if cpu_prefers_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return torch.float32 if dtype == "q8" else getattr(torch, dtype)


def native_mode_for(dtype: str | torch.dtype | None, decoder: Decoder) -> str:
    """The native forward's arithmetic (`target_worker.native.MODES`) for a decoder loaded
    with ``dtype``: "q8" when asked, or for "auto" when its file stores quantized weights
    (`QUANTIZED_TYPES`); else "float32"."""
    if dtype == "q8":
        return "q8"
    stored = decoder.stored_weights or {}
    if dtype in (None, "auto") and decoder.dtype == torch.float32 and any(
            w.type in QUANTIZED_TYPES for w in stored.values()):
        return "q8"
    return "float32"


def _configured(decoder: Decoder, dtype: str | torch.dtype | None) -> Decoder:
    decoder.native_mode = native_mode_for(dtype, decoder)
    return decoder


def _cast(decoder: Decoder, dtype: torch.dtype) -> Decoder:
    return decoder if dtype == decoder.dtype else decoder.to(dtype)


def load_hf_decoder(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
                    device: str | torch.device = "cpu") -> Decoder:
    """Decoder with the weights of a Hugging Face checkpoint directory, read in place from its
    safetensors (no cache copy) and cast to ``dtype`` (`resolve_dtype`).

    Raises:
        ValueError: see `target_worker.hf.read_hf_config` and `target_worker.hf.HFSource`.
    """
    from .sharded import decoder_state

    config, arch = read_hf_config(path)
    source = HFSource(path, config, arch)
    torch_dtype = resolve_dtype(dtype, str(device))
    state = {k: v.to(torch_dtype) for k, v in decoder_state(config, source).items()}
    return _decoder_from_state(config, state)


def load_decoder(
    source: str | os.PathLike | None = None, dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> Decoder:
    """`load_model` without the tokenizer (a target worker never tokenizes).

    Raises:
        As `load_model`.
    """
    where = str(device)
    if is_tiny_random_spec(source):
        decoder = _cast(load_tiny_random(source)[0], resolve_dtype(dtype, where))
    else:
        path = model_path(source)
        decoder = load_hf_decoder(path, dtype, device) if path.is_dir() else _cast(
            load_gguf_decoder(path), resolve_dtype(dtype, where))
    return _configured(_placed(decoder, device), dtype)


def _placed(decoder: Decoder, device: str | torch.device) -> Decoder:
    """``decoder`` with its weights on ``device`` (its caches and forwards follow them)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: torch here has no CUDA device "
                         f"(torch {torch.__version__})")
    if device.type == "cuda":
        from .cuda import configure_cublas

        configure_cublas()  # before the process's first CUDA matmul (`CUBLAS_ENV`)
    return decoder if decoder.device == device else decoder.to(device)


def needs_conversion(source: str | os.PathLike | None) -> bool:
    """Whether loading ``source`` first converts it: a GGUF file whose weights cache or
    tokenizer cache (`target_worker.disk_cache`) is missing, which costs tens of seconds once
    (SmolLM2 on 2 cores: ~5 s of weights, ~16 s of tokenizer). The default model is fetched
    first if needed.

    Raises:
        As `model_path`.
    """
    if is_tiny_random_spec(source):
        return False
    path = model_path(source)
    if not path.is_file():
        return False  # a directory is read in place; a missing file fails elsewhere, named
    return not (weights_cache_path(path).is_file()
                and (tokenizer_cache_path(path) / "tokenizer_config.json").is_file())


def validate_model(source: str | os.PathLike | None) -> ModelConfig:
    """Everything about a source that can be checked without loading weights: its config, a
    directory's safetensors names and shapes, and that its tokenizer fits the vocabulary.
    The service calls it before any actor starts.

    Raises:
        As `load_model`.
    """
    config = model_config(source)
    # Refused before any allocation: a model that would not fit this machine's memory even
    # at one byte per parameter (the smallest dtype a target loads in).
    check_fits_memory(config.n_params, source or "the default model", "the model's weights")
    if not is_tiny_random_spec(source) and is_hf_dir(source):
        load_tokenizer(source)
    return config
