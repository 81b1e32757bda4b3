"""Hugging Face checkpoint directories (target_worker.hf): tiny Llama (llama3 RoPE scaling),
Mistral (sharded safetensors), Qwen2 (Q/K/V biases, tied and untied) and Mixtral (MoE) built
here with transformers' config classes and ``save_pretrained``, checked against transformers
itself; TP=2 against TP=1; bfloat16 against float32; and every bad input's ValueError."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from hf_checkpoints import MODELS, build_checkpoints, hf_model
from tp_harness import engine_script, rows_of, run_tp

from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.request import SpeculativeOptions
from target_worker.loader import load_decoder, load_model, model_config, validate_model
from target_worker.model import rope_tables

NAMES = list(MODELS)
TEXT = " ".join(["The quick brown fox", "def add(a, b): return a + b"] * 4)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build_checkpoints(tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def loaded(dirs):
    """{name: (specd float32 decoder, tokenizer, transformers float32 model, 40 prompt ids)}:
    float32 pinned, as the 1e-4 bounds and the float32 references below are float32's ("auto"
    is bfloat16 on an AMX CPU (`cpu_prefers_bf16`))."""
    out = {}
    for name, d in dirs.items():
        decoder, tokenizer = load_model(d, dtype="float32")
        ids = tokenizer.encode(TEXT)[:40]
        assert len(ids) == 40
        out[name] = (decoder, tokenizer, hf_model(d), ids)
    return out


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(loaded, name):
    decoder, _, hf, ids = loaded[name]
    got = decoder.forward_batch(ids, 0, decoder.new_cache())
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama3", "qwen2-untied"])
def test_captured_layers_are_transformers_hidden_states(loaded, name):
    """`Decoder.set_capture_layers` returns the residual stream entering each layer asked
    for (transformers' ``hidden_states[i]``, what EAGLE-3 reads), side by side in ascending
    order, with the logits unchanged; the last index is the stream before the final norm."""
    decoder, _, hf, ids = loaded[name]
    n = decoder.config.n_layers
    plain_logits, plain_hidden = decoder.forward_batch_with_hidden(ids, 0, decoder.new_cache())
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    try:
        decoder.set_capture_layers([n, 1, 0])
        logits, rows = decoder.forward_batch_with_hidden(ids, 0, decoder.new_cache())
    finally:
        decoder.set_capture_layers(())
    h = decoder.config.hidden_size
    assert rows.shape == (len(ids), 3 * h) and rows.dtype == torch.float32
    assert torch.equal(logits, plain_logits)
    torch.testing.assert_close(rows[:, :h], ref[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows[:, h:2 * h], ref[1][0], atol=1e-4, rtol=0)
    # transformers' last entry is after the final norm: ours before it, normed here.
    torch.testing.assert_close(decoder.norm(rows[:, 2 * h:]), plain_hidden, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=f"outside \\[0, {n}\\]"):
        decoder.set_capture_layers([n + 1])
    with pytest.raises(ValueError, match="repeat"):
        decoder.set_capture_layers([1, 1])


def test_llama3_rope_scaling_is_applied(loaded):
    """The llama3 frequencies matter on this checkpoint (positions past 64/4 = 16), so the
    match above would fail with plain RoPE; and the tables equal transformers' formula."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    decoder, _, hf, ids = loaded["llama3"]
    c = decoder.config
    assert c.rope_scaling is not None and c.rope_scaling.factor == 8.0
    plain = load_decoder(hf.name_or_path, "float32")
    plain.config = dataclasses.replace(c, rope_scaling=None)
    off = plain.forward_batch(ids, 0, plain.new_cache())
    assert (off - hf_logits(hf, ids)).abs().max() > 1e-2
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf.config, "cpu")
    cos, _ = rope_tables(c.head_dim, c.rope_theta, 50, c.rope_scaling)
    ref = torch.outer(torch.arange(50, dtype=torch.float32), inv_freq).cos()
    torch.testing.assert_close(cos[:, : c.head_dim // 2], ref)


def test_config_fields(loaded):
    assert loaded["qwen2-tied"][0].config.tie_embeddings and loaded["qwen2-tied"][0].config.qkv_bias
    assert not loaded["qwen2-untied"][0].config.tie_embeddings
    assert loaded["mixtral"][0].config.moe.n_experts == 4
    assert loaded["mistral-sharded"][0].config.max_seq_len == 128  # the sliding window


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_generate(loaded, name):
    decoder, _, hf, ids = loaded[name]
    prompt = torch.tensor([ids])
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, 40:].tolist()
        ref_lookup = hf.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 prompt_lookup_num_tokens=4)[0, 40:].tolist()
    options = SpeculativeOptions(max_new_tokens=NEW_TOKENS)
    plain = speculative_decode_with(decoder, ids, decoder.new_cache(), None, options)
    lookup = speculative_decode_with(decoder, ids, decoder.new_cache(),
                                     PromptLookupSpeculator(1, 4), options)
    assert lookup.drafted_tokens > 0  # the multi-token verify path ran
    assert plain.generated_tokens == ref
    assert lookup.generated_tokens == ref_lookup == ref


def test_tokenizer_and_chat_template(loaded):
    _, tokenizer, _, _ = loaded["llama3"]
    assert tokenizer.eos_token == "<|im_end|>"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                         tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["qwen2-tied", "mixtral", "mistral-sharded"])
