"""The anisotropic spine tree (GOOSE, section 6 of docs/algorithm.md) and the bypass.

A deep **spine** of context-matched tokens (the chain of a chain-proposing source, ``pld`` by
default) hangs under the root; wide, shallow **branches** of successor-table tokens (``tr``)
hang off the root and the spine nodes, their widths decaying harmonically along the spine, and
grow breadth-first from there. Per cycle (routes of section 3):

- the successor table knows the anchor -> a spine tree, route ``"spine"`` (a pure branch tree
  when there is no chain);
- else there is a chain -> the chain alone, route ``"chain"`` (cut to the tree budget);
- else None: an ordinary decoding step. A tree of fewer than 2 nodes is None too.

Registered policies:

- ``spine-tree``: the raw builder above, with the confidence signal (budget extension, spine
  ratio shift, chain extension) on.
- ``spine``: the paper's configuration: ``bypass`` wrapping ``spine-tree``. Use it as
  ``goose.compose(model, tok, sources=["pld", "tr"], policy="spine")``.
- ``bypass``: confidence-adaptive bypass around any policy (option ``inner``, default
  ``spine-tree``): on a consensus match (confidence 1.0) whose extended chain alone fills the
  largest tree the inner policy may build, verify that chain as one plain chain (route
  ``"bypass"``, origin ``"spine"``, up to ``max_chain`` tokens) instead of a tree.
- Ablations (Table 2 of the paper): ``spine-nobypass`` (confidence off: base budget, no chain
  extension, no bypass), ``spine-nobranch`` (no branches on the spine nodes; root branches and
  their extension stay). "No bigram" and "no prefill harvest" are options of the ``tr`` source
  (``bigram=False``, ``prefill_harvest=False``); "no context match" is ``sources=["tr"]``.

Node origins: ``"spine"`` (chain tokens), ``"root-branch"`` (successor tokens under the root),
``"branch"`` (successor tokens under spine nodes and deeper).

Sources: every source's chain merges into the tree (policies/chains.py): the spine is the chain
with the most expected accepted tokens under each source's measured acceptance (or
``spine_source``'s whenever it proposes), other chains hang as side chains (origin ``"chain"``)
where they leave it; branches from every successor-providing source (first that knows a token
wins, see :meth:`goose.DraftContext.successors`). With only a chain source the
policy degrades to the chain route (plain PLD); with only a successor source, to pure branch
trees. With neither, ``bind`` refuses.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from pydantic import Field, field_validator

from goose import manager
from goose.errors import InvalidInputError
from goose.branches import Successors
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, Request, TreePolicy, Verified
from goose.policies.chains import CHAIN, SPINE, Drafted, Merged, Trie, gather, gather_alternatives, merge, rank
from goose.policies.merge import MIN_SCORE, TRUST_MIN, MergingPolicy, chain_sources, load_tiers, resolve_spine_source
from goose.policies.rates import SourceRates
from goose.tree import ROOT, DraftTree

BRANCH = "branch"
ROOT_BRANCH = "root-branch"


def harmonic_split(share: int, positions: int) -> tuple[int, ...]:
    """Split ``share`` branch nodes over ``positions`` spine nodes with weights 1/(j+1).

    Each position gets ``max(1, int(share * w_j / sum w))`` until the share runs out; the result
    never increases with j and sums to at most ``share``.
    """
    if positions <= 0:
        return ()
    total = sum(1.0 / (j + 1) for j in range(positions))
    out, left = [], share
    for j in range(positions):
        if left <= 0:
            out.append(0)
            continue
        a = min(max(1, int(share * (1.0 / (j + 1)) / total)), left)
        out.append(a)
        left -= a
    return tuple(out)


def spine_ratio(ema: float, tiers: Sequence[float], cutoffs: Sequence[float]) -> float:
    """The spine share tier for a spine acceptance estimate."""
    if ema < cutoffs[0]:
        return tiers[0]
    if ema < cutoffs[1]:
        return tiers[1]
    return tiers[2]


# ---------------------------------------------------------------------------------------------
# The raw spine tree builder
# ---------------------------------------------------------------------------------------------
# the spine tree's internal tuning (the paper's defaults where it gives them)
SIDE_SHARE = 0.5  # at most this share of the branch budget goes to other sources' chains where they leave the spine
SIDE_MIN = 0.05  # a side chain's node is drafted while its source's rate of being right from the fork on is at least this
RATE_PRIOR, RATE_WEIGHT = 0.25, 4.0  # a chain source's per-depth acceptance before it is measured, and its weight
RATE_CARRY = 0.5  # share of the measured source rates carried into the decoder's next generation
TIER_CUTOFFS = (0.2, 0.4)  # spine-acceptance EMA cut-offs between the tiers of the spine's budget share
EMA_INIT, EMA_WEIGHT = 0.5, 0.3  # the spine acceptance EMA: its start per request, the newest cycle's weight
SPINE_BRANCH_SHARE = 0.5  # share of the branch budget hung off spine nodes (the rest under the root)
MAX_BRANCH_DEPTH = 6  # branches are extended only while shallower than this
TOP_K = 10  # K of the branches' width cap max(1, K // depth)


class SpineOptions(Options):
    spine_source: str | None = Field(
        None, description="source whose chain always forms the spine when it proposes; None: the chain "
        "with the most expected accepted tokens under each source's measured acceptance (policies/chains.py)"
    )
    confidence: bool = Field(
        True,
        description="use the chain's confidence: budget + int(confidence * extension), spine ratio "
        "shift and chain extension (off: base budget, the unextended match, no bypass)",
    )
    extension: int = Field(40, ge=0, description="extra nodes a fully confident cycle may use")
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="a chain's confidence buys extension, spine share and bypass only while its (source, "
        "confidence tier) has a measured depth-1 rate of at least this (the reported confidence picks the tier)",
    )
    tiers: tuple[float, float, float] = Field(
        (0.15, 0.30, 0.50), description="base spine share of the budget at low / medium / high spine acceptance"
    )
    spine_branches: bool = Field(True, description="hang branches off spine nodes (off: the nobranch ablation)")
    coupled: bool = Field(
        True,
        description="when sampling, order each node's successors by how likely the draw at its depth "
        "picks them, knowing the draw's noise (DraftContext.successors with depth); off: the source's order",
    )

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v):
        if not all(0.0 <= t <= 1.0 for t in v):
            raise ValueError(f"tiers are shares of the budget in [0, 1], got {v}")
        return v



class SpinePolicy(MergingPolicy):
    """The anisotropic spine tree: a PLD spine with harmonically decaying TR branches (no bypass)."""

    name = "spine-tree"
    Options = SpineOptions

    def __init__(self, options: SpineOptions | None = None):
        super().__init__(options)
        self.begin(None)

    def uses_confidence(self) -> bool:
        return self.options.confidence

    def extension(self) -> int:
        return self.options.extension

    def make_rates(self) -> SourceRates:
        return SourceRates(RATE_PRIOR, RATE_WEIGHT, carry=RATE_CARRY)

    def begin(self, request: Request | None) -> None:
        self.ema = EMA_INIT
        self.routes: Counter = Counter()
        self.counts: Counter = Counter()
        self.leaders: Counter = Counter()
        self.rates.begin(fresh=request is None)

    # -- shaping ---------------------------------------------------------------------------------
    def lay_out(self, ctx: DraftContext) -> Merged:
        """This step's chains from every source, ranked by measured acceptance and merged."""
        chains = gather(ctx, self._chains)
        if not self.options.confidence:  # the ablation: each chain unextended, confidence 0
            chains = [Drafted(d.source, d.tokens[: d.base] if d.base else d.tokens, 0.0, d.base) for d in chains]
        return merge(rank(chains, self.rates, self._spine), self.rates, gather_alternatives(ctx, chains))

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        o = self.options
        merged = self.lay_out(ctx)
        conf = self.trusted(merged.leader)
        budget = ctx.budget + int(conf * o.extension)
        root = ctx.successors(ctx.state.anchor, ctx.state.prev_anchor, 1 if o.coupled else None)
        if merged.leader is not None:
            self.leaders[merged.leader.source] += 1
        if not len(root.ids):
            return self.chains_only(ctx, merged, budget)
        return self.build(ctx, merged, conf, budget, root)

    def chains_only(self, ctx: DraftContext, merged: Merged, budget: int) -> DraftTree | None:
        """No successor at the root: the spine alone (route ``"chain"``), with the other sources'
        side chains when there are any (route ``"chains"``)."""
        n = min(len(merged.spine), budget - 1, ctx.state.max_depth)
        if n <= 0:
            return None
        trie = Trie(ctx.state.anchor, ROOT)
        for j in range(n):
            trie.add(j, merged.spine[j], SPINE, merged.spine_sources[j])
        added = trie.add_sides(merged, n, budget - 1 - n, self.rates, SIDE_MIN, ctx.state.max_depth)
        return trie.tree("chains" if added else "chain", spine_len=n, confidence=merged.confidence, chains=merged.chains)

    def build(
        self,
        ctx: DraftContext,
        merged: Merged,
        conf: float,
        budget: int,
        root: Successors,
    ) -> DraftTree | None:
        """Algorithm 1: spine (and the other sources' side chains), root branches, harmonic spine
        branches, BFS extension."""
        o = self.options
        st = ctx.state
        depth_cap = st.max_depth
        min_score = MIN_SCORE
        coupled = o.coupled
        maxd = min(MAX_BRANCH_DEPTH, depth_cap)
        ratio_base = spine_ratio(self.ema, o.tiers, TIER_CUTOFFS)
        ratio = ratio_base + conf * (1.0 - ratio_base)
        chain = merged.spine
        L = max(0, min(len(chain), int(budget * ratio), budget - 1, depth_cap))

        # Step 1: the spine, then the other sources' chains where they leave it.
        trie = Trie(st.anchor, ROOT)
        for j in range(L):
            trie.add(j, chain[j], SPINE, merged.spine_sources[j])
        branch_budget = budget - 1 - L
        if merged.sides and branch_budget > 0:
            room = int(branch_budget * SIDE_SHARE)
            branch_budget -= trie.add_sides(merged, L, room, self.rates, SIDE_MIN, depth_cap)
        tokens, parents, depths = trie.tokens, trie.parents, trie.depths

        if L > 0 and branch_budget > 0 and o.spine_branches and SPINE_BRANCH_SHARE > 0.0:
            spine_share = max(1, int(branch_budget * SPINE_BRANCH_SHARE))
        else:
            spine_share = 0
        root_share = branch_budget - spine_share
        frontier: deque = deque()

        def attach(parent: int, depth: int, succ: Successors, limit: int, label: str, width: int | None = None) -> int:
            """Hang up to ``limit`` of the first ``width`` successors (best first, above min_score, not already
            a child) on a node, each credited to the sources that proposed it."""
            attached = 0
            have = trie.kids.get(parent)
            ids, scores, vouch = succ
            if width is not None:
                ids, scores = ids[:width], scores[:width]
            for t, s, by in zip(ids, scores, vouch):
                if attached >= limit or s < min_score:
                    break
                if have is not None and t in have:
                    continue
                i = trie.add(parent, t, label, by)
                have = trie.kids[parent]
                attached += 1
                if depth < maxd:
                    frontier.append((i, s))
            return attached

        # Step 2: alternatives to the first spine token, under the root.
        attach(0, 1, root, root_share, ROOT_BRANCH)

        # Step 3: alternatives at each spine node, harmonically fewer with depth.
        if spine_share > 0:
            alloc = harmonic_split(spine_share, L)
            for j in range(L):
                a = alloc[j]
                if a <= 0 or j + 2 > depth_cap:
                    break
                node = j + 1
                attach(node, j + 2, ctx.successors(tokens[node], tokens[node - 1], j + 2 if coupled else None), a, BRANCH)

        # Step 4: breadth-first extension of the branch frontier.
        remaining = budget - len(tokens)
        k = TOP_K
        while frontier and remaining > 0:
            node, score = frontier.popleft()
            d = depths[node]
            succ = ctx.successors(tokens[node], tokens[parents[node]], d + 1 if coupled else None)
            if not len(succ.ids):
                continue
            width = max(1, min(len(succ.ids), math.ceil(remaining * score)))
            width = min(width, max(1, k // d))
            remaining -= attach(node, d + 1, succ, remaining, BRANCH, width)

        if len(tokens) < 2:
            return None
        return trie.tree("spine", spine_len=L, confidence=conf, chains=merged.chains)

    # -- learning and reporting ------------------------------------------------------------------
    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if verified.kind != "tree" or tree is None:
            return
        route = tree.route
        self.routes[route] += 1
        origins = tree.origins
        path = verified.path
        self.rates.observe(tree, path, verified.bonus)
        n_spine = origins.count(SPINE)
        n_root = origins.count(ROOT_BRANCH)
        n_chain = origins.count(CHAIN)
        n_branch = len(origins) - 1 - n_spine - n_root - n_chain
        acc_spine = acc_root = acc_chain = 0
        for i in path[1:]:
            o = origins[i]
            if o == SPINE:
                acc_spine += 1
            elif o == ROOT_BRANCH:
                acc_root += 1
            elif o == CHAIN:
                acc_chain += 1
        acc_branch = len(path) - 1 - acc_spine - acc_root - acc_chain
        c = self.counts
        c["side_chain_drafted"] += n_chain
        c["side_chain_accepted"] += acc_chain
        c["spine_drafted"] += n_spine
        c["spine_accepted"] += acc_spine
        c["branch_drafted"] += n_branch
        c["branch_accepted"] += acc_branch
        c["root_branch_drafted"] += n_root
        c["root_branch_accepted"] += acc_root
        if acc_spine and acc_branch:
            # The walk followed the spine, left it where it broke, and went on along a branch.
            c["continuation_cycles"] += 1
            c["continuation_tokens"] += acc_branch
        if n_spine and verified.walk == "greedy":
            # Per-cycle dominance (Prop. 4): re-walk the spine alone with the target's argmax.
            children, toks, am = tree.children, tree.tokens, verified.argmax
            node, chain_len = 0, 0
            while True:
                nxt = next((ch for ch in children[node] if origins[ch] == SPINE), None)
                if nxt is None or toks[nxt] != am[node]:
                    break
                node, chain_len = nxt, chain_len + 1
            c["dominance_cycles"] += 1
            c["gain_over_spine_chain"] += (len(path) - 1) - chain_len
            if len(path) - 1 < chain_len:
                c["dominance_violations"] += 1
        if n_spine and route in ("spine", "bypass"):
            w = EMA_WEIGHT
            self.ema = w * (acc_spine / n_spine) + (1.0 - w) * self.ema

    def stats(self) -> dict:
        c = self.counts
        return {
            "routes": dict(self.routes),
            "spine_drafted": c["spine_drafted"],
            "spine_accepted": c["spine_accepted"],
            "branch_drafted": c["branch_drafted"],
            "branch_accepted": c["branch_accepted"],
            "root_branch_drafted": c["root_branch_drafted"],
            "root_branch_accepted": c["root_branch_accepted"],
            "side_chain_drafted": c["side_chain_drafted"],
            "side_chain_accepted": c["side_chain_accepted"],
            "spine_leaders": dict(self.leaders),
            "source_rates": self.rates.snapshot(),
            "continuation_cycles": c["continuation_cycles"],
            "continuation_tokens": c["continuation_tokens"],
            "dominance_cycles": c["dominance_cycles"],
            "dominance_violations": c["dominance_violations"],
            "gain_over_spine_chain": c["gain_over_spine_chain"],
            "spine_accept_ema": self.ema,
        }


# ---------------------------------------------------------------------------------------------
# Confidence-adaptive bypass around any policy
# ---------------------------------------------------------------------------------------------
class BypassOptions(Options):
    inner: str = Field("spine-tree", description="registered policy to wrap (e.g. 'spine-tree', 'iso3')")
    inner_options: dict[str, Any] = Field(default_factory=dict, description="options of the inner policy")
    spine_source: str | None = Field(
        None, description="source whose chain may bypass the tree; None: the chain with the most expected "
        "accepted tokens under each source's measured acceptance (the inner policy's spine when it merges chains)"
    )
    min_length: int | None = Field(
        None,
        ge=1,
        description="bypass when the chain has at least this many tokens; None: when it alone fills the "
        "largest tree the inner policy may build (inner.max_nodes(budget) - 1), as in the reference",
    )
    max_chain: int = Field(100, ge=1, description="longest chain a bypass verifies (the longest extended chain)")
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="around a policy that does not merge chains: bypass only while the chain's (source, "
        "confidence tier) has a measured depth-1 rate of at least this (a merging inner policy's own trust_min decides otherwise)",
    )


BYPASS_CONFIDENCE = 1.0  # a chain bypasses the tree at this confidence or above (consensus)
_NESTING = threading.local()  # .depth: bypass policies under construction in this thread (inner within inner)
_MAX_NESTING = 8


class BypassPolicy(TreePolicy):
    """Confidence-adaptive bypass: a consensus chain that fills the tree is verified as one chain."""

    name = "bypass"
    Options = BypassOptions

    def __init__(self, options: BypassOptions | None = None):
        super().__init__(options)
        o = self.options
        _NESTING.depth = getattr(_NESTING, "depth", 0) + 1
        try:
            if _NESTING.depth > _MAX_NESTING:
                raise InvalidInputError(
                    f"bypass policies nest more than {_MAX_NESTING} deep (inner={o.inner!r}); does the "
                    "inner policy wrap itself? Hint: inner='spine-tree'."
                )
            self.inner: TreePolicy = manager.build_inner(o.inner, o.inner_options, {"spine_source": o.spine_source}, self.name)
        finally:
            _NESTING.depth -= 1
        # a spine-tree inner policy merges every source's chain: the bypass takes its spine and its trust
        self._spine_inner = self.inner if isinstance(self.inner, SpinePolicy) else None
        self._spine: str | None = None
        self._chains: tuple[str, ...] = ()
        self._sources: tuple[DraftSource, ...] = ()
        self._bound = False
        self._thresholds: dict[int, int] = {}
        self.rates = SourceRates()  # around a policy that does not merge chains: which chain leads, its trust
        self.begin(None)

    def bind(self, sources: Sequence[DraftSource]) -> None:
        o = self.options
        self._spine = resolve_spine_source(self.name, o.spine_source, sources) if o.spine_source else None
        self._chains = (self._spine,) if self._spine else chain_sources(sources)
        self._sources = tuple(sources)
        self.inner.bind(sources)
        self._bound = True

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        inner = self.inner.consulted(sources)
        if self._spine_inner is not None or inner is None:  # bypasses with the inner policy's spine
            return inner
        o = self.options
        return inner | ({o.spine_source} if o.spine_source else {s.name for s in sources if not s.provides_successors})

    def attach(self, model, verifier) -> None:
        if self._spine_inner is None:  # its own rates decide only around a policy that does not merge chains
            load_tiers(self.rates, self._sources, model)
        self.inner.attach(model, verifier)

    def max_nodes(self, budget: int) -> int:
        return max(self.inner.max_nodes(budget), self.options.max_chain + 1)

    def begin(self, request: Request | None) -> None:
        self.cycles = 0
        self.drafted = 0
        self.accepted = 0
        self.rates.begin(fresh=request is None)
        if request is not None:
            self.inner.begin(request)

    def threshold(self, budget: int) -> int:
        t = self._thresholds.get(budget)
        if t is None:
            t = self.options.min_length
            if t is None:
                t = max(1, self.inner.max_nodes(budget) - 1)
            self._thresholds[budget] = t
        return t

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        o = self.options
        inner = self._spine_inner
        if inner is not None:  # the inner policy merges every source's chain: bypass with its spine, its trust
            merged = inner.lay_out(ctx)
            lead = merged.leader
            if (lead is not None and lead.confidence >= BYPASS_CONFIDENCE and inner.trusted(lead) > 0.0
                    and len(lead.tokens) >= self.threshold(ctx.budget)
                    and (o.spine_source is None or lead.source == o.spine_source)):
                tree = self._bypass_tree(ctx, lead.tokens, merged.spine_sources, lead.confidence, chains=merged.chains)
                if tree is not None:
                    return tree
            return self.inner.shape(ctx)
        # an inner policy that does not merge chains: the best-ranked chain under this policy's own measured rates
        ranked = rank(gather(ctx, self._chains), self.rates)
        if ranked:
            lead = ranked[0]
            if (lead.confidence >= BYPASS_CONFIDENCE and self.rates.trusted(lead, o.trust_min) > 0.0
                    and len(lead.tokens) >= self.threshold(ctx.budget)):
                chains = {d.source: (self.rates.key(d.source, d.confidence)[1], d.tokens) for d in ranked}
                tree = self._bypass_tree(ctx, lead.tokens, ((lead.source,),) * len(lead.tokens), lead.confidence,
                                         chains=chains)
                if tree is not None:
                    return tree
        return self.inner.shape(ctx)

    def _bypass_tree(self, ctx: DraftContext, chain, vouching, confidence: float, **meta) -> DraftTree | None:
        """The confident chain alone, verified as one chain (route ``bypass``), cut to ``max_chain`` and the
        depth left; ``vouching``: the sources of each chain token. None where nothing is left to draft."""
        n = min(len(chain), self.options.max_chain, ctx.state.max_depth)
        if n <= 0:
            return None
        return DraftTree.build(
            (ctx.state.anchor, *chain[:n]), range(-1, n), SPINE, None, "bypass",
            ((), *vouching[:n]), spine_len=n, confidence=confidence, **meta,
        )

    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if tree is not None and tree.route == "bypass":
            self.cycles += 1
            self.drafted += tree.num_nodes - 1
            self.accepted += len(verified.path) - 1
        if tree is not None and verified.kind == "tree" and self._spine_inner is None:
            self.rates.observe(tree, verified.path, verified.bonus)  # the chains every tree laid out, where it says
        self.inner.observe(verified)

    def end(self, output) -> None:
        self.inner.end(output)

    def stats(self) -> dict:
        return {
            **self.inner.stats(),
            "bypass_cycles": self.cycles,
            "bypass_drafted": self.drafted,
            "bypass_accepted": self.accepted,
        }


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(SpinePolicy)
    register(
        SpinePolicy,
        name="spine-nobypass",
        defaults={"confidence": False},
        description="Spine tree without the confidence signal: base budget, unextended chain, no bypass",
    )
    register(BypassPolicy)
    register(
        BypassPolicy,
        name="spine",
        defaults={"inner": "spine-tree"},
        description="GOOSE: anisotropic spine tree (PLD spine, TR branches) with the confidence bypass",
    )
    register(
        BypassPolicy,
        name="spine-nobranch",
        defaults={"inner": "spine-tree", "inner_options": {"spine_branches": False}},
        description="Spine tree without branches on spine nodes (root branches kept), with the bypass",
    )
