"""Suffix decoding's structures (`drafter_worker.suffix`) against brute-force references on
random token streams: the same substrings and counts, the same most frequent continuations,
the same drafts; incremental growth equal to a rebuild; eviction within its bounds; and the
drafter's sessions, run-ahead and cross-request cache."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from drafter_worker.registry import build_drafter, check_drafter
from drafter_worker.sessions import DrafterSessions
from drafter_worker.suffix import SuffixCache, SuffixDrafter, SuffixTree
from specd_core.draft import DraftBlock, drafter_capabilities, propose_ahead

# ---- brute-force references ----


def brute_counts(streams, depth) -> Counter:
    """Occurrences of every substring of length 1..depth over ``streams``."""
    counts: Counter = Counter()
    for s in streams:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                counts[tuple(s[i:j])] += 1
    return counts


def brute_speculate(streams, context, depth, max_tokens, factor, floor, open_stream):
    """The draft `SuffixTree.speculate` must give, from substring counts alone: for each
    match length the most frequent continuation chain (ties: smallest id) while the product
    of count ratios stays >= floor; denominators exclude the open stream's end occurrence."""
    counts = brute_counts(streams, depth)
    last = streams[-1] if streams and open_stream else None

    def total(s):
        ends_open = last is not None and len(last) >= len(s) and \
            tuple(last[len(last) - len(s):]) == s
        return counts[s] - (1 if ends_open else 0)

    ctx = list(context)[-(depth - 1):]
    best = ((), 0.0, 0)
    for m in range(1, len(ctx) + 1):
        s = tuple(ctx[len(ctx) - m:])
        if counts[s] == 0:
            break
        limit = min(max_tokens, int(factor * m + 1e-9), depth - m)
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < limit:
            nxt = [(counts[(*s, c)], -c) for c in range(VOCAB) if counts[(*s, c)] > 0]
            if not nxt:
                break
            cnt, neg = max(nxt)
            t = total(s)
            if t <= 0:
                break
            p = prob * cnt / t
            if p < floor:
                break
            prob = p
            tokens.append(-neg)
            score += prob
            s = (*s, -neg)
        if tokens and score >= best[1]:
            best = (tuple(tokens), score, m)
    return best


VOCAB = 4


def random_stream(rng, n, vocab=VOCAB):
    # Mildly repetitive: copies of earlier spans, so long matches occur.
    out = []
    while len(out) < n:
        if out and rng.random() < 0.4:
            i = rng.randrange(len(out))
            out.extend(out[i:i + rng.randint(1, 6)])
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def best_children_ok(tree: SuffixTree) -> None:
    """Every node's ``best`` is its most frequent child, ties to the smallest id."""
    stack = [tree.root]
    while stack:
        node = stack.pop()
        kids = dict(node.items())
        if not kids:
            assert node.best == -1
            continue
        top = max(c.count for c in kids.values())
        assert node.best == min(t for t, c in kids.items() if c.count == top)
        stack.extend(kids.values())


# ---- the tree ----


@pytest.mark.parametrize("seed", range(12))
def test_the_tree_holds_every_substring_with_its_count(seed):
    rng = random.Random(seed)
    depth = rng.randint(2, 7)
    streams = [random_stream(rng, rng.randint(0, 50)) for _ in range(rng.randint(1, 4))]
    tree = SuffixTree(depth)
    for s in streams:
        tree.add(s)
    assert tree.dump() == dict(brute_counts(streams, depth))
    assert tree.nodes == len(tree.dump())
    best_children_ok(tree)
    for _ in range(20):
        probe = random_stream(rng, rng.randint(1, depth))
        assert tree.count(probe) == brute_counts(streams, depth)[tuple(probe)]


@pytest.mark.parametrize("seed", range(12))
def test_growing_in_chunks_equals_a_rebuild(seed):
    rng = random.Random(100 + seed)
    depth = rng.randint(2, 8)
    stream = random_stream(rng, 80)
    grown = SuffixTree(depth)
    i = 0
    while i < len(stream):
        step = rng.randint(0, 7)
        grown.extend(stream[i:i + step])
        i += step
        rebuilt = SuffixTree(depth)
        rebuilt.extend(stream[:i])
        assert grown.dump() == rebuilt.dump()
        assert grown.nodes == rebuilt.nodes
        ctx = stream[:i]
        assert grown.speculate(ctx, 8, 1.0, 0.1, open_stream=True) == \
            rebuilt.speculate(ctx, 8, 1.0, 0.1, open_stream=True)
    best_children_ok(grown)


