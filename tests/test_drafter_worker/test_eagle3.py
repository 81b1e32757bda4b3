"""The EAGLE-3 drafter: heads written in every layout users have (EAGLE safetensors / .bin /
sharded, speculators, SpecForge) drafting exactly what an independent reference forward of the
published architecture computes, every mismatch refused by name, our own heads round-tripping
through the speculators layout, the training forward equal to drafting, and losslessness in
process (greedy token-identical, T=1 marginals exact)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from drafters import exact_marginals, plain_decode, tv_tolerance

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.eagle import NeedsResync
from drafter_worker.eagle3 import (
    RECIPE_FILE,
    Eagle3Config,
    Eagle3Drafter,
    Eagle3Head,
    SuffixThenEagle3,
    default_aux_layers,
    inspect_eagle3,
    load_eagle3,
)
from drafter_worker.registry import check_drafter
from drafter_worker.suffix import SuffixDrafter
from specd_core.request import SpeculativeOptions
from specd_core.sampling import DraftSamplingParams, SamplingParams
from target_worker.config import ModelConfig
from target_worker.model import Decoder

# The tiny target: 8 layers (default aux layers (2, 4, 5) distinct), H 64, 4/2 heads of 16.
TARGET = ModelConfig(vocab_size=96, hidden_size=64, n_layers=8, n_heads=4, n_kv_heads=2,
                     head_dim=16, ffn_dim=128, max_seq_len=256, rms_norm_eps=1e-5)
# A narrower target for a head whose own width differs (target_hidden_size).
NARROW = ModelConfig(vocab_size=96, hidden_size=32, n_layers=8, n_heads=4, n_kv_heads=2,
                     head_dim=8, ffn_dim=64, max_seq_len=256, rms_norm_eps=1e-5)
H, NH, NKV, HD, FFN, V, VD = 64, 4, 2, 16, 128, 96, 40
EPS = 1e-5
HISTORY = [1, 17, 5, 33, 9, 60, 2, 41, 7]


def target(config: ModelConfig = TARGET, seed: int = 0) -> Decoder:
    return Decoder.random(config, seed=seed)


# ---- the reference: the published architecture, written from the paper / vLLM ----


def make_weights(seed: int, vd: int = VD, ht: int = H, own_embed: bool = False,
                 input_norm: bool = False, dtype: torch.dtype = torch.float16
                 ) -> dict[str, torch.Tensor]:
    """EAGLE-named head tensors: float32 values exact in ``dtype`` (what the files store),
    norms away from 1."""
    g = torch.Generator().manual_seed(seed)

    def lin(out, inp, scale=1.0):
        return (scale * torch.randn(out, inp, generator=g) / math.sqrt(inp)).to(dtype).float()

    def norm(n):
        return (1 + 0.3 * torch.randn(n, generator=g)).to(dtype).float()

    w = {
        "fc.weight": lin(H, 3 * ht),
        "midlayer.input_layernorm.weight": norm(H),
        "midlayer.hidden_norm.weight": norm(H),
        "midlayer.self_attn.q_proj.weight": lin(NH * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": lin(NKV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": lin(NKV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": lin(H, NH * HD, 0.5),
        "midlayer.post_attention_layernorm.weight": norm(H),
        "midlayer.mlp.gate_proj.weight": lin(FFN, H),
        "midlayer.mlp.up_proj.weight": lin(FFN, H),
        "midlayer.mlp.down_proj.weight": lin(H, FFN, 0.5),
        "norm.weight": norm(H),
        "lm_head.weight": lin(vd, H, 3.0),  # spread-out logits: sampled q is not flat
    }
    ids = torch.randperm(V, generator=g)[:vd].sort().values
    w["d2t"] = ids - torch.arange(vd)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if own_embed:
        w["embed_tokens.weight"] = torch.randn(V, H, generator=g).to(dtype).float()
    if input_norm:
        w["input_norm.weight"] = norm(3 * ht)
    return w


def rms(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rope(x, theta):
    """HF Llama rotate_half RoPE at positions 0..T-1 for x [T, heads, d]."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(t, dtype=torch.float32)[:, None] * inv[None]
    cos = torch.cat((ang.cos(), ang.cos()), -1)[:, None]
    sin = torch.cat((ang.sin(), ang.sin()), -1)[:, None]
    rot = torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)
    return x * cos + rot * sin


