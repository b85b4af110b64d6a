"""What is learned online, in one place: the shrunk rate, and the chain sources' acceptance table.

Every rate Goose learns as it decodes is one estimator, :func:`shrunk`: ``hits`` successes in ``trials``
pulled toward a ``prior`` by ``weight`` pseudo-observations, ``(hits + prior * weight) / (trials +
weight)``. Its callers differ only in what they count and where they start:

- :class:`SourceRates` (here): a chain source's token at depth d right, given the tokens before it
  were, per source and confidence tier; prior 0.25 behind 4 (the merging policies, ``chain``, the vLLM
  proposer);
- :class:`goose.branches.BranchRates`: a successor source's token at rank r the target's next token;
  prior 0.2 / (r + 1) behind 4;
- ``spine-fit`` (policies/fit.py): each tree node class's acceptance; its options' ``prior`` behind
  ``prior_weight``;
- the vLLM proposer (goose/vllm/proposer.py): a request's accepted tokens over what its drafts were expected to
  give, toward 1 behind ``request_weight`` expected tokens.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from goose.branches import shrunk
from goose.tree import DraftTree


class SourceRates:
    """Per-source, per-confidence-tier, per-depth acceptance of chain tokens, learned online (module docstring).

    A chain's **tier** is the first of its source's tier floors its reported confidence reaches (0.0 below
    them all): the floors of the source's measured tiers (``goose tiers``, :meth:`set_tiers`), else
    ``(confident,)``. The reported confidence only chooses the tier; what the tier is worth is measured.
    A tier with measured priors starts at them (p_1 at depth 1, p_deeper deeper), any other at ``prior``."""

    def __init__(self, prior: float = 0.25, weight: float = 4.0, max_depth: int = 16, confident: float = 1.0,
                 carry: float = 0.5):
        self.prior, self.weight, self.max_depth, self.confident, self.carry = prior, weight, max_depth, confident, carry
        self.hits: dict = defaultdict(lambda: [0.0] * max_depth)
        self.trials: dict = defaultdict(lambda: [0.0] * max_depth)
        self.floors: dict[str, tuple[float, ...]] = {}  # source -> its tiers' floors, highest first
        self.starts: dict[tuple[str, float], tuple[float, float]] = {}  # (source, floor) -> (p_1, p_deeper)
        self._memo: dict = {}  # key -> {n: expected(key, n)}
        self._inherited: dict = {}  # key -> {(n, prior): reach_inherited(key, n, prior)}

    def set_tiers(self, source: str, tiers) -> None:
        """``tiers``: ``[(floor, p_1, p_deeper), ...]`` measured for ``source`` (None or empty: none)."""
        if not tiers:
            return
        tiers = sorted(tiers, key=lambda t: -t[0])
        self.floors[source] = tuple(float(t[0]) for t in tiers)
        for floor, p1, deeper in tiers:
            self.starts[source, float(floor)] = (float(p1), float(deeper))
        self._memo.clear()
        self._inherited.clear()

    def begin(self, fresh: bool) -> None:
        """A generation starts: keep ``carry`` of what was learned (all of it dropped when ``fresh``)."""
        k = 0.0 if fresh else self.carry
        for table in (self.hits, self.trials):
            for key in list(table):
                table[key] = [v * k for v in table[key]]
        self._memo.clear()
        self._inherited.clear()

    def key(self, source: str, confidence: float) -> tuple[str, float]:
        """``(source, tier floor)`` of a chain with this reported confidence."""
        for floor in self.floors.get(source, (self.confident,)):
            if confidence >= floor:
                return source, floor
        return source, 0.0

    def start(self, key, depth: int) -> float:
        """Where the rate of ``key`` at ``depth`` starts: its tier's measured prior, else ``prior``."""
        st = self.starts.get(key)
        return self.prior if st is None else st[0] if depth <= 1 else st[1]

    def rate(self, key, depth: int) -> float:
        d = min(depth, self.max_depth) - 1
        h, t = self.hits.get(key), self.trials.get(key)
        hit, trial = (h[d], t[d]) if h is not None else (0.0, 0.0)
        return shrunk(hit, trial, self.start(key, depth), self.weight)

    def trusted(self, drafted, trust_min: float) -> float:
        """The confidence ``drafted`` (a :class:`goose.policies.chains.Drafted`, or None) may spend on budget, spine share and bypass: its reported confidence
        while its (source, tier) has earned a depth-1 rate of at least ``trust_min``, else 0."""
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
        """As :meth:`reach` from depth 0, but each depth's rate is shrunk toward the rate of the depth
        above (the first toward ``prior``, default this table's): an unmeasured depth inherits the
        shallower rate, as ``theory.calibrate.smoothed`` does for the spine (a match that held so far
        tends to hold on). Kept until ``key`` is booked again (vLLM's proposer reads every key's each step)."""
        memo = self._inherited.get(key)
        if memo is None:
            memo = self._inherited[key] = {}
        out = memo.get((n, prior))
        if out is None:
            out = memo[n, prior] = tuple(self._reach_inherited(key, n, prior))
        return out

    def _reach_inherited(self, key, n: int, prior: float | None) -> list[float]:
        h, t = self.hits.get(key), self.trials.get(key)
        out, p, rate = [], 1.0, self.prior if prior is None else prior
        for d in range(n):
            j = min(d, self.max_depth - 1)
            hit, trial = (h[j], t[j]) if h is not None else (0.0, 0.0)
            rate = shrunk(hit, trial, rate, self.weight)
            p *= rate
            out.append(p)
        return out

    def expected(self, key, n: int) -> float:
        """Expected accepted tokens of an ``n``-token chain of this key."""
        memo = self._memo.get(key)
        if memo is None:
            memo = self._memo[key] = {}
        m = memo.get(n)
        if m is None:
            m = memo[n] = sum(self.reach(key, n))
        return m

    def observe(self, tree: DraftTree, path: Sequence[int], bonus: int | None) -> None:
        """Book every chain laid out this step against what the target chose, drafted or not.

        Along the accepted path the target's token at each depth is known (the path's nodes, then
        the bonus token after the last one), so each source's chain is checked token by token until
        its first miss: a trial at each depth checked, a hit where the tokens agree. A chain the
        policy cut, or hung as a side chain, is measured all the same."""
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
        anchor (``target[d]`` is the target's token at depth d + 1), each until its first miss."""
        for source, (floor, chain) in chains.items():
            key = (source, floor)
            self._memo.pop(key, None)  # only the booked keys' expectations change
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