def test_an_update_touches_at_most_depth_nodes():
    # O(new tokens x depth): a token creates at most `depth` nodes, however long the stream.
    depth = 5
    tree = SuffixTree(depth)
    stream = list(range(200))  # all distinct: the worst case
    for i, t in enumerate(stream):
        before = tree.nodes
        tree.extend([t])
        assert tree.nodes - before == min(i + 1, depth)
        assert len(tree._open) <= depth - 1


@pytest.mark.parametrize("seed", range(10))
def test_removing_an_output_leaves_the_tree_of_the_rest(seed):
    rng = random.Random(200 + seed)
    depth = rng.randint(2, 6)
    streams = [random_stream(rng, rng.randint(1, 30)) for _ in range(6)]
    tree = SuffixTree(depth)
    for s in streams:
        tree.add(s)
    order = list(range(6))
    rng.shuffle(order)
    kept = set(range(6))
    for i in order:
        tree.remove(streams[i])
        kept.discard(i)
        rest = [streams[j] for j in sorted(kept)]
        assert tree.dump() == dict(brute_counts(rest, depth))
        assert tree.nodes == len(tree.dump())
        best_children_ok(tree)
    assert tree.root.items() == [] and tree.nodes == 0


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("open_stream", [False, True], ids=["global", "local"])
def test_drafts_equal_the_brute_force_reference(seed, open_stream):
    rng = random.Random(300 + seed)
    depth = rng.randint(3, 8)
    streams = [random_stream(rng, rng.randint(5, 60)) for _ in range(1 if open_stream else 3)]
    tree = SuffixTree(depth)
    if open_stream:
        tree.extend(streams[0])
    else:
        for s in streams:
            tree.add(s)
    factor = rng.choice([0.5, 1.0, 2.0])
    floor = rng.choice([0.0, 0.1, 0.3])
    for _ in range(10):
        ctx = streams[0] if open_stream else random_stream(rng, rng.randint(1, 12))
        draft = tree.speculate(ctx, 6, factor, floor, open_stream=open_stream)
        tokens, score, m = brute_speculate(streams, ctx, depth, 6, factor, floor, open_stream)
        assert draft.tokens == tokens
        assert draft.score == pytest.approx(score)
        assert draft.match_len == (m if tokens else 0)


def test_a_longer_match_earns_a_longer_draft_and_the_floor_stops_a_doubtful_one():
    tree = SuffixTree(24)
    tree.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    # One matched token allows one draft token (max_spec_factor 1); four allow four.
    assert tree.speculate([9, 9, 1], 10, 1.0, 0.1).tokens == (2,)
    assert tree.speculate([1, 2, 3, 4], 10, 1.0, 0.1).tokens == (5, 6, 7, 8)
    assert tree.speculate([1, 2, 3, 4], 10, 2.0, 0.1).tokens == (5, 6, 7, 8, 9)
    # After 1: 2 twice, 3 once, then ... : p(2) = 2/3, p(2 then 5) = 2/3 * 1/2.
    branchy = SuffixTree(24)
    for s in ([1, 2, 5], [1, 2, 6], [1, 3]):
        branchy.add(s)
    assert branchy.speculate([1], 5, 5.0, 0.1).tokens == (2, 5)
    assert branchy.speculate([1], 5, 5.0, 0.4).tokens == (2,)
    assert branchy.speculate([1], 5, 5.0, 0.7).tokens == ()


def test_a_match_shorter_than_min_match_drafts_nothing():
    tree = SuffixTree(24)
    tree.add([1, 2, 3, 4, 5, 6])
    assert tree.speculate([9, 2, 3], 4, 2.0, 0.1, min_match=2).tokens == (4, 5, 6)
    assert tree.speculate([9, 2, 3], 4, 2.0, 0.1, min_match=3).tokens == ()
    assert tree.speculate([1, 2, 3], 4, 2.0, 0.1, min_match=3).tokens == (4, 5, 6)


