"""Every composed chain source drafts into one tree: the chains' trie, ranked by measured acceptance.

Each step every source that proposes something gives a chain (its proposal, or a tree proposal's
first root-to-leaf path). The chains merge into a trie under the root: a token that two sources
propose at the same place is one node that both vouch for (``DraftTree.sources``). Which chain is
the **spine** follows each source's *measured* acceptance, never the order of ``sources=[...]``:

- :class:`SourceRates` keeps, per source and per depth of its chain (and apart for its confident
  proposals, confidence >= ``confident``), how often the chain's token at depth d was the
  target's when the tokens before it were, shrunk toward a pessimistic prior. Every verified
  pass tells the target's tokens along the accepted path and the bonus token after it, so every
  chain laid out that step is measured against them, drafted or not: a source keeps being
  measured while it is not the spine.
- :func:`rank` orders this step's chains by the expected accepted tokens of each under its
  source's rates (ties: higher confidence, longer chain, then the source's name: so the order of
  ``sources=[...]`` never decides). ``forced`` (a policy's ``spine_source``) goes first whenever
  it proposes.
- :func:`merge` lays the ranked chains out: the best one is the spine; a chain that agrees with
  the whole spine and goes further extends it; every other chain leaves the spine at the depth
  where it first disagrees and hangs there as a **side chain** (origin ``"chain"``), drafted while
  its source's rate of being right from the fork on stays at or above ``side_min``.

With a single chain source, its chain is the spine.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from goose.errors import InvalidInputError
from goose.interfaces import DraftContext, DraftSource, Options, Proposal, TreePolicy
from goose.tree import DraftTree

SPINE = "spine"
CHAIN = "chain"  # origin of another source's chain where it leaves the spine


def first_chain(prop: Proposal) -> tuple[int, ...]:
    """A proposal's tokens as one chain (:meth:`goose.Proposal.first_chain`)."""
    return prop.first_chain()


@dataclass(frozen=True)
class Drafted:
    """One source's chain this step."""

    source: str
    tokens: tuple[int, ...]
    confidence: float
    base: int | None = None  # the unextended length (``Proposal.info["match_len"]``), when the source says
    probs: tuple[float, ...] | None = None  # an alternative path: the proposal's own conditional probability per token


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
        return (hit + self.start(key, depth) * self.weight) / (trial + self.weight)

    def trusted(self, drafted: Drafted | None, trust_min: float) -> float:
        """The confidence ``drafted`` may spend on budget, spine share and bypass: its reported confidence
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
            rate = (hit + rate * self.weight) / (trial + self.weight)
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


TRUST_MIN = 0.2  # the depth-1 rate below which a (source, tier)'s confidence buys nothing (policies' trust_min)


def load_tiers(rates: SourceRates, sources: Sequence[DraftSource], model) -> None:
    """Give ``rates`` every chain source's confidence tiers measured with ``model`` (``goose tiers``;
    :func:`goose.tiers.for_sources`), where it has any."""
    from goose import tiers

    for name, found in tiers.for_sources(sources, model).items():
        rates.set_tiers(name, found)


def chain_sources(sources: Sequence[DraftSource]) -> tuple[str, ...]:
    """Every source a chain may come from: all of them (a successor source that proposes nothing
    costs one call returning None)."""
    return tuple(s.name for s in sources)


def gather(ctx: DraftContext, names: Sequence[str]) -> list[Drafted]:
    """This step's chains, one per source that proposes."""
    out = []
    for name in names:
        prop = ctx.proposal(name)
        if prop is None or not len(prop):
            continue
        chain = first_chain(prop)
        if not chain:
            continue
        base = prop.info.get("match_len") if prop.info else None
        out.append(Drafted(name, tuple(chain), prop.confidence,  # in [0, 1]: check_proposal saw to it
                           base if isinstance(base, int) and not isinstance(base, bool) else None))
    return out


def alternatives(prop: Proposal) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """A tree proposal's other root-to-leaf paths (its first one is its chain), likeliest leaf first:
    ``(tokens from the root, conditional probability of each token)``, the probabilities being the
    ratios of the proposal's scores along the path (1.0 each when it gives no scores)."""
    parents, n = prop.parents, len(prop.parents)
    if n < 2 or prop.is_chain:
        return []
    on_first, node = set(), -1
    for i, p in enumerate(parents):
        if p == node:
            on_first.add(i)
            node = i
    has_kid = {p for p in parents if p >= 0}
    sc = prop.scores
    leaves = [i for i in range(n) if i not in has_kid and i not in on_first]
    if sc is not None:
        leaves.sort(key=lambda i: -sc[i])
    out = []
    for leaf in leaves:
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        path.reverse()
        if sc is None:
            probs = (1.0,) * len(path)
        else:
            probs = tuple(
                max(0.0, min(1.0, sc[i] / sc[parents[i]] if parents[i] >= 0 and sc[parents[i]] > 0 else sc[i]))
                for i in path
            )
        out.append((tuple(prop.tokens[i] for i in path), probs))
    return out