def ref_layer(w, hidden, embeds, nbr, theta):
    """EAGLE-3's midlayer over all positions, causal, no cache: pre-norm outputs [T, H]."""
    t = hidden.shape[0]
    normed = rms(hidden, w["midlayer.hidden_norm.weight"])
    residual = normed if nbr else hidden
    x = torch.cat((rms(embeds, w["midlayer.input_layernorm.weight"]), normed), -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, NH, HD)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, NKV, HD)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, NKV, HD)
    q, k = rope(q, theta), rope(k, theta)
    out = torch.empty(t, NH, HD)
    for head in range(NH):
        kv = head // (NH // NKV)
        scores = q[:, head] @ k[:, kv].T / math.sqrt(HD)
        scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
        out[:, head] = torch.softmax(scores, -1) @ v[:, kv]
    a = residual + out.reshape(t, NH * HD) @ w["midlayer.self_attn.o_proj.weight"].T
    m = rms(a, w["midlayer.post_attention_layernorm.weight"])
    gate = F.silu(m @ w["midlayer.mlp.gate_proj.weight"].T)
    return a + (gate * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"].T


def ref_logits(w, embed_table, rows, history, drafted, nbr=False, theta=10000.0):
    """The draft logits [Vd] after ``history`` (rows: the target's captured rows of its
    first len(history) - 1 positions) and the tokens ``drafted`` so far: pairs (row t, token
    t + 1) at positions t, then the head's own previous pre-norm output with each drafted
    token, recomputed from scratch."""
    tokens = [*history, *drafted]
    aux = rows
    if "input_norm.weight" in w:
        aux = rms(aux, w["input_norm.weight"])
    inputs = list(aux @ w["fc.weight"].T)
    n = len(history) - 1
    out = None
    for t in range(n, n + len(drafted) + 1):
        feed = torch.stack(inputs[:t])
        out = ref_layer(w, feed, embed_table[torch.tensor(tokens[1: t + 1])], nbr, theta)
        inputs.append(out[-1])
    return rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T


def ref_chain(w, embed_table, rows, history, k, nbr=False, theta=10000.0):
    """The greedy draft chain (target ids) of the reference."""
    vocab_ids = torch.arange(w["lm_head.weight"].shape[0]) + w.get(
        "d2t", torch.zeros(w["lm_head.weight"].shape[0], dtype=torch.long))
    drafted = []
    for _ in range(k):
        logits = ref_logits(w, embed_table, rows, history, drafted, nbr, theta)
        drafted.append(int(vocab_ids[int(logits.argmax())]))
    return drafted


# ---- writing checkpoints the way each tool lays them out ----


def llama_config(vd=VD, ht=None, **extra) -> dict:
    """An HF LlamaConfig-style head config (EAGLE's traineagle3/config.json shape)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": FFN, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "head_dim": HD, "num_hidden_layers": 1, "rms_norm_eps": EPS, "vocab_size": V,
           "draft_vocab_size": vd, "max_position_embeddings": 2048, "hidden_act": "silu",
           "tie_word_embeddings": False, "torch_dtype": "float16"}
    if ht is not None:
        cfg["target_hidden_size"] = ht
    cfg.update(extra)
    return cfg


def write_eagle(d, w, fmt="safetensors", **cfg_extra):
    """EAGLE repository layout: config.json + model.safetensors / pytorch_model.bin /
    a sharded safetensors index; float16 weights, int64 d2t, bool t2d."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(llama_config(w["lm_head.weight"].shape[0],
                                                           **cfg_extra)))
    state = {k: (v.half() if v.is_floating_point() else v) for k, v in w.items()}
    if fmt == "bin":
        torch.save(state, d / "pytorch_model.bin")
    elif fmt == "sharded":
        names = sorted(state)
        half = len(names) // 2
        parts = {"model-00001-of-00002.safetensors": names[:half],
                 "model-00002-of-00002.safetensors": names[half:]}
        for f, keys in parts.items():
            save_file({k: state[k].contiguous() for k in keys}, str(d / f))
        (d / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: f for f, keys in parts.items() for k in keys}}))
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, str(d / "model.safetensors"))
    return d


def write_speculators(d, w, nbr, ids=None, **top_extra):
    """Red Hat speculators layout: layers.0.* tensors, speculators config with a
    transformer_layer_config written as a diff against LlamaConfig's defaults."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": FFN,
             "num_hidden_layers": 1, "num_attention_heads": NH, "num_key_value_heads": NKV,
             "head_dim": HD, "rms_norm_eps": EPS}  # rope_theta 10000: LlamaConfig's default
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
           "speculators_version": "0.3.0", "draft_vocab_size": w["lm_head.weight"].shape[0],
           "norm_before_residual": nbr, "target_hidden_size": None,
           "eagle_aux_hidden_state_layer_ids": ids, "transformer_layer_config": layer,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "tiny",
                                               "architectures": ["LlamaForCausalLM"]}}}
    cfg.update(top_extra)
    (d / "config.json").write_text(json.dumps(cfg))
    state = {(("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k):
             (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
             for k, v in w.items()}
    save_file(state, str(d / "model.safetensors"))
    return d


def write_specforge(d, w, **cfg_extra):
    """SpecForge export: EAGLE names, no embeddings, LlamaForCausalLMEagle3."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(w["lm_head.weight"].shape[0], architectures=["LlamaForCausalLMEagle3"],
                       rope_theta=10000.0)
    cfg.update(cfg_extra)
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items() if "embed" not in k},
              str(d / "model.safetensors"))
    return d