def test_tp2_equals_tp1(dirs, loaded, name, tmp_path):
    """Each rank reads its own slices of the directory's safetensors (`load_shard`)."""
    decoder = loaded[name][0]
    ref = engine_script(decoder, decoder.config.vocab_size)
    ranks = run_tp(2, str(dirs[name]), tmp_path)
    got = ranks[0]
    for a, b in zip(ref["logits"], got["logits"], strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
    assert got["greedy_tokens"] == ref["greedy_tokens"]
    for ra, rb in zip(ref["verify"], got["verify"], strict=True):
        assert rows_of(rb[0]) == rows_of(ra[0])
    full = sum(p.numel() for p in decoder.parameters())
    assert sum(ranks[1]["param_counts"].values()) < full  # rank 1 holds a part only


@pytest.mark.parametrize("name", ["llama3", "qwen2-untied", "mixtral"])
def test_bfloat16_close_to_float32(dirs, loaded, name):
    """Bound checked: specd's bf16 logits stay within twice the distance of transformers' own
    bf16 logits from float32 (plus 0.05), and the argmax of at least 90% of the 40 positions
    equals float32's (random tiny models have near-ties bf16 may flip). Outputs are float32."""
    from transformers import AutoModelForCausalLM

    decoder, _, hf, ids = loaded[name]
    bf16 = load_decoder(dirs[name], "bfloat16")
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    logits, hidden = bf16.forward_batch_with_hidden(ids, 0, bf16.new_cache())
    assert logits.dtype == hidden.dtype == torch.float32
    ref = decoder.forward_batch(ids, 0, decoder.new_cache())
    hf_bf16 = AutoModelForCausalLM.from_pretrained(str(dirs[name]), dtype=torch.bfloat16).eval()
    hf_dev = (hf_logits(hf_bf16, ids).float() - ref).abs().max()
    assert (logits - ref).abs().max() <= 2 * hf_dev + 0.05
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


# --- errors ---------------------------------------------------------------------------------


def edited_copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    path = dst / "config.json"
    raw = json.loads(path.read_text())
    for key, value in config_changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return dst


def expect_error(source, *fragments):
    for check in (model_config, validate_model, load_model):
        with pytest.raises(ValueError) as info:
            check(source)
        for fragment in fragments:
            assert fragment in str(info.value), (check.__name__, str(info.value))


def test_missing_config(dirs, tmp_path):
    d = shutil.copytree(dirs["llama3"], tmp_path / "m")
    (d / "config.json").unlink()
    expect_error(d, str(d / "config.json"), "missing")


def test_unknown_architecture(dirs, tmp_path):
    d = edited_copy(dirs["llama3"], tmp_path / "m", architectures=["GPT2LMHeadModel"])
    expect_error(d, "config.json", "'architectures'", "GPT2LMHeadModel", "LlamaForCausalLM",
                 "Qwen2ForCausalLM", "MistralForCausalLM")


def test_unknown_rope_type(dirs, tmp_path):
    raw = json.loads((dirs["llama3"] / "config.json").read_text())
    rope = {**raw["rope_parameters"], "rope_type": "yarn"}
    d = edited_copy(dirs["llama3"], tmp_path / "m", rope_parameters=rope)
    expect_error(d, "config.json", "rope_type", "'yarn'")


def test_missing_config_field(dirs, tmp_path):
    d = edited_copy(dirs["qwen2-tied"], tmp_path / "m", hidden_size=None)
    expect_error(d, "config.json", "'hidden_size'")


def test_shape_does_not_match_config(dirs, tmp_path):
    d = edited_copy(dirs["qwen2-untied"], tmp_path / "m", num_key_value_heads=4)
    expect_error(d, "config.json", "k_proj.weight", "layers.0.attn.wqkv.weight",
                 "num_key_value_heads")


def test_missing_shard_file(dirs, tmp_path):
    d = shutil.copytree(dirs["mistral-sharded"], tmp_path / "m")
    (d / "model-00003-of-00007.safetensors").unlink()
    expect_error(d, "model.safetensors.index.json", "model-00003-of-00007.safetensors")


def test_missing_weights(dirs, tmp_path):
    d = shutil.copytree(dirs["llama3"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    expect_error(d, str(d), "model.safetensors")


def test_untied_config_without_head(dirs, tmp_path):
    d = edited_copy(dirs["qwen2-tied"], tmp_path / "m", tie_word_embeddings=False)
    expect_error(d, "lm_head.weight", "missing")


def test_tokenizer_larger_than_embedding(dirs, tmp_path):
    from transformers import AutoTokenizer

    d = shutil.copytree(dirs["llama3"], tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(d))
    tok.add_tokens([f"<extra_{i}>" for i in range(5)])
    tok.save_pretrained(d)
    for check in (validate_model, load_model):
        with pytest.raises(ValueError, match="tokenizer.json.*'vocab_size'"):
            check(d)


def test_service_refuses_before_any_actor(dirs, tmp_path, monkeypatch):
    import ray

    from coordinator.cluster.config import ServiceConfig
    from coordinator.cluster.service import Service

    d = edited_copy(dirs["llama3"], tmp_path / "m", architectures=["BertModel"])

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was used before the model was validated")

    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(ray, "remote", no_ray)
    with pytest.raises(ValueError, match="BertModel"):
        Service(ServiceConfig(model=str(d), port=0)).start()
    with pytest.raises(ValueError, match="dtype"):
        Service(ServiceConfig(model=str(dirs["llama3"]), dtype="int8"))


def test_cli_passes_model_dir_and_dtype(dirs):
    from specd_tools.cli import build_parser
    from specd_tools.generate import embedded_service_config

    args = build_parser().parse_args(
        ["generate", "hi", "--model", str(dirs["llama3"]), "--dtype", "bfloat16"])
    config = embedded_service_config(args)
    assert (config.model, config.dtype) == (str(dirs["llama3"]), "bfloat16")
    serve = build_parser().parse_args(["serve", "--model", str(dirs["llama3"])])
    assert serve.dtype == "auto"
