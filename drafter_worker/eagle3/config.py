"""EAGLE-3 head configuration: `Eagle3Config`, the files of a head directory, and the
three checkpoint layouts' ``config.json`` (EAGLE, speculators, SpecForge) read and written
(layouts: the `drafter_worker.eagle3` package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from target_worker.config import RopeScaling

#: Files of a head directory.
CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
#: The training recipe beside a head `Eagle3Head.save` writes (not part of the layout).
RECIPE_FILE = "specd_recipe.json"

#: Context bound of a head's KV cache (it grows on demand; the target's context is the limit).
HEAD_MAX_SEQ_LEN = 1 << 20

#: transformers' ``LlamaConfig`` defaults: speculators writes its ``transformer_layer_config``
#: as a diff against them, so an absent key means this value.
_LLAMA_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "hidden_act": "silu"}

#: Architectures named in a config.json, per layout.
SPECFORGE_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layers for an ``n_layers`` target: ``(2, N // 2, N - 3)``
    (capture-before; EAGLE ``modeling_llama_kv.py``, vLLM ``get_eagle3_aux_hidden_state_layers``,
    SGLang and speculators agree).

    Raises:
        ValueError: a target with fewer than 7 layers, where two of them coincide.
    """
    n = int(n_layers)
    layers = (2, n // 2, n - 3)
    if n < 7:
        raise ValueError(f"aux_layers: a {n}-layer target has no distinct default (2, N // 2, "
                         f"N - 3) = {layers}; give the layer ids explicitly")
    return layers


@dataclass(frozen=True)
class Eagle3Config:
    """Shape of an EAGLE-3 head.

    Attributes:
        hidden_size: the head's width H (its embeddings, layer and ``lm_head`` input).
        vocab_size: the target's vocabulary size V (``t2d`` and embedding rows).
        draft_vocab_size: rows Vd of ``lm_head`` (<= V).
        n_heads, n_kv_heads, head_dim: the layer's grouped-query attention.
        ffn_dim: the SwiGLU width.
        target_hidden_size: the target's width Ht (None: H); ``fc`` reads ``3 * Ht``.
        rope_theta: the head's own RoPE base (what it was trained with).
        rope_scaling: Llama 3.x scaling (`target_worker.config.RopeScaling`) or None.
        rms_norm_eps: epsilon of every RMSNorm of the head.
        aux_layers: the three target layers read, capture-before, strictly ascending; None
            until resolved for a target (`resolved`: the default `default_aux_layers`).
        norm_before_residual: the layer's residual is ``hidden_norm(h)`` instead of ``h``
            (vLLM ``llama_eagle3``, speculators).
        norm_before_fc: an RMSNorm ``input_norm`` ``[3 * Ht]`` before ``fc`` (speculators'
            gpt-oss variant).

    Raises:
        ValueError: naming the field: a non-positive size, heads not divisible by KV heads,
            an odd head_dim, Vd > V, or aux_layers that are not 3 distinct ascending ids >= 0.
    """

    hidden_size: int
    vocab_size: int
    draft_vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    target_hidden_size: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    aux_layers: tuple[int, ...] | None = None
    norm_before_residual: bool = False
    norm_before_fc: bool = False

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            object.__setattr__(self, "target_hidden_size", self.hidden_size)
        for name in ("hidden_size", "vocab_size", "draft_vocab_size", "n_heads", "n_kv_heads",
                     "head_dim", "ffn_dim", "target_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Eagle3Config.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Eagle3Config.{name} must be > 0, got {getattr(self, name)!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Eagle3Config.n_heads {self.n_heads} is not divisible by "
                             f"n_kv_heads {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"Eagle3Config.head_dim must be even for RoPE, got {self.head_dim}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"Eagle3Config.draft_vocab_size {self.draft_vocab_size} > "
                             f"vocab_size {self.vocab_size}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"Eagle3Config.rope_scaling must be a RopeScaling or None, got "
                             f"{type(self.rope_scaling).__name__}")
        if self.aux_layers is not None:
            layers = tuple(self.aux_layers)
            if (len(layers) != 3 or any(isinstance(i, bool) or not isinstance(i, int)
                                        for i in layers)):
                raise ValueError(f"Eagle3Config.aux_layers must be 3 ints, got "
                                 f"{list(layers)}")
            if layers[0] < 0 or any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
                raise ValueError(f"Eagle3Config.aux_layers must be distinct, ascending and "
                                 f">= 0 (the target returns its captured layers in ascending "
                                 f"order), got {list(layers)}")
            object.__setattr__(self, "aux_layers", layers)

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int, ffn_dim: int | None = None,
                   **fields) -> Eagle3Config:
        """A head shaped like one layer of ``target_config`` (a `target_worker.ModelConfig`),
        reading the default layers (`default_aux_layers`) unless ``aux_layers`` is given;
        ``fields`` override any other field."""
        c = target_config
        values = dict(hidden_size=c.hidden_size, vocab_size=c.vocab_size,
                      draft_vocab_size=min(draft_vocab_size, c.vocab_size), n_heads=c.n_heads,
                      n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                      ffn_dim=ffn_dim or c.ffn_dim, target_hidden_size=c.hidden_size,
                      rope_theta=c.rope_theta, rope_scaling=c.rope_scaling,
                      rms_norm_eps=c.rms_norm_eps)
        values.update(fields)
        if values.get("aux_layers") is None:
            values["aux_layers"] = default_aux_layers(c.n_layers)
        return cls(**values)

    def resolved(self, n_layers: int) -> Eagle3Config:
        """This config with ``aux_layers`` set: its own, or the default for an ``n_layers``
        target. Raises ValueError as `default_aux_layers`."""
        if self.aux_layers is not None:
            return self
        return replace(self, aux_layers=default_aux_layers(n_layers))

    def expected_shapes(self, embedding: bool = False) -> dict[str, tuple[int, ...]]:
        """Every tensor of the head under its EAGLE name (``midlayer.*``) with its shape;
        ``embed_tokens.weight`` only when ``embedding``."""
        h, ht, nh, nkv, d = (self.hidden_size, self.target_hidden_size, self.n_heads,
                             self.n_kv_heads, self.head_dim)
        shapes = {
            "fc.weight": (h, 3 * ht),
            "midlayer.input_layernorm.weight": (h,),
            "midlayer.hidden_norm.weight": (h,),
            "midlayer.self_attn.q_proj.weight": (nh * d, 2 * h),
            "midlayer.self_attn.k_proj.weight": (nkv * d, 2 * h),
            "midlayer.self_attn.v_proj.weight": (nkv * d, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, nh * d),
            "midlayer.post_attention_layernorm.weight": (h,),
            "midlayer.mlp.gate_proj.weight": (self.ffn_dim, h),
            "midlayer.mlp.up_proj.weight": (self.ffn_dim, h),
            "midlayer.mlp.down_proj.weight": (h, self.ffn_dim),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.vocab_size,),
        }
        if self.norm_before_fc:
            shapes["input_norm.weight"] = (3 * ht,)
        if embedding:
            shapes["embed_tokens.weight"] = (self.vocab_size, h)
        return shapes



