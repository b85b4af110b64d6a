"""The device-fitted policy: lossless, prunes to what pays on the given latency curve, falls back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.verifiers.latency import LatencyCurve, curve_for, measure
from goose.testing import ToyCausalLM, reference_greedy

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
    out = run([1, 2, 3, 4] * 5, 60, STEEP, prior=0.3, explore_every=1000)
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
    c = measure(m, sizes=(1, 2, 4), past_len=16, repeats=1)
    assert c.sizes == (1, 2, 4) and all(t > 0 for t in c.seconds)
    c1 = curve_for(m)
    c2 = curve_for(m)  # second call: from the cache file
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
    return clock, Slow(16)


def test_measure_stops_where_trees_cannot_pay_and_reports_progress(monkeypatch):
    """A model whose forward costs grow with every token: measuring stops at stop_ratio x t(1).

    The clock is the model's own (each forward advances it by 2 ms a token), so the test does not
    depend on the machine's load."""
    clock, model = _clocked_toy(monkeypatch, 0.002)
    lines = []
    c = measure(model, past_len=8, repeats=2, stop_ratio=4.0, progress=lines.append)
    assert c.sizes == (1, 2, 3, 4, 5)  # 5 tokens cost 5 > 4 x t(1): the last size measured
    assert c.seconds == pytest.approx((0.002, 0.004, 0.006, 0.008, 0.010))
    assert any("size 1:" in x for x in lines) and any("round 2/2" in x for x in lines)
    assert c(64) > c(c.sizes[-1])  # extended in proportion past the last size


def test_measure_keeps_to_its_time_budget_on_a_slow_steep_model(monkeypatch):
    """0.3 s a token (a 1.5B model on an AVX2-only CPU): measuring ends within 30 s, before size 16."""
    clock, model = _clocked_toy(monkeypatch, 0.3)
    lines = []
    c = measure(model, past_len=8, repeats=3, stop_ratio=100.0, progress=lines.append)  # the ratio never stops it
    assert clock["t"] <= 25.0  # the budget (the limit for first use is 30 s)
    walked = [n for n in c.sizes if n == 1 or c.sizes[c.sizes.index(n) - 1] == n - 1]  # the contiguous walk
    assert 4 <= walked[-1] < 16 and any("time budget reached" in x for x in lines)
    assert set(c.sizes) - set(walked) <= {32, 16, 8, 24, 12}  # anchors only where the budget allowed them
    assert c(64) == pytest.approx(64 * c(1), rel=0.05)  # in proportion, as this toy's cost is


def test_a_budget_stopped_curve_times_larger_anchor_sizes_instead_of_extending_in_proportion(monkeypatch):
    """A forward with a large fixed cost (1 s, plus 20 ms a token: a big model whose weights are read
    once per pass): the walk stops early for the budget, and anchors up to 64 are timed once, so a
    48-token chain is priced near its real 1.96 s, not the 7.8 s a proportional extension gives."""
    clock, model = _clocked_toy(monkeypatch, 0.02, fixed=1.0)
    lines = []
    c = measure(model, past_len=8, repeats=3, progress=lines.append, measure_head=False)
    assert clock["t"] <= 25.0
    assert c.sizes[-1] == 64 and 32 in c.sizes and max(n for n in c.sizes if n < 8) < 8
    assert c(48) == pytest.approx(1.96, rel=0.02)
    assert any("then sizes 8, 16, 24, 32, 48, 64" in x for x in lines)


def test_anchor_sizes_are_guessed_on_the_line_through_t1_not_in_proportion(monkeypatch):
    """A 1.5B model on a slow machine (1.2 s a pass, plus 50 ms a token): the walk ends at size 4 for the
    budget; guessed in proportion from t(4) (1.4 s), size 32 would take 11 s and was never timed (Qwen2.5-
    Coder's curve on an earlier session's machine: sizes 1-4, a 52-token chain priced at 11 s); on the
    line through t(1) and t(4) it takes its real 2.8 s, and both 32 and 64 fit in the budget."""
    clock, model = _clocked_toy(monkeypatch, 0.05, fixed=1.2)
    c = measure(model, past_len=8, repeats=3, measure_head=False)
    assert clock["t"] <= 25.0
    assert max(n for n in c.sizes if n < 8) == 4 and {32, 64} <= set(c.sizes)
    assert c(48) == pytest.approx(1.2 + 0.05 * 48, rel=0.02)


