"""Every composed chain source drafts into one tree: the chains, ranked by measured acceptance and merged.

Each step every source that proposes gives a chain (a tree proposal: its first root-to-leaf path). A token
two sources propose at the same place is one node both vouch for (``DraftTree.sources``). :func:`rank` orders
the chains by expected accepted tokens under each source's measured acceptance (:class:`SourceRates`), never
by the order of ``sources=[...]``; :func:`merge` makes the best the **spine**, extended by any chain that
agrees with all of it and goes further; every other chain hangs as a **side chain** (origin ``"side"``)
where it first disagrees (:meth:`Trie.add_sides`). Every chain laid out (``tree.meta["chains"]``) is booked
against the target's tokens, drafted or not (:meth:`SourceRates.observe`). The policies and the vLLM
proposer (goose/vllm/) lay chains out here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import mul

from goose.interfaces import DraftContext, Proposal
from goose.policies.rates import SourceRates
from goose.tree import ROOT, DraftTree

LEAD = "lead"  # origin of the spine's nodes: the best-ranked chain
SIDE = "side"  # origin of another source's chain where it leaves the spine

first_chain = Proposal.first_chain  # a proposal's tokens as one chain


@dataclass(frozen=True)
class Drafted:
    """One source's chain this step."""

    source: str
    tokens: tuple[int, ...]
    confidence: float
    base: int | None = None  # the unextended length (``Proposal.info["match_len"]``), when the source says
    probs: tuple[float, ...] | None = None  # an alternative path: the proposal's own conditional probability per token


def gather(ctx: DraftContext, names: Sequence[str]) -> list[Drafted]:
    """This step's chains, one per source that proposes."""
    out = []
    for name in names:
        prop = ctx.proposal(name)
        chain = () if prop is None else prop.first_chain()
        if not chain:
            continue
        base = prop.info.get("match_len") if prop.info else None
        out.append(Drafted(name, tuple(chain), prop.confidence,  # in [0, 1]: check_proposal saw to it
                           base if isinstance(base, int) and not isinstance(base, bool) else None))
    return out


def unextended(chains: Sequence[Drafted]) -> list[Drafted]:
    """The confidence-off ablation: each chain cut to its unextended match, at confidence 0."""
    return [Drafted(d.source, d.tokens[: d.base] if d.base else d.tokens, 0.0, d.base) for d in chains]


def alternatives(prop: Proposal) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """A tree proposal's other root-to-leaf paths (its first is its chain), likeliest leaf first:
    ``(tokens from the root, conditional probability of each token)``, each probability the ratio of the
    proposal's scores along the path (1.0 each when it gives no scores)."""
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
    if sc is None:
        prob = [1.0] * n
    else:
        leaves.sort(key=lambda i: -sc[i])
        prob = [max(0.0, min(1.0, sc[i] / sc[p] if p >= 0 and sc[p] > 0 else sc[i])) for i, p in enumerate(parents)]
    out = []
    for leaf in leaves:
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        path.reverse()
        out.append((tuple(prop.tokens[i] for i in path), tuple(prob[i] for i in path)))
    return out


def gather_alternatives(ctx: DraftContext, chains: Sequence[Drafted]) -> list[Drafted]:
    """The other paths of this step's tree proposals (the context caches proposals: no source runs twice)."""
    return [Drafted(d.source, toks, d.confidence, None, probs)
            for d in chains for toks, probs in alternatives(ctx.proposal(d.source))]


def rank(chains: Sequence[Drafted], rates: SourceRates, forced: str | None = None) -> list[Drafted]:
    """Best first: ``forced`` when it proposes, then by expected accepted tokens under the measured rates;
    ties: higher confidence, longer chain, then the source's name."""
    def score(d: Drafted):
        return (d.source != forced, -rates.expected(rates.key(d.source, d.confidence), len(d.tokens)),
                -d.confidence, -len(d.tokens), d.source)

    return sorted(chains, key=score)


def laid_out(ranked: Sequence[Drafted], rates: SourceRates) -> dict:
    """``{source: (tier floor, tokens)}`` of every chain laid out: ``tree.meta["chains"]``, which
    :meth:`SourceRates.observe` books."""
    return {d.source: (rates.key(d.source, d.confidence)[1], d.tokens) for d in ranked}


