"""Suffix matching (``suffix``): the index, the tree, learning across requests, eviction, the pool."""

import copy
import gc
import random
import threading
import weakref
from types import SimpleNamespace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as hs

import goose
from goose.interfaces import check_proposal
from goose.plugins.suffix import SuffixOptions, SuffixSource, _Segment, confidence, ngram_hash, pattern_lengths
from goose.policies.chains import first_chain
from goose.testing import SourceLosslessnessKit, ToyCausalLM, reference_greedy

V = 16
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def make(past=(), vocab=100, **opts):
    """A source that has seen ``past`` requests (each finished: a prompt, no output) and has begun."""
    src = SuffixSource(SuffixOptions(**opts))
    for h in past:
        finish(src, h, [], vocab)
    src.begin(goose.Request((0,), vocab, 10, 60))
    return src


def finish(src, prompt, new, vocab=100):
    src.begin(goose.Request(tuple(prompt), vocab, len(new), 60))
    src.end(SimpleNamespace(prompt_ids=tuple(prompt), token_ids=list(new), stats=None))


def state(tokens, max_depth=50, budget=60):
    return goose.DraftState(tokens, len(tokens), tokens[-1], tokens[-2] if len(tokens) > 1 else None, budget, max_depth, 0)


def propose(tokens, past=(), max_depth=50, vocab=100, **opts):
    src = make(past, vocab, **opts)
    return src.propose(state(tokens, max_depth))


def depths(prop):
    d = []
    for p in prop.parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def likeliest_chain(prop):
    """From the root, the highest-scored child at each node (ties: the earlier node), to a leaf."""
    out, node = [], -1
    while True:
        kids = [i for i, p in enumerate(prop.parents) if p == node]
        if not kids:
            return tuple(out)
        node = max(kids, key=lambda i: (prop.scores[i], -i))
        out.append(prop.tokens[node])


def assert_valid(prop, vocab=100):
    check_proposal("suffix", prop, vocab)  # ids, parents < index, no duplicate siblings, confidence
    sib = set()
    for i, (t, p) in enumerate(zip(prop.tokens, prop.parents)):
        assert -1 <= p < i and (p, t) not in sib
        sib.add((p, t))
        assert 0 < prop.scores[i] <= (1.0 if p < 0 else prop.scores[p]) + 1e-12
    k = prop.info["match_len"]
    assert prop.parents[:k] == tuple(range(-1, k - 1))  # nodes 0..k-1 are the chain
    assert first_chain(prop) == prop.tokens[:k] == likeliest_chain(prop)
    assert 0.0 <= prop.confidence < 1.0


# -- the index ------------------------------------------------------------------------------
def test_pattern_lengths():
    assert pattern_lengths(2, 32) == (2, 4, 8, 16, 32)
    assert pattern_lengths(3, 32) == (3, 6, 12, 24, 32)
    assert pattern_lengths(4, 4) == (4,)


@pytest.mark.parametrize(
    "tokens, opts, chain, pattern",
    [
        ([1, 2, 3, 4, 5, 6], {}, None, 0),  # nothing repeats
        ([4, 4], {}, None, 0),  # the trailing suffix itself is no earlier occurrence
        # (2,3) was followed by 7, the longer (9,2,3) by 8: the longest match wins
        ([9, 2, 3, 8, 5, 1, 2, 3, 7, 6, 9, 2, 3], {}, (8, 5, 1, 2, 3, 7, 6, 9, 2, 3), 3),
        # a match of 5 (between indexed lengths 4 and 8) measured exactly; the 4-gram occurs twice
        ([0, 1, 2, 3, 4, 8, 5, 1, 2, 3, 4, 7, 0, 1, 2, 3, 4], {"min_prob": 0.0}, (8, 5, 1, 2, 3, 4, 7, 0, 1, 2, 3, 4), 5),
        # capped by max_depth
        (list(range(20)) + [0, 1, 2], {"max_depth": 4}, (3, 4, 5, 6), 3),
        # min_pattern 3: a 2-token match is not enough
        ([1, 2, 5, 0, 1, 2], {"min_pattern": 3}, None, 0),
        ([1, 2, 5, 0, 1, 2], {"min_pattern": 2}, (5, 0, 1, 2), 2),
    ],
)
def test_longest_match(tokens, opts, chain, pattern):
    p = propose(tokens, **opts)
    if chain is None:
        assert p is None
        return
    assert_valid(p)
    assert p.tokens[: p.info["match_len"]] == chain and p.info["pattern"] == pattern


