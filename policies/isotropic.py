"""Balanced trees: the isotropic control of the GOOSE paper, and Token Recycling's static tree.

``isotropic`` (presets ``iso3``, ``iso5``): the paper's baseline, with the same sources, budget
and routes as the spine policy but no spine. The tree grows breadth-first from the root; every
node gets up to ``k`` children, its candidate tokens in order: where the node lies on the chains'
trie (every chain source's chain merged, best-ranked by measured acceptance first,
policies/chains.py), the chains' continuations, then the successor-table tokens (``tr``) scoring
at least ``min_score``, deduplicated; until the budget (nodes, root
included; ``B + int(confidence * 40)`` as for the spine) is used or depth ``max_depth`` (6).
The best-ranked chain's tokens have origin ``"spine"``, the other chains' ``"chain"``, successor tokens ``"root-branch"`` under the root and
``"branch"`` deeper. Routes as for the spine: the table knows the anchor -> the tree (route
``"iso"``); else a chain -> the chain alone (``"chain"``); else None.

``tr-tree``: Token Recycling alone, the original fixed tree of 80 draft nodes with level widths
8/21/25/15/8/3 at depths 1..6 (81 nodes with the root), filled from ``successors`` and cut to
the budget (pass ``budget=81`` for the whole tree). The TR paper's per-node layout is not
available, so the shape is derived deterministically: a slot is (parent slot, rank r) and
carries the prior ``prod 1/(r+1)`` over its path (the rank-r successor is assumed to be right
with probability proportional to 1/(r+1)); each level keeps the ``width`` slots of largest prior
(ties: earlier parent, then lower rank), with ranks below ``k`` (8, the original K). Within a
level, slots are laid out by decreasing prior, so a budget cut drops the least likely ones.
Root children have origin ``"root-branch"``, deeper nodes ``"branch"``; route ``"tr"``.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from pydantic import Field, field_validator

from goose.errors import InvalidInputError
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, TreePolicy
from goose.policies.chains import CHAIN, SPINE, Drafted, chain_trie, gather, rank
from goose.policies.merge import MIN_SCORE, TRUST_MIN, MergingPolicy, spine_and_successors
from goose.policies.spine import BRANCH, ROOT_BRANCH
from goose.tree import ROOT, DraftTree


class IsotropicOptions(Options):
    k: int = Field(3, ge=1, le=64, description="children per node")
    max_depth: int = Field(6, ge=1, description="deepest node depth")
    spine_source: str | None = Field(
        None, description="source whose chain continues first at chain nodes when it proposes; None: the chains "
        "ranked by each source's measured acceptance (every source's chain is in the tree, policies/chains.py)"
    )
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="a chain's confidence buys the extension only while its (source, confidence tier) has a measured "
        "depth-1 rate of at least this",
    )


class IsotropicPolicy(MergingPolicy):
    """Balanced k-ary tree over the same sources and budget as the spine tree, no spine."""

    name = "isotropic"
    Options = IsotropicOptions

    def begin(self, request) -> None:
        self.rates.begin(fresh=request is None)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        o = self.options
        st = ctx.state
        anchor = st.anchor
        chains = gather(ctx, self._chains)
        if not self.uses_confidence():
            chains = [Drafted(d.source, d.tokens[: d.base] if d.base else d.tokens, 0.0, d.base) for d in chains]
        ranked = rank(chains, self.rates, self._spine)
        conf = self.trusted(ranked[0]) if ranked else 0.0
        budget = ctx.budget + int(conf * self.extension())
        root = ctx.successors(anchor, st.prev_anchor)
        meta = {"chains": {d.source: (self.rates.key(d.source, d.confidence)[1], d.tokens) for d in ranked},
                "confidence": conf}
        if not len(root.ids):
            if not ranked:
                return None
            lead = ranked[0]
            n = min(len(lead.tokens), budget - 1, st.max_depth)
            if n <= 0:
                return None
            return DraftTree.build((anchor, *lead.tokens[:n]), range(-1, n), SPINE, None, "chain",
                                   ((),) + ((lead.source,),) * n, **meta)

        # the chains' trie, best-ranked first: a node's chain children come in rank order
        kids, vouch, lead_nodes = chain_trie(ranked)

        k, min_score = o.k, MIN_SCORE
        maxd = min(o.max_depth, st.max_depth)
        tokens = [anchor]
        parents = [-1]
        origins = [ROOT]
        sources: list[tuple[str, ...]] = [()]
        depths = [0]
        on_chain = [0]  # the node's place in the chains' trie; -1 off the chains
        i = 0
        while i < len(tokens) and len(tokens) < budget:
            d = depths[i]
            if d >= maxd:
                break  # breadth-first: every later node is at least as deep
            if i == 0:
                ids, scores, by = root
                label = ROOT_BRANCH
            else:
                ids, scores, by = ctx.successors(tokens[i], tokens[parents[i]])
                label = BRANCH
            seen = set()
            c = on_chain[i]
            if c >= 0:
                for t, child in kids[c].items():
                    if len(seen) >= k or len(tokens) >= budget:
                        break
                    seen.add(t)
                    tokens.append(t)
                    parents.append(i)
                    origins.append(SPINE if child in lead_nodes else CHAIN)
                    sources.append(tuple(vouch[child]))
                    depths.append(d + 1)
                    on_chain.append(child)
            for t, s, who in zip(ids, scores, by):
                if len(seen) >= k or len(tokens) >= budget or s < min_score:
                    break
                if t in seen:
                    continue
                seen.add(t)
                tokens.append(t)
                parents.append(i)
                origins.append(label)
                sources.append(who)
                depths.append(d + 1)
                on_chain.append(-1)
            i += 1
        if len(tokens) < 2:
            return None
        return DraftTree.build(tokens, parents, origins, None, "iso", sources, **meta)

    def observe(self, verified) -> None:
        if verified.kind == "tree" and verified.tree is not None:
            self.rates.observe(verified.tree, verified.path, verified.bonus)

    def stats(self) -> dict:
        return {"source_rates": self.rates.snapshot()}


# ---------------------------------------------------------------------------------------------
# Token Recycling's static tree
# ---------------------------------------------------------------------------------------------
TR_TREE_K = 8  # successor ranks a parent may use (the original token recycling's K)


class TRTreeOptions(Options):
    widths: tuple[int, ...] = Field(
        (8, 21, 25, 15, 8, 3), description="nodes per level at depths 1, 2, ... (Token Recycling: 80 nodes)"
    )

    @field_validator("widths")
    @classmethod
    def _widths(cls, v):
        if not v or any(w < 1 for w in v):
            raise ValueError(f"widths must be positive node counts per level, got {v}; e.g. (8, 21, 25, 15, 8, 3)")
        return v


@lru_cache(maxsize=64)
def static_tree(widths: tuple[int, ...], k: int) -> tuple[tuple[int, int, int], ...]:
    """The static shape: slots ``(parent slot, rank, depth)`` in layout order (slot 0 is the root).

    Level by level, the ``widths[d-1]`` children (parent, rank < k) of largest prior
    ``prod 1/(rank+1)`` (compared exactly, as integer denominators); ties: earlier parent slot,
    then lower rank. Within a level the slots are laid out by decreasing prior.
    """
    slots: list[tuple[int, int, int]] = []
    level = [(1, 0)]  # (denominator of the prior, slot)
    for depth, width in enumerate(widths, start=1):
        cands = sorted((den * (r + 1), p, r) for den, p in level for r in range(k))[:width]
        level = []
        for den, p, r in cands:
            slots.append((p, r, depth))
            level.append((den, len(slots)))
    return tuple(slots)


class TRTreePolicy(TreePolicy):
    """Token Recycling's fixed 80-node tree (levels 8/21/25/15/8/3), filled from the successor table."""

    name = "tr-tree"
    Options = TRTreeOptions

    def __init__(self, options: TRTreeOptions | None = None):
        super().__init__(options)
        self.slots = static_tree(tuple(self.options.widths), TR_TREE_K)

    def bind(self, sources: Sequence[DraftSource]) -> None:
        if not any(s.provides_successors for s in sources):
            raise InvalidInputError(
                f"policy {self.name!r} fills its tree from a successor table, but none of the sources "
                f"{[s.name for s in sources]} provides successors. Hint: sources=['tr'] (or 'tr-original')."
            )

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        return spine_and_successors(None, sources)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        st = ctx.state
        root = ctx.successors(st.anchor, st.prev_anchor)
        if not len(root.ids):
            return None
        budget, depth_cap, min_score = ctx.budget, st.max_depth, 0.0
        tokens = [st.anchor]
        parents = [-1]
        origins = [ROOT]
        vouch: list[tuple[str, ...]] = [()]  # the successor sources each node came from (stats.per_source)
        node_of = [0]  # slot -> node index, -1 when the slot is empty
        rows = {0: (*root, set())}
        for p, r, depth in self.slots:
            if len(tokens) >= budget or depth > depth_cap:
                break
            pn = node_of[p]
            if pn < 0:
                node_of.append(-1)
                continue
            row = rows.get(pn)
            if row is None:
                row = rows[pn] = (*ctx.successors(tokens[pn], tokens[parents[pn]]), set())
            ids, scores, by, used = row
            if r >= len(ids) or scores[r] < min_score or ids[r] in used:
                node_of.append(-1)
                continue
            t = ids[r]
            used.add(t)
            node_of.append(len(tokens))
            tokens.append(t)
            parents.append(pn)
            origins.append(ROOT_BRANCH if pn == 0 else BRANCH)
            vouch.append(by[r])
        if len(tokens) < 2:
            return None
        return DraftTree.build(tokens, parents, origins, None, "tr", vouch)


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(IsotropicPolicy)
    register(IsotropicPolicy, name="iso3", defaults={"k": 3}, description="Isotropic control, 3 children per node")
    register(IsotropicPolicy, name="iso5", defaults={"k": 5}, description="Isotropic control, 5 children per node")
    register(TRTreePolicy)