@dataclass
class Merged:
    """The ranked chains laid out as a spine and side chains (token lists, no tree yet)."""

    spine: list[int]  # the spine's tokens, depth 1 first
    spine_sources: list[tuple[str, ...]]  # who vouches for each spine token
    confidence: float  # the spine source's confidence this step
    leader: Drafted | None  # the spine's source
    sides: list[tuple[Drafted, int]]  # (chain, fork depth: it agrees with the spine on that many tokens)
    chains: dict  # :func:`laid_out`


def merge(ranked: Sequence[Drafted], rates: SourceRates, alts: Sequence[Drafted] = ()) -> Merged:
    """``ranked``: one chain per source, best first; ``alts``: tree proposals' other paths, hung as side
    chains after every ranked chain (they never lead nor extend the spine, nor enter the measured rates)."""
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
        if k == len(spine) and len(d.tokens) > k and not alt:  # agrees with the whole spine and goes on
            spine.extend(d.tokens[k:])
            vouch.extend([d.source] for _ in d.tokens[k:])
        elif k < len(d.tokens) and not (alt and k == len(spine)):
            sides.append((d, k))  # leaves the spine at depth k
    return Merged(spine, [tuple(v) for v in vouch], lead.confidence, lead, sides, laid_out(ranked, rates))


class Trie:
    """A tree under construction: tokens, parents, origins, sources, depths, and each node's child tokens."""

    __slots__ = ("tokens", "parents", "origins", "sources", "depths", "kids")

    def __init__(self, root: int):
        self.tokens = [root]
        self.parents = [-1]
        self.origins = [ROOT]
        self.sources: list[tuple[str, ...]] = [()]
        self.depths = [0]
        self.kids: dict[int, dict[int, int]] = {}  # node -> {child token: child node}

    def add(self, parent: int, token: int, origin: str, sources: tuple[str, ...]) -> int:
        i = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.origins.append(origin)
        self.sources.append(sources)
        self.depths.append(self.depths[parent] + 1)
        self.kids.setdefault(parent, {})[token] = i
        return i

    def add_sides(self, merged: Merged, spine_len: int, room: int, rates: SourceRates, side_min: float,
                  depth_cap: int) -> int:
        """Hang the side chains (at most ``room`` nodes) off the root and the spine, which must be nodes
        1..spine_len; each is drafted while its reach stays at least ``side_min``. Returns the nodes added."""
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
                start = rates.reach(key, fork)[-1] if fork else 1.0
                reach = list(accumulate(d.probs[fork : fork + n], mul, initial=start))[1:]
            for j, r in enumerate(reach):
                t = d.tokens[fork + j]
                c = self.kids.get(node, {}).get(t)
                if c is not None:  # shared with an earlier side chain: one node both vouch for
                    if d.source not in self.sources[c]:
                        self.sources[c] = (*self.sources[c], d.source)
                    node = c
                    continue
                if r < side_min or added >= room:
                    break
                node = self.add(node, t, SIDE, (d.source,))
                added += 1
        return added

    def tree(self, route: str, **meta) -> DraftTree:
        return DraftTree.build(self.tokens, self.parents, self.origins, None, route, self.sources, **meta)


def lead_path(tree: DraftTree) -> list[int]:
    """The spine's nodes, depth 1 first: from the root, each node's child of origin ``"lead"``."""
    nodes = [0]
    while (nxt := next((k for k in tree.children[nodes[-1]] if tree.origins[k] == LEAD), None)) is not None:
        nodes.append(nxt)
    return nodes[1:]


def chain_tree(anchor: int, chain: Sequence[int], vouching: Sequence[tuple[str, ...]], route: str,
               **meta) -> DraftTree:
    """``chain`` alone under ``anchor``, origin ``"lead"``; ``vouching[j]``: the sources of its token j."""
    return DraftTree.build((anchor, *chain), range(-1, len(chain)), LEAD, None, route, ((), *vouching), **meta)


def chain_trie(anchor: int, ranked: Sequence[Drafted]) -> Trie:
    """The plain trie of the ranked chains under ``anchor``: a node's children come in rank order, its sources
    are the chains through it, its origin ``"lead"`` on the best-ranked chain, else ``"side"``."""
    trie = Trie(anchor)
    for r, d in enumerate(ranked):
        c = 0
        for t in d.tokens:
            nxt = trie.kids.get(c, {}).get(t)
            if nxt is None:
                nxt = trie.add(c, t, SIDE if r else LEAD, ())
            trie.sources[nxt] += (d.source,)
            c = nxt
    return trie
