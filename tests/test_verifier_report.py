"""The loop checks what a verifier reports before anything observes or commits it: the path is a root-to-node
walk of the tree it was sent, the accepted tokens are that walk's tokens, and in a greedy request each is the
argmax of its parent's logit row (the bonus the last node's). A verifier that misreports is a VerifierError
naming it, the node and the value, in greedy and sampled requests, not corrupted output or an error blamed on
the policy."""

import re
from dataclasses import replace

import pytest
import torch

import goose
from goose.sampling import Sampling, build_processors
from goose.testing import ArbitraryTreeSource, ToyCausalLM, ToySplitLM, reference_greedy, reference_sample
from goose.testing.kit import ArbitraryTreeOptions
from goose.verifiers.transformers_tree import TransformersVerifier

from test_verifier_kit import Wrapping

V = 16
PROMPTS = ([3, 8, 13, 2, 7, 12, 3, 8, 13, 2], [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3], [0, 5, 0, 5, 9, 9, 9])


class Misreports(TransformersVerifier):
    """The built-in verifier, its tree passes' reports changed by ``fault(tree, v)`` (None: reported as walked)."""

    name = "misreports"

    def __init__(self, fault):
        super().__init__()
        self.fault = fault
        self.faults = 0

    def verify(self, tree, rule=None):
        v = super().verify(tree, rule)
        bad = self.fault(tree, v)
        if bad is None:
            return v
        self.faults += 1
        return bad


# -- the faults ----------------------------------------------------------------------------------------
def one_token_too_many(tree, v):
    """accepted has a token more than the path has nodes (the loop would commit it)."""
    return replace(v, accepted=(*v.accepted, v.bonus if v.bonus is not None else tree.tokens[0]))


def index_past_the_tree(tree, v):
    """The path goes on to node num_nodes, which is not in the tree."""
    return replace(v, path=(*v.path, tree.num_nodes), accepted=(*v.accepted, 0))


def skips_a_level(tree, v):
    """The path goes from the root straight to a node two levels down."""
    deep = next((i for i, d in enumerate(tree.depths) if d == 2), None)
    return None if deep is None else replace(v, path=(0, deep), accepted=(tree.tokens[deep],))


def jumps_to_a_non_child(tree, v):
    """The path goes on to a node that is not a child of its last node (nor on the path)."""
    last = v.path[-1]
    j = next((i for i in range(1, tree.num_nodes) if tree.parents[i] != last and i not in v.path), None)
    return None if j is None else replace(v, path=(*v.path, j), accepted=(*v.accepted, tree.tokens[j]))


def starts_off_the_root(tree, v):
    return None if tree.num_nodes < 2 else replace(v, path=(1,), accepted=())


def tokens_differ_from_the_path(tree, v):
    """The path is right, the first accepted token is not its node's."""
    if not v.accepted:
        return None
    return replace(v, accepted=((v.accepted[0] + 1) % V, *v.accepted[1:]))


def not_the_argmax(tree, v):
    """A consistent walk that accepts a node whose token is not its parent's argmax: the last node swapped for a
    sibling with another token, or the path taken one node further, to a child that is not the bonus."""
    path, toks = v.path, tree.tokens
    if len(path) >= 2:
        last, parent = path[-1], path[-2]
        sib = next((c for c in tree.children[parent] if toks[c] != toks[last]), None)
        if sib is not None:
            return replace(v, path=(*path[:-1], sib), accepted=(*v.accepted[:-1], toks[sib]))
    child = next((c for c in tree.children[path[-1]] if toks[c] != v.bonus), None)
    return None if child is None else replace(v, path=(*path, child), accepted=(*v.accepted, toks[child]))


def bonus_not_the_argmax(tree, v):
    return replace(v, bonus=(v.bonus + 1) % V)


def bonus_outside_the_vocabulary(tree, v):
    return replace(v, bonus=V)


def another_tree(tree, v):
    """The record names a tree other than the one the verifier was sent."""
    return replace(v, tree=goose.DraftTree.single(tree.tokens[0]) if tree.num_nodes > 1 else None)


def _decoder(fault, policy="proposal", budget=12, p_oracle=0.7, seed=0):
    ver = Misreports(fault)
    if policy == "proposal":
        src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=seed, p_oracle=p_oracle, p_chain=0.3))
        dec = goose.compose(ToyCausalLM(V), None, sources=[src], policy="proposal", verifier=ver, budget=budget)
    else:
        dec = goose.compose(ToyCausalLM(V), None, sources=["pld", "tr"], policy=policy, verifier=ver, budget=budget)
    return dec, ver


