"""Proposition 2: how many branches each spine node should get (docs/theory.md, "Proposition 2").
The expected extra tokens ``G(b) = sum_d w_d (q_1 + ... + q_{b_d})`` are separable and concave in each
``b_d`` when ``q`` is non-increasing, so taking the largest marginal gains one at a time is exact."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np


def spine_weights(p: Sequence[float], L: int) -> np.ndarray:
    """``[L]`` weights ``w_d = P_d (1 - p_{d+1})`` for d = 1..L-1 and ``w_L = P_L``; ``p[d - 1]`` is
    ``p_d``, depths beyond ``len(p)`` reuse the last entry."""
    if L <= 0:
        return np.zeros(0)
    pv = [p[min(d, len(p)) - 1] for d in range(1, L + 2)]
    P = np.cumprod(pv[:L])
    nxt = np.asarray(pv[1 : L + 1])
    w = P * (1.0 - nxt)
    w[-1] = P[-1]
    return w


def gain(w: Sequence[float], q: Sequence[float], b: Sequence[int]) -> float:
    """``sum_d w_d (q_1 + ... + q_{b_d})``."""
    Q = np.concatenate([[0.0], np.cumsum(q)])
    return float(sum(wd * Q[min(bd, len(q))] for wd, bd in zip(w, b, strict=True)))


def optimal_allocation(w: Sequence[float], q: Sequence[float], M: int) -> list[int]:
    """The exact optimum: the ``M`` largest marginal gains (ties: the shallower node first); uses all
    ``min(M, L K)`` nodes (extra nodes never lower the gain)."""
    if any(b > a + 1e-15 for a, b in zip(q, q[1:])):
        raise ValueError(f"q must be non-increasing in rank for the greedy allocation to be exact, got {list(q)}")
    L, K = len(w), len(q)
    b = [0] * L
    heap = [(-w[d] * q[0], d) for d in range(L)] if K else []
    heapq.heapify(heap)
    for _ in range(min(M, L * K)):
        _, d = heapq.heappop(heap)
        b[d] += 1
        if b[d] < K:
            heapq.heappush(heap, (-w[d] * q[b[d]], d))
    return b


def brute_force_allocation(w: Sequence[float], q: Sequence[float], M: int) -> tuple[float, list[int]]:
    """Best gain over every allocation with ``sum b <= M``, ``0 <= b_d <= K`` (the oracle)."""
    L, K = len(w), len(q)
    best, arg = 0.0, [0] * L
    for b in itertools.product(range(K + 1), repeat=L):
        if sum(b) <= M:
            g = gain(w, q, b)
            if g > best + 1e-15:
                best, arg = g, list(b)
    return best, arg


def _fill(b: list[int], M: int, K: int) -> list[int]:
    """Hand out what ``b`` leaves of ``M`` one node at a time, shallowest node with room first."""
    left = min(M, len(b) * K) - sum(b)
    while left > 0:
        for d in range(len(b)):
            if left > 0 and b[d] < K:
                b[d] += 1
                left -= 1
    return b


def harmonic_allocation(M: int, L: int, K: int) -> list[int]:
    """Section 6's 1/(j+1) rule: in depth order, ``max(1, floor(M w_j / W))`` capped by what is left
    and by the top-K; the flooring remainder (which the deployed rule gives to the breadth-first
    extension) is spent here, shallowest first, so that all rules use the same number of nodes."""
    if L <= 0:
        return []
    W = sum(1.0 / (j + 1) for j in range(L))
    b, left = [], M
    for j in range(L):
        take = min(max(1, int(M / (j + 1) / W)), left, K) if left > 0 else 0
        b.append(take)
        left -= take
    return _fill(b, M, K)


def uniform_allocation(M: int, L: int, K: int) -> list[int]:
    """``floor(M / L)`` per node (capped by K), the remainder to the shallowest nodes."""
    if L <= 0:
        return []
    return _fill([min(M // L, K)] * L, M, K)


def kkt_slope(p: float, q: float) -> float:
    """The predicted decay, in branches per unit depth, of the optimum for constant ``p`` and
    independent branch success ``q`` (``q_r = q (1-q)^(r-1)``): ``ln(1/p) / ln(1/(1-q))``."""
    return math.log(1.0 / p) / math.log(1.0 / (1.0 - q))


def interior_active(b: Sequence[int], K: int) -> np.ndarray:
    """Depth indices (0-based) where the optimum is neither 0 nor the cap K, end node excluded."""
    return np.asarray([d for d in range(len(b) - 1) if 0 < b[d] < K], dtype=int)


def fitted_slope(b: Sequence[int], K: int) -> float | None:
    """Least-squares decay (branches per depth, positive = decreasing) over the interior active
    nodes; None with fewer than 3 of them."""
    idx = interior_active(b, K)
    if len(idx) < 3:
        return None
    slope = np.polyfit(idx.astype(float), np.asarray(b, dtype=float)[idx], 1)[0]
    return float(-slope)


def band_width(b: Sequence[int], K: int, slope: float) -> float | None:
    """``max - min`` of ``b_d + slope * d`` over the interior active nodes (the exact optimum lies
    on the line up to integer rounding iff this is <= 1); None with fewer than 2 of them."""
    idx = interior_active(b, K)
    if len(idx) < 2:
        return None
    v = np.asarray(b, dtype=float)[idx] + slope * idx
    return float(v.max() - v.min())
