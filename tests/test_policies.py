"""Tree policies: spine (and its bypass and ablations), isotropic, tr-tree.

Shape tests run the policies on stub sources (a chain with a given confidence, a successor table
with a given width and scores) and check the construction rules of docs/algorithm.md
section 6; property tests check every registered policy stays lossless on the exact toy model.
"""

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.interfaces import DraftContext, DraftSource, DraftState, Proposal, Request, Verified
from goose.policies.isotropic import IsotropicOptions, IsotropicPolicy, TRTreeOptions, TRTreePolicy, static_tree
from goose.policies.spine import BypassOptions, BypassPolicy, SpineOptions, SpinePolicy, harmonic_split
from goose.testing import ToyCausalLM, reference_greedy, reference_next

V = 1000  # stub vocabulary: chains use 500+, successors 0..499 (no accidental overlaps)


class ChainStub(DraftSource):
    name = "pld"

    def __init__(self, chain=(), confidence=0.0, match_len=None):
        super().__init__()
        self.chain, self.confidence = tuple(chain), confidence
        self.match_len = len(self.chain) if match_len is None else match_len

    def propose(self, state):
        if not self.chain:
            return None
        return Proposal.chain(self.name, self.chain, self.confidence, match_len=self.match_len, consensus=False)


class SuccStub(DraftSource):
    """Every known token has ``k`` distinct successors scored ``scores`` (best first)."""

    name = "tr"
    provides_successors = True

    def __init__(self, k=10, scores=None, known=None, include=None):
        super().__init__()
        self.k = k
        self.scores = tuple(scores or [0.5 / (r + 1) for r in range(k)])
        self.known = known  # None: every token
        self.include = include or {}  # token -> a successor to put first (e.g. the next spine token)

    def propose(self, state):
        return None

    def successors(self, token, prev):
        if self.known is not None and token not in self.known:
            return (), ()
        base = (token * 37 + 11) % 450
        ids = [(base + r) % 500 for r in range(self.k)]
        if token in self.include:
            ids = [self.include[token]] + [t for t in ids if t != self.include[token]][: self.k - 1]
        return ids, self.scores[: len(ids)]


def ctx(sources, budget=60, max_depth=500, anchor=7, prev=3):
    state = DraftState((1, 2, prev, anchor), 2, anchor, prev, budget, max_depth, 0)
    return DraftContext(state, sources)


def spine(sources, **opts):
    p = SpinePolicy(SpineOptions(**opts))
    p.bind(sources)
    return p


CHAIN = tuple(range(500, 600))  # 100 chain tokens


def counts(tree):
    return Counter(tree.origins)


def spine_children(tree):
    """Children per spine node j (branch children only), in spine order."""
    L = tree.meta["spine_len"]
    return [sum(1 for c in tree.children[j + 1] if tree.origins[c] == "branch") for j in range(L)]


# ---------------------------------------------------------------------------------------------
# harmonic split
# ---------------------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(share=st.integers(0, 200), n=st.integers(0, 120))
def test_harmonic_split_rules(share, n):
    a = harmonic_split(share, n)
    assert len(a) == n and sum(a) <= share
    assert all(x >= y for x, y in zip(a, a[1:])), "widths never increase along the spine"
    total = sum(1 / (j + 1) for j in range(n))
    left = share
    for j, x in enumerate(a):  # brute force of the rule: max(1, int(share*w/total)) until exhausted
        want = 0 if left <= 0 else min(max(1, int(share / (j + 1) / total)), left)
        assert x == want
        left -= x
    for j, x in enumerate(a):  # each position gets at least 1 until the share runs out
        assert x >= 1 or sum(a[:j]) == share


