"""Balanced trees: the isotropic control of the GOOSE paper, and Token Recycling's static tree.

``isotropic`` (presets ``iso3``, ``iso5``): the spine policy's sources, budget and routes (``"iso"`` for the
tree), no spine. Breadth-first from the root, every node gets up to ``k`` children: the chains'
continuations where it lies on their trie (best-ranked first, policies/chains.py), then the successor tokens
scoring at least ``MIN_SCORE``, deduplicated, down to depth ``max_depth``. Origins: ``"lead"`` on the
best-ranked chain, ``"side"`` on the others, ``"root-branch"`` / ``"branch"`` for successors.

``tr-tree``: Token Recycling's fixed tree of 80 draft nodes (levels 8/21/25/15/8/3), filled from the
successors and cut to the budget, route ``"tr"``; its per-node layout is derived by :func:`static_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from itertools import takewhile

from pydantic import Field, field_validator

from goose.errors import InvalidInputError
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, TreePolicy
from goose.policies.chains import Trie, chain_trie, chain_tree, laid_out, rank
from goose.policies.merge import MIN_SCORE, TRUST_MIN, MergingPolicy
from goose.policies.spine import BRANCH, ROOT_BRANCH
from goose.tree import DraftTree


class IsotropicOptions(Options):
    k: int = Field(3, ge=1, le=64, description="children per node",
        json_schema_extra={"why": "children per node: the paper's iso3 / iso5 control"},
    )
    max_depth: int = Field(6, ge=1, description="deepest node depth",
        json_schema_extra={"why": "depth of the control tree"},
    )
    spine_source: str | None = Field(
        None, description="source whose chain continues first at chain nodes when it proposes; None: the chains "
        "ranked by each source's measured acceptance (every source's chain is in the tree, policies/chains.py)",
        json_schema_extra={"why": "force one chain source first"},
    )
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="a chain's confidence buys the extension only while its (source, confidence tier) has a measured "
        "depth-1 rate of at least this",
        json_schema_extra={"why": "how much measured evidence a source's confidence needs before it buys the extension"},
    )


class IsotropicPolicy(MergingPolicy):
    """Balanced k-ary tree over the same sources and budget as the spine tree, no spine."""

    name = "isotropic"
    Options = IsotropicOptions

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        o, st = self.options, ctx.state
        ranked = rank(self.gather_chains(ctx), self.rates, self._spine)
        conf = self.trusted(ranked[0]) if ranked else 0.0
        budget = ctx.budget + int(conf * self.extension())
        root = ctx.successors(st.anchor, st.prev_anchor)
        meta = {"chains": laid_out(ranked, self.rates), "confidence": conf}
        if not len(root.ids):
            lead = ranked[0] if ranked else None
            n = min(len(lead.tokens), budget - 1, st.max_depth) if lead else 0
            return chain_tree(st.anchor, lead.tokens[:n], ((lead.source,),) * n, "path", **meta) if n > 0 else None
        chains = chain_trie(st.anchor, ranked)
        maxd = min(o.max_depth, st.max_depth)
        trie = Trie(st.anchor)
        on_chain = [0]  # each node's place in the chains' trie; -1 off the chains
        i = 0
        while i < len(trie.tokens) < budget and trie.depths[i] < maxd:  # breadth-first: later nodes are no shallower
            ids, scores, by = root if i == 0 else ctx.successors(trie.tokens[i], trie.tokens[trie.parents[i]])
            label = ROOT_BRANCH if i == 0 else BRANCH
            on = chains.kids.get(on_chain[i], {})  # (no node has the key -1)
            cands = [(t, chains.origins[ch], chains.sources[ch], ch) for t, ch in on.items()]
            succ = takewhile(lambda x: x[1] >= MIN_SCORE, zip(ids, scores, by))
            children = trie.kids.setdefault(i, {})
            for t, origin, who, at in (*cands, *((t, label, who, -1) for t, _, who in succ)):
                if len(children) >= o.k or len(trie.tokens) >= budget:
                    break
                if t not in children:
                    trie.add(i, t, origin, who)
                    on_chain.append(at)
            i += 1
        return trie.tree("iso", **meta) if len(trie.tokens) > 1 else None

    def stats(self) -> dict:
        return {"source_rates": self.rates.snapshot()}


# -- Token Recycling's static tree ---------------------------------------------------------------
TR_TREE_K = 8  # successor ranks a parent may use (the original token recycling's K)


class TRTreeOptions(Options):
    widths: tuple[int, ...] = Field(
        (8, 21, 25, 15, 8, 3), description="nodes per level at depths 1, 2, ... (Token Recycling: 80 nodes)",
        json_schema_extra={"why": "the static tree's nodes per level: fit its size to the budget and device"},
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

    The TR paper's per-node layout is not available, so level by level it keeps the ``widths[d-1]`` children
    (parent, rank < k) of largest prior ``prod 1/(rank+1)`` over the path (compared exactly, as integer
    denominators; ties: earlier parent slot, then lower rank), laid out by decreasing prior, so that a budget
    cut drops the least likely slots."""
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
        return frozenset(s.name for s in sources if s.provides_successors)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        st = ctx.state
        root = ctx.successors(st.anchor, st.prev_anchor)
        if not len(root.ids):
            return None
        trie = Trie(st.anchor)
        node_of = [0]  # slot -> node, -1 where the slot is empty
        rows = {0: root}  # node -> its successors
        for p, r, depth in self.slots:
            if len(trie.tokens) >= ctx.budget or depth > st.max_depth:
                break
            pn = node_of[p]
            if pn >= 0 and pn not in rows:
                rows[pn] = ctx.successors(trie.tokens[pn], trie.tokens[trie.parents[pn]])
            ids, scores, by = rows.get(pn, ((), (), ()))
            if r >= len(ids) or scores[r] < 0.0 or ids[r] in trie.kids.get(pn, ()):
                node_of.append(-1)
                continue
            node_of.append(trie.add(pn, ids[r], ROOT_BRANCH if pn == 0 else BRANCH, by[r]))
        return trie.tree("tr") if len(trie.tokens) > 1 else None


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(IsotropicPolicy)
    register(IsotropicPolicy, name="iso3", defaults={"k": 3}, description="Isotropic control, 3 children per node")
    register(IsotropicPolicy, name="iso5", defaults={"k": 5}, description="Isotropic control, 5 children per node")
    register(TRTreePolicy)
