"""The chain sources' acceptance table (:class:`SourceRates`), learned online by the merging policies, ``chain``
and the vLLM proposer.

Every rate Goose learns is :func:`goose.branches.shrunk` (re-exported here): ``hits`` in ``trials`` pulled
toward a ``prior`` by ``weight`` pseudo-observations.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from goose.branches import shrunk
from goose.tree import DraftTree


class SourceRates:
    """Per-source, per-confidence-tier, per-depth acceptance of chain tokens.

    A chain's **tier** is the first of its source's tier floors its reported confidence reaches (0.0 below
    them all): the floors of the source's measured tiers (``goose tiers``, :meth:`set_tiers`), else
    ``(confident,)``. The reported confidence only chooses the tier; what the tier is worth is measured.
    A tier with measured priors starts at them (p_1 at depth 1, p_deeper deeper), any other at ``prior``.
    ``begin`` keeps ``carry`` of what was learned into the next generation."""

    def __init__(self, prior: float = 0.25, weight: float = 4.0, max_depth: int = 16, confident: float = 1.0,
                 carry: float = 0.5):
        self.prior, self.weight, self.max_depth, self.confident, self.carry = prior, weight, max_depth, confident, carry
        self.hits: dict = defaultdict(lambda: [0.0] * max_depth)
        self.trials: dict = defaultdict(lambda: [0.0] * max_depth)
        self.floors: dict[str, tuple[float, ...]] = {}  # source -> its tiers' floors, highest first
        self.starts: dict[tuple[str, float], tuple[float, float]] = {}  # (source, floor) -> (p_1, p_deeper)
        self._memo: dict = {}  # key -> {n: expected(key, n)}
        self._inherited: dict = {}  # key -> {(n, prior): reach_inherited(key, n, prior)}

    def _forget(self) -> None:
        self._memo.clear()
        self._inherited.clear()

    def set_tiers(self, source: str, tiers) -> None:
        """``tiers``: ``[(floor, p_1, p_deeper), ...]`` measured for ``source`` (None or empty: none)."""
        if not tiers:
            return
        tiers = sorted(tiers, key=lambda t: -t[0])
        self.floors[source] = tuple(float(t[0]) for t in tiers)
        for floor, p1, deeper in tiers:
            self.starts[source, float(floor)] = (float(p1), float(deeper))
        self._forget()

    def begin(self, fresh: bool) -> None:
        """A generation starts: keep ``carry`` of what was learned (none of it when ``fresh``)."""
        k = 0.0 if fresh else self.carry
        for table in (self.hits, self.trials):
            for key in list(table):
                table[key] = [v * k for v in table[key]]
        self._forget()

    def key(self, source: str, confidence: float) -> tuple[str, float]:
        """``(source, tier floor)`` of a chain with this reported confidence."""
        for floor in self.floors.get(source, (self.confident,)):
            if confidence >= floor:
                return source, floor
        return source, 0.0

    def _counts(self, key, depth: int) -> tuple[float, float]:
        """(hits, trials) of ``key`` at ``depth`` (the deepest row past ``max_depth``)."""
        d = min(depth, self.max_depth) - 1
        h, t = self.hits.get(key), self.trials.get(key)
        return (h[d], t[d]) if h is not None else (0.0, 0.0)

    def rate(self, key, depth: int) -> float:
        """The rate at ``depth``, shrunk toward its tier's measured prior, else ``prior``."""
        st = self.starts.get(key)
        start = self.prior if st is None else st[0] if depth <= 1 else st[1]
        return shrunk(*self._counts(key, depth), start, self.weight)

    def trusted(self, drafted, trust_min: float) -> float:
        """The confidence ``drafted`` (a :class:`goose.policies.chains.Drafted`, or None) may spend: its
        reported confidence while its (source, tier) has a depth-1 rate of at least ``trust_min``, else 0."""
        if drafted is None or drafted.confidence <= 0.0:
            return 0.0
        key = self.key(drafted.source, drafted.confidence)
        return drafted.confidence if self.rate(key, 1) >= trust_min else 0.0

    def reach(self, key, n: int, start: int = 0) -> list[float]:
        """``[n]``: the probability that the chain is right through depth ``start + j + 1``, given
        it was right through depth ``start``."""
        out, r = [], 1.0
        for d in range(start + 1, start + n + 1):
            r *= self.rate(key, d)
            out.append(r)
        return out

    def reach_inherited(self, key, n: int, prior: float | None = None) -> tuple[float, ...]:
        """As :meth:`reach` from depth 0, but each depth's rate is shrunk toward the rate of the depth above
        (the first toward ``prior``, default this table's): an unmeasured depth inherits the shallower rate,
        as ``theory.calibrate.smoothed`` does for the spine. Memoized until ``key`` is booked again (the vLLM
        proposer reads every key each step)."""
        memo = self._inherited.setdefault(key, {})
        if (n, prior) not in memo:
            out, p, rate = [], 1.0, self.prior if prior is None else prior
            for d in range(1, n + 1):
                rate = shrunk(*self._counts(key, d), rate, self.weight)
                p *= rate
                out.append(p)
            memo[n, prior] = tuple(out)
        return memo[n, prior]

    def expected(self, key, n: int) -> float:
        """Expected accepted tokens of an ``n``-token chain of this key (memoized until it is booked)."""
        memo = self._memo.setdefault(key, {})
        if n not in memo:
            memo[n] = sum(self.reach(key, n))
        return memo[n]

    def observe(self, tree: DraftTree, path: Sequence[int], bonus: int | None) -> None:
        """Book every chain laid out this step (``tree.meta["chains"]``) against the target's tokens: the
        accepted path's, then the bonus token. A chain the policy cut or hung as a side chain counts too."""
        chains = tree.meta.get("chains")
        if not chains:
            return
        toks = tree.tokens
        target = [toks[i] for i in path[1:]]
        if bonus is not None:
            target.append(bonus)
        self.book(chains, target)

    def book(self, chains: dict, target: Sequence[int]) -> None:
        """Book ``chains`` (``{source: (tier floor, tokens)}``) against the target's tokens after the
        anchor (``target[d]`` at depth d + 1): a trial at each depth checked, a hit where they agree,
        until the first miss."""
        for source, (floor, chain) in chains.items():
            key = (source, floor)
            self._memo.pop(key, None)  # only the booked keys' memos change
            self._inherited.pop(key, None)
            h, t = self.hits[key], self.trials[key]
            for d in range(min(len(chain), len(target))):
                j = min(d, self.max_depth - 1)
                t[j] += 1.0
                if chain[d] != target[d]:
                    break
                h[j] += 1.0

    def snapshot(self) -> dict:
        """``{source^tier: [rate at depth 1, 2, 3]}`` for the stats (``pld^1``: pld's chains of confidence >= 1)."""
        out = {}
        for (source, floor), t in sorted(self.trials.items()):
            if sum(t):
                out[f"{source}^{floor:g}"] = [round(self.rate((source, floor), d), 3) for d in (1, 2, 3)]
        return out