def check_fits(config: Eagle3Config, target_config, own_embedding: bool | None) -> None:
    """Refuses a head shape (``config``) that does not fit ``target_config`` (a
    `target_worker.ModelConfig`), from the config alone (no weights read): the rows' width
    (``target_hidden_size`` vs the target's ``hidden_size``), ``vocab_size``, aux layer ids
    outside ``[0, n_layers]`` (or no distinct default), and, for a head without its own
    embeddings (``own_embedding`` False; None: not known, not checked), the target's
    embedding width against the head's ``hidden_size``.

    Raises:
        ValueError: naming the field and both values.
    """
    c, t = config, target_config
    if c.target_hidden_size != t.hidden_size:
        raise ValueError(f"target_hidden_size: the head reads rows of 3 x "
                         f"{c.target_hidden_size}, the target's hidden_size is "
                         f"{t.hidden_size}")
    if c.vocab_size != t.vocab_size:
        raise ValueError(f"vocab_size: the head's is {c.vocab_size}, the target's is "
                         f"{t.vocab_size}")
    layers = c.aux_layers if c.aux_layers is not None else default_aux_layers(t.n_layers)
    bad = [i for i in layers if not 0 <= i <= t.n_layers]
    if bad:
        raise ValueError(f"aux_layers: layer {bad[0]} of {list(layers)} is outside [0, "
                         f"{t.n_layers}] (the target has {t.n_layers} layers)")
    if own_embedding is False and c.hidden_size != t.hidden_size:
        raise ValueError(f"embed_tokens: the head has none and the target's embedding is "
                         f"{t.hidden_size} wide, the head's hidden_size is "
                         f"{c.hidden_size}")