def test_a_budget_stopped_walk_times_anchors_between_its_end_and_64(monkeypatch):
    """A big model (1 s a pass, 20 ms a token) whose passes of 7-15 tokens cost 0.4 s more (Qwen2.5-Coder
    with stock linears: 13 rows 1.05 s, 16 rows 0.78 s): the walk ends at size 5 for the budget, and its
    rest times 8, 16, 24, 48 besides 32 and 64, so a 12-token tree is priced from t(8) and t(16)
    (1.44 s), not on the line from t(5) to t(32) (1.27 s)."""
    clock, model = _clocked_toy(monkeypatch, 0.02, fixed=1.0, extra=lambda n: 0.4 if 7 <= n <= 15 else 0.0)
    lines = []
    c = measure(model, past_len=8, repeats=3, measure_head=False, progress=lines.append)
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
    kw = dict(sizes=(1, 2, 4, 8), past_len=8, repeats=1, measure_head=False)
    first = curve_for(model, **kw)
    assert first(1) == pytest.approx(0.002) and first(4) == pytest.approx(0.008)
    capsys.readouterr()
    lat._checked.clear()  # a new process, same machine: the check passes, the cached curve is kept
    assert curve_for(model, **kw) == first
    assert "does not hold" not in capsys.readouterr().err
    assert lat.check(model, first, past_len=8) == []
    rate["s"] = 0.004  # another machine, twice as slow
    off = lat.check(model, first, past_len=8)
    assert [n for n, _, _ in off] == [1, 4] and off[0][2] == pytest.approx(0.004)
    assert curve_for(model, **kw) == first  # checked once per process: this one already was
    lat._checked.clear()
    second = curve_for(model, **kw)
    err = capsys.readouterr().err
    assert "disagrees (t(1) 2.0 ms cached, 4.0 ms now, t(4) 8.0 ms cached, 16.0 ms now" in err
    assert second(1) == pytest.approx(0.004) and lat.cached_curve(model) == second  # measured and cached
    rate["s"] = 0.0045  # 1.125x: within the tolerance, kept
    lat._checked.clear()
    assert curve_for(model, **kw) == second
    rate["s"] = 0.002
    lat._checked.clear()
    assert curve_for(model, check_cached=False, **kw) == second  # not checked: kept although off


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
    c = measure(Stalls(16), sizes=range(1, 25), past_len=8, repeats=1, measure_head=False)
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
    c = measure(Stalls(16), past_len=8, repeats=3, measure_head=False)
    assert 32 in c.sizes and c(32) == pytest.approx(1.2 + 0.05 * 32)
    assert calls["n32"] == 2


def test_fit_refuses_to_wrap_itself():
    with pytest.raises(goose.InvalidInputError, match="cannot wrap itself"):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="fit", policy_options={"inner": "spine-fit"})


def test_cascade_estimates_report_prediction_spine_share_and_carry_over():
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": {1: 1.0, 8: 1.5, 32: 4.0, 128: 20.0}, "carry": 0.5}, budget=24,
    )
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 4
    out = dec.generate(prompt, max_new_tokens=60)
    assert out.token_ids == reference_greedy(prompt, 60, 16)
    st_ = out.stats.extra["policy"]
    assert st_["fit_model_misfits"] == 0
    assert 0 <= st_["fit_spine_kept"] <= st_["fit_spine_offered"] and st_["fit_spine_kept"] <= st_["fit_nodes_kept"]
    # one prediction per fitted step, each between 1 (the bonus) and 1 + the nodes kept
    assert st_["fit_steps"] <= st_["fit_predicted_tokens"] <= st_["fit_steps"] + st_["fit_nodes_kept"]
    assert st_["fit_predicted_steps_tokens"] >= st_["fit_steps"]
    pol = dec.policy
    def trials(c):
        return sum(c.spine_trials.values()) + sum(sum(v.values()) for v in c.rank_trials.values())

    seen = {r: trials(c) for r, c in pol.route_counts.items()}
    assert sum(seen.values()) > 0
    from goose.interfaces import Request

    pol.begin(Request(tuple(prompt), 16, 60, 24))
    carried = {r: trials(c) for r, c in pol.route_counts.items()}
    assert carried == {r: v * 0.5 for r, v in seen.items()}


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


