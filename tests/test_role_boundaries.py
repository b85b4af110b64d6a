"""Every role's boundary (issue 38, points 4 and 6): successors checked as they leave their source, every
component's end() run, a bad tree blamed on its policy, strict integer options, every composed source in
stats.per_source, and a verifier that wraps another keeping the deferred prefill rows."""

from __future__ import annotations

import math

import pytest

import goose
from goose.errors import InvalidTreeError
from goose.testing import ToyCausalLM, ToySplitLM, reference_greedy

V = 16
PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


class Succ(goose.DraftSource):
    """A successor source whose rows ``row(token)`` builds."""

    name = "succ"
    provides_successors = True

    def __init__(self, row, options=None):
        super().__init__(options)
        self.row = row

    def propose(self, state):
        return None

    def successors(self, token, prev):
        return self.row(token)


# -- successors() output ---------------------------------------------------------------------------
BAD_ROWS = {
    "more ids than scores": (lambda t: ([1, 2, 3], [0.5, 0.4]), r"3 ids but 2 scores"),
    "a float id": (lambda t: ([1, 2.0], [0.5, 0.4]), r"id 2.0 \(float\) at position 1, not an integer token id"),
    "an id outside the vocabulary": (lambda t: ([1, V + 2], [0.5, 0.4]), rf"token id {V + 2}, outside the vocabulary \[0, {V}\)"),
    "a negative id": (lambda t: ([-1, 2], [0.5, 0.4]), r"token id -1, outside the vocabulary"),
    "a repeated id": (lambda t: ([3, 3], [0.5, 0.4]), r"a repeated id in \[3, 3\]"),
    "a NaN score": (lambda t: ([1, 2], [0.5, math.nan]), r"score nan at position 1, not a finite number"),
    "a bool score": (lambda t: ([1, 2], [True, 0.4]), r"score True at position 0"),
}


@pytest.mark.parametrize("policy", ["spine", "iso3", "tr-tree"])
@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_successors_are_refused_naming_the_source(case, policy):
    row, msg = BAD_ROWS[case]
    dec = goose.compose(ToyCausalLM(V), None, sources=[Succ(row)], policy=policy, budget=12)
    with pytest.raises(goose.DraftSourceError, match=r"Draft source 'succ' failed: successors\(\d+, \.\.\.\) returned .*" + msg):
        dec.generate(PROMPT, max_new_tokens=8)
    # the decoder still works with a good source
    good = goose.compose(ToyCausalLM(V), None, sources=[Succ(lambda t: ([(t + 1) % V, (t + 2) % V], [0.6, 0.3]))],
                         policy=policy, budget=12)
    assert good.generate(PROMPT, max_new_tokens=8).token_ids == reference_greedy(PROMPT, 8, V)


def test_numpy_successor_ids_are_taken_as_ints():
    import numpy as np

    dec = goose.compose(ToyCausalLM(V), None, sources=[Succ(lambda t: (np.array([(t + 1) % V, (t + 3) % V]), [0.6, 0.3]))],
                        policy="spine", budget=12)
    assert dec.generate(PROMPT, max_new_tokens=8).token_ids == reference_greedy(PROMPT, 8, V)


# -- end(): every component's runs ---------------------------------------------------------------
class Ending(goose.DraftSource):
    def __init__(self, name, fail=False):
        super().__init__()
        self.name, self.fail, self.ended = name, fail, 0

    def propose(self, state):
        return None

    def end(self, output):
        self.ended += 1
        if self.fail:
            raise RuntimeError(f"{self.name} could not save")


class EndingPolicy(goose.TreePolicy):
    name = "ending-chain"
    ended = 0

    def shape(self, ctx):
        return None

    def end(self, output):
        type(self).ended += 1


def test_every_end_runs_when_one_raises_and_the_first_error_names_its_source():
    EndingPolicy.ended = 0
    a, b, c = Ending("a", fail=True), Ending("b", fail=True), Ending("c")
    seen = []

    class Observer:
        @goose.hookimpl
        def goose_on_generation_end(self, decoder, output):
            seen.append(output)

    goose.register_plugin(Observer(), name="end-observer")
    dec = goose.compose(ToyCausalLM(V), None, sources=[a, b, c], policy=EndingPolicy())
    with pytest.raises(goose.DraftSourceError, match=r"Draft source 'a' failed: end\(\) raised RuntimeError: a could not save"):
        dec.generate(PROMPT, max_new_tokens=4)
    assert (a.ended, b.ended, c.ended, EndingPolicy.ended, len(seen)) == (1, 1, 1, 1, 1)
    a.fail = b.fail = False  # the decoder is usable afterwards
    assert dec.generate([5, 6], max_new_tokens=3).token_ids == reference_greedy([5, 6], 3, V)


# -- registration -----------------------------------------------------------------------------------
def test_a_failed_registration_restores_the_left_out_plugins():
    import goose.manager as manager

    manager.get_registry()
    manager._broken["some-plugin"] = "left out earlier"
    before = (dict(manager._broken), dict(manager._origins), manager.get_registry())

    class Clash:
        @goose.hookimpl
        def goose_register_sources(self, register):
            register(type("Dup", (goose.DraftSource,), {"name": "pld", "propose": lambda self, s: None}))

    with pytest.raises(goose.PluginError, match="Duplicate draft source name 'pld'"):
        goose.register_plugin(Clash(), name="clash")
    assert (dict(manager._broken), dict(manager._origins), manager.get_registry()) == before


