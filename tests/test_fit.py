"""The device-fitted policy: lossless, prunes to what pays on the given latency curve, falls back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.verifiers.latency import LatencyCurve, curve_for, measure
from goose.testing import ToyCausalLM, reference_greedy


def _verifier(model):
    """The built-in verifier bound to ``model`` as a default decoder composes it: what the calibration times."""
    return goose.greedy(model).verifier

FLAT = {1: 1.0, 128: 1.0}  # a forward over 128 tokens costs one token's (GPU-like)
STEEP = {1: 1.0, 2: 2.0, 128: 128.0}  # cost grows with every token: nothing pays unless certain


def run(prompt, n, latency, **opts):
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": latency, **opts}, budget=24,
    )
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == reference_greedy(prompt, n, 16)
    return out


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=30),
    n=st.integers(1, 60),
    latency=st.sampled_from([FLAT, STEEP, {1: 1.0, 8: 1.5, 32: 4.0, 128: 20.0}]),
    prior=st.sampled_from([0.05, 0.3, 0.9]),
    tiers=st.sampled_from([None, {}, {"pld": [(0.0, 0.9, 0.99)]}, {"pld": [(1.0, 0.05, 0.5), (0.5, 0.9, 0.9)]}]),
    continuation=st.booleans(),
)
def test_fit_is_lossless(prompt, n, latency, prior, tiers, continuation):
    run(prompt, n, latency, prior=prior, continuation=continuation,
        **({} if tiers is None else {"source_priors": tiers}))


def test_steep_latency_falls_back_to_plain_decoding():
    out = run([1, 2, 3, 4] * 5, 60, STEEP, prior=0.3)
    st_ = out.stats.extra["policy"]
    assert st_["fit_fallback_steps"] > 0
    assert out.stats.routes.get("single", 0) >= st_["fit_fallback_steps"]


def test_flat_latency_keeps_whole_trees():
    out = run([1, 2, 3, 4] * 5, 60, FLAT, prior=0.3)
    st_ = out.stats.extra["policy"]
    assert st_["fit_fallback_steps"] == 0
    assert st_["fit_nodes_kept"] == st_["fit_nodes_offered"] > 0


def test_latency_curve_interpolates_and_extends():
    c = LatencyCurve((1, 4, 8), (1.0, 2.0, 4.0))
    assert c(1) == 1.0 and c(2) == pytest.approx(4 / 3) and c(8) == 4.0 and c(16) == 8.0
    assert c.table(3) == [0.0, 1.0, pytest.approx(4 / 3), pytest.approx(5 / 3)]


def test_measure_and_cache_on_a_model():
    m = ToyCausalLM(16, max_positions=4096)
    v = _verifier(m)
    c = measure(m, v, sizes=(1, 2, 4), past_len=16, repeats=1)
    assert c.sizes == (1, 2, 4) and all(t > 0 for t in c.seconds)
    c1 = curve_for(m, v)
    c2 = curve_for(m, v)  # second call: from the cache file
    assert c1 == c2


def _clocked_toy(monkeypatch, seconds_per_token: float, fixed: float = 0.0, extra=lambda n: 0.0):
    """A toy whose forwards advance a fake clock (the one measure reads) by ``fixed`` a pass plus
    ``seconds_per_token`` a token (plus ``extra(tokens)``)."""
    import goose.verifiers.latency as lat

    clock = {"t": 0.0}

    class Slow(ToyCausalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
            clock["t"] += fixed + seconds_per_token * input_ids.shape[1] + extra(input_ids.shape[1])
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kw)

    monkeypatch.setattr(lat.time, "perf_counter", lambda: clock["t"])
    model = Slow(16)
    return clock, model, _verifier(model)


def test_measure_stops_where_trees_cannot_pay_and_reports_progress(monkeypatch):
    """A model whose forward costs grow with every token: measuring stops at stop_ratio x t(1).

    The clock is the model's own (each forward advances it by 2 ms a token), so the test does not
    depend on the machine's load."""
    clock, model, v = _clocked_toy(monkeypatch, 0.002)
    lines = []
    c = measure(model, v, past_len=8, repeats=2, stop_ratio=4.0, progress=lines.append)
    assert c.sizes == (1, 2, 3, 4, 5)  # 5 tokens cost 5 > 4 x t(1): the last size measured
    assert c.seconds == pytest.approx((0.002, 0.004, 0.006, 0.008, 0.010))
    assert any("size 1:" in x for x in lines) and any("round 2/2" in x for x in lines)
    assert c(64) > c(c.sizes[-1])  # extended in proportion past the last size


def test_measure_keeps_to_its_time_budget_on_a_slow_steep_model(monkeypatch):
    """0.3 s a token (a 1.5B model on an AVX2-only CPU): measuring ends within 30 s, before size 16."""
    clock, model, v = _clocked_toy(monkeypatch, 0.3)
    lines = []
    c = measure(model, v, past_len=8, repeats=3, stop_ratio=100.0, progress=lines.append)  # the ratio never stops it
    assert clock["t"] <= 25.0  # the budget (the limit for first use is 30 s)
    walked = [n for n in c.sizes if n == 1 or c.sizes[c.sizes.index(n) - 1] == n - 1]  # the contiguous walk
    assert 4 <= walked[-1] < 16 and any("time budget reached" in x for x in lines)
    assert set(c.sizes) - set(walked) <= {32, 16, 8, 24, 12}  # anchors only where the budget allowed them
    assert c(64) == pytest.approx(64 * c(1), rel=0.05)  # in proportion, as this toy's cost is


def test_a_budget_stopped_curve_times_larger_anchor_sizes_instead_of_extending_in_proportion(monkeypatch):
    """A forward with a large fixed cost (1 s, plus 20 ms a token: a big model whose weights are read
    once per pass): the walk stops early for the budget, and anchors up to 64 are timed once, so a
    48-token chain is priced near its real 1.96 s, not the 7.8 s a proportional extension gives."""
    clock, model, v = _clocked_toy(monkeypatch, 0.02, fixed=1.0)
    lines = []
    c = measure(model, v, past_len=8, repeats=3, progress=lines.append, measure_head=False)
    assert clock["t"] <= 25.0
    assert c.sizes[-1] == 64 and 32 in c.sizes and max(n for n in c.sizes if n < 8) < 8
    assert c(48) == pytest.approx(1.96, rel=0.02)
    assert any("then sizes 8, 16, 24, 32, 48, 64" in x for x in lines)


