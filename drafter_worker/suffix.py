"""Suffix decoding: drafts from frequency-counted suffix trees over the request's own context
and over previous requests' outputs, no model at all.

After Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications" (arXiv 2411.04975, NeurIPS 2025; Snowflake's Arctic Inference implements it,
vLLM wraps that in PR #25784). Written from the paper's description, not from that code:

- a **local tree** per request over its prompt and committed output, and a **global tree**
  over the outputs of previous requests (`SuffixCache`, FIFO-evicted past a request count
  or a node budget), both **depth-capped** (every substring of length ``<= depth`` is a
  node), each node counting the occurrences of its substring; the global tree is one per
  **partition** (`PartitionedCache`: the coordinator's tenant and ``cache_salt``), so a
  request drafts only from its own partition's previous outputs;
- trees grow **incrementally**: a new token touches at most ``depth`` nodes (the open
  suffixes of the stream), never a rebuild;
- to draft, the context's last ``m`` tokens are matched for ``m = 1, 2, ...`` while they
  occur; from each match the draft follows the most frequent child while the product of
  count ratios (the estimated probability that the whole draft so far is right) stays
  ``>= min_token_prob``, for at most ``max_spec_factor * m`` tokens (a longer match earns a
  longer draft); a draft's score is the sum of those products (its expected accepted
  length); the best-scoring candidate over every ``m`` and both trees wins; a draft from
  previous outputs needs a longer match and a higher probability than one from the request's
  own context (`DEFAULT_CACHE_MIN_MATCH`, `DEFAULT_CACHE_MIN_TOKEN_PROB`), and the coordinator
  indexes each output after its prompt's last tokens, so an answer's first tokens can be
  drafted from how earlier prompts ended.

Drafts are deterministic (`DraftBlock.deterministic`: a point mass ``q``), so the rejection
rule stays lossless at every temperature.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specd_core.draft import DraftBlock, DrafterCapabilities

#: Default depth cap of both trees (vLLM's ``suffix_decoding_max_tree_depth``).
DEFAULT_DEPTH = 24
#: Default draft tokens per matched token (the paper's default is 1.0).
DEFAULT_MAX_SPEC_FACTOR = 2.0
#: Default floor on a local (own-context) draft's estimated probability (the product of
#: count ratios; the paper's default is 0.1).
DEFAULT_MIN_TOKEN_PROB = 0.7
#: Default floor on a draft from previous requests' outputs: stricter, since another
#: request's text continues this one less often than this request's own does.
DEFAULT_CACHE_MIN_TOKEN_PROB = 0.9
#: Default shortest context match a draft from previous outputs needs (a few shared tokens
#: say little about an unrelated request).
DEFAULT_CACHE_MIN_MATCH = 4
# These four defaults (with `coordinator.step.drafting.REMEMBER_PROMPT_TAIL`) were chosen by
# replaying greedy SmolLM2 outputs through the drafters with the adaptive draft length and
# this machine's forward costs (`scripts/suffix_replay.py`, docs/drafters.md): on the
# repeated-structure workload the paper's settings drafted 1.34x plain decoding's estimated
# speed and these 2.06x; on the shipped workloads and MT-Bench suffix+lookup stayed within
# 0.16x of prompt lookup (code_edit 3.61x against 3.77x) and through the service it measured
# ahead of it on every shipped workload (docs/benchmarks.md).
#: Default most prompt tokens a request's own tree indexes (the last ones): with the depth
#: this bounds a request's tree to ``depth x (this + its output)`` nodes (~8 MB for 4,096
#: prompt tokens); prompt lookup (``suffix+lookup``) still copies from the whole context.
DEFAULT_LOCAL_PROMPT_TOKENS = 4096
#: Default number of previous outputs the global cache keeps (FIFO).
DEFAULT_CACHE_REQUESTS = 10_000
#: Default node budget of the global cache: with `SuffixTree.BYTES_PER_NODE` this bounds
#: its memory to ~1 GB whatever the outputs are; 10,000 outputs of 60 tokens with a sixth
#: of their tokens random (field values) took 8.8M nodes, 640 MiB (README, "Suffix
#: decoding").
DEFAULT_CACHE_NODES = 12_000_000


class _Node:
    """One substring: ``count`` occurrences, its children by next token, and ``best``: the
    token of the most frequent child (ties: the smallest id), -1 for none.

    Memory: most nodes of a depth-capped tree have at most one child (the chains of text seen
    once), so a single child is held inline (``tok``, ``one``) and a dict (``kids``) is made
    only for a second one: ~3x less than a dict per node.
    """

    __slots__ = ("count", "best", "tok", "one", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.best = -1
        self.tok = -1
        self.one: _Node | None = None
        self.kids: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node | None:
        """The child for ``token``, or None."""
        kids = self.kids
        if kids is not None:
            return kids.get(token)
        return self.one if self.tok == token else None

    def items(self) -> list[tuple[int, _Node]]:
        """``(token, child)`` for every child."""
        if self.kids is not None:
            return list(self.kids.items())
        return [] if self.one is None else [(self.tok, self.one)]

    def add_child(self, token: int) -> _Node:
        """A new, zero-count child for ``token`` (which must not have one)."""
        node = _Node()
        if self.kids is not None:
            self.kids[token] = node
        elif self.one is None:
            self.tok, self.one = token, node
        else:
            self.kids = {self.tok: self.one, token: node}
            self.tok, self.one = -1, None
        return node

    def drop_child(self, token: int) -> None:
        """Removes ``token``'s child (which must exist)."""
        kids = self.kids
        if kids is None:
            self.tok, self.one = -1, None
            return
        del kids[token]
        if len(kids) == 1:
            (self.tok, self.one), = kids.items()
            self.kids = None