def _misreport(fault, sample: bool, **kw) -> goose.VerifierError:
    """The VerifierError a generation with ``fault`` raises (greedy, or sampled at a low temperature)."""
    dec, ver = _decoder(fault, **kw)
    args = dict(do_sample=True, temperature=0.3, seed=5) if sample else {}
    with pytest.raises(goose.VerifierError) as ei:
        for prompt in PROMPTS:  # the fault applies to some tree within these
            dec.generate(prompt, max_new_tokens=40, **args)
    assert ver.faults == 1, "the loop went on after a misreported pass"
    err = ei.value
    assert not isinstance(err, goose.TreePolicyError), str(err)
    assert err.component == "misreports" and err.hook == "verify", (err.component, err.hook)
    assert "Verifier 'misreports'" in str(err) and "VerifierLosslessnessKit" in str(err), str(err)
    return err


STRUCTURE = [  # (fault, what the message names): wrong in any request
    (one_token_too_many,
     r"reported (\d+) accepted tokens \(.*\) for the path \(.*\) of (?!\1)\d+ nodes after the root"),
    (index_past_the_tree, r"path\[\d+\] = (\d+) is not a node of the \1-node tree"),
    (skips_a_level,
     r"path\[1\] = node \d+ follows node 0, but node \d+ is not a child of node 0 \(its parent is node [1-9]"),
    (jumps_to_a_non_child, r"path\[\d+\] = node \d+ follows node \d+, but node \d+ is not a child of node \d+"),
    (starts_off_the_root, r"reported path \(1,\), which does not start at node 0"),
    (tokens_differ_from_the_path, r"reported accepted token \d+ for node \d+ of the path \(.*\), whose token is \d+"),
    (bonus_outside_the_vocabulary, rf"reported bonus {V} after node \d+, not a token id \(an int in \[0, {V}\)\)"),
    (another_tree, r"reported a pass over (no tree|a 1-node tree \(\d+,\)), not the \d+-node tree"),
]
GREEDY = [  # wrong in a greedy request only: the loop cannot know a sampled walk's draws
    (not_the_argmax, r"accepted node \d+ \(token \d+\) in a greedy request, but the argmax of its parent node \d+'s "
                     r"logit row is \d+"),
    (bonus_not_the_argmax, r"reported bonus \d+ after node \d+ in a greedy request, but the argmax of that node's "
                           r"logit row is \d+"),
]


@pytest.mark.parametrize("fault,match", STRUCTURE + GREEDY, ids=[f.__name__ for f, _ in STRUCTURE + GREEDY])
def test_a_misreported_pass_is_a_verifier_error_in_a_greedy_request(fault, match):
    err = _misreport(fault, sample=False)
    assert re.search(match, str(err)), str(err)


@pytest.mark.parametrize("fault,match", STRUCTURE, ids=[f.__name__ for f, _ in STRUCTURE])
def test_a_misreported_pass_is_a_verifier_error_in_a_sampled_request(fault, match):
    err = _misreport(fault, sample=True, p_oracle=1.0)
    assert re.search(match, str(err)), str(err)


@pytest.mark.parametrize("policy", ["spine", "chain", "spine-fit"])
def test_a_path_past_the_tree_is_blamed_on_the_verifier_not_the_policy(policy):
    """The policies' observe() reads the path: the check runs before it, so an index past the tree is the
    verifier's fault, not an IndexError in the policy."""
    err = _misreport(index_past_the_tree, sample=False, policy=policy, budget=16)
    assert "is not a node of the" in str(err) and err.__cause__ is None, str(err)


def test_nothing_observes_or_commits_a_misreported_pass():
    seen = []

    class Watch(goose.DraftSource):
        name = "watch"

        def observe(self, verified):
            seen.append(verified.kind)

    src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=1, p_oracle=0.9))
    ver = Misreports(one_token_too_many)
    dec = goose.compose(ToyCausalLM(V), None, sources=[src, Watch()], policy="proposal", verifier=ver, budget=8)
    streamed = []

    class Streamer:
        def put(self, ids):
            streamed.append(ids.tolist())

        def end(self):
            pass

    with pytest.raises(goose.VerifierError):
        dec.generate(PROMPTS[0], max_new_tokens=20, streamer=Streamer(), stream_prompt=False)
    assert seen == ["prefill"], seen  # the tree pass was never observed
    assert streamed == [[[reference_greedy(PROMPTS[0], 1, V)[0]]]], streamed  # only the prefill's token


