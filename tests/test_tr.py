"""The token-recycling source ``tr``: harvest, tiers, request lifetime, options."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.interfaces import DraftState, Request, Verified
from goose.plugins.tr import TokenTable, TROptions, TRSource
from goose.testing import SourceLosslessnessKit, ToyCausalLM, reference_greedy


def verified(tokens, preds, logits, kind="tree"):
    return Verified(
        kind,
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(preds, dtype=torch.long),
        logits,
        tuple(logits.argmax(-1).tolist()),
    )


def source(vocab, **opts):
    s = TRSource(TROptions(**opts))
    s.begin(Request((0,), vocab, 10, 8))
    return s


def brute_force(passes, vocab, k, bigram):
    """Reference harvest: walk every position in order, overwrite its rows (last write wins)."""
    uni, bi = {}, {}
    kk = min(k, vocab)
    for tokens, preds, logits in passes:
        for i, t in enumerate(tokens):
            row = logits[i]
            order = sorted(range(vocab), key=lambda v: -float(row[v]))[:kk]
            vals = torch.tensor([float(row[v]) for v in order])
            probs = torch.softmax(vals, 0).tolist()
            uni[t] = (order, probs)
            if bigram and preds[i] >= 0:
                bi[(preds[i], t)] = (order, probs)
    return uni, bi


passes_strategy = st.fixed_dictionaries(
    {
        "vocab": st.integers(2, 24),
        "k": st.integers(1, 12),
        "bigram": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
        "lengths": st.lists(st.integers(1, 20), min_size=1, max_size=4),
        "distinct": st.integers(1, 6),  # tokens drawn from this many values: many duplicates
    }
)


@settings(max_examples=60, deadline=None)
@given(passes_strategy)
def test_harvest_equals_brute_force(c):
    vocab, k = c["vocab"], c["k"]
    g = torch.Generator().manual_seed(c["seed"])
    src = source(vocab, k=k, bigram=c["bigram"])
    passes = []
    for n in c["lengths"]:
        tokens = torch.randint(0, min(vocab, c["distinct"]), (n,), generator=g).tolist()
        preds = torch.randint(-1, min(vocab, c["distinct"]), (n,), generator=g).tolist()
        logits = torch.randn(n, vocab, generator=g)  # continuous: no ties in the top-K
        passes.append((tokens, preds, logits))
        src.observe(verified(tokens, preds, logits))
    uni, bi = brute_force(passes, vocab, k, c["bigram"])
    table = src.table
    kk = min(k, vocab)
    for t in range(vocab):
        if t in uni:
            ids, probs = uni[t]
            assert table.ids[t, :kk].tolist() == ids
            assert torch.allclose(table.scores[t, :kk], torch.tensor(probs), atol=1e-6)
            assert (table.ids[t, kk:] == -1).all()
            assert table.rows[t][0] == ids
        else:
            assert (table.ids[t] == -1).all() and (table.scores[t] == 0).all()
            assert t not in table.rows
    assert set(table.bigram) == set(bi)
    for key, (ids, probs) in bi.items():
        assert table.bigram[key][0] == ids
        assert table.bigram[key][1] == pytest.approx(probs, abs=1e-6)


def test_duplicate_positions_last_write_wins():
    # Token 3 at three positions: every tensor row and the mirror hold the LAST position's top-K.
    vocab = 8
    logits = torch.full((3, vocab), -10.0)
    logits[0, 1], logits[1, 2], logits[2, 5] = 5.0, 5.0, 5.0
    src = source(vocab, k=2, bigram=False)
    src.observe(verified([3, 3, 3], [-1, 3, 3], logits))
    assert src.table.ids[3, 0].item() == 5
    assert src.successors(3, None)[0][0] == 5


def test_duplicate_rows_last_write_wins_at_scale():
    # Many duplicates in a long pass: index_put with repeated indices would pick any of them.
    vocab, n = 50, 400
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (n,), generator=g).tolist()
    logits = torch.randn(n, vocab, generator=g)
    src = source(vocab, k=4, bigram=False)
    src.observe(verified(tokens, [-1] * n, logits))
    for t in set(tokens):
        last = max(i for i, x in enumerate(tokens) if x == t)
        assert src.table.ids[t].tolist() == logits[last].topk(4).indices.tolist()


def test_bigram_tier_is_consulted_first():
    vocab = 10
    logits = torch.full((2, vocab), -5.0)
    logits[0, 7] = 3.0  # token 4 after 1 -> 7
    logits[1, 8] = 3.0  # token 4 after 2 -> 8 (the unigram row: last write)
    src = source(vocab, k=3)
    src.observe(verified([4, 4], [1, 2], logits))
    assert src.successors(4, 1)[0][0] == 7  # bigram (1, 4)
    assert src.successors(4, 2)[0][0] == 8  # bigram (2, 4)
    assert src.successors(4, 9)[0][0] == 8  # unknown pair: the unigram row
    assert src.successors(4, None)[0][0] == 8
    assert src.successors(5, 1) == ((), ())  # unknown token
    off = source(vocab, k=3, bigram=False)
    off.observe(verified([4, 4], [1, 2], logits))
    assert off.successors(4, 1)[0][0] == 8 and not off.table.bigram


def test_successors_best_first_no_unknown_entries():
    vocab = 4  # fewer tokens than K: the row has 4 entries, the tensor pads with -1
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    src = source(vocab, k=10)
    src.observe(verified([0], [-1], logits))
    ids, scores = src.successors(0, None)
    assert list(ids) == [1, 3, 2, 0]
    assert list(scores) == sorted(scores, reverse=True) and sum(scores) == pytest.approx(1.0)
    assert src.table.ids[0, 4:].tolist() == [-1] * 6


def test_min_score_drops_weak_successors():
    logits = torch.tensor([[10.0, 0.0, 9.0, -20.0]])
    src = source(4, k=4, min_score=0.01)
    src.observe(verified([0], [-1], logits))
    assert list(src.successors(0, None)[0]) == [0, 2]


def test_prefill_harvest_option():
    logits = torch.randn(3, 6)
    on, off = source(6), source(6, prefill_harvest=False)
    for s in (on, off):
        s.observe(verified([1, 2, 3], [-1, 1, 2], logits, kind="prefill"))
    assert on.successors(2, 1)[0] and off.successors(2, 1) == ((), ())
    off.observe(verified([1, 2, 3], [-1, 1, 2], logits, kind="tree"))  # tree passes still harvest
    assert off.successors(2, 1)[0]


def test_propose_is_none_and_registration():
    reg = goose.get_registry()
    assert reg.get("source", "tr").cls is TRSource
    orig = reg.get("source", "tr-original").options()
    assert (orig.k, orig.bigram, orig.warm) == (8, False, True)
    assert TRSource.provides_successors
    state = DraftState((1, 2), 2, 2, 1, 10, 5, 0)
    assert source(4).propose(state) is None


@pytest.mark.parametrize("warm", [False, True])
def test_warm_table_across_requests(warm):
    model = ToyCausalLM(16)
    dec = goose.compose(model, None, sources=[("tr", {"warm": warm})], policy="tr-tree", budget=20)
    tr = dec.sources[0]
    dec.generate([1, 2, 3], max_new_tokens=10)
    first = tr.table
    known = set(first.rows)
    dec.generate([5], max_new_tokens=1)  # prefill of one token, no tree pass
    if warm:
        assert tr.table is first and known <= set(tr.table.rows)
    else:
        assert tr.table is not first and set(tr.table.rows) == {5}


def test_warm_table_keeps_output_lossless():
    model = ToyCausalLM(16)
    dec = goose.compose(model, None, sources=["pld", "tr-original"], policy="spine", budget=30)
    for prompt in ([1, 2, 3], [3, 1, 4, 1, 5], [1, 2, 3]):
        assert dec.generate(prompt, max_new_tokens=30).token_ids == reference_greedy(prompt, 30, 16)


@pytest.mark.parametrize(
    "opts, field",
    [
        ({"k": 0}, "k"),
        ({"k": "ten"}, "k"),
        ({"min_score": 1.0}, "min_score"),
        ({"bigrams": True}, "bigrams"),
    ],
)
def test_invalid_options_are_refused(opts, field):
    with pytest.raises(goose.InvalidInputError, match=field):
        goose.compose(ToyCausalLM(16), None, sources=[("tr", opts)], policy="tr-tree")


def test_table_without_begin_sizes_itself():
    s = TRSource()
    s.observe(verified([1], [-1], torch.randn(1, 7)))
    assert s.table.vocab_size == 7 and len(s.successors(1, None)[0]) == 7


def test_token_table_ignores_padded_logit_columns():
    # Models whose lm_head is padded past the vocabulary: successors stay inside the vocabulary.
    t = TokenTable(4, 2)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 99.0, 98.0]])
    t.harvest([0], [-1], logits, False)
    assert t.rows[0][0] == [3, 2]


class TestTRLosslessTRTree(SourceLosslessnessKit):
    policy = "tr-tree"
    max_examples = 20

    def make_source(self):
        return "tr"


class TestTRLosslessSpineNoBigram(SourceLosslessnessKit):
    policy = "spine"
    max_examples = 20

    def make_source(self):
        return ("tr", {"bigram": False, "k": 4})


@pytest.mark.parametrize("vocab,block", [(50, 256), (4096, 256), (49_152, 256), (151_936, 256), (262_144, 256), (10_007, 64)])
def test_blocked_topk_equals_torch_topk(vocab, block):
    """The harvest's two-pass top-k gives torch.topk's values, and its indices where values are distinct, with a
    vocabulary that fills no block (fallback), whole blocks, and a tail outside the blocks (151,936 = 593 x 256 + 128)."""
    from goose.plugins.tr import topk_rows

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(13, vocab, generator=g)
    x[3, -5:] = 10.0 + torch.arange(5.0)  # the best values in the tail
    x[4, :] = -1.0
    x[4, 7] = 2.0  # one block holds the top value, the rest tie
    for k in (1, 4, 10):
        got, want = topk_rows(x, k, block), torch.topk(x, k, dim=-1)
        assert torch.equal(got[0], want.values)
        distinct = [r for r in range(13) if r != 4]
        assert torch.equal(got[1][distinct], want.indices[distinct])
        assert int(got[1][4, 0]) == 7


@pytest.mark.parametrize("bigram", [False, True])
def test_the_harvest_reads_only_the_rows_that_stay_in_the_table(monkeypatch, bigram):
    """A later position of a token (and of a (previous, token) pair) overwrites the earlier one's row, so a
    chain that repeats a 14-token loop six times has its top-k taken on 14 rows (bigram: the loop's pairs'
    last positions, at most 28), and the table is the one every row would have written."""
    import goose.plugins.tr as tr

    loop = list(range(3, 17))
    tokens = loop * 6
    preds = [loop[-1]] + tokens[:-1]
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(tokens), 40, generator=g)
    seen = []
    real = tr.topk_rows
    monkeypatch.setattr(tr, "topk_rows", lambda x, k, **kw: (seen.append(x.shape[0]), real(x, k, **kw))[1])
    src = source(40, k=4, bigram=bigram)
    src.observe(verified(tokens, preds, logits))
    assert seen == [14]  # the loop's pairs repeat with it: their last positions are the tokens' last ones
    uni, bi = brute_force([(tokens, preds, logits)], 40, 4, bigram)
    for t, (ids, probs) in uni.items():
        assert src.table.rows[t][0] == ids and src.table.ids[t].tolist() == ids
    assert {p: r[0] for p, r in src.table.bigram.items()} == {p: r[0] for p, r in bi.items()}
    # a pair that last occurs before its token's last occurrence is read as well
    seen.clear()
    src2 = source(40, k=4, bigram=True)
    src2.observe(verified([5, 6, 7, 6], [4, 5, 9, 8], logits[:4]))
    assert seen == [4]
    assert src2.table.bigram[(5, 6)][0] == brute_force([([5, 6, 7, 6], [4, 5, 9, 8], logits[:4])], 40, 4, True)[1][(5, 6)][0]
