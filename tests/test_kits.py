"""The test kits on the built-in components, and the kits failing on broken ones.

``SourceLosslessnessKit`` on ``pld`` (the kit's default policy and ``spine``) and ``tr`` (a successor
source, under ``spine``; ``tr-tree`` in tests/test_tr.py, ``suffix`` in tests/test_suffix.py); ``PolicyLosslessnessKit`` on ``spine``, ``iso3``,
``chain``, ``spine-fit`` and ``tr-tree``; a source with bad successors, a successor source under the
kit's default policy, and tree policies that break the rules, each failing the kit.
"""

from __future__ import annotations

import math

import pytest

import goose
from goose.testing import (
    ArbitrarySuccessorSource,
    PolicyLosslessnessKit,
    SourceLosslessnessKit,
    echo_prompt,
    reference_greedy,
)
from goose.testing.kit import _kit_sources


@pytest.fixture
def no_shrinking():
    """Hypothesis without its shrink and explain phases, for tests that expect a kit's property to fail:
    the first failing example is enough (the kit's own @settings start from the profile loaded now)."""
    from hypothesis import Phase, settings

    settings.register_profile("kits-before", parent=settings.default)
    settings.register_profile("kits-no-shrinking", parent=settings.default,
                              phases=[Phase.explicit, Phase.reuse, Phase.generate])
    settings.load_profile("kits-no-shrinking")
    yield
    settings.load_profile("kits-before")


# -- the source kit on the built-in sources ------------------------------------------------------
class TestPLDKit(SourceLosslessnessKit):
    max_examples = 12

    def make_source(self):
        return "pld"


class TestPLDKitSpine(SourceLosslessnessKit):
    policy = "spine"
    extra_sources = ("tr",)
    max_examples = 12

    def make_source(self):
        return "pld"


class TestTRKitSpine(SourceLosslessnessKit):
    policy = "spine"
    max_examples = 12

    def make_source(self):
        return "tr"


# tr under tr-tree and suffix under the kit's default policy: tests/test_tr.py, tests/test_suffix.py


@pytest.mark.parametrize("vocab", [2, 16, 50, 1000])
def test_echo_prompt_holds_its_continuation(vocab):
    """The source kit's drafting prompt: its greedy continuation is written at its start, so at every
    step the last 3 committed tokens (pld's shortest n-gram) occurred earlier, followed by the next one."""
    prompt = echo_prompt(vocab, 30)
    cont = reference_greedy(prompt, 30, vocab)
    for s in range(30):  # after the prompt and s + 1 generated tokens
        text = prompt + cont[: s + 1]
        tail = text[-3:]
        assert any(text[i : i + 3] == tail for i in range(len(text) - 3)), s


def test_pld_proposes_at_every_step_on_the_echo_prompt():
    from goose.testing import ToyCausalLM

    calls, props = [], []
    dec = goose.compose(ToyCausalLM(16), None, sources=["pld"], policy="proposal", budget=4)
    src = dec._idle[0].sources[0]
    propose = src.propose

    def spied(state):
        calls.append(state.step)
        p = propose(state)
        props.append(p is not None)
        return p

    src.propose = spied
    prompt = echo_prompt(16, 30)
    out = dec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == reference_greedy(prompt, 30, 16)
    assert calls and all(props), f"pld proposed at {sum(props)} of {len(props)} steps"
    assert out.stats.per_source["pld"]["accepted"] == out.stats.per_source["pld"]["drafted"] > 0


# -- the source kit failing ----------------------------------------------------------------------
class _Successors(goose.DraftSource):
    """A successor source whose successors are ``ids`` / ``scores`` after any token."""

    name = "bad-successors"
    provides_successors = True
    ids: tuple = (1, 2)
    scores: tuple = (0.5, 0.25)

    def propose(self, state):
        return None

    def successors(self, token, prev):
        return list(self.ids), list(self.scores)


class _FloatIds(_Successors):
    ids = (1.0, 2.0)


class _NaNScores(_Successors):
    scores = (0.5, math.nan)


class _InfScores(_Successors):
    scores = (math.inf, 0.5)


@pytest.mark.parametrize("source,match", [
    (_FloatIds, "not an integer token id"),
    (_NaNScores, "not a finite number"),
    (_InfScores, "not a finite number"),
])
@pytest.mark.parametrize("test", ["test_proposals_are_drafted_and_valid", "test_lossless_on_toy"])
def test_the_source_kit_fails_bad_successors(source, match, test, no_shrinking):
    class Kit(SourceLosslessnessKit):
        policy = "spine"
        max_examples = 3

        def make_source(self):
            return source()

    with pytest.raises(goose.DraftSourceError, match=match):
        getattr(Kit(), test)()


def test_the_source_kit_accepts_scores_beyond_one():
    """Successor scores are weights (any finite number, as the loop takes them), not only probabilities."""

    class Kit(SourceLosslessnessKit):
        policy = "spine"
        max_examples = 3

        def make_source(self):
            src = _Successors()
            src.scores = (3.0, -1.0)
            return src

    Kit().test_proposals_are_drafted_and_valid()


