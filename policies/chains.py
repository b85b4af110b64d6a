"""Every composed chain source drafts into one tree: the chains, ranked by measured acceptance and merged.

Each step every source that proposes something gives a chain (its proposal, or a tree proposal's
first root-to-leaf path). The chains merge into a trie under the root: a token that two sources
propose at the same place is one node that both vouch for (``DraftTree.sources``). Which chain is
the **spine** follows each source's *measured* acceptance (:class:`goose.policies.rates.SourceRates`), never
the order of ``sources=[...]``:

- :func:`rank` orders this step's chains by the expected accepted tokens of each under its
  source's rates (ties: higher confidence, longer chain, then the source's name: so the order of
  ``sources=[...]`` never decides). ``forced`` (a policy's ``spine_source``) goes first whenever
  it proposes.
- :func:`merge` lays the ranked chains out: the best one is the spine; a chain that agrees with
  the whole spine and goes further extends it; every other chain leaves the spine at the depth
  where it first disagrees and hangs there as a **side chain** (origin ``"chain"``), drafted while
  its source's rate of being right from the fork on stays at or above ``side_min``
  (:meth:`Trie.add_sides`).
- :func:`chain_trie` is the plain trie of the ranked chains (the isotropic policies' layout).

Every verified pass tells the target's tokens along the accepted path and the bonus token after it,
so every chain laid out that step is measured against them, drafted or not (``tree.meta["chains"]``,
:meth:`SourceRates.observe`). The policies (policies/) and the vLLM proposer (goose/vllm/) all
lay chains out here. With a single chain source, its chain is the spine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from goose.interfaces import DraftContext, Proposal
from goose.policies.rates import SourceRates
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


def chain_trie(ranked: Sequence[Drafted]) -> tuple[list[dict[int, int]], list[list[str]], set[int]]:
    """The plain trie of the ranked chains under the root (node 0): ``(kids, vouch, lead_nodes)``, ``kids[c]``
    a node's child token -> node (children in rank order), ``vouch[c]`` the sources whose chains pass
    through it, ``lead_nodes`` the nodes of the best-ranked chain."""
    kids: list[dict[int, int]] = [{}]
    vouch: list[list[str]] = [[]]
    lead_nodes = {0}
    for r, d in enumerate(ranked):
        c = 0
        for t in d.tokens:
            nxt = kids[c].get(t)
            if nxt is None:
                nxt = kids[c][t] = len(kids)
                kids.append({})
                vouch.append([])
            vouch[nxt].append(d.source)
            if r == 0:
                lead_nodes.add(nxt)
            c = nxt
    return kids, vouch, lead_nodes
