"""The anisotropic spine tree (docs/algorithm.md, sections 3 and 6) and the confidence bypass.

A deep **spine** (the best chain, policies/chains.py) hangs under the root; shallow **branches** of
successor tokens hang off the root and the spine nodes, their widths decaying harmonically along the spine,
and grow breadth-first. Routes: the successor sources know the anchor -> ``"branched"`` (pure branches without a
chain); else a chain -> ``"path"`` (``"paths"`` with side chains); else, or under 2 nodes, None. Origins:
``"lead"`` (the spine), ``"side"`` (side chains), ``"root-branch"`` (successors under the root), ``"branch"`` (deeper).

Policies: ``spine-tree`` (the builder); ``bypass`` around any policy (a consensus chain that fills the inner
policy's largest tree is verified alone: route ``"bypassed"``); ``spine`` = ``bypass`` around ``spine-tree``,
the paper's configuration; the ablations ``spine-nobypass`` (confidence off) and ``spine-nobranch`` (no
branches on spine nodes).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_right
from collections import Counter, deque
from collections.abc import Sequence
from itertools import islice
from typing import Any

from pydantic import Field, field_validator

from goose import manager
from goose.errors import InvalidInputError
from goose.branches import Successors
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, Request, TreePolicy, Verified
from goose.policies.chains import (LEAD, SIDE, Merged, Trie, chain_tree, gather, gather_alternatives, laid_out,
                                   lead_path, merge, rank)
from goose.policies.merge import EXTENSION, MIN_SCORE, TRUST_MIN, MergingPolicy, RatedPolicy, resolve_spine_source
from goose.tree import DraftTree

BRANCH = "branch"
ROOT_BRANCH = "root-branch"

# the spine tree's internal tuning (the paper's values where it gives them)
SIDE_SHARE = 0.5  # at most this share of the branch budget goes to other sources' side chains
SIDE_MIN = 0.05  # a side chain's node is drafted while its rate of being right from the fork on is at least this
TIER_CUTOFFS = (0.2, 0.4)  # spine-acceptance EMA cut-offs between the tiers of the spine's budget share
EMA_INIT, EMA_WEIGHT = 0.5, 0.3  # the spine acceptance EMA: its start per request, the newest cycle's weight
SPINE_BRANCH_SHARE = 0.5  # share of the branch budget hung off spine nodes (the rest under the root)
MAX_BRANCH_DEPTH = 6  # branches are extended only while shallower than this
TOP_K = 10  # K of the branches' width cap max(1, K // depth)
PARTS = ("lead", "branch", "root_branch", "side")  # the stats' node classes


def harmonic_split(share: int, positions: int) -> tuple[int, ...]:
    """Split ``share`` branch nodes over ``positions`` spine nodes with weights 1/(j+1): each position gets
    ``max(1, int(share * w_j / sum w))`` until the share runs out; the result never increases with j and
    sums to at most ``share``."""
    if positions <= 0:
        return ()
    total = sum(1.0 / (j + 1) for j in range(positions))
    out, left = [], share
    for j in range(positions):
        a = min(max(1, int(share * (1.0 / (j + 1)) / total)), left) if left > 0 else 0
        out.append(a)
        left -= a
    return tuple(out)


def _tally(origins: Sequence[str], nodes: Sequence[int]) -> dict[str, int]:
    """``nodes`` counted per stats class (:data:`PARTS`; ``branch``: every other origin)."""
    n = Counter(origins[i] for i in nodes)
    out = {"lead": n[LEAD], "root_branch": n[ROOT_BRANCH], "side": n[SIDE]}
    out["branch"] = len(nodes) - sum(out.values())
    return out


class SpineOptions(Options):
    spine_source: str | None = Field(
        None, description="source whose chain always forms the spine when it proposes; None: the chain "
        "with the most expected accepted tokens under each source's measured acceptance (policies/chains.py)",
        json_schema_extra={"why": "force one chain source to form the spine"},
    )
    confidence: bool = Field(
        True, description="use the chain's confidence: budget + int(confidence * extension), spine ratio "
        "shift and chain extension (off: base budget, the unextended match, no bypass)",
        json_schema_extra={"why": "off: the ablation without the confidence signal (preset spine-nobypass)"},
    )
    extension: int = Field(EXTENSION, ge=0, description="extra nodes a fully confident cycle may use",
        json_schema_extra={"why": "how many extra nodes a confident step may use: what a large tree costs depends on the device"},
    )
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="a chain's confidence buys extension, spine share and bypass only while its (source, "
        "confidence tier) has a measured depth-1 rate of at least this (the reported confidence picks the tier)",
        json_schema_extra={"why": "how much measured evidence a source's confidence needs before it buys extension and spine share"},
    )
    tiers: tuple[float, float, float] = Field(
        (0.15, 0.30, 0.50), description="base spine share of the budget at low / medium / high spine acceptance",
        json_schema_extra={"why": "the spine's base share of the budget, per band of spine acceptance"},
    )
    spine_branches: bool = Field(True, description="hang branches off spine nodes (off: the nobranch ablation)",
        json_schema_extra={"why": "off: the ablation without branches on spine nodes (preset spine-nobranch)"},
    )
    coupled: bool = Field(
        True, description="when sampling, order each node's successors by how likely the draw at its depth "
        "picks them, knowing the draw's noise (DraftContext.successors with depth); off: the source's order",
        json_schema_extra={"why": "off: drafts that do not read the sampling draws' noise (an ablation)"},
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

    def begin(self, request: Request | None) -> None:
        self.ema = EMA_INIT
        self.routes: Counter = Counter()
        self.counts: Counter = Counter()
        self.leaders: Counter = Counter()
        self.rates.begin(fresh=request is None)

    # -- shaping ---------------------------------------------------------------------------------
    def lay_out(self, ctx: DraftContext) -> Merged:
        """This step's chains from every source, ranked by measured acceptance and merged."""
        chains = self.gather_chains(ctx)
        return merge(rank(chains, self.rates, self._spine), self.rates, gather_alternatives(ctx, chains))

    def successors(self, ctx: DraftContext, token: int, prev: int | None, depth: int) -> Successors:
        """``ctx.successors`` for a node at ``depth``, ranked for the draw there when ``coupled``."""
        return ctx.successors(token, prev, depth if self.options.coupled else None)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        merged = self.lay_out(ctx)
        conf = self.trusted(merged.leader)
        budget = ctx.budget + int(conf * self.options.extension)
        root = self.successors(ctx, ctx.state.anchor, ctx.state.prev_anchor, 1)
        if merged.leader is not None:
            self.leaders[merged.leader.source] += 1
        if not len(root.ids):
            return self.chains_only(ctx, merged, budget)
        return self.build(ctx, merged, conf, budget, root)

    def spine_trie(self, ctx: DraftContext, merged: Merged, n: int, room: int) -> tuple[Trie, int]:
        """The first ``n`` spine tokens under the anchor, then at most ``room`` side chain nodes:
        ``(trie, side chain nodes added)``."""
        trie = Trie(ctx.state.anchor)
        for j in range(n):
            trie.add(j, merged.spine[j], LEAD, merged.spine_sources[j])
        return trie, trie.add_sides(merged, n, room, self.rates, SIDE_MIN, ctx.state.max_depth)

    def chains_only(self, ctx: DraftContext, merged: Merged, budget: int) -> DraftTree | None:
        """No successor at the root: the spine alone (route ``"path"``), with the other sources'
        side chains when there are any (route ``"paths"``)."""
        n = min(len(merged.spine), budget - 1, ctx.state.max_depth)
        if n <= 0:
            return None
        trie, added = self.spine_trie(ctx, merged, n, budget - 1 - n)
        return trie.tree("paths" if added else "path", spine_len=n, confidence=merged.confidence, chains=merged.chains)

    def build(self, ctx: DraftContext, merged: Merged, conf: float, budget: int, root: Successors) -> DraftTree | None:
        """Algorithm 1: spine (and side chains), root branches, harmonic spine branches, BFS extension."""
        o = self.options
        depth_cap = ctx.state.max_depth
        maxd = min(MAX_BRANCH_DEPTH, depth_cap)
        ratio_base = o.tiers[bisect_right(TIER_CUTOFFS, self.ema)]
        ratio = ratio_base + conf * (1.0 - ratio_base)
        L = max(0, min(len(merged.spine), int(budget * ratio), budget - 1, depth_cap))
        # Step 1: the spine, then the other sources' chains where they leave it.
        trie, added = self.spine_trie(ctx, merged, L, int((budget - 1 - L) * SIDE_SHARE))
        branch_budget = budget - 1 - L - added
        tokens, parents, depths = trie.tokens, trie.parents, trie.depths
        branched_spine = L and branch_budget > 0 and o.spine_branches
        spine_share = max(1, int(branch_budget * SPINE_BRANCH_SHARE)) if branched_spine else 0
        frontier: deque = deque()

        def attach(parent: int, depth: int, succ: Successors, limit: int, label: str, width: int | None = None) -> int:
            """Hang up to ``limit`` of the first ``width`` successors (best first, scoring at least MIN_SCORE, not
            already a child) on a node, each credited to the sources that proposed it; returns how many."""
            attached = 0
            for t, s, by in islice(zip(*succ), width):
                if attached >= limit or s < MIN_SCORE:
                    break
                if t in trie.kids.get(parent, ()):
                    continue
                i = trie.add(parent, t, label, by)
                attached += 1
                if depth < maxd:
                    frontier.append((i, s))
            return attached

        # Step 2: alternatives to the first spine token, under the root.
        attach(0, 1, root, branch_budget - spine_share, ROOT_BRANCH)
        # Step 3: alternatives at each spine node, harmonically fewer with depth.
        for j, a in enumerate(harmonic_split(spine_share, L)):
            if a <= 0 or j + 2 > depth_cap:
                break
            attach(j + 1, j + 2, self.successors(ctx, tokens[j + 1], tokens[j], j + 2), a, BRANCH)
        # Step 4: breadth-first extension of the branch frontier.
        remaining = budget - len(tokens)
        while frontier and remaining > 0:
            node, score = frontier.popleft()
            d = depths[node]
            succ = self.successors(ctx, tokens[node], tokens[parents[node]], d + 1)
            if not len(succ.ids):
                continue
            width = min(max(1, min(len(succ.ids), math.ceil(remaining * score))), max(1, TOP_K // d))
            remaining -= attach(node, d + 1, succ, remaining, BRANCH, width)
        return trie.tree("branched", spine_len=L, confidence=conf, chains=merged.chains) if len(tokens) > 1 else None

    # -- learning and reporting ------------------------------------------------------------------
    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if verified.kind != "tree" or tree is None:
            return
        self.routes[tree.route] += 1
        origins, path = tree.origins, verified.path
        self.rates.observe(tree, path, verified.bonus)
        drafted, accepted = _tally(origins, range(1, len(origins))), _tally(origins, path[1:])
        c = self.counts
        for part in PARTS:
            c[f"{part}_drafted"] += drafted[part]
            c[f"{part}_accepted"] += accepted[part]
        if accepted["lead"] and accepted["branch"]:  # the walk left the spine where it broke, along a branch
            c["continuation_cycles"] += 1
            c["continuation_tokens"] += accepted["branch"]
        if drafted["lead"] and verified.walk == "greedy":
            # Per-cycle dominance (Prop. 4): re-walk the spine alone with the target's argmax.
            node, chain_len = 0, 0
            for nxt in lead_path(tree):
                if tree.tokens[nxt] != verified.argmax[node]:
                    break
                node, chain_len = nxt, chain_len + 1
            c["dominance_cycles"] += 1
            c["gain_over_spine_chain"] += (len(path) - 1) - chain_len
            if len(path) - 1 < chain_len:
                c["dominance_violations"] += 1
        if drafted["lead"] and tree.route in ("branched", "bypassed"):
            self.ema = EMA_WEIGHT * (accepted["lead"] / drafted["lead"]) + (1.0 - EMA_WEIGHT) * self.ema

    def stats(self) -> dict:
        c = self.counts
        return {
            "routes": dict(self.routes),
            **{f"{part}_{what}": c[f"{part}_{what}"] for part in PARTS for what in ("drafted", "accepted")},
            "spine_leaders": dict(self.leaders),
            "source_rates": self.rates.snapshot(),
            **{k: c[k] for k in ("continuation_cycles", "continuation_tokens", "dominance_cycles",
                                 "dominance_violations", "gain_over_spine_chain")},
            "spine_accept_ema": self.ema,
        }


# -- the confidence-adaptive bypass around any policy ------------------------------------------
class BypassOptions(Options):
    inner: str = Field("spine-tree", description="registered policy to wrap (e.g. 'spine-tree', 'iso3')",
        json_schema_extra={"why": "which policy the bypass wraps (presets spine, spine-nobranch)"},
    )
    inner_options: dict[str, Any] = Field(default_factory=dict, description="options of the inner policy",
        json_schema_extra={"why": "the wrapped policy's options (how spine-nobranch is expressed)"},
    )
    spine_source: str | None = Field(
        None, description="source whose chain may bypass the tree; None: the chain with the most expected "
        "accepted tokens under each source's measured acceptance (the inner policy's spine when it merges chains)",
        json_schema_extra={"why": "force the chain source that may bypass the tree"},
    )
    min_length: int | None = Field(
        None, ge=1, description="bypass when the chain has at least this many tokens; None: when it alone fills the "
        "largest tree the inner policy may build (inner.max_nodes(budget) - 1), as in the reference",
        json_schema_extra={"why": "bypass shorter confident chains where a chain pass is cheap on this device"},
    )
    max_chain: int = Field(100, ge=1, description="longest chain a bypass verifies (the longest extended chain)",
        json_schema_extra={"why": "cap on a bypassed chain's length (memory and the pass's cost)"},
    )
    trust_min: float = Field(
        TRUST_MIN, ge=0.0, le=1.0,
        description="around a policy that does not merge chains: bypass only while the chain's (source, "
        "confidence tier) has a measured depth-1 rate of at least this (a merging inner policy's own trust_min decides otherwise)",
        json_schema_extra={"why": "how much measured evidence a source's confidence needs before it buys a bypass"},
    )


BYPASS_CONFIDENCE = 1.0  # a chain bypasses the tree at this confidence or above (consensus)
_NESTING = threading.local()  # .depth: bypass policies under construction in this thread (inner within inner)
_MAX_NESTING = 8


class BypassPolicy(RatedPolicy):
    """Confidence-adaptive bypass: a consensus chain that fills the tree is verified as one chain.

    Around a ``spine-tree`` (which merges every source's chain) the bypass takes its spine and its trust;
    around any other policy it ranks the chains by its own measured rates (``trust_min``)."""

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
        self._spine_inner = self.inner if isinstance(self.inner, SpinePolicy) else None
        self._spine: str | None = None
        self._chains: tuple[str, ...] = ()
        self._bound = False
        self.begin(None)

    def bind(self, sources: Sequence[DraftSource]) -> None:
        self._spine = resolve_spine_source(self.name, self.options.spine_source, sources)
        self._chains = (self._spine,) if self._spine else tuple(s.name for s in sources)
        super().bind(sources)
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
            super().attach(model, verifier)
        self.inner.attach(model, verifier)

    def max_nodes(self, budget: int) -> int:
        return max(self.inner.max_nodes(budget), self.options.max_chain + 1)

    def begin(self, request: Request | None) -> None:
        self.cycles = self.drafted = self.accepted = 0
        super().begin(request)
        if request is not None:
            self.inner.begin(request)

    def threshold(self, budget: int) -> int:
        """The shortest chain that bypasses at ``budget``: ``min_length``, else the inner policy's largest tree."""
        t = self.options.min_length
        return max(1, self.inner.max_nodes(budget) - 1) if t is None else t

    def _bypasses(self, lead, trusted: float, budget: int) -> bool:
        return (lead is not None and lead.confidence >= BYPASS_CONFIDENCE and trusted > 0.0
                and len(lead.tokens) >= self.threshold(budget))

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        if not self._bound:
            self.bind(ctx.sources)
        o, inner, tree = self.options, self._spine_inner, None
        if inner is not None:
            merged = inner.lay_out(ctx)
            lead = merged.leader
            if self._bypasses(lead, inner.trusted(lead), ctx.budget) and o.spine_source in (None, lead.source):
                tree = self._bypass_tree(ctx, lead.tokens, merged.spine_sources, lead.confidence, merged.chains)
        else:
            ranked = rank(gather(ctx, self._chains), self.rates)
            lead = ranked[0] if ranked else None
            if self._bypasses(lead, self.rates.trusted(lead, o.trust_min), ctx.budget):
                vouching = ((lead.source,),) * len(lead.tokens)
                tree = self._bypass_tree(ctx, lead.tokens, vouching, lead.confidence, laid_out(ranked, self.rates))
        return tree if tree is not None else self.inner.shape(ctx)

    def _bypass_tree(self, ctx: DraftContext, chain, vouching, confidence: float, chains: dict) -> DraftTree | None:
        """The chain alone (route ``"bypassed"``), cut to ``max_chain`` and the depth left; ``vouching``: the
        sources of each chain token. None where nothing is left to draft."""
        n = min(len(chain), self.options.max_chain, ctx.state.max_depth)
        if n <= 0:
            return None
        return chain_tree(ctx.state.anchor, chain[:n], vouching[:n], "bypassed", spine_len=n, confidence=confidence,
                          chains=chains)

    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if tree is not None and tree.route == "bypassed":
            self.cycles += 1
            self.drafted += tree.num_nodes - 1
            self.accepted += len(verified.path) - 1
        if self._spine_inner is None:
            super().observe(verified)
        self.inner.observe(verified)

    def end(self, output) -> None:
        self.inner.end(output)

    def stats(self) -> dict:
        return {**self.inner.stats(), "bypass_cycles": self.cycles, "bypass_drafted": self.drafted,
                "bypass_accepted": self.accepted}


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(SpinePolicy)
    register(SpinePolicy, name="spine-nobypass", defaults={"confidence": False},
             description="Spine tree without the confidence signal: base budget, unextended chain, no bypass")
    register(BypassPolicy)
    register(BypassPolicy, name="spine", defaults={"inner": "spine-tree"},
             description="GOOSE: anisotropic spine tree (PLD spine, TR branches) with the confidence bypass")
    register(BypassPolicy, name="spine-nobranch",
             defaults={"inner": "spine-tree", "inner_options": {"spine_branches": False}},
             description="Spine tree without branches on spine nodes (root branches kept), with the bypass")
