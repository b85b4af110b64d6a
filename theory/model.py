"""The acceptance model over :class:`goose.tree.DraftTree`, its exact expectation and a simulator.

Semantics (docs/theory.md, "The model"): given an accepted node, its children's events are
disjoint (siblings are distinct tokens). The spine child (origin ``"spine"``, at most one) at
depth ``d`` matches with ``p_d``; then each origin group of the other children, in order of first
appearance, gives its child of rank ``r`` (node order) ``m * q^o_r``, ``m`` the probability that
the spine child and every earlier group missed. Every rank vector sums to at most 1.
``P(v accepted)`` is the product along the root-to-``v`` path, and the expected tokens per
verification step are ``1 + sum_v P(v accepted)`` (the bonus included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

LEAD = "lead"  # origin of the spine's nodes
ROOT = "root"
RATE_TOL = 1e-9


class TreeLike(Protocol):
    """What the model reads from a tree: :class:`goose.tree.DraftTree` satisfies it."""

    @property
    def parents(self) -> Sequence[int]: ...

    @property
    def origins(self) -> Sequence[str]: ...


def _rates(name: str, values: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(v) for v in values)
    for i, v in enumerate(out):
        if not (0.0 <= v <= 1.0) or v != v:
            raise ValueError(f"{name}[{i}] = {v!r}: every acceptance rate must lie in [0, 1]")
    return out


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-depth spine rates, per-rank branch rates, optional per-origin branch rates.

    ``spine[d - 1]`` is ``p_d`` (the spine node at depth ``d``); depths beyond ``len(spine)`` reuse
    the last entry (an empty ``spine`` means ``p = 0``). ``branch[r - 1]`` is ``q_r``; ranks beyond
    ``len(branch)`` have rate 0. ``per_origin[o]`` replaces ``branch`` for origin ``o``.
    """

    spine: tuple[float, ...] = ()
    branch: tuple[float, ...] = ()
    per_origin: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    spine_origin: str = LEAD

    def __post_init__(self) -> None:
        object.__setattr__(self, "spine", _rates("spine", self.spine))
        object.__setattr__(self, "branch", _rates("branch", self.branch))
        object.__setattr__(
            self, "per_origin", {str(o): _rates(f"per_origin[{o!r}]", v) for o, v in dict(self.per_origin).items()}
        )
        for name, vec in [("branch", self.branch), *((f"per_origin[{o!r}]", v) for o, v in self.per_origin.items())]:
            if sum(vec) > 1.0 + RATE_TOL:
                raise ValueError(
                    f"{name} sums to {sum(vec):.6f} > 1: ranks of one source are disjoint events, "
                    "so their rates must sum to at most 1"
                )

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def geometric(cls, p: float, q: float, ranks: int = 10, **per_origin) -> AcceptanceModel:
        """Constant spine rate ``p``; independent branch success ``q``: ``q_r = q (1 - q)^(r-1)``.

        ``P(some of the first b branches matches) = 1 - (1 - q)^b``: the "independent" model of
        Proposition 2.
        """
        return cls((p,), independent_ranks(q, ranks), per_origin)

    # ---- rates -------------------------------------------------------------------------------
    def p(self, depth: int) -> float:
        if depth < 1:
            raise ValueError(f"spine depth must be >= 1, got {depth}")
        if not self.spine:
            return 0.0
        return self.spine[min(depth, len(self.spine)) - 1]

    def rates(self, origin: str) -> tuple[float, ...]:
        return self.per_origin.get(origin, self.branch)

    def q(self, rank: int, origin: str = "branch") -> float:
        vec = self.rates(origin)
        return vec[rank - 1] if 1 <= rank <= len(vec) else 0.0

    # ---- the model over a tree ---------------------------------------------------------------
    def conditional(self, tree: TreeLike) -> np.ndarray:
        """``[n]`` probability of each node being accepted given its parent was (root: 1)."""
        parents, origins = tree.parents, tree.origins
        n = len(parents)
        cond = np.zeros(n)
        cond[0] = 1.0
        depth = _depths(parents)
        for u, kids in enumerate(_children(parents)):
            if not kids:
                continue
            spine_kids = [c for c in kids if origins[c] == self.spine_origin]
            if len(spine_kids) > 1:
                raise ValueError(
                    f"node {u} has {len(spine_kids)} spine children {spine_kids}; the spine is a chain "
                    "(at most one spine child per node)"
                )
            miss = 1.0
            if spine_kids:
                s = spine_kids[0]
                cond[s] = self.p(depth[s])
                miss = 1.0 - cond[s]
            for origin, group in _origin_groups(kids, origins, self.spine_origin):
                if origin == ROOT:
                    raise ValueError(f"node {group[0]} has origin 'root'; only node 0 may")
                vec = self.rates(origin)
                for r, c in enumerate(group):
                    cond[c] = miss * (vec[r] if r < len(vec) else 0.0)
                miss *= 1.0 - sum(vec[: len(group)])
        return cond

    def reach(self, tree: TreeLike) -> np.ndarray:
        """``[n]`` probability that each node is on the accepted path."""
        cond = self.conditional(tree)
        out = cond.copy()
        for i in range(1, len(out)):
            out[i] = out[tree.parents[i]] * cond[i]
        return out

    def expected_accept_length(self, tree: TreeLike) -> float:
        """Expected accepted draft tokens (root and bonus excluded)."""
        return float(self.reach(tree)[1:].sum())

    def expected_tokens(self, tree: TreeLike) -> float:
        """Expected committed tokens per verification step: accepted draft tokens + the bonus."""
        return 1.0 + self.expected_accept_length(tree)


