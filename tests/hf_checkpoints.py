"""Tiny Hugging Face checkpoint directories built offline: transformers' own config classes and
``save_pretrained``, with a byte-level BPE tokenizer trained here by the ``tokenizers`` package.
Shared by the HF loader tests (`build_checkpoints` once per module)."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Speculative decoding drafts tokens and verifies them in one forward pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Hugging Face checkpoints hold config.json, safetensors and a tokenizer.",
]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
             initializer_range=0.3, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
#: name -> (transformers model_type, config overrides, save_pretrained max_shard_size)
MODELS = {
    "llama3": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": False}, None),
    "mistral-sharded": ("mistral", {"sliding_window": 128}, "20KB"),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, None),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}, None),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, None),
}


def train_tokenizer(vocab_size: int = 320):
    """A ByteLevel BPE tokenizer (``<|im_end|>`` is eos) wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_checkpoint(out: Path, model_type: str, overrides: dict, shard: str | None,
                     tokenizer, seed: int = 0) -> Path:
    """Saves a random ``model_type`` model (float32) and ``tokenizer`` into ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), **{**SMALL, **overrides},
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norm weights away from 1 so a norm mix-up would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out, **kwargs)
    tokenizer.save_pretrained(out)
    return out


def build_checkpoints(root: Path) -> dict[str, Path]:
    """Every checkpoint of `MODELS` under ``root``; returns ``{name: directory}``."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = train_tokenizer()
    return {name: build_checkpoint(root / name, mt, over, shard, tokenizer, seed=i)
            for i, (name, (mt, over, shard)) in enumerate(MODELS.items())}


def hf_model(directory: Path):
    """transformers' own load of a directory: float32, eval."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare fixed-length outputs
    model.generation_config.pad_token_id = 0
    return model.eval()