def rows_of(decoder, layers, tokens):
    decoder.set_capture_layers(layers)
    try:
        return decoder.forward_batch_with_hidden(list(tokens), 0, decoder.new_cache())[1]
    finally:
        decoder.set_capture_layers(())


# ---- every layout drafts what the reference computes ----


BF16 = torch.bfloat16  # what speculators writes
LAYOUTS = {
    # name: (writer, weights kwargs, nbr, target config, expected layout, aux layers)
    "eagle-safetensors-own-embed": (lambda d, w: write_eagle(d, w), {"own_embed": True},
                                    False, TARGET, "eagle", (2, 4, 5)),
    "eagle-bin": (lambda d, w: write_eagle(d, w, "bin"), {}, False, TARGET, "eagle",
                  (2, 4, 5)),
    "eagle-sharded": (lambda d, w: write_eagle(d, w, "sharded"), {}, False, TARGET, "eagle",
                      (2, 4, 5)),
    "eagle-target-hidden-32": (lambda d, w: write_eagle(d, w, ht=32), {"own_embed": True,
                                                                       "ht": 32},
                               False, NARROW, "eagle", (2, 4, 5)),
    "speculators-nbr-false": (lambda d, w: write_speculators(d, w, False, [1, 4, 7]),
                              {"own_embed": True, "dtype": BF16}, False, TARGET, "speculators",
                              (1, 4, 7)),
    "speculators-nbr-true": (lambda d, w: write_speculators(d, w, True),
                             {"own_embed": True, "dtype": BF16}, True, TARGET, "speculators",
                             (2, 4, 5)),
    "speculators-norm-before-fc": (lambda d, w: write_speculators(d, w, False,
                                                                  norm_before_fc=True),
                                   {"input_norm": True, "dtype": BF16}, False, TARGET,
                                   "speculators", (2, 4, 5)),
    "specforge-no-embed": (lambda d, w: write_specforge(d, w), {}, False, TARGET, "specforge",
                           (2, 4, 5)),
    # SGLang's "output of layer X" ids: captured before X + 1.
    "specforge-sglang-ids": (lambda d, w: write_specforge(
        d, w, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}), {}, False, TARGET,
        "specforge", (1, 4, 7)),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_layout_drafts_exactly_what_the_reference_architecture_computes(name, tmp_path):
    writer, wkw, nbr, tcfg, layout, aux = LAYOUTS[name]
    decoder = target(tcfg, seed=1)
    w = make_weights(seed=list(LAYOUTS).index(name), **wkw)
    path = writer(tmp_path / "head", w)
    head, info = load_eagle3(path, tcfg)
    assert info["layout"] == layout
    assert head.config.aux_layers == aux and head.config.norm_before_residual == nbr
    assert info["embedding"] == ("own" if "embed_tokens.weight" in w else "target")
    # float32 weights: the reference computes in float32 (bfloat16: the q test below).
    drafter = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=4,
                            dtype="float32")
    assert drafter.hidden_layers == aux
    table = w.get("embed_tokens.weight", decoder.embed_tokens.weight)
    rows = rows_of(decoder, aux, HISTORY[:-1])
    assert rows.shape == (len(HISTORY) - 1, 3 * tcfg.hidden_size)
    # Greedy: the reference's argmax chain, in target ids.
    block = drafter.session().propose(HISTORY, rows, 4)
    assert list(block.tokens) == ref_chain(w, table, rows, HISTORY, 4, nbr)
    assert all(d.support() == ((t, 1.0),) for t, d in zip(block.tokens, block.dists,
                                                             strict=True))
    # At temperature 1 the same chain, still point masses: drafts are the head's argmax at
    # every temperature (the rule couples them to plain sampling).
    session = drafter.session(DraftSamplingParams(temperature=1.0), seed=3)
    block = session.propose(HISTORY, rows, 4)
    assert list(block.tokens) == ref_chain(w, table, rows, HISTORY, 4, nbr)
    assert all(d.support() == ((t, 1.0),) for t, d in zip(block.tokens, block.dists,
                                                             strict=True))
    # The session is back at the committed positions.
    assert session.cache.seq_len == len(HISTORY) - 1