def _bump(parent: _Node, token: int) -> _Node:
    """``parent``'s child ``token`` (created if new) with its count + 1; keeps ``best``."""
    child = parent.child(token)
    if child is None:
        child = parent.add_child(token)
    child.count += 1
    best = parent.best
    if best != token:
        if best < 0:
            parent.best = token
        else:
            b = parent.child(best).count
            if child.count > b or (child.count == b and token < best):
                parent.best = token
    return child


def _rescan(node: _Node) -> None:
    """Recomputes ``node.best`` from its children (after a count went down)."""
    best, top = -1, 0
    for token, child in node.items():
        if child.count > top or (child.count == top and token < best):
            best, top = token, child.count
    node.best = best


@dataclass(frozen=True)
class Draft:
    """A candidate continuation: ``tokens``, ``score`` (the sum over its positions of the
    estimated probability that every token so far is right), ``match_len`` (context tokens
    matched) and ``source`` ("local", "global" or "" for none)."""

    tokens: tuple[int, ...] = ()
    score: float = 0.0
    match_len: int = 0
    source: str = ""


class SuffixTree:
    """A depth-capped suffix tree with occurrence counts over one or many token streams.

    Node ``s`` (a substring, ``1 <= len(s) <= depth``) counts the positions where ``s``
    occurs in the streams added. `extend` appends tokens to the open stream in
    O(new tokens x depth); `add` inserts a whole sequence as its own stream and `remove`
    takes one out again (the global cache's eviction), both O(len x depth).

    Memory: at most ``depth`` nodes per token held, ~`BYTES_PER_NODE` bytes each (CPython
    3.11, measured); repeated text shares nodes.

    Raises:
        ValueError: ``depth < 2``.
    """

    #: Measured bytes per node (tracemalloc, 2k random and 10k structured outputs of 60
    #: tokens: 76-79 B; a node is 56 B, a second child adds a dict).
    BYTES_PER_NODE = 80

    def __init__(self, depth: int = DEFAULT_DEPTH):
        if isinstance(depth, bool) or int(depth) < 2:
            raise ValueError(f"depth must be an int >= 2, got {depth!r}")
        self.depth = int(depth)
        self.root = _Node()
        self.nodes = 0
        # The open stream's suffixes that may still grow, shortest first: _open[i] is the
        # node of its last i + 1 tokens (i + 1 < depth).
        self._open: list[_Node] = []
        self._open_ends: list[_Node] = []  # every suffix node of the open stream

    # ---- building ----

    def extend(self, tokens: Iterable[int]) -> None:
        """Appends ``tokens`` to the open stream: each touches at most ``depth`` nodes."""
        depth, root = self.depth, self.root
        opened = self._open
        created = 0
        for t in tokens:
            t = int(t)
            grown = []
            for node in (root, *opened):  # `_bump`, inlined: this loop is the hot path
                kids = node.kids
                child = kids.get(t) if kids is not None else (
                    node.one if node.tok == t else None)
                if child is None:
                    child = node.add_child(t)
                    created += 1
                count = child.count = child.count + 1
                best = node.best
                if best != t:
                    if best < 0:
                        node.best = t
                    else:
                        b = node.child(best).count
                        if count > b or (count == b and t < best):
                            node.best = t
                grown.append(child)
            self._open_ends = grown
            opened = grown[:depth - 1]
        self._open = opened
        self.nodes += created

    def add(self, tokens: Sequence[int]) -> None:
        """Inserts ``tokens`` as a stream of its own (the open stream is closed first)."""
        self.close()
        self.extend(tokens)
        self.close()

    def close(self) -> None:
        """Ends the open stream: later tokens start a new one."""
        self._open, self._open_ends = [], []

    def remove(self, tokens: Sequence[int]) -> None:
        """Takes out one earlier `add` of ``tokens``: every count it added goes down, nodes
        left at zero go (the caller must only remove what it added)."""
        toks = [int(t) for t in tokens]
        depth = self.depth
        for start in range(len(toks)):
            node = self.root
            for t in toks[start:start + depth]:
                child = node.child(t)
                if child is None:
                    raise KeyError(f"remove: {toks[start:start + depth]} was never added")
                child.count -= 1
                if child.count == 0:
                    self.nodes -= _size(child)
                    node.drop_child(t)
                    if node.best == t:
                        _rescan(node)
                    break
                if node.best == t:
                    _rescan(node)
                node = child

    # ---- reading ----

    def find(self, tokens: Sequence[int]) -> _Node | None:
        """The node of substring ``tokens`` (None when it does not occur or is too long)."""
        node = self.root
        for t in tokens:
            node = node.child(int(t))
            if node is None:
                return None
        return node

    def count(self, tokens: Sequence[int]) -> int:
        """Occurrences of ``tokens`` (0 for none; ``len(tokens) <= depth`` to count)."""
        node = self.find(tokens)
        return 0 if node is None or not tokens else node.count

    def continuations(self, tokens: Sequence[int]) -> dict[int, int]:
        """``{next token: occurrences of tokens + [next]}`` (empty when none)."""
        node = self.find(tokens)
        return {} if node is None else {t: c.count for t, c in node.items()}

    def dump(self) -> dict[tuple[int, ...], int]:
        """Every substring held with its count (tests: compare trees)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[tuple[int, ...], _Node]] = [((), self.root)]
        while stack:
            path, node = stack.pop()
            for t, child in node.items():
                key = (*path, t)
                out[key] = child.count
                stack.append((key, child))
        return out

    def speculate(self, context: Sequence[int], max_tokens: int,
                  max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
                  min_token_prob: float = DEFAULT_MIN_TOKEN_PROB, open_stream: bool = False,
                  source: str = "", min_match: int = 1) -> Draft:
        """The best-scoring draft after ``context`` (an empty `Draft` when nothing matches).

        For each ``m = min_match .. depth - 1`` whose last-``m`` tokens of ``context`` occur:
        follow the most frequent child while the running product of ``child.count /
        node.count`` stays ``>= min_token_prob``, for at most ``min(max_tokens,
        floor(max_spec_factor * m), depth - m)`` tokens. Score: the sum of the products. The
        best score wins; ties go to the longer match. ``open_stream``: this tree's open
        stream is still growing (a request's own tree): the occurrence of each of its
        suffixes at its end has no continuation yet and does not count in the ratios'
        denominators (which then equal the sum of the children's counts)."""
        best = Draft(source=source)
        if max_tokens <= 0 or not context:
            return best
        ctx = [int(t) for t in context[-(self.depth - 1):]]
        open_ids = {id(n) for n in self._open_ends} if open_stream else ()
        n = len(ctx)
        for m in range(1, n + 1):
            node = self.find(ctx[n - m:])
            if node is None:
                break
            if m < min_match:
                continue
            limit = min(max_tokens, int(max_spec_factor * m + 1e-9), self.depth - m)
            if limit <= 0:
                continue
            tokens, score, prob = [], 0.0, 1.0
            while len(tokens) < limit and node.best >= 0:
                child = node.child(node.best)
                total = node.count - (1 if id(node) in open_ids else 0)
                if total <= 0:
                    break
                p = prob * child.count / total
                if p < min_token_prob:
                    break
                prob = p
                tokens.append(node.best)
                score += prob
                node = child
            if tokens and score >= best.score:
                best = Draft(tuple(tokens), score, m, source)
        return best


def _size(node: _Node) -> int:
    """Nodes in the subtree under and including ``node``."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        total += 1
        stack.extend(c for _, c in n.items())
    return total


class SuffixCache:
    """The global tree: previous requests' outputs, FIFO-evicted.

    Holds at most ``max_requests`` outputs and ``max_nodes`` tree nodes: adding an output
    first evicts the oldest ones until both bounds hold again (an output is cut to its first
    ``max_nodes // depth`` tokens, so one output alone always fits). Memory is therefore
    bounded by ``max_nodes * SuffixTree.BYTES_PER_NODE`` plus the outputs' token lists
    (between inserts; while one output goes in, the tree may pass the budget by that
    output's nodes, at most ``depth x`` its length, before the oldest ones go).
    Thread-safe (one lock).

    Raises:
        ValueError: a bound below 1, or a bad ``depth``.
    """

    def __init__(self, max_requests: int = DEFAULT_CACHE_REQUESTS,
                 max_nodes: int = DEFAULT_CACHE_NODES, depth: int = DEFAULT_DEPTH):
        for name, value in (("max_requests", max_requests), ("max_nodes", max_nodes)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.tree = SuffixTree(depth)
        self.max_requests = int(max_requests)
        self.max_nodes = int(max_nodes)
        self._outputs: deque[tuple[int, ...]] = deque()
        self.tokens = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def add(self, output: Sequence[int]) -> None:
        """Caches one finished output (empty ones are ignored), evicting the oldest ones
        past the bounds."""
        keep = max(1, self.max_nodes // self.tree.depth)
        toks = tuple(int(t) for t in output[:keep])
        if not toks:
            return
        with self._lock:
            while len(self._outputs) >= self.max_requests:
                self._evict()
            self.tree.add(toks)
            self._outputs.append(toks)
            self.tokens += len(toks)
            while len(self._outputs) > 1 and self.tree.nodes > self.max_nodes:
                self._evict()

    def _evict(self) -> None:
        old = self._outputs.popleft()
        self.tree.remove(old)
        self.tokens -= len(old)
        self.evicted += 1

    def evict_oldest(self) -> None:
        """Takes out the oldest output held (none held: nothing happens)."""
        with self._lock:
            if self._outputs:
                self._evict()

    def speculate(self, context: Sequence[int], max_tokens: int, max_spec_factor: float,
                  min_token_prob: float, min_match: int = 1) -> Draft:
        """`SuffixTree.speculate` over the cached outputs."""
        with self._lock:
            return self.tree.speculate(context, max_tokens, max_spec_factor, min_token_prob,
                                       source="global", min_match=min_match)

    def __len__(self) -> int:
        """Outputs held."""
        return len(self._outputs)

    def stats(self) -> dict:
        """``outputs``, ``tokens``, ``nodes``, ``evicted`` and ``approx_bytes``."""
        with self._lock:
            return {"outputs": len(self._outputs), "tokens": self.tokens,
                    "nodes": self.tree.nodes, "evicted": self.evicted,
                    "approx_bytes": self.tree.nodes * SuffixTree.BYTES_PER_NODE}


#: The partition of requests that name none (`PartitionedCache`).
SHARED_PARTITION = ""


class PartitionedCache:
    """Previous requests' outputs, one `SuffixCache` per partition: a request drafts only
    from its own partition's outputs, so what it drafts (and so its counters and timing)
    never depends on another partition's text.

    A partition is an opaque string (the coordinator derives it from the request's tenant
    and ``cache_salt``; `SHARED_PARTITION`, "", for requests that name none). A partition
    exists while it holds an output: it is made by its first `add` and dropped when its last
    output goes.

    Bounds: each partition holds at most ``partition_requests`` outputs and
    ``partition_nodes`` nodes (its own FIFO, as `SuffixCache`), and all partitions together
    at most ``max_requests`` outputs and ``max_nodes`` nodes: past a total bound, the oldest
    output of the least recently used partition goes first (a partition is used when an
    output is added to it or a request drafts from it), so a partition left empty is dropped
    before any other loses an output; the output just added is never the one evicted. Memory
    is therefore bounded as one `SuffixCache` of the total bounds, plus ~1 KB per partition
    (at most ``max_requests`` of them). What another partition can still change is only
    *whether* this one's oldest outputs are evicted (by filling the total), never what it
    drafts from.

    ``max_requests = 0`` keeps nothing: `add` ignores every output and nothing is drafted.
    Thread-safe (one lock).

    Raises:
        ValueError: ``max_requests < 0``, another bound below 1, or a bad ``depth``.
    """

    def __init__(self, max_requests: int = DEFAULT_CACHE_REQUESTS,
                 max_nodes: int = DEFAULT_CACHE_NODES, depth: int = DEFAULT_DEPTH,
                 partition_requests: int | None = None, partition_nodes: int | None = None):
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or \
                max_requests < 0:
            raise ValueError(f"max_requests must be an int >= 0 (0 keeps nothing), got "
                             f"{max_requests!r}")
        partition_requests = max(1, max_requests) if partition_requests is None \
            else partition_requests
        partition_nodes = max_nodes if partition_nodes is None else partition_nodes
        for name, value in (("max_nodes", max_nodes), ("partition_requests", partition_requests),
                            ("partition_nodes", partition_nodes)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        SuffixTree(depth)  # validates depth
        self.depth = int(depth)
        self.max_requests = int(max_requests)
        self.max_nodes = int(max_nodes)
        self.partition_requests = min(int(partition_requests), max(1, self.max_requests))
        self.partition_nodes = min(int(partition_nodes), self.max_nodes)
        # partition -> its cache, least recently used first.
        self._parts: OrderedDict[str, SuffixCache] = OrderedDict()
        self.outputs = 0
        self.tokens = 0
        self.nodes = 0
        self.evicted = 0
        self._lock = threading.Lock()

    def add(self, output: Sequence[int], partition: str = SHARED_PARTITION) -> None:
        """Caches one finished output in ``partition`` (empty outputs are ignored, and every
        output when ``max_requests`` is 0), evicting past the bounds (see the class)."""
        if self.max_requests == 0 or not output:
            return
        partition = str(partition)
        with self._lock:
            cache = self._parts.get(partition)
            if cache is None:
                cache = self._parts[partition] = SuffixCache(
                    self.partition_requests, self.partition_nodes, self.depth)
            self._parts.move_to_end(partition)
            self._apply(cache, lambda: cache.add(output))
            while self.outputs > self.max_requests or self.nodes > self.max_nodes:
                name, victim = next(iter(self._parts.items()))
                if victim is cache and len(cache) <= 1:
                    break  # only the new output is left: it alone fits (it was cut to fit)
                self._apply(victim, victim.evict_oldest)
                if not len(victim):
                    del self._parts[name]

    def _apply(self, cache: SuffixCache, change) -> None:
        """Runs ``change()`` on ``cache`` and carries its effect into the totals (caller
        holds the lock)."""
        before = (len(cache), cache.tokens, cache.tree.nodes, cache.evicted)
        change()
        self.outputs += len(cache) - before[0]
        self.tokens += cache.tokens - before[1]
        self.nodes += cache.tree.nodes - before[2]
        self.evicted += cache.evicted - before[3]

    def speculate(self, partition: str, context: Sequence[int], max_tokens: int,
                  max_spec_factor: float, min_token_prob: float, min_match: int = 1) -> Draft:
        """`SuffixCache.speculate` over ``partition``'s outputs only (an empty `Draft` for a
        partition that holds none); marks the partition used."""
        with self._lock:
            cache = self._parts.get(partition)
            if cache is None:
                return Draft(source="global")
            self._parts.move_to_end(partition)
            return cache.speculate(context, max_tokens, max_spec_factor, min_token_prob,
                                   min_match)

    def partition(self, name: str) -> SuffixCache | None:
        """``name``'s cache, or None when it holds nothing (tests, tools)."""
        with self._lock:
            return self._parts.get(name)

    def __len__(self) -> int:
        """Outputs held, over every partition."""
        return self.outputs

    def stats(self) -> dict:
        """Totals over every partition: ``outputs``, ``tokens``, ``nodes``, ``evicted``,
        ``approx_bytes``, and ``partitions`` (how many hold an output; never their names)."""
        with self._lock:
            return {"outputs": self.outputs, "tokens": self.tokens, "nodes": self.nodes,
                    "evicted": self.evicted,
                    "approx_bytes": self.nodes * SuffixTree.BYTES_PER_NODE,
                    "partitions": len(self._parts)}


class SuffixDrafter:
    """The ``--drafter suffix`` drafter: one per drafter worker, holding the global cache
    (`PartitionedCache`: one `SuffixCache` per partition); each request drafts through its
    own `SuffixSession` (its local tree) and its own partition's cache.

    `remember` puts finished outputs into their partitions' caches (the scheduler sends
    every finished request's output to every drafter worker). Proposals are deterministic
    point masses.

    Args:
        max_draft_len: the most tokens one proposal drafts (>= 1).
        depth: both trees' depth cap (>= 2).
        max_spec_factor: draft tokens allowed per matched context token (> 0).
        min_token_prob: the floor on a local draft's estimated probability, in ``[0, 1]``.
        cache_min_token_prob: the same floor for drafts from the global cache, in ``[0, 1]``.
        cache_min_match: the shortest context match a global-cache draft needs (>= 1).
        local_prompt_tokens: the most tokens of a request's first history (its prompt) its
            own tree indexes, the last ones (>= 1); later tokens are all indexed.
        cache_requests: previous outputs the global cache keeps, over all partitions
            together and in each (FIFO within a partition; >= 0: 0 keeps none, so a request
            drafts from its own context only and `capabilities` declares no cache).
        cache_nodes: the global cache's node budget, likewise (>= 1; see `SuffixCache`).
        partition_requests, partition_nodes: tighter bounds for each partition (default:
            the totals; see `PartitionedCache`).
        lookup: a `drafter_worker.prompt_lookup.PromptLookupSpeculator` ("suffix+lookup"):
            when its block over the whole context starts with the suffix draft and is longer
            (a copy longer than the trees' depth allows), its block is proposed instead.

    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, max_draft_len: int = 32, depth: int = DEFAULT_DEPTH,
                 max_spec_factor: float = DEFAULT_MAX_SPEC_FACTOR,
                 min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
                 cache_min_token_prob: float = DEFAULT_CACHE_MIN_TOKEN_PROB,
                 cache_min_match: int = DEFAULT_CACHE_MIN_MATCH,
                 local_prompt_tokens: int = DEFAULT_LOCAL_PROMPT_TOKENS,
                 cache_requests: int = DEFAULT_CACHE_REQUESTS,
                 cache_nodes: int = DEFAULT_CACHE_NODES, lookup=None,
                 partition_requests: int | None = None, partition_nodes: int | None = None):
        if isinstance(max_draft_len, bool) or int(max_draft_len) < 1:
            raise ValueError(f"max_draft_len must be at least 1, got {max_draft_len!r}")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be > 0, got {max_spec_factor!r}")
        for name, value in (("min_token_prob", min_token_prob),
                            ("cache_min_token_prob", cache_min_token_prob)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        for name, value in (("cache_min_match", cache_min_match),
                            ("local_prompt_tokens", local_prompt_tokens)):
            if isinstance(value, bool) or int(value) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.max_draft_len = int(max_draft_len)
        self.depth = int(depth)
        self.max_spec_factor = float(max_spec_factor)
        self.min_token_prob = float(min_token_prob)
        self.cache_min_token_prob = float(cache_min_token_prob)
        self.cache_min_match = int(cache_min_match)
        self.local_prompt_tokens = int(local_prompt_tokens)
        self.cache = PartitionedCache(cache_requests, cache_nodes, depth, partition_requests,
                                      partition_nodes)
        self.lookup = lookup
        #: Proposals made, and how many of them came from the local / global tree / lookup.
        self.proposals = 0
        self.local_wins = 0
        self.global_wins = 0
        self.lookup_wins = 0

    @property
    def capabilities(self) -> DrafterCapabilities:
        """No hidden rows, point masses, a session per request (its local tree), and a
        cross-request cache fed by `remember` (none with ``cache_requests=0``)."""
        return DrafterCapabilities(wants_hidden=False, max_draft_len=self.max_draft_len,
                                   sessions=True, samples=False,
                                   remembers=self.cache.max_requests > 0)

    def session(self, sampling=None, seed: int = 0,
                partition: str = SHARED_PARTITION) -> SuffixSession:
        """A request's own drafter (its local tree), drafting from ``partition``'s cache only;
        ``sampling`` and ``seed`` are unused: suffix drafts are deterministic."""
        return SuffixSession(self, partition)

    def remember(self, outputs: Iterable[Sequence[int]],
                 partitions: Sequence[str] | None = None) -> None:
        """Adds finished requests' outputs (token ids; the scheduler sends each after the last
        `coordinator.step.drafting.REMEMBER_PROMPT_TAIL` tokens of its prompt, so answers' first
        tokens can be drafted from how earlier prompts ended) to the global cache, output
        ``i`` to partition ``partitions[i]`` (None: all to the shared partition "").

        Raises:
            ValueError: ``partitions`` not one per output (nothing is added).
        """
        outputs = list(outputs)
        if partitions is None:
            partitions = [SHARED_PARTITION] * len(outputs)
        elif len(partitions) != len(outputs):
            raise ValueError(f"remember: {len(partitions)} partitions for {len(outputs)} "
                             "outputs (one each)")
        for output, partition in zip(outputs, partitions, strict=True):
            self.cache.add(output, partition)

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """`Drafter.propose` without a session: builds a throwaway local tree over
        ``history`` (O(len x depth)), drafting from the shared partition's cache; the service
        always drafts through sessions."""
        return SuffixSession(self).propose(history, target_hidden, max_len)

    def choose(self, local: Draft, context: Sequence[int], max_len: int,
               full_context: Sequence[int] | None = None,
               partition: str = SHARED_PARTITION) -> tuple[int, ...]:
        """The tokens to propose: the better of ``local`` and ``partition``'s cached draft
        for ``context`` (ties: local), or prompt lookup's longer block over ``full_context``
        (default ``context``) when it extends that draft; counted in the statistics."""
        glob = self.cache.speculate(partition, context, max_len, self.max_spec_factor,
                                    self.cache_min_token_prob, self.cache_min_match)
        best = glob if glob.score > local.score else local
        tokens = best.tokens
        source = best.source
        if self.lookup is not None:
            copy = tuple(self.lookup.propose_tokens(
                context if full_context is None else full_context)[:max_len])
            if len(copy) > len(tokens) and copy[:len(tokens)] == tokens:
                tokens, source = copy, "lookup"
        self.proposals += 1
        if tokens:
            if source == "global":
                self.global_wins += 1
            elif source == "lookup":
                self.lookup_wins += 1
            else:
                self.local_wins += 1
        return tokens

    def stats(self) -> dict:
        """``proposals``, ``local_wins``, ``global_wins``, ``global_hit_rate`` (global wins
        per proposal) and the cache's `PartitionedCache.stats` (totals over partitions, and
        their number) under ``cache``."""
        return {"proposals": self.proposals, "local_wins": self.local_wins,
                "global_wins": self.global_wins, "lookup_wins": self.lookup_wins,
                "global_hit_rate": self.global_wins / self.proposals if self.proposals else 0.0,
                "cache": self.cache.stats()}

    def __repr__(self) -> str:
        return (f"SuffixDrafter(max_draft_len={self.max_draft_len}, depth={self.depth}, "
                f"max_spec_factor={self.max_spec_factor}, "
                f"min_token_prob={self.min_token_prob}, "
                f"cache_min_token_prob={self.cache_min_token_prob}, "
                f"cache_min_match={self.cache_min_match}, "
                f"cache_requests={self.cache.max_requests})")


class SuffixSession:
    """One request's suffix drafter: its local tree over the committed history (grown by the
    new tokens of each call), drafting against it and its ``partition``'s cache of previous
    outputs (no other partition's).

    The history a caller passes must be append-only between calls (`DrafterSessions`
    guarantees it); a shorter one rebuilds the tree.
    """

    def __init__(self, parent: SuffixDrafter, partition: str = SHARED_PARTITION):
        self.parent = parent
        self.partition = str(partition)
        self.tree = SuffixTree(parent.depth)
        self._seen: list[int] = []

    @property
    def capabilities(self) -> DrafterCapabilities:
        return self.parent.capabilities

    def _ingest(self, history: Sequence[int]) -> None:
        n = len(self._seen)
        if len(history) < n:  # not a continuation: start over
            self.tree, self._seen, n = SuffixTree(self.parent.depth), [], 0
        new = [int(t) for t in history[n:]]
        # The first history (the prompt) is indexed from its last tokens only: the bound
        # on this request's tree.
        self.tree.extend(new if n else new[-self.parent.local_prompt_tokens:])
        self._seen.extend(new)

    def _draft(self, context: Sequence[int], max_len: int,
               full_context: Sequence[int] | None = None) -> DraftBlock:
        p = self.parent
        max_len = max(0, min(int(max_len), p.max_draft_len))
        if max_len == 0:
            return DraftBlock.empty()
        local = self.tree.speculate(context, max_len, p.max_spec_factor, p.min_token_prob,
                                    open_stream=True, source="local")
        return DraftBlock.deterministic(p.choose(local, context, max_len, full_context,
                                                 self.partition))

    def propose(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                max_len: int) -> DraftBlock:
        """`Drafter.propose`: ingests the new committed tokens, then drafts after them."""
        self._ingest(history)
        return self._draft(history, max_len)

    def propose_ahead(self, history: Sequence[int], target_hidden: torch.Tensor | None,
                      assumed: Sequence[int], max_len: int) -> DraftBlock:
        """`specd_core.draft.propose_ahead`: ingests only the committed ``history``, drafts
        after ``history + assumed``; the block's first token is the guess of the bonus
        token."""
        self._ingest(history)
        if not assumed:
            return self._draft(history, max_len)
        full = [*history, *assumed] if self.parent.lookup is not None else None
        return self._draft([*history[-(self.tree.depth - 1):], *assumed], max_len, full)
