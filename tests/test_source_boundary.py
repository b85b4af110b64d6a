"""A proposal is checked where it leaves its source, and the blame lands on that source (issue 21, point 4).

Every malformed proposal, under every policy that reads proposals, fails with a
``DraftSourceError`` naming the source, the proposal's own node index and the offending value,
before any tree is built; ``state.tokens`` is read-only to sources; the decoder works afterwards.
"""

import math

import numpy as np
import pytest
import torch

import goose
from goose.interfaces import TokenView
from goose.testing import ToyCausalLM, reference_greedy

V = 16


class Fixed(goose.DraftSource):
    """Proposes one fixed proposal every step (built by ``make(self.name)``)."""

    name = "fixed"

    def __init__(self, make, options=None):
        super().__init__(options)
        self.make = make

    def propose(self, state):
        return self.make(self.name)


def _decode(make, policy="chain", sources=None):
    src = Fixed(make)
    d = goose.compose(ToyCausalLM(V, max_positions=64), None, sources=[src, *(sources or [])], policy=policy)
    return d, lambda: d.generate([1, 2, 3, 1, 2], max_new_tokens=6)


P = goose.Proposal
BAD = {
    "negative id": (lambda n: P.chain(n, [3, -1]), r"node 1: token id -1 is not allowed: an int in \[0, 16\)"),
    "id past the vocabulary": (lambda n: P.chain(n, [3, 16]), r"node 1: token id 16 is not allowed"),
    "float id": (lambda n: P.chain(n, [1.5]), r"node 0: token id 1.5 is not allowed"),
    "bool id": (lambda n: P.chain(n, [True]), r"node 0: token id True is not allowed"),
    "parent ahead": (lambda n: P(n, (3, 4), (-1, 1)), r"node 1: parent 1 is not allowed: -1 \(the root\) or an earlier node 0..0"),
    "parent below the root": (lambda n: P(n, (3, 4), (-1, -2)), r"node 1: parent -2 is not allowed"),
    "duplicate siblings": (lambda n: P(n, (3, 4, 3), (-1, -1, -1)), r"node 2: token 3 under parent -1 repeats node 0 \(duplicate siblings\)"),
    "NaN confidence": (lambda n: P.chain(n, [3], confidence=math.nan), r"confidence=nan is not allowed: a finite number in \[0, 1\]"),
    "confidence above 1": (lambda n: P.chain(n, [3], confidence=1.5), r"confidence=1.5 is not allowed"),
    "credited to another source": (lambda n: P.chain("pld", [3]), r"its proposal says source='pld'; a proposal is credited to the source that made it"),
    "parents short": (lambda n: P(n, (3, 4), (-1,)), r"proposal has 2 tokens but 1 parents"),
    "scores short": (lambda n: P(n, (3, 4), (-1, 0), (0.5,)), r"proposal has 2 tokens but 1 scores"),
    "NaN score": (lambda n: P(n, (3, 4), (-1, 0), (0.5, math.nan)), r"node 1: score nan is not allowed"),
}


@pytest.mark.parametrize("policy", ["chain", "spine", "iso3"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_proposal_is_blamed_on_its_source(case, policy):
    make, msg = BAD[case]
    d, run = _decode(make, policy, ["tr"] if policy != "chain" else None)
    with pytest.raises(goose.DraftSourceError, match=r"Draft source 'fixed' failed: .*" + msg + r".*Hint: ") as ei:
        run()
    assert ei.value.source == "fixed"
    # nothing lost: the same decoder decodes afterwards once the source behaves
    d.sources[0].make = lambda n: P.chain(n, [3, 1])
    assert run().token_ids == reference_greedy([1, 2, 3, 1, 2], 6, V)


def test_integer_ids_of_numpy_and_torch_are_taken_as_ints():
    def make(n):
        return P(n, (np.int64(3), torch.tensor(1)), (-1, np.int32(0)), confidence=np.float32(0.5))

    d, run = _decode(make)
    out = run()
    assert out.token_ids == reference_greedy([1, 2, 3, 1, 2], 6, V)
    from goose.interfaces import check_proposal

    p = check_proposal("fixed", make("fixed"), V)
    assert p.tokens == (3, 1) and all(type(t) is int for t in (*p.tokens, *p.parents)) and type(p.confidence) is float


@pytest.mark.parametrize("mutate", [
    lambda t: t.append(3),
    lambda t: t.__setitem__(0, 5),
    lambda t: t.clear(),
    lambda t: t.extend([1, 2]),
    lambda t: t.pop(),
    lambda t: t.__delitem__(0),
])
def test_state_tokens_are_read_only_to_sources(mutate):
    class Vandal(goose.DraftSource):
        name = "vandal"

        def propose(self, state):
            mutate(state.tokens)
            return None

    d = goose.compose(ToyCausalLM(V, max_positions=64), None, sources=[Vandal(), "pld"], policy="chain")
    with pytest.raises(goose.DraftSourceError, match=r"'vandal'.*TypeError: state.tokens is read-only.*Hint: copy it first"):
        d.generate([1, 2, 3, 1, 2], max_new_tokens=6)


def test_the_view_reads_like_the_list_without_copying_it():
    seq = [4, 5, 6, 5]
    v = TokenView(seq)
    assert len(v) == 4 and v[-1] == 5 and v[1:3] == [5, 6] and list(v) == seq and v == seq and 6 in v
    assert v.index(5) == 1 and v.count(5) == 2 and list(reversed(v)) == seq[::-1]
    seq.append(9)  # the loop commits: the view sees it, no copy was made
    assert len(v) == 5 and v[-1] == 9
    with pytest.raises(TypeError, match="read-only"):
        v._tokens = []
    copy = list(v)
    copy.append(1)  # a copy is the source's own
    assert len(v) == 5