@pytest.mark.parametrize("d2t", ["zeros", "absent"])
def test_a_full_draft_vocabulary_with_zero_or_absent_d2t_drafts_target_ids_directly(d2t,
                                                                                  tmp_path):
    decoder = target(seed=2)
    w = make_weights(seed=5, vd=V)
    assert bool((w["d2t"] == 0).all()) and bool(w["t2d"].all())
    if d2t == "absent":
        del w["d2t"], w["t2d"]
        path = write_specforge(tmp_path / "h", w)
    else:
        path = write_eagle(tmp_path / "h", w)
    head, _ = load_eagle3(path, TARGET)
    assert torch.equal(head.vocab_ids, torch.arange(V)) and bool(head.t2d.all())
    drafter = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=4,
                            dtype="float32")
    rows = rows_of(decoder, drafter.hidden_layers, HISTORY[:-1])
    block = drafter.session().propose(HISTORY, rows, 4)
    assert list(block.tokens) == ref_chain(w, decoder.embed_tokens.weight, rows, HISTORY, 4)


# ---- refusals, by name, before anything serves ----


def _refused(tmp_path, match, target_config=TARGET, writer=write_eagle, unloaded=False,
             **changes):
    """Loading the head refuses it; ``unloaded``: so do `inspect_eagle3` and `check_drafter`
    given the target's config, without reading a weight (what a service checks first)."""
    w = make_weights(seed=9)
    for key, value in changes.items():
        name = key.replace("__", ".")
        if value is None:
            del w[name]
        else:
            w[name] = value
    path = writer(tmp_path / "h", w)
    with pytest.raises(ValueError, match=match):
        load_eagle3(path, target_config)
    if unloaded:
        inspect_eagle3(path)  # fine on its own: only the target makes it a misfit
        with pytest.raises(ValueError, match=match):
            inspect_eagle3(path, target_config)
        with pytest.raises(ValueError, match=match):
            check_drafter("eagle3", drafter_path=str(path), target_config=target_config)


def test_tensor_mismatches_are_refused_naming_the_tensor_and_both_shapes(tmp_path):
    _refused(tmp_path / "a", r"tensor 'norm.weight' is missing", norm__weight=None)
    _refused(tmp_path / "b", r"unexpected tensor 'midlayer.extra.weight'",
             midlayer__extra__weight=torch.zeros(3))
    _refused(tmp_path / "c", r"tensor 'fc.weight' has shape \[64, 190\], the config needs "
                             r"\[64, 192\]", fc__weight=torch.zeros(64, 190))
    _refused(tmp_path / "d", r"tensor 'd2t' is missing and draft_vocab_size 40 < vocab_size "
                             r"96", d2t=None)
    _refused(tmp_path / "e", r"only one-layer heads", writer=lambda d, w: write_speculators(
        d, {**w, "layers.1.norm.weight": torch.ones(H)}, False))
    _refused(tmp_path / "f", r"tensor 'd2t' has dtype torch.float16, must be integer",
             d2t=make_weights(seed=9)["d2t"].float())


def test_vocabulary_map_mismatches_are_refused_naming_the_ids(tmp_path):
    w = make_weights(seed=9)
    out = w["d2t"].clone()
    out[-1] += 200
    _refused(tmp_path / "a", r"d2t: draft id 39 maps to target id \d+, outside \[0, 96\)",
             d2t=out)
    swapped = w["d2t"].clone()
    mapped = torch.arange(VD) + swapped
    mapped[[3, 4]] = mapped[[4, 3]]
    _refused(tmp_path / "b", r"d2t: target ids must be strictly increasing, draft id 4",
             d2t=mapped - torch.arange(VD))
    extra = w["t2d"].clone()
    extra[(~extra).nonzero()[0]] = True
    _refused(tmp_path / "c", r"t2d: marks 41 target ids, draft_vocab_size is 40", t2d=extra)
    moved = w["t2d"].clone()
    first = int((torch.arange(VD) + w["d2t"])[0])
    moved[first] = False
    moved[(~w["t2d"]).nonzero()[0]] = True
    _refused(tmp_path / "d", rf"t2d: False at target id {first}, which d2t maps draft id 0",
             t2d=moved)


