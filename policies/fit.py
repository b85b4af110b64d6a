"""``fit``: fit any policy's tree to the device, and fall back to plain decoding when no tree pays.

Each step the inner policy (default ``spine``) shapes its tree; ``fit`` estimates every node's
probability of acceptance from what was accepted so far in this generation (per origin, depth
and sibling rank, with a prior), and keeps the subtree that maximises expected tokens per second:

    (1 + sum of the kept nodes' acceptance probabilities) / t(kept nodes + 1)

where ``t(n)`` is the measured forward latency for n tokens on this model, dtype, device and
thread count (``goose.latency``). Because a child is never likelier than its parent, the best
subtree of m nodes is the m likeliest nodes. When keeping no node (a single step) is best, the
step is an ordinary decoding step (the automatic fallback, counted in the stats); every
``explore_every``-th fallback in a row still verifies the inner tree, so estimates keep learning.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from goose.errors import InvalidInputError
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, Request, TreePolicy, Verified
from goose.tree import DraftTree


class FitOptions(Options):
    inner: str = Field("spine", description="registered policy whose trees are fitted")
    inner_options: dict[str, Any] = Field(default_factory=dict, description="options of the inner policy")
    latency: dict[int, float] | None = Field(
        None, description="fixed forward latency {tree size: seconds}; None: measured once for the model"
    )
    prior: float = Field(0.3, ge=0.0, le=1.0, description="prior acceptance probability of a node class")
    prior_weight: float = Field(2.0, gt=0.0, description="pseudo-observations behind the prior")
    max_depth_bucket: int = Field(8, ge=1, description="depths beyond this share one estimate")
    fallback: bool = Field(True, description="plain decoding step when no tree is worth its cost")
    explore_every: int = Field(8, ge=1, description="verify the full tree after this many fallbacks in a row")


class FitPolicy(TreePolicy):
    """Prune the inner policy's tree to maximise expected tokens per second on this device."""

    name = "fit"
    Options = FitOptions

    def __init__(self, options: FitOptions | None = None):
        super().__init__(options)
        from goose.compose import build_inner

        o = self.options
        if o.inner == "fit" or o.inner.endswith("-fit"):
            raise InvalidInputError(f"fit cannot wrap itself (inner={o.inner!r}). Hint: inner='spine'.")
        self.inner: TreePolicy = build_inner(o.inner, o.inner_options)
        self.curve = None
        if o.latency:
            from goose.latency import LatencyCurve

            items = sorted((int(k), float(v)) for k, v in o.latency.items())
            self.curve = LatencyCurve(tuple(k for k, _ in items), tuple(v for _, v in items))
        self.acc: Counter = Counter()
        self.trials: Counter = Counter()
        self.begin(None)

    def bind(self, sources: Sequence[DraftSource]) -> None:
        self.inner.bind(sources)

    def attach(self, model) -> None:
        self.inner.attach(model)
        if self.curve is None:
            from goose.latency import curve_for

            self.curve = curve_for(model)
        self._t = self.curve.table(512)

    def max_nodes(self, budget: int) -> int:
        return self.inner.max_nodes(budget)

    def begin(self, request: Request | None) -> None:
        self.acc.clear()
        self.trials.clear()
        self.counts: Counter = Counter()
        self.streak = 0
        if request is not None:
            self.inner.begin(request)

    # -- estimates ---------------------------------------------------------------------------------
    def _keys(self, tree: DraftTree) -> list:
        """A class per node: (origin, depth bucket, rank among same-origin siblings, capped)."""
        dcap = self.options.max_depth_bucket
        seen: Counter = Counter()
        keys = [None]
        for i in range(1, tree.num_nodes):
            o = tree.origins[i]
            r = seen[(tree.parents[i], o)]
            seen[(tree.parents[i], o)] += 1
            keys.append((o, min(tree.depths[i], dcap), min(r, 3)))
        return keys

    def _prob(self, key) -> float:
        o = self.options
        return (self.acc[key] + o.prior * o.prior_weight) / (self.trials[key] + o.prior_weight)

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        tree = self.inner.shape(ctx)
        if tree is None or tree.num_nodes < 2:
            return tree
        if not hasattr(self, "_t"):
            self._t = self.curve.table(512) if self.curve is not None else None
        if self._t is None:
            return tree
        keys = self._keys(tree)
        parents = tree.parents
        n = tree.num_nodes
        prob = [1.0] * n
        for i in range(1, n):
            prob[i] = prob[parents[i]] * self._prob(keys[i])
        order = sorted(range(1, n), key=lambda i: (-prob[i], i))
        t = self._t
        best_m, best_v, gain = 0, 1.0 / t[1], 1.0
        for m, i in enumerate(order, start=1):
            gain += prob[i]
            size = m + 1
            v = gain / (t[size] if size < len(t) else self.curve(size))
            if v > best_v:
                best_m, best_v = m, v
        c = self.counts
        if best_m == 0 and self.options.fallback:
            self.streak += 1
            if self.streak < self.options.explore_every:
                c["fallback_steps"] += 1
                return None
            c["explore_steps"] += 1
            best_m = n - 1
        self.streak = 0
        c["fitted_steps"] += 1
        c["nodes_offered"] += n - 1
        c["nodes_kept"] += best_m
        if best_m == n - 1:
            return tree
        keep = sorted([0, *order[:best_m]])
        remap = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            tuple(tree.tokens[i] for i in keep),
            tuple(-1 if i == 0 else remap[parents[i]] for i in keep),
            tuple(tree.origins[i] for i in keep),
            None if tree.scores is None else tuple(tree.scores[i] for i in keep),
            tree.route,
            dict(tree.meta),
        )

    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if verified.kind == "tree" and tree is not None and tree.num_nodes > 1:
            on_path = set(verified.path)
            keys = self._keys(tree)
            for i in range(1, tree.num_nodes):
                if tree.parents[i] in on_path:
                    self.trials[keys[i]] += 1
                    if i in on_path:
                        self.acc[keys[i]] += 1
        self.inner.observe(verified)

    def stats(self) -> dict:
        c = self.counts
        out = dict(self.inner.stats())
        out.update(
            fit_fallback_steps=c["fallback_steps"],
            fit_explore_steps=c["explore_steps"],
            fit_steps=c["fitted_steps"],
            fit_nodes_offered=c["nodes_offered"],
            fit_nodes_kept=c["nodes_kept"],
        )
        return out


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(FitPolicy)
    register(
        FitPolicy,
        name="spine-fit",
        defaults={"inner": "spine"},
        description="GOOSE spine tree fitted to the device's measured forward latency, with automatic fallback",
    )