def test_frequency_orders_children_and_scores_are_path_probabilities():
    # (1, 2) was followed by 5, 6, 5: 5 first (2/3), then 6 (1/3)
    toks = [1, 2, 5, 0, 1, 2, 6, 0, 1, 2, 5, 0, 1, 2]
    p = propose(toks, min_prob=0.0, max_pattern=2)
    assert_valid(p)
    roots = [(p.tokens[i], p.scores[i]) for i, par in enumerate(p.parents) if par == -1]
    assert roots == [(5, pytest.approx(2 / 3)), (6, pytest.approx(1 / 3))]
    assert p.info["occurrences"] == 3 and p.info["pattern"] == 2
    # under 5 (twice): 0 both times -> 2/3; then (1, 2) ... the 2nd occurrence of 5 ends the text later
    assert p.tokens[1] == 0 and p.scores[1] == pytest.approx(2 / 3)
    # min_prob prunes the 1/3 branch
    q = propose(toks, min_prob=0.5, max_pattern=2)
    assert 6 not in [q.tokens[i] for i, par in enumerate(q.parents) if par == -1]
    # frequency beats recency: 6 followed last, 5 twice before it
    toks = [1, 2, 5, 0, 1, 2, 5, 0, 1, 2, 6, 0, 1, 2]
    p = propose(toks, min_prob=0.0, max_pattern=2)
    assert [p.tokens[i] for i, par in enumerate(p.parents) if par == -1] == [5, 6]
    q = propose(toks, min_prob=0.5, max_pattern=2)
    assert q is not None and [q.tokens[i] for i, par in enumerate(q.parents) if par == -1] == [5]


def test_ties_go_to_the_most_recent_occurrence():
    p = propose([1, 2, 5, 0, 1, 2, 6, 0, 1, 2], min_prob=0.0, max_pattern=2)
    assert p.tokens[0] == 6 and p.scores[0] == pytest.approx(0.5)


def test_history_is_matched_and_counted():
    hist = [[7, 8, 9, 10, 11, 12, 13], [7, 8, 9, 10, 20, 21]]
    p = propose([1, 7, 8, 9, 10], past=hist, min_prob=0.0)
    assert_valid(p)
    assert p.info["from_history"] == 2 and p.info["occurrences"] == 2 and p.info["pattern"] == 4
    roots = {p.tokens[i]: p.scores[i] for i, par in enumerate(p.parents) if par == -1}
    assert roots == {20: pytest.approx(0.5), 11: pytest.approx(0.5)}
    assert p.tokens[0] == 20  # the newest request first among equals
    # a longer match in the history beats a shorter one in the request
    p = propose([8, 9, 10, 99, 5, 7, 8, 9, 10], past=[[6, 7, 8, 9, 10, 42]])
    assert p.tokens[0] == 42 and p.info["pattern"] == 4 and p.info["from_history"] == 1


def test_history_off_and_prompts_off():
    hist = [[7, 8, 9, 10, 11, 12, 13]]
    src = make(hist, history=0)
    assert src.propose(state([1, 7, 8, 9, 10])) is None and len(src.history) == 0
    src = make(hist, history_prompts=False)  # the prompts were the whole requests: nothing kept
    assert src.propose(state([1, 7, 8, 9, 10])) is None
    src = SuffixSource(SuffixOptions(history_prompts=False))
    finish(src, [7, 8, 9], [10, 11, 12])
    src.begin(goose.Request((0,), 100, 10, 60))
    assert src.propose(state([0, 10, 11])).tokens[0] == 12
    assert src.propose(state([0, 8, 9])) is None  # the prompt was not kept