def test_a_tree_outside_the_model_is_fitted_with_per_class_rates():
    from goose.tree import DraftTree
    from goose.policies.fit import FitOptions, FitPolicy

    two_spines = DraftTree.build([5, 1, 2, 3], [-1, 0, 0, 1], ["root", "spine", "spine", "branch"])

    class Stub:
        def shape(self, ctx):
            return two_spines

    pol = FitPolicy(FitOptions(latency=FLAT))
    pol.inner = Stub()
    got = pol.shape(None)
    assert pol.counts["model_misfits"] == 1
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
    """The check above can fail: an optimistic prior with full-tree exploration (the fit before
    issue 11) loses on this curve."""
    ratio = _modeled_ratio(LINEAR, HARD, prior=0.3, explore_share=1.0, explore_cost=1000.0)
    assert ratio > 1.03, ratio


def test_exploration_is_small_and_within_its_share():
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": LINEAR, "explore_every": 1}, budget=24,
    )
    obs = _Sizes()
    goose.register_plugin(obs, name="fit-sizes")
    try:
        for p in HARD:
            dec.generate(p, max_new_tokens=48)
    finally:
        goose.unregister_plugin("fit-sizes")
    # an exploration tree costs at most explore_cost (2) plain steps on the curve: one node here
    assert max(obs.sizes) == 2
    st_ = dec.policy.stats()
    assert st_["fit_explore_steps"] > 0
    assert st_["fit_explore_lost_share"] <= 0.02 + 1e-9


def test_flat_curve_still_pays_with_the_pessimistic_prior():
    ratio = _modeled_ratio(FLAT, [[1, 2, 3, 4] * 5, [5, 6, 7] * 6])
    assert ratio < 0.85, ratio


def test_observed_latency_corrects_the_curve():
    """A curve that says trees are free, on a device where they are not: the observed step times
    pull the tree ratio up (the toy's real forwards cost the same at every size, so the ratio
    of observed to predicted time is far from 1 for one of the two kinds of step)."""
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": {1: 1e-6, 128: 1e-6}, "correct_latency": True}, budget=24,
    )
    out = dec.generate([1, 2, 3, 4] * 5, max_new_tokens=40)
    assert out.token_ids == reference_greedy([1, 2, 3, 4] * 5, 40, 16)
    st_ = out.stats.extra["policy"]
    # a microsecond per forward is far below what a Python forward costs: the tree ratio grew
    assert st_["fit_latency_ratio_tree"] > 2.0


def test_the_curve_is_keyed_by_the_cpu_and_its_kernel_limits(monkeypatch):
    """A cache shared between machines, or kernels limited to AVX2, must not reuse another curve."""
    from goose.verifiers import latency
    from goose.verifiers import machine

    model = ToyCausalLM(16)
    base = latency._key(model)
    assert latency._key(model) == base  # stable
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    limited = latency._key(model)
    assert limited != base
    assert "kernels limited by ONEDNN_MAX_CPU_ISA=AVX2" in machine.describe()
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    other = dict(machine.cpu(), model="AMD EPYC 7B13", flags=["avx2"])
    monkeypatch.setattr(machine, "cpu", lambda: other)
    assert latency._key(model) not in (base, limited)


def test_head_rows_pads_to_the_cheapest_measured_count():
    """A head whose GEMM is slow from 4 to 15 rows and fast at 16 (Gemma-3-270M's on an AMX Xeon)."""
    c = LatencyCurve((1,), (0.1,), (), ((1, 0.035), (2, 0.04), (4, 0.08), (8, 0.125), (16, 0.08), (32, 0.105)))
    # 3 rows: 60 ms by interpolation, under every measured count above; 5-15: 16 rows (80 ms) are cheaper;
    # 17: 82 ms by interpolation against 32 rows' 105 ms; 4: a tie with 16 keeps the fewer rows
    assert [c.head_rows(k) for k in (1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 32)] == [1, 2, 3, 4, 16, 16, 16, 16, 16, 17, 32]
    assert c.head_rows(33) == 33 and c.head_rows(200) == 200  # past the last measured count: as asked
    assert LatencyCurve((1,), (0.1,)).head_rows(7) == 7  # not measured: as asked
    # the allowance counts what is run: 19 rows (85 ms by interpolation from 16) fit in 35 + 50 ms, where
    # 8 rows' measured 125 ms would have stopped an interpolation from below
    assert c.head_rows_within(0.05) == 19 and c.head_rows_within(0.02) == 2


