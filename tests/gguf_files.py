"""GGUF files written here, as llama.cpp's converter lays them out (float32 or quantized)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from target_worker.model import Decoder

__all__ = ["llama_cpp_permute", "write_gguf"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf LlamaModel.permute (HF rows -> GGUF rows)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(model: Decoder, path: Path, arch: str = "llama",
               types: dict[str, gguf.GGMLQuantizationType] | None = None, **extra_meta) -> Path:
    """Write ``model`` as a GGUF file the way llama.cpp's converter lays it out: float32, or
    with the matrices ``types`` names (``token_embd``, ``attn_q``, ``ffn_down``, ...)
    quantized to that ggml type."""
    c = model.config
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    types = types or {}
    add_tensor = w.add_tensor

    def add(name: str, arr: np.ndarray) -> None:
        kind = types.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0])
        arr = np.ascontiguousarray(arr)
        if kind is None or arr.ndim != 2:
            add_tensor(name, arr)
        else:
            add_tensor(name, gguf.quants.quantize(arr, kind), raw_dtype=kind)

    w.add_tensor = add
    w.add_block_count(c.n_layers)
    w.add_context_length(c.max_seq_len)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.ffn_dim)
    w.add_head_count(c.n_heads)
    w.add_head_count_kv(c.n_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for key, value in extra_meta.items():
        w.add_uint32(f"{arch}.{key}", value)
    permute = arch == "llama"
    w.add_tensor("token_embd.weight", sd["embed_tokens.weight"])
    nq, nk = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    for i in range(c.n_layers):
        p, b = f"layers.{i}.", f"blk.{i}."
        wqkv = sd[p + "attn.wqkv.weight"]
        q, k, v = wqkv[:nq], wqkv[nq : nq + nk], wqkv[nq + nk :]
        if permute:
            q, k = llama_cpp_permute(q, c.n_heads), llama_cpp_permute(k, c.n_kv_heads)
        w.add_tensor(b + "attn_q.weight", np.ascontiguousarray(q))
        w.add_tensor(b + "attn_k.weight", np.ascontiguousarray(k))
        w.add_tensor(b + "attn_v.weight", np.ascontiguousarray(v))
        if c.qkv_bias:
            bias = sd[p + "attn.wqkv.bias"]
            qb, kb, vb = bias[:nq], bias[nq : nq + nk], bias[nq + nk :]
            if permute:
                qb, kb = llama_cpp_permute(qb, c.n_heads), llama_cpp_permute(kb, c.n_kv_heads)
            for name, arr in (("q", qb), ("k", kb), ("v", vb)):
                w.add_tensor(b + f"attn_{name}.bias", np.ascontiguousarray(arr))
        w.add_tensor(b + "attn_output.weight", sd[p + "attn.wo.weight"])
        w.add_tensor(b + "attn_norm.weight", sd[p + "attn_norm.weight"])
        w.add_tensor(b + "ffn_norm.weight", sd[p + "ffn_norm.weight"])
        gate_up = sd[p + "ffn.w_gate_up.weight"]
        w.add_tensor(b + "ffn_gate.weight", np.ascontiguousarray(gate_up[: c.ffn_dim]))
        w.add_tensor(b + "ffn_up.weight", np.ascontiguousarray(gate_up[c.ffn_dim :]))
        w.add_tensor(b + "ffn_down.weight", sd[p + "ffn.w_down.weight"])
    w.add_tensor("output_norm.weight", sd["norm.weight"])
    if not c.tie_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