def test_target_mismatches_are_refused_naming_the_field_and_both_values(tmp_path):
    _refused(tmp_path / "a", r"target_hidden_size: the head reads rows of 3 x 64, the "
                             r"target's hidden_size is 32", target_config=NARROW, unloaded=True)
    other_vocab = ModelConfig(**{**TARGET.__dict__, "vocab_size": 80})
    _refused(tmp_path / "b", r"vocab_size: the head's is 96, the target's is 80",
             target_config=other_vocab, unloaded=True)
    _refused(tmp_path / "c", r"aux_layers: layer 9 of \[2, 4, 9\] is outside \[0, 8\]",
             writer=lambda d, w: write_speculators(d, w, False, [2, 4, 9]), unloaded=True)
    shallow = ModelConfig(**{**TARGET.__dict__, "n_layers": 6})
    _refused(tmp_path / "d", r"aux_layers: a 6-layer target has no distinct default",
             target_config=shallow, unloaded=True)
    # A head without embeddings, wider than the target: the target's table cannot serve it.
    w = make_weights(seed=1, ht=32)
    path = write_eagle(tmp_path / "e", w, ht=32)
    match = r"embed_tokens: the head has none and the target's embedding is 32 wide, the " \
            r"head's hidden_size is 64"
    with pytest.raises(ValueError, match=match):
        load_eagle3(path, NARROW)
    with pytest.raises(ValueError, match=match):  # the safetensors header says: no embedding
        inspect_eagle3(path, NARROW)
    # A .bin head's tensors are not read before loading: only loading finds that one.
    path = write_eagle(tmp_path / "f", w, "bin", ht=32)
    assert inspect_eagle3(path, NARROW)[1]["embedding"] is None
    with pytest.raises(ValueError, match=match):
        load_eagle3(path, NARROW)


@pytest.mark.parametrize("change, match", [
    ({"num_attention_heads": 3}, r"n_heads 3 is not divisible by n_kv_heads 2"),
    ({"head_dim": 8}, r"'midlayer.self_attn.q_proj.weight' has shape \[64, 128\], the config "
                      r"needs \[32, 128\]"),
    ({"num_hidden_layers": 2}, r"'num_hidden_layers': 2: only one-layer heads"),
    ({"model_type": "qwen3"}, r"'model_type': 'qwen3' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope type 'yarn'"),
    ({"hidden_act": "gelu"}, r"'hidden_act': 'gelu'"),
    ({"attention_bias": True}, r"'attention_bias': true is not supported"),
    ({"eagle_aux_hidden_state_layer_ids": [4, 2, 6]}, r"ascending"),
])
def test_config_problems_are_refused_naming_the_field(change, match, tmp_path):
    path = write_eagle(tmp_path / "h", make_weights(seed=2), **change)
    with pytest.raises(ValueError, match=match):
        inspect_eagle3(path)  # without loading weights (the shapes from headers only)
    with pytest.raises(ValueError, match=match):
        load_eagle3(path, TARGET)


@pytest.mark.parametrize("flag", ["fc_norm", "norm_output"])
def test_speculators_variants_we_do_not_implement_are_refused_by_name(flag, tmp_path):
    path = write_speculators(tmp_path / "h", make_weights(seed=2), False, **{flag: True})
    with pytest.raises(ValueError, match=rf"field '{flag}': true"):
        load_eagle3(path, TARGET)


def test_a_pickled_object_that_would_run_code_is_refused_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    d = tmp_path / "h"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(llama_config()))
    state = dict(make_weights(seed=1))
    state["fc.weight"] = Payload()
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model.bin: refused: not a plain tensor "
                                         r"checkpoint \(read with weights_only=True"):
        load_eagle3(d, TARGET)
    assert not marker.exists()
    # The payload is real: an unrestricted unpickler runs it.
    torch.load(d / "pytorch_model.bin", weights_only=False)
    assert marker.exists()


def test_paths_resolve_from_a_directory_or_a_file_inside_it_and_missing_ones_are_named(
        tmp_path):
    path = write_eagle(tmp_path / "h", make_weights(seed=1))
    for given in (path, path / "config.json", path / "model.safetensors"):
        assert load_eagle3(given, TARGET)[1]["directory"] == str(path)
    with pytest.raises(FileNotFoundError, match="EAGLE-3 head not found"):
        load_eagle3(tmp_path / "nowhere", TARGET)
    # A file that is not in a head directory: the message names that file.
    stray = tmp_path / "notes.md"
    stray.write_text("not a head")
    with pytest.raises(FileNotFoundError, match=r"EAGLE-3 head .*notes\.md .*no config\.json"):
        load_eagle3(stray, TARGET)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_eagle3(path, TARGET)


# ---- our own heads: the speculators layout, read back by the same loader ----


