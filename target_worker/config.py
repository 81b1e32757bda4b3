"""Model hyper-parameters for the target decoder (Llama architecture, optional MoE FFN)."""

from __future__ import annotations

from dataclasses import dataclass


def _require_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts FFN settings.

    Attributes:
        n_experts: number of routed experts.
        n_experts_active: top-k routed experts used per token (1 <= k <= n_experts).
        n_shared_experts: always-on experts whose output is added to the routed output (>= 0).
        expert_ffn_dim: SwiGLU intermediate size of each expert (routed and shared).

    Raises:
        ValueError: naming the field and value when a size is out of range.
    """

    n_experts: int
    n_experts_active: int
    n_shared_experts: int
    expert_ffn_dim: int

    def __post_init__(self) -> None:
        _require_positive(self, "n_experts", "n_experts_active", "expert_ffn_dim")
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts!r}")
        if self.n_experts_active > self.n_experts:
            raise ValueError(
                f"n_experts_active ({self.n_experts_active}) must be <= "
                f"n_experts ({self.n_experts})"
            )


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.x RoPE frequency scaling (``rope_type: "llama3"`` in a Hugging Face config).

    Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` keep their
    frequency, longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, and those between are interpolated (transformers'
    ``_compute_llama3_parameters``; Meta's ``apply_scaling`` in llama-models).

    Raises:
        ValueError: naming the field when a value is out of range.
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        _require_positive(self, "factor", "low_freq_factor", "high_freq_factor",
                          "original_max_position_embeddings")
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (Llama family: RMSNorm, RoPE, GQA attention, SwiGLU FFN).

    Attributes:
        vocab_size: number of token ids.
        hidden_size: residual stream width.
        n_layers: number of transformer blocks.
        n_heads: query heads per layer.
        n_kv_heads: key/value heads per layer; must divide n_heads (grouped-query attention).
        head_dim: width of one attention head (n_heads * head_dim need not equal hidden_size).
        ffn_dim: dense SwiGLU intermediate size (unused when ``moe`` is set).
        max_seq_len: context length in tokens; the KV cache never grows past it.
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon inside RMSNorm.
        tie_embeddings: whether the LM head shares the token-embedding matrix.
        moe: mixture-of-experts FFN settings, or None for a dense FFN.
        qkv_bias: whether the Q/K/V projections have biases (Qwen2-style checkpoints).
        rope_scaling: Llama 3.x RoPE frequency scaling, or None for plain RoPE.

    Raises:
        ValueError: naming the field and value when a setting is out of range.
    """

    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    max_seq_len: int = 8192
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    moe: MoEConfig | None = None
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "vocab_size",
            "hidden_size",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "ffn_dim",
            "max_seq_len",
            "rope_theta",
            "rms_norm_eps",
        )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim!r}")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"moe must be a MoEConfig or None, got {type(self.moe).__name__}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            kind = type(self.rope_scaling).__name__
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {kind}")

    @classmethod
    def tiny_test(cls, vocab_size: int, n_layers: int = 2) -> ModelConfig:
        """A tiny MoE config for tests: hidden 16, 4 heads / 2 KV heads of width 4,
        6 experts (2 active, 1 shared) with FFN 8, dense ffn_dim 32, context 256."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=16,
            n_layers=n_layers,
            n_heads=4,
            n_kv_heads=2,
            head_dim=4,
            ffn_dim=32,
            max_seq_len=256,
            moe=MoEConfig(n_experts=6, n_experts_active=2, n_shared_experts=1, expert_ffn_dim=8),
        )

    @property
    def n_params(self) -> int:
        """Number of parameters of a decoder with this config (counts a tied head once)."""
        h, d = self.hidden_size, self.head_dim
        qkv = d * (self.n_heads + 2 * self.n_kv_heads)
        attn = h * qkv + self.n_heads * d * h + (qkv if self.qkv_bias else 0)
        if self.moe is None:
            ffn = 3 * h * self.ffn_dim
        else:
            m = self.moe
            ffn = h * m.n_experts + 3 * h * m.expert_ffn_dim * (m.n_experts + m.n_shared_experts)
        per_layer = attn + ffn + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.n_layers * per_layer + h + head
