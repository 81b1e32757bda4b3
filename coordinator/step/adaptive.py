"""Adaptive draft length: draft only as many tokens as the target's forward cost repays.

A verification step feeds the anchor plus ``k`` drafts in one target forward. Drafts are not
free: on a CPU a forward of 2-8 tokens costs ~1.7x a forward of 1, so a fixed ``k`` loses
to plain decoding whenever drafts miss. Each step, `choose_draft_len` picks the ``k`` that
maximises expected committed tokens per second from

- `AcceptanceTracker`: the request's recent per-position acceptance, and
- `ForwardCostModel`: the target's forward time as a function of tokens fed.

`AdaptiveDraftLength` glues the two for one request; `speculative_decode_with` takes one
through its ``adaptive`` argument. The choice only limits how many drafts are verified, so
the output distribution is unchanged (the rejection rule is lossless at every ``k``).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Mapping, Sequence

import torch


class ForwardCostModel:
    """Target forward time, in seconds, as a function of the tokens fed in one step.

    Piecewise-linear between measured points; flat below the smallest point; beyond the
    largest, extended with the last segment's slope (never decreasing). `observe` folds a
    new measurement into its bucket with an exponential moving average.

    Args:
        points: ``{n_tokens: seconds}``, at least one point, ``n_tokens >= 1``, seconds finite
            and > 0. E.g. ``{1: 0.057, 2: 0.097, 8: 0.097, 16: 0.114, 32: 0.143}``.
        alpha: EMA weight of a new observation, in ``[0, 1]``; 0 freezes the model (a
            synthetic curve that measured steps must not move).

    Raises:
        ValueError: an empty ``points``, a bad key or value, or ``alpha`` out of range.
    """

    #: `observe` caps a measurement at this multiple of its bucket.
    OUTLIER_FACTOR = 3.0

    def __init__(self, points: Mapping[int, float], alpha: float = 0.2):
        if not points:
            raise ValueError("points must hold at least one measurement")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        self.alpha = float(alpha)
        self._points: dict[int, float] = {}
        for n, seconds in points.items():
            self._points[self._check(n, seconds)] = float(seconds)
        self._keys = sorted(self._points)

    @staticmethod
    def _check(n_tokens: int, seconds: float) -> int:
        if isinstance(n_tokens, bool) or int(n_tokens) != n_tokens or n_tokens < 1:
            raise ValueError(f"n_tokens must be an int >= 1, got {n_tokens!r}")
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds must be finite and > 0, got {seconds!r}")
        return int(n_tokens)

    def points(self) -> dict[int, float]:
        """A copy of the current ``{n_tokens: seconds}`` buckets."""
        return {n: self._points[n] for n in self._keys}

    def cost(self, n_tokens: int) -> float:
        """Seconds for one forward of ``n_tokens >= 1`` tokens.

        Raises:
            ValueError: ``n_tokens < 1``.
        """
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        keys, pts = self._keys, self._points
        if n_tokens <= keys[0]:
            return pts[keys[0]]
        if n_tokens >= keys[-1]:
            if len(keys) == 1:
                return pts[keys[-1]]
            a, b = keys[-2], keys[-1]
            slope = max(0.0, (pts[b] - pts[a]) / (b - a))
            return pts[b] + slope * (n_tokens - b)
        i = bisect.bisect_right(keys, n_tokens)
        a, b = keys[i - 1], keys[i]
        t = (n_tokens - a) / (b - a)
        return pts[a] + t * (pts[b] - pts[a])

    def observe(self, n_tokens: int, seconds: float) -> None:
        """Folds one measured forward into the model.

        An existing bucket moves ``alpha`` of the way to ``seconds``; a new ``n_tokens`` gets
        a bucket that starts at the current prediction and moves the same way, so one noisy
        sample shifts the curve by ``alpha`` of its error, never all of it. ``seconds`` is
        first capped at `OUTLIER_FACTOR` times the bucket: a step stalled by another process
        (seconds, not milliseconds, on a shared machine) would otherwise price that size out
        of every later choice, and a size no longer chosen is never measured again to undo
        it. A real slowdown still comes through, by up to ``alpha * (OUTLIER_FACTOR - 1)``
        of the bucket per step.

        Raises:
            ValueError: ``n_tokens < 1`` or ``seconds`` not finite and > 0.
        """
        n = self._check(n_tokens, seconds)
        if self.alpha == 0.0:
            return
        if n not in self._points:
            self._points[n] = self.cost(n)
            bisect.insort(self._keys, n)
        seconds = min(float(seconds), self.OUTLIER_FACTOR * self._points[n])
        self._points[n] += self.alpha * (seconds - self._points[n])


def calibrate(
    decoder,
    cache_len: int = 300,
    sizes: Sequence[int] = (1, 2, 4, 8, 16),
    repeats: int = 3,
    alpha: float = 0.2,
) -> ForwardCostModel:
    """Measures a `ForwardCostModel` by timing real forwards on a scratch cache.

    Fills a fresh cache with ``cache_len`` tokens, then for each size feeds that many tokens
    at position ``cache_len`` and truncates back, in ``repeats`` timed rounds over all sizes
    after an untimed warm-up round; the bucket is the median per size, made non-decreasing in
    size. Wall-clock, so the result varies run to run.

    Args:
        decoder: a `target_worker.Decoder`.
        cache_len: context length to measure at (cost grows with it through attention), >= 1.
        sizes: tokens per forward to measure, each >= 1.
        repeats: timed runs per size, >= 1.
        alpha: passed to the returned model.

    Raises:
        ValueError: empty ``sizes``, a bad argument, or ``cache_len + max(sizes)`` beyond the
            model's context.
    """
    if not sizes or min(sizes) < 1 or cache_len < 1 or repeats < 1:
        raise ValueError(
            f"need cache_len >= 1, repeats >= 1 and sizes >= 1, got cache_len={cache_len}, "
            f"repeats={repeats}, sizes={tuple(sizes)}"
        )
    vocab, context = decoder.config.vocab_size, decoder.config.max_seq_len
    if cache_len + max(sizes) > context:
        raise ValueError(
            f"cache_len {cache_len} + {max(sizes)} tokens exceeds the context of {context}"
        )
    cache = decoder.new_cache(cache_len + max(sizes))
    tokens = [(7 * i + 1) % vocab for i in range(cache_len + max(sizes))]
    times: dict[int, list[float]] = {int(n): [] for n in sorted(set(sizes))}
    with torch.inference_mode():
        decoder.forward_batch(tokens[:cache_len], 0, cache)
        # Rounds over all sizes rather than size after size: a burst of load on a shared
        # machine then hits every size alike instead of bending the curve.
        for r in range(repeats + 1):
            for n in times:
                start = time.perf_counter()
                decoder.forward_batch_with_hidden(tokens[cache_len:cache_len + n], cache_len,
                                                  cache)
                elapsed = time.perf_counter() - start
                cache.truncate(cache_len)
                if r:  # the first round is a warm-up
                    times[n].append(elapsed)
    return ForwardCostModel(_monotone(times), alpha=alpha)


#: Tokens per forward the service and the tools calibrate (`calibrate_for`, `calibrate_target`).
CALIBRATION_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

#: Context length `calibrate_for` measures at by default (a typical prompt's).
CALIBRATION_CACHE_LEN = 256


def calibrate_for(decoder, cache_len: int = CALIBRATION_CACHE_LEN, repeats: int = 1,
                  alpha: float = 0.2) -> ForwardCostModel:
    """`calibrate` over `CALIBRATION_SIZES` at ``cache_len``, both cut to fit the model's
    context (a tiny test model's too): at most half the context, sizes that fit after it.
    One round (the default) takes ~1 s on SmolLM2 over 2 cores; a run then keeps the model
    current with its measured steps."""
    context = decoder.config.max_seq_len
    cache_len = min(cache_len, max(1, context // 2))
    sizes = tuple(n for n in CALIBRATION_SIZES if cache_len + n <= context)
    return calibrate(decoder, cache_len=cache_len, sizes=sizes, repeats=repeats, alpha=alpha)


def restarted_cost_model(calibrated: ForwardCostModel | None,
                         previous: ForwardCostModel | None) -> ForwardCostModel | None:
    """The cost model a re-created replica starts with: per size, the lower of its fresh
    calibration and what its previous incarnation had learnt (``previous``: None for a
    first start), made non-decreasing; the fresh one's ``alpha``.

    Why the lower: a restart's calibration runs in a new process beside the restart's own
    work (the re-placed requests, a fresh drafter channel), so its larger sizes can read
    several times too slow, which prices drafting out, and a size no longer chosen is never
    measured again (`ForwardCostModel.observe`): the likely cause of drafting staying off
    for minutes after a restart. A price too low is corrected by the very steps it makes the
    policy choose, one too high never, so the error to avoid is the high one.
    """
    if calibrated is None or previous is None:
        return calibrated if calibrated is not None else previous
    sizes = sorted({*calibrated.points(), *previous.points()})
    points, floor = {}, 0.0
    for n in sizes:
        floor = max(floor, min(calibrated.cost(n), previous.cost(n)))
        points[n] = floor
    return ForwardCostModel(points, alpha=calibrated.alpha)


def _monotone(times: Mapping[int, list[float]]) -> dict[int, float]:
    """Median per size, made non-decreasing in size (feeding more tokens never costs less;
    a lower reading for a larger size is noise)."""
    points, floor = {}, 0.0
    for n in sorted(times):
        if times[n]:
            floor = max(floor, sorted(times[n])[len(times[n]) // 2])
            points[n] = floor
    return points


async def calibrate_target(
    target,
    cache_len: int = 128,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    repeats: int = 2,
    alpha: float = 0.2,
) -> ForwardCostModel:
    """`calibrate` through the scheduler's async `Target` interface (allocate, prefill,
    verify, free), so it measures what a service step costs: a local engine, a Ray actor
    (its call overhead included) or a tensor-parallel group alike.

    Prefills a scratch slot with ``cache_len`` copies of token 0, verifies each size at
    ``cache_len`` (each verify rolls the slot back first) in ``repeats`` rounds after a
    warm-up round, keeps the median per size (made non-decreasing), and frees the slot.
    Sizes the model's context cannot fit are skipped; if none fits, or the target fails,
    the result is a flat model (every size one second), which drafts whenever acceptance
    is positive until real steps correct it.
    """
    from specd_core.sampling import SamplingParams
    from target_worker.engine import PrefillItem, VerifyItem

    greedy = SamplingParams()
    times: dict[int, list[float]] = {int(n): [] for n in sorted(set(sizes))}
    slot = None
    try:
        slot = await target.allocate()
        await target.prefill([PrefillItem(slot=slot, tokens=[0] * cache_len, sampling=greedy)])
        for r in range(repeats + 1):  # rounds over all sizes, as in `calibrate`
            for n in list(times):
                start = time.perf_counter()
                try:
                    await target.verify([VerifyItem(slot=slot, start_pos=cache_len,
                                                    tokens=[0] * n, sampling=greedy)])
                except ValueError:  # beyond the model's context: drop it and larger sizes
                    times = {m: t for m, t in times.items() if m < n}
                    break
                if r:  # the first round is a warm-up
                    times[n].append(time.perf_counter() - start)
    except Exception:
        logging.getLogger(__name__).exception("forward-cost calibration failed")
    finally:
        if slot is not None:
            try:
                await target.free(slot)
            except Exception:
                logging.getLogger(__name__).exception("freeing the calibration slot failed")
    return ForwardCostModel(_monotone(times) or {1: 1.0}, alpha=alpha)


class AcceptanceTracker:
    """One request's running acceptance rate at each draft position.

    Position ``i``'s rate is conditional: P(draft ``i`` accepted | drafts ``0..i-1``
    accepted), estimated as ``(a_i + w * p_i) / (e_i + w)`` from decayed counts of times
    evaluated ``e_i`` and accepted ``a_i``, with prior ``p_i`` of weight ``w``. Every recorded
    step first multiplies all counts by ``decay``, so recent steps dominate and evidence that
    is no longer refreshed (positions not reached, or steps that drafted nothing) fades back
    to the prior; that is what lets a request that stopped drafting try again later.

    Args:
        prior: the prior rate for every position, or one per position (later positions reuse
            the last entry); each in ``[0, 1]``.
        prior_weight: ``w``, pseudo-observations behind the prior, >= 0 (> 0 if the prior
            must stand in for positions never evaluated: with 0 they read as the prior anyway).
        decay: per-step factor on past counts, in ``(0, 1]``; 1 never forgets.
        chain: position ``i > 0`` shrinks towards position ``i - 1``'s estimate instead of
            its own prior, so evidence that the first drafts land carries to positions not
            yet reached (a fully accepted block suggests the next, longer one will land too)
            and a drafter that misses early reads low everywhere. Position 0 uses the prior.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(
        self,
        prior: float | Sequence[float] = 0.5,
        prior_weight: float = 2.0,
        decay: float = 0.9,
        chain: bool = False,
    ):
        priors = [float(prior)] if isinstance(prior, int | float) else [float(p) for p in prior]
        if not priors or any(not 0.0 <= p <= 1.0 for p in priors):
            raise ValueError(f"prior must be rates in [0, 1], got {prior!r}")
        if prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {prior_weight}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.priors = priors
        self.prior_weight = float(prior_weight)
        self.decay = float(decay)
        self.chain = bool(chain)
        self._evaluated: list[float] = []
        self._accepted: list[float] = []

    def prior_at(self, position: int) -> float:
        return self.priors[min(position, len(self.priors) - 1)]

    def record(self, drafted: int, accepted: int) -> None:
        """Records one verification step.

        Args:
            drafted: drafts verified this step, >= 0 (0 for a step that drafted nothing;
                it still ages the evidence).
            accepted: the accepted prefix length, ``0 <= accepted <= drafted``. Positions
                ``< accepted`` count as accepted, position ``accepted`` (if ``< drafted``)
                as rejected; later ones were not reached and count as nothing.

        Raises:
            ValueError: counts out of range.
        """
        if drafted < 0 or not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got {accepted}, {drafted}")
        self._evaluated = [e * self.decay for e in self._evaluated]
        self._accepted = [a * self.decay for a in self._accepted]
        reached = min(drafted, accepted + 1)
        if len(self._evaluated) < reached:
            grow = reached - len(self._evaluated)
            self._evaluated.extend([0.0] * grow)
            self._accepted.extend([0.0] * grow)
        for i in range(reached):
            self._evaluated[i] += 1.0
            if i < accepted:
                self._accepted[i] += 1.0

    def rates(self, n: int | None = None) -> list[float]:
        """Conditional accept probability per position, ``n`` of them (default: every
        position evaluated so far); positions never evaluated read as their prior (with
        ``chain``: as the position before them)."""
        n = len(self._evaluated) if n is None else n
        out: list[float] = []
        for i in range(n):
            e = self._evaluated[i] if i < len(self._evaluated) else 0.0
            a = self._accepted[i] if i < len(self._accepted) else 0.0
            w = self.prior_weight
            p = out[-1] if self.chain and out else self.prior_at(i)
            out.append((a + w * p) / (e + w) if e + w > 0 else p)
        return out


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Expected tokens committed by a step verifying ``k`` drafts:
    ``1 + sum_{i<k} prod_{j<=i} rates[j]``.

    Draft ``i`` is committed only if drafts ``0..i`` are all accepted; the 1 is the token
    every step commits anyway (the bonus token, or the resample at the first rejection).
    With a constant rate ``a`` this is ``(1 - a^(k+1)) / (1 - a)``, the expected tokens per
    step in Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding" (arXiv 2211.17192); per-position rates generalise it. Their walltime analysis
    divides it by a step's time, ``k`` drafter runs plus one target run; `choose_draft_len` divides
    by the target forward's measured cost at ``k + 1`` tokens and leaves drafter time out.

    Raises:
        ValueError: ``k`` < 0 or more than ``len(rates)``.
    """
    if not 0 <= k <= len(rates):
        raise ValueError(f"k must be in [0, {len(rates)}], got {k}")
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= rates[i]
        total += reach
    return total


def choose_draft_len(
    rates: Sequence[float],
    cost_model: ForwardCostModel,
    max_k: int,
    batch_tokens: int = 0,
    call_cost: float = 0.0,
) -> int:
    """The draft length in ``[0, max_k]`` with the most expected tokens per second.

    Scores ``k`` as ``expected_tokens(rates, k) / (cost(batch_tokens + k + 1) + call)``,
    ``call`` being ``call_cost`` for ``k >= 1`` and 0 for ``k = 0``: the step feeds the
    anchor and ``k`` drafts alongside ``batch_tokens`` tokens of other requests sharing the
    forward, so on a flat cost curve a busy batch makes drafting cheaper, and drafting at all
    may make the step wait for the drafter (a serial step's call; once per step, so the
    scheduler charges it to the step's first drafting request). Ties go to the shorter
    draft, so 0 (plain decoding) unless drafting strictly wins. The score is this request's
    throughput; it ignores that a longer block also slows the others.

    Args:
        rates: conditional accept probability per position, each in ``[0, 1]``, at least
            ``max_k`` of them (`AcceptanceTracker.rates`).
        cost_model: the target's forward cost.
        max_k: the most drafts allowed (budget, drafter limit), >= 0.
        batch_tokens: other requests' tokens in the same forward, >= 0.
        call_cost: seconds the step waits for the drafter when this request drafts, >= 0
            (a forward of 3.7 ms and a drafter call of 1.5 ms make a draft pay only where
            it is accepted well over a third of the time).

    Raises:
        ValueError: a negative ``max_k``, ``batch_tokens`` or ``call_cost``, too few rates,
            or a rate outside ``[0, 1]``.
    """
    if max_k < 0 or batch_tokens < 0:
        raise ValueError(f"max_k and batch_tokens must be >= 0, got {max_k}, {batch_tokens}")
    if not call_cost >= 0.0:
        raise ValueError(f"call_cost must be >= 0, got {call_cost}")
    if len(rates) < max_k:
        raise ValueError(f"need {max_k} rates, got {len(rates)}")
    if any(not 0.0 <= r <= 1.0 for r in rates[:max_k]):
        raise ValueError(f"rates must be in [0, 1], got {list(rates[:max_k])}")
    best_k, best = 0, 1.0 / cost_model.cost(batch_tokens + 1)
    expected, reach = 1.0, 1.0
    for k in range(1, max_k + 1):
        reach *= rates[k - 1]
        expected += reach
        score = expected / (cost_model.cost(batch_tokens + k + 1) + call_cost)
        if score > best:
            best_k, best = k, score
    return best_k


class AdaptiveDraftLength:
    """Per-request draft-length policy: `next_len` before drafting, `update` after verifying.

    Args:
        cost_model: the target's forward cost; may be shared between requests (it describes
            the model and machine, not the request).
        tracker: this request's acceptance; by default a fresh chained tracker with a
            mildly optimistic, light prior (``AcceptanceTracker(prior=0.6, prior_weight=0.5,
            chain=True)``: a first match drafts a few tokens, and a block that lands grows
            the next one quickly). Never share one between requests.

    Dry synchronous drafter calls back off where calls cost: a call that proposed nothing
    (prompt lookup without a match) makes the request skip the drafter for 1, 2, 4, up to
    `MAX_REST` verified steps (`record_call`, `resting`, `tick`) when the caller says a call
    costs at least `DRY_CALL_SHARE` of a step, so a drafter with nothing to say costs about
    one call in `MAX_REST` steps instead of one every step. Any proposal ends the back-off.
    (The pipelined scheduler reports only its synchronous calls: a run-ahead overlaps the
    forward.)

    Not thread-safe; one instance per request.
    """

    #: The most verified steps a request rests from a drafter that keeps proposing nothing.
    MAX_REST = 8
    #: A drafter call costing at least this share of a step backs off when dry: a call that
    #: costs 2% of a step, made every step for nothing, alone puts decoding below 0.98x plain.
    DRY_CALL_SHARE = 0.02

    def __init__(self, cost_model: ForwardCostModel, tracker: AcceptanceTracker | None = None):
        self.cost_model = cost_model
        self.tracker = tracker if tracker is not None else AcceptanceTracker(
            prior=0.6, prior_weight=0.5, chain=True)
        #: Every length `next_len` returned, in order (observability and tests).
        self.chosen: list[int] = []
        #: True between `next_len` and the `update` that reports its step.
        self.awaiting_update = False
        #: Drafter calls in a row that proposed nothing, and steps left to rest.
        self.dry_calls = 0
        self._rest = 0

    def record_call(self, proposed: bool, call_share: float = 1.0) -> None:
        """Reports one drafter call's outcome: ``proposed`` False (an empty block) starts
        or lengthens the back-off when ``call_share`` (a call's measured time over a step's,
        >= 0) is at least `DRY_CALL_SHARE`; True ends it."""
        if proposed:
            self.dry_calls, self._rest = 0, 0
        elif call_share >= self.DRY_CALL_SHARE:
            self.dry_calls += 1
            self._rest = min(self.MAX_REST, 2 ** (self.dry_calls - 1))

    def resting(self) -> bool:
        """Whether the drafter is skipped for this request now (after dry calls)."""
        return self._rest > 0

    def tick(self) -> None:
        """One verified step of the request passed (counts down the rest)."""
        if self._rest > 0:
            self._rest -= 1

    def next_len(self, budget: int, drafter_max: int | None = None, batch_tokens: int = 0,
                 call_cost: float = 0.0) -> int:
        """Drafts to request this step, in ``[0, min(budget, drafter_max)]``; 0 means do not
        call the drafter.

        Args:
            budget: the request's draft budget (`DecodeRequest.draft_budget`), >= 0.
            drafter_max: the drafter's own limit, or None for none.
            batch_tokens: other requests' tokens in the same forward, >= 0.
            call_cost: seconds the step waits for the drafter if this request drafts
                (`choose_draft_len`).
        """
        k = self.choose(budget, drafter_max, batch_tokens, call_cost)
        self.chosen.append(k)
        self.awaiting_update = True
        return k

    def choose(self, budget: int, drafter_max: int | None = None, batch_tokens: int = 0,
               call_cost: float = 0.0) -> int:
        """`next_len` without recording the choice: pipelined scheduling picks a length
        one step before that length is verified, and records the step itself
        (`AcceptanceTracker.record`) once verified."""
        limit = max(0, budget if drafter_max is None else min(budget, drafter_max))
        return choose_draft_len(self.tracker.rates(limit), self.cost_model, limit, batch_tokens,
                                call_cost)

    def update(self, draft_len: int, accepted: int) -> None:
        """Records a verified step: ``draft_len`` drafts fed, ``accepted`` of them accepted
        (the accepted prefix). See `AcceptanceTracker.record`.

        A step that asked for drafts but got none (prompt lookup found no match) is not
        evidence about acceptance and does not age it either: only steps that verified
        drafts, or that chose not to draft (so acceptance there is unknown and should fade
        back towards the prior), are recorded.
        """
        asked = self.chosen[-1] if self.awaiting_update and self.chosen else 0
        self.awaiting_update = False
        if draft_len == 0 and asked > 0:
            return
        self.tracker.record(draft_len, accepted)
