"""transformers' side of the bench: its own load of the target (the ``hf-*`` systems' model)
and, for tiny random models, which have no checkpoint it can load, a twin holding the
decoder's weights."""

from __future__ import annotations

import torch

__all__ = ["hf_twin", "load_hf_model"]


def _quiet_hf(hf):
    hf.generation_config.temperature = None  # greedy: silence sampling-field warnings
    hf.generation_config.top_p = None
    hf.generation_config.top_k = None
    return hf.eval()


def load_hf_model(model: str | None, decoder=None):
    """transformers' own load of the GGUF file (``from_pretrained(dir, gguf_file=...)``) or of
    a Hugging Face directory, eval mode, in ``decoder``'s dtype when it is given (both sides
    of the bench then compute in the same dtype: ``auto`` is bfloat16 on a CPU with native
    bf16 dot products), else float32. A tiny-random model has no GGUF file: with its
    ``decoder`` given and dense, its `hf_twin`; else None.

    Raises:
        ImportError: transformers cannot load GGUF files here (accelerate missing).
    """
    from target_worker.loader import model_path
    from target_worker.testing import is_tiny_random_spec

    if is_tiny_random_spec(model):
        if decoder is None or decoder.config.moe is not None:
            return None
        return hf_twin(decoder)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = model_path(model)
    dtype = torch.float32 if decoder is None else decoder.dtype
    if path.is_dir():  # a Hugging Face checkpoint directory: transformers reads it as is
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=dtype)
    return _quiet_hf(hf)


def hf_twin(decoder):
    """A transformers ``LlamaForCausalLM`` (eval, in ``decoder.dtype``) holding ``decoder``'s
    weights bit for bit: fused ``wqkv`` / ``w_gate_up`` split back into ``q/k/v_proj`` /
    ``gate/up_proj``. For tests with tiny random models, which have no checkpoint
    transformers can load.

    Raises:
        ValueError: a MoE decoder or one with QKV biases (not a Llama layout).
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    c = decoder.config
    if c.moe is not None or c.qkv_bias:
        raise ValueError("hf_twin needs a dense decoder without QKV biases (Llama layout)")
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim,
        max_position_embeddings=c.max_seq_len, rms_norm_eps=c.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings, attention_bias=False, mlp_bias=False)
    hf = LlamaForCausalLM(cfg).to(decoder.dtype)
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    state = {"model.embed_tokens.weight": decoder.embed_tokens.weight,
             "model.norm.weight": decoder.norm.weight,
             "lm_head.weight": decoder.lm_head.weight}
    for i, block in enumerate(decoder.layers):
        p = f"model.layers.{i}."
        q, k, v = block.attn.wqkv.weight.split([q_rows, kv_rows, kv_rows])
        gate, up = block.ffn.w_gate_up.weight.split(c.ffn_dim)
        state.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": block.attn.wo.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": block.ffn.w_down.weight,
            p + "input_layernorm.weight": block.attn_norm.weight,
            p + "post_attention_layernorm.weight": block.ffn_norm.weight})
    with torch.no_grad():
        hf.load_state_dict({k: v.detach().clone() for k, v in state.items()}, strict=True)
    return _quiet_hf(hf)
