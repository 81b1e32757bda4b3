"""The systems ``specd bench`` times, each generating greedily from token ids into a
`RunRecord`: specd's bare forward loop (the overhead reference), specd through
`speculative_decode_with` (plain or with a drafter), and transformers' ``generate``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from coordinator.step.adaptive import AdaptiveDraftLength, ForwardCostModel
from coordinator.step.speculative import speculative_decode_with
from specd_core.request import SpeculativeOptions

__all__ = ["BARE", "HF_PLAIN", "PLAIN", "BareForward", "HFSystem", "RunRecord", "SpecdSystem"]

#: The system names the report and the forward timing refer to.
PLAIN = "specd-plain"
BARE = "bare-forward"
HF_PLAIN = "hf-plain"


@dataclass
class RunRecord:
    """One generation by one system.

    Attributes:
        tokens: the generated ids (EOS included when it ended the run).
        seconds: wall time of the whole call (prefill included).
        first_token_seconds: wall time until the first generated token existed.
        forward_calls: target forward calls (prefill included); for HF, calls of the model.
        verification_steps: forward calls after the prefill.
        drafted_tokens, accepted_tokens: draft tokens verified / accepted (0 for HF and plain).
        evaluated_at_position, accepted_at_position: per draft position (specd only).
        draft_lens: the draft length each step verified (adaptive runs only).
    """

    system: str
    workload: str
    prompt_id: str
    repeat: int
    prompt_tokens: int
    tokens: list[int]
    seconds: float
    first_token_seconds: float
    forward_calls: int
    verification_steps: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    evaluated_at_position: list[int] = field(default_factory=list)
    accepted_at_position: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    #: Process CPU time of the decode (after the first token): less sensitive than wall
    #: time to other processes on a shared machine (with one torch thread, ~ compute).
    decode_cpu_seconds: float = 0.0

    @property
    def decode_seconds(self) -> float:
        return max(self.seconds - self.first_token_seconds, 0.0)


class _FirstToken:
    """Records when the first generated token appears (an ``on_tokens`` callback), in
    wall time since ``start`` and as a process CPU-time stamp."""

    def __init__(self, start: float):
        self.start = start
        self.at: float | None = None
        self.cpu_at = time.process_time()

    def __call__(self, tokens) -> None:
        if self.at is None:
            self.at = time.perf_counter() - self.start
            self.cpu_at = time.process_time()


class BareForward:
    """The overhead reference: prefill, then one-token forwards and an argmax, nothing else."""

    name = BARE
    kind = "reference"

    def __init__(self, decoder, eos: int | None):
        self.decoder = decoder
        self.eos = eos

    def generate(self, prompt: list[int], max_new_tokens: int) -> RunRecord:
        decoder, eos = self.decoder, self.eos
        cache = decoder.new_cache()
        start = time.perf_counter()
        with torch.inference_mode():
            logits = decoder.forward_batch(prompt, 0, cache)
            token = int(logits[-1].argmax())
            first = time.perf_counter() - start
            cpu_first = time.process_time()
            out = [token]
            pos = len(prompt)
            while len(out) < max_new_tokens and token != eos:
                token = int(decoder.forward_batch([token], pos, cache)[0].argmax())
                out.append(token)
                pos += 1
        seconds = time.perf_counter() - start
        record = _record(self.name, prompt, out, seconds, first, len(out), len(out) - 1)
        record.decode_cpu_seconds = time.process_time() - cpu_first
        return record


class SpecdSystem:
    """specd's in-process loop with a drafter (or none), fixed or adaptive draft length."""

    kind = "specd"

    def __init__(self, name: str, decoder, eos: int | None, drafter=None,
                 cost_model: ForwardCostModel | None = None):
        self.name = name
        self.decoder = decoder
        self.drafter = drafter
        self.cost_model = cost_model
        self.stops = () if eos is None else (eos,)

    def generate(self, prompt: list[int], max_new_tokens: int) -> RunRecord:
        options = SpeculativeOptions(max_new_tokens=max_new_tokens, stop_token_ids=self.stops)
        adaptive = None if self.cost_model is None else AdaptiveDraftLength(self.cost_model)
        cache = self.decoder.new_cache()
        start = time.perf_counter()
        first = _FirstToken(start)
        result = speculative_decode_with(self.decoder, prompt, cache, self.drafter, options,
                                         on_tokens=first, adaptive=adaptive)
        seconds = time.perf_counter() - start
        cpu_decode = time.process_time() - first.cpu_at
        record = _record(self.name, prompt, result.generated_tokens, seconds,
                         first.at if first.at is not None else seconds,
                         result.forward_calls, result.verification_steps)
        record.decode_cpu_seconds = cpu_decode
        record.drafted_tokens = result.drafted_tokens
        record.accepted_tokens = result.accepted_tokens
        record.evaluated_at_position = list(result.evaluated_at_position)
        record.accepted_at_position = list(result.accepted_at_position)
        if adaptive is not None:
            record.draft_lens = list(adaptive.chosen)
        return record


class HFSystem:
    """transformers' ``generate``, greedy, plain or with ``prompt_lookup_num_tokens``."""

    kind = "hf"

    def __init__(self, name: str, model, eos: int | None, prompt_lookup: int | None = None):
        self.name = name
        self.model = model
        self.eos = eos
        self.prompt_lookup = prompt_lookup
        self.calls = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, module, args) -> None:
        self.calls += 1

    def generate(self, prompt: list[int], max_new_tokens: int) -> RunRecord:
        ids = torch.tensor([prompt], dtype=torch.long)
        kwargs = {"prompt_lookup_num_tokens": self.prompt_lookup} if self.prompt_lookup else {}
        self.calls = 0
        start = time.perf_counter()
        streamer = _HFFirstToken(start)
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=self.eos,
                pad_token_id=self.eos if self.eos is not None else 0, streamer=streamer,
                **kwargs)
        seconds = time.perf_counter() - start
        tokens = out[0, len(prompt):].tolist()
        first = streamer.at if streamer.at is not None else seconds
        return _record(self.name, prompt, tokens, seconds, first, self.calls, self.calls - 1)


class _HFFirstToken:
    """A transformers streamer that only notes when the first generated token arrives (its
    first ``put`` is the prompt)."""

    def __init__(self, start: float):
        self.start = start
        self.puts = 0
        self.at: float | None = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.at is None:
            self.at = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def _record(system, prompt, tokens, seconds, first, forward_calls, steps) -> RunRecord:
    return RunRecord(system=system, workload="", prompt_id="", repeat=-1,
                     prompt_tokens=len(prompt), tokens=[int(t) for t in tokens],
                     seconds=seconds, first_token_seconds=first,
                     forward_calls=int(forward_calls), verification_steps=int(steps))