def test_anchor_sizes_are_guessed_on_the_line_through_t1_not_in_proportion(monkeypatch):
    """A 1.5B model on a slow machine (1.2 s a pass, plus 50 ms a token): the walk ends at size 4 for the
    budget; guessed in proportion from t(4) (1.4 s), size 32 would take 11 s and was never timed (Qwen2.5-
    Coder's curve on an earlier session's machine: sizes 1-4, a 52-token chain priced at 11 s); on the
    line through t(1) and t(4) it takes its real 2.8 s, and both 32 and 64 fit in the budget."""
    clock, model, v = _clocked_toy(monkeypatch, 0.05, fixed=1.2)
    c = measure(model, v, past_len=8, repeats=3, measure_head=False)
    assert clock["t"] <= 25.0
    assert max(n for n in c.sizes if n < 8) == 4 and {32, 64} <= set(c.sizes)
    assert c(48) == pytest.approx(1.2 + 0.05 * 48, rel=0.02)


def test_a_budget_stopped_walk_times_anchors_between_its_end_and_64(monkeypatch):
    """A big model (1 s a pass, 20 ms a token) whose passes of 7-15 tokens cost 0.4 s more (Qwen2.5-Coder
    with stock linears: 13 rows 1.05 s, 16 rows 0.78 s): the walk ends at size 5 for the budget, and its
    rest times 8, 16, 24, 48 besides 32 and 64, so a 12-token tree is priced from t(8) and t(16)
    (1.44 s), not on the line from t(5) to t(32) (1.27 s)."""
    clock, model, v = _clocked_toy(monkeypatch, 0.02, fixed=1.0, extra=lambda n: 0.4 if 7 <= n <= 15 else 0.0)
    lines = []
    c = measure(model, v, past_len=8, repeats=3, measure_head=False, progress=lines.append)
    assert clock["t"] <= 25.0
    assert max(n for n in c.sizes if n < 8) == 5 and {8, 16, 24, 32, 48, 64} <= set(c.sizes)
    assert c(12) == pytest.approx((1.56 + 1.32) / 2, rel=0.02)
    assert any("sizes between are interpolated" in x for x in lines)


def test_sizes_between_two_anchors_of_one_form_are_listed_in_that_form():
    """The curve prices a size between two timed sizes by interpolating them; the verifier must run it in
    their form (Qwen2.5-Coder's curve: 6, 32, 64 timed as weight @ x.T, sizes 7-31 ran with stock linears at
    1.5-2x the price the fit was told). Only past the walk's end: sizes the walk skips by design (25-27 between
    24 and 28) keep running stock. Where the two forms differ, or either is stock, stock; none past 64."""
    from goose.verifiers.latency import _between_anchors

    timed = {1: None, 2: "packed", 3: "packed", 4: "packed", 5: None, 6: "skinny", 8: "skinny", 16: "skinny",
             24: "packed", 32: "packed", 48: None, 64: None, 128: "skinny"}
    got = _between_anchors(timed, 6, 64)
    assert {n: got[n] for n in (7, 9, 15)} == {7: "skinny", 9: "skinny", 15: "skinny"}
    assert all(got[n] == "packed" for n in range(25, 32))
    assert not any(n in got for n in (*range(17, 24), *range(33, 48), *range(49, 129)))
    assert _between_anchors(timed, 16, 64).keys() == set(range(25, 32))  # nothing below the walk's end


def test_a_cached_curve_that_does_not_hold_on_this_machine_is_measured_anew(monkeypatch, capsys):
    """The cache key names the CPU, not its speed: a curve cached on a faster machine under the same
    CPU name (or measured under load) is checked once per process and measured anew where it is off."""
    import goose.verifiers.latency as lat

    clock, rate = {"t": 0.0}, {"s": 0.002}

    class Clocked(ToyCausalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
            clock["t"] += rate["s"] * input_ids.shape[1]
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kw)

    monkeypatch.setattr(lat.time, "perf_counter", lambda: clock["t"])
    model = Clocked(16)
    v = _verifier(model)
    kw = dict(sizes=(1, 2, 4, 8), past_len=8, repeats=1, measure_head=False)
    first = curve_for(model, v, **kw)
    assert first(1) == pytest.approx(0.002) and first(4) == pytest.approx(0.008)
    capsys.readouterr()
    lat._checked.clear()  # a new process, same machine: the check passes, the cached curve is kept
    assert curve_for(model, v, **kw) == first
    assert "does not hold" not in capsys.readouterr().err
    assert lat.check(v, first, past_len=8) == []
    rate["s"] = 0.004  # another machine, twice as slow
    off = lat.check(v, first, past_len=8)
    assert [n for n, _, _ in off] == [1, 4] and off[0][2] == pytest.approx(0.004)
    assert curve_for(model, v, **kw) == first  # checked once per process: this one already was
    lat._checked.clear()
    second = curve_for(model, v, **kw)
    err = capsys.readouterr().err
    assert "disagrees (t(1) 2.0 ms cached, 4.0 ms now, t(4) 8.0 ms cached, 16.0 ms now" in err
    assert second(1) == pytest.approx(0.004) and lat.cached_curve(model, v) == second  # measured and cached
    rate["s"] = 0.0045  # 1.125x: within the tolerance, kept
    lat._checked.clear()
    assert curve_for(model, v, **kw) == second
    rate["s"] = 0.002
    lat._checked.clear()
    assert curve_for(model, v, check_cached=False, **kw) == second  # not checked: kept although off


def test_one_stall_does_not_end_the_walk_over_sizes(monkeypatch):
    """A forward that stalls once (20x its time: another process on a 2-core machine) at size 6 is
    timed again before it may stop the walk at ``stop_ratio``: the curve still reaches size 24."""
    import goose.verifiers.latency as lat

    clock, calls = {"t": 0.0}, {"n6": 0}

    class Stalls(ToyCausalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
            n = input_ids.shape[1]
            calls["n6"] += n == 6
            clock["t"] += 0.01 * (1 + 0.05 * n) * (20 if n == 6 and calls["n6"] == 1 else 1)
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kw)

    monkeypatch.setattr(lat.time, "perf_counter", lambda: clock["t"])
    model = Stalls(16)
    c = measure(model, _verifier(model), sizes=range(1, 25), past_len=8, repeats=1, measure_head=False)
    assert c.sizes[-1] == 24 and c(6) == pytest.approx(0.013)
    assert calls["n6"] == 2  # timed twice in round 1


