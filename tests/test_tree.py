"""The draft tree's derived structure, checked against brute-force definitions."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

import goose
from goose.decoding import prune
from goose.testing import trees
from goose.verifiers.transformers_tree import walk


def ancestors_brute(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


@given(trees())
def test_depths_mask_positions_paths(tree):
    n = tree.num_nodes
    for i in range(n):
        anc = ancestors_brute(tree.parents, i)
        assert tree.depths[i] == len(anc) - 1
        assert set(np.flatnonzero(tree.ancestor_mask[i])) == anc
    past = 7
    pos = tree.position_ids(past)
    assert pos.shape == (1, n) and pos[0].tolist() == [past + d for d in tree.depths]
    mask = tree.attention_mask(past, dtype=torch.float32)
    assert mask.shape == (1, 1, n, past + n)
    allowed = mask[0, 0] == 0
    assert allowed[:, :past].all()
    assert torch.equal(allowed[:, past:], torch.from_numpy(tree.ancestor_mask))
    assert (mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all()
    # paths: one per leaf, each a root-to-leaf chain of parent links
    leaves = [i for i in range(n) if not tree.children[i]]
    assert [p[-1] for p in tree.paths] == leaves
    for p in tree.paths:
        assert p[0] == 0 and all(tree.parents[b] == a for a, b in zip(p, p[1:], strict=False))


@given(trees(), st.lists(st.integers(0, 49), min_size=24, max_size=24))
def test_walk_is_longest_matching_path(tree, argmax):
    argmax = argmax[: tree.num_nodes]
    path = walk(tree, argmax)
    # brute force: the deepest node all of whose path edges match the argmax of the parent
    def ok(i):
        while i:
            if tree.tokens[i] != argmax[tree.parents[i]]:
                return False
            i = tree.parents[i]
        return True

    best = max((i for i in range(tree.num_nodes) if ok(i)), key=lambda i: tree.depths[i])
    assert len(path) - 1 == tree.depths[best]
    assert ok(path[-1])


@given(trees(), st.integers(0, 6))
def test_prune_keeps_exactly_the_shallow_nodes(tree, d):
    p = prune(tree, d)
    assert max(p.depths) <= d
    assert p.num_nodes == sum(1 for x in tree.depths if x <= d)
    kept = [i for i in range(tree.num_nodes) if tree.depths[i] <= d]
    assert [tree.tokens[i] for i in kept] == list(p.tokens)


def test_constructors():
    c = goose.DraftTree.from_chain(5, [1, 2, 3], "pld")
    assert c.is_chain and c.parents == (-1, 0, 1, 2) and c.origins == ("root", "pld", "pld", "pld")
    assert c.route == "path" and goose.DraftTree.from_chain(5, [], "pld").route == "single"
    # Medusa-style choices: paths of child ranks from the root
    t = goose.DraftTree.from_choices(9, [(0,), (1,), (0, 0), (0, 1), (1, 0)], lambda path: 10 * len(path) + path[-1], "x")
    assert t.parents == (-1, 0, 0, 1, 1, 2)
    assert t.tokens == (9, 10, 11, 20, 21, 20)
    p = goose.Proposal("s", (4, 5, 6), (-1, 0, -1))
    tree = p.as_tree(3)
    assert tree.parents == (-1, 0, 1, 0) and tree.origins == ("root", "s", "s", "s")
    assert not p.is_chain and goose.Proposal.chain("s", [1, 2]).is_chain
