"""One target forward timed, specd against transformers on the same weights (`forward_timing`),
and specd's forward at each torch thread count, quiet and beside a busy process
(`thread_timing`): the ``--forward-*`` part of ``specd bench`` and of ``--default-path``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from .systems import BARE, HF_PLAIN

__all__ = ["FORWARD_CACHE_LENS", "FORWARD_KS", "check_forward_sizes", "forward_timing",
           "reported_forward_timing", "thread_timing"]

#: Forward timing defaults: the block sizes speculative verification feeds, over a short and
#: a long cache.
FORWARD_KS = (1, 2, 4, 8, 32)
FORWARD_CACHE_LENS = (300, 2000)


def check_forward_sizes(ks: Sequence[int], cache_lens: Sequence[int]) -> None:
    """Raises ValueError naming the flag when a forward-timing size is not an int >= 1
    (``ks`` may be empty: no forward timing)."""
    for flag, values, least in (("forward-ks", ks, 1), ("forward-cache-lens", cache_lens, 1)):
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ValueError(f"{flag} must be ints >= {least}, got {v!r}")
    if ks and not cache_lens:
        raise ValueError("forward-cache-lens is empty but forward-ks is not")


def forward_timing(decoder, hf_model, ks: Sequence[int] = FORWARD_KS,
                   cache_lens: Sequence[int] = FORWARD_CACHE_LENS, repeats: int = 15,
                   seed: int = 0, on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """One forward of ``k`` new tokens over ``L`` cached ones: specd (``bare-forward``:
    ``Decoder.forward_batch``, logits for all k rows) against the transformers model
    (``hf-plain``: its forward with a ``DynamicCache``, ``logits_to_keep=0`` so all k rows
    too), call by call in alternating order so drift hits both alike.

    Both caches are filled once with the same ``L`` random tokens (``seed``); each timed
    call feeds ``k`` random tokens at positions ``[L, L + k)`` and is rolled back after
    (specd ``truncate``, transformers ``crop``). A (k, L) that does not fit the model's
    context is skipped. ``on_row(row)`` is called with each row as soon as it is measured
    (a long timing then reports as it goes).

    Returns:
        One row per (L, k): ``cache_len``, ``k``, ``bare_forward_ms`` and ``hf_plain_ms``
        (medians over ``repeats``), ``ratio`` (median of the paired per-call ratios specd /
        transformers: < 1 is specd faster), ``max_logit_diff`` (the two models' logits on the
        same block: they hold the same weights).
    """
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    vocab = decoder.config.vocab_size
    rows = []
    for length in cache_lens:
        fitting = [k for k in ks if length + k <= decoder.config.max_seq_len]
        if not fitting:
            continue
        prefix = torch.randint(0, vocab, (length,), generator=gen)
        cache = decoder.new_cache(min(decoder.config.max_seq_len, length + max(fitting)))
        hf_cache = DynamicCache(config=hf_model.config)
        with torch.inference_mode():
            decoder.forward_batch(prefix, 0, cache)
            hf_model(prefix[None], cache=hf_cache, use_cache=True, logits_to_keep=1)
        for k in fitting:
            block = torch.randint(0, vocab, (k,), generator=gen)
            positions = torch.arange(length, length + k)[None]

            def specd_call(block=block, length=length, cache=cache):
                start = time.perf_counter()
                logits = decoder.forward_batch(block, length, cache)
                seconds = time.perf_counter() - start
                cache.truncate(length)
                return seconds, logits

            def hf_call(block=block, k=k, positions=positions, hf_cache=hf_cache):
                with torch.inference_mode():
                    start = time.perf_counter()
                    out = hf_model(block[None], cache=hf_cache, use_cache=True,
                                   position_ids=positions, logits_to_keep=0)
                    seconds = time.perf_counter() - start
                hf_cache.crop(-k)
                return seconds, out.logits[0]

            _, a = specd_call()
            _, b = hf_call()
            diff = float((a - b).abs().max())
            times: dict[str, list[float]] = {BARE: [], HF_PLAIN: []}
            for r in range(repeats):
                order = ((BARE, specd_call), (HF_PLAIN, hf_call))
                for name, call in (order if r % 2 == 0 else order[::-1]):
                    times[name].append(call()[0])
            rows.append({
                "cache_len": length, "k": k,
                "bare_forward_ms": 1e3 * statistics.median(times[BARE]),
                "hf_plain_ms": 1e3 * statistics.median(times[HF_PLAIN]),
                "ratio": statistics.median(
                    x / y for x, y in zip(times[BARE], times[HF_PLAIN], strict=True)),
                "max_logit_diff": diff,
            })
            if on_row is not None:
                on_row(rows[-1])
    return rows


def reported_forward_timing(decoder, hf_model, config, progress: Callable[[str], None]
                            ) -> list[dict]:
    """`forward_timing` with ``config``'s ``forward_ks``, ``forward_cache_lens`` and
    ``forward_repeats`` (a `BenchConfig` or a service bench config), each row also reported
    as a line through ``progress`` once measured."""
    sizes = len(config.forward_ks) * len(config.forward_cache_lens)
    progress(f"timing one forward per k, specd against transformers, interleaved ({sizes} "
             f"sizes x {config.forward_repeats} calls each, a line per size)")

    def report(row: dict) -> None:
        progress(f"forward L={row['cache_len']} k={row['k']}: bare-forward "
                 f"{row['bare_forward_ms']:.1f} ms, hf-plain {row['hf_plain_ms']:.1f} ms, "
                 f"ratio {row['ratio']:.2f}")

    return forward_timing(decoder, hf_model, config.forward_ks, config.forward_cache_lens,
                          config.forward_repeats, on_row=report)


def thread_timing(decoder, threads: Sequence[int] = (1, 2), ks: Sequence[int] = (1, 8),
                  cache_len: int = 300, repeats: int = 12, seed: int = 0,
                  on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """specd's forward at each torch thread count, on a quiet machine and beside one busy
    process: the evidence for the default thread budget
    (`coordinator.cluster.config.target_thread_counts`).

    For each condition (``busy`` False, then True: a ``python -c 'while True: pass'``
    child started here and killed by its PID after), each k: ``repeats`` forwards of ``k``
    tokens over ``cache_len`` cached ones per thread count, alternating thread counts call by
    call. The torch thread count is restored after. ``on_row(row)`` is called with each row
    as soon as its condition and k are measured.

    Returns:
        One row per (busy, k, threads): ``median_ms`` and ``max_ms``.
    """
    import subprocess
    import sys

    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    vocab = decoder.config.vocab_size
    length = min(cache_len, decoder.config.max_seq_len - max(ks))
    cache = decoder.new_cache(length + max(ks))
    rows = []
    try:
        decoder.forward_batch(torch.randint(0, vocab, (length,), generator=gen), 0, cache)
        for busy in (False, True):
            child = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                for k in ks:
                    times: dict[int, list[float]] = {t: [] for t in threads}
                    for r in range(repeats + 1):
                        for t in (threads if r % 2 == 0 else threads[::-1]):
                            torch.set_num_threads(t)
                            block = torch.randint(0, vocab, (k,), generator=gen)
                            start = time.perf_counter()
                            decoder.forward_batch(block, length, cache)
                            if r:  # the first round warms each thread count up
                                times[t].append(time.perf_counter() - start)
                            cache.truncate(length)
                    for t, v in times.items():
                        rows.append({"busy": busy, "k": k, "threads": t,
                                     "median_ms": 1e3 * statistics.median(v),
                                     "max_ms": 1e3 * max(v)})
                        if on_row is not None:
                            on_row(rows[-1])
            finally:
                if child is not None:
                    child.kill()
                    child.wait()
    finally:
        torch.set_num_threads(before)
    return rows
