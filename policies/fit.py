"""``fit``: fit any policy's tree to the device, and fall back to plain decoding when no tree pays.

Each step the inner policy (default ``spine``) shapes its tree; ``fit`` gives every node its
probability of being accepted under the theory module's acceptance model
(:class:`goose.theory.model.AcceptanceModel`: spine rates ``p_d`` per depth, per-origin rank
vectors ``q^o_r``, siblings' events disjoint, spine child first), with the rates estimated online
from this generation's verified trees (:func:`goose.theory.calibrate.count_step`, shrunk toward a
prior by :func:`goose.theory.calibrate.smoothed`; one set of rates per route, since a bypass
chain is drafted only when the context match is confident). It keeps the subtree that maximises
expected tokens per second:

    (1 + sum of the kept nodes' acceptance probabilities) / t(kept nodes + 1)

where ``t(n)`` is the measured forward latency for n tokens on this model, dtype, device and
thread count (``goose.latency``). A child is never likelier than its parent and a source's
lower-ranked candidate never likelier than a better-ranked sibling, so the m likeliest nodes form
a subtree that keeps rank prefixes; pruning a node only raises its later siblings' probability in
the cascade, so the sum over the full tree's probabilities is a lower bound of the kept tree's
exact expectation, which is what the stats report (``fit_predicted_tokens``, next to the tokens
the fitted steps actually committed). The budget and the spine share (the share of kept nodes
that are spine nodes) are both chosen this way, step by step.

When keeping no node (a single step) is best, the step is an ordinary decoding step (the
automatic fallback, counted in the stats); every ``explore_every``-th fallback in a row still
verifies the inner tree, so estimates keep learning. ``estimator="classes"`` replaces the model
by independent per-class rates (origin, depth, sibling rank), the estimate used before.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any, Literal

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
    max_depth_bucket: int = Field(8, ge=1, description="classes: depths beyond this share one estimate")
    max_spine_depth: int = Field(32, ge=1, description="cascade: spine depths beyond this share one rate")
    carry: float = Field(
        0.5, ge=0.0, le=1.0,
        description="cascade: share of the acceptance counts carried into the decoder's next generation (0: start afresh)",
    )
    fallback: bool = Field(True, description="plain decoding step when no tree is worth its cost")
    explore_every: int = Field(8, ge=1, description="verify the full tree after this many fallbacks in a row")
    estimator: Literal["cascade", "classes"] = Field(
        "cascade",
        description="'cascade': the theory module's acceptance model with online rates; "
        "'classes': independent rates per (origin, depth, sibling rank)",
    )
    max_rank: int = Field(16, ge=1, description="cascade: sibling ranks beyond this are given probability 0")


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
        from goose.theory.calibrate import Counts

        self.acc.clear()
        self.trials.clear()
        old = getattr(self, "route_counts", {})
        self.route_counts: dict[str, Counts] = defaultdict(Counts)
        if request is not None and self.options.carry > 0.0:
            for route, c in old.items():
                self.route_counts[route] = c.scaled(self.options.carry)
        self.models: dict = {}
        self.counts: Counter = Counter()
        self.streak = 0
        self.pending: float | None = None
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
        parents = tree.parents
        n = tree.num_nodes
        model = self._model(tree.route) if self.options.estimator == "cascade" else None
        if model is not None:
            try:
                prob = model.reach(tree).tolist()
            except ValueError:  # a plugin tree outside the model (e.g. two spine children): per-class rates
                model = None
                c0 = self.counts
                c0["model_misfits"] += 1
        if model is None:
            keys = self._keys(tree)
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
        keep = sorted([0, *order[:best_m]])
        c["spine_offered"] += sum(1 for o in tree.origins if o == "spine")
        c["spine_kept"] += sum(1 for i in keep if tree.origins[i] == "spine")
        if best_m == n - 1:
            out = tree
        else:
            remap = {old: new for new, old in enumerate(keep)}
            out = DraftTree(
                tuple(tree.tokens[i] for i in keep),
                tuple(-1 if i == 0 else remap[parents[i]] for i in keep),
                tuple(tree.origins[i] for i in keep),
                None if tree.scores is None else tuple(tree.scores[i] for i in keep),
                tree.route,
                dict(tree.meta),
            )
        if model is not None:
            self.pending = model.expected_tokens(out)
        return out

    def _model(self, route: str):
        m = self.models.get(route)
        if m is None:
            from goose.theory.calibrate import smoothed

            o = self.options
            m = self.models[route] = smoothed(
                self.route_counts[route], o.prior, o.prior_weight, o.max_spine_depth, o.max_rank
            )
        return m

    def observe(self, verified: Verified) -> None:
        tree = verified.tree
        if verified.kind == "tree" and tree is not None and tree.num_nodes > 1:
            if self.pending is not None:
                self.counts["predicted_tokens"] += self.pending
                self.counts["predicted_steps_tokens"] += len(verified.path)
                self.pending = None
            if self.options.estimator == "cascade":
                from goose.theory.calibrate import count_step

                try:
                    count_step(self.route_counts[tree.route], tree.parents, tree.origins, verified.path)
                    self.models.pop(tree.route, None)
                except ValueError:
                    pass
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
            fit_spine_offered=c["spine_offered"],
            fit_spine_kept=c["spine_kept"],
            fit_predicted_tokens=round(float(c["predicted_tokens"]), 3),
            fit_predicted_steps_tokens=c["predicted_steps_tokens"],
            fit_model_misfits=c["model_misfits"],
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
