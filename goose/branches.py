"""Branch candidates from every successor source, merged and ranked by what each source has earned.

With two or more successor sources, :meth:`goose.DraftContext.successors` merges their answers per parent (a
token several propose is one candidate), ordered by :class:`BranchRates`, never by the order of the sources:
per source and rank r, the rate at which its rank-r token was the target's next token, measured at every node
of each accepted path (drafted or not), from a prior ``prior / (r + 1)`` worth ``weight`` observations, with
``carry`` of it kept into the next generation. A candidate scores the best rate among the sources that gave
it; one several gave, what such agreements measured at its best rank, shrunk toward that rate; ties go to the
better rank, then the smaller id. A single successor source's answers pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def shrunk(hits, trials, prior, weight):
    """``hits`` in ``trials`` shrunk toward ``prior`` by ``weight`` pseudo-observations (numbers or numpy
    arrays, elementwise): the one estimator every learned rate uses."""
    return (hits + prior * weight) / (trials + weight)


class Successors(NamedTuple):
    """What :meth:`goose.DraftContext.successors` returns: candidate ids best first, a score each, and per
    id the names of the sources that proposed it (sorted; one name when a single source answered)."""

    ids: Sequence[int]
    scores: Sequence[float]
    sources: Sequence[tuple[str, ...]]


class BranchRates:
    """Per source and rank, how often a successor answer's token was the target's (module docstring)."""

    def __init__(self, prior: float = 0.2, weight: float = 4.0, max_rank: int = 16, carry: float = 0.5):
        self.prior, self.weight, self.max_rank, self.carry = prior, weight, max_rank, carry
        self.hits: dict[str, list[float]] = {}
        self.trials: dict[str, list[float]] = {}
        # candidates two or more sources gave, by the best rank any gave them
        self.agree_hits, self.agree_trials = [0.0] * max_rank, [0.0] * max_rank
        self._table: dict[str, list[float]] = {}  # memo of rate() per source, dropped when anything is booked

    def begin(self) -> None:
        """A generation starts: keep ``carry`` of what was learned."""
        k = self.carry
        for table in (self.hits, self.trials):
            for key, row in table.items():
                table[key] = [v * k for v in row]
        self.agree_hits = [v * k for v in self.agree_hits]
        self.agree_trials = [v * k for v in self.agree_trials]
        self._table.clear()

    def agreed(self, rank: int, base: float) -> float:
        """The rate of a candidate several sources gave, the best of them at ``rank``, shrunk toward ``base``
        (the best of their own rates)."""
        r = min(rank, self.max_rank - 1)
        return shrunk(self.agree_hits[r], self.agree_trials[r], base, self.weight)

    def rates(self, source: str) -> list[float]:
        """``[max_rank]``: the source's measured rate at each rank, shrunk toward the prior."""
        row = self._table.get(source)
        if row is None:
            h, t = self.hits.get(source), self.trials.get(source)
            w, p = self.weight, self.prior
            row = [shrunk(h[r] if h else 0.0, t[r] if t else 0.0, p / (r + 1), w) for r in range(self.max_rank)]
            self._table[source] = row
        return row

    def rate(self, source: str, rank: int) -> float:
        """The source's measured rate at ``rank`` (the last rank's beyond ``max_rank``)."""
        return self.rates(source)[min(rank, self.max_rank - 1)]

    def merge(self, answers: Sequence[tuple[str, Sequence[int]]]) -> Successors:
        """One ranked candidate list from ``[(source, ids best first), ...]`` (see the module docstring)."""
        best: dict[int, list] = {}  # token -> [score, best rank, sources]
        cap = self.max_rank - 1
        for source, ids in answers:
            row = self.rates(source)
            for r, t in enumerate(ids):
                p = row[r if r < cap else cap]
                e = best.get(t)
                if e is None:
                    best[t] = [p, r, [source]]
                else:
                    e[0], e[1] = max(e[0], p), min(e[1], r)
                    e[2].append(source)
        for e in best.values():
            if len(e[2]) > 1:
                e[0] = self.agreed(e[1], e[0])
        order = sorted(best.items(), key=lambda kv: (-kv[1][0], kv[1][1], kv[0]))
        return Successors([t for t, _ in order], [e[0] for _, e in order], [tuple(sorted(e[2])) for _, e in order])

    def book(self, asked: dict, root_prev: int | None, tokens: Sequence[int], parents: Sequence[int],
             path: Sequence[int], bonus: int | None) -> None:
        """Book every answer asked for at a node of the accepted ``path`` against the target's next token
        there. ``asked``: ``{(token, prev): ((source, ids, scores), ...)}`` as the step's context recorded it;
        ``root_prev``: the ``prev`` the root was asked with."""
        if not asked:
            return
        cap = self.max_rank
        for k, node in enumerate(path):
            nxt = tokens[path[k + 1]] if k + 1 < len(path) else bonus
            if nxt is None:
                break
            prev = root_prev if node == 0 else tokens[parents[node]]
            answers = asked.get((tokens[node], prev))
            if not answers:
                continue
            for source, ids, _ in answers:
                h = self.hits.get(source)
                if h is None:
                    h = self.hits[source] = [0.0] * cap
                    self.trials[source] = [0.0] * cap
                t = self.trials[source]
                for r in range(min(len(ids), cap)):  # ids are distinct: at most one rank hits
                    t[r] += 1.0
                    if ids[r] == nxt:
                        h[r] += 1.0
            if len(answers) > 1:
                self._book_agreements(answers, nxt)
        self._table.clear()

    def _book_agreements(self, answers, nxt: int) -> None:
        """Book each candidate several sources gave, at the best rank any gave it, against ``nxt``."""
        seen: dict[int, list] = {}  # token -> [best rank, how many sources gave it]
        for _, ids, _ in answers:
            for r, t in enumerate(ids):
                e = seen.get(t)
                if e is None:
                    seen[t] = [r, 1]
                else:
                    e[0], e[1] = min(e[0], r), e[1] + 1
        cap = self.max_rank - 1
        for t, (r, n) in seen.items():
            if n > 1:
                r = min(r, cap)
                self.agree_trials[r] += 1.0
                if t == nxt:
                    self.agree_hits[r] += 1.0

    def snapshot(self) -> dict:
        """``{source: [rate at rank 0, 1, 2]}`` for the stats, for sources measured at all; ``"agreed"``: the
        measured rate of candidates several sources gave, at best rank 0, 1, 2 (counts behind it)."""
        out = {s: [round(x, 3) for x in self.rates(s)[:3]] for s in sorted(self.trials) if sum(self.trials[s])}
        if sum(self.agree_trials):
            out["agreed"] = [f"{h:.0f}/{t:.0f}" for h, t in zip(self.agree_hits[:3], self.agree_trials[:3])]
        return out