def test_save_writes_the_speculators_layout_and_loads_back_with_the_same_drafts(tmp_path):
    from safetensors import safe_open

    decoder = target(seed=3)
    config = Eagle3Config.for_target(TARGET, draft_vocab_size=VD, norm_before_residual=True)
    head = Eagle3Head.random(config, seed=4, draft_vocab=list(range(7, 87, 2)))
    with torch.no_grad():  # float16-exact, so the file holds the head exactly
        for p in head.parameters():
            p.copy_(p.half().float())
    recipe = {"epochs": 2, "ttt_steps": 3}
    out = head.save(tmp_path / "ours", recipe, verifier="tiny-target")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["algorithm"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert cfg["norm_before_residual"] is True and cfg["draft_vocab_size"] == VD
    assert cfg["transformer_layer_config"]["vocab_size"] == V
    assert json.loads((out / RECIPE_FILE).read_text()) == recipe
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == torch.int64
        assert f.get_tensor("t2d").dtype == torch.bool
        assert f.get_tensor("layers.0.self_attn.q_proj.weight").dtype == torch.float16
    assert "embed_tokens.weight" not in names and "layers.0.hidden_norm.weight" in names
    loaded, info = load_eagle3(out, TARGET)
    assert info["layout"] == "speculators" and info["embedding"] == "target"
    for name, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    ours = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=4)
    back = Eagle3Drafter(loaded, decoder.embed_tokens.weight, max_draft_len=4)
    rows = rows_of(decoder, ours.hidden_layers, HISTORY[:-1])
    sampling = DraftSamplingParams(temperature=0.8)
    assert back.session(sampling, 5).propose(HISTORY, rows, 4) == \
        ours.session(sampling, 5).propose(HISTORY, rows, 4)
    # A head with its own embeddings keeps them; a copy of the target's is shared instead.
    own = Eagle3Head.random(config, seed=4, own_embedding=True)
    loaded, info = load_eagle3(own.save(tmp_path / "own", dtype=torch.float32), TARGET)
    assert info["embedding"] == "own"
    assert Eagle3Drafter(loaded, decoder.embed_tokens.weight).head.has_own_embedding
    with torch.no_grad():
        own.embed_tokens.weight.copy_(decoder.embed_tokens.weight)
    loaded, _ = load_eagle3(own.save(tmp_path / "copy", dtype=torch.float32), TARGET)
    shared = Eagle3Drafter(loaded, decoder.embed_tokens.weight).head
    assert not shared.has_own_embedding
    assert shared._target_embed.data_ptr() == decoder.embed_tokens.weight.data_ptr()


# ---- training forward = drafting ----


