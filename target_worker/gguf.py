"""Read a Llama-family GGUF file (``llama`` or ``qwen2``) into a `ModelConfig` and a float32
`~target_worker.model.Decoder` state dict. Tensors are dequantized with the ``gguf`` package;
`target_worker.disk_cache` keeps the result as safetensors so a file is parsed once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "gguf_config", "read_gguf", "read_gguf_stored"]

# llama.cpp permutes Q/K rows for these architectures (its converter's LlamaModel.permute);
# qwen2 is converted without the permutation (NEOX-style RoPE in llama.cpp).
_PERMUTED_QK = {"llama"}
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


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


def read_gguf_stored(path: str | os.PathLike) -> dict[str, Any]:
    """The weight matrices of a GGUF file as it stores them, for the native forward: name ->
    `target_worker.native.StoredWeight` (uint8 rows of whole blocks, a copy in memory), for
    every matrix whose type the native forward reads (`target_worker.stored.GGML_TYPES`;
    others are left to the float32 weights). Names: ``embed``, ``head`` (untied files only),
    ``{i}.q``, ``{i}.k``, ``{i}.v``, ``{i}.o``, ``{i}.gate``, ``{i}.up``, ``{i}.down``; Q and
    K rows are un-permuted as `read_gguf` does, so a row holds what the float32 weights'
    same row holds.

    Raises:
        ValueError: as `read_gguf`.
    """
    from .stored import GGML_TYPES, StoredWeight

    path = Path(path)
    reader = _open_gguf(path)
    config, arch = _config_from_reader(reader, path)
    tensors: dict[str, Any] = {t.name: t for t in reader.tensors}
    permute = arch in _PERMUTED_QK
    out: dict[str, Any] = {}

    def put(name: str, gguf_name: str, heads: int | None = None) -> None:
        t = tensors.get(gguf_name)
        if t is None or int(t.tensor_type) not in GGML_TYPES or len(t.shape) != 2:
            return
        k, n = (int(x) for x in t.shape)  # ggml lists the row length first
        rows = np.ascontiguousarray(np.asarray(t.data).view(np.uint8).reshape(n, -1))
        if heads is not None:
            rows = np.ascontiguousarray(_permute_reverse(rows, heads))
        out[name] = StoredWeight(int(t.tensor_type), n, k, torch.from_numpy(rows.copy()))

    put("embed", "token_embd.weight")
    if not config.tie_embeddings:
        put("head", "output.weight")
    for i in range(config.n_layers):
        b = f"blk.{i}."
        put(f"{i}.q", b + "attn_q.weight", config.n_heads if permute else None)
        put(f"{i}.k", b + "attn_k.weight", config.n_kv_heads if permute else None)
        put(f"{i}.v", b + "attn_v.weight")
        put(f"{i}.o", b + "attn_output.weight")
        put(f"{i}.gate", b + "ffn_gate.weight")
        put(f"{i}.up", b + "ffn_up.weight")
        put(f"{i}.down", b + "ffn_down.weight")
    return out


def gguf_config(path: str | os.PathLike) -> ModelConfig:
    """The `ModelConfig` of a GGUF file from its metadata and tensor shapes, reading no tensor
    data (~3 s to open SmolLM2).

    Raises:
        ValueError: as `read_gguf`.
    """
    path = Path(path)
    return _config_from_reader(_open_gguf(path), path)[0]
