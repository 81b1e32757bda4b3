"""EAGLE-3 heads through the drafter registry and the command line: building and checking
`eagle3` and `eagle3+suffix` from a head directory, and `specd generate --in-process`."""

from __future__ import annotations

import json

import pytest
import torch

from drafter_worker.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, SuffixThenEagle3
from drafter_worker.registry import build_drafter, check_drafter, drafter_spec
from specd_core.draft import drafter_capabilities

TINY = "tiny-random:vocab=64,seed=0,layers=8"


def tiny_head_dir(tmp_path, vocab_ids=range(1, 40)):
    from target_worker.testing import load_tiny_random

    decoder, _ = load_tiny_random(TINY)
    config = Eagle3Config.for_target(decoder.config, draft_vocab_size=len(vocab_ids))
    head = Eagle3Head.random(config, seed=2, draft_vocab=list(vocab_ids))
    with torch.no_grad():  # confident enough to draft past EAGLE_MIN_CONFIDENCE
        head.lm_head.weight.mul_(8)
    return head.save(tmp_path / "head"), decoder


def test_registry_builds_and_checks_eagle3_heads(tmp_path, monkeypatch):
    path, decoder = tiny_head_dir(tmp_path)
    for name in ("eagle3", "eagle3+suffix"):
        spec = drafter_spec(name)
        assert spec.has_head and spec.capabilities.wants_hidden
        check_drafter(name, drafter_path=str(path))
        check_drafter(name, drafter_path=str(path / "config.json"))
    drafter = build_drafter("eagle3", target=decoder, drafter_path=str(path))
    assert isinstance(drafter, Eagle3Drafter) and drafter.hidden_layers == (2, 4, 5)
    # The target's table, shared, not copied.
    assert drafter.head._target_embed.data_ptr() == decoder.embed_tokens.weight.data_ptr()
    caps = drafter_capabilities(drafter)
    assert caps.wants_hidden and caps.sessions and not caps.samples and not caps.remembers
    combined = build_drafter("eagle3+suffix", target=decoder, drafter_path=str(path),
                             suffix_cache_requests=0)
    assert isinstance(combined, SuffixThenEagle3)
    assert combined.hidden_layers == (2, 4, 5)
    assert not drafter_capabilities(combined).remembers  # no cache kept
    assert drafter_capabilities(build_drafter("eagle3+suffix", target=decoder,
                                              drafter_path=str(path))).remembers
    # A worker without the target: the model's config and embedding only.
    by_name = build_drafter("eagle3", model=TINY, drafter_path=str(path))
    assert torch.equal(by_name.head._target_embed, decoder.embed_tokens.weight)
    with pytest.raises(ValueError, match="suffix_cache_requests"):
        check_drafter("eagle3", drafter_path=str(path), suffix_cache_requests=3)
    # The default head moved away (an install without it): a clear error.
    import drafter_worker.eagle3.loading as loading

    monkeypatch.setattr(loading, "DEFAULT_EAGLE3_HEAD", tmp_path / "not-shipped")
    with pytest.raises(FileNotFoundError, match="EAGLE-3 head not found: .*not-shipped .*"
                                                "--drafter-path"):
        check_drafter("eagle3")
    with pytest.raises(FileNotFoundError, match="EAGLE-3 head not found"):
        build_drafter("eagle3", target=decoder)
    # A config problem is found without loading weights.
    cfg = json.loads((path / "config.json").read_text())
    cfg["transformer_layer_config"]["num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        check_drafter("eagle3", drafter_path=str(path))


def test_cli_in_process_eagle3_gives_the_plain_greedy_output(tmp_path, capsys):
    from specd_tools.cli import main

    path, _ = tiny_head_dir(tmp_path)
    outputs = {}
    # eagle3+suffix in process: test_greedy_output_is_token_identical_to_plain_decoding (each
    # CLI run here spends most of its time proving the kernels batch-invariant).
    for drafter in ("none", "eagle3"):
        args = ["generate", "abcabcabd", "--model", TINY, "--in-process", "--json",
                "--max-new-tokens", "12", "--drafter", drafter, "--no-adaptive"]
        if drafter != "none":
            args += ["--drafter-path", str(path)]
        assert main(args) == 0
        outputs[drafter] = json.loads(capsys.readouterr().out)
    assert outputs["eagle3"]["drafted_tokens"] > 0
    assert outputs["eagle3"]["token_ids"] == outputs["none"]["token_ids"]
    with pytest.raises(SystemExit) as exc:
        main(["generate", "x", "--model", TINY, "--in-process", "--drafter", "eagle3",
              "--drafter-path", str(tmp_path / "missing")])
    assert exc.value.code == 2
    assert "EAGLE-3 head not found" in capsys.readouterr().err