def test_one_stall_does_not_price_an_anchor_size(monkeypatch):
    """An anchor is timed once; a stall there (5x) would price every long chain. Over 1.5x its guess it is
    timed again and the lower time kept: t(32) is the model's own."""
    import goose.verifiers.latency as lat

    clock, calls = {"t": 0.0}, {"n32": 0}

    class Stalls(ToyCausalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
            n = input_ids.shape[1]
            calls["n32"] += n == 32
            clock["t"] += (1.2 + 0.05 * n) * (5 if n == 32 and calls["n32"] == 1 else 1)
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kw)

    monkeypatch.setattr(lat.time, "perf_counter", lambda: clock["t"])
    model = Stalls(16)
    c = measure(model, _verifier(model), past_len=8, repeats=3, measure_head=False)
    assert 32 in c.sizes and c(32) == pytest.approx(1.2 + 0.05 * 32)
    assert calls["n32"] == 2


def test_fit_refuses_to_wrap_itself():
    with pytest.raises(goose.InvalidInputError, match="cannot wrap itself"):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="fit", policy_options={"inner": "spine-fit"})


def test_cascade_estimates_report_prediction_spine_share_and_carry_over():
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": {1: 1.0, 8: 1.5, 32: 4.0, 128: 20.0}}, budget=24,
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    out = dec.generate(prompt, max_new_tokens=60)
    assert out.token_ids == reference_greedy(prompt, 60, 16)
    st_ = out.stats.extra["policy"]
    assert st_["fit_model_misfits"] == 0
    assert 0 <= st_["fit_lead_kept"] <= st_["fit_lead_offered"] and st_["fit_lead_kept"] <= st_["fit_nodes_kept"]
    # one prediction per fitted step, each between 1 (the bonus) and 1 + the nodes kept
    assert st_["fit_steps"] <= st_["fit_predicted_tokens"] <= st_["fit_steps"] + st_["fit_nodes_kept"]
    assert st_["fit_predicted_steps_tokens"] >= st_["fit_steps"]
    pol = dec.policy
    def trials(c):
        return sum(c.spine_trials.values()) + sum(sum(v.values()) for v in c.rank_trials.values())

    seen = {r: trials(c) for r, c in pol.route_counts.items()}
    assert sum(seen.values()) > 0
    from goose.interfaces import Request
    from goose.policies.fit import CARRY

    pol.begin(Request(tuple(prompt), 16, 60, 24))  # the next generation: the counts carried, scaled
    carried = {r: trials(c) for r, c in pol.route_counts.items()}
    assert 0 < CARRY < 1 and carried == {r: v * CARRY for r, v in seen.items()}


def test_smoothed_rates_shrink_toward_the_shallower_depth_and_stay_a_distribution():
    from goose.theory.calibrate import Counts, smoothed

    c = Counts()
    c.spine_trials.update({1: 100, 2: 50, 3: 1})
    c.spine_hits.update({1: 90, 2: 45, 3: 1})
    c.rank_trials["branch"].update({1: 40, 2: 40, 3: 40})
    c.rank_hits["branch"].update({1: 2, 2: 10, 3: 0})
    m = smoothed(c, prior=0.3, weight=2.0, pool_from=8, ranks=4)
    assert m.p(1) == pytest.approx((90 + 0.6) / 102)
    assert m.p(2) == pytest.approx((45 + 2 * m.p(1)) / 52)
    assert m.p(3) == pytest.approx((1 + 2 * m.p(2)) / 3)
    assert m.p(4) == pytest.approx(m.p(3))  # no trials: the shallower rate
    q = m.rates("branch")
    assert all(a >= b for a, b in zip(q, q[1:], strict=False)) and sum(q) <= 1.0
    assert q[1] == q[0]  # rank 2's higher raw rate is capped by rank 1's


# -- the fit driven step by step: an inner policy that returns the trees a test hands it -----------------
class _Scripted(goose.TreePolicy):
    """An inner policy whose trees are the test's: ``trees`` holds the next steps' trees (None: a plain step)."""

    name = "scripted"

    def __init__(self, options=None):
        super().__init__(options)
        self.trees: list = []

    def shape(self, ctx):
        return self.trees.pop(0) if self.trees else None


class _ScriptedPlugin:
    @goose.hookimpl
    def goose_register_policies(self, register):
        register(_Scripted)


def _fit(**opts):
    """A fit policy around the scripted inner policy (registered as a plugin, as a third party would)."""
    from goose.manager import get_registry
    from goose.policies.fit import FitOptions, FitPolicy

    if "scripted" not in get_registry().names("policy"):
        goose.register_plugin(_ScriptedPlugin(), name="scripted-policy")
    return FitPolicy(FitOptions(inner="scripted", **opts))


def _step(pol, tree):
    """One step: the inner policy offers ``tree`` (None: nothing); the tree the fit returns (None: a plain step)."""
    pol.inner.trees.append(tree)
    return pol.shape(None)


def _verified(tree, path, bonus):
    """The record of a verified pass of ``tree`` that walked ``path`` and chose ``bonus`` after it."""
    import torch

    from goose.interfaces import Verified

    n = tree.num_nodes
    return Verified("tree", torch.tensor(tree.tokens), torch.full((n,), -1), torch.zeros(n, 4), (0,) * n,
                    tree, tuple(path), tuple(tree.tokens[i] for i in path[1:]), bonus)


def _chain(route, depth=3, tokens=None):
    """A chain tree on ``route`` (its kind, lead source and confidence tier), ``depth`` spine nodes deep."""
    from goose.tree import DraftTree

    toks = tuple(tokens) if tokens is not None else (7, *range(1, depth + 1))
    n = len(toks)
    sources = None if route.lead is None else ((),) + ((route.lead,),) * (n - 1)
    conf = route.tier if route.tier is not None else 0.0  # a tier's floor reaches it; 0: below every tier
    return DraftTree.build(toks, tuple(range(-1, n - 1)), "lead", None, route.kind, sources, confidence=conf)


def _rates(pol, route):
    """The spine rates the fit shapes a chain on ``route`` with (its smoothed model for that route)."""
    _step(pol, _chain(route))
    return pol.models[route].spine


