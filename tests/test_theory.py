"""goose.theory: the acceptance model against Monte Carlo, the optimal-tree programs and the
allocation rule against brute force, and the proposition statements docs/theory.md makes.

Every property here has an independent oracle (a simulator, an exhaustive search or a hand
computation), so a wrong recursion, a wrong DP or a wrong estimator fails a test.
"""

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import goose
from goose.theory import allocation as al
from goose.theory import sources as so
from goose.theory.__main__ import main as theory_main
from goose.theory.calibrate import (
    Record,
    as_record,
    calibration_report,
    compare_tau,
    dump_records,
    estimate,
    load_records,
    synthetic_records,
)
from goose.theory.checks import (
    CHAIN,
    HARMONIC_REGION,
    NS_EXAMPLE,
    NS_EXAMPLE_BUDGET,
    NS_GAP,
    PROP3_ISO_RATIO,
    PROP4_RATIO,
    Check,
    Report,
    random_plan,
    check_nsource_dominance,
    check_nsource_estimates,
    check_nsource_example,
    check_nsource_model,
    check_nsource_optimum,
    check_prop4_per_cycle,
    per_cycle_margins,
    random_logged_tree,
    sweep_point,
)
from goose.theory.model import (
    AcceptanceModel,
    chain_accept_from_argmax,
    chain_accept_from_path,
    greedy_walk,
    independent_ranks,
    simulate_tokens,
)
from goose.theory.trees import (
    SpineRule,
    brute_force_best,
    chain_tree,
    goose_tree,
    harmonic_split,
    isotropic_tree,
    make_tree,
    optimal_single_source,
    optimal_spine_tree,
    ordered_trees,
    spine_with_branches,
    stationary_rule,
)
from goose.tree import DraftTree

# ---------------------------------------------------------------------------------------------
# strategies
# ---------------------------------------------------------------------------------------------
unit = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def rate_vectors(draw, min_size=1, max_size=5, sorted_desc=False):
    """Rank rates summing to at most 1 (zeros and a single 1.0 included)."""
    v = draw(st.lists(unit, min_size=min_size, max_size=max_size))
    s = sum(v)
    v = [x / s for x in v] if s > 1 else v
    v = [min(1.0, max(0.0, x)) for x in v]
    if sum(v) > 1:  # rounding
        v = [x * (1 - 1e-12) for x in v]
    return tuple(sorted(v, reverse=True)) if sorted_desc else tuple(v)


@st.composite
def models(draw):
    return AcceptanceModel(
        tuple(draw(st.lists(unit, min_size=0, max_size=4))),
        draw(rate_vectors()),
        {"plugin": draw(rate_vectors(max_size=3))},
    )


@st.composite
def trees(draw, max_nodes=25):
    """Any parent array, a random root path as the spine, random non-spine origins."""
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    end = draw(st.integers(0, n - 1))
    spine = set()
    while end > 0:
        spine.add(end)
        end = parents[end]
    origins = ["root"] + [
        "lead" if i in spine else draw(st.sampled_from(["branch", "root-branch", "plugin"])) for i in range(1, n)
    ]
    return make_tree(parents, origins)


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(tree=trees(), model=models(), seed=st.integers(0, 2**32 - 1))
def test_exact_expectation_agrees_with_monte_carlo(tree, model, seed):
    n = 3000
    sim = simulate_tokens(tree, model, n, np.random.default_rng(seed))
    exact = model.expected_tokens(tree)
    se = sim.std(ddof=1) / math.sqrt(n)
    # 5 standard errors, plus a floor for near-degenerate cases (a rare event never sampled)
    assert abs(sim.mean() - exact) <= 5 * se + 3.0 / n, (exact, sim.mean(), se)


@settings(deadline=None)
@given(tree=trees(), model=models())
def test_children_probabilities_are_disjoint_events(tree, model):
    cond = model.conditional(tree)
    assert cond[0] == 1.0
    for u, kids in enumerate(tree.children):
        assert sum(cond[c] for c in kids) <= 1.0 + 1e-9, (u, [cond[c] for c in kids])
    reach = model.reach(tree)
    for i in range(1, tree.num_nodes):
        assert reach[i] == pytest.approx(reach[tree.parents[i]] * cond[i])
    assert model.expected_tokens(tree) == pytest.approx(1.0 + reach[1:].sum())