def _check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int) -> None:
    """Raises ValueError unless ``d2t`` maps draft ids to strictly increasing target ids in
    ``[0, V)`` and ``t2d`` marks exactly those."""
    if d2t.dtype != torch.long:
        raise ValueError(f"d2t: dtype {d2t.dtype}, must be int64 offsets")
    if t2d.dtype != torch.bool:
        raise ValueError(f"t2d: dtype {t2d.dtype}, must be bool")
    mapped = torch.arange(d2t.numel()) + d2t
    if mapped.numel():
        lo, hi = int(mapped.min()), int(mapped.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            i = int((mapped == bad).nonzero()[0])
            raise ValueError(f"d2t: draft id {i} maps to target id {bad}, outside [0, "
                             f"{vocab_size})")
        steps = mapped[1:] - mapped[:-1]
        if bool((steps <= 0).any()):
            i = int((steps <= 0).nonzero()[0]) + 1
            raise ValueError(f"d2t: target ids must be strictly increasing, draft id {i} maps "
                             f"to {int(mapped[i])} after {int(mapped[i - 1])}")
    total = int(t2d.sum())
    if total != d2t.numel():
        raise ValueError(f"t2d: marks {total} target ids, draft_vocab_size is {d2t.numel()}")
    if mapped.numel() and not bool(t2d[mapped].all()):
        i = int((~t2d[mapped]).nonzero()[0])
        raise ValueError(f"t2d: False at target id {int(mapped[i])}, which d2t maps draft id "
                         f"{i} to")


def _speculators_config(c: Eagle3Config, dtype: str, verifier: str | None,
                        speculative_tokens: int) -> dict:
    """The speculators ``config.json`` of ``c`` (speculators ``Eagle3SpeculatorConfig``;
    the keys vLLM's speculators adapter reads)."""
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
             "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
             "intermediate_size": c.ffn_dim, "num_hidden_layers": 1,
             "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
             "head_dim": c.head_dim, "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps,
             "rope_theta": c.rope_theta, "attention_bias": False, "mlp_bias": False,
             "tie_word_embeddings": False, "torch_dtype": dtype}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        layer["rope_scaling"] = {
            "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "specd",
        "draft_vocab_size": c.draft_vocab_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": c.norm_before_fc,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers or ()),
        "torch_dtype": dtype,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": int(speculative_tokens),
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
    }


# ---- loading ----


def _layout(raw: dict) -> str:
    if "speculators_config" in raw or "speculators_model_type" in raw:
        return "speculators"
    archs = raw.get("architectures") or []
    if any(a in SPECFORGE_ARCHITECTURES for a in archs):
        return "specforge"
    return "eagle"