def _booked(pol, tree, path, bonus):
    """Shape ``tree`` through the fit, then verify what it returned as walking ``path`` (None: every node of the
    chain it kept); the tree it returned."""
    from goose.tree import DraftTree

    got = _step(pol, tree)
    done = got if got is not None else DraftTree.single(tree.tokens[0])
    pol.observe(_verified(done, tuple(range(done.num_nodes)) if path is None else path, bonus))
    return got


# a forward of 2 or 3 tokens costs one token's, of 4 a hundred: the fit keeps two nodes of a chain
TWO = {1: 1.0, 3: 1.0, 4: 100.0}


def test_a_tree_outside_the_model_is_fitted_with_per_class_rates():
    from goose.tree import DraftTree

    two_spines = DraftTree.build([5, 1, 2, 3], [-1, 0, 0, 1], ["root", "lead", "lead", "branch"])
    pol = _fit(latency=FLAT)
    got = _step(pol, two_spines)
    assert pol.stats()["fit_model_misfits"] == 1
    assert got is two_spines  # flat latency: every node pays


# -- never slower than plain decoding ------------------------------------------------------------
# The curve seen on an AVX2-only CPU for Qwen2.5-Coder-1.5B in bfloat16 (issue 11): every node costs
# about three quarters of a one-token forward, so almost no tree pays.
LINEAR = {1: 0.198, 2: 0.344, 8: 1.25, 16: 2.40, 128: 18.8}


class _Sizes:
    """Observer: the size of every verified tree (1 for a plain step)."""

    def __init__(self):
        self.sizes = []

    @goose.hookimpl
    def goose_on_step(self, decoder, step):
        self.sizes.append(step.tree.num_nodes)


def _modeled_ratio(latency, prompts, n=48, **opts):
    """Time under the latency curve of fit's steps over greedy's (n - 1 plain steps per prompt)."""
    from goose.verifiers.latency import LatencyCurve

    items = sorted(latency.items())
    curve = LatencyCurve(tuple(k for k, _ in items), tuple(v for _, v in items))
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": latency, **opts}, budget=24,
    )
    obs = _Sizes()
    goose.register_plugin(obs, name="fit-sizes")
    try:
        cost = greedy = 0.0
        for p in prompts:
            obs.sizes.clear()
            out = dec.generate(p, max_new_tokens=n)
            assert out.token_ids == reference_greedy(p, n, 16)
            cost += sum(curve(s) for s in obs.sizes)
            greedy += (len(out.token_ids) - 1) * curve(1)
    finally:
        goose.unregister_plugin("fit-sizes")
    return cost / greedy


# prompts whose context matches mostly fail on the toy: drafts are rarely right
HARD = [[(7 * i + 3 * j) % 16 for j in range(12)] for i in range(12)]


def test_linear_curve_never_slower_than_plain_steps():
    ratio = _modeled_ratio(LINEAR, HARD)
    assert ratio <= 1.025, ratio


def test_the_previous_fit_lost_on_the_same_curve():
    """The check above can fail: an optimistic prior (every node trusted until observed wrong, as the fit
    before issue 11 started) loses on this curve."""
    ratio = _modeled_ratio(LINEAR, HARD, prior=1.0)
    assert ratio > 1.03, ratio


def test_exploration_is_small_and_within_its_share():
    from goose.policies.fit import EXPLORE_SHARE

    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit", policy_options={"latency": LINEAR}, budget=24,
    )
    obs = _Sizes()
    goose.register_plugin(obs, name="fit-sizes")
    try:
        for p in HARD:
            dec.generate(p, max_new_tokens=48)
    finally:
        goose.unregister_plugin("fit-sizes")
    # an exploration tree costs at most EXPLORE_COST (2) plain steps on the curve: one node here
    assert max(obs.sizes) == 2
    st_ = dec.policy.stats()
    assert st_["fit_explore_steps"] > 0
    assert st_["fit_explore_lost_share"] <= EXPLORE_SHARE + 1e-9


def test_flat_curve_still_pays_with_the_pessimistic_prior():
    ratio = _modeled_ratio(FLAT, [[1, 2, 3, 4] * 5, [5, 6, 7] * 6])
    assert ratio < 0.85, ratio


def test_observed_latency_corrects_the_curve(monkeypatch):
    """A measured curve that says trees are free, on a device where they are not: the observed step times
    pull the tree ratio up (the toy's real forwards cost the same at every size, so the ratio
    of observed to predicted time is far from 1 for one of the two kinds of step). A fixed curve
    (``latency``) is taken as given."""
    import goose.verifiers.latency as lat

    free = {1: 1e-6, 128: 1e-6}
    monkeypatch.setattr(lat, "curve_for", lambda model, verifier, **kw: LatencyCurve((1, 128), (1e-6, 1e-6)))
    ratios = {}
    for fixed in (False, True):
        dec = goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
                            policy_options={"latency": free} if fixed else None, budget=24)
        out = dec.generate([1, 2, 3, 4] * 5, max_new_tokens=40)
        assert out.token_ids == reference_greedy([1, 2, 3, 4] * 5, 40, 16)
        ratios[fixed] = out.stats.extra["policy"]["fit_latency_ratio_tree"]
    # a microsecond per forward is far below what a Python forward costs: the measured curve's tree ratio grew
    assert ratios[False] > 2.0 and ratios[True] == 1.0


def test_the_curve_is_keyed_by_the_cpu_and_its_kernel_limits(monkeypatch):
    """A cache shared between machines, or kernels limited to AVX2, must not reuse another curve."""
    from goose.verifiers import latency
    from goose.verifiers import machine

    model = ToyCausalLM(16)
    v = _verifier(model)
    base = latency.curve_path(model, v)
    assert latency.curve_path(model, v) == base  # stable
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    limited = latency.curve_path(model, v)
    assert limited != base
    assert "kernels limited by ONEDNN_MAX_CPU_ISA=AVX2" in machine.describe()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    other = dict(machine.cpu(), model="AMD EPYC 7B13", flags=["avx2"])
    monkeypatch.setattr(machine, "cpu", lambda: other)
    assert latency.curve_path(model, v) not in (base, limited)


