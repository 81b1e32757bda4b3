"""Log probabilities on the real default model (SmolLM2-135M-Instruct) against transformers'
own GGUF load: the prompt's and the generated tokens' values and top alternatives, with
prompt lookup drafts accepted and chunked prefill, equal ``log_softmax`` over transformers'
logits on the same ids.

Slow: transformers' reference load takes ~20-30 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_logprobs import decodes

from coordinator.step.plan import ChunkPolicy
from specd_core.request import SpeculativeOptions
from specd_core.text import encode_prompt
from target_worker.fetch import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
#: Measured: 5.5e-5 at worst over the prompt and 24 generated tokens (our logits and
#: transformers' may differ by up to 1e-3, test_loader_real; log-softmax keeps that scale).
TOL = 5e-4


def test_values_equal_transformers_log_softmax(smollm2_float32):
    from transformers import AutoModelForCausalLM

    decoder, tokenizer = smollm2_float32  # float32 as transformers' reference and TOL are
    prompt = encode_prompt(tokenizer, (PROMPTS / "code_edit.txt").read_text(), raw=False)
    k = 5
    options = SpeculativeOptions(max_new_tokens=24, stop_token_ids=(tokenizer.eos_token_id,),
                                 logprobs=k, prompt_logprobs=k)
    found, _ = decodes(decoder, [prompt], [options], chunking=ChunkPolicy(128))
    decode = found[0]
    assert decode.result.accepted_tokens > 0  # values of accepted drafts are checked too
    generated = decode.generated
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(
            hf(torch.tensor([prompt + generated[:-1]])).logits[0].float(), -1)
    records = [(prompt[j], decode.prompt_logprobs[j], ref[j - 1]) for j in range(1, len(prompt))]
    records += [(t, r, ref[len(prompt) - 1 + i])
                for i, (t, r) in enumerate(zip(generated, decode.token_logprobs, strict=True))]
    worst = 0.0
    for token, record, row in records:
        assert record.token == token
        worst = max(worst, abs(record.logprob - float(row[token])))
        top = torch.topk(row, k)
        assert [v for _, v in record.top] == pytest.approx(top.values.tolist(), abs=TOL)
        for t, v in record.top:
            worst = max(worst, abs(v - float(row[t])))
    assert worst < TOL, worst