def _parse_config(raw: dict, where: str) -> tuple[Eagle3Config, dict]:
    """(config, info) of a head ``config.json`` in any layout; ``where`` names the file.

    Raises:
        ValueError: naming the file and field of anything not supported or inconsistent.
    """
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a JSON object")
    layout = _layout(raw)
    notes: list[str] = []

    def refuse(field: str, why: str) -> ValueError:
        return ValueError(f"{where}: field {field!r}: {why}")

    if layout == "speculators":
        kind = raw.get("speculators_model_type", "eagle3")
        if kind != "eagle3":
            raise refuse("speculators_model_type", f"{kind!r} is not an EAGLE-3 head")
        algo = (raw.get("speculators_config") or {}).get("algorithm", "eagle3")
        if algo != "eagle3":
            raise refuse("speculators_config.algorithm", f"{algo!r} is not 'eagle3'")
        src = raw.get("transformer_layer_config")
        if not isinstance(src, dict):
            raise refuse("transformer_layer_config", "missing (speculators layout)")
        src = {**_LLAMA_DEFAULTS, **src}  # written as a diff against LlamaConfig's defaults
        prefix = "transformer_layer_config."
        for flag, meaning in (("fc_norm", "per-layer norms before fc"),
                              ("norm_output", "the post-norm output fed back")):
            if raw.get(flag):
                raise refuse(flag, f"true ({meaning}) is not supported")
        if "norm_before_residual" not in raw:
            notes.append("norm_before_residual absent: speculators' default false (vLLM's "
                         "speculators adapter would assume true)")
        norm_before_residual = bool(raw.get("norm_before_residual", False))
        norm_before_fc = bool(raw.get("norm_before_fc", False))
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        ids_source = "config (capture-before, verbatim as vLLM reads speculators ids)"
        draft_vocab = raw.get("draft_vocab_size") or src["vocab_size"]
        target_hidden = raw.get("target_hidden_size")
    else:
        src = {**_LLAMA_DEFAULTS, **raw}
        prefix = ""
        for flag in ("norm_before_residual", "norm_before_fc", "fc_norm"):
            if raw.get(flag):
                raise refuse(flag, f"true is not part of the {layout} layout")
        if layout == "specforge":
            if raw.get("norm_output") is False:
                raise refuse("norm_output", "false (lm_head without the final norm) is not "
                                            "supported")
            if raw.get("tie_word_embeddings"):
                raise refuse("tie_word_embeddings", "true (SGLang would use the embedding as "
                                                    "lm_head) is not supported")
        norm_before_residual = norm_before_fc = False
        eagle_cfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) \
            else {}
        ids = raw.get("eagle_aux_hidden_state_layer_ids",
                      eagle_cfg.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and layout == "specforge":
            # SGLang reads explicit ids as "output of layer X" and captures before X + 1.
            try:
                ids = [int(i) + 1 for i in ids]
            except (TypeError, ValueError):
                raise refuse("eagle_aux_hidden_state_layer_ids",
                             f"not a list of ints: {ids!r}") from None
            ids_source = "config (SGLang's output-of-layer ids, converted to capture-before +1)"
        else:
            ids_source = "config (capture-before, verbatim as vLLM reads them)"
        draft_vocab = raw.get("draft_vocab_size") or src["vocab_size"]
        target_hidden = raw.get("target_hidden_size")
    if ids is None:
        ids_source = "default (2, N // 2, N - 3) for the target's N layers"

    model_type = src.get("model_type", "llama")
    if model_type != "llama":
        raise refuse(prefix + "model_type", f"{model_type!r} is not supported (only llama "
                                            "layers)")
    if int(src["num_hidden_layers"]) != 1:
        raise refuse(prefix + "num_hidden_layers", f"{src['num_hidden_layers']}: only "
                                                   "one-layer heads are supported")
    if src.get("hidden_act", "silu") != "silu":
        raise refuse(prefix + "hidden_act", f"{src['hidden_act']!r} is not supported (silu)")
    for flag in ("attention_bias", "bias", "mlp_bias"):
        if src.get(flag):
            raise refuse(prefix + flag, "true is not supported (no biases)")
    rope = src.get("rope_parameters") or src.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise refuse(prefix + "rope_scaling", f"not an object: {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise refuse(prefix + "rope_scaling", f"rope type {rope_type!r} is not supported "
                                              "(default, llama3)")
    try:
        h, nh = int(src["hidden_size"]), int(src["num_attention_heads"])
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
        config = Eagle3Config(
            hidden_size=h, vocab_size=int(src["vocab_size"]),
            draft_vocab_size=int(draft_vocab), n_heads=nh,
            n_kv_heads=int(src.get("num_key_value_heads") or nh),
            head_dim=int(src.get("head_dim") or h // nh),
            ffn_dim=int(src["intermediate_size"]),
            target_hidden_size=None if target_hidden is None else int(target_hidden),
            rope_theta=float(rope.get("rope_theta", src.get("rope_theta"))),
            rope_scaling=scaling, rms_norm_eps=float(src["rms_norm_eps"]),
            aux_layers=None if ids is None else tuple(int(i) for i in ids),
            norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc)
    except KeyError as exc:
        raise ValueError(f"{where}: field {prefix}rope_scaling.{exc.args[0]!r} is "
                         "missing") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    info = {"layout": layout, "aux_layers_source": ids_source, "notes": notes}
    return config, info


def _normalise_names(state: dict, where: str) -> dict:
    """Tensor names as the head's (``layers.0.`` -> ``midlayer.``).

    Raises:
        ValueError: a tensor of a second layer (``layers.1.*``).
    """
    out = {}
    for name, value in state.items():
        if name.startswith("layers."):
            index, _, rest = name[len("layers."):].partition(".")
            if index != "0":
                raise ValueError(f"{where}: tensor {name!r}: only one-layer heads are "
                                 "supported")
            name = "midlayer." + rest
        out[name] = value
    return out


def _check_tensor_names(shapes: dict[str, tuple[int, ...]], config: Eagle3Config,
                        where: str) -> None:
    """Refuses missing, unexpected and wrongly shaped tensors (``shapes`` by head name).

    Raises:
        ValueError: naming the tensor and both shapes.
    """
    expected = config.expected_shapes("embed_tokens.weight" in shapes)
    optional = {"d2t", "t2d"}
    for name in shapes:
        if name not in expected:
            raise ValueError(f"{where}: unexpected tensor {name!r}")
    for name, shape in expected.items():
        if name not in shapes:
            if name in optional:
                continue
            raise ValueError(f"{where}: tensor {name!r} is missing")
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(shapes[name])}, the "
                             f"config needs {list(shape)}")
    if "d2t" not in shapes and config.draft_vocab_size != config.vocab_size:
        raise ValueError(f"{where}: tensor 'd2t' is missing and draft_vocab_size "
                         f"{config.draft_vocab_size} < vocab_size {config.vocab_size}")

