"""Target worker: the large model that verifies speculative drafts (pure torch)."""

from .config import ModelConfig, MoEConfig
from .loader import (
    DEFAULT_MODEL_PACKAGE,
    cache_dir,
    default_model_path,
    load_gguf_decoder,
    load_model,
)
from .model import Decoder, KvCache

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "Decoder",
    "KvCache",
    "ModelConfig",
    "MoEConfig",
    "cache_dir",
    "default_model_path",
    "load_gguf_decoder",
    "load_model",
]