# ---------------------------------------------------------------------------------------------
# spine tree shape
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "chain_len, conf, ema, budget, want_budget, want_L",
    [
        (100, 0.0, 0.5, 60, 60, 30),  # ema >= 0.4: base 0.5 -> L = int(60 * 0.5)
        (100, 0.0, 0.3, 60, 60, 18),  # medium tier 0.30
        (100, 0.0, 0.1, 60, 60, 9),  # low tier 0.15
        (12, 0.0, 0.5, 60, 60, 12),  # the chain is shorter than its share
        (100, 0.6, 0.5, 60, 84, 67),  # budget 60 + int(0.6*40); ratio 0.5 + 0.6*0.5 = 0.8
        (100, 0.9, 0.1, 60, 96, 87),  # ratio 0.15 + 0.9*0.85 = 0.915 -> int(96 * 0.915) = int(87.84)
        (100, 1.0, 0.5, 60, 100, 99),  # saturated: the spine takes the whole budget, less the root
        (100, 0.0, 0.5, 20, 20, 10),
    ],
)
def test_spine_budget_and_length(chain_len, conf, ema, budget, want_budget, want_L):
    srcs = [ChainStub(CHAIN[:chain_len], conf), SuccStub()]
    p = spine(srcs)
    p.ema = ema
    tree = p.shape(ctx(srcs, budget))
    assert tree.route == "branched"
    assert tree.meta["spine_len"] == want_L
    assert tree.tokens[1 : want_L + 1] == CHAIN[:want_L]
    assert tree.parents[1 : want_L + 1] == tuple(range(want_L))
    assert tree.num_nodes <= want_budget <= p.max_nodes(budget)
    if want_L < want_budget - 1:
        assert tree.num_nodes == want_budget  # a full table fills the budget
    c = counts(tree)
    assert c["lead"] == want_L


def test_spine_root_and_spine_shares_and_harmonic_widths():
    srcs = [ChainStub(CHAIN[:20]), SuccStub()]
    p = spine(srcs)
    tree = p.shape(ctx(srcs, 60))
    L = 20
    branch_budget = 60 - 1 - L  # 39
    spine_share = max(1, int(branch_budget * 0.5))  # 19
    root_share = branch_budget - spine_share  # 20 > K: the root gets all its 10 successors
    root_children = [c for c in tree.children[0] if tree.origins[c] == "root-branch"]
    assert len(root_children) == min(root_share, 10)
    widths = spine_children(tree)
    assert widths == list(harmonic_split(spine_share, L))
    assert all(a >= b for a, b in zip(widths, widths[1:]))


def test_spine_skips_chain_tokens_among_branches():
    # The table predicts the chain itself: the first root successor is chain[0], and each spine
    # node's first successor is the next spine token. Branches must skip them (siblings distinct).
    chain = CHAIN[:10]
    include = {7: chain[0], **{chain[j]: chain[j + 1] for j in range(9)}}
    srcs = [ChainStub(chain), SuccStub(include=include)]
    tree = spine(srcs).shape(ctx(srcs, 60))
    for node, kids in enumerate(tree.children):
        toks = [tree.tokens[c] for c in kids]
        assert len(toks) == len(set(toks))
    assert [tree.tokens[c] for c in tree.children[0]].count(chain[0]) == 1
    assert all(tree.tokens[c] not in chain for c in tree.children[0] if tree.origins[c] != "lead")


