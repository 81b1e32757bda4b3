"""The in-process path runs the service's loop: `speculative_decode_with` gives the tokens the
service gives (greedy and seeded, with and without a drafter), continues a warm cache, reads
a drafter's declared capabilities, and treats a drafter failure as the service does (the
step goes undrafted)."""

from __future__ import annotations

import pytest
import torch
from service_harness import MODEL, LocalService
from test_service import REPEATING, request, stream_tokens

from coordinator.step.adaptive import AdaptiveDraftLength, ForwardCostModel
from coordinator.step.speculative import speculative_decode_with
from drafter_worker.prompt_lookup import PromptLookupSpeculator
from specd_core.draft import DraftBlock, DrafterCapabilities
from specd_core.request import SpeculativeOptions
from specd_core.sampling import SamplingParams, greedy_tokens
from target_worker.loader import load_model


@pytest.fixture(scope="module")
def service():
    svc = LocalService().start()
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def decoder():
    return load_model(MODEL)[0]


@pytest.mark.parametrize("drafted", [True, False], ids=["lookup", "no-drafter"])
@pytest.mark.parametrize(("sampling", "seed"), [({}, None), ({"temperature": 1.0}, 5)],
                         ids=["greedy", "seeded-t1"])
@pytest.mark.parametrize("prompt", [REPEATING, [11, 3, 40, 22, 17, 9, 31]],
                         ids=["repeating", "few-hits"])
def test_in_process_gives_the_services_tokens_and_counters(service, drafted, sampling, seed,
                                                           prompt):
    tokens, final = stream_tokens(service, request(prompt, max_new=24, seed=seed,
                                                   speculate=drafted, **sampling))
    impl = service.drafter_impl
    drafter = PromptLookupSpeculator(impl.ngram_size, impl.max_draft_len) if drafted else None
    result = speculative_decode_with(
        service.decoder, prompt, service.decoder.new_cache(), drafter,
        SpeculativeOptions(max_new_tokens=24, sampling=SamplingParams(**sampling), seed=seed))
    assert result.generated_tokens == tokens
    spec = final.speculation
    assert (result.forward_calls, result.drafted_tokens, result.accepted_tokens) == (
        spec.forward_calls, spec.drafted_tokens, spec.accepted_tokens)
    if drafted and prompt is REPEATING and not sampling:
        assert result.accepted_tokens > 0  # the drafts were really verified


@pytest.mark.parametrize("drafter", [None, PromptLookupSpeculator(2, 4)],
                         ids=["no-drafter", "lookup"])
def test_warm_cache_continues_its_context_and_keeps_only_committed_positions(decoder, drafter):
    context, prompt, n = [3, 14, 15, 9, 26, 5, 3, 14], [15, 9, 26, 5, 3, 14, 15], 20
    # Penalties see the prompt and the output, never the context before the prompt.
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3)
    ref = decoder.new_cache()
    decoder.forward_batch(context, 0, ref)
    logits = decoder.forward_batch(prompt, len(context), ref)
    history, expected = list(prompt), []
    for _ in range(n):
        token = greedy_tokens(logits[-1:], params, history, len(prompt))[0]
        expected.append(token)
        history.append(token)
        logits = decoder.forward_batch([token], ref.seq_len, ref)

    cache = decoder.new_cache()
    decoder.forward_batch(context, 0, cache)
    result = speculative_decode_with(
        decoder, prompt, cache, drafter,
        SpeculativeOptions(max_new_tokens=n, start_pos=len(context), sampling=params))
    assert result.generated_tokens == expected
    # Context + prompt + every generated token but the last, which is fed next.
    assert cache.seq_len == len(context) + len(prompt) + n - 1
    after = decoder.forward_batch([expected[-1]], cache.seq_len, cache)
    torch.testing.assert_close(after, logits, atol=1e-4, rtol=1e-4)


class _Recording:
    """Prompt lookup that records what it is given."""

    def __init__(self):
        self.lookup = PromptLookupSpeculator(2, 8)
        self.hidden: list = []
        self.max_lens: list[int] = []
        self.lengths: list[int] = []

    def propose(self, history, hidden, max_len):
        self.hidden.append(hidden)
        self.lengths.append(len(history))
        self.max_lens.append(max_len)
        return self.lookup.propose(history, None, max_len)


class _Declaring(_Recording):
    capabilities = DrafterCapabilities(wants_hidden=False, max_draft_len=2, samples=False)


def test_declared_capabilities_decide_hidden_rows_and_the_adaptive_cap(decoder):
    drafter = _Declaring()
    free = ForwardCostModel({1: 1.0}, alpha=0.0)  # drafting is free: adaptive asks the most
    speculative_decode_with(decoder, REPEATING, decoder.new_cache(), drafter,
                            SpeculativeOptions(max_new_tokens=30),
                            adaptive=AdaptiveDraftLength(free))
    assert drafter.max_lens and all(h is None for h in drafter.hidden)
    assert max(drafter.max_lens) == 2  # its own cap, not the request's budget


def test_a_drafter_that_declares_nothing_gets_every_hidden_row_once(decoder):
    drafter = _Recording()
    speculative_decode_with(decoder, REPEATING, decoder.new_cache(), drafter,
                            SpeculativeOptions(max_new_tokens=16))
    rows = [h.shape[0] for h in drafter.hidden]
    # Every prompt position on the first call, then the positions committed since the last.
    assert len(rows) > 3
    assert rows == [len(REPEATING)] + [b - a for a, b in zip(drafter.lengths,
                                                            drafter.lengths[1:], strict=False)]
    assert all(h.dtype == torch.float32 and h.shape[1] == decoder.config.hidden_size
               for h in drafter.hidden)


class _Flaky:
    """Fails every other proposal; drafts prompt lookup's block otherwise."""

    def __init__(self):
        self.calls = 0
        self.lookup = PromptLookupSpeculator(2, 6)

    def propose(self, history, hidden, max_len) -> DraftBlock:
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("drafter crashed")
        return self.lookup.propose(history, None, max_len)


def test_a_failing_drafter_costs_its_drafts_only_in_process_as_in_the_service(decoder):
    options = SpeculativeOptions(max_new_tokens=24, sampling=SamplingParams(temperature=1.0),
                                 seed=9)
    plain = speculative_decode_with(decoder, REPEATING, decoder.new_cache(), None, options)
    flaky = _Flaky()
    result = speculative_decode_with(decoder, REPEATING, decoder.new_cache(), flaky, options)
    assert flaky.calls > 2
    # Prompt lookup is a point mass: with the same seed the output is the plain one.
    assert result.generated_tokens == plain.generated_tokens