def test_never_proposes_ids_outside_the_vocabulary():
    # the text holds ids 12 and 13 (from a request of a larger vocabulary); vocab is 10 now
    p = propose([1, 2, 12, 1, 2, 3, 4, 1, 2], vocab=10, min_prob=0.0)
    assert p is not None and all(t < 10 for t in p.tokens) and p.tokens[0] == 3
    assert_valid(p, 10)


@pytest.mark.parametrize("max_nodes, max_depth, state_depth", [(32, 24, 50), (5, 24, 50), (32, 3, 50), (32, 24, 2)])
def test_limits(max_nodes, max_depth, state_depth):
    rng = random.Random(1)
    toks = [rng.randrange(4) for _ in range(300)]
    p = make(max_nodes=max_nodes, max_depth=max_depth, min_prob=0.0).propose(state(toks, state_depth))
    assert_valid(p)
    cap = min(max_depth, state_depth)
    assert len(p.tokens) <= max_nodes and max(depths(p)) <= cap
    if cap >= 24:
        assert len(p.tokens) == max_nodes  # enough branching text to fill it
    else:
        assert max(depths(p)) == cap  # the chain reaches the cap
    assert make().propose(state(toks, 0)) is None


def _brute(tokens, lo, hi):
    """Longest suffix (lo..hi tokens) that occurred earlier with a follower, and its followers."""
    n = len(tokens)
    for m in range(min(hi, n - 1), lo - 1, -1):
        suf = tokens[n - m :]
        follow = [tokens[e + 1] for e in range(m - 1, n - 1) if tokens[e - m + 1 : e + 1] == suf]
        if follow:
            return m, follow
    return 0, []


@settings(max_examples=150, deadline=None)
@given(
    tokens=hs.lists(hs.integers(0, 5), min_size=1, max_size=80),
    min_pattern=hs.integers(1, 4),
    max_pattern=hs.integers(4, 12),
    max_nodes=hs.integers(1, 20),
    max_depth=hs.integers(1, 10),
    state_depth=hs.integers(1, 12),
)
def test_tree_against_brute_force(tokens, min_pattern, max_pattern, max_nodes, max_depth, state_depth):
    src = make(min_pattern=min_pattern, max_pattern=max_pattern, max_nodes=max_nodes, max_depth=max_depth,
               min_prob=0.0, max_occurrences=10_000)
    # drafted incrementally, as in a decoder: the index grows by the new positions only
    cut = len(tokens) // 2
    if cut:
        src.propose(state(tokens[:cut], state_depth))
    p = src.propose(state(tokens, state_depth))
    m, follow = _brute(tokens, min_pattern, max_pattern)
    if not m:
        assert p is None
        return
    assert_valid(p)
    assert p.info["pattern"] == m and p.info["occurrences"] == len(follow)
    roots = {p.tokens[i]: p.scores[i] for i, par in enumerate(p.parents) if par == -1}
    best = max(follow.count(t) for t in set(follow))
    assert follow.count(p.tokens[0]) == best  # the chain starts with the most frequent follower
    for t, s in roots.items():
        assert s == pytest.approx(follow.count(t) / len(follow))
    assert len(p.tokens) <= max_nodes and max(depths(p)) <= min(max_depth, state_depth)
    assert src.live.indexed == len(tokens) - 1