def test_hand_computed_values():
    m = AcceptanceModel((0.9, 0.5), (0.3, 0.2, 0.1), {"root-branch": (0.6,)})
    # chain: p1 + p1 p2 + p1 p2 p2 (depths past the vector reuse the last rate)
    assert m.expected_tokens(chain_tree(3)) == pytest.approx(1 + 0.9 + 0.45 + 0.225)
    # a spine node with two branches at the root: (1 - p1) q1, (1 - p1) q2
    t = spine_with_branches([2, 0])
    assert m.expected_tokens(t) == pytest.approx(1 + 0.9 + 0.1 * 0.3 + 0.1 * 0.2)
    # a branch-only star: q1 + q2 + q3 + 0 (rank 4 has no rate)
    assert m.expected_tokens(isotropic_tree(4, 5, 1)) == pytest.approx(1 + 0.6)
    # two origins under one node: the second group only gets the first group's misses
    t = make_tree([-1, 0, 0, 0], ["root", "root-branch", "branch", "branch"])
    assert m.expected_tokens(t) == pytest.approx(1 + 0.6 + 0.4 * 0.3 + 0.4 * 0.2)


def test_model_rejects_what_it_cannot_model():
    with pytest.raises(ValueError, match="sums to"):
        AcceptanceModel((0.5,), (0.7, 0.6))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        AcceptanceModel((1.5,), ())
    two_spines = make_tree([-1, 0, 0], ["root", "lead", "lead"])
    with pytest.raises(ValueError, match="spine children"):
        AcceptanceModel((0.5,), (0.1,)).expected_tokens(two_spines)


def test_model_reads_the_project_tree_type():
    tree = DraftTree.build([7, 3, 4, 9, 5], [-1, 0, 1, 0, 1], ["root", "lead", "lead", "branch", "branch"])
    m = AcceptanceModel((0.5,), (0.2,))
    assert m.expected_tokens(tree) == pytest.approx(1 + 0.5 + 0.25 + 0.5 * 0.2 + 0.5 * 0.5 * 0.2)


