"""Hugging Face checkpoint directories: ``config.json``, safetensors weights, tokenizer.

A directory as ``save_pretrained`` writes it (and as vLLM, SGLang and TGI load it):
``config.json``; ``model.safetensors``, or shards listed in ``model.safetensors.index.json``;
``tokenizer.json`` / ``tokenizer_config.json`` (with the chat template, or a
``chat_template.jinja`` beside it). Supported ``architectures``: see `ARCHITECTURES`.

Weights are read in place: `HFSource` keeps the safetensors files open (memory-mapped,
``safe_open``) and reads each Decoder tensor, or a tensor-parallel rank's slice of it, from the
checkpoint tensors named in the architecture's table (`WEIGHT_TABLES`); no converted copy is
written. HF checkpoints use the rotate-half RoPE layout the `Decoder` computes in, so Q/K rows
need no un-permutation (unlike llama.cpp's GGUF files).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd_core.config_check import check_config_sizes

from .config import ModelConfig, MoEConfig, RopeScaling
from .sharded import WeightSource

__all__ = [
    "ARCHITECTURES",
    "WEIGHT_TABLES",
    "HFSource",
    "check_tokenizer_fits",
    "is_hf_dir",
    "load_hf_tokenizer",
    "read_hf_config",
]

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class Stack:
    """A Decoder tensor that stacks one tensor per MoE expert (``{e}`` in ``part``) on a new
    leading dimension; ``part`` is a checkpoint name or a tuple of them (concatenated)."""

    part: str | tuple[str, ...]


# One table per architecture: Decoder state-dict name -> checkpoint tensor name(s). ``{i}`` is
# the layer; a tuple concatenates its tensors along dim 0 (the fused Q/K/V and gate/up rows).
_ATTN = {
    "layers.{i}.attn.wqkv.weight": tuple(
        f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv"),
    "layers.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}
_ENDS = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_DENSE_FFN = {
    "layers.{i}.ffn.w_gate_up.weight": ("model.layers.{i}.mlp.gate_proj.weight",
                                        "model.layers.{i}.mlp.up_proj.weight"),
    "layers.{i}.ffn.w_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_QKV_BIAS = {
    "layers.{i}.attn.wqkv.bias": tuple(
        f"model.layers.{{i}}.self_attn.{x}_proj.bias" for x in "qkv"),
}
_MOE = "model.layers.{i}.block_sparse_moe."
WEIGHT_TABLES: dict[str, dict[str, str | tuple[str, ...] | Stack]] = {
    "LlamaForCausalLM": {**_ENDS, **_ATTN, **_DENSE_FFN},
    "MistralForCausalLM": {**_ENDS, **_ATTN, **_DENSE_FFN},
    "Qwen2ForCausalLM": {**_ENDS, **_ATTN, **_QKV_BIAS, **_DENSE_FFN},
    # Mixtral's router is softmax -> top-k -> renormalise, as `target_worker.model.MoE`.
    "MixtralForCausalLM": {
        **_ENDS, **_ATTN,
        "layers.{i}.ffn.router.weight": _MOE + "gate.weight",
        "layers.{i}.ffn.w_gate_up": Stack((_MOE + "experts.{e}.w1.weight",
                                           _MOE + "experts.{e}.w3.weight")),
        "layers.{i}.ffn.w_down": Stack(_MOE + "experts.{e}.w2.weight"),
    },
}
#: Supported ``architectures`` values of ``config.json``.
ARCHITECTURES = tuple(WEIGHT_TABLES)
_ROPE_TYPES = ("default", "llama3")
# Checkpoint tensors that carry nothing the Decoder needs (older Llama checkpoints).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# The config.json fields that set each Decoder tensor's shape (named in shape errors).
_SHAPE_FIELDS = {
    "attn.wqkv": "num_attention_heads, num_key_value_heads, head_dim, hidden_size",
    "attn.wo": "num_attention_heads, head_dim, hidden_size",
    "ffn.router": "num_local_experts, hidden_size",
    "ffn.w_": "intermediate_size, hidden_size",
    "embed_tokens": "vocab_size, hidden_size",
    "lm_head": "vocab_size, hidden_size",
    "norm": "hidden_size",
}


def _shape_fields(name: str) -> str:
    return next((f for key, f in _SHAPE_FIELDS.items() if key in name), "hidden_size")


def is_hf_dir(source: Any) -> bool:
    """Whether a `load_model` source names a directory (a Hugging Face checkpoint)."""
    return isinstance(source, (str, Path)) and Path(source).is_dir()


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: file is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_hf_config(directory: str | Path) -> tuple[ModelConfig, str]:
    """``(config, architecture)`` from ``<directory>/config.json`` (reads no weights).

    Understands transformers 5's ``rope_parameters`` and the older ``rope_theta`` /
    ``rope_scaling`` keys. A ``sliding_window`` (Mistral; Qwen2 with ``use_sliding_window``)
    caps ``max_seq_len`` at the window, where full attention equals windowed attention.

    Raises:
        ValueError: naming ``config.json`` and the field: a missing file or key, an
            architecture not in `ARCHITECTURES`, a rope type other than default/llama3, an
            activation other than silu, or a value `ModelConfig` refuses.
    """
    path = Path(directory) / CONFIG_FILE
    raw = _read_json(path)
    check_config_sizes(raw, path)  # finite, positive, sane: before any int() or allocation
    archs = raw.get("architectures")
    if not isinstance(archs, list) or len(archs) != 1:
        raise ValueError(f"{path}: field 'architectures' must list one class, got {archs!r}")
    arch = archs[0]
    if arch not in WEIGHT_TABLES:
        raise ValueError(f"{path}: field 'architectures': {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise ValueError(f"{path}: field {key!r} is missing")
        return raw[key]

    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{path}: field 'hidden_act': {act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise ValueError(f"{path}: fields 'attention_bias'/'mlp_bias' are not supported")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"{path}: field 'rope_parameters.rope_type': {rope_type!r} is not "
                         f"supported (supported: {', '.join(_ROPE_TYPES)})")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    hidden, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    max_seq = int(need("max_position_embeddings"))
    window = raw.get("sliding_window")
    if window and raw.get("use_sliding_window", arch == "MistralForCausalLM"):
        max_seq = min(max_seq, int(window))
    try:
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        moe = None
        if arch == "MixtralForCausalLM":
            moe = MoEConfig(n_experts=int(need("num_local_experts")),
                            n_experts_active=int(need("num_experts_per_tok")),
                            n_shared_experts=0, expert_ffn_dim=int(need("intermediate_size")))
        config = ModelConfig(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            n_layers=int(need("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or hidden // n_heads),
            ffn_dim=int(need("intermediate_size")),
            max_seq_len=max_seq,
            rope_theta=float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            moe=moe,
            qkv_bias=arch == "Qwen2ForCausalLM",
            rope_scaling=scaling,
        )
    except KeyError as exc:
        raise ValueError(f"{path}: field 'rope_parameters.{exc.args[0]}' is missing") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return config, arch


def _expand(arch: str, config: ModelConfig) -> dict[str, Any]:
    """The table of ``arch`` for ``config``: every Decoder tensor name -> its spec, with
    ``{i}`` and ``{e}`` filled in (a `Stack` becomes a list of per-expert specs)."""
    experts = config.moe.n_experts if config.moe is not None else 0

    def fill(spec: Any, **keys: int) -> Any:
        if isinstance(spec, Stack):
            return [fill(spec.part, e=e, **keys) for e in range(experts)]
        if isinstance(spec, tuple):
            return tuple(fill(s, **keys) for s in spec)
        return spec.format(**keys)

    out = {}
    for name, spec in WEIGHT_TABLES[arch].items():
        if name == "lm_head.weight" and config.tie_embeddings:
            continue
        if "{i}" not in name:
            out[name] = spec
            continue
        for i in range(config.n_layers):
            out[name.format(i=i)] = fill(spec, i=i)
    return out


class HFSource(WeightSource):
    """Decoder tensors (or slices of them) read from a checkpoint directory's safetensors.

    Opening reads only the safetensors headers and checks them against the config: every
    tensor the architecture's table needs is present with the shape the config implies, and
    no unknown tensor is left over. `get` then reads just the rows asked for (``get_slice``
    on the memory-mapped file), concatenating fused tensors and stacking experts as the table
    says; dtype is the file's (the caller casts).

    Raises:
        ValueError: naming the file and tensor: a missing index or weights file, a missing
            tensor, a shape that does not match ``config.json``, or an unexpected tensor.
    """

    def __init__(self, directory: str | Path, config: ModelConfig, arch: str) -> None:
        from safetensors import safe_open

        from .model import Decoder

        self.dir = d = Path(directory)
        index = d / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: field 'weight_map' is missing or empty")
            files = sorted(set(weight_map.values()))
        elif (d / SINGLE_FILE).is_file():
            files, weight_map = [SINGLE_FILE], None
        else:
            raise ValueError(f"{d}: no {SINGLE_FILE} or {INDEX_FILE} (safetensors weights)")
        self._files: dict[str, Any] = {}
        self._where: dict[str, str] = {}
        for name in files:
            if not (d / name).is_file():
                raise ValueError(f"{index}: weights file {name!r} is missing")
            try:
                handle = safe_open(str(d / name), framework="pt")
            except Exception as exc:  # safetensors' errors do not name the file
                raise ValueError(f"{d / name}: not a readable safetensors file ({exc})") from exc
            self._files[name] = handle
            for key in handle.keys():
                self._where[key] = name
        if weight_map is not None:
            for key, name in weight_map.items():
                if self._where.get(key) != name:
                    raise ValueError(f"{index}: tensor {key!r} is not in {name!r}")
        self.table = _expand(arch, config)
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in Decoder(config).state_dict().items()}
        used = set()
        for name, spec in self.table.items():
            got = self._check(spec, used)
            if got != expected[name]:
                raise ValueError(
                    f"{d / CONFIG_FILE}: tensor(s) {self._names(spec)[:3]} give {name} shape "
                    f"{got}, but fields ({_shape_fields(name)}) imply {expected[name]}"
                )
        extra = [k for k in self._where if k not in used and not k.endswith(_IGNORED_SUFFIXES)
                 and not (k == "lm_head.weight" and config.tie_embeddings)]
        if extra:
            raise ValueError(f"{d / self._where[extra[0]]}: unexpected tensor(s) {extra[:5]} "
                             f"for {arch} (is 'architectures' in config.json right?)")

    def _names(self, spec: Any) -> list[str]:
        if isinstance(spec, str):
            return [spec]
        return [n for s in spec for n in self._names(s)]

    def _check(self, spec: Any, used: set) -> tuple[int, ...]:
        """Shape of the tensor ``spec`` builds, checking its parts fit together."""
        if isinstance(spec, str):
            if spec not in self._where:
                raise ValueError(f"{self.dir}: tensor {spec!r} is missing from the weights")
            used.add(spec)
            return tuple(self._files[self._where[spec]].get_slice(spec).get_shape())
        shapes = [self._check(s, used) for s in spec]
        if any(s[1:] != shapes[0][1:] or (isinstance(spec, list) and s != shapes[0])
               for s in shapes):
            raise ValueError(f"{self.dir}: tensors {self._names(spec)[:4]} have mismatched "
                             f"shapes {shapes[:4]}")
        if isinstance(spec, list):  # stacked experts
            return (len(shapes), *shapes[0])
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def _read(self, spec: Any, index: tuple[slice, ...]) -> torch.Tensor:
        if isinstance(spec, str):
            f = self._files[self._where[spec]]
            return f.get_slice(spec)[index] if index else f.get_tensor(spec)
        first = index[0] if index else slice(None)
        rest = index[1:]
        if first.step not in (None, 1):
            raise ValueError(f"slices with a step are not supported, got {first}")
        if isinstance(spec, list):  # experts: the first index picks them
            return torch.stack([self._read(s, rest) for s in spec[first]])
        lo, hi, _ = first.indices(self._check(spec, set())[0])
        parts, offset = [], 0
        for s in spec:
            n = self._check(s, set())[0]
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                parts.append(self._read(s, (slice(a - offset, b - offset), *rest)))
            offset += n
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def get(self, name: str, *index: slice) -> torch.Tensor:
        """``decoder_tensor[index]`` (one slice per leading dim) in the file's dtype, in memory
        this process owns."""
        spec = self.table[name]
        part = self._read(spec, index)
        # A tensor read straight from the file sits at its offset there, 8-byte aligned only;
        # MKL matmuls on such weights measured markedly slower (SmolLM2 decode), so copy it
        # into a fresh (64-byte aligned) allocation. Fused tensors are fresh already.
        return part.clone() if isinstance(spec, str) or not part.is_contiguous() else part

    def has(self, name: str) -> bool:
        return name in self.table


def check_tokenizer_fits(tokenizer: Any, directory: str | Path, config: ModelConfig) -> None:
    """Raises ValueError (naming the tokenizer file and ``config.json``'s ``vocab_size``) when
    the tokenizer has ids the embedding has no row for."""
    size = len(tokenizer)
    if size > config.vocab_size:
        d = Path(directory)
        raise ValueError(f"{d / 'tokenizer.json'}: the tokenizer has {size} tokens, more than "
                         f"field 'vocab_size' ({config.vocab_size}) of {d / CONFIG_FILE}")


def load_hf_tokenizer(directory: str | Path) -> Any:
    """The directory's tokenizer and chat template via transformers' ``AutoTokenizer``.

    Raises:
        ValueError: naming the directory when it has no tokenizer files or transformers
            cannot load them.
    """
    from transformers import AutoTokenizer

    d = Path(directory)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(f"{d}: no tokenizer.json or tokenizer_config.json (the tokenizer)")
    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as exc:  # transformers raises many kinds; name the directory
        msg = f"{d}: the tokenizer does not load ({type(exc).__name__}: {exc})"
        raise ValueError(msg) from exc