@settings(max_examples=150, deadline=None)
@given(
    tokens=hs.lists(hs.integers(0, 4), min_size=1, max_size=80),
    past=hs.lists(hs.lists(hs.integers(0, 4), min_size=2, max_size=30), max_size=3),
    max_depth=hs.integers(1, 10),
    min_prob=hs.sampled_from([0.0, 0.1, 0.3]),
)
def test_chain_only_is_the_trees_first_chain(tokens, past, max_depth, min_prob):
    """``tree=False`` (what goose.vllm asks for) proposes the tree's likeliest chain, node for node, with the
    same scores, counts, pattern and confidence; with a node budget deep enough that the tree is not cut."""
    opts = dict(max_depth=max_depth, min_prob=min_prob, max_nodes=4096)
    tree = propose(tokens, past, **opts)
    chain = propose(tokens, past, tree=False, **opts)
    if tree is None:
        assert chain is None
        return
    assert chain is not None and chain.is_chain
    assert chain.tokens == tree.first_chain() == likeliest_chain(tree)
    k = len(chain.tokens)
    assert chain.scores == tree.scores[:k]
    assert chain.confidence == tree.confidence
    assert {x: chain.info[x] for x in ("pattern", "occurrences", "from_history")} == \
        {x: tree.info[x] for x in ("pattern", "occurrences", "from_history")}
    cut = propose(tokens, past, tree=False, max_depth=max_depth, min_prob=min_prob, max_nodes=2)
    assert len(cut.tokens) <= 2 and cut.tokens == chain.tokens[: len(cut.tokens)]

@settings(max_examples=60, deadline=None)
@given(tokens=hs.lists(hs.integers(0, 3), max_size=300) | hs.lists(hs.integers(0, 2**31 - 1), max_size=300),
       chunks=hs.lists(hs.sampled_from([1, 2, 15, 16, 17, 40, 200]), min_size=1, max_size=40))
@example(tokens=[0, 1] * 40, chunks=[3, 40])  # a long append after a short one: its n-grams chain to earlier ones
def test_a_long_append_indexes_as_token_by_token(tokens, chunks):
    """A long append (a prompt: numpy hashes and chains it at once) leaves the same index as appending a token at
    a time: each length's latest end per hash and each end's chain to the previous one with that hash."""
    lengths = pattern_lengths(2, 32)
    one = _Segment(lengths)
    for t in tokens:
        one.extend([t])
    mixed, i = _Segment(lengths), 0
    for c in chunks * (1 + len(tokens)):
        if i >= len(tokens):
            break
        mixed.extend(tokens[i : i + c])
        i += c
    mixed.extend(tokens[i:])
    assert mixed.last == one.last and [list(a) for a in mixed.prev] == [list(a) for a in one.prev]
    for k, n in enumerate(lengths):
        for e in range(n - 1, len(tokens) - 1):
            h = ngram_hash(tokens[e - n + 1 : e + 1])
            assert h in one.last[k] and one.last[k][h] >= e
            prev = one.prev[k][e]
            assert prev < e and (prev < 0 or ngram_hash(tokens[prev - n + 1 : prev + 1]) == h)


def test_index_is_incremental():
    src = make()
    toks = [1, 2, 3, 4]
    src.propose(state(toks))
    assert src.live.indexed == 3 and len(src.live.tokens) == 4
    entries = src.live.entries()
    src.propose(state(toks))  # nothing new: nothing re-indexed
    assert src.live.entries() == entries and src.live.indexed == 3
    toks += [1, 2]
    src.propose(state(toks))
    assert src.live.indexed == 5


def test_confidence():
    assert confidence(1.0, 2, 8) == pytest.approx(0.75)
    assert confidence(1.0, 1, 4) == pytest.approx(0.4)
    assert confidence(0.5, 3, 16) == pytest.approx(0.5 * (1 - 2**-4))
    assert confidence(0.0, 2, 8) == 0.0 and confidence(1.0, 5, 0) == 0.0
    assert confidence(1.0, 9, 64) < 1.0
    # in a proposal: a long, repeated, unanimous match is more confident than a short single one
    long = propose(list(range(10, 30)) * 4 + list(range(10, 20)))  # 2 occurrences match 32 tokens
    short = propose([1, 2, 5, 0, 1, 2])
    assert long.confidence > 0.9 > 0.5 > short.confidence > 0.0