# -- the prefill's first token ----------------------------------------------------------------------------
class MisreportsFirst(TransformersVerifier):
    name = "misreports-first"

    def __init__(self, bonus):
        super().__init__()
        self.bonus = bonus

    def prefill(self, prompt_ids, keep=None, rule=None):
        v = super().prefill(prompt_ids, keep, rule)
        return replace(v, bonus=self.bonus(v.bonus))


@pytest.mark.parametrize("bonus,sample,match", [
    (lambda b: (b + 1) % V, False, r"prefill's bonus \d+ in a greedy request, but the argmax of the last prompt "
                                   r"position's logit row is \d+"),
    (lambda b: V, False, rf"prefill's bonus {V}, not a token id \(an int in \[0, {V}\)\)"),
    (lambda b: None, True, r"prefill's bonus None, not a token id"),
    (lambda b: -1, True, r"prefill's bonus -1, not a token id"),
], ids=["greedy-not-the-argmax", "greedy-outside-the-vocabulary", "sampled-none", "sampled-negative"])
def test_a_misreported_first_token_is_a_verifier_error(bonus, sample, match):
    dec = goose.compose(ToySplitLM(V), None, sources=["pld", "tr"], policy="spine", verifier=MisreportsFirst(bonus))
    args = dict(do_sample=True, temperature=0.7, seed=3) if sample else {}
    with pytest.raises(goose.VerifierError, match=match) as ei:
        dec.generate(PROMPTS[1], max_new_tokens=8, **args)
    assert ei.value.component == "misreports-first" and ei.value.hook == "prefill"


def test_a_first_token_other_than_the_argmax_is_not_checked_when_sampling():
    """A sampled first token is the rule's draw: any token id passes."""
    dec = goose.compose(ToySplitLM(V), None, sources=["pld"], verifier=MisreportsFirst(lambda b: (b + 1) % V))
    out = dec.generate(PROMPTS[1], max_new_tokens=4, do_sample=True, temperature=0.7, seed=3)
    assert len(out.token_ids) == 4


# -- the built-in verifier passes ------------------------------------------------------------------------
@pytest.mark.parametrize("model", [ToyCausalLM, ToySplitLM])
@pytest.mark.parametrize("policy,sources,budget", [
    ("proposal", "arbitrary", 1), ("proposal", "arbitrary", 6), ("proposal", "arbitrary", 24),
    ("spine", ["pld", "tr"], 16), ("chain", ["pld"], 8), ("spine-tree", ["tr"], 12), ("iso3", ["pld", "tr"], 20),
])
def test_the_builtin_verifier_passes_the_check(model, policy, sources, budget):
    for i, prompt in enumerate(PROMPTS):
        srcs = [ArbitraryTreeSource(ArbitraryTreeOptions(seed=i, p_oracle=0.6))] if sources == "arbitrary" else sources
        dec = goose.compose(model(V), None, sources=srcs, policy=policy, budget=budget)
        out = dec.generate(prompt, max_new_tokens=30)
        assert out.token_ids == reference_greedy(prompt, 30, V)
        assert out.stats.time_s["check"] > 0 and out.stats.time_s["check"] < out.stats.time_s["total"]
        p = {"do_sample": True, "temperature": 0.8, "top_k": 8}
        out = dec.generate(prompt, max_new_tokens=30, generator=torch.Generator().manual_seed(i), **p)
        ref = reference_sample(prompt, 30, V, build_processors(Sampling(**p), len(prompt), []),
                               torch.Generator().manual_seed(i))
        assert out.token_ids == ref
        # processors without sampling (the rule's walk, not the raw argmax): the structure is checked only
        out = dec.generate(prompt, max_new_tokens=20, do_sample=False, repetition_penalty=1.3)
        assert len(out.token_ids) == 20


class OwnRecords(Wrapping):
    """The kit tests' wrapping verifier, building records of its own (docs/plugins.md, "A verifier")."""

    name = "own-records"

    def verify(self, tree, rule=None):
        v = self.inner.verify(tree, rule)  # a record of its own, equal to the inner one's: a copy of the tree
        return replace(v, tree=replace(tree), path=list(v.path), accepted=list(v.accepted))


def test_a_wrapping_verifier_that_builds_its_own_record_passes_the_check():
    dec = goose.compose(ToySplitLM(V), None, sources=["pld", "tr"], policy="spine", verifier=OwnRecords(), budget=16)
    for prompt in PROMPTS:
        assert dec.generate(prompt, max_new_tokens=30).token_ids == reference_greedy(prompt, 30, V)