def test_a_draft_from_previous_outputs_needs_a_longer_match_and_more_confidence():
    drafter = SuffixDrafter(max_draft_len=8, max_spec_factor=2.0, min_token_prob=0.1,
                            cache_min_token_prob=0.9, cache_min_match=3)
    drafter.remember([[1, 2, 3, 4, 5, 6]])
    # Two shared tokens ("2 3") are too few for the cache; three ("1 2 3") are enough.
    assert drafter.session().propose([9, 2, 3], None, 8).tokens == ()
    assert drafter.session().propose([9, 1, 2, 3], None, 8).tokens == (4, 5, 6)
    # After "1 2 3": 4 in one output, 7 in another: p = 1/2 < 0.9, so nothing from the cache,
    # while the same counts in the request's own context clear its floor of 0.1.
    drafter.remember([[1, 2, 3, 7, 8]])
    assert drafter.session().propose([9, 1, 2, 3], None, 8).tokens == ()
    own = drafter.session().propose([1, 2, 3, 4, 1, 2, 3, 7, 1, 2, 3], None, 8)
    assert own.tokens[:1] in {(4,), (7,)}


@pytest.mark.parametrize("bad", [{"cache_min_match": 0}, {"cache_min_token_prob": 1.5},
                                 {"min_token_prob": -0.1}, {"local_prompt_tokens": 0}])
def test_bad_suffix_drafter_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SuffixDrafter(**bad)


def test_the_open_end_of_a_local_stream_does_not_dilute_its_counts():
    tree = SuffixTree(8)
    tree.extend([7, 1, 2, 3, 9, 1, 2])
    # "1 2" occurs twice; only the first has a continuation (3): p = 1, not 1/2.
    d = tree.speculate([9, 1, 2], 4, 4.0, 0.6, open_stream=True)
    assert d.tokens[:1] == (3,)
    assert tree.speculate([9, 1, 2], 4, 4.0, 0.6, open_stream=False).tokens == ()


# ---- the global cache ----


def test_the_cache_keeps_the_newest_outputs_fifo():
    rng = random.Random(5)
    cache = SuffixCache(max_requests=5, max_nodes=10_000, depth=6)
    outs = [random_stream(rng, rng.randint(1, 20)) for _ in range(20)]
    for i, out in enumerate(outs):
        cache.add(out)
        assert len(cache) == min(i + 1, 5)
        kept = outs[max(0, i - 4):i + 1]
        assert cache.tree.dump() == dict(brute_counts(kept, 6))
        assert cache.tokens == sum(len(o) for o in kept)
    assert cache.evicted == 15


def test_the_cache_stays_within_its_node_budget():
    rng = random.Random(6)
    budget, depth = 300, 6
    cache = SuffixCache(max_requests=1000, max_nodes=budget, depth=depth)
    for _ in range(100):
        cache.add([rng.randrange(50) for _ in range(rng.randint(1, 40))])
        assert cache.tree.nodes <= budget
        assert cache.tree.nodes == len(cache.tree.dump())
    # One output longer than the budget allows is cut, so it alone still fits.
    cache.add(list(range(10_000)))
    assert cache.tree.nodes <= budget and len(cache) >= 1
    stats = cache.stats()
    assert stats["nodes"] == cache.tree.nodes and stats["approx_bytes"] > 0


def test_ten_thousand_outputs_fit_the_default_bounds():
    # The target: at least 10,000 previous outputs within the stated bound.
    rng = random.Random(7)
    cache = SuffixCache()
    shapes = [[40 + i for i in range(10)], [80 + i for i in range(8)]]
    for i in range(10_000):
        shape = shapes[i % 2]
        cache.add([*shape[:5], rng.randrange(50), *shape[5:]])
    assert len(cache) == 10_000 and cache.evicted == 0
    assert cache.tree.nodes <= cache.max_nodes


@pytest.mark.parametrize("bad", [{"max_requests": 0}, {"max_nodes": 0}, {"depth": 1}])
def test_bad_cache_bounds_are_refused(bad):
    with pytest.raises(ValueError):
        SuffixCache(**bad)


# ---- the drafter ----