# -- across requests on a toy model -----------------------------------------------------------
@pytest.mark.parametrize("sources, policy", [(["suffix"], "chain"), (["suffix", "tr"], "spine"), (["suffix"], "proposal")])
def test_learns_across_requests(sources, policy):
    want = reference_greedy(PROMPT, 60, V)
    runs = {}
    for hist in (16, 0):
        srcs = [("suffix", {"history": hist}), *sources[1:]]
        dec = goose.compose(ToyCausalLM(V, max_positions=512), None, sources=srcs, policy=policy)
        first = dec.generate(PROMPT, max_new_tokens=60)
        second = dec.generate(PROMPT, max_new_tokens=60)
        assert first.token_ids == second.token_ids == want
        runs[hist] = (first, second)
    first, second = runs[16]
    st = second.stats.extra["suffix"]
    assert st["history_proposals"] > 0 and st["history_requests"] == 1
    assert second.stats.per_source["suffix"]["accepted"] >= 40
    assert second.stats.forward_passes < first.stats.forward_passes / 3
    first, second = runs[0]
    st = second.stats.extra["suffix"]
    assert st["history_proposals"] == 0 and st["history_requests"] == 0
    if policy != "spine":  # the spine's measured source rates carry into the next request: it may draft otherwise
        assert second.stats.forward_passes == first.stats.forward_passes


# -- losslessness (the kit), history on and off ------------------------------------------------
class TestSuffixKit(SourceLosslessnessKit):
    max_examples = 20

    def make_source(self):
        return "suffix"


class TestSuffixKitNoHistory(SourceLosslessnessKit):
    max_examples = 12

    def make_source(self):
        return ("suffix", {"history": 0})


class TestSuffixKitSpine(SourceLosslessnessKit):
    policy = "spine"
    extra_sources = ("tr",)
    max_examples = 12

    def make_source(self):
        return ("suffix", {"min_pattern": 1, "max_pattern": 8, "history_prompts": False})