def gather_alternatives(ctx: DraftContext, chains: Sequence[Drafted]) -> list[Drafted]:
    """The other paths of this step's tree proposals (cached by the context: no source runs twice)."""
    out = []
    for d in chains:
        prop = ctx.proposal(d.source)
        for toks, probs in alternatives(prop):
            out.append(Drafted(d.source, toks, d.confidence, None, probs))
    return out


def rank(chains: Sequence[Drafted], rates: SourceRates, forced: str | None = None) -> list[Drafted]:
    """Best first: ``forced`` when it proposes, then by expected accepted tokens under the measured rates."""
    def score(d: Drafted):
        return (d.source != forced, -rates.expected(rates.key(d.source, d.confidence), len(d.tokens)),
                -d.confidence, -len(d.tokens), d.source)

    return sorted(chains, key=score)


@dataclass
class Merged:
    """The ranked chains laid out as a spine and side chains (token lists, no tree yet)."""

    spine: list[int]  # the spine's tokens, depth 1 first
    spine_sources: list[tuple[str, ...]]  # who vouches for each spine token
    confidence: float  # the spine source's confidence this step
    leader: Drafted | None  # the spine's source
    sides: list[tuple[Drafted, int]]  # (chain, fork depth: it agrees with the spine on that many tokens)
    chains: dict  # {source: (tier floor, tokens)} of every chain laid out (tree.meta["chains"], for SourceRates.observe)


def merge(ranked: Sequence[Drafted], rates: SourceRates, alts: Sequence[Drafted] = ()) -> Merged:
    """``ranked``: one chain per source, best first; ``alts``: tree proposals' other paths, hung as side
    chains after every ranked chain (they never lead the spine nor enter the measured rates)."""
    if not ranked:
        return Merged([], [], 0.0, None, [], {})
    lead = ranked[0]
    spine = list(lead.tokens)
    vouch: list[list[str]] = [[lead.source] for _ in spine]
    sides: list[tuple[Drafted, int]] = []
    for d in (*ranked[1:], *alts):
        alt = d.probs is not None
        k = 0
        n = min(len(d.tokens), len(spine))
        while k < n and d.tokens[k] == spine[k]:
            if not alt:
                vouch[k].append(d.source)
            k += 1
        if k == len(spine) and len(d.tokens) > k and not alt:  # agrees with the whole spine and goes on: extends it
            spine.extend(d.tokens[k:])
            vouch.extend([d.source] for _ in d.tokens[k:])
        elif k < len(d.tokens) and not (alt and k == len(spine)):
            sides.append((d, k))  # leaves the spine at depth k (an alternative path: always a side chain)
    chains = {d.source: (rates.key(d.source, d.confidence)[1], d.tokens) for d in ranked}
    return Merged(spine, [tuple(v) for v in vouch], lead.confidence, lead, sides, chains)