def independent_ranks(q: float, ranks: int) -> tuple[float, ...]:
    """``q_r = q (1 - q)^(r - 1)``, r = 1..ranks (sums to ``1 - (1 - q)^ranks <= 1``)."""
    return tuple(q * (1.0 - q) ** r for r in range(ranks))


def _children(parents: Sequence[int]) -> list[list[int]]:
    ch: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        ch[parents[i]].append(i)
    return ch


def _depths(parents: Sequence[int]) -> list[int]:
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return d


def _origin_groups(kids: Sequence[int], origins: Sequence[str], spine_origin: str) -> list[tuple[str, list[int]]]:
    """Non-spine children grouped by origin, groups in order of first appearance, ranks in node order."""
    groups: dict[str, list[int]] = {}
    for c in kids:
        if origins[c] != spine_origin:
            groups.setdefault(origins[c], []).append(c)
    return list(groups.items())


# ---------------------------------------------------------------------------------------------
# Monte Carlo: the greedy walk of the same tree against a simulated target
# ---------------------------------------------------------------------------------------------
def simulate_walks(tree: TreeLike, model: AcceptanceModel, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n]`` index of the last accepted node of ``n`` independent greedy walks.

    The target is simulated generatively, independently of :meth:`AcceptanceModel.conditional`
    (docs/theory.md, "Monte Carlo"): the spine child matches with ``p_d``; else each origin group
    in turn draws the rank of the target's token among its source's candidates (``q^o_r``, or
    "not listed"), and the walk takes that child if drafted. It stops when no child matches.
    """
    parents, origins = tree.parents, tree.origins
    kids = _children(parents)
    depth = _depths(parents)
    spine_child = [-1] * len(parents)
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = []
    for u, ks in enumerate(kids):
        sk = [c for c in ks if origins[c] == model.spine_origin]
        if len(sk) > 1:
            raise ValueError(f"node {u} has more than one spine child")
        if sk:
            spine_child[u] = sk[0]
        g = []
        for origin, group in _origin_groups(ks, origins, model.spine_origin):
            vec = np.asarray(model.rates(origin), dtype=float)
            # categorical over ranks 1..K, then "not in the list" (index K)
            cdf = np.cumsum(np.append(vec, max(0.0, 1.0 - vec.sum())))
            cdf[-1] = 1.0
            g.append((cdf, np.asarray(group)))
        groups.append(g)

    cur = np.zeros(n, dtype=np.int64)
    active = np.ones(n, dtype=bool)
    while active.any():
        nxt = np.full(n, -1, dtype=np.int64)
        idx_active = np.flatnonzero(active)
        for u in np.unique(cur[idx_active]):
            walkers = idx_active[cur[idx_active] == u]
            undecided = np.ones(len(walkers), dtype=bool)
            s = spine_child[u]
            if s >= 0:
                hit = rng.random(len(walkers)) < model.p(depth[s])
                nxt[walkers[hit]] = s
                undecided &= ~hit
            for cdf, group in groups[u]:
                w = np.flatnonzero(undecided)
                if not len(w):
                    break
                rank0 = np.searchsorted(cdf, rng.random(len(w)), side="right")  # 0-based rank
                hit = rank0 < min(len(group), len(cdf) - 1)  # index K is "not listed"
                nxt[walkers[w[hit]]] = group[rank0[hit]]
                undecided[w[hit]] = False
        moved = nxt >= 0
        cur[moved] = nxt[moved]
        active = moved
    return cur


def simulate_tokens(tree: TreeLike, model: AcceptanceModel, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n]`` committed tokens per step (accepted draft tokens + bonus) of ``n`` simulated steps."""
    depth = np.asarray(_depths(tree.parents))
    return depth[simulate_walks(tree, model, n, rng)] + 1


