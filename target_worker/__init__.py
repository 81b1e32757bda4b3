"""Target worker: the large model that verifies speculative drafts (pure torch)."""

from .config import ModelConfig, MoEConfig
from .engine import PrefillItem, StepOutput, TargetEngine, VerifyItem
from .loader import (
    DEFAULT_MODEL_PACKAGE,
    cache_dir,
    default_model_path,
    load_gguf_decoder,
    load_model,
)
from .model import Decoder, KvCache
from .testing import TinyTokenizer

__all__ = [
    "DEFAULT_MODEL_PACKAGE",
    "Decoder",
    "KvCache",
    "ModelConfig",
    "MoEConfig",
    "PrefillItem",
    "StepOutput",
    "TargetEngine",
    "TinyTokenizer",
    "VerifyItem",
    "cache_dir",
    "default_model_path",
    "load_gguf_decoder",
    "load_model",
]
