"""N chain sources in one tree (docs/theory.md, "N sources"): the model, the exact value of a tree
:class:`Plan`, the plans the checks compare, and a simulator that walks real token tries. Everything
is exact arithmetic except :func:`simulate_tokens` and :func:`observed_rates`, which sample."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np

from goose.theory.model import ROOT, LEAD, AcceptanceModel, greedy_walk, simulate_tokens as simulate_tr
from goose.theory.trees import BRANCH, forest_values, isotropic_tree, optimal_single_source
from goose.tree import DraftTree

SIDE = "side"  # the origin policies/chains.py gives another source's chain where it leaves the spine
PRIOR, PRIOR_WEIGHT = 0.25, 4.0  # goose.policies.rates.SourceRates' shrinkage: shrunk(hits, trials, 0.25, 4)
TIE = 1e-12


@dataclass(frozen=True)
class Sources:
    """``chains[s]``: source s's per-depth rates ``p^s_1..p^s_{n_s}`` (its chain has ``n_s`` tokens);
    ``branch``: the TR rank rates ``q_1..q_K``, non-increasing, summing to at most 1."""

    chains: tuple[tuple[float, ...], ...]
    branch: tuple[float, ...]

    def __post_init__(self) -> None:
        chains = tuple(tuple(float(p) for p in c) for c in self.chains)
        branch = tuple(float(q) for q in self.branch)
        object.__setattr__(self, "chains", chains)
        object.__setattr__(self, "branch", branch)
        if not chains or any(not c for c in chains):
            raise ValueError(f"need at least one source and a token per chain, got lengths {[len(c) for c in chains]}")
        for v in (*(p for c in chains for p in c), *branch):
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"every rate must lie in [0, 1], got {v!r}")
        if sum(branch) > 1.0 + TIE or any(b > a + TIE for a, b in zip(branch, branch[1:])):
            raise ValueError(f"branch rates must be non-increasing and sum to at most 1, got {list(branch)}")

    @property
    def n(self) -> int:
        return len(self.chains)

    def length(self, s: int) -> int:
        return len(self.chains[s])

    @cached_property
    def survival(self) -> np.ndarray:
        """``[N, 2 max n + 2]``: ``S_s(d) = P(A_s >= d)`` for d = 0, 1, ...; 0 past the chain."""
        D = 2 * max(len(c) for c in self.chains) + 2
        S = np.zeros((self.n, D))
        S[:, 0] = 1.0
        for s, c in enumerate(self.chains):
            S[s, 1 : len(c) + 1] = np.cumprod(c)
        return S

    @cached_property
    def shifted(self) -> np.ndarray:
        """``[N, max n + 1, max n + 1]``: ``S_s(a + j)``."""
        n = max(len(c) for c in self.chains)
        idx = np.arange(n + 1)
        return self.survival[:, idx[:, None] + idx[None, :]]

    def expected_chain(self, s: int) -> float:
        """Expected accepted tokens of source s's whole chain alone (SourceRates.expected)."""
        return float(self.survival[s, 1:].sum())


@dataclass(frozen=True)
class Plan:
    """A tree layout (docs/theory.md, "Plans") and its exact expected tokens per step."""

    leader: int
    spine: int
    sides: tuple[int, ...]  # [N] tokens past the fork per source; 0 for the leader
    widths: tuple[int, ...]  # [spine + 1] nodes of the TR forest under spine depths 0..spine
    value: float = field(compare=False)

    @property
    def nodes(self) -> int:
        """Nodes reserved, root included: an upper bound on every realised tree's size."""
        return 1 + self.spine + sum(self.sides) + sum(self.widths)


# ---- Exact value ----
def forest(q: tuple[float, ...], m: int) -> np.ndarray:
    """``[m + 1]`` (read-only): ``F(0..m)``, the best TR forest's expected accepted nodes."""
    return _forest(q, max(64, 1 << m.bit_length()))[: m + 1]


@lru_cache(maxsize=64)
def _forest(q: tuple[float, ...], size: int) -> np.ndarray:
    """The forest values up to ``size`` nodes; raises if ``F`` is not concave, where the greedy widths
    would not be exact (it was for every q tried: docs/theory.md)."""
    F = forest_values(q, size)
    if np.diff(F, 2).max() > TIE:
        raise ValueError(f"the forest value is not concave in its nodes for q = {list(q)}")
    F.setflags(write=False)
    return F