def path_to(parents: Sequence[int], node: int) -> tuple[int, ...]:
    """Root-first node path to ``node``."""
    out = [node]
    while out[-1] != 0:
        out.append(parents[out[-1]])
    return tuple(reversed(out))


# ---------------------------------------------------------------------------------------------
# The greedy walk against known target tokens (logged records) and the spine-only re-walk
# ---------------------------------------------------------------------------------------------
def greedy_walk(
    tokens: Sequence[int], parents: Sequence[int], origins: Sequence[str], argmax: Sequence[int], spine_origin: str = LEAD
) -> tuple[int, ...]:
    """The verifier's walk: from the root move to the child whose token is the target's argmax at
    the current node, preferring the spine child; stop when none matches. Returns the path."""
    kids = _children(parents)
    path = [0]
    while True:
        u = path[-1]
        match = [c for c in kids[u] if tokens[c] == argmax[u]]
        if not match:
            return tuple(path)
        spine = [c for c in match if origins[c] == spine_origin]
        path.append(spine[0] if spine else match[0])


def spine_chain(parents: Sequence[int], origins: Sequence[str], spine_origin: str = LEAD) -> tuple[int, ...]:
    """The spine as node indices: root, then the spine child of each spine node in turn."""
    kids = _children(parents)
    chain = [0]
    while True:
        sk = [c for c in kids[chain[-1]] if origins[c] == spine_origin]
        if not sk:
            return tuple(chain)
        chain.append(sk[0])


def chain_accept_from_argmax(
    tokens: Sequence[int], parents: Sequence[int], origins: Sequence[str], argmax: Sequence[int], spine_origin: str = LEAD
) -> int:
    """Accepted tokens if the spine alone had been verified as a plain chain (the PLD chain).

    Exact from the tree pass: a node's argmax depends only on its ancestors, which are the same in
    the chain, so the chain's spine node at depth d is accepted iff its token equals the argmax at
    the spine node at depth d - 1 and every shallower one was accepted.
    """
    chain = spine_chain(parents, origins, spine_origin)
    n = 0
    for prev, node in zip(chain[:-1], chain[1:], strict=True):
        if tokens[node] != argmax[prev]:
            break
        n += 1
    return n


def chain_accept_from_path(origins: Sequence[str], path: Sequence[int], spine_origin: str = LEAD) -> int:
    """The same from the accepted path alone: the number of leading spine nodes on it.

    Valid for paths the greedy walk produced: the walk takes the spine child whenever it matches,
    so the chain's accepted prefix is exactly the spine prefix of the tree's path.
    """
    n = 0
    for node in path[1:]:
        if origins[node] != spine_origin:
            break
        n += 1
    return n