def test_a_session_drafts_what_a_fresh_drafter_drafts_on_the_same_history():
    rng = random.Random(8)
    drafter = SuffixDrafter(max_draft_len=8, depth=10)
    drafter.remember([random_stream(rng, 40) for _ in range(5)])
    session = drafter.session()
    history = random_stream(rng, 5)
    for _ in range(30):
        history = history + random_stream(rng, rng.randint(1, 4))
        block = session.propose(history, None, 8)
        assert block == drafter.propose(history, None, 8)
        assert all(d.support() == ((t, 1.0),) for t, d in zip(block.tokens, block.dists,
                                                                 strict=True))


def test_a_requests_tree_indexes_only_the_last_prompt_tokens_and_all_later_ones():
    drafter = SuffixDrafter(max_draft_len=4, depth=4, local_prompt_tokens=5)
    session = drafter.session()
    prompt = list(range(100, 112))  # 12 distinct tokens
    session.propose(prompt, None, 4)
    assert session.tree.count([100]) == 0 and session.tree.count([106]) == 0
    assert all(session.tree.count([t]) == 1 for t in prompt[-5:])
    output = [1, 2, 3, 1, 2, 3, 1]
    for i in range(1, len(output) + 1):
        session.propose(prompt + output[:i], None, 4)
    assert session.tree.count([1, 2, 3]) == 2 and session.tree.count([111, 1]) == 1
    assert session.tree.nodes <= 4 * (5 + len(output))


def test_run_ahead_drafts_past_the_assumed_block_but_stores_only_the_committed_history():
    drafter = SuffixDrafter(max_draft_len=8)
    session = drafter.session()
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    block = propose_ahead(session, history, None, [3, 4], 4)
    # The guess 5 after "... 1 2 3 4" (the earlier "1 2 3 4" continued 5 6 1 2), then the rest.
    assert block.tokens == (5, 6, 1, 2)
    assert session._seen == history
    assert session.tree.count([3, 4]) == 1  # the assumed "3 4" was not added


def test_previous_outputs_are_drafted_for_a_new_request():
    drafter = SuffixDrafter(max_draft_len=16, max_spec_factor=1.0)
    answer = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
    drafter.remember([answer])
    # A new prompt whose output starts like the earlier answer: the global tree continues it.
    block = drafter.session().propose([9, 8, 7, 50, 51, 52, 53], None, 16)
    assert block.tokens == (54, 55, 56, 57)
    stats = drafter.stats()
    assert stats["global_wins"] == 1 and stats["cache"]["outputs"] == 1


def test_suffix_plus_lookup_extends_a_short_suffix_draft_with_a_longer_copy():
    plain = build_drafter("suffix", max_draft_len=12)
    both = build_drafter("suffix+lookup", ngram_size=2, max_draft_len=12)
    history = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 30, 1, 2]
    short = plain.session().propose(history, None, 12)
    long = both.session().propose(history, None, 12)
    assert short.tokens == (3, 4, 5, 6)  # 2 matched tokens x max_spec_factor 2
    assert long.tokens == (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 30, 1)


def test_the_registry_builds_and_checks_the_suffix_drafters():
    for name in ("suffix", "suffix+lookup"):
        drafter = build_drafter(name, suffix_cache_requests=7)
        caps = drafter_capabilities(drafter)
        assert (caps.sessions, caps.remembers, caps.samples, caps.wants_hidden) == \
            (True, True, False, False)
        assert drafter.cache.max_requests == 7
        check_drafter(name, suffix_cache_requests=3)
        with pytest.raises(ValueError):
            check_drafter(name, suffix_cache_requests=-1)
    with pytest.raises(ValueError, match="suffix"):
        check_drafter("prompt-lookup", suffix_cache_requests=5)


def test_sessions_hand_outputs_only_to_a_drafter_that_remembers():
    suffix = SuffixDrafter(max_spec_factor=1.0)
    sessions = DrafterSessions(suffix)
    assert sessions.remember([[1, 2, 3], [4, 5]]) == 2
    assert len(suffix.cache) == 2
    lookup = DrafterSessions(build_drafter("prompt-lookup"))
    assert lookup.remember([[1, 2, 3]]) == 0
    # A session per request id; its history grows through the sessions' append-only view.
    resync, block = sessions.propose("r", 0, [4, 5, 9, 4], 4)
    assert not resync and isinstance(block, DraftBlock) and block.tokens == (5,)
