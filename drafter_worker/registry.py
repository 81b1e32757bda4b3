"""The drafter registry: every drafter the command line, the service and the benchmarks can
name, with its defaults and capabilities, and the functions that check and build one.

The one place a drafter name, a default draft length or a drafter's defaults are written:
`specd_tools.cli`, `coordinator.cluster.service`, `specd_tools.bench.core`, `drafter_worker.actor`
and ``python -m drafter_worker`` all read them from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from specd_core.draft import Drafter, DrafterCapabilities

from .prompt_lookup import PromptLookupSpeculator
from .suffix import DEFAULT_CACHE_REQUESTS, SuffixDrafter

#: The drafter a service, `specd generate` and a drafter worker use unless told otherwise:
#: suffix decoding extended by prompt lookup's long copies. Through the service on this
#: machine it measured ahead of prompt lookup on every shipped workload and at or above plain
#: decoding on open questions, where prompt lookup fell below (docs/benchmarks.md, "Never
#: slower than plain"), and 2x plain on repeated-structure traffic.
DEFAULT_DRAFTER = "suffix+lookup"

#: The n-gram length prompt lookup matches, by default.
DEFAULT_NGRAM_SIZE = 3

#: Prompt lookup's default draft length when the length is fixed (``--no-adaptive``): long
#: enough for a copied line, short enough that a miss costs little.
LOOKUP_DRAFT_LEN = 10

#: Prompt lookup's default cap under the adaptive chooser, which picks the length each step
#: (0 included): room for long copies.
LOOKUP_ADAPTIVE_DRAFT_LEN = 32

#: Suffix decoding's default draft length with a fixed length (``--no-adaptive``); its own
#: score (``min_token_prob``) usually stops a draft well before it.
SUFFIX_DRAFT_LEN = 16

#: Suffix decoding's default cap under the adaptive chooser.
SUFFIX_ADAPTIVE_DRAFT_LEN = 32

#: Default draft length of the EAGLE drafters (each drafted token costs a head forward).
EAGLE_MAX_DRAFT_LEN = 3

#: Default `EagleDrafter` ``min_confidence``: a drafted position is verified only while the
#: head's own estimate that the whole block so far is accepted stays above this. Its value is
#: the break-even of one more verified token on the 2-core CPU (a verify over 2 tokens costs
#: ~1.1x one over 1 token, and a head step ~3% of a target forward); see README (EAGLE).
EAGLE_MIN_CONFIDENCE = 0.15


@dataclass(frozen=True)
class DrafterSpec:
    """One registered drafter.

    Attributes:
        name: what ``--drafter`` and `ServiceConfig.drafter` accept.
        summary: one line for help texts.
        draft_len: default most drafts per step with a fixed length (None: no drafter).
        adaptive_draft_len: default cap when the adaptive chooser picks the length.
        has_head: it loads an EAGLE or EAGLE-3 head (``drafter_path`` applies).
        capabilities: what every drafter it builds declares (its ``max_draft_len`` is set
            per instance; a suffix drafter built with ``suffix_cache_requests=0`` keeps no
            cache, so it declares ``remembers`` False).
    """

    name: str
    summary: str
    draft_len: int | None
    adaptive_draft_len: int | None
    has_head: bool
    capabilities: DrafterCapabilities | None


_EAGLE_CAPS = DrafterCapabilities(wants_hidden=True, sessions=True, samples=True)
_SUFFIX_CAPS = DrafterCapabilities(wants_hidden=False, sessions=True, samples=False,
                                   remembers=True)
#: EAGLE-3 drafts the head's argmax (a point mass) at every temperature.
_EAGLE3_CAPS = DrafterCapabilities(wants_hidden=True, sessions=True, samples=False)
_EAGLE3_SUFFIX_CAPS = DrafterCapabilities(wants_hidden=True, sessions=True, samples=False,
                                          remembers=True)

#: Every drafter by name, in help order.
REGISTRY: dict[str, DrafterSpec] = {spec.name: spec for spec in (
    DrafterSpec("prompt-lookup", "n-gram match over the context (no model)",
                LOOKUP_DRAFT_LEN, LOOKUP_ADAPTIVE_DRAFT_LEN, False,
                DrafterCapabilities(wants_hidden=False, samples=False)),
    DrafterSpec("suffix", "suffix trees over the request and previous outputs (no model)",
                SUFFIX_DRAFT_LEN, SUFFIX_ADAPTIVE_DRAFT_LEN, False, _SUFFIX_CAPS),
    DrafterSpec("suffix+lookup", "suffix decoding, extended by prompt lookup's longer copies",
                SUFFIX_DRAFT_LEN, SUFFIX_ADAPTIVE_DRAFT_LEN, False, _SUFFIX_CAPS),
    DrafterSpec("eagle", "EAGLE head over the target's hidden states",
                EAGLE_MAX_DRAFT_LEN, EAGLE_MAX_DRAFT_LEN, True, _EAGLE_CAPS),
    DrafterSpec("eagle+lookup", "prompt lookup when it matches, EAGLE otherwise",
                EAGLE_MAX_DRAFT_LEN, EAGLE_MAX_DRAFT_LEN, True, _EAGLE_CAPS),
    DrafterSpec("eagle3", "EAGLE-3 head over three target layers",
                EAGLE_MAX_DRAFT_LEN, EAGLE_MAX_DRAFT_LEN, True, _EAGLE3_CAPS),
    DrafterSpec("eagle3+suffix", "suffix decoding when it drafts, EAGLE-3 otherwise",
                EAGLE_MAX_DRAFT_LEN, EAGLE_MAX_DRAFT_LEN, True, _EAGLE3_SUFFIX_CAPS),
    DrafterSpec("none", "plain decoding, one token per forward", None, None, False, None),
)}

#: Every name `build_drafter` accepts ("none" builds no drafter).
DRAFTERS: tuple[str, ...] = tuple(REGISTRY)

#: The names a drafter worker can serve (all but "none").
SERVED_DRAFTERS: tuple[str, ...] = tuple(n for n, s in REGISTRY.items() if s.draft_len)


def drafter_spec(name: str) -> DrafterSpec:
    """The registered `DrafterSpec` of ``name``.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown drafter {name!r}; choices: {', '.join(DRAFTERS)}") from None