def test_unrolled_training_forward_equals_what_a_session_drafts_with_teacher_tokens():
    """Step j of `forward_unrolled` at position p is what an `Eagle3Session` computes at
    draft step j + 1 from anchor p - j, fed the same true tokens (the property the trainer
    relies on), and its logits pick the session's draft."""
    decoder = target(seed=4)
    config = Eagle3Config.for_target(TARGET, draft_vocab_size=VD)
    head = Eagle3Head.random(config, seed=6, draft_vocab=list(range(0, 80, 2)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    # float32 weights, as the trainer's forward.
    drafter = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=4,
                            dtype="float32")
    stream = [1, 17, 5, 33, 9, 60, 2, 41, 7, 3, 88, 12]
    rows = rows_of(decoder, drafter.hidden_layers, stream)
    t = len(stream) - 1
    aux, next_ids = rows[None, :t].clone(), torch.tensor([stream[1:]])
    steps = head.forward_unrolled(aux, next_ids, 3)
    assert torch.allclose(steps[0], head(aux, next_ids))
    for p in range(2, t - 1):
        for j in range(3):
            anchor = p - j
            session = drafter.session()
            session.propose(stream[: anchor + 2], rows[: anchor + 1], 0)
            hidden = session._hidden
            for i in range(1, j + 1):
                hidden = head.step(hidden, torch.tensor([stream[anchor + 1 + i]]),
                                   session.cache)
            assert torch.allclose(hidden[0], steps[j][0, p], atol=1e-5), (p, j)
            # Greedy drafting after the same teacher tokens drafts the step's argmax.
            block = drafter.session().propose_ahead(
                stream[: anchor + 2], rows[: anchor + 1], stream[anchor + 2: anchor + 2 + j], 1)
            best = int(head.draft_logits(steps[j][0, p]).argmax())
            assert block.tokens[0] == int(drafter.vocab_ids[best]), (p, j)
    # The feedback is not teacher forcing: step 1 differs from step 0 at the same position.
    assert not torch.allclose(steps[1][0, 2:], steps[0][0, 2:], atol=1e-3)


def test_training_gradients_flow_through_the_unroll_but_not_into_the_embeddings():
    config = Eagle3Config.for_target(TARGET, draft_vocab_size=VD)
    head = Eagle3Head.random(config, seed=1, own_embedding=True)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(2, 10, 3 * H, generator=g)
    next_ids = torch.randint(0, V, (2, 10), generator=g)
    next_ids[1, 7:] = -1  # pads
    steps = head.forward_unrolled(aux, next_ids, 3)
    head.draft_logits(steps[2]).logsumexp(-1).mean().backward()
    for name in ("fc.weight", "midlayer.self_attn.q_proj.weight", "lm_head.weight",
                 "midlayer.hidden_norm.weight"):
        grad = dict(head.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert head.embed_tokens.weight.grad is None
    # Step 2's loss reaches fc both directly (the step-0 keys it attends to) and through the
    # fed-back outputs of steps 0 and 1; detaching the feedback drops the second path.
    full = head.fc.weight.grad.clone()
    head.zero_grad()
    detached = head.forward_unrolled(aux, next_ids, 3, detach_feedback=True)
    head.draft_logits(detached[2]).logsumexp(-1).mean().backward()
    assert torch.allclose(detached[2], steps[2])
    assert not torch.allclose(head.fc.weight.grad, full, atol=1e-6)
    # Padded rows of a batch do not change the other positions (causal): row 1's first 7
    # positions equal the same sequence alone.
    alone = head.forward_unrolled(aux[1:, :7], next_ids[1:, :7], 3)
    for j in range(3):
        assert torch.allclose(alone[j][0], steps[j][1, :7], atol=1e-5)


# ---- sessions ----


def test_after_partial_acceptance_proposals_equal_a_fresh_session_on_the_committed_prefix():
    decoder = target(seed=6)
    head = Eagle3Head.random(Eagle3Config.for_target(TARGET, draft_vocab_size=VD), seed=2)
    drafter = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=5)
    stream = [1, 4, 2, 8, 5, 7, 3, 9, 11, 6, 2, 12, 10, 4, 1]
    full = rows_of(decoder, drafter.hidden_layers, stream)
    session = drafter.session()
    # Commit 5 tokens, then steps accepting 0, 2 and 1 drafts (1, 3 and 2 new tokens).
    prev = None
    for end in (5, 6, 9, 11):
        rows = full[: end - 1] if prev is None else full[prev - 1: end - 1]
        got = session.propose(stream[:end], rows, 5)
        assert len(got) == 5
        assert got == drafter.session().propose(stream[:end], full[: end - 1], 5)
        assert session.cache.seq_len == end - 1  # rolled back to the committed positions
        prev = end
    with pytest.raises(NeedsResync):  # 1 row for 3 new tokens: rows were lost
        session.propose(stream[:14], full[12:13], 3)
    with pytest.raises(ValueError, match=r"hidden rows must be \[rows, 192\].*"
                                         r"set_capture_layers"):
        drafter.session().propose(stream[:5], full[:4, :64], 3)


def test_stop_tokens_end_a_block_and_min_confidence_cuts_it():
    decoder = target(seed=7)
    head = Eagle3Head.random(Eagle3Config.for_target(TARGET, draft_vocab_size=VD), seed=8)
    rows_layers = default_aux_layers(TARGET.n_layers)
    rows = rows_of(decoder, rows_layers, HISTORY[:-1])
    free = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=6).session() \
        .propose(HISTORY, rows, 5)
    assert len(free) == 5
    stop = free.tokens[1]
    stopped = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=6,
                            stop_token_ids=[stop]).session().propose(HISTORY, rows, 5)
    assert stopped.tokens == free.tokens[: free.tokens.index(stop) + 1]
    cut = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=6,
                        min_confidence=1.0).session().propose(HISTORY, rows, 5)
    assert len(cut) == 0  # no softmax over 40 tokens puts all mass on one
    with pytest.raises(ValueError, match="min_confidence"):
        Eagle3Drafter(head, decoder.embed_tokens.weight, min_confidence=1.5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sampled_drafts_are_point_masses_so_seeded_output_equals_plain_sampling(dtype):
    """At temperature > 0 the head still drafts its argmax as a point mass: the rule then
    draws every position as plain sampling does, so a seeded request gives plain sampling's
    tokens exactly, drafted or not (`specd_core.rule`), in either weight dtype."""
    decoder = target(seed=4)
    head = Eagle3Head.random(Eagle3Config.for_target(TARGET, draft_vocab_size=VD), seed=5)
    drafter = Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=4, dtype=dtype)
    weights = {name: p.dtype for name, p in head.named_parameters()}
    assert weights["lm_head.weight"] == weights["fc.weight"] == getattr(torch, dtype)
    assert weights["norm.weight"] == torch.float32  # norms (and activations) stay float32
    rows = rows_of(decoder, drafter.hidden_layers, HISTORY[:-1])
    block = drafter.session(DraftSamplingParams(temperature=0.8, top_k=8), seed=7).propose(
        HISTORY, rows, 4)
    assert list(block.tokens) == list(drafter.session().propose(HISTORY, rows, 4).tokens)
    assert all(d.support() == ((t, 1.0),) for t, d in zip(block.tokens, block.dists,
                                                             strict=True))
    assert drafter.capabilities.samples is False
    prompt = [1, 5, 2, 9, 3, 1, 5, 2]
    params = SamplingParams(temperature=0.8, top_p=0.9)
    for seed in range(3):
        options = SpeculativeOptions(max_new_tokens=20, sampling=params, seed=seed)
        drafted = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                          options)
        plain = speculative_decode_with(decoder, prompt, decoder.new_cache(), None, options)
        assert drafted.drafted_tokens > 0
        assert drafted.generated_tokens == plain.generated_tokens, seed


