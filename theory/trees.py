"""Trees under the model: the deployed spine rule, isotropic controls, and exact optima
(docs/theory.md, "Trees under the model" and "Optimal trees"). Every builder returns a
:class:`goose.tree.DraftTree` with placeholder tokens (the node index, so siblings are distinct)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from goose.policies.spine import harmonic_split  # the deployed rule, as the policy runs it
from goose.theory.model import ROOT, LEAD, AcceptanceModel, _depths, path_to
from goose.tree import DraftTree

BRANCH = "branch"
ROOT_BRANCH = "root-branch"


def make_tree(parents: Sequence[int], origins: Sequence[str], route: str = "tree") -> DraftTree:
    """A DraftTree with placeholder tokens (node index) for a shape."""
    return DraftTree(tuple(range(len(parents))), tuple(parents), tuple(origins), None, route, {})


# ---- Simple shapes ----
def chain_tree(length: int, origin: str = LEAD) -> DraftTree:
    """Root plus a chain of ``length`` nodes (the PLD chain when ``origin`` is the spine)."""
    return make_tree(tuple(range(-1, length)), (ROOT,) + (origin,) * length, "path")


def spine_with_branches(widths: Sequence[int], origin: str = BRANCH) -> DraftTree:
    """A spine of ``len(widths) - 1`` nodes; ``widths[d]`` leaf branches at spine depth d (0 = root)."""
    L = len(widths) - 1
    parents, origins = [-1], [ROOT]
    spine_nodes = [0]
    for _ in range(L):
        parents.append(spine_nodes[-1])
        origins.append(LEAD)
        spine_nodes.append(len(parents) - 1)
    for d, b in enumerate(widths):
        for _ in range(b):
            parents.append(spine_nodes[d])
            origins.append(origin)
    return make_tree(parents, origins, "branched")


def isotropic_tree(k: int, budget: int, max_depth: int = 6, origin: str = BRANCH) -> DraftTree:
    """The isotropic control: breadth-first, every node gets up to ``k`` children (ranks 1..k),
    depth <= ``max_depth``, at most ``budget`` nodes including the root, one source, no spine."""
    parents, depth = [-1], [0]
    frontier = deque([0])
    while frontier and len(parents) < budget:
        u = frontier.popleft()
        for _ in range(k):
            if len(parents) >= budget:
                break
            parents.append(u)
            depth.append(depth[u] + 1)
            if depth[-1] < max_depth:
                frontier.append(len(parents) - 1)
    return make_tree(parents, (ROOT,) + (origin,) * (len(parents) - 1), "isotropic")


# ---- The deployed spine rule (docs/algorithm.md section 6) in the model ----
@dataclass(frozen=True)
class SpineRule:
    """The knobs of the deployed construction (defaults: the reference configuration)."""

    budget: int = 60
    chain_len: int = 20  # tokens the context matcher proposed
    confidence: float = 0.0
    ema: float = 0.5  # spine acceptance EMA: picks the spine-share tier
    top_k: int = 10
    min_score: float = 0.01
    max_branch_depth: int = 6
    spine_branch_ratio: float = 0.5
    budget_extension: int = 40

    def spine_length(self) -> int:
        budget = self.budget + int(self.confidence * self.budget_extension)
        base = 0.15 if self.ema < 0.2 else 0.30 if self.ema < 0.4 else 0.50
        ratio = base + self.confidence * (1.0 - base)
        return min(self.chain_len, int(budget * ratio)) if self.chain_len > 0 else 0


def goose_tree(q: Sequence[float], rule: SpineRule = SpineRule()) -> DraftTree:
    """The spine tree section 6 builds, with a branch source whose rank-r successor has score
    ``q_r / sum(q)`` (ranks beyond ``top_k`` do not exist); root branches are labelled ``root-branch``.
    With ``chain_len = 0`` it is the pure branch tree the rule builds when there is no context match."""
    budget = rule.budget + int(rule.confidence * rule.budget_extension)
    qv = list(q)[: rule.top_k]
    total = sum(qv)
    scores = [x / total if total > 0 else 0.0 for x in qv]
    L = rule.spine_length()

    parents, origins, depth = [-1], [ROOT], [0]

    def add(parent: int, origin: str) -> int:
        parents.append(parent)
        origins.append(origin)
        depth.append(depth[parent] + 1)
        return len(parents) - 1

    spine = [0]
    for _ in range(L):
        spine.append(add(spine[-1], LEAD))
    branch_budget = budget - 1 - L
    if L > 0 and branch_budget > 0:
        spine_share = max(1, int(branch_budget * rule.spine_branch_ratio))
        root_share = branch_budget - spine_share
    else:
        spine_share, root_share = 0, branch_budget

    frontier: deque[tuple[int, float]] = deque()

    def attach(parent: int, allowance: int, origin: str) -> int:
        """Up to ``allowance`` children of ranks 1, 2, ... (score >= min_score); returns how many."""
        before = len(parents)
        for r in range(min(allowance, len(scores))):
            if scores[r] < rule.min_score:
                break
            c = add(parent, origin)
            if depth[c] < rule.max_branch_depth:
                frontier.append((c, scores[r]))
        return len(parents) - before

    attach(0, root_share, ROOT_BRANCH)
    for j, allowance in enumerate(harmonic_split(spine_share, L)):
        if allowance > 0:
            attach(spine[j + 1], allowance, BRANCH)
    remaining = budget - len(parents)
    while frontier and remaining > 0:
        u, score = frontier.popleft()
        width = max(1, min(len(scores), math.ceil(remaining * score)))
        remaining -= attach(u, min(width, max(1, rule.top_k // depth[u]), remaining), BRANCH)
    return make_tree(parents, origins, "branched")


def stationary_rule(p: Sequence[float], rule: SpineRule = SpineRule(), steps: int = 300) -> SpineRule:
    """``rule`` with the EMA tier it settles in under the model: iterates ``ema <- 0.3 E[spine
    accepted] / L + 0.7 ema`` from 0.5 (mean-field) and keeps the tier visited most often in the
    second half (the EMA can oscillate across a tier boundary)."""
    model = AcceptanceModel(tuple(p), ())
    tier_ema = (0.1, 0.3, 0.5)  # one EMA value inside each tier: [0, 0.2), [0.2, 0.4), [0.4, 1]
    frac: list[float | None] = []  # per tier: expected fraction of the spine accepted
    for e in tier_ema:
        L = replace(rule, ema=e).spine_length()
        acc = float(np.cumprod([model.p(d) for d in range(1, L + 1)]).sum()) if L > 0 else 0.0
        frac.append(acc / L if L > 0 else None)

    def tier(e: float) -> int:
        return 0 if e < 0.2 else 1 if e < 0.4 else 2

    visits = [0, 0, 0]
    ema = 0.5
    for t in range(steps):
        x = frac[tier(ema)]
        if x is not None:
            ema = 0.3 * x + 0.7 * ema
        if t >= steps // 2:
            visits[tier(ema)] += 1
    best = max(range(3), key=lambda i: (visits[i], i))
    return replace(rule, ema=tier_ema[best])


# ---- Optimal trees ----
@dataclass(frozen=True)
class ForestTable:
    """Single-source values: ``F[d, m, r]`` = best expected accepted nodes of a forest of at most m nodes,
    top-level ranks >= r + 1, under an accepted parent, with depth d left (bounded) or d = 1 (unbounded)."""

    F: np.ndarray  # [D + 1, max_nodes + 1, K + 1]
    choice: np.ndarray  # same shape: nodes of the rank-(r+1) child's subtree; -1: the best uses m - 1 nodes
    bounded: bool


def _forest_fill(qv: np.ndarray, F: np.ndarray, C: np.ndarray, S: np.ndarray, m: int) -> None:
    """Row m of the forest table, every rank at once: a rank-(r+1) child with a k-node subtree is
    worth ``q_{r+1} (1 + S[k])`` plus the best forest of ranks > r + 1 on the other m - k nodes."""
    ks = np.arange(1, m + 1)
    vals = qv[:, None] * (1.0 + S[ks])[None, :] + F[m - ks, 1:].T  # [K, m]
    j = np.argmax(vals, axis=1)
    best = vals[np.arange(len(qv)), j]
    F[m, :-1], C[m, :-1] = best, ks[j]
    keep = F[m - 1, :-1] >= best  # "at most m nodes": never worse than m - 1
    F[m, :-1][keep] = F[m - 1, :-1][keep]
    C[m, :-1][keep] = -1


def _forest_table(q: Sequence[float], max_nodes: int, max_depth: int | None) -> ForestTable:
    qv = np.asarray(q, dtype=float)
    K, M, D = len(qv), max_nodes, 1 if max_depth is None else max_depth
    F = np.zeros((D + 1, M + 1, K + 1))
    C = np.zeros((D + 1, M + 1, K + 1), dtype=np.int64)
    for d in range(1, D + 1):
        below = d if max_depth is None else d - 1  # the layer of a child's subtree (unbounded: this one)
        S = np.zeros(M + 1)  # S[k] = F[below, k - 1, 0]: a k-node child subtree holds a (k-1)-node forest
        for m in range(1, M + 1):
            S[m] = F[below, m - 1, 0]
            _forest_fill(qv, F[d], C[d], S, m)
    return ForestTable(F, C, max_depth is not None)


def _emit_forest(table: ForestTable, parent: int, m: int, layer: int,
                 parents: list[int], origins: list[str], origin: str) -> None:
    """Append the optimal forest of at most ``m`` nodes under ``parent`` (ranks from 1), read from ``layer``."""
    r, K = 0, table.F.shape[2] - 1
    while m > 0 and r < K and layer > 0:
        k = int(table.choice[layer, m, r])
        if k == -1:  # the best with m nodes uses at most m - 1
            m -= 1
            continue
        parents.append(parent)
        origins.append(origin)
        _emit_forest(table, len(parents) - 1, k - 1, layer - 1 if table.bounded else layer, parents, origins, origin)
        m -= k
        r += 1


def forest_values(q: Sequence[float], max_nodes: int) -> np.ndarray:
    """``[max_nodes + 1]``: ``F(m)``, the best expected accepted nodes of a one-source forest of at most
    ``m`` nodes (rank rates ``q`` at every depth, depth unbounded) under an accepted node."""
    return _forest_table(q, max_nodes, None).F[-1, :, 0].copy()


def optimal_single_source(
    q: Sequence[float], budget: int, max_depth: int | None = None, origin: str = BRANCH
) -> tuple[float, DraftTree]:
    """Best expected tokens per step, and a tree reaching it, over trees of at most ``budget``
    nodes (root included) and depth <= ``max_depth`` for one source with rank rates ``q``."""
    if budget < 1:
        raise ValueError(f"budget counts the root and must be >= 1, got {budget}")
    table = _forest_table(q, budget - 1, max_depth)
    parents, origins = [-1], [ROOT]
    _emit_forest(table, 0, budget - 1, len(table.F) - 1, parents, origins, origin)
    return 1.0 + float(table.F[-1, budget - 1, 0]), make_tree(parents, origins, "optimal")


def optimal_spine_tree(
    p: Sequence[float], q: Sequence[float], budget: int, max_spine: int | None = None
) -> tuple[float, DraftTree]:
    """Best expected tokens per step, and a tree reaching it, over all trees of at most ``budget``
    nodes made of a spine (``p_d`` at depth d, at most ``max_spine`` nodes: the chain on offer)
    and branches with rank rates ``q`` anywhere off the root, the spine and other branches.
    ``H[i, m]``: best accepted nodes below an accepted spine node at depth i with m nodes to spend."""
    if budget < 1:
        raise ValueError(f"budget counts the root and must be >= 1, got {budget}")
    M = budget - 1
    Lmax = M if max_spine is None else min(max_spine, M)
    model = AcceptanceModel(tuple(p), ())
    table = _forest_table(q, M, None)
    F = table.F[-1, :, 0]
    H = np.zeros((Lmax + 1, M + 1))
    cont_k = np.full((Lmax + 1, M + 1), -1, dtype=np.int64)  # branch nodes at i when continuing; -1: stop
    H[Lmax] = F
    m_idx = np.arange(M + 1)[:, None]
    k_idx = np.arange(M)[None, :]
    rest = m_idx - 1 - k_idx  # nodes left below the next spine node when k go to branches here
    valid = rest >= 0
    rest_c = np.where(valid, rest, 0)
    for i in range(Lmax - 1, -1, -1):
        pn = model.p(i + 1)
        vals = np.where(valid, pn * (1.0 + H[i + 1][rest_c]) + (1.0 - pn) * F[:M][None, :], -np.inf)
        j = np.argmax(vals, axis=1) if M > 0 else np.zeros(M + 1, dtype=np.int64)
        cont = vals[np.arange(M + 1), j] if M > 0 else np.full(M + 1, -np.inf)
        better = cont > F + 1e-15
        H[i] = np.where(better, cont, F)
        cont_k[i] = np.where(better, j, -1)
    parents, origins = [-1], [ROOT]
    node, i, m = 0, 0, M
    branch_plan: list[tuple[int, int]] = []
    while i < Lmax and m > 0 and cont_k[i, m] >= 0:
        k = int(cont_k[i, m])
        branch_plan.append((node, k))
        parents.append(node)
        origins.append(LEAD)
        node, i, m = len(parents) - 1, i + 1, m - 1 - k
    branch_plan.append((node, m))
    for at, k in branch_plan:
        _emit_forest(table, at, k, 1, parents, origins, BRANCH)
    return 1.0 + float(H[0, M]), make_tree(parents, origins, "optimal")


# ---- Brute force (the oracle for small budgets) ----
def ordered_trees(n: int) -> Iterator[tuple[int, ...]]:
    """Every ordered rooted tree of ``n`` nodes as a preorder parent array (Catalan(n-1) of them)."""
    if n < 1:
        return
    parents = [-1]

    def rec() -> Iterator[tuple[int, ...]]:
        if len(parents) == n:
            yield tuple(parents)
            return
        # in preorder the next node hangs off the rightmost path: the last node or an ancestor
        u = len(parents) - 1
        while u >= 0:
            parents.append(u)
            yield from rec()
            parents.pop()
            u = parents[u]

    yield from rec()


def brute_force_best(
    model: AcceptanceModel, budget: int, spine: bool, max_spine: int | None = None, max_depth: int | None = None
) -> tuple[float, DraftTree]:
    """Exhaustive optimum over trees of at most ``budget`` nodes: all-``branch`` trees, or (with
    ``spine``) every choice of a root path as the spine, scored by ``model.expected_tokens``."""
    best_v, best_t = 1.0, make_tree((-1,), (ROOT,))
    for n in range(2, budget + 1):
        for parents in ordered_trees(n):
            if max_depth is not None and max(_depths(parents)) > max_depth:
                continue
            ends = range(n) if spine else (0,)
            for end in ends:
                on_path = set(path_to(parents, end)[1:])
                if max_spine is not None and len(on_path) > max_spine:
                    continue
                origins = [ROOT] + [LEAD if i in on_path else BRANCH for i in range(1, n)]
                t = make_tree(parents, origins)
                v = model.expected_tokens(t)
                if v > best_v + 1e-12:
                    best_v, best_t = v, t
    return best_v, best_t