def test_spine_bfs_widths_depths_and_scores():
    srcs = [ChainStub(CHAIN[:10]), SuccStub(k=5, scores=[0.9, 0.05, 0.03, 0.009, 0.001])]
    tree = spine(srcs).shape(ctx(srcs, 60))
    d = tree.depths
    for i, o in enumerate(tree.origins):
        if o == "branch" and tree.origins[tree.parents[i]] in ("branch", "root-branch"):
            assert d[i] <= 6  # extension stops at depth 6
    # min_score 0.01: only the first three ranks are ever drafted
    for i in range(1, tree.num_nodes):
        if tree.origins[i] != "lead":
            kids = [c for c in tree.children[i]]
            assert len(kids) <= 3
    for i, kids in enumerate(tree.children):  # BFS width cap max(1, K // depth) under branch nodes
        if i and tree.origins[i] != "lead":
            assert len(kids) <= max(1, 10 // d[i])


def test_spine_routes():
    chain = CHAIN[:15]
    # table knows the anchor, chain -> spine tree
    srcs = [ChainStub(chain), SuccStub()]
    assert spine(srcs).shape(ctx(srcs)).route == "branched"
    # table does not know the anchor, chain -> the plain chain
    srcs = [ChainStub(chain), SuccStub(known=set())]
    t = spine(srcs).shape(ctx(srcs))
    assert t.route == "path" and t.tokens[1:] == chain and set(t.origins[1:]) == {"lead"}
    # table knows the anchor, no chain -> a pure branch tree
    srcs = [ChainStub(()), SuccStub()]
    t = spine(srcs).shape(ctx(srcs))
    assert t.route == "branched" and "lead" not in t.origins and t.num_nodes == 60
    # nothing -> None (an ordinary step)
    srcs = [ChainStub(()), SuccStub(known=set())]
    assert spine(srcs).shape(ctx(srcs)) is None
    # only scores under min_score and no chain: a one-node tree -> None
    srcs = [ChainStub(()), SuccStub(scores=[0.001] * 10)]
    assert spine(srcs).shape(ctx(srcs)) is None


def test_spine_chain_route_is_cut_to_the_budget():
    srcs = [ChainStub(CHAIN, 0.9), SuccStub(known=set())]
    t = spine(srcs).shape(ctx(srcs, 60))
    assert t.num_nodes == 60 + 36  # budget 60 + int(0.9*40), root included


def test_spine_respects_max_depth():
    srcs = [ChainStub(CHAIN[:40]), SuccStub()]
    t = spine(srcs).shape(ctx(srcs, 60, max_depth=4))
    assert max(t.depths) <= 4 and t.meta["spine_len"] == 4


def test_spine_nobranch_and_nobypass_presets():
    reg = goose.get_registry()
    srcs = [ChainStub(CHAIN[:20], 0.8, match_len=12), SuccStub()]
    nb = reg.get("policy", "spine-nobranch")
    pol = nb.cls(nb.options())
    pol.bind(srcs)
    t = pol.shape(ctx(srcs))
    assert spine_children(t) == [0] * t.meta["spine_len"]
    assert any(o == "root-branch" for o in t.origins)
    nby = reg.get("policy", "spine-nobypass")
    pol = nby.cls(nby.options())
    pol.bind(srcs)
    t = pol.shape(ctx(srcs))
    assert t.num_nodes == 60 and t.meta["spine_len"] == 12  # base budget, unextended chain
    assert pol.max_nodes(60) == 60


def test_spine_ema_update_and_stats():
    chain = CHAIN[:10]
    srcs = [ChainStub(chain), SuccStub()]
    p = spine(srcs)
    p.begin(Request((1,), V, 10, 60))
    tree = p.shape(ctx(srcs))
    # accept 4 spine tokens, then the first branch child of spine node 4 (continuation)
    kid = next(c for c in tree.children[4] if tree.origins[c] == "branch")
    path = (0, 1, 2, 3, 4, kid)
    n = tree.num_nodes
    v = Verified("tree", torch.tensor(tree.tokens), torch.zeros(n, dtype=torch.long), torch.zeros(n, 2), (0,) * n,
                 tree, path, tuple(tree.tokens[i] for i in path[1:]), 0)
    p.observe(v)
    assert p.ema == pytest.approx(0.3 * 4 / 10 + 0.7 * 0.5)
    s = p.stats()
    assert s["continuation_cycles"] == 1 and s["continuation_tokens"] == 1
    assert s["lead_drafted"] == 10 and s["lead_accepted"] == 4 and s["routes"] == {"branched": 1}
    # a pure branch cycle leaves the EMA alone
    ema = p.ema
    srcs2 = [ChainStub(()), SuccStub()]
    t2 = p.shape(ctx(srcs2))
    p.observe(Verified("tree", torch.tensor(t2.tokens), torch.zeros(t2.num_nodes, dtype=torch.long),
                       torch.zeros(t2.num_nodes, 2), (0,) * t2.num_nodes, t2, (0,), (), 0))
    assert p.ema == ema
    p.begin(Request((1,), V, 10, 60))
    assert p.ema == 0.5 and p.stats()["lead_drafted"] == 0


# ---------------------------------------------------------------------------------------------
# bypass
# ---------------------------------------------------------------------------------------------
def bypass(sources, **opts):
    p = BypassPolicy(BypassOptions(**opts))
    p.bind(sources)
    return p


@pytest.mark.parametrize(
    "chain_len, conf, route",
    [
        (100, 1.0, "bypassed"),  # consensus, the chain fills the 100-node tree: one chain of 100
        (99, 1.0, "bypassed"),  # 99 + root = the largest spine tree
        (98, 1.0, "branched"),  # one node would be left for a branch: the spine tree
        (100, 0.9, "branched"),  # no consensus
        (30, 1.0, "branched"),
    ],
)
def test_bypass_collapses_only_a_filling_consensus_chain(chain_len, conf, route):
    srcs = [ChainStub(CHAIN[:chain_len], conf), SuccStub()]
    p = bypass(srcs)
    t = p.shape(ctx(srcs, 60))
    assert t.route == route
    assert p.max_nodes(60) == 101 and t.num_nodes <= 101
    if route == "bypassed":
        assert t.is_chain and t.tokens[1:] == CHAIN[:chain_len] and set(t.origins[1:]) == {"lead"}


def test_bypass_options_and_inner_policies():
    srcs = [ChainStub(CHAIN[:30], 1.0), SuccStub()]
    t = bypass(srcs, min_length=20).shape(ctx(srcs))
    assert t.route == "bypassed" and t.num_nodes == 31
    t = bypass(srcs, inner="iso3").shape(ctx(srcs))
    assert t.route == "iso"
    t = bypass(srcs, inner="iso3", min_length=10, max_chain=12).shape(ctx(srcs, max_depth=8))
    assert t.route == "bypassed" and t.num_nodes == 9  # cut to max_depth
    with pytest.raises(goose.GooseError, match="Unknown tree policy"):
        BypassPolicy(BypassOptions(inner="nope"))
    with pytest.raises(goose.InvalidInputError, match="k"):
        BypassPolicy(BypassOptions(inner="iso3", inner_options={"k": 0}))


def test_bypass_refuses_an_inner_policy_that_wraps_itself():
    class LoopPlugin:
        @goose.hookimpl
        def goose_register_policies(self, register):
            register(BypassPolicy, name="loop", defaults={"inner": "loop"})

    goose.register_plugin(LoopPlugin(), name="loop-plugin")
    with pytest.raises(goose.InvalidInputError, match="nest"):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="loop")