def default_draft_len(name: str, adaptive: bool = False) -> int | None:
    """``name``'s default most drafts per step: its adaptive cap when ``adaptive``, else its
    fixed length; None for "none". Raises ValueError for an unknown name."""
    spec = drafter_spec(name)
    return spec.adaptive_draft_len if adaptive else spec.draft_len


def check_drafter(name: str, ngram_size: int = DEFAULT_NGRAM_SIZE,
                  max_draft_len: int | None = None, drafter_path: str | None = None,
                  suffix_cache_requests: int | None = None, target_config=None) -> None:
    """Validates `build_drafter`'s arguments without loading any weights (what a service
    checks before starting workers).

    Args:
        target_config: the target's `target_worker.ModelConfig`, when known: an EAGLE-3
            head must fit it (`drafter_worker.eagle3.check_fits`: width, vocabulary, layer
            ids), so a misfit is refused before any worker starts rather than by the worker.

    Raises:
        ValueError: an unknown name, invalid sizes, or a head path for a drafter that has no
            head ("none" accepts and ignores everything); for the EAGLE-3 drafters a head
            config or (safetensors) tensor `drafter_worker.eagle3.inspect_eagle3` refuses,
            or a head that does not fit ``target_config`` (naming the field and both values).
        FileNotFoundError: a missing head file or directory.
    """
    spec = drafter_spec(name)
    if spec.draft_len is None:  # "none": nothing to build, the other arguments are unused
        return
    if drafter_path is not None and not spec.has_head:
        raise ValueError(f"drafter_path={drafter_path!r} is for the EAGLE drafters; "
                         f"drafter {name!r} has no head")
    PromptLookupSpeculator(ngram_size=ngram_size,
                           max_draft_len=LOOKUP_DRAFT_LEN if max_draft_len is None
                           else max_draft_len)
    if suffix_cache_requests is not None:
        if name not in CACHE_DRAFTERS:
            raise ValueError(f"suffix_cache_requests: only the suffix drafters keep a "
                             f"cache; drafter {name!r} keeps none")
        _check_cache_requests(suffix_cache_requests)
    if name in EAGLE3_DRAFTERS:
        from .head_check import check_eagle3_head

        # Opened, every tensor read and checked, and the fit to the target when it is
        # given: a bad head is one line here, before Ray, never an actor's traceback.
        check_eagle3_head(drafter_path, target_config)
    elif spec.has_head:
        from .eagle import DEFAULT_HEAD
        from .head_check import check_eagle_head

        check_eagle_head(DEFAULT_HEAD if drafter_path is None else drafter_path)