def chain_terms(src: Sources, leader: int, spine: int, sides: Sequence[int]) -> tuple[float, np.ndarray]:
    """Exact: (expected accepted chain tokens, ``[spine + 1]`` TR weights ``w_d``), the closed form of
    docs/theory.md, "Exact value"."""
    S = src.survival
    a = np.arange(spine + 1)
    pa = S[leader, : spine + 1] - S[leader, 1 : spine + 2]  # P(A_leader = a)
    tail = S[leader, spine + 1]  # P(A_leader > spine)
    k = np.asarray(sides)
    J = int(k.max())
    if J:
        cover = src.shifted[:, : spine + 1, 1 : J + 1] * (k[:, None, None] >= np.arange(1, J + 1))  # [N, spine + 1, J]
        miss = np.prod(1.0 - cover, axis=0)
        gain, stop = J - miss.sum(axis=1), miss[:, 0]
    else:
        gain, stop = np.zeros(spine + 1), np.ones(spine + 1)
    w = pa * stop
    w[spine] += tail
    return float(pa @ (a + gain) + tail * spine), w


def _marginals(w: np.ndarray, F: np.ndarray, m: int) -> np.ndarray:
    """``[len(w) * m]``: ``w_d (F(b + 1) - F(b))`` for every depth d and b < m."""
    return np.outer(w, np.diff(F[: m + 1])).ravel()


def branch_gain(w: np.ndarray, F: np.ndarray, m: int) -> float:
    """Exact: the best ``sum_d w_d F(b_d)`` over ``sum b_d <= m``: the ``m`` largest marginal gains (the
    greedy of theory/allocation.py; ``F`` is concave, so the ones taken at a depth are its first ``b_d``)."""
    if m <= 0:
        return 0.0
    g = _marginals(w, F, m)
    return float(np.partition(g, len(g) - m)[len(g) - m :].sum())