def test_spine_is_bypass_around_spine_tree():
    dec = goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine")
    assert isinstance(dec.policy, BypassPolicy) and dec.policy.inner.name == "spine-tree"
    assert dec.max_nodes == 101
    assert dec.policy.inner.options == SpineOptions()


# ---------------------------------------------------------------------------------------------
# isotropic
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k, budget", [(3, 60), (5, 60), (3, 20), (2, 200)])
def test_isotropic_is_breadth_first_k_ary(k, budget):
    srcs = [ChainStub(()), SuccStub()]
    p = IsotropicPolicy(IsotropicOptions(k=k))
    p.bind(srcs)
    t = p.shape(ctx(srcs, budget))
    full = sum(k**d for d in range(7))
    assert t.num_nodes == min(budget, full)
    assert max(t.depths) <= 6
    kids = [len(c) for c in t.children]
    internal = [n for n in kids if n]
    assert all(n == k for n in internal[:-1]) and 1 <= internal[-1] <= k
    assert list(t.depths) == sorted(t.depths)  # laid out breadth-first
    assert Counter(t.origins)["root-branch"] == k


def test_isotropic_puts_the_chain_first():
    chain = CHAIN[:10]
    srcs = [ChainStub(chain), SuccStub()]
    p = IsotropicPolicy(IsotropicOptions(k=3))
    p.bind(srcs)
    t = p.shape(ctx(srcs, 60))
    node, got = 0, []
    while True:
        kids = t.children[node]
        if not kids or t.origins[kids[0]] != "lead":
            break
        node = kids[0]
        got.append(t.tokens[node])
    assert got == list(chain[: len(got)]) and len(got) == max(t.depths)
    assert Counter(t.origins)["lead"] == len(got)


def test_isotropic_routes_and_budget_extension():
    srcs = [ChainStub(CHAIN, 0.5), SuccStub(known=set())]
    p = IsotropicPolicy(IsotropicOptions(k=3))
    p.bind(srcs)
    t = p.shape(ctx(srcs, 20))
    assert t.route == "path" and t.num_nodes == 20 + 20  # budget 20 + int(0.5 * 40)
    srcs = [ChainStub(CHAIN, 0.5), SuccStub()]
    assert p.shape(ctx(srcs, 20)).num_nodes == 40
    assert p.max_nodes(20) == 60