def test_head_rows_pads_to_the_cheapest_measured_count():
    """A head whose GEMM is slow from 4 to 15 rows and fast at 16 (Gemma-3-270M's on an AMX Xeon)."""
    c = LatencyCurve((1,), (0.1,), head=((1, 0.035), (2, 0.04), (4, 0.08), (8, 0.125), (16, 0.08), (32, 0.105)))
    # 3 rows: 60 ms by interpolation, under every measured count above; 5-15: 16 rows (80 ms) are cheaper;
    # 17: 82 ms by interpolation against 32 rows' 105 ms; 4: a tie with 16 keeps the fewer rows
    assert [c.head_rows(k) for k in (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 32)] == [1, 2, 3, 4, 16, 16, 16, 16, 16, 17, 32]
    assert c.head_rows(33) == 33 and c.head_rows(200) == 200  # past the last measured count: as asked
    assert LatencyCurve((1,), (0.1,)).head_rows(7) == 7  # not measured: as asked
    # the allowance counts what is run: 19 rows (85 ms by interpolation from 16) fit in 35 + 50 ms, where
    # 8 rows' measured 125 ms would have stopped an interpolation from below
    assert c.head_rows_within(0.05) == 19 and c.head_rows_within(0.02) == 2


def test_head_rows_within_an_allowance():
    c = LatencyCurve((1, 2), (0.2, 0.4), head=((1, 0.01), (8, 0.08), (32, 0.32)))  # 10 ms a row
    assert c.head_rows_within(0.2) == 21 and c.head_rows_within(0.05) == 6 and c.head_rows_within(0.0) == 1
    assert c.head_rows_within(0.31) == 32 and all(c.head_rows(k) == k for k in range(1, 40))  # monotone: no padding
    assert c.head_rows_within(1.0) == 101  # past the last measured count: in proportion
    assert LatencyCurve((1,), (0.2,)).head_rows_within(1.0) is None  # not measured: no limit
    assert LatencyCurve.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("per_row,rows", [(0.1, 3), (1e-6, 200)])