@pytest.mark.parametrize("test", ["test_lossless_on_toy", "test_proposals_are_drafted_and_valid"])
def test_the_source_kit_says_a_successor_source_needs_a_tree_policy(test):
    class Kit(SourceLosslessnessKit):
        max_examples = 3

        def make_source(self):
            return "tr"

    with pytest.raises(AssertionError, match='needs a tree policy: set policy = "spine"'):
        getattr(Kit(), test)()


# -- the policy kit on the built-in policies -----------------------------------------------------
class TestSpinePolicyKit(PolicyLosslessnessKit):
    max_examples = 12

    def make_policy(self):
        return "spine"


class TestIso3PolicyKit(PolicyLosslessnessKit):
    max_examples = 12

    def make_policy(self):
        return "iso3"


class TestChainPolicyKit(PolicyLosslessnessKit):
    max_examples = 12

    def make_policy(self):
        return "chain"


class TestSpineFitPolicyKit(PolicyLosslessnessKit):
    policy_options = {"latency": {1: 1.0, 128: 1.0}}  # a flat measured latency: no calibration
    max_examples = 12

    def make_policy(self):
        return "spine-fit"


class TestTRTreePolicyKit(PolicyLosslessnessKit):
    required_kinds = ("successors",)  # it fills its tree from a successor table
    max_examples = 12

    def make_policy(self):
        return "tr-tree"


def test_the_kit_successor_source_drafts_the_toys_tokens():
    """ArbitrarySuccessorSource at p_oracle=1 gives the toy's next token after the anchor, and after each
    node on the greedy continuation: tr-tree accepts its whole tree line."""
    from goose.testing import ToyCausalLM

    src = ArbitrarySuccessorSource(ArbitrarySuccessorSource.Options(seed=3, p_oracle=1.0, max_k=2))
    dec = goose.compose(ToyCausalLM(16), None, sources=[src], policy=("tr-tree", {"widths": (2, 2, 2, 2)}), budget=9)
    prompt = [3, 1, 4, 1, 5]
    out = dec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == reference_greedy(prompt, 30, 16)
    assert out.stats.forward_passes < 12


# -- the policy kit failing ------------------------------------------------------------------------
class _Broken(goose.TreePolicy):
    """Verifies the first proposal as a chain, broken one way or another by ``how``."""

    name = "broken"
    how = ""

    def shape(self, ctx):
        chain = []
        for prop in ctx.proposals().values():
            chain = list(prop.tokens[: ctx.budget - 1])
            break
        succ, _, src = ctx.successors(ctx.state.anchor, ctx.state.prev_anchor)
        if not chain and len(succ) and ctx.budget > 1:
            chain = [succ[0]]
        if not chain:
            return None
        root = ctx.state.anchor
        if self.how == "over-budget":  # one node too many
            chain = chain + [t for t in range(ctx.vocab_size) if t != chain[-1]][: ctx.budget + 1 - len(chain)]
        if self.how == "root":
            root = (root + 1) % ctx.vocab_size
        credit = {"ghost": "ghost", "uncredited": "arbitrary-successors"}.get(self.how)
        sources = None if credit is None else ((),) + ((credit,),) * len(chain)
        return goose.DraftTree.build([root, *chain], list(range(-1, len(chain))), "broken", sources=sources)


@pytest.mark.parametrize("how,match", [
    ("over-budget", r"over policy.max_nodes"),
    ("root", r"not the anchor"),
    ("ghost", r"credited to 'ghost', not a composed source"),
    ("uncredited", r"credited to 'arbitrary-successors', which did not draft it"),
])
def test_the_policy_kit_fails_a_broken_policy(how, match, no_shrinking):
    class Kit(PolicyLosslessnessKit):
        source_kinds = ("chain", "tree")
        required_kinds = ("successors",) if how == "uncredited" else ()
        max_examples = 10

        def make_policy(self):
            p = _Broken()
            p.how = how
            return p

    with pytest.raises(AssertionError, match=match):
        Kit().test_trees_within_budget_and_valid()
    with pytest.raises(AssertionError, match=match):
        Kit().test_lossless_on_toy()


class _Never(goose.TreePolicy):
    name = "never"

    def shape(self, ctx):
        return None


def test_the_policy_kit_fails_a_policy_that_never_drafts():
    class Kit(PolicyLosslessnessKit):
        def make_policy(self):
            return _Never()

    with pytest.raises(AssertionError, match="never returned a tree of more than the anchor"):
        Kit().test_drafts_from_right_sources()

    class Allowed(Kit):
        require_drafts = False

    Allowed().test_drafts_from_right_sources()


def test_the_policy_kit_sources_compose():
    assert [s.name for s in _kit_sources((("successors", 1, 0.5, 0.0), ("chain", 2, 1.0, 1.0), ("tree", 3, 0.3, 0.5)))] \
        == ["arbitrary-successors", "arbitrary-chain", "arbitrary"]