def test_the_head_drafts_in_bfloat16_by_default_where_the_cpu_has_bfloat16_dot_products(
        monkeypatch):
    import target_worker.loader as loader

    decoder = target(seed=4)
    config = Eagle3Config.for_target(TARGET, draft_vocab_size=VD)
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(loader, "cpu_has_bf16_dot", lambda native=native: native)
        head = Eagle3Drafter(Eagle3Head.random(config), decoder.embed_tokens.weight).head
        assert head.weight_dtype == dtype
    head = Eagle3Drafter(Eagle3Head.random(config), decoder.embed_tokens.weight,
                         dtype="float32").head
    assert head.weight_dtype == torch.float32
    with pytest.raises(ValueError, match="dtype: .* got 'int8'"):
        Eagle3Drafter(Eagle3Head.random(config), decoder.embed_tokens.weight, dtype="int8")


# ---- losslessness in process ----


def tiny_drafter(decoder, config: ModelConfig, vocab_ids, seed, max_draft_len=4,
                 min_confidence=0.0):
    head = Eagle3Head.random(Eagle3Config.for_target(config, draft_vocab_size=len(vocab_ids)),
                             seed=seed, draft_vocab=vocab_ids)
    return Eagle3Drafter(head, decoder.embed_tokens.weight, max_draft_len=max_draft_len,
                         min_confidence=min_confidence)


@pytest.mark.parametrize("name", ["eagle3", "eagle3+suffix"])
@pytest.mark.parametrize("pipeline", [False, True], ids=["serial", "pipelined"])
def test_greedy_output_is_token_identical_to_plain_decoding(name, pipeline):
    decoder = target(seed=1)
    prompt = [1, 5, 2, 9, 3, 1, 5, 2]
    eagle = tiny_drafter(decoder, TARGET, list(range(0, 96, 2)), seed=1)
    drafter = eagle if name == "eagle3" else SuffixThenEagle3(SuffixDrafter(max_draft_len=8),
                                                             eagle)
    out = speculative_decode_with(decoder, prompt, decoder.new_cache(), drafter,
                                  SpeculativeOptions(max_new_tokens=24), pipeline=pipeline)
    assert out.generated_tokens == plain_decode(decoder, prompt, 24)
    assert out.drafted_tokens > 0
    assert decoder.capture_layers == ()  # the caller's decoder is left as it was


def test_temperature_one_output_is_distributed_as_plain_sampling():
    config = ModelConfig(vocab_size=6, hidden_size=32, n_layers=7, n_heads=4, n_kv_heads=2,
                         head_dim=8, ffn_dim=64, max_seq_len=64)
    decoder = target(config, seed=1)
    prompt = [1, 2, 3, 1, 2]
    params = SamplingParams(temperature=1.0)
    seeds, max_new = 800, 3
    exact = exact_marginals(decoder, prompt, params, max_new)
    drafter = tiny_drafter(decoder, config, [0, 1, 2, 4], seed=3, max_draft_len=3,
                           min_confidence=0.2)
    counts = np.zeros((max_new, 6))
    drafted = 0
    for seed in range(seeds):
        out = speculative_decode_with(
            decoder, prompt, decoder.new_cache(), drafter,
            SpeculativeOptions(max_new_tokens=max_new, sampling=params, seed=seed))
        drafted += out.drafted_tokens
        for i, token in enumerate(out.generated_tokens):
            counts[i, token] += 1
    assert drafted > 0
    for i in range(max_new):
        tv = 0.5 * np.abs(counts[i] / seeds - exact[i]).sum()
        assert tv < tv_tolerance(exact[i], seeds), (i, tv)