# ---------------------------------------------------------------------------------------------
# tr-tree
# ---------------------------------------------------------------------------------------------
def test_static_tree_is_the_best_slots_per_level():
    slots = static_tree((8, 21, 25, 15, 8, 3), 8)
    assert [sum(1 for s in slots if s[2] == d) for d in range(1, 7)] == [8, 21, 25, 15, 8, 3]
    den = {0: 1}
    for i, (p, r, d) in enumerate(slots, start=1):
        assert p < i
        den[i] = den[p] * (r + 1)
    for d in range(1, 7):  # brute force: no unchosen (parent, rank) beats a chosen one
        prev = [0] if d == 1 else [i for i, s in enumerate(slots, 1) if s[2] == d - 1]
        chosen = {(slots[i - 1][0], slots[i - 1][1]) for i in range(1, len(slots) + 1) if slots[i - 1][2] == d}
        worst = max(den[i] for i in range(1, len(slots) + 1) if slots[i - 1][2] == d)
        left = [den[p] * (r + 1) for p in prev for r in range(8) if (p, r) not in chosen]
        best_left = min(left, default=math.inf)
        assert worst <= best_left


@pytest.mark.parametrize(
    "budget, want", [(81, [8, 21, 25, 15, 8, 3]), (200, [8, 21, 25, 15, 8, 3]), (60, [8, 21, 25, 5])]
)
def test_tr_tree_level_widths(budget, want):
    srcs = [SuccStub(k=10)]
    p = TRTreePolicy(TRTreeOptions())
    p.bind(srcs)
    t = p.shape(ctx(srcs, budget))
    assert t.route == "tr"
    widths = Counter(t.depths)
    assert [widths[d] for d in range(1, len(want) + 1)] == want and t.num_nodes == min(budget, 81)


def test_tr_tree_thin_table_and_errors():
    srcs = [SuccStub(k=2)]
    p = TRTreePolicy(TRTreeOptions())
    p.bind(srcs)
    t = p.shape(ctx(srcs, 81))
    assert all(len(c) <= 2 for c in t.children)
    assert p.shape(ctx([SuccStub(known=set())], 81)) is None
    with pytest.raises(goose.InvalidInputError, match="successor"):
        goose.compose(ToyCausalLM(16), None, sources=["pld"], policy="tr-tree")


@pytest.mark.parametrize("policy", ["spine", "spine-tree", "iso3", "bypass"])
def test_bind_refuses_no_sources_and_unknown_spine_source(policy):
    with pytest.raises(goose.InvalidInputError, match="source"):
        goose.compose(ToyCausalLM(16), None, sources=[], policy=policy)
    with pytest.raises(goose.InvalidInputError, match="spine_source"):
        goose.compose(ToyCausalLM(16), None, sources=["tr"], policy=policy, policy_options={"spine_source": "x"})


def test_only_one_kind_of_source_degrades_gracefully():
    for sources, routes in ((["pld"], {"path", "single"}), (["tr"], {"branched", "single"})):
        dec = goose.compose(ToyCausalLM(16), None, sources=sources, policy="spine", budget=20)
        prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
        out = dec.generate(prompt, max_new_tokens=30)
        assert out.token_ids == reference_greedy(prompt, 30, 16)
        assert set(out.stats.routes) <= routes


@pytest.mark.parametrize(
    "name, bad",
    [("spine", {"nope": 1}), ("spine-tree", {"tiers": (0.1, 0.2, 1.5)}), ("iso3", {"k": 0}),
     ("tr-tree", {"widths": ()}), ("spine-tree", {"extension": -1})],
)
def test_policy_options_are_validated(name, bad):
    with pytest.raises(goose.InvalidInputError):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy=name, policy_options=bad)


# ---------------------------------------------------------------------------------------------
# losslessness on the exact toy model
# ---------------------------------------------------------------------------------------------
TOY_V = 16
MY_POLICIES = [
    "spine", "spine-tree", "spine-nobypass", "spine-nobranch", "bypass", "isotropic", "iso3", "iso5", "tr-tree"
]