def build_drafter(name: str, ngram_size: int = DEFAULT_NGRAM_SIZE,
                  max_draft_len: int | None = None, *, model: str | None = None, target=None,
                  drafter_path: str | None = None, stop_token_ids=(),
                  min_confidence: float | None = None,
                  suffix_cache_requests: int | None = None) -> Drafter | None:
    """Builds a drafter by name.

    Args:
        name: one of `DRAFTERS`: "prompt-lookup" (`PromptLookupSpeculator`), "eagle"
            (`drafter_worker.eagle.EagleDrafter`), "eagle+lookup" (prompt lookup when it
            matches, EAGLE otherwise: `drafter_worker.eagle.LookupThenEagle`) or "none"
            (returns None: plain decoding), "suffix" (`drafter_worker.suffix.SuffixDrafter`)
            or "suffix+lookup" (the same with a `PromptLookupSpeculator` extending its drafts),
            "eagle3" (`drafter_worker.eagle3.Eagle3Drafter`) or "eagle3+suffix" (suffix
            decoding when it drafts, EAGLE-3 otherwise: `drafter_worker.eagle3.SuffixThenEagle3`;
            its suffix part defaults to `SUFFIX_DRAFT_LEN`).
        ngram_size: the n-gram length prompt lookup matches.
        max_draft_len: the most tokens one proposal drafts (default: the spec's
            ``draft_len``; eagle+lookup's lookup part defaults to `LOOKUP_DRAFT_LEN`).
        model: the target the EAGLE head drafts for (a ``.gguf`` path or None for the
            default model); only its embedding table and LM head are used.
        target: an already loaded `target_worker.Decoder` to share those weights with
            (instead of loading ``model``).
        drafter_path: an EAGLE head file (default: the head shipped for SmolLM2); for the
            EAGLE-3 drafters a head directory or a file inside one (default
            `drafter_worker.eagle3.DEFAULT_EAGLE3_HEAD`).
        stop_token_ids: a drafted stop token ends an EAGLE block.
        min_confidence: EAGLE's dynamic draft length threshold (`EagleDrafter`; default
            `EAGLE_MIN_CONFIDENCE`, 0 turns it off).
        suffix_cache_requests: the suffix drafters' (and eagle3+suffix's) global cache size
            in previous outputs,
            over all partitions and in each (default
            `drafter_worker.suffix.DEFAULT_CACHE_REQUESTS`; 0 keeps none: suffix drafting
            within each request only).

    Raises:
        ValueError: an unknown name (the message lists the choices), or sizes the drafter
            rejects, or a head that does not fit the target.
        FileNotFoundError: a missing head or model file.
    """
    spec = drafter_spec(name)
    if spec.draft_len is None:
        return None
    k = spec.draft_len if max_draft_len is None else max_draft_len
    if name in SUFFIX_DRAFTERS:
        return _suffix(name, ngram_size, k, suffix_cache_requests)
    if not spec.has_head:
        return PromptLookupSpeculator(ngram_size=ngram_size, max_draft_len=k)
    conf = EAGLE_MIN_CONFIDENCE if min_confidence is None else min_confidence
    if name in EAGLE3_DRAFTERS:
        return _eagle3(name, k, max_draft_len, model, target, drafter_path, stop_token_ids,
                       conf, suffix_cache_requests)
    from .eagle import EagleDrafter, LookupThenEagle

    if target is None:
        eagle = EagleDrafter.for_model(model, drafter_path, max_draft_len=k,
                                       stop_token_ids=stop_token_ids, min_confidence=conf)
    else:
        eagle = EagleDrafter.for_target(target, drafter_path, max_draft_len=k,
                                        stop_token_ids=stop_token_ids, min_confidence=conf)
    if name == "eagle":
        return eagle
    lookup_len = LOOKUP_DRAFT_LEN if max_draft_len is None else max_draft_len
    return LookupThenEagle(PromptLookupSpeculator(ngram_size, lookup_len), eagle)


#: The drafters with a cross-request cache (suffix decoding).
SUFFIX_DRAFTERS: tuple[str, ...] = ("suffix", "suffix+lookup")

#: The drafters that load an EAGLE-3 head (`drafter_worker.eagle3`).
EAGLE3_DRAFTERS: tuple[str, ...] = ("eagle3", "eagle3+suffix")

#: The drafters ``suffix_cache_requests`` applies to (a suffix drafter inside).
CACHE_DRAFTERS: tuple[str, ...] = (*SUFFIX_DRAFTERS, "eagle3+suffix")


def _eagle3(name: str, k: int, max_draft_len: int | None, model, target, drafter_path,
            stop_token_ids, min_confidence: float, cache_requests: int | None) -> Drafter:
    """An `drafter_worker.eagle3.Eagle3Drafter` (``eagle3``), or one behind suffix decoding
    (``eagle3+suffix``: `drafter_worker.eagle3.SuffixThenEagle3`)."""
    from .eagle3 import Eagle3Drafter, SuffixThenEagle3

    kwargs = dict(max_draft_len=k, stop_token_ids=stop_token_ids,
                  min_confidence=min_confidence)
    eagle = (Eagle3Drafter.for_model(model, drafter_path, **kwargs) if target is None
             else Eagle3Drafter.for_target(target, drafter_path, **kwargs))
    if name == "eagle3":
        return eagle
    suffix_len = SUFFIX_DRAFT_LEN if max_draft_len is None else max_draft_len
    return SuffixThenEagle3(_suffix("suffix", DEFAULT_NGRAM_SIZE, suffix_len, cache_requests),
                            eagle)


def _check_cache_requests(value) -> None:
    """Raises ValueError unless ``value`` is an int >= 0 (``--suffix-cache-requests``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"suffix_cache_requests must be an int >= 0 (0: draft from each "
                         f"request's own context only, keep nothing across requests), got "
                         f"{value!r}")


def _suffix(name: str, ngram_size: int, max_draft_len: int,
            cache_requests: int | None, **kwargs) -> Drafter:
    if cache_requests is not None:
        _check_cache_requests(cache_requests)
    lookup = None if name == "suffix" else PromptLookupSpeculator(ngram_size, max_draft_len)
    return SuffixDrafter(max_draft_len=max_draft_len,
                         cache_requests=DEFAULT_CACHE_REQUESTS if cache_requests is None
                         else cache_requests, lookup=lookup, **kwargs)
