"""`specd bench long-prompts` end to end on a tiny Hugging Face checkpoint: the TTFT table
against transformers prints a row per length (the service tables are the measured run's;
their pieces are covered by the chunked-prefill tests), and a missing document is named."""

from __future__ import annotations

import pytest
from hf_checkpoints import MODELS, build_checkpoint, train_tokenizer

from specd_tools.cli import main


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model_type, overrides, shard = MODELS["llama3"]
    return build_checkpoint(tmp_path_factory.mktemp("hf") / "llama", model_type, overrides,
                            shard, train_tokenizer())


def test_the_ttft_table_has_a_row_per_length(llama_dir, capsys):
    assert main(["bench", "long-prompts", "--model", str(llama_dir), "--skip-service",
                 "--lengths", "120,200", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 2
    # Each row: prompt tokens (about the length asked), two times, their ratio, tok/s.
    assert [abs(int(r[0]) - n) <= 2 for r, n in zip(rows, (120, 200), strict=True)] == [True] * 2
    assert all(float(r[1]) > 0 and float(r[2]) > 0 and r[3].endswith("x") for r in rows)


def test_a_missing_document_is_named(llama_dir, tmp_path, capsys):
    missing = tmp_path / "nope.txt"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "long-prompts", "--model", str(llama_dir), "--document", str(missing),
              "--skip-service"])
    assert exit_.value.code == 2
    assert "--document" in capsys.readouterr().err