class OracleChain(DraftSource):
    """A chain source that knows the toy's greedy continuation, corrupts it at a random spot, and
    claims random confidence: it drives long spines, consensus bypasses and spine continuations."""

    name = "oracle"

    def __init__(self, seed=0):
        super().__init__()
        self.rng = random.Random(seed)

    def begin(self, request):
        self.vocab = request.vocab_size

    def propose(self, state):
        n = self.rng.choice([0, 3, 10, 40, 80])
        if not n:
            return None
        seq, out = list(state.tokens), []
        for i in range(n):
            t = reference_next(seq, self.vocab)
            if self.rng.random() < 0.1:
                t = (t + 1) % self.vocab
            out.append(t)
            seq.append(t)
        conf = self.rng.choice([0.0, 0.5, 0.9, 1.0])
        return Proposal.chain(self.name, out, conf, match_len=min(n, 20))


def test_every_policy_is_tested():
    names = set(goose.get_registry().names("policy"))
    assert set(MY_POLICIES) <= names


toy_cases = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(0, 5), min_size=1, max_size=30),  # small alphabet: n-gram repeats
        "max_new": st.integers(1, 40),
        "budget": st.integers(1, 30),
        "eos": st.none() | st.integers(0, TOY_V - 1),
        "seed": st.integers(0, 2**16),
    }
)


def _check(policy, sources, c):
    model = ToyCausalLM(TOY_V, eos_token_id=c["eos"])
    dec = goose.compose(model, None, sources=sources, policy=policy, budget=c["budget"])
    out = dec.generate(c["prompt"], max_new_tokens=c["max_new"])
    ref = reference_greedy(c["prompt"], c["max_new"], TOY_V, [] if c["eos"] is None else [c["eos"]])
    assert out.token_ids == ref
    assert out.stats.forward_passes == out.stats.steps + 1 == model.forward_calls
    return out


@pytest.mark.parametrize("policy", MY_POLICIES)
def test_lossless_pld_tr(policy):
    @settings(max_examples=25, deadline=None)
    @given(toy_cases)
    def prop(c):
        _check(policy, ["pld", "tr"], c)

    prop()


@pytest.mark.parametrize("policy", ["spine", "spine-nobranch", "iso3", ("bypass", {"inner": "iso5"})])
def test_lossless_oracle_spine(policy):
    @settings(max_examples=25, deadline=None)
    @given(toy_cases)
    def prop(c):
        _check(policy, [OracleChain(c["seed"]), ("tr", {"bigram": bool(c["seed"] % 2)})], c)

    prop()


def test_oracle_spine_exercises_bypass_and_continuation():
    model = ToyCausalLM(TOY_V)
    dec = goose.compose(model, None, sources=[OracleChain(3), "tr"], policy="spine", budget=20)
    prompt = [1, 2, 3]
    out = dec.generate(prompt, max_new_tokens=300)
    assert out.token_ids == reference_greedy(prompt, 300, TOY_V)
    pol = out.stats.extra["policy"]
    assert out.stats.routes.get("bypassed", 0) > 0 and pol["bypass_cycles"] == out.stats.routes["bypassed"]
    assert pol["continuation_cycles"] > 0 and out.stats.tau > 2
    assert out.stats.per_origin["lead"]["accepted"] > 0 and out.stats.per_source["oracle"]["accepted"] > 0


def test_lossless_every_registered_policy_with_pld_tr():
    prompt = [1, 2, 3, 1, 2, 3, 4, 1, 2, 3]
    for name in goose.get_registry().names("policy"):
        out = goose.compose(ToyCausalLM(TOY_V), None, sources=["pld", "tr"], policy=name, budget=16).generate(
            prompt, max_new_tokens=25
        )
        assert out.token_ids == reference_greedy(prompt, 25, TOY_V), name


def test_spine_never_accepts_fewer_than_its_spine_chain():
    """Per-cycle Prop. 4: the spine alone, re-walked with the target's argmax, never beats the tree."""
    from goose.testing import ToyCausalLM, reference_greedy

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5] * 4
    dec = goose.compose(ToyCausalLM(16), None, sources=[OracleChain(seed=3), "tr"], policy="spine-nobypass", budget=30)
    out = dec.generate(prompt, max_new_tokens=120)
    assert out.token_ids == reference_greedy(prompt, 120, 16)
    st = out.stats.extra["policy"]
    assert st["dominance_cycles"] > 0
    assert st["dominance_violations"] == 0
    assert st["gain_over_spine_chain"] >= 0