class Trie:
    """A tree under construction: tokens, parents, origins, sources, and each node's child tokens."""

    __slots__ = ("tokens", "parents", "origins", "sources", "depths", "kids")

    def __init__(self, root: int, root_origin: str):
        self.tokens = [root]
        self.parents = [-1]
        self.origins = [root_origin]
        self.sources: list[tuple[str, ...]] = [()]
        self.depths = [0]
        self.kids: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, origin: str, sources: tuple[str, ...]) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.origins.append(origin)
        self.sources.append(sources)
        self.depths.append(self.depths[parent] + 1)
        self.kids.setdefault(parent, {})[token] = i
        return i

    def child(self, parent: int, token: int) -> int | None:
        k = self.kids.get(parent)
        return None if k is None else k.get(token)

    def vouch(self, node: int, source: str) -> None:
        if source not in self.sources[node]:
            self.sources[node] = (*self.sources[node], source)

    def add_sides(self, merged: Merged, spine_len: int, room: int, rates: SourceRates, side_min: float,
                  depth_cap: int) -> int:
        """Hang the side chains (at most ``room`` nodes) off spine nodes 0..spine_len; nodes 1..spine_len
        must be the spine. A side chain node is drafted while its source's rate of being right from the
        fork on is at least ``side_min``. Returns the nodes added."""
        added = 0
        for d, fork in merged.sides:
            if fork > spine_len or added >= room:
                continue
            node = fork  # the spine node at depth fork (the root when 0)
            key = rates.key(d.source, d.confidence)
            n = min(len(d.tokens), depth_cap) - fork
            if d.probs is None:
                reach = rates.reach(key, n, fork)
            else:  # the source's measured reach to the fork, then the proposal's own odds of this path
                r = rates.reach(key, fork)[-1] if fork else 1.0
                reach = []
                for p in d.probs[fork : fork + n]:
                    r *= p
                    reach.append(r)
            for j, r in enumerate(reach):
                t = d.tokens[fork + j]
                c = self.child(node, t)
                if c is not None:  # shared with an earlier side chain: one node both vouch for
                    self.vouch(c, d.source)
                    node = c
                    continue
                if r < side_min or added >= room:
                    break
                node = self.add(node, t, CHAIN, (d.source,))
                added += 1
        return added

    def tree(self, route: str, **meta) -> DraftTree:
        return DraftTree.build(self.tokens, self.parents, self.origins, None, route, self.sources, **meta)


def resolve_spine_source(policy: str, wanted: str | None, sources: Sequence[DraftSource]) -> str | None:
    """The name of the source whose chain forms the spine, or None when there is none.

    ``wanted`` names it explicitly (it must be bound); None picks the first source that does not
    provide successors.
    """
    names = [s.name for s in sources]
    if wanted is not None:
        if wanted not in names:
            raise InvalidInputError(
                f"policy {policy!r}: spine_source={wanted!r} is not among the decoder's sources "
                f"{names}. Hint: add it to sources=[...] or set spine_source=None to use the first "
                "chain source."
            )
        return wanted
    for s in sources:
        if not s.provides_successors:
            return s.name
    return None


def spine_and_successors(spine: str | None, sources: Sequence[DraftSource]) -> frozenset[str]:
    """What a spine-shaped policy drafts from: its spine source and every successor source."""
    return frozenset({*([spine] if spine else []), *(s.name for s in sources if s.provides_successors)})


def require_some_source(policy: str, sources: Sequence[DraftSource]) -> None:
    if not sources:
        raise InvalidInputError(
            f"policy {policy!r} needs at least one draft source: a chain source (e.g. 'pld') for the "
            "spine and/or a successor source (e.g. 'tr') for the branches; got sources=[]. "
            "Hint: sources=['pld', 'tr']."
        )


class MergingPolicy(TreePolicy):
    """The wiring of a policy that merges every source's chain into its tree (``spine-tree``, ``isotropic``):
    which sources it asks for chains, the spine source its options force (if any), the measured source rates
    (:meth:`make_rates`), and the budget a confident chain extends (options ``confidence``, ``extension``)."""

    def __init__(self, options: Options | None = None):
        super().__init__(options)
        self._spine: str | None = None
        self._chains: tuple[str, ...] = ()
        self._bound = False
        self.rates = self.make_rates()

    def make_rates(self) -> SourceRates:
        """The per-source chain acceptance this policy learns (defaults: a pessimistic prior)."""
        return SourceRates()

    def bind(self, sources: Sequence[DraftSource]) -> None:
        require_some_source(self.name, sources)
        forced = self.options.spine_source
        self._spine = resolve_spine_source(self.name, forced, sources) if forced else None
        self._chains = chain_sources(sources)
        self._sources = tuple(sources)
        self._bound = True

    def attach(self, model) -> None:
        """The model is known: every chain source's rates start at the tiers measured with it."""
        load_tiers(self.rates, getattr(self, "_sources", ()), model)

    def trusted(self, drafted: Drafted | None) -> float:
        """The confidence ``drafted`` may spend (extension, spine share, bypass): :meth:`SourceRates.trusted`
        at this policy's ``trust_min``; 0 with the ``confidence`` option off."""
        if not self.options.confidence:
            return 0.0
        return self.rates.trusted(drafted, self.options.trust_min)

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        return frozenset(s.name for s in sources)  # every chain merges into the tree, every successor source branches

    def max_nodes(self, budget: int) -> int:
        return budget + (self.options.extension if self.options.confidence else 0)
