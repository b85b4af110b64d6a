"""The acceptance model over :class:`goose.tree.DraftTree`: its exact expectation, a Monte-Carlo
simulator and the greedy walk against known target tokens (docs/theory.md, "The model")."""

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

    @classmethod
    def geometric(cls, p: float, q: float, ranks: int = 10, **per_origin) -> AcceptanceModel:
        """Constant spine rate ``p``; independent branch success ``q``: ``q_r = q (1 - q)^(r-1)``
        (the "independent" model of Proposition 2)."""
        return cls((p,), independent_ranks(q, ranks), per_origin)

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

    def conditional(self, tree: TreeLike) -> np.ndarray:
        """``[n]`` probability of each node being accepted given its parent was (root: 1)."""
        depth = _depths(tree.parents)
        spine, groups = _layout(tree.parents, tree.origins, self.spine_origin)
        cond = np.zeros(len(depth))
        cond[0] = 1.0
        for u in range(len(depth)):
            s, miss = _spine_child(spine, u), 1.0
            if s >= 0:
                cond[s] = self.p(depth[s])
                miss = 1.0 - cond[s]
            for origin, group in groups[u].items():
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

    def expected_tokens(self, tree: TreeLike) -> float:
        """Expected committed tokens per verification step: accepted draft tokens + the bonus."""
        return 1.0 + float(self.reach(tree)[1:].sum())


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


def _layout(parents: Sequence[int], origins: Sequence[str], spine_origin: str) -> tuple[list[list[int]], list[dict]]:
    """Per node: its spine children, and its other children grouped by origin (groups in order of
    first appearance, ranks in node order)."""
    spine: list[list[int]] = [[] for _ in parents]
    groups: list[dict[str, list[int]]] = [{} for _ in parents]
    for c in range(1, len(parents)):
        if origins[c] == spine_origin:
            spine[parents[c]].append(c)
        else:
            groups[parents[c]].setdefault(origins[c], []).append(c)
    return spine, groups


def _spine_child(spine: list[list[int]], u: int) -> int:
    """Node ``u``'s spine child (-1: none); raises if it has several."""
    if len(spine[u]) > 1:
        raise ValueError(f"node {u} has {len(spine[u])} spine children {spine[u]}; the spine is a chain "
                         "(at most one spine child per node)")
    return spine[u][0] if spine[u] else -1


# ---- Monte Carlo: the greedy walk of the same tree against a simulated target ----
def simulate_walks(tree: TreeLike, model: AcceptanceModel, n: int, rng: np.random.Generator) -> np.ndarray:
    """``[n]`` index of the last accepted node of ``n`` independent greedy walks against a target
    simulated generatively, independently of :meth:`AcceptanceModel.conditional` (docs/theory.md,
    "Monte Carlo")."""
    depth = _depths(tree.parents)
    spine, by_origin = _layout(tree.parents, tree.origins, model.spine_origin)
    spine_child = [_spine_child(spine, u) for u in range(len(depth))]
    groups: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in depth]
    for u, origin_groups in enumerate(by_origin):
        for origin, group in origin_groups.items():
            vec = np.asarray(model.rates(origin), dtype=float)
            # categorical over ranks 1..K, then "not in the list" (index K)
            cdf = np.cumsum(np.append(vec, max(0.0, 1.0 - vec.sum())))
            cdf[-1] = 1.0
            groups[u].append((cdf, np.asarray(group)))

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


# ---- The greedy walk against known target tokens (logged records) and the spine-only re-walk ----
def greedy_walk(
    tokens: Sequence[int], parents: Sequence[int], origins: Sequence[str], argmax: Sequence[int],
    spine_origin: str = LEAD,
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


def chain_accept_from_argmax(
    tokens: Sequence[int], parents: Sequence[int], origins: Sequence[str], argmax: Sequence[int],
    spine_origin: str = LEAD,
) -> int:
    """Accepted tokens if the spine alone had been verified as a plain chain (the PLD chain).

    Exact from the tree pass: a node's argmax depends only on its ancestors, which are the same in
    the chain, so the chain's spine node at depth d is accepted iff its token equals the argmax at
    the spine node at depth d - 1 and every shallower one was accepted.
    """
    kids = _children(parents)
    u, n = 0, 0
    while True:
        spine = [c for c in kids[u] if origins[c] == spine_origin]
        if not spine or tokens[spine[0]] != argmax[u]:
            return n
        u, n = spine[0], n + 1


def chain_accept_from_path(origins: Sequence[str], path: Sequence[int], spine_origin: str = LEAD) -> int:
    """The same from the accepted path alone: the number of leading spine nodes on it.

    Valid for paths the greedy walk produced: the walk takes the spine child whenever it matches,
    so the chain's accepted prefix is exactly the spine prefix of the tree's path.
    """
    return next((i for i, node in enumerate(path[1:]) if origins[node] != spine_origin), len(path) - 1)