# ---------------------------------------------------------------------------------------------
# optimal trees
# ---------------------------------------------------------------------------------------------
def test_ordered_tree_enumeration_counts_catalan():
    assert [sum(1 for _ in ordered_trees(n)) for n in range(1, 9)] == [math.comb(2 * (n - 1), n - 1) // n for n in range(1, 9)]


@settings(deadline=None)
@given(q=rate_vectors(max_size=3), budget=st.integers(1, 7), depth=st.none() | st.integers(0, 3))
def test_single_source_dp_equals_brute_force(q, budget, depth):
    model = AcceptanceModel((), q)
    value, tree = optimal_single_source(q, budget, depth)
    best, _ = brute_force_best(model, budget, spine=False, max_depth=depth)
    assert value == pytest.approx(best, abs=1e-9)
    assert tree.num_nodes <= budget and (depth is None or max(tree.depths) <= depth)
    assert model.expected_tokens(tree) == pytest.approx(value, abs=1e-12)


@settings(deadline=None)
@given(p=st.lists(unit, min_size=1, max_size=3), q=rate_vectors(max_size=3), budget=st.integers(1, 7),
       max_spine=st.none() | st.integers(0, 3))
def test_spine_dp_equals_brute_force(p, q, budget, max_spine):
    model = AcceptanceModel(tuple(p), q)
    value, tree = optimal_spine_tree(p, q, budget, max_spine)
    best, _ = brute_force_best(model, budget, spine=True, max_spine=max_spine)
    assert value == pytest.approx(best, abs=1e-9)
    assert tree.num_nodes <= budget
    assert max_spine is None or sum(o == "lead" for o in tree.origins) <= max_spine
    assert model.expected_tokens(tree) == pytest.approx(value, abs=1e-12)


@settings(deadline=None)
@given(p=st.floats(0.01, 0.95), q=st.floats(0.01, 0.6), budget=st.integers(2, 80))
def test_optimum_contains_every_baseline(p, q, budget):
    r = sweep_point(p, q, budget)
    assert r["opt"] >= max(r["spine"], r["iso"], r["tr_opt"], r["pld"], r["tr_rule"]) - 1e-9


# ---------------------------------------------------------------------------------------------
# the deployed construction
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(budget=st.integers(2, 120), chain=st.integers(0, 40), conf=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
       ema=st.floats(0, 1), q=st.floats(0.01, 0.9))
def test_goose_tree_follows_the_rule(budget, chain, conf, ema, q):
    rule = SpineRule(budget=budget, chain_len=chain, confidence=conf, ema=ema)
    qv = independent_ranks(q, 10)
    t = goose_tree(qv, rule)
    total = budget + int(conf * 40)
    assert t.num_nodes <= total
    spine = [i for i, o in enumerate(t.origins) if o == "lead"]
    L = rule.spine_length()
    assert len(spine) == L <= chain and spine == list(range(1, L + 1))  # one chain under the root
    # branch extension stops at depth 6 (branches hanging directly off deep spine nodes excepted)
    assert all(t.depths[i] <= 6 for i in range(1, t.num_nodes) if t.origins[t.parents[i]] in ("branch", "root-branch"))
    # the first pass gives spine node j min(harmonic share, usable ranks) branches: widths never increase
    usable = sum(1 for x in qv if x / sum(qv) >= 0.01)
    branch_budget = total - 1 - L
    share = max(1, int(branch_budget * 0.5)) if L > 0 and branch_budget > 0 else 0
    widths = [sum(1 for c in t.children[s] if t.origins[c] == "branch") for s in spine]
    assert widths == [min(h, usable) for h in harmonic_split(share, L)]
    assert all(a >= b for a, b in zip(widths[:-1], widths[1:]))
    root_branches = sum(1 for c in t.children[0] if t.origins[c] == "root-branch")
    assert root_branches == min(branch_budget - share, usable) if branch_budget > 0 else root_branches == 0


@given(share=st.integers(0, 200), positions=st.integers(0, 30))
def test_harmonic_split_is_monotone_and_within_share(share, positions):
    b = harmonic_split(share, positions)
    assert len(b) == positions and sum(b) <= share
    assert all(x >= y for x, y in zip(b[:-1], b[1:]))
    for j, x in enumerate(b):
        assert x >= 1 or sum(b[:j]) == share  # each position at least 1 until the share runs out


# ---------------------------------------------------------------------------------------------
# Proposition 2
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(p=st.lists(unit, min_size=4, max_size=4), q=rate_vectors(max_size=3, sorted_desc=True),
       L=st.integers(1, 4), M=st.integers(0, 12))
def test_greedy_allocation_is_exact(p, q, L, M):
    w = al.spine_weights(p, L)
    best, _ = al.brute_force_allocation(w, q, M)
    b = al.optimal_allocation(w, q, M)
    assert sum(b) <= M and all(0 <= x <= len(q) for x in b)
    assert al.gain(w, q, b) == pytest.approx(best, abs=1e-12)


def test_greedy_refuses_increasing_q():
    with pytest.raises(ValueError, match="non-increasing"):
        al.optimal_allocation([1.0], [0.1, 0.2], 2)


@settings(deadline=None)
@given(p=st.floats(0.01, 0.99), q=st.floats(0.005, 0.6), L=st.integers(1, 20), frac=st.floats(0, 1))
def test_allocation_ranking(p, q, L, frac):
    K = 10
    M = int(frac * K * L)
    qv = independent_ranks(q, K)
    w = al.spine_weights((p,), L)
    go = al.gain(w, qv, al.optimal_allocation(w, qv, M))
    gh = al.gain(w, qv, al.harmonic_allocation(M, L, K))
    gu = al.gain(w, qv, al.uniform_allocation(M, L, K))
    assert sum(al.harmonic_allocation(M, L, K)) == sum(al.uniform_allocation(M, L, K)) == min(M, K * L)
    assert go >= gh - 1e-12 and go >= gu - 1e-12
    if p <= HARMONIC_REGION[0] and q <= HARMONIC_REGION[1]:
        assert gh >= gu - 1e-12, "harmonic >= uniform inside the region docs/theory.md states"


def test_harmonic_loses_to_uniform_at_a_documented_point():
    """The counterexample docs/theory.md reports: p = 0.8, q = 0.03, L = 2, M = 14."""
    qv = independent_ranks(0.03, 10)
    w = al.spine_weights((0.8,), 2)
    assert al.gain(w, qv, al.harmonic_allocation(14, 2, 10)) < al.gain(w, qv, al.uniform_allocation(14, 2, 10))


@settings(deadline=None)
@given(p=st.floats(0.3, 0.99), q=st.floats(0.02, 0.6), L=st.integers(3, 25), frac=st.floats(0.05, 1))
def test_optimal_allocation_decays_linearly_with_the_kkt_slope(p, q, L, frac):
    K = 10
    M = max(1, int(frac * K * L))
    qv = independent_ranks(q, K)
    b = al.optimal_allocation(al.spine_weights((p,), L), qv, M)
    assert all(b[d] >= b[d + 1] for d in range(L - 2)), b  # decays over the interior
    width = al.band_width(b, K, al.kkt_slope(p, q))
    if width is not None:
        assert width <= 1.0 + 1e-9, (b, al.kkt_slope(p, q))


def test_chain_end_breaks_the_decay_above_one_half():
    qv = independent_ranks(0.2, 10)
    b = al.optimal_allocation(al.spine_weights((0.9,), 16), qv, 40)
    assert b[-1] > b[-2]
    b = al.optimal_allocation(al.spine_weights((0.45,), 16), qv, 40)
    assert b[-1] <= b[-2]


# ---------------------------------------------------------------------------------------------
# Propositions 3 and 4
# ---------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(p=st.floats(0.05, 0.95), ratio=st.floats(PROP3_ISO_RATIO + 0.4, 20), budget=st.integers(10, 100))
def test_spine_tree_beats_best_isotropic_tree_when_p_exceeds_q(p, ratio, budget):
    r = sweep_point(p, p / ratio, budget)
    assert r["spine"] > r["iso"]


@settings(deadline=None)
@given(data=st.data())
def test_tree_never_accepts_fewer_than_its_spine_chain(data):
    rec, argmax = random_logged_tree(np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    full = len(rec.path) - 1
    chain = chain_accept_from_argmax(rec.tokens, rec.parents, rec.origins, argmax)
    assert full >= chain
    assert chain_accept_from_path(rec.origins, rec.path) == chain


def test_per_cycle_check_catches_a_forged_path():
    # spine 1 -> 2 under the root; the target's argmax accepts both, but the "log" stops at node 1
    tokens, parents, origins = (0, 5, 6, 7), (-1, 0, 1, 0), ("root", "lead", "lead", "branch")
    argmax = (5, 6, 9, 9)
    assert greedy_walk(tokens, parents, origins, argmax) == (0, 1, 2)
    good = Record(tokens, parents, origins, (0, 1, 2), argmax=argmax)
    forged = Record(tokens, parents, origins, (0, 1), argmax=argmax)
    assert per_cycle_margins([good])[2] == 0
    worst, walked, mismatch, bad = per_cycle_margins([forged])
    assert mismatch == 1 and worst < 0 and bad


@settings(deadline=None)
@given(q=st.floats(0.01, 0.45), ratio=st.floats(PROP4_RATIO, 20), budget=st.integers(20, 100))
def test_spine_tree_beats_tr_tree_in_expectation(q, ratio, budget):
    p = min(0.95, ratio * q)
    assume(p >= PROP4_RATIO * q)
    qv = independent_ranks(q, 10)
    m = AcceptanceModel((p,), qv)
    spine = m.expected_tokens(goose_tree(qv, stationary_rule((p,), SpineRule(budget=budget, chain_len=CHAIN))))
    tr = m.expected_tokens(goose_tree(qv, SpineRule(budget=budget, chain_len=0)))
    assert spine >= tr - 1e-9


def test_spine_tree_can_lose_to_tr_tree_at_p_equal_q():
    """The violation docs/theory.md reports for q_1 <= p < 2 q_1 (budget 100, p = q = 0.3)."""
    qv = independent_ranks(0.3, 10)
    m = AcceptanceModel((0.3,), qv)
    spine = m.expected_tokens(goose_tree(qv, stationary_rule((0.3,), SpineRule(budget=100, chain_len=CHAIN))))
    tr = m.expected_tokens(goose_tree(qv, SpineRule(budget=100, chain_len=0)))
    assert spine < tr


# ---------------------------------------------------------------------------------------------
# calibration
# ---------------------------------------------------------------------------------------------
def _truth():
    return AcceptanceModel((0.9, 0.8, 0.7), independent_ranks(0.2, 10), {"root-branch": independent_ranks(0.3, 10)})


def test_estimates_recover_the_rates_that_generated_the_records():
    truth = _truth()
    shapes = [goose_tree(truth.branch, SpineRule(budget=B, chain_len=L, ema=0.5)) for B in (20, 60) for L in (0, 5, 20)]
    recs = synthetic_records(shapes, truth, 400, np.random.default_rng(5))
    fit, counts = estimate(recs, pool_from=3)
    for d in (1, 2, 3):
        t = counts.spine_trials[d] if d < 3 else sum(v for k, v in counts.spine_trials.items() if k >= 3)
        assert abs(fit.p(d) - truth.p(d)) <= 4.5 * math.sqrt(truth.p(d) * (1 - truth.p(d)) / t)
    for origin in ("branch", "root-branch"):
        for r in (1, 2, 3):
            t = counts.rank_trials[origin][r]
            true = truth.q(r, origin)
            assert abs(fit.q(r, origin) - true) <= 4.5 * math.sqrt(true * (1 - true) / t) + 1e-9
    cmp_ = compare_tau(recs, fit)
    assert abs(cmp_.error) < 0.02


def test_estimates_are_wrong_when_the_records_are_biased():
    """Guard against a tautological estimator: records that always stop at the spine's first
    node must give p_1 = 1, p_2 = 0 whatever model produced the trees."""
    t = chain_tree(3)
    recs = [Record(t.tokens, t.parents, t.origins, (0, 1)) for _ in range(20)]
    fit, _ = estimate(recs)
    assert fit.p(1) == 1.0 and fit.p(2) == 0.0


def test_tau_arithmetic_counts_prefill_and_cuts():
    t = chain_tree(2)
    recs = [
        Record(t.tokens, t.parents, t.origins, (0, 1, 2), "d", 0, 0),  # 3 committed
        Record(t.tokens, t.parents, t.origins, (0,), "d", 0, 1),  # 1 committed
        Record(t.tokens, t.parents, t.origins, (0, 1, 2), "d", 1, 0, committed=2),  # cut at max_new_tokens
    ]
    m = AcceptanceModel((0.5,), ())
    cmp_ = compare_tau(recs, m)
    assert cmp_.requests == 2 and cmp_.steps == 3
    assert cmp_.tau_measured == pytest.approx((2 + 3 + 1 + 2) / (2 + 3))
    assert cmp_.tau_predicted == pytest.approx((2 + 1.75 + 1.75 + 2) / (2 + 3))


def test_records_round_trip_and_reject_bad_paths(tmp_path):
    recs = synthetic_records([chain_tree(4)], _truth(), 10, np.random.default_rng(0), dataset="x")
    path = tmp_path / "r.jsonl"
    dump_records(recs, path)
    assert load_records(path) == recs
    with pytest.raises(ValueError, match="not a root-to-node path"):
        Record((0, 1, 2), (-1, 0, 0), ("root", "lead", "branch"), (0, 1, 2))
    path.write_text(json.dumps({"tokens": [0], "parents": [-1], "origins": ["root"]}) + "\n")
    with pytest.raises(ValueError, match="missing"):
        load_records(path)


def test_record_from_a_decoder_step_record():
    tree = DraftTree.build([4, 5, 6, 8], [-1, 0, 1, 0], ["root", "lead", "lead", "branch"])
    v = goose.Verified("tree", torch.tensor(tree.tokens), torch.tensor([-1, 4, 5, 4]), torch.zeros(4, 10),
                       (5, 7, 1, 1), tree, (0, 1), (5,), 7)
    rec = as_record(goose.StepRecord(3, tree, v, (5, 7), 0.0, 0.0), dataset="gsm8k", request=2)
    assert rec.path == (0, 1) and rec.tokens_committed == 2 and rec.argmax == (5, 7, 1, 1)
    assert rec.dataset == "gsm8k" and rec.step == 3
    assert per_cycle_margins([rec])[:3] == (0, 1, 0)


def test_calibration_report_per_dataset():
    truth = _truth()
    rng = np.random.default_rng(1)
    recs = (synthetic_records([goose_tree(truth.branch, SpineRule(budget=40))], truth, 300, rng, "a")
            + synthetic_records([goose_tree(truth.branch, SpineRule(budget=40, chain_len=0))], truth, 300, rng, "b"))
    rep = calibration_report(recs)
    assert set(rep) == {"a", "b"}
    for cal in rep.values():
        assert abs(cal.own.error) < 0.03 and abs(cal.pooled.error) < 0.05


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------
def test_cli_exit_code_follows_the_checks(monkeypatch, capsys, tmp_path):
    import goose.theory.checks as checks

    def fake(records=None, seed=0, tau_tol=0.1, fail=False):
        r = Report()
        r.checks.append(Check.of("x.holds", 0.5, "fine"))
        r.checks.append(Check("x.note", "note", None, "a finding"))
        if fail:
            r.checks.append(Check.of("x.fails", -0.1, "broken"))
        return r

    monkeypatch.setattr(checks, "run_all", fake)
    assert theory_main(["check", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "x.holds" in out and "holds" in out and "margin=+0.5" in out
    monkeypatch.setattr(checks, "run_all", lambda *a, **k: fake(fail=True))
    assert theory_main(["check", "--no-plots", "--out", str(tmp_path)]) == 1
    assert "fails" in capsys.readouterr().out
    assert theory_main(["check", "--records", str(tmp_path / "missing.jsonl")]) == 2


def test_prop4_check_reads_records():
    rng = np.random.default_rng(0)
    recs = [random_logged_tree(rng)[0] for _ in range(50)]
    lines = {c.name: c for c in check_prop4_per_cycle(rng, recs)}
    assert lines["prop4.per_cycle_vs_chain[records]"].status == "holds"
    forged = [Record(r.tokens, r.parents, r.origins, r.path[:1], argmax=r.argmax) for r in recs if len(r.path) > 1]
    lines = {c.name: c for c in check_prop4_per_cycle(rng, forged)}
    assert lines["prop4.per_cycle_vs_chain[records]"].status == "fails"


def test_recorder_reproduces_the_decoders_tau():
    """Records logged through the goose_on_step hook give back Stats.tau exactly (cuts included)."""
    from goose.testing import ArbitraryTreeSource, ToyCausalLM
    from goose.testing.kit import ArbitraryTreeOptions
    from goose.theory.calibrate import Recorder

    recorder = Recorder("toy")
    goose.register_plugin(recorder, name="theory-recorder")
    gen, passes, requests = 0, 0, 0
    for seed in range(12):
        model = ToyCausalLM(16, eos_token_id=seed % 16)
        src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=seed, p_oracle=0.9, p_chain=0.5))
        dec = goose.compose(model, None, sources=[src], policy="proposal", budget=12)
        out = dec.generate([seed % 7, 3, 5, 7, 3, 5], max_new_tokens=5 + 3 * seed)
        if out.stats.steps:  # a request that stops at its prefill logs no step
            gen += out.stats.generated_tokens
            passes += out.stats.forward_passes
            requests += 1
    recs = [Record.from_json(json.loads(json.dumps(r.to_json()))) for r in recorder.records]
    assert any(r.cut for r in recs), "no stop-token cut exercised: pick other seeds"
    cmp_ = compare_tau(recs, AcceptanceModel((0.5,), (0.1,)))
    assert cmp_.requests == requests
    assert cmp_.tau_measured == pytest.approx(gen / passes)
    assert per_cycle_margins(recs)[2] == 0  # every logged path is the greedy walk of its argmax


# ---------------------------------------------------------------------------------------------
# N chain sources (theory/sources.py)
# ---------------------------------------------------------------------------------------------
seeds = st.integers(0, 2**32 - 1)


def _small(seed: int) -> tuple[so.Sources, int, np.random.Generator]:
    rng = np.random.default_rng(seed)
    return so.random_sources(rng, (2, 3), 4), int(rng.integers(3, 20)), rng


def test_nsource_hand_computed_values():
    # leader 1 (p = 0.8) spine of 1; source 0 (p = 0.5) as a 1-token side chain; q_1 = 0.1
    src = so.Sources(((0.5,), (0.8,)), (0.1,))
    assert so.rank(src) == [1, 0]
    # accepted: 1 - P(both wrong) = 1 - 0.5 * 0.2; no TR
    assert so.evaluate(src, so.Plan(1, 1, (1, 0), (0, 0), 0.0)) == pytest.approx(1 + 0.9)
    # one TR node at the root: stops there when both are wrong (0.2 * 0.5), catches with q_1
    assert so.evaluate(src, so.Plan(1, 1, (1, 0), (1, 0), 0.0)) == pytest.approx(1 + 0.9 + 0.1 * 0.1)
    # one TR node under the spine node: reached with 0.8, nothing drafted below it
    assert so.evaluate(src, so.Plan(1, 1, (1, 0), (0, 1), 0.0)) == pytest.approx(1 + 0.9 + 0.8 * 0.1)
    # the best tree of 3 nodes drafts both chains, whichever leads (0.9 beats 0.8 + 0.08 with a TR node)
    best = so.best_plan(src, 3)
    assert best.spine + sum(best.sides) == 2 and best.value == pytest.approx(1.9)


def test_nsource_rejects_what_it_cannot_model():
    with pytest.raises(ValueError, match="non-increasing"):
        so.Sources(((0.5,),), (0.1, 0.2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        so.Sources(((1.5,),), (0.1,))
    with pytest.raises(ValueError, match="at least one source"):
        so.Sources(((0.5,), ()), (0.1,))
    with pytest.raises(ValueError, match="more than the budget"):
        so.fit(so.Sources(((0.5,) * 4,), (0.1,)), 0, 4, (0,), 4)


@settings(deadline=None, max_examples=25)
@given(seed=seeds)
def test_nsource_exact_value_equals_enumeration(seed):
    src, B, rng = _small(seed)
    for plan in (so.rate_plan(src, B), random_plan(rng, src)):
        assert so.enumerate_value(src, plan) == pytest.approx(plan.value, abs=1e-12)


@settings(deadline=None, max_examples=25)
@given(seed=seeds)
def test_nsource_trie_accepts_the_longest_drafted_right_prefix(seed):
    src, B, rng = _small(seed)
    plan = random_plan(rng, src)
    for A in so.sample_prefixes(src, 20, rng):
        tree, drafted = so.realize(src, plan, A)
        depth, _ = so.chain_walk(tree)
        assert depth == max(min(int(a), d) for a, d in zip(A, drafted))
        assert tree.num_nodes <= plan.nodes


@settings(deadline=None, max_examples=25)
@given(seed=seeds)
def test_nsource_one_source_tree_is_the_spine_dp(seed):
    src, B, _ = _small(seed)
    for s in range(src.n):
        dp, _ = optimal_spine_tree(src.chains[s], src.branch, B, src.length(s))
        assert so.one_source_plan(src, s, B).value == pytest.approx(dp, abs=1e-12)


@settings(deadline=None, max_examples=25)
@given(seed=seeds)
def test_nsource_rate_tree_contains_its_leader_and_the_tr_trees(seed):
    """The two theorems: never below the leader's one-source tree, nor the optimal TR-only tree (so
    nor any isotropic tree); and never over budget."""
    rng = np.random.default_rng(seed)
    src, B = so.random_sources(rng), int(rng.integers(4, 65))
    plan = so.rate_plan(src, B)
    assert plan.nodes <= B
    assert plan.value >= so.one_source_plan(src, plan.leader, B).value - 1e-12
    tr, _ = optimal_single_source(src.branch, B)
    assert plan.value >= tr - 1e-12 >= so.isotropic_value(src.branch, B)[0] - 2e-12
    assert so.best_plan(*_small(seed)[:2]).value >= so.rate_plan(*_small(seed)[:2]).value - 1e-12


def test_nsource_simulation_agrees_with_the_exact_value():
    rng = np.random.default_rng(7)
    src = so.random_sources(rng, (3, 3), 8)
    for plan in (so.rate_plan(src, 40), so.list_order_plan(src, 40)):
        sim, broken = so.simulate_tokens(src, plan, 20000, rng)
        assert broken == 0
        assert abs(sim.mean() - plan.value) <= 5 * sim.std(ddof=1) / math.sqrt(len(sim))


def test_nsource_list_order_example():
    """The numbers docs/theory.md quotes: a weak source listed first."""
    src, B = NS_EXAMPLE, NS_EXAMPLE_BUDGET
    rate, listed, alone = so.rate_plan(src, B), so.list_order_plan(src, B), so.one_source_plan(src, 0, B)
    assert rate.leader == 1 and listed.leader == 0
    assert (round(rate.value, 3), round(listed.value, 3), round(alone.value, 3)) == (5.132, 5.067, 1.697)


def test_nsource_measured_rates_shrink_toward_the_prior():
    src = so.Sources(((0.9,) * 3, (0.2,) * 2), (0.1,))
    rng = np.random.default_rng(0)
    assert so.observed_rates(src, 0, rng).chains == ((0.25,) * 3, (0.25,) * 2)
    far = so.observed_rates(src, 20000, rng)
    assert np.allclose(far.chains[0], 0.9, atol=0.02) and np.allclose(far.chains[1], 0.2, atol=0.03)


def _statuses(lines):
    return {c.name: c.status for c in lines}


def test_nsource_checks_hold():
    rng = np.random.default_rng(0)
    lines = (check_nsource_model(rng, cases=3, walks=5000) + check_nsource_dominance(rng, 40)
             + check_nsource_optimum(rng, cases=10) + check_nsource_example() + check_nsource_estimates(rng))
    assert "fails" not in _statuses(lines).values(), [c.line() for c in lines if c.status == "fails"]
    assert {"holds", "note"} == set(_statuses(lines).values())


def _reversed_ranking(src, budget):
    return so.ascend(src, so.rank(src)[-1], budget)


@pytest.mark.parametrize("planner", [_reversed_ranking, so.list_order_plan], ids=["reversed", "list-order"])
def test_nsource_dominance_check_fails_for_a_bad_leader(planner):
    lines = _statuses(check_nsource_dominance(np.random.default_rng(0), 40, planner) + check_nsource_example(planner))
    assert lines[f"nsource.rate_ge_every_one_source[E1>={NS_GAP:g}E2]"] == "fails"
    assert lines["nsource.list_order_loses[example]"] == "fails"
    # the theorems hold for any leader: they are about the layout, not the ranking
    assert lines["nsource.rate_ge_leader_one_source"] == lines["nsource.rate_ge_isotropic"] == "holds"


def test_nsource_regret_check_fails_for_an_estimator_that_ignores_the_steps():
    def blind(src, steps, rng):
        return so.observed_rates(src, 0, rng)

    lines = _statuses(check_nsource_estimates(np.random.default_rng(0), estimator=blind, cases=10))
    assert lines["nsource.estimated_rates_regret"] == "fails"


def test_nsource_model_check_catches_a_wrong_formula(monkeypatch):
    right = so.chain_terms

    def no_sides(src, leader, spine, sides):  # forgets the side chains
        return right(src, leader, spine, (0,) * len(sides))

    monkeypatch.setattr(so, "chain_terms", no_sides)
    lines = _statuses(check_nsource_model(np.random.default_rng(0), cases=3, walks=5000))
    assert lines["nsource.exact_vs_enumeration"] == "fails"
