"""Grammar masks, the matcher's block plans, and the rule on masked rows (`specd_core.grammar`),
without a model: the tiny test tokenizer (id i spells one letter) and synthetic target logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd_core.draft import DraftBlock, DraftDist
from specd_core.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    apply_token_bitmask,
    bitmask_allows,
    bitmask_width,
)
from specd_core.request import DecodeRequest, SpeculativeOptions
from specd_core.rule import target_rows
from specd_core.sampling import Sampler, SamplingParams
from target_worker.testing import TinyTokenizer

VOCAB = 8  # ids 1..7 spell "B".."H"; 0 is EOS
B, C, D, E, F, G, H = range(1, 8)
EOS = 0


def compiled(kind, value, vocab=VOCAB, **kw):
    return GrammarCompiler(TinyTokenizer(vocab), vocab).compile(GrammarSpec(kind, value, **kw))


def allowed(mask, vocab=VOCAB):
    return [t for t in range(vocab) if bitmask_allows(mask, t)]


def test_apply_token_bitmask_masks_forbidden_tokens_and_the_padded_tail():
    vocab = 40  # two words: bits 32..39 of the second, its padding bits ignored
    logits = torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab)
    mask = np.zeros((3, bitmask_width(vocab)), dtype=np.int32)
    mask[0, 0] = 0b101          # tokens 0 and 2
    mask[0, 1] = 1 << 7         # token 39
    mask[1] = -1                # all allowed: unchanged
    mask[2] = 0                 # allows nothing: left as is (never a NaN row)
    out = apply_token_bitmask(logits, mask)
    assert torch.isfinite(out[0]).tolist() == [t in (0, 2, 39) for t in range(vocab)]
    assert torch.equal(out[1:], logits[1:])
    assert torch.equal(logits, torch.arange(3 * vocab, dtype=torch.float32).reshape(3, vocab))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, mask[:, :1])


def test_masks_are_as_wide_as_the_logits_and_never_allow_padded_ids():
    # A model whose logits are wider than its tokenizer (padded vocabulary): 70 columns.
    grammar = compiled("regex", "[B-H]+", vocab=70)
    m = grammar.matcher()
    row = m.mask()
    assert row.shape == (bitmask_width(70),) and row.dtype == np.int32
    ok = allowed(row, 70)
    assert set(range(1, 8)) <= set(ok)
    assert all(TinyTokenizer(70).decode([t]) in "BCDEFGH" for t in ok)


def test_eos_is_allowed_only_where_the_grammar_accepts():
    m = compiled("choice", ["BC", "BCD"]).matcher()
    assert allowed(m.mask()) == [B]
    m.commit(B)
    assert allowed(m.mask()) == [C]
    m.commit(C)
    assert allowed(m.mask()) == [EOS, D]  # "BC" is complete, "BCD" may go on
    m.commit(D)
    assert allowed(m.mask()) == [EOS]
    m.commit(EOS)
    assert m.stopped


def test_commit_refuses_a_token_the_grammar_forbids():
    m = compiled("regex", "B+").matcher()
    with pytest.raises(GrammarError, match="does not fit"):
        m.commit(C)


def test_block_masks_follow_the_drafts_and_leave_the_committed_state_alone():
    m = compiled("regex", "(BC|BD|E)F").matcher()
    masks = m.block_masks([B, D, F])
    assert [allowed(r) for r in masks] == [[B, E], [C, D], [F], [EOS]]
    # A refused draft: rows after it are all ones (never reached by the rule).
    masks = m.block_masks([B, F, C])
    assert allowed(masks[0]) == [B, E] and allowed(masks[1]) == [C, D]
    assert (masks[2:] == -1).all()
    assert allowed(m.mask()) == [B, E]  # unchanged


def test_the_grammar_drafts_forced_tokens_and_keeps_a_refused_drafter_token_for_the_rule():
    m = compiled("regex", "BCD[EF]G[BC]").matcher()
    # Nothing proposed: the forced prefix B C D is the block.
    plan = m.draft(DraftBlock.empty(), budget=8)
    assert plan.block.tokens == (B, C, D) and plan.forced == [True] * 3
    assert [allowed(r) for r in plan.masks] == [[B], [C], [D], [E, F]]
    # The drafter agrees with the forced tokens: its block goes on after them.
    proposal = DraftBlock.deterministic([B, C, D, F, G, H])
    plan = m.draft(proposal, budget=8)
    assert plan.block.tokens == (B, C, D, F, G, H)
    assert plan.forced == [True, True, True, False, True, False]
    assert plan.invalid == 5 and plan.masks.shape == (7, 1)
    # It disagrees: its later tokens were drawn for another prefix, so they are dropped.
    plan = m.draft(DraftBlock.deterministic([C, C, C]), budget=8)
    assert plan.block.tokens == (B, C, D) and plan.invalid is None
    # The budget caps the block; the committed state never moves.
    assert m.draft(proposal, budget=2).block.tokens == (B, C)
    assert allowed(m.mask()) == [B]


def test_an_invalid_pattern_error_says_what_is_wrong_with_it():
    # llguidance reports a regex error over several lines (a caret drawing, then the
    # reason): the one-line message keeps the reason.
    with pytest.raises(GrammarError, match="regex parse error: unclosed character class$"):
        compiled("regex", "([")
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(["}}}
    with pytest.raises(GrammarError, match="^response_format: unsupported json schema: "
                                           "regex parse error: unclosed character class$"):
        compiled("json_schema", schema)


def test_a_constraint_that_allows_nothing_fails_with_a_clear_error():
    with pytest.raises(GrammarError, match="regex"):
        compiled("regex", "(B")
    with pytest.raises(GrammarError, match="unknown constraint"):
        GrammarSpec("xml", "x")
    with pytest.raises(GrammarError, match="choice needs"):
        GrammarSpec("choice", [])
    # A choice none of whose strings this tokenizer can spell: refused when compiled (at
    # admission), never left to fail at the first step.
    with pytest.raises(GrammarError, match="^response_format: this model's tokenizer cannot "
                                           "spell the start of any output the choice allows"):
        compiled("choice", ["xyz!"])


ASCII_VOCAB = 128  # TinyTokenizer(128, ascii=True): ids 1..95 spell printable ASCII


def ascii_compiled(kind, value, **kw):
    return GrammarCompiler(TinyTokenizer(ASCII_VOCAB, ascii=True), ASCII_VOCAB).compile(
        GrammarSpec(kind, value, **kw))


@pytest.mark.parametrize("kind,value,reason", [
    # A counted repetition whose automaton explodes: the lexer's limit, at the first step.
    ("regex", "y{300000}", "the regex is beyond the matcher's limits: lexer error"),
    ("regex", "y{2000000}", "the regex is beyond the matcher's limits: lexer error"),
    # A required property that is the object itself: no finite document.
    ("json_schema", {"$defs": {"n": {"type": "object", "required": ["next"],
                                     "properties": {"next": {"$ref": "#/$defs/n"}}}},
                     "$ref": "#/$defs/n"}, "the JSON schema admits no finite output"),
    # A rule that only recurses: a dead end.
    ("lark", 'start: "a" b\nb: "b" b', "the grammar admits no finite output"),
])
def test_constraints_that_cannot_be_generated_are_refused_when_compiled(kind, value, reason):
    with pytest.raises(GrammarError) as info:
        ascii_compiled(kind, value, field="constraint")
    assert str(info.value).startswith(f"constraint: {reason}")
    assert info.value.field == "constraint"


def test_a_tokenizer_that_cannot_spell_json_is_refused_when_compiled():
    # The plain tiny tokenizer spells only letters: no '{', so no JSON at all. Before,
    # its greedy encoder skipped the '{' and llguidance forced a letter the grammar then
    # refused mid-stream ("token 32 does not fit").
    for kind, value in [("json_schema", {"type": "object", "required": ["a"],
                                         "properties": {"a": {"type": "integer"}}}),
                        ("json_object", None)]:
        with pytest.raises(GrammarError, match="tokenizer cannot spell the start"):
            GrammarCompiler(TinyTokenizer(512), 512).compile(GrammarSpec(kind, value))


def test_every_token_a_mask_allows_is_one_the_matcher_commits():
    # Walks outputs by always taking the highest allowed id, then the lowest: each token
    # a row allows must be accepted by commit (a mask that lets through a token the
    # commit refuses is the bug behind mid-stream "does not fit" errors).
    schema = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
              "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}}}
    for spec in [("json_schema", schema), ("json_object", None), ("regex", "y{3000}"),
                 ("choice", ["ab", "abc", "b"])]:
        grammar = ascii_compiled(*spec)
        for pick in (max, min):
            m = grammar.matcher()
            for _ in range(200):
                ids = [t for t in allowed(m.mask(), ASCII_VOCAB) if t != EOS]
                if not ids:
                    break
                m.commit(pick(ids))


def test_a_constraint_too_large_is_refused_before_compiling():
    huge = {"enum": ["x" * 100 + str(i) for i in range(3000)]}
    with pytest.raises(GrammarError, match="response_format: the constraint is over"):
        compiled("json_schema", huge)


def test_the_compiler_caches_by_constraint_and_is_bounded():
    comp = GrammarCompiler(TinyTokenizer(VOCAB), VOCAB, max_entries=2)
    a = comp.compile(GrammarSpec("regex", "B+"))
    assert comp.compile(GrammarSpec("regex", "B+")) is a and comp.hits == 1
    comp.compile(GrammarSpec("regex", "C+"))
    comp.compile(GrammarSpec("regex", "D+"))
    assert comp.compile(GrammarSpec("regex", "B+")) is not a  # evicted, compiled anew
    assert comp.compiled == 4


def test_json_whitespace_is_capped_by_default():
    # The default separators leave no free whitespace: a model cannot loop on spaces.
    from llguidance import LLMatcher

    g = GrammarSpec("json_object").llguidance_grammar()
    assert '"whitespace_flexible":false' in g.replace(" ", "")
    assert LLMatcher.validate_grammar(g) == ""


# ---- the rule on masked rows ----

P = torch.tensor([0.05, 0.2, 0.2, 0.4, 0.05, 0.05, 0.03, 0.02])  # the target, before masking


def _verify_once(grammar, draft: DraftBlock, seed: int, logits: torch.Tensor,
                 cut: bool = False) -> int:
    """One step of a request: the first committed token. ``cut``: vLLM's shortcut (the
    block cut before its first refused token, the next token drawn from the masked row)."""
    decode = DecodeRequest([B], SpeculativeOptions(max_new_tokens=4, seed=seed,
                                                   sampling=SamplingParams(temperature=1.0),
                                                   grammar=grammar))
    decode.pending = B  # the anchor: decoding starts with an empty grammar state
    decode.grammar = grammar.matcher()
    if cut:
        ok = 0
        masks = decode.grammar.block_masks(draft.tokens)
        while ok < len(draft) and bitmask_allows(masks[ok], draft.tokens[ok]):
            ok += 1
        draft = DraftBlock(draft.tokens[:ok], draft.dists[:ok])
    block, masks = decode.plan_block(draft, force=False)
    n = len(block) + 1
    rows = target_rows(apply_token_bitmask(logits[:n], masks), decode.sampling, [B], 1,
                       block.tokens)
    decode.on_verify(block, rows)
    return decode.generated[0]


def test_a_refused_sampled_draft_is_a_rejection_and_cutting_the_block_is_biased():
    # The counter-example of the notes: p' = (.5, .5) on {B, C} ("[BC]"), q = .5 on B and .5
    # on D, which the grammar refuses. Exact: B and C with .5 each. Cutting the block at D
    # and drawing from p' gives B .5 + .5 * .5 = .75.
    grammar = compiled("regex", "[BC][B-H]")
    logits = torch.log(P).expand(3, -1).clone()
    q = DraftDist.from_support([(B, 0.5), (D, 0.5)])
    trials = 4000
    draws = Sampler(123)
    got = {"rule": np.zeros(VOCAB), "cut": np.zeros(VOCAB)}
    for seed in range(trials):
        token = B if draws.uniform() < 0.5 else D
        block = DraftBlock([token], [q])
        got["rule"][_verify_once(grammar, block, seed, logits)] += 1
        got["cut"][_verify_once(grammar, block, seed, logits, cut=True)] += 1
    exact = np.zeros(VOCAB)
    exact[[B, C]] = 0.5
    tol = 4 * np.sqrt(0.25 / trials)  # four binomial sigmas on a frequency of .5
    rule, cut = got["rule"] / trials, got["cut"] / trials
    assert abs(rule[B] - 0.5) < tol and rule[B] + rule[C] == 1.0, rule
    assert abs(cut[B] - 0.75) < tol and cut[B] - 0.5 > 5 * tol, cut


def test_a_forbidden_point_mass_draft_is_replaced_by_a_draw_from_the_masked_row():
    # Prompt lookup's coupled form: the draw comes from p' exactly as plain decoding draws it.
    grammar = compiled("regex", "[BC][B-H]")
    logits = torch.log(P).expand(3, -1).clone()
    for seed in range(50):
        plain = Sampler(seed).sample_from(torch.tensor([0, 0.5, 0.5, 0, 0, 0, 0, 0]))
        assert _verify_once(grammar, DraftBlock.deterministic([D, E]), seed, logits) == plain


def test_refusals_are_cached_and_name_the_field_they_came_in():
    comp = GrammarCompiler(TinyTokenizer(ASCII_VOCAB, ascii=True), ASCII_VOCAB)
    with pytest.raises(GrammarError, match="^response_format: the regex is beyond"):
        comp.compile(GrammarSpec("regex", "y{300000}"))
    with pytest.raises(GrammarError, match="^constraint: the regex is beyond"):
        comp.compile(GrammarSpec("regex", "y{300000}", field="constraint"))
    assert comp.refused_hits == 1 and comp.compiled == 0