def test_fit_keeps_the_prefill_logit_rows_within_one_plain_step(monkeypatch, per_row, rows):
    """A costly LM head row (an AVX2-only CPU in bfloat16): the prefill computes only what one step pays for."""
    import goose.verifiers.latency as lat

    curve = LatencyCurve((1, 2, 4), (0.2, 0.4, 0.8), head=tuple((r, 0.01 + (r - 1) * per_row) for r in (1, 2, 4, 8, 32)))
    monkeypatch.setattr(lat, "curve_for", lambda model, verifier, **kw: curve)
    model = ToyCausalLM(16)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit")
    prompt = [(i * 7 + i // 5) % 16 for i in range(200)]
    out = dec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == reference_greedy(prompt, 30, 16)
    assert out.stats.extra["prefill_logit_rows"] == rows  # 0.2 s / 0.1 s a row -> 1 + 2 rows; cheap: TR's 200
    # a fixed curve says nothing of the LM head's cost: as many rows as the sources ask
    fixed = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", policy_options={"latency": FLAT})
    assert fixed.generate(prompt, max_new_tokens=4).stats.extra["prefill_logit_rows"] == 200


def test_calibration_leaves_torch_global_generator_alone():
    """fit calibrates on first use, inside a generate the caller may have seeded: no global draws."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    v = _verifier(model)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    c = measure(model, v, sizes=(1, 2, 4), past_len=16, repeats=1)
    assert c.head and c.head[0][0] == 1  # the LM head was timed
    assert torch.equal(torch.get_rng_state(), before)


class _Oracle(goose.DraftSource):
    """A chain source that is always right, 16 tokens deep: the source that has earned long chains."""

    name = "oracle"

    def propose(self, state):
        return goose.Proposal.chain(self.name, reference_greedy(list(state.tokens), 16, 16), confidence=0.5)


CONCAVE = {1: 1.0, 2: 1.3, 4: 1.8, 8: 2.6, 16: 4.5, 128: 40.0}


def _oracle_run(shadow):
    dec = goose.compose(
        ToyCausalLM(16), None, sources=[_Oracle(), "tr"], policy="spine-fit",
        policy_options={"latency": CONCAVE, "shadow": shadow}, budget=24,
    )
    out = dec.generate([3, 1, 4, 1, 5], max_new_tokens=80)
    assert out.token_ids == reference_greedy([3, 1, 4, 1, 5], 80, 16)
    return out


def test_shadow_trials_let_an_earned_chain_grow():
    """The spine rate one depth past the verified spine is learned from the target's next token, so
    a source that is always right gets its deep chain within a few steps; without it the cascade
    learns a depth only once it already drafts there."""
    on, off = _oracle_run(True), _oracle_run(False)
    pol_on = on.stats.extra["policy"]
    assert pol_on["fit_shadow_trials"] > 0 and off.stats.extra["policy"]["fit_shadow_trials"] == 0
    assert on.stats.forward_passes < off.stats.forward_passes, (on.stats.forward_passes, off.stats.forward_passes)


def test_hindsight_trials_follow_the_committed_tokens_of_later_steps():
    """A cut spine keeps being checked, depth by depth, against what the following steps commit,
    until its first miss, and at most SHADOW_DEPTH depths past the kept spine."""
    from goose.policies.fit import SHADOW_DEPTH, Route
    from goose.tree import DraftTree

    spine = (1, 2, 3, 4, 5, 6, 7)
    full = DraftTree.build((9, *spine), (-1, 0, 1, 2, 3, 4, 5, 6), "lead", route="path")
    kept = full.subtree([0, 1, 2])

    def run(later, spine=spine):
        full = DraftTree.build((9, *spine), tuple(range(-1, len(spine))), "lead", route="path")
        pol = _fit(latency=TWO)
        # the fit kept 2 of the spine nodes; depth 3 right (the bonus)
        assert _booked(pol, full, (0, 1, 2), spine[2]) == full.subtree([0, 1, 2])
        for bonus in later:  # plain steps, each committing one token; they shape no spine of their own
            assert _step(pol, None) is None
            pol.observe(_verified(DraftTree.single(9), (0,), bonus))
        c = pol.route_counts[Route("path")]
        # depths past the kept spine (1 and 2 are booked by the verified tree itself)
        return ({d: c.spine_trials[d] for d in range(3, len(spine) + 2) if c.spine_trials[d]},
                {d: c.spine_hits[d] for d in range(3, len(spine) + 2) if c.spine_hits[d]})

    # 4 and 5 right, 0 wrong at depth 6: trials stop there, the later 6 and 7 are not booked
    assert run((4, 5, 0, 6, 7)) == ({3: 1, 4: 1, 5: 1, 6: 1}, {3: 1, 4: 1, 5: 1})
    # all right: booked up to the spine's end (depth 7), nothing past it
    assert run((4, 5, 6, 7, 8)) == ({3: 1, 4: 1, 5: 1, 6: 1, 7: 1}, {3: 1, 4: 1, 5: 1, 6: 1, 7: 1})
    # at most SHADOW_DEPTH depths past the kept spine, however long the spine and however long it holds
    long = tuple(range(1, SHADOW_DEPTH + 8))
    trials, hits = run(long[3:], spine=long)
    assert sorted(trials) == sorted(hits) == list(range(3, 2 + SHADOW_DEPTH + 1))
    # a tree step's walk and bonus feed the open spine in order
    pol = _fit(latency=TWO)
    _booked(pol, full, (0, 1, 2), 3)
    walk = DraftTree.build((3, 4, 5), (-1, 0, 1), "lead", route="path")  # its own spine kept whole: no new check
    assert _booked(pol, walk, (0, 1, 2), 6) == walk  # commits 4, 5, then the bonus 6: depths 4, 5, 6 right
    c = pol.route_counts[Route("path")]
    assert [c.spine_hits[d] for d in range(3, 8)] == [1, 1, 1, 1, 0] and c.spine_trials[7] == 0
    assert pol.stats()["fit_shadow_trials"] == 4


def test_a_chain_that_continues_an_open_spine_is_shaped_from_the_depth_it_has_reached():
    """``continuation``: when this step's spine is the next tokens of an earlier spine still being checked
    (K of its tokens committed, all right), the tree is shaped with that route's p_{K+1}, p_{K+2}, ...;
    a chain that departs from it, or an exhausted check, is a fresh chain (p_1, p_2, ...).

    The route's first depth is rarely right (3 of 10), its deeper ones always (3 of 3): on a curve where a
    node pays only when likely, a fresh chain keeps at most its first node, a continued one all of them."""
    from goose.policies.fit import Route
    from goose.tree import DraftTree

    old = (11, 12, 13, 14, 15, 16, 17, 18)

    def after_a_plain_step(continuation=True):
        """A policy that has seen ``old`` offered on a plain step (no node paid) whose token was old[0]."""
        pol = _fit(latency={1: 1.0, 128: 1.0 + 0.3 * 127}, continuation=continuation)
        c = pol.route_counts[Route("path")]
        for d, (t, h) in enumerate([(10, 3), (3, 3), (3, 3), (3, 3), (3, 3), (3, 3)], start=1):
            c.spine_trials[d], c.spine_hits[d] = t, h
        assert _booked(pol, _chain(Route("path"), tokens=(9, *old)), (0,), old[0]) is None  # the fallback
        assert pol.stats()["fit_fallback_steps"] == 1 and pol.stats()["fit_shadow_trials"] == 1
        return pol

    def shaped(pol, spine):
        got = _step(pol, _chain(Route("path"), tokens=(old[0], *spine)))
        return (0 if got is None else got.num_nodes - 1), pol.stats()["fit_continued_steps"]

    # the next 7 tokens of the spine still being checked (1 committed): shaped from p_2 on, kept whole
    assert shaped(after_a_plain_step(), old[1:]) == (7, 1)
    # departs from it (the second token differs): a fresh chain, from p_1
    fresh = shaped(after_a_plain_step(), (12, 99, 14, 15, 16, 17, 18))
    assert fresh[1] == 0 and fresh[0] <= 1
    assert shaped(after_a_plain_step(continuation=False), old[1:]) == fresh  # off: every chain is fresh
    # a check that has committed the whole spine is over: nothing left to continue
    pol = after_a_plain_step()
    walked = DraftTree.build((old[0], *old[1:]), tuple(range(-1, 7)), "lead", route="path")
    pol.inner.trees.append(walked)
    got = pol.shape(None)
    pol.observe(_verified(got, tuple(range(got.num_nodes)), 19))  # every kept token right, and the bonus
    assert shaped(pol, (19, 20, 21))[1] == 1  # continued before (the step above), not now


def test_continuation_makes_an_always_right_chain_cheaper_and_changes_no_token():
    def passes(cont):
        dec = goose.compose(ToyCausalLM(16), None, sources=[_Oracle(), "tr"], policy="spine-fit",
                            policy_options={"latency": CONCAVE, "continuation": cont}, budget=24)
        out = dec.generate([3, 1, 4, 1, 5], max_new_tokens=80)
        assert out.token_ids == reference_greedy([3, 1, 4, 1, 5], 80, 16)
        return out.stats.forward_passes, out.stats.extra["policy"]["fit_continued_steps"]

    (on, continued), (off, none) = passes(True), passes(False)
    assert continued > 0 and none == 0
    assert on < off, (on, off)


def test_shadow_trial_is_booked_one_depth_past_the_kept_spine():
    from goose.policies.fit import Route
    from goose.tree import DraftTree

    full = DraftTree.build((9, 1, 2, 3, 4), (-1, 0, 1, 2, 3), "lead", route="path")
    kept = full.subtree([0, 1, 2])
    pol = _fit(latency=TWO)
    for bonus, hits in ((3, 1), (7, 1)):  # the cut spine token 3 is right, then wrong
        assert _booked(pol, full, (0, 1, 2), bonus) == kept  # the fit kept 2 of 4 spine nodes
        c = pol.route_counts[Route("path")]
        assert c.spine_hits[3] == hits
    assert c.spine_trials[3] == 2
    # a walk that broke inside the kept spine says nothing about depth 3
    _booked(pol, full, (0, 1), 5)
    assert c.spine_trials[3] == 2
    # a plain step (the fit kept nothing): depth 1, against the bonus
    pol = _fit(latency=STEEP)
    assert _booked(pol, full, (0,), 1) is None
    c = pol.route_counts[Route("path")]
    assert (c.spine_trials[1], c.spine_hits[1]) == (1, 1) and pol.stats()["fit_fallback_steps"] == 1


def test_a_route_starts_from_what_its_lead_source_earned_on_the_other_routes():
    """The bypass chain of a source that has earned depth on the spine route starts from those rates,
    not from the prior; another source's routes and the non-bypass routes start from the prior."""
    from goose.policies.fit import Route

    def model(route):
        pol = _fit(latency=FLAT)
        c = pol.route_counts[Route("branched", "pld")]
        for d in range(1, 21):  # pld right 10 times out of 10 at every depth to 20
            c.spine_trials[d] += 10
            c.spine_hits[d] += 10
        return _rates(pol, route)

    earned, fresh = model(Route("bypassed", "pld")), model(Route("bypassed", "suffix"))
    assert fresh[0] == pytest.approx(0.1) and fresh[19] == pytest.approx(0.1)  # another source earned nothing: the prior
    assert earned[0] > 0.8 and earned[19] > 0.8  # what pld earned on the spine route
    assert model(Route("branched"))[0] == pytest.approx(0.1)  # a route without a lead source
    # only the bypass route borrows: the spine and chain routes (TR's branches compete, or not) stay apart
    assert model(Route("path", "pld"))[0] == pytest.approx(0.1)
    pol = _fit(latency=FLAT)
    pol.route_counts[Route("bypassed", "pld")].spine_trials[1] += 10
    pol.route_counts[Route("bypassed", "pld")].spine_hits[1] += 10
    assert _rates(pol, Route("branched", "pld"))[0] == pytest.approx(0.1)


# -- where a context match's trust starts: pld's confidence tiers (source_priors) -------------------
def test_smoothed_rates_start_a_tier_at_its_calibrated_rates():
    """``start=(a, b)``: p_1 toward a; deeper depths toward the larger of b and the shallower estimate."""
    from goose.theory.calibrate import Counts, smoothed

    m = smoothed(Counts(), prior=0.1, weight=2.0, pool_from=8, ranks=4, start=(0.4, 0.85))
    assert m.p(1) == pytest.approx(0.4) and m.p(2) == pytest.approx(0.85) and m.p(8) == pytest.approx(0.85)
    c = Counts()
    c.spine_trials.update({1: 10, 2: 10})
    c.spine_hits.update({1: 10, 2: 10})
    m = smoothed(c, prior=0.1, weight=2.0, pool_from=8, ranks=4, start=(0.4, 0.85))
    assert m.p(1) == pytest.approx((10 + 0.8) / 12)
    assert m.p(3) == pytest.approx(m.p(2)) and m.p(3) > 0.85  # earned higher than b: the shallower rate
    c = Counts()
    c.spine_trials.update({1: 10})
    c.spine_hits.update({1: 0})
    m = smoothed(c, prior=0.1, weight=2.0, pool_from=8, ranks=4, start=(0.4, 0.85))
    assert m.p(1) == pytest.approx(0.8 / 12) and m.p(2) == pytest.approx(0.85)  # a miss at depth 1 says nothing deeper


PLD_TIERS = {"pld": [(1.0, 0.7, 0.9), (0.7, 0.45, 0.9)]}  # the tiers these tests were written with


def test_a_chain_is_keyed_and_started_by_its_confidence_tier():
    from goose.policies.fit import Route
    from goose.tree import DraftTree

    def tree(conf, source="pld", route="branched"):
        return DraftTree.build((7, 1, 2, 3), (-1, 0, 1, 2), ("root", "lead", "lead", "lead"), None, route,
                               ((), (source,), (source,), (source,)), confidence=conf)

    def keyed(t, tiers):
        """The route the fit keys ``t``'s rates by (the one whose rates it shaped ``t`` with)."""
        pol = _fit(latency=FLAT, source_priors=tiers)
        _step(pol, t)
        (route,) = pol.models
        return route

    tiers = PLD_TIERS
    assert keyed(tree(1.0), tiers) == Route("branched", "pld", 1.0)
    assert keyed(tree(0.82), tiers) == Route("branched", "pld", 0.7)
    assert keyed(tree(0.3), tiers) == Route("branched", "pld")  # below every tier: the source's plain route
    assert keyed(tree(1.0, "suffix"), tiers) == Route("branched", "suffix")  # no tiers for that source
    assert keyed(tree(1.0), {}) == Route("branched", "pld")  # tiers off: one route per source
    assert keyed(tree(1.0, route="bypassed"), tiers) == Route("bypassed", "pld", 1.0)
    # str() writes a route as kind@lead^tier
    written = [str(keyed(tree(c), tiers)) for c in (1.0, 0.82, 0.3)]
    assert written == ["branched@pld^1", "branched@pld^0.7", "branched@pld"]
    assert str(Route("branched")) == "branched"
    pol = _fit(latency=FLAT, source_priors={"pld": [(0.7, 0.3, 0.9), (1.0, 0.6, 0.95)]})
    assert pol.options.source_priors["pld"][0][0] == 1.0  # the highest tier a confidence reaches wins
    assert _rates(pol, Route("branched", "pld", 1.0))[:3] == pytest.approx((0.6, 0.95, 0.95))
    assert _rates(pol, Route("branched", "pld", 0.7))[:2] == pytest.approx((0.3, 0.9))
    assert _rates(pol, Route("branched", "pld"))[0] == pytest.approx(0.1)  # untiered: the pessimistic prior
    # a tier's bypass route borrows depth 1 only from the same tier of its source
    before = _rates(pol, Route("bypassed", "pld", 0.7))[0]  # its model made before the counts change
    for _ in range(20):  # tier-0.7 chains wrong at depth 1, twenty times
        _booked(pol, tree(0.82), (0,), 9)
    assert pol.route_counts[Route("branched", "pld", 0.7)].spine_trials[1] == 20
    assert _rates(pol, Route("bypassed", "pld", 1.0))[0] == pytest.approx(0.6)
    assert _rates(pol, Route("bypassed", "pld", 0.7))[0] < 0.1 < before


def test_a_bypass_route_borrows_its_deeper_depths_from_every_tier_of_its_source():
    """Depth 1 is where a tier's chains start (its own tier's counts, else its calibrated p_1); the rate of
    depth d given d - 1 is the source's (every tier pooled), so a consensus match that carries on a loop the
    long matches have held through starts with that depth."""
    from goose.policies.fit import Route

    def rates(other=Route("branched", "pld", 0.7)):
        pol = _fit(latency=FLAT, source_priors=PLD_TIERS)
        _rates(pol, Route("bypassed", "pld", 1.0))  # made before the counts change: observing them must renew it
        deep = _chain(other, depth=40)
        for _ in range(20):  # the other route's chains missed depth 1 half the time, else held as deep as kept
            _booked(pol, deep, None, 5)
            _booked(pol, deep, (0,), 5)
        c = pol.route_counts[other]
        assert (c.spine_trials[1], c.spine_hits[1]) == (40, 20) and c.spine_hits[2] == c.spine_trials[2] == 20
        if other.lead == "pld":  # every one of the 40 depths kept and right
            assert c.spine_trials[40] == c.spine_hits[40] == 20
        return _rates(pol, Route("bypassed", "pld", 1.0))

    pooled = rates()
    assert pooled[0] == pytest.approx(0.7)  # depth 1: tier 1.0's calibrated start, not 0.5
    assert pooled[1] > 0.99 and pooled[31] > 0.99  # the depth tier 0.7 earned
    # another source's depth is not pld's: the calibrated floor only
    other = rates(other=Route("branched", "suffix"))
    assert other[0] == pytest.approx(0.7) and other[1] == pytest.approx(0.9) and other[31] == pytest.approx(0.9)


class _Named(goose.DraftSource):
    """A chain source of any name: the toy's next 6 tokens (``right``) or the same with the first one wrong,
    at confidence 1.0, proposed only at context lengths of one parity, so each step has one chain source."""

    def __init__(self, name, right, parity):
        super().__init__()
        self.name, self.right, self.parity = name, right, parity

    def propose(self, state):
        if len(state.tokens) % 2 != self.parity:
            return None
        toks = reference_greedy(list(state.tokens), 6, 16)
        if not self.right:
            toks[0] = (toks[0] + 1) % 16
        return goose.Proposal.chain(self.name, toks, confidence=1.0)


@pytest.mark.parametrize("name, other, priors", [
    ("pld^1", "pld", None),  # pld's tiers: its tier-1.0 route is written spine@pld^1 as well
    ("my@src^1", "my@src", {"my@src": [(1.0, 0.7, 0.9)]}),  # written alike too
    ("my@src^2", "my@src", {"my@src": [(1.0, 0.7, 0.9)]}),  # written apart, but read as my@src's
])
def test_a_source_whose_name_looks_like_a_route_keeps_its_own_rates(name, other, priors):
    """Rates are keyed by Route (kind, lead source, tier), not by the string it is written as: a source
    named ``name`` (no tiers of its own), whose routes are written ``spine@<name>``, is learned apart
    from ``other``'s tier-1.0 chains, and rates booked on either one's routes stay out of the other's
    bypass route; the output is greedy's."""
    from goose.policies.fit import Route

    opts = {"latency": FLAT, "source_priors": PLD_TIERS if priors is None else priors}
    dec = goose.compose(ToyCausalLM(16), None, sources=[_Named(name, True, 0), _Named(other, False, 1), "tr"],
                        policy="spine-fit", policy_options=opts, budget=24)
    prompt = [3, 1, 4, 1, 5]
    out = dec.generate(prompt, max_new_tokens=60)
    assert out.token_ids == reference_greedy(prompt, 60, 16)
    depth1: dict = {}  # (lead, tier) -> (trials, hits) at depth 1, over every route kind
    for r, c in dec.policy.route_counts.items():
        t, h = depth1.get((r.lead, r.tier), (0, 0))
        depth1[(r.lead, r.tier)] = (t + c.spine_trials.get(1, 0), h + c.spine_hits.get(1, 0))
    assert {lead for lead, _ in depth1} <= {None, name, other}
    t, h = depth1[(name, None)]
    assert t > 0 and h == t, depth1  # always right, on its own untiered routes
    t, h = depth1[(other, 1.0)]
    assert t > 0 and h == 0, depth1  # always wrong at depth 1, on its tier-1.0 routes

    def bypasses(booked):
        """Both sources' bypass rates after 20 right chains, 20 deep, on the route ``booked``."""
        pol = _fit(**opts)
        deep = _chain(booked, depth=20)
        for _ in range(20):
            _booked(pol, deep, None, 5)
        return _rates(pol, Route("bypassed", other, 1.0)), _rates(pol, Route("bypassed", name))

    fresh_other, fresh_name = bypasses(Route("branched", "elsewhere"))
    assert bypasses(Route("branched", name))[0] == fresh_other
    assert bypasses(Route("branched", other, 1.0))[1] == fresh_name
    assert bypasses(Route("path", other))[0][1] > fresh_other[1]  # a route of the same source: borrowed


@pytest.mark.parametrize("tiers", [
    {"pld": [(1.0, 1.5, 0.9)]}, {"pld": [(1.0, 0.5)]}, {"pld": [(-0.1, 0.5, 0.9)]},
])
def test_malformed_tiers_are_refused(tiers):
    with pytest.raises(goose.InvalidInputError, match="source_priors"):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
                      policy_options={"source_priors": tiers, "latency": FLAT})


class _Copy(goose.DraftSource):
    """Always right, 16 tokens deep, with a confidence that says so (tier 1.0): a match that can be trusted."""

    name = "copy"

    def propose(self, state):
        return goose.Proposal.chain(self.name, reference_greedy(list(state.tokens), 16, 16), confidence=1.0)


def test_a_trusted_tier_drafts_its_first_chain_deep():
    """A fresh decoder meets a confidence-1.0 chain: with its tier's calibrated start the first step
    keeps most of the chain; from the pessimistic prior only the chain's first tokens."""
    def first_spine(tiers):
        dec = goose.compose(ToyCausalLM(16), None, sources=[_Copy(), "tr"], policy="spine-fit",
                            policy_options={"latency": CONCAVE, "source_priors": tiers}, budget=24)
        seen = []

        class Hook:
            @goose.hookimpl
            def goose_on_step(self, decoder, step):
                if decoder is dec and step.tree.num_nodes > 1 and not seen:
                    seen.append(sum(1 for o in step.tree.origins if o == "lead"))

        goose.register_plugin(Hook(), name="tier-probe")
        try:
            out = dec.generate([3, 1, 4, 1, 5], max_new_tokens=40)
        finally:
            goose.unregister_plugin("tier-probe")
        assert out.token_ids == reference_greedy([3, 1, 4, 1, 5], 40, 16)
        return seen[0], out.stats.forward_passes

    trusted, cold = first_spine({"copy": [(1.0, 0.8, 0.95)]}), first_spine({})
    assert trusted[0] >= 8 and cold[0] <= 2, (trusted, cold)
    assert trusted[1] < cold[1]