# -- a policy's bad tree is the policy's ----------------------------------------------------------
class BadTree(goose.TreePolicy):
    name = "bad-tree"
    make = None

    def shape(self, ctx):
        return type(self).make(ctx)


@pytest.mark.parametrize("make,err,msg", [
    (lambda ctx: goose.DraftTree.build([ctx.state.anchor, 1, 2], [-1, 0, 5], "branch"), InvalidTreeError,
     r"Tree policy 'bad-tree' built an invalid tree: node 2: parent"),
    (lambda ctx: goose.DraftTree.build([ctx.state.anchor, 1.0], [-1, 0], "branch"), InvalidTreeError,
     r"Tree policy 'bad-tree' built an invalid tree: node 1: token 1.0 \(float\) is not an integer id"),
    (lambda ctx: [ctx.state.anchor, 1], goose.PluginError, r"Tree policy 'bad-tree' returned list; shape\(\) must return"),
    (lambda ctx: goose.DraftTree.build([ctx.state.anchor, V + 1], [-1, 0], "branch", sources=[(), ("tr",)]),
     goose.PluginError, rf"Tree policy 'bad-tree' returned token id {V + 1} at tree node 1 \(origin 'branch', credited to tr\)"),
])
def test_a_bad_tree_names_the_policy_that_built_it(make, err, msg):
    BadTree.make = staticmethod(make)
    dec = goose.compose(ToyCausalLM(V), None, sources=["pld"], policy=BadTree(), budget=8)
    with pytest.raises(err, match=msg):
        dec.generate(PROMPT, max_new_tokens=6)


def test_draft_tree_build_refuses_non_integer_ids():
    with pytest.raises(InvalidTreeError, match=r"node 1: token True \(bool\) is not an integer id"):
        goose.DraftTree.build([3, True], [-1, 0], "branch")
    with pytest.raises(InvalidTreeError, match=r"node 1: parent 0.0 \(float\)"):
        goose.DraftTree.build([3, 4], [-1, 0.0], "branch")


# -- options -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [True, 3.0, 2.5])
def test_an_integer_option_takes_an_integer_only(value):
    with pytest.raises(goose.InvalidInputError, match=rf"max_depth: Value error, an integer is required, got {value!r}"):
        goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy="iso3", policy_options={"max_depth": value})
    goose.compose(ToyCausalLM(V), None, sources=["pld", ("tr", {"min_score": 0})], policy="iso3",
                  policy_options={"max_depth": 3})  # an int for a float option stays fine


# -- stats.per_source --------------------------------------------------------------------------------
def test_per_source_lists_every_composed_source_with_zeros():
    silent = Ending("silent")
    out = goose.compose(ToyCausalLM(V), None, sources=["pld", "tr", silent], policy="spine").generate(PROMPT, max_new_tokens=12)
    assert out.stats.per_source["silent"] == {"proposed": 0, "drafted": 0, "accepted": 0}
    assert {"pld", "tr", "silent"} <= set(out.stats.per_source)


# -- a verifier that wraps another -------------------------------------------------------------------
class Recording(goose.Verifier):
    """Written from docs/plugins.md: wraps the tree verifier, delegates, records every pass's size."""

    name = "recording"

    def __init__(self, options=None):
        super().__init__(options)
        from goose.verifiers.transformers_tree import TransformersVerifier

        self.inner = TransformersVerifier()
        self.sizes: list[int] = []

    def bind(self, model):
        super().bind(model)
        self.inner.bind(model)

    def check_request(self, prompt_len, max_new_tokens, max_depth):
        self.inner.check_request(prompt_len, max_new_tokens, max_depth)

    def prefill(self, prompt_ids, keep=None):
        return self.inner.prefill(prompt_ids, keep)

    def verify(self, tree):
        self.sizes.append(tree.num_nodes)
        return self.inner.verify(tree)

    def end(self):
        self.inner.end()


def test_a_wrapping_verifier_keeps_the_deferred_prefill_rows():
    prompt = ([3, 8, 13, 2, 7, 12] * 7)[:40]
    plain = goose.compose(ToySplitLM(V), None, sources=["pld", "tr"], policy="spine", budget=24)
    wrapped_v = Recording()
    wrapped = goose.compose(ToySplitLM(V), None, sources=["pld", "tr"], policy="spine", budget=24, verifier=wrapped_v)
    a, b = plain.generate(prompt, max_new_tokens=30), wrapped.generate(prompt, max_new_tokens=30)
    assert a.token_ids == b.token_ids == reference_greedy(prompt, 30, V)
    assert wrapped_v.vocab_size == V and wrapped_v.sizes
    # the sources learned from every deferred prefill row through the wrapper, as without it
    assert b.stats.extra["tr"]["harvested_positions"] == a.stats.extra["tr"]["harvested_positions"] >= 40
    assert b.stats.tau == a.stats.tau