def branch_widths(w: np.ndarray, F: np.ndarray, m: int) -> tuple[int, ...]:
    """The widths ``b_d`` that reach :func:`branch_gain`: how many of the ``m`` largest gains each depth holds."""
    b = np.zeros(len(w), dtype=np.int64)
    if m > 0:
        g = _marginals(w, F, m)
        np.add.at(b, np.argpartition(g, len(g) - m)[len(g) - m :] // m, 1)
    return tuple(int(x) for x in b)


def evaluate(src: Sources, plan: Plan) -> float:
    """Exact expected tokens per step (accepted + bonus) of ``plan`` under ``src``: its widths as given."""
    chain, w = chain_terms(src, plan.leader, plan.spine, plan.sides)
    F = forest(src.branch, max(plan.widths))
    return 1.0 + chain + float(w @ F[list(plan.widths)])


def _value(src: Sources, leader: int, spine: int, sides: Sequence[int], budget: int) -> float:
    """Exact expected tokens of the layout with optimal widths; -inf when it does not fit ``budget``."""
    m = budget - 1 - spine - sum(sides)
    if m < 0:
        return -np.inf
    chain, w = chain_terms(src, leader, spine, sides)
    return 1.0 + chain + branch_gain(w, forest(src.branch, m), m)


def fit(src: Sources, leader: int, spine: int, sides: Sequence[int], budget: int) -> Plan:
    """The chain layout with the exact optimal TR widths for the nodes it leaves of ``budget``."""
    m = budget - 1 - spine - sum(sides)
    if m < 0:
        raise ValueError(f"the layout needs {1 + spine + sum(sides)} nodes, more than the budget {budget}")
    _, w = chain_terms(src, leader, spine, sides)
    widths = branch_widths(w, forest(src.branch, m), m)
    plan = Plan(leader, spine, tuple(sides), widths, 0.0)
    return Plan(leader, spine, tuple(sides), widths, evaluate(src, plan))


# ---- Plans ----
Planner = Callable[[Sources, int], Plan]


def rank(src: Sources) -> list[int]:
    """Sources best first by the expected accepted tokens of their whole chain (goose.policies.chains.rank);
    ties: the longer chain, then the index."""
    return sorted(range(src.n), key=lambda s: (-src.expected_chain(s), -src.length(s), s))


def one_source_plan(src: Sources, s: int, budget: int) -> Plan:
    """The best tree with source s's chain as the only chain: every spine length, optimal TR widths."""
    none = (0,) * src.n
    L = max(range(min(src.length(s), budget - 1) + 1), key=lambda L: (_value(src, s, L, none, budget), -L))
    return fit(src, s, L, none, budget)


def ascend(src: Sources, leader: int, budget: int) -> Plan:
    """Coordinate ascent over the spine length and each side chain's length (others in rank order),
    optimal TR widths throughout, from the best one-source tree of ``leader``. A coordinate moves
    only to a strictly better value, so the result is never worse than that one-source tree."""
    start = one_source_plan(src, leader, budget)
    L, k, best = start.spine, list(start.sides), start.value
    order = [s for s in rank(src) if s != leader]
    moved = True
    while moved:
        moved = False
        for coord in [-1, *order]:
            top = src.length(leader) if coord < 0 else src.length(coord)
            for v in range(top + 1):
                L2, k2 = (v, k) if coord < 0 else (L, k[:coord] + [v] + k[coord + 1 :])
                val = _value(src, leader, L2, k2, budget)
                if val > best + TIE:
                    L, k, best, moved = L2, k2, val, True
    return fit(src, leader, L, k, budget)


def rate_plan(src: Sources, budget: int) -> Plan:
    """Allocation by measured rates: the best-ranked chain leads, the others may hang as side chains."""
    return ascend(src, rank(src)[0], budget)


def list_order_plan(src: Sources, budget: int) -> Plan:
    """The failure mode: the first source always leads, whatever its rates (same allocation)."""
    return ascend(src, 0, budget)


def best_plan(src: Sources, budget: int, leaders: Sequence[int] | None = None) -> Plan:
    """Exhaustive optimum over every leader (or those in ``leaders``), spine length and side-chain
    lengths, optimal TR widths: the oracle for small cases (``prod (n_s + 1)`` layouts per leader)."""
    best: tuple[float, int, int, tuple[int, ...]] = (-np.inf, 0, 0, ())
    for leader in range(src.n) if leaders is None else leaders:
        ranges = [range(1) if s == leader else range(src.length(s) + 1) for s in range(src.n)]
        for L in range(min(src.length(leader), budget - 1) + 1):
            for k in itertools.product(*ranges):
                v = _value(src, leader, L, k, budget)
                if v > best[0] + TIE:
                    best = (v, leader, L, k)
    return fit(src, best[1], best[2], best[3], budget)


def isotropic_value(q: Sequence[float], budget: int) -> tuple[float, int]:
    """Exact: the best TR-only isotropic tree (k = 2..5 children per node, depth <= 6, theory/trees.py)
    of ``budget`` nodes; returns (expected tokens per step, k)."""
    model = AcceptanceModel((), tuple(q))
    vals = {k: model.expected_tokens(isotropic_tree(k, budget)) for k in range(2, 6)}
    k = max(vals, key=vals.get)
    return vals[k], k


# ---- Real token tries (the Monte Carlo side) ----
@lru_cache(maxsize=1024)
def forest_shape(q: tuple[float, ...], nodes: int) -> DraftTree:
    """The best TR forest of at most ``nodes`` nodes under a root (``trees.optimal_single_source``)."""
    return optimal_single_source(q, nodes + 1)[1]


def realize(src: Sources, plan: Plan, A: Sequence[int]) -> tuple[DraftTree, list[int]]:
    """The tree ``plan`` drafts when the sources' right prefixes are ``A``, built as a token trie
    (shared tokens are one node), and each source's drafted depth (its deepest node in the trie)."""
    # the truth's token at depth d is d; source s's wrong token there is 1000 (s + 1) + d, its own
    chains = [tuple(d if d <= A[s] else 1000 * (s + 1) + d for d in range(1, src.length(s) + 1)) for s in range(src.n)]
    lead = chains[plan.leader]
    tokens, parents, origins = [0], [-1], [ROOT]
    kids: list[dict[int, int]] = [{}]

    def add(parent: int, token: int, origin: str) -> int:
        tokens.append(token)
        parents.append(parent)
        origins.append(origin)
        kids.append({})
        kids[parent][token] = len(tokens) - 1
        return len(tokens) - 1

    for d in range(plan.spine):
        add(d, lead[d], LEAD)
    drafted = [plan.spine if s == plan.leader else 0 for s in range(src.n)]
    for s, c in enumerate(chains):
        if s == plan.leader:
            continue
        f = next((d for d, (x, y) in enumerate(zip(c, lead)) if x != y), min(len(c), len(lead)))
        drafted[s] = min(f, plan.spine)
        if f > plan.spine or f >= len(c):
            continue
        node = f  # the spine node at depth f (node index = depth)
        for t in c[f : f + plan.sides[s]]:
            node = kids[node].get(t) or add(node, t, SIDE)
        drafted[s] = min(len(c), f + plan.sides[s])
    for d, b in enumerate(plan.widths):
        if b:
            shape = forest_shape(src.branch, b)
            at = [d]
            for i in range(1, shape.num_nodes):
                at.append(add(at[shape.parents[i]], 100_000 + len(tokens), BRANCH))
    return DraftTree(tuple(tokens), tuple(parents), tuple(origins), None, "nsource", {}), drafted


def chain_walk(tree: DraftTree) -> tuple[int, bool]:
    """The greedy walk against the truth (node v right -> the target's token is ``depth(v) + 1``):
    (accepted chain tokens, whether it stops at the root or a spine node)."""
    depth = tree.depths
    argmax = [depth[v] + 1 if v == 0 or tree.tokens[v] == depth[v] else -1 for v in range(tree.num_nodes)]
    end = greedy_walk(tree.tokens, tree.parents, tree.origins, argmax)[-1]
    return depth[end], tree.origins[end] in (ROOT, LEAD)


def enumerate_value(src: Sources, plan: Plan) -> float:
    """Exact by exhaustion (small cases: ``prod (n_s + 1)`` tries): the mean over every ``A`` of the
    walked trie's chain tokens, plus ``F(widths[d])`` where it stops at spine node d, plus the bonus."""
    pmf = -np.diff(src.survival, axis=1)  # pmf[s, a] = P(A_s = a)
    F = forest(src.branch, max(plan.widths))
    total = 0.0
    for A in itertools.product(*(range(src.length(s) + 1) for s in range(src.n))):
        depth, on_spine = chain_walk(realize(src, plan, A)[0])
        total += float(np.prod(pmf[np.arange(src.n), A])) * (depth + (F[plan.widths[depth]] if on_spine else 0.0))
    return 1.0 + total


def sample_prefixes(src: Sources, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, N]`` right-prefix lengths ``A_s``, drawn independently per source from its rates."""
    out = np.empty((n, src.n), dtype=np.int64)
    for s in range(src.n):
        pmf = -np.diff(src.survival[s, : src.length(s) + 2])  # P(A_s = 0..n_s)
        out[:, s] = np.searchsorted(np.cumsum(pmf), rng.random(n) * pmf.sum(), side="right")
    return np.minimum(out, [src.length(s) for s in range(src.n)])


def simulate_tokens(src: Sources, plan: Plan, n: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """Sampled: ``[n]`` committed tokens per step, and how many distinct draws of ``A`` broke the
    per-step identity "the trie accepts the longest drafted right prefix" (0 when the model holds).
    Each step walks the trie :func:`realize` builds, then the TR forest where it stops (``simulate_walks``)."""
    A = sample_prefixes(src, n, rng)
    _, first, inv = np.unique(A @ (max(src.length(s) for s in range(src.n)) + 1) ** np.arange(src.n),
                              return_index=True, return_inverse=True)
    rows = A[first]
    depth, stop = np.empty(len(rows), dtype=np.int64), np.full(len(rows), -1)
    broken = 0
    for i, row in enumerate(rows):
        tree, drafted = realize(src, plan, row)
        depth[i], on_spine = chain_walk(tree)
        stop[i] = depth[i] if on_spine else -1
        broken += depth[i] != max(min(int(a), d) for a, d in zip(row, drafted))
    out = depth[inv] + 1
    model = AcceptanceModel((), src.branch)
    for d, b in enumerate(plan.widths):
        steps = np.flatnonzero(stop[inv] == d)
        if b and len(steps):
            out[steps] += simulate_tr(forest_shape(src.branch, b), model, len(steps), rng) - 1
    return out, broken


# ---- Rates measured from a finite number of steps ----
Estimator = Callable[[Sources, int, np.random.Generator], Sources]


def observed_rates(src: Sources, steps: int, rng: np.random.Generator) -> Sources:
    """Sampled: the rates SourceRates would hold after ``steps`` steps in which every chain is checked
    against the truth up to its first miss: ``(hits_d + 0.25 * 4) / (trials_d + 4)`` per depth."""
    A = sample_prefixes(src, steps, rng)
    chains = []
    for s in range(src.n):
        d = np.arange(1, src.length(s) + 1)
        trials = (A[:, s, None] >= d - 1).sum(axis=0)
        hits = (A[:, s, None] >= d).sum(axis=0)
        chains.append(tuple((hits + PRIOR * PRIOR_WEIGHT) / (trials + PRIOR_WEIGHT)))
    return Sources(tuple(chains), src.branch)


def random_sources(rng: np.random.Generator, n_sources: tuple[int, int] = (2, 4), max_len: int = 12) -> Sources:
    """Random rates: per source a base rate in 0.05..0.95 with per-depth jitter (+-0.1) and a chain of
    1..``max_len`` tokens; TR ranks ``q (1 - q)^(r-1)``, r <= 10, q log-uniform in 0.01..0.4."""
    N = int(rng.integers(n_sources[0], n_sources[1] + 1))
    chains = []
    for _ in range(N):
        base = rng.uniform(0.05, 0.95)
        n = int(rng.integers(1, max_len + 1))
        chains.append(tuple(np.clip(base + rng.uniform(-0.1, 0.1, n), 0.01, 0.99)))
    q = float(np.exp(rng.uniform(np.log(0.01), np.log(0.4))))
    return Sources(tuple(chains), tuple(q * (1.0 - q) ** r for r in range(10)))