def test_head_rows_within_an_allowance():
    c = LatencyCurve((1, 2), (0.2, 0.4), (), ((1, 0.01), (8, 0.08), (32, 0.32)))  # 10 ms a row
    assert c.head_rows_within(0.2) == 21 and c.head_rows_within(0.05) == 6 and c.head_rows_within(0.0) == 1
    assert c.head_rows_within(0.31) == 32 and all(c.head_rows(k) == k for k in range(1, 40))  # monotone: no padding
    assert c.head_rows_within(1.0) == 101  # past the last measured count: in proportion
    assert LatencyCurve((1,), (0.2,)).head_rows_within(1.0) is None  # not measured: no limit
    assert LatencyCurve.from_dict(c.to_dict()) == c


@pytest.mark.parametrize("per_row,rows", [(0.1, 3), (1e-6, 200)])
def test_fit_keeps_the_prefill_logit_rows_within_one_plain_step(monkeypatch, per_row, rows):
    """A costly LM head row (an AVX2-only CPU in bfloat16): the prefill computes only what one step pays for."""
    import goose.verifiers.latency as lat

    curve = LatencyCurve((1, 2, 4), (0.2, 0.4, 0.8), (), tuple((r, 0.01 + (r - 1) * per_row) for r in (1, 2, 4, 8, 32)))
    monkeypatch.setattr(lat, "curve_for", lambda model, **kw: curve)
    model = ToyCausalLM(16)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit")
    prompt = [(i * 7 + i // 5) % 16 for i in range(200)]
    out = dec.generate(prompt, max_new_tokens=30)
    assert out.token_ids == reference_greedy(prompt, 30, 16)
    assert out.stats.extra["prefill_logit_rows"] == rows  # 0.2 s / 0.1 s a row -> 1 + 2 rows; cheap: TR's 200
    off = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", policy_options={"prefill_steps": None})
    assert off.generate(prompt, max_new_tokens=4).stats.extra["prefill_logit_rows"] == 200


def test_calibration_leaves_torch_global_generator_alone():
    """fit calibrates on first use, inside a generate the caller may have seeded: no global draws."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    c = measure(model, sizes=(1, 2, 4), past_len=16, repeats=1)
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
    until its first miss; with shadow_depth=1 only the target's next token is checked."""
    from goose.interfaces import Verified
    from goose.policies.fit import FitOptions, FitPolicy, Route
    from goose.tree import DraftTree

    import torch

    def verified(tree, path, bonus):
        n = tree.num_nodes
        return Verified("tree", torch.tensor(tree.tokens), torch.full((n,), -1), torch.zeros(n, 4), (0,) * n,
                        tree, path, tuple(tree.tokens[i] for i in path[1:]), bonus)

    spine = (1, 2, 3, 4, 5, 6, 7)
    full = DraftTree.build((9, *spine), (-1, 0, 1, 2, 3, 4, 5, 6), "spine", route="chain")
    kept = full.subtree([0, 1, 2])  # the fit kept 2 of 7 spine nodes

    def run(depth, later):
        pol = FitPolicy(FitOptions(latency=FLAT, shadow_depth=depth))
        pol._shadow = (Route("chain"), spine)
        pol.observe(verified(kept, (0, 1, 2), 3))  # depth 3 right (the bonus)
        for bonus in later:  # plain steps, each committing one token; their own spines say nothing
            pol._shadow = None
            pol.observe(verified(DraftTree.single(9), (0,), bonus))
        c = pol.route_counts[Route("chain")]
        # depths past the kept spine (1 and 2 are booked by the verified tree itself)
        return ({d: c.spine_trials[d] for d in range(3, 9) if c.spine_trials[d]},
                {d: c.spine_hits[d] for d in range(3, 9) if c.spine_hits[d]})

    # 4 and 5 right, 0 wrong at depth 6: trials stop there, the later 6 and 7 are not booked
    assert run(64, (4, 5, 0, 6, 7)) == ({3: 1, 4: 1, 5: 1, 6: 1}, {3: 1, 4: 1, 5: 1})
    # all right: booked up to the spine's end (depth 7), nothing past it
    assert run(64, (4, 5, 6, 7, 8)) == ({3: 1, 4: 1, 5: 1, 6: 1, 7: 1}, {3: 1, 4: 1, 5: 1, 6: 1, 7: 1})
    # at most shadow_depth depths past the kept spine
    assert run(2, (4, 5, 6)) == ({3: 1, 4: 1}, {3: 1, 4: 1})
    assert run(1, (4, 5, 6)) == ({3: 1}, {3: 1})
    # a tree step's walk and bonus feed the open spine in order
    pol = FitPolicy(FitOptions(latency=FLAT))
    pol._shadow = (Route("chain"), spine)
    pol.observe(verified(kept, (0, 1, 2), 3))
    pol._shadow = None
    walk = DraftTree.build((3, 4, 5, 8), (-1, 0, 1, 2), "spine", route="chain")
    pol.observe(verified(walk, (0, 1, 2), 6))  # commits 4, 5, then the bonus 6: depths 4, 5, 6 right
    c = pol.route_counts[Route("chain")]
    assert [c.spine_hits[d] for d in range(3, 8)] == [1, 1, 1, 1, 0] and c.spine_trials[7] == 0


def test_hindsight_earns_an_always_right_chain_faster_than_one_depth_per_step():
    dec = {
        depth: goose.compose(
            ToyCausalLM(16), None, sources=[_Oracle(), "tr"], policy="spine-fit",
            policy_options={"latency": CONCAVE, "shadow_depth": depth}, budget=24,
        )
        for depth in (1, 64)
    }
    outs = {d: x.generate([3, 1, 4, 1, 5], max_new_tokens=80) for d, x in dec.items()}
    for out in outs.values():
        assert out.token_ids == reference_greedy([3, 1, 4, 1, 5], 80, 16)
    assert outs[64].stats.forward_passes < outs[1].stats.forward_passes, {
        d: o.stats.forward_passes for d, o in outs.items()}


def test_a_chain_that_continues_an_open_spine_is_shaped_from_the_depth_it_has_reached():
    """``continuation``: when this step's spine is the next tokens of an earlier spine still being checked
    (K of its tokens committed, all right), the tree is shaped with that route's p_{K+1}, p_{K+2}, ...;
    a chain that departs from it, or an exhausted check, is a fresh chain (p_1, p_2, ...)."""
    from goose.policies.fit import FitOptions, FitPolicy, Route

    pol = FitPolicy(FitOptions(latency=FLAT))
    c = pol.route_counts[Route("chain", "pld")]
    for d, (t, h) in enumerate([(10, 3), (3, 3), (3, 3), (3, 3), (3, 3), (3, 3)], start=1):
        c.spine_trials[d], c.spine_hits[d] = t, h
    old = [11, 12, 13, 14, 15, 16, 17, 18]
    pol._open = [[Route("chain", "pld"), old, 2, 8], [Route("chain", "pld"), old[4:], 0, 4]]
    assert pol._continues([13, 14, 15]) == (Route("chain", "pld"), 2)  # the check with the most committed wins
    assert pol._continues([13, 99]) is None  # departs from the earlier spine: a fresh chain
    assert pol._continues([15, 16, 17, 18]) == (Route("chain", "pld"), 0)  # only the second check's next tokens
    base = pol._model(Route("chain", "pld"))
    fresh = pol._model(Route("spine", "pld"))  # this step's own route: its branches, a fresh chain's spine
    shifted = pol._shifted(fresh, Route("chain", "pld"), 2)
    assert shifted.p(1) == pytest.approx(base.p(3)) and shifted.p(4) == pytest.approx(base.p(6))
    assert shifted.p(1) > base.p(1) + 0.3  # p_1 was earned at 3/10, depth 3 at 3/3
    assert shifted.per_origin == fresh.per_origin and shifted.branch == fresh.branch
    pol._open = [[Route("chain", "pld"), old, 8, 8]]  # nothing left to check
    assert pol._continues([19]) is None


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
    from goose.interfaces import Verified
    from goose.policies.fit import FitOptions, FitPolicy, Route
    from goose.tree import DraftTree

    import torch

    pol = FitPolicy(FitOptions(latency=FLAT))
    full = DraftTree.build((9, 1, 2, 3, 4), (-1, 0, 1, 2, 3), "spine", route="chain")
    kept = full.subtree([0, 1, 2])  # the fit kept 2 of 4 spine nodes

    def verified(tree, path, bonus):
        n = tree.num_nodes
        return Verified("tree", torch.tensor(tree.tokens), torch.full((n,), -1), torch.zeros(n, 4), (0,) * n,
                        tree, path, tuple(tree.tokens[i] for i in path[1:]), bonus)

    for bonus, hits in ((3, 1), (7, 1)):  # the cut spine token 3 is right, then wrong
        pol._shadow = (Route("chain"), (1, 2, 3, 4))
        pol.observe(verified(kept, (0, 1, 2), bonus))
        c = pol.route_counts[Route("chain")]
        assert c.spine_hits[3] == hits
    assert c.spine_trials[3] == 2
    # a walk that broke inside the kept spine says nothing about depth 3
    pol._shadow = (Route("chain"), (1, 2, 3, 4))
    pol.observe(verified(kept, (0, 1), 5))
    assert c.spine_trials[3] == 2
    # a plain step (nothing kept): depth 1, against the bonus
    t1, h1 = c.spine_trials[1], c.spine_hits[1]
    pol._shadow = (Route("chain"), (1, 2, 3, 4))
    pol.observe(verified(DraftTree.single(9), (0,), 1))
    assert (c.spine_trials[1], c.spine_hits[1]) == (t1 + 1, h1 + 1)


def test_a_route_starts_from_what_its_lead_source_earned_on_the_other_routes():
    """The bypass chain of a source that has earned depth on the spine route starts from those rates,
    not from the prior; another source's routes, the non-bypass routes, and pool_routes=False start
    from the prior."""
    from goose.policies.fit import FitOptions, FitPolicy, Route

    def model(pool, route):
        pol = FitPolicy(FitOptions(latency=FLAT, pool_routes=pool))
        c = pol.route_counts[Route("spine", "pld")]
        for d in range(1, 21):  # pld right 10 times out of 10 at every depth to 20
            c.spine_trials[d] += 10
            c.spine_hits[d] += 10
        return pol._model(route).spine

    earned, fresh = model(True, Route("bypass", "pld")), model(False, Route("bypass", "pld"))
    assert fresh[0] == pytest.approx(0.1) and fresh[19] == pytest.approx(0.1)  # the prior, every depth
    assert earned[0] > 0.8 and earned[19] > 0.8  # what pld earned on the spine route
    assert model(True, Route("bypass", "suffix"))[0] == pytest.approx(0.1)  # another source earned nothing
    assert model(True, Route("spine"))[0] == pytest.approx(0.1)  # a route without a lead source
    # only the bypass route borrows: the spine and chain routes (TR's branches compete, or not) stay apart
    assert model(True, Route("chain", "pld"))[0] == pytest.approx(0.1)
    pol = FitPolicy(FitOptions(latency=FLAT))
    pol.route_counts[Route("bypass", "pld")].spine_trials[1] += 10
    pol.route_counts[Route("bypass", "pld")].spine_hits[1] += 10
    assert pol._model(Route("spine", "pld")).spine[0] == pytest.approx(0.1)


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
    from goose.policies.fit import FitOptions, FitPolicy, Route, _per_source
    from goose.tree import DraftTree

    def tree(conf, source="pld", route="spine"):
        return DraftTree.build((7, 1, 2, 3), (-1, 0, 1, 2), ("root", "spine", "spine", "spine"), None, route,
                               ((), (source,), (source,), (source,)), confidence=conf)

    tiers = PLD_TIERS
    assert _per_source(tree(1.0), tiers)[0] == Route("spine", "pld", 1.0)
    assert _per_source(tree(0.82), tiers)[0] == Route("spine", "pld", 0.7)
    assert _per_source(tree(0.3), tiers)[0] == Route("spine", "pld")  # below every tier: the source's plain route
    assert _per_source(tree(1.0, "suffix"), tiers)[0] == Route("spine", "suffix")  # no tiers for that source
    assert _per_source(tree(1.0), {})[0] == Route("spine", "pld")  # tiers off: one route per source
    assert _per_source(tree(1.0, route="bypass"), tiers)[0] == Route("bypass", "pld", 1.0)
    # str() writes a route as kind@lead^tier
    written = [str(_per_source(tree(c), tiers)[0]) for c in (1.0, 0.82, 0.3)]
    assert written == ["spine@pld^1", "spine@pld^0.7", "spine@pld"]
    assert str(Route("spine")) == "spine"
    pol = FitPolicy(FitOptions(latency=FLAT, source_priors={"pld": [(0.7, 0.3, 0.9), (1.0, 0.6, 0.95)]}))
    assert pol.options.source_priors["pld"][0][0] == 1.0  # the highest tier a confidence reaches wins
    assert pol._model(Route("spine", "pld", 1.0)).spine[:3] == pytest.approx((0.6, 0.95, 0.95))
    assert pol._model(Route("spine", "pld", 0.7)).spine[:2] == pytest.approx((0.3, 0.9))
    assert pol._model(Route("spine", "pld")).spine[0] == pytest.approx(0.1)  # untiered: the pessimistic prior
    # a tier's bypass route borrows depth 1 only from the same tier of its source
    c = pol.route_counts[Route("spine", "pld", 0.7)]
    c.spine_trials[1] += 20
    pol._stale(Route("spine", "pld", 0.7))
    assert pol._model(Route("bypass", "pld", 1.0)).spine[0] == pytest.approx(0.6)
    assert pol._model(Route("bypass", "pld", 0.7)).spine[0] < 0.1


def test_a_bypass_route_borrows_its_deeper_depths_from_every_tier_of_its_source():
    """Depth 1 is where a tier's chains start (its own tier's counts, else its calibrated p_1); the rate of
    depth d given d - 1 is the source's (every tier pooled), so a consensus match that carries on a loop the
    long matches have held through starts with that depth. pool_tiers=False: its own tier only."""
    from goose.policies.fit import FitOptions, FitPolicy, Route

    def rates(pool_tiers, other=Route("spine", "pld", 0.7)):
        pol = FitPolicy(FitOptions(latency=FLAT, pool_tiers=pool_tiers, source_priors=PLD_TIERS))
        pol._model(Route("bypass", "pld", 1.0))  # cached before the counts change: _stale must drop it
        c = pol.route_counts[other]
        for d in range(1, 41):  # the tier-0.7 chains missed depth 1 half the time, then held to 40
            c.spine_trials[d] += 20
            c.spine_hits[d] += 10 if d == 1 else 20
        pol._stale(other)
        return pol._model(Route("bypass", "pld", 1.0)).spine

    pooled, apart = rates(True), rates(False)
    assert pooled[0] == pytest.approx(0.7) == apart[0]  # depth 1: tier 1.0's calibrated start, not 0.5
    assert pooled[1] > 0.99 and pooled[31] > 0.99  # the depth tier 0.7 earned
    assert apart[1] == pytest.approx(0.9) and apart[31] == pytest.approx(0.9)  # the calibrated floor only
    assert rates(True, other=Route("spine", "suffix"))[1] == pytest.approx(0.9)  # another source's depth is not pld's


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
    from goose.policies.fit import FitOptions, FitPolicy, Route

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
        pol = FitPolicy(FitOptions(**opts))
        c = pol.route_counts[booked]
        for d in range(1, 21):
            c.spine_trials[d] += 20
            c.spine_hits[d] += 20
        pol._stale(booked)
        return pol._model(Route("bypass", other, 1.0)).spine, pol._model(Route("bypass", name)).spine

    fresh_other, fresh_name = bypasses(Route("spine", "elsewhere"))
    assert bypasses(Route("spine", name))[0] == fresh_other
    assert bypasses(Route("spine", other, 1.0))[1] == fresh_name
    assert bypasses(Route("chain", other))[0][1] > fresh_other[1]  # a route of the same source: borrowed


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
                    seen.append(sum(1 for o in step.tree.origins if o == "spine"))

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
