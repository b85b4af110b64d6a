"""Context matcher: table-driven tie-breaking, confidence, incremental indexing."""

import pytest

import goose
from goose.plugins.pld import NgramIndex, PLDOptions, PLDSource, confidence


def propose(tokens, **opts):
    src = PLDSource(PLDOptions(**opts))
    src.begin(goose.Request(tuple(tokens), 100, 10, 60))
    st = goose.DraftState(tokens, len(tokens), tokens[-1], tokens[-2] if len(tokens) > 1 else None, 60, 50, 0)
    return src.propose(st)


@pytest.mark.parametrize(
    "tokens, opts, chain",
    [
        # no earlier occurrence of any 3..5-gram suffix: nothing
        ([1, 2, 3, 4, 5, 6], {}, None),
        # 3-gram (1,2,3) seen once before: copy what followed it
        ([1, 2, 3, 9, 8, 1, 2, 3], {"extend": False}, [9, 8, 1, 2, 3]),
        # earliest occurrence by default ...
        ([1, 2, 3, 7, 5, 1, 2, 3, 8, 6, 1, 2, 3], {"extend": False, "max_chain": 2}, [7, 5]),
        # ... latest on request (classic PLD)
        ([1, 2, 3, 7, 5, 1, 2, 3, 8, 6, 1, 2, 3], {"extend": False, "max_chain": 2, "occurrence": "latest"}, [8, 6]),
        # the longest n wins: the 4-gram (0,1,2,3) only occurred before 8
        ([5, 1, 2, 3, 7, 0, 1, 2, 3, 8, 0, 1, 2, 3], {"extend": False, "max_chain": 1}, [8]),
        # the copy is capped by max_chain
        (list(range(30)) + [0, 1, 2], {"extend": False, "max_chain": 4}, [3, 4, 5, 6]),
        # an occurrence must have a following token: the suffix itself does not count
        ([4, 4, 4], {"extend": False, "ngram_sizes": (3,)}, None),
    ],
)
def test_matcher_table(tokens, opts, chain):
    p = propose(tokens, **opts)
    assert (None if p is None else list(p.tokens)) == chain


def test_consensus_and_confidence():
    # (1,2,3) seen twice before, both times followed by 9: consensus -> confidence 1
    p = propose([1, 2, 3, 9, 5, 1, 2, 3, 9, 6, 1, 2, 3], extend=False)
    assert p.info["consensus"] and p.confidence == 1.0
    # followed by different tokens: no consensus
    p = propose([1, 2, 3, 9, 5, 1, 2, 3, 8, 6, 1, 2, 3], extend=False)
    assert not p.info["consensus"]
    assert confidence(0, False) == 0.0
    assert confidence(4, False) == pytest.approx(0.3)
    assert confidence(8, False) == pytest.approx(0.7)
    assert confidence(20, False) == pytest.approx(0.9)
    assert confidence(30, False) == 0.9
    assert confidence(3, True) == 1.0


def test_chain_extension_follows_the_matches():
    text = list(range(10, 40))
    tokens = text + text[:5]  # long match: 25 tokens follow the 5-gram; max_chain 20
    p = propose(tokens, extend=True)
    assert p.confidence > 0.6
    assert list(p.tokens[:20]) == text[5:25]
    assert len(p.tokens) > 20 and p.info["extended"] > 0
    q = propose(tokens, extend=False)
    assert len(q.tokens) == 20


def test_index_is_incremental():
    idx = NgramIndex((3,))
    seq = [1, 2, 3, 4]
    idx.update(seq)
    assert idx.indexed == 3 and len(idx.tables[3]) == 1  # only (1,2,3), followed by 4
    seq += [1, 2, 3]
    idx.update(seq)
    assert idx.indexed == 6
    ent = idx.tables[3][(1, 2, 3)]
    assert (ent.first, ent.last, ent.count) == (2, 2, 1)  # the trailing (1,2,3) has no follower yet
    before = dict(idx.tables[3])
    idx.update(seq)  # nothing new: nothing re-indexed
    assert idx.indexed == 6 and idx.tables[3] == before


def test_bad_options():
    with pytest.raises(Exception, match="ngram_sizes"):
        PLDOptions(ngram_sizes=())
    with pytest.raises(Exception, match="extra"):
        PLDOptions(max_chian=3)