# -- eviction and size ------------------------------------------------------------------------
def _fill(src, n_requests, length, vocab=50_000, seed=0):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n_requests):
        prompt = [rng.randrange(vocab) for _ in range(length // 2)]
        new = [rng.randrange(vocab) for _ in range(length - length // 2)]
        src.begin(goose.Request(tuple(prompt), vocab, len(new), 60))
        src.propose(state(prompt + new[: len(new) // 2]))  # the live index is handed over in end()
        src.end(SimpleNamespace(prompt_ids=tuple(prompt), token_ids=new, stats=None))
        reqs.append(prompt + new)
    return reqs


def test_eviction_by_requests_frees_the_index():
    src = SuffixSource(SuffixOptions(history=4))
    reqs = _fill(src, 1, 200, seed=1)
    oldest = weakref.ref(src.history.segments()[0])
    sizes = []
    for i in range(12):
        reqs += _fill(src, 1, 200, seed=100 + i)
        size = src.index_size()
        sizes.append((size["history_entries"], size["history_bytes"]))
    segs = src.history.segments()
    assert len(segs) == 4 and src.history.evicted == 9
    assert [list(s.tokens) for s in segs] == reqs[-4:]  # the newest four, oldest first
    del segs
    gc.collect()
    assert oldest() is None  # the evicted request's index is gone
    at_limit = sizes[2]  # 4 requests held from here on
    assert all(e == at_limit[0] for e, _ in sizes[2:])
    assert all(b <= at_limit[1] * 1.02 for _, b in sizes[2:])
    st = src.stats()
    assert st["history_requests"] == 4 and st["history_tokens"] == 800 and st["index_mib"] > 0


def test_eviction_by_tokens():
    src = SuffixSource(SuffixOptions(history=100, history_tokens=1000))
    reqs = _fill(src, 7, 300)
    assert len(src.history) == 3 and src.history.tokens == 900
    assert [list(s.tokens) for s in src.history.segments()] == reqs[-3:]
    _fill(src, 1, 1200, seed=5)  # longer than the whole history: not kept, nothing evicted
    assert len(src.history) == 3 and src.history.tokens == 900
    # what was evicted is not matched any more
    src.begin(goose.Request((0,), 50_000, 10, 60))
    assert src.propose(state(reqs[0][:10])) is None
    assert src.propose(state(reqs[-1][:10])).tokens[0] == reqs[-1][10]


def test_mib_per_10k_cached_tokens(capsys):
    """Measured, not asserted as a speed: the history index's memory per 10k cached tokens."""
    out = {}
    for label, vocab in (("distinct ids (worst case)", 50_000), ("small vocabulary (repetitive)", 64)):
        src = SuffixSource(SuffixOptions())
        _fill(src, 5, 2000, vocab=vocab)
        size = src.index_size()
        tokens = src.history.tokens
        assert tokens == 10_000
        out[label] = size["history_bytes"] / 2**20 / (tokens / 10_000)
    with capsys.disabled():
        print("\nsuffix index MiB per 10k cached tokens:", {k: round(v, 2) for k, v in out.items()})
    assert 0 < out["small vocabulary (repetitive)"] <= out["distinct ids (worst case)"] < 64


# -- the pool: one history per decoder --------------------------------------------------------
class _MeetingToy(ToyCausalLM):
    """Each thread's first forward waits for the other thread's: both generate at once."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.barrier = None
        self._local = threading.local()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kwargs):
        if self.barrier is not None and not getattr(self._local, "met", False):
            self._local.met = True
            self.barrier.wait(timeout=30)
        return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kwargs)


def test_concurrent_generations_share_one_history():
    model = _MeetingToy(V, max_positions=512)
    dec = goose.compose(model, None, sources=["suffix"], policy="chain")
    prompts = [PROMPT, [7, 7, 2, 0, 11, 5]]
    model.barrier = threading.Barrier(2)
    outs, errs = {}, []

    def run(i):
        try:
            outs[i] = dec.generate(prompts[i], max_new_tokens=40)
        except Exception as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    model.barrier = None
    assert not errs, errs
    for i in range(2):
        assert outs[i].token_ids == reference_greedy(prompts[i], 40, V)
    assert dec._workers == 2 and len(dec._idle) == 2  # the second call ran on a copied set
    a, b = (w.sources[0] for w in dec._idle)
    assert a is not b and a.history is b.history
    assert len(a.history) == 2
    held = sorted(list(s.tokens) for s in a.history.segments())
    assert held == sorted([prompts[i] + outs[i].token_ids for i in range(2)])
    # either set now drafts both requests from the shared history
    for p in prompts:
        again = dec.generate(p, max_new_tokens=40)
        assert again.stats.extra["suffix"]["history_proposals"] > 0
    # a decoder of its own compose has a history of its own
    other = goose.compose(ToyCausalLM(V, max_positions=512), None, sources=["suffix"], policy="chain")
    assert other.sources[0].history is not a.history and len(other.sources[0].history) == 0
    out = other.generate(PROMPT, max_new_tokens=40)
    assert out.token_ids == outs[0].token_ids and out.stats.extra["suffix"]["history_proposals"] == 0


def test_copies_share_the_history_not_the_request():
    src = make([[1, 2, 3, 4]])
    src.propose(state([5, 6, 5]))
    twin = copy.deepcopy(src)
    assert twin.history is src.history and twin.live is not src.live
    twin.propose(state([5, 6, 5, 6, 7]))
    assert len(src.live.tokens) == 3  # the copy's request index is its own
    finish(twin, [9, 9, 9], [8])
    assert len(src.history) == 2
    import pickle

    back = pickle.loads(pickle.dumps(src))
    assert len(back.history) == 2 and back.history is not src.history


# -- options ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opts, match",
    [
        ({"histroy": 3}, "histroy"),
        ({"min_pattern": 5, "max_pattern": 3}, "min_pattern"),
        ({"history": -1}, "history"),
        ({"min_prob": 1.5}, "min_prob"),
        ({"max_nodes": 0}, "max_nodes"),
    ],
)
def test_bad_options(opts, match):
    with pytest.raises(Exception, match=match):
        SuffixOptions(**opts)
    with pytest.raises(goose.InvalidInputError, match=match):
        goose.compose(ToyCausalLM(V), None, sources=[("suffix", opts)])


def test_registered_as_builtin():
    e = goose.get_registry().get("source", "suffix")
    assert e.cls is SuffixSource and e.origin == "builtin" and e.provider == "goose.plugins.suffix"
