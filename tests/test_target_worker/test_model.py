"""Fast tests of the target decoder, its config and its KV cache (tiny random models)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from target_worker.config import ModelConfig, MoEConfig
from target_worker.model import KEY_BLOCK, Decoder, KvCache

VOCAB = 8


def dense_config(vocab: int = VOCAB, **overrides) -> ModelConfig:
    return dataclasses.replace(ModelConfig.tiny_test(vocab), moe=None, **overrides)


CONFIGS = {
    "moe": lambda: ModelConfig.tiny_test(VOCAB),
    "dense": dense_config,
    "dense_untied_bias": lambda: dense_config(tie_embeddings=False, qkv_bias=True),
}


@pytest.fixture(params=sorted(CONFIGS))
def model(request) -> Decoder:
    """A tiny random decoder, batch invariant as every served target is."""
    decoder = Decoder.random(CONFIGS[request.param](), seed=3)
    decoder.make_batch_invariant()
    return decoder


def random_tokens(n: int, seed: int, vocab: int = VOCAB) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


# --- config ---------------------------------------------------------------------------------


def test_tiny_test_values():
    c = ModelConfig.tiny_test(vocab_size=50)
    assert (c.vocab_size, c.hidden_size, c.n_layers) == (50, 16, 2)
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim, c.max_seq_len) == (4, 2, 4, 32, 256)
    assert c.moe == MoEConfig(n_experts=6, n_experts_active=2, n_shared_experts=1, expert_ffn_dim=8)
    assert ModelConfig.tiny_test(50, n_layers=3).n_layers == 3
    assert c.tie_embeddings


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("vocab_size", 0, "vocab_size"),
        ("hidden_size", -1, "hidden_size"),
        ("n_layers", 0, "n_layers"),
        ("n_heads", 3, "n_heads"),  # not divisible by n_kv_heads=2
        ("n_kv_heads", 0, "n_kv_heads"),
        ("head_dim", 3, "head_dim"),  # RoPE needs an even width
        ("ffn_dim", 0, "ffn_dim"),
        ("max_seq_len", 0, "max_seq_len"),
        ("rope_theta", 0.0, "rope_theta"),
        ("rms_norm_eps", -1e-5, "rms_norm_eps"),
    ],
)
def test_model_config_rejects(field, value, match):
    with pytest.raises(ValueError, match=match) as info:
        dataclasses.replace(ModelConfig.tiny_test(VOCAB), **{field: value})
    assert str(value) in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_experts=0), "n_experts must be positive, got 0"),
        (dict(n_experts_active=0), "n_experts_active"),
        (dict(n_experts_active=7), r"n_experts_active \(7\).*n_experts \(6\)"),
        (dict(n_shared_experts=-1), "n_shared_experts.*-1"),
        (dict(expert_ffn_dim=0), "expert_ffn_dim"),
    ],
)
def test_moe_config_rejects(kwargs, match):
    base = dict(n_experts=6, n_experts_active=2, n_shared_experts=1, expert_ffn_dim=8)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_n_params_matches_module():
    for make in CONFIGS.values():
        m = Decoder.random(make())
        assert m.config.n_params == sum(p.numel() for p in m.parameters())


# --- random weights --------------------------------------------------------------------------


def test_random_is_deterministic_by_seed():
    cfg = ModelConfig.tiny_test(VOCAB)
    torch.manual_seed(123)  # the global RNG must not matter
    a = Decoder.random(cfg, seed=5)
    torch.manual_seed(456)
    b = Decoder.random(cfg, seed=5)
    c = Decoder.random(cfg, seed=6)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    toks = random_tokens(6, seed=0)
    assert torch.equal(
        a.forward_batch(toks, 0, a.new_cache()), b.forward_batch(toks, 0, b.new_cache())
    )


@pytest.mark.parametrize("name", ["moe", "dense"])
def test_random_distributions_are_spread_out(name):
    max_probs, entropies = [], []
    for seed in range(4):
        m = Decoder.random(CONFIGS[name](), seed=seed)
        for prompt in range(10):
            probs = torch.softmax(m.forward_batch(random_tokens(8, prompt), 0, m.new_cache()), -1)
            max_probs.append(probs.max(-1).values)
            entropies.append(-(probs * probs.log()).sum(-1))
    max_probs, entropies = torch.cat(max_probs), torch.cat(entropies)
    assert max_probs.median() < 0.6
    assert (max_probs < 0.6).float().mean() > 0.8
    assert max_probs.max() < 0.99  # never near one-hot
    assert entropies.mean() > 0.5 * torch.log(torch.tensor(float(VOCAB)))


# --- KV cache --------------------------------------------------------------------------------


def test_cache_truncate_and_errors(model):
    cache = model.new_cache()
    assert (cache.seq_len, cache.capacity) == (0, 256)  # min(1024, max_seq_len)
    model.forward_batch(random_tokens(5, 0), 0, cache)
    assert cache.seq_len == 5
    with pytest.raises(ValueError, match="6"):
        cache.truncate(6)
    with pytest.raises(ValueError, match="-1"):
        cache.truncate(-1)
    k_before = cache.k
    cache.truncate(2)
    assert cache.seq_len == 2 and cache.k is k_before  # O(1): no copy
    cache.truncate(2)
    cache.truncate(0)
    assert cache.seq_len == 0


def test_cache_clone_is_independent(model):
    toks = random_tokens(6, 1)
    cache = model.new_cache()
    model.forward_batch(toks[:4], 0, cache)
    copy = cache.clone()
    assert copy.seq_len == 4 and copy.capacity == cache.capacity
    assert copy.k.data_ptr() != cache.k.data_ptr()
    a = model.forward_batch(toks[4:], 4, cache)
    assert copy.seq_len == 4
    copy.truncate(1)
    assert cache.seq_len == 6
    # Writing into the clone leaves the original untouched and vice versa.
    b = model.forward_batch(toks[1:4], 1, copy)
    c = model.forward_batch(toks[4:], 4, copy)
    assert torch.allclose(a, c, atol=1e-5)
    assert b.shape == (3, VOCAB)


def test_cache_grows_beyond_initial_capacity():
    model = Decoder.random(dense_config(max_seq_len=4 * KEY_BLOCK), seed=3)
    model.make_batch_invariant()
    n = 2 * KEY_BLOCK + 10
    toks = random_tokens(n, 2)
    small = model.new_cache(capacity=3)
    assert small.capacity == KEY_BLOCK  # storage comes in whole key blocks
    out_small = torch.cat([model.forward_batch(toks[i : i + 5], i, small)
                           for i in range(0, n, 5)])
    assert small.capacity == 4 * KEY_BLOCK and small.seq_len == n  # 1 -> 2 -> 4 blocks
    big = model.new_cache()
    assert torch.equal(out_small, model.forward_batch(toks, 0, big))
    assert torch.equal(small.keys(), big.keys()[:, :, :n])


def test_cache_growth_capped_at_max_seq_len():
    m = Decoder.random(dense_config(max_seq_len=20))
    cache = m.new_cache(capacity=8)
    m.forward_batch(random_tokens(17, 0), 0, cache)
    assert cache.capacity == KEY_BLOCK  # one whole block holds every position there is
    with pytest.raises(ValueError, match=r"17 \+ 4 tokens = 21 exceeds max_seq_len=20"):
        m.forward_batch(random_tokens(4, 1), 17, cache)
    assert cache.seq_len == 17
    m.forward_batch(random_tokens(3, 1), 17, cache)
    assert cache.seq_len == 20
    with pytest.raises(ValueError, match="capacity"):
        m.new_cache(capacity=21)
    with pytest.raises(ValueError, match="capacity"):
        m.new_cache(capacity=0)


def test_default_capacity_is_bounded():
    m = Decoder.random(dense_config(max_seq_len=8192))
    assert m.new_cache().capacity == 1024
    assert m.new_cache().k.shape == (2, 1024 // KEY_BLOCK, 2, KEY_BLOCK, 4)


# --- forward contract ------------------------------------------------------------------------


def test_start_pos_must_match_cache(model):
    cache = model.new_cache()
    model.forward_batch([1, 2, 3], 0, cache)
    for bad in (0, 2, 4):
        with pytest.raises(ValueError, match="start_pos must be the cache's current length"):
            model.forward_batch([1], bad, cache)
    with pytest.raises(ValueError, match="start_pos must be the cache's current length"):
        model.forward_token(1, 5, cache)
    assert cache.seq_len == 3


@pytest.mark.parametrize("bad", [-1, VOCAB, 1000])
def test_unknown_token_refused(model, bad):
    cache = model.new_cache()
    with pytest.raises(ValueError, match=f"token id {bad}"):
        model.forward_batch([0, bad, 1], 0, cache)
    with pytest.raises(ValueError, match=f"token id {bad}"):
        model.forward_token(bad, 0, cache)
    assert cache.seq_len == 0


def test_empty_and_malformed_tokens_refused(model):
    cache = model.new_cache()
    with pytest.raises(ValueError, match="at least one"):
        model.forward_batch([], 0, cache)
    with pytest.raises(ValueError, match="at least one"):
        model.forward_batch(torch.tensor([], dtype=torch.long), 0, cache)
    with pytest.raises(ValueError, match="1-D integer"):
        model.forward_batch(torch.tensor([[1, 2]]), 0, cache)
    with pytest.raises(ValueError, match="1-D integer"):
        model.forward_batch(torch.tensor([1.0]), 0, cache)


def test_output_shapes_and_types(model):
    cache = model.new_cache()
    logits = model.forward_batch(torch.tensor([1, 2, 3]), 0, cache)
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    assert not logits.requires_grad
    one = model.forward_token(4, 3, cache)
    assert one.shape == (VOCAB,) and one.dtype == torch.float32
    assert cache.seq_len == 4
    assert model.embed_tokens.weight.shape == (VOCAB, 16)
    assert model.lm_head.weight.shape == (VOCAB, 16)
    tied = model.lm_head.weight is model.embed_tokens.weight
    assert tied == model.config.tie_embeddings


def test_block_matches_token_by_token(model):
    toks = random_tokens(30, 4)
    block = model.forward_batch(toks, 0, model.new_cache())
    cache = model.new_cache()
    single = torch.stack([model.forward_token(t, i, cache) for i, t in enumerate(toks)])
    assert (block - single).abs().max() < 1e-4
    # Mixed block sizes on a warm cache agree as well.
    cache = model.new_cache()
    parts, pos = [], 0
    for size in (7, 1, 3, 8, 2, 9):
        parts.append(model.forward_batch(toks[pos : pos + size], pos, cache))
        pos += size
    assert (torch.cat(parts) - block).abs().max() < 1e-4


def test_rollback_equals_never_fed(model):
    prefix, rejected, accepted = random_tokens(12, 5), random_tokens(6, 6), random_tokens(5, 7)
    cache = model.new_cache()
    model.forward_batch(prefix, 0, cache)
    model.forward_batch(rejected, 12, cache)  # a draft that gets rejected after 2 tokens
    cache.truncate(14)
    after_rollback = model.forward_batch(accepted, 14, cache)

    clean = model.new_cache()
    model.forward_batch(prefix + rejected[:2], 0, clean)
    reference = model.forward_batch(accepted, 14, clean)
    assert (after_rollback - reference).abs().max() < 1e-5
    assert cache.seq_len == clean.seq_len == 19


def test_hidden_feeds_lm_head(model):
    cache = model.new_cache()
    logits, hidden = model.forward_batch_with_hidden(random_tokens(5, 8), 0, cache)
    assert hidden.shape == (5, 16) and hidden.dtype == torch.float32
    assert torch.allclose(model.lm_head(hidden), logits, atol=1e-6)
    assert torch.allclose(hidden @ model.lm_head.weight.T, logits, atol=1e-5)
    assert cache.seq_len == 5


def test_last_logits_only_gives_the_last_row(model):
    toks = random_tokens(6, 3)
    full, hidden = model.forward_batch_with_hidden(toks, 0, model.new_cache())
    last, hidden_last = model.forward_batch_with_hidden(toks, 0, model.new_cache(),
                                                        last_logits_only=True)
    assert last.shape == (1, full.shape[1])
    torch.testing.assert_close(last, full[-1:], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hidden_last, hidden)


def test_moe_uses_top_k_experts():
    m = Decoder.random(ModelConfig.tiny_test(VOCAB), seed=1)
    moe = m.layers[0].ffn
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        out = moe(x)
        # Reference: dense evaluation of every expert, masked to the renormalised top-2.
        probs = torch.softmax(x @ moe.router.weight.T, -1)
        top_w, top_i = probs.topk(2, -1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        ref = moe.shared(x).clone()
        for e in range(6):
            gate, up = (x @ moe.w_gate_up[e].T).split(8, -1)
            y = (torch.nn.functional.silu(gate) * up) @ moe.w_down[e].T
            w = (top_w * (top_i == e)).sum(-1, keepdim=True)
            ref += w * y
    assert torch.allclose(out, ref, atol=1e-6)


def test_kvcache_direct_construction_validates():
    with pytest.raises(ValueError, match="capacity"):
        KvCache(1, 1, 2, capacity=10, max_seq_len=5)
