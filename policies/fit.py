"""``fit``: fit any policy's tree to the device, and fall back to plain decoding when no tree pays.

Each step the inner policy (default ``spine``) shapes its tree; ``fit`` gives every node its probability of
being accepted under :class:`goose.theory.model.AcceptanceModel`, with rates learned online per :class:`Route`
from this generation's verified trees (:func:`goose.theory.calibrate.count_step`, shrunk toward a prior by
:func:`goose.theory.calibrate.smoothed`), and keeps the subtree that maximises expected tokens per second:

    (1 + sum of the kept nodes' acceptance probabilities) / t(kept nodes + 1)

where ``t(n)`` is the measured forward latency for n tokens (``goose.verifiers.latency``). A child is never
likelier than its parent nor a lower-ranked candidate than a better-ranked sibling, so the m likeliest nodes
form a subtree; pruning only raises later siblings' probability, so the full tree's sum is a lower bound of
the kept tree's expectation (``fit_predicted_tokens``). Keeping no node is an ordinary decoding step (the
fallback). A tree the acceptance model cannot read is fitted with per-class rates (``fit_model_misfits``).

Never slower than plain decoding: a pessimistic ``prior`` (except a chain's measured confidence tier,
``source_priors``, so that a right 50-token match is not verified a few tokens at a time), the curve corrected by
observed step times, the gain scaled down by observed over predicted tokens, and exploration budgeted
(``EXPLORE_*``); all carried across requests (``CARRY``). docs/speed.md ("How spine-fit uses the curve") has the
details; ``shadow`` and ``continuation`` (the spine checked in hindsight) are described in their options.
"""

from __future__ import annotations

from collections import Counter, defaultdict, namedtuple
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from pydantic import Field, field_validator

from goose.policies import tiers as measured_tiers
from goose.errors import InvalidInputError
from goose.hookspecs import hookimpl
from goose.interfaces import DraftContext, DraftSource, Options, Request, TreePolicy, Verified
from goose.verifiers import latency
from goose.manager import build_inner
from goose.policies.chains import LEAD, SIDE, lead_path
from goose.policies.rates import shrunk
from goose.theory.calibrate import Counts, count_step, smoothed
from goose.theory.model import AcceptanceModel
from goose.tree import DraftTree

# the fit's internal tuning
PRIOR_WEIGHT = 2.0  # pseudo-observations behind the prior
MAX_DEPTH_BUCKET = 8  # per-class rates (a tree the acceptance model cannot read): deeper depths share one estimate
MAX_SPINE_DEPTH = 32  # spine depths beyond this share one rate
CARRY = 0.5  # share of the acceptance counts carried into the decoder's next generation
MAX_RANK = 16  # sibling ranks beyond this are given probability 0
EXPLORE_EVERY = 8  # after this many fallbacks in a row, a small exploration tree is verified
EXPLORE_COST = 2.0  # an exploration tree costs at most this many plain steps on the curve (at least one node)
EXPLORE_SHARE = 0.02  # exploration may lose at most this share of the observed time against plain steps
PREFILL_STEPS = 1.0  # the prefill's extra logit rows may cost at most this many plain steps (LM head's cost per row)
SHADOW_DEPTH = 64  # spine depths past the verified spine a step's inner spine is checked for, in hindsight


class FitOptions(Options):
    inner: str = Field("spine", description="registered policy whose trees are fitted",
        json_schema_extra={"why": "which policy's trees are fitted to the device"},
    )
    inner_options: dict[str, Any] = Field(default_factory=dict, description="options of the inner policy",
        json_schema_extra={"why": "the inner policy's options"},
    )
    spine_source: str | None = Field(
        None, description="the chain source of the spine, passed on to the inner policy (and the policies it "
        "wraps); None: theirs (the first non-successor source)",
        json_schema_extra={"why": "force the spine's chain source through every wrapped policy"},
    )
    latency: dict[int, float] | None = Field(
        None, description="fixed forward latency {tree size: seconds}; None: measured once for the model",
        json_schema_extra={"why": "a fixed latency curve: reproducible runs, no calibration, or another device's curve"},
    )
    prior: float = Field(0.1, ge=0.0, le=1.0, description="prior acceptance probability of a node class (pessimistic: trees must be earned by observed rates)",
        json_schema_extra={"why": "how much evidence a tree must earn before it is drafted (higher: drafts sooner)"},
    )
    shadow: bool = Field(
        True,
        description="also learn the spine rates past what was verified (the spine nodes the fit cut, all "
        "of them on a plain step), checked in hindsight against the tokens the target commits there in this and "
        "the following steps (up to SHADOW_DEPTH depths), so that deeper spine nodes are earned by evidence "
        "instead of staying at the prior",
        json_schema_extra={"why": "off: learn spine rates from verified nodes only (an ablation)"},
    )
    source_priors: dict[str, list[tuple[float, float, float]]] | None = Field(
        None,
        description="where a chain source's spine rates start, by the confidence of its chain this step: "
        "{source: [(min confidence, p_1, p_deeper), ...]}, the first tier the chain's confidence reaches wins; a tier's "
        "chains are learned apart from the source's other chains (route 'branched@pld^1'), shrunk toward (p_1, p_deeper) "
        "instead of `prior`. None: each source's tiers as `goose tiers` measured and stored them (pld's ship with "
        "Goose); {}: every spine starts at `prior`",
        json_schema_extra={"why": "start a source's rates from tiers of your own ({}: from the prior)"},
    )
    continuation: bool = Field(
        True,
        description="with shadow: a chain that continues an earlier step's spine still being checked (its "
        "tokens are that spine's next ones, every one before them committed) is given that spine's route's rates "
        "from the depth it has reached (p_{K+1}, p_{K+2}, ... after K committed) when its tree is shaped, not a fresh "
        "chain's from depth 1 (what is learned is unchanged)",
        json_schema_extra={"why": "off: a chain that continues a checked spine starts from depth 1 (an ablation)"},
    )

    @field_validator("source_priors")
    @classmethod
    def _tiers(cls, v):
        if v is None:
            return v
        # pydantic has made each tier a (float, float, float); what is left is the range and the order
        for source, tiers in v.items():
            for t in tiers:
                if not all(0.0 <= x <= 1.0 for x in t):
                    raise ValueError(
                        f"source_priors[{source!r}]: each tier is (min confidence, p_1, p_deeper), all in [0, 1]; "
                        f"got {t}. Hint: {{'pld': [(1.0, 0.5, 0.85)]}}"
                    )
        return {source: sorted(tiers, key=lambda t: -t[0]) for source, tiers in v.items()}  # highest tier first


@dataclass(frozen=True)
class Route:
    """The key of one set of acceptance rates: the inner policy's route for the tree (``kind``: ``spine``,
    ``bypass``, ``chain``, ...), the source that leads its spine (``lead``; None when no source does), and
    the confidence tier of that source's chain (``tier``: the tier's minimum confidence in
    ``FitOptions.source_priors``; None when the source has no tier there or the chain reaches none).
    ``str()`` writes it as ``kind@lead^tier`` (``branched@pld^1``, ``bypassed@pld``, ``branched``)."""

    kind: str
    lead: str | None = None
    tier: float | None = None

    def __str__(self) -> str:
        out = self.kind if self.lead is None else f"{self.kind}@{self.lead}"
        return out if self.tier is None else f"{out}^{self.tier:g}"


class FitPolicy(TreePolicy):
    """Prune the inner policy's tree to maximise expected tokens per second on this device."""

    name = "fit"
    Options = FitOptions

    def __init__(self, options: FitOptions | None = None):
        super().__init__(options)
        o = self.options
        if o.inner == "fit" or o.inner.endswith("-fit"):
            raise InvalidInputError(f"fit cannot wrap itself (inner={o.inner!r}). Hint: inner='spine'.")
        self.inner: TreePolicy = build_inner(o.inner, o.inner_options, {"spine_source": o.spine_source}, self.name)
        if o.spine_source is not None and "spine_source" not in type(self.inner).Options.model_fields:
            raise InvalidInputError(
                f"policy {self.name!r}: spine_source={o.spine_source!r}, but its inner policy {o.inner!r} has no spine. "
                "Hint: inner='spine', or drop spine_source."
            )
        self.curve = None
        self._sources: tuple = ()
        if o.latency:
            items = sorted((int(k), float(v)) for k, v in o.latency.items())
            self.curve = latency.LatencyCurve(tuple(k for k, _ in items), tuple(v for _, v in items))
        self._t: list[float] | None = None  # the curve's latency by tree size (attach, or the first fit)
        self._set_priors(o.source_priors or {})
        self.observed: Counter = Counter()  # latency, calibration and exploration sums (carried)
        self.route_counts: dict[Route, Counts] = {}  # acceptance counts per route (carried)
        self.begin(None)

    def _set_priors(self, priors: dict) -> None:
        """``priors``: ``{source: tiers}``, highest floor first; ``_starts``: (source, floor) -> (p_1, p_deeper)."""
        self.priors = priors
        self._starts = {
            (source, floor): (p1, deeper) for source, tiers in priors.items() for floor, p1, deeper in tiers
        }

    def bind(self, sources: Sequence[DraftSource]) -> None:
        self.inner.bind(sources)
        self._sources = tuple(sources)

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        return self.inner.consulted(sources)

    def attach(self, model, verifier) -> None:
        self.inner.attach(model, verifier)
        if self.options.source_priors is None:  # the stored tiers (load checks them highest floor first)
            self._set_priors(measured_tiers.for_sources(self._sources, model))
        if self.curve is None:
            self.curve = latency.curve_for(model, verifier)
        self._t = self.curve.table(512)

    def max_nodes(self, budget: int) -> int:
        return self.inner.max_nodes(budget)

    def prefill_positions(self, prompt_len: int, wanted: int) -> int:
        """At most the rows whose LM-head cost fits ``PREFILL_STEPS`` plain steps (measured curves only)."""
        c, steps = self.curve, PREFILL_STEPS
        wanted = self.inner.prefill_positions(prompt_len, wanted)
        if c is None:
            return wanted
        cap = c.head_rows_within(steps * c(1))
        return wanted if cap is None else max(1, min(wanted, cap))

    def begin(self, request: Request | None) -> None:
        self.acc: Counter = Counter()  # per-class rates (a tree the acceptance model cannot read)
        self.trials: Counter = Counter()
        carry = CARRY if request is not None else 0.0
        carried = {r: c.scaled(carry) for r, c in self.route_counts.items()} if carry else {}
        self.route_counts = defaultdict(Counts, carried)
        self.observed = Counter({k: v * carry for k, v in self.observed.items()} if carry else {})
        self.models: dict[Route, AcceptanceModel] = {}  # smoothed rates per route, until its counts change
        self.counts: Counter = Counter()
        self.streak = 0
        # the step being shaped and verified
        self.pending: float | None = None  # the fitted tree's expected tokens
        self._pending_fitted = False  # whether that tree was fitted (an exploration tree is not the fit's bet)
        self._kind = "fitted"  # "fitted" or "explore"
        self._shadow: tuple[Route, list[int]] | None = None  # (route, the inner tree's spine tokens)
        self._step: tuple | None = None  # (kind, size, shape-end time) of the step being verified
        self._open: list = []  # earlier steps' spines still being checked against committed tokens (shadow)
        if request is not None:
            self.inner.begin(request)

    # -- per-class rates: the estimate for a tree the acceptance model cannot read -------------------
    def _keys(self, tree: DraftTree) -> list:
        """A class per node: (origin, depth bucket, rank among same-origin siblings, capped)."""
        seen: Counter = Counter()
        keys = [None]
        for i in range(1, tree.num_nodes):
            o = tree.origins[i]
            keys.append((o, min(tree.depths[i], MAX_DEPTH_BUCKET), min(seen[tree.parents[i], o], 3)))
            seen[tree.parents[i], o] += 1
        return keys

    def shape(self, ctx: DraftContext) -> DraftTree | None:
        out = self._fit(ctx)
        size = 1 if out is None else out.num_nodes
        kind = self._kind if out is not None and size > 1 else "single"
        self._step = (kind, size, perf_counter())
        return out

    # -- what the observed steps say ----------------------------------------------------------------
    def _correcting(self) -> bool:
        return not self.options.latency  # a measured curve is corrected, a fixed one is taken as given

    def _ratios(self) -> tuple[float, float]:
        """(plain, tree) ratios of observed step time to the curve's prediction, prior 1."""
        if not self._correcting():
            return 1.0, 1.0
        ob, t = self.observed, self._t
        c1, ct = 2.0 * t[1], 2.0 * t[min(4, len(t) - 1)]
        r1 = (ob["single_obs"] + c1) / (ob["single_pred"] + c1)
        rt = (ob["tree_obs"] + ct) / (ob["tree_pred"] + ct)
        return r1, rt

    def _kappa(self) -> float:
        """Observed / predicted accepted tokens of fitted steps, capped at 1 (never optimistic)."""
        ob = self.observed
        return min(1.0, (ob["calib_got"] + 2.0) / (ob["calib_pred"] + 2.0))

    def _cost(self, size: int) -> float:
        """The curve's latency of a pass over ``size`` tokens."""
        return self._t[size] if size < len(self._t) else self.curve(size)

    def _fit(self, ctx: DraftContext) -> DraftTree | None:
        self._kind = "fitted"
        self._shadow = None
        tree = self.inner.shape(ctx)
        if tree is None or tree.num_nodes < 2:
            return tree
        if self._t is None and self.curve is not None:  # not attached to a model: the fixed curve
            self._t = self.curve.table(512)
        if self._t is None:
            return tree
        n = tree.num_nodes
        route, view = _per_source(tree, self.priors)
        model = self._model(route)
        spine = [tree.tokens[i] for i in lead_path(tree)] if self.options.shadow else None
        continued = self._continues(spine) if spine and self.options.continuation else None
        if continued is not None:
            model = self._shifted(model, *continued)
            self.counts["continued_steps"] += 1
        if spine is not None:
            self._shadow = (route, spine)
        try:
            prob = model.reach(view).tolist()
        except ValueError:  # a plugin tree outside the model (e.g. two spine children): per-class rates
            model = None
            self.counts["model_misfits"] += 1
            keys = self._keys(tree)
            prob = [1.0] * n
            for i in range(1, n):
                k = keys[i]
                prob[i] = prob[tree.parents[i]] * shrunk(self.acc[k], self.trials[k], self.options.prior, PRIOR_WEIGHT)
        order = sorted(range(1, n), key=lambda i: (-prob[i], i))
        t = self._t
        r1, rt = self._ratios()
        kappa = self._kappa()
        best_m, best_v, gain = 0, 1.0 / (t[1] * r1), 1.0
        for m, i in enumerate(order, start=1):
            gain += kappa * prob[i]
            v = gain / (self._cost(m + 1) * rt)
            if v > best_v:
                best_m, best_v = m, v
        c = self.counts
        if best_m == 0:
            self.streak += 1
            limit = EXPLORE_COST * t[1]
            best_m = 1
            while best_m < n - 1 and self._cost(best_m + 2) <= limit:
                best_m += 1
            worst = self._cost(best_m + 1) * rt - t[1] * r1  # its worst loss against a plain step, corrected
            if self.streak < EXPLORE_EVERY or not self._may_explore(worst):
                c["fallback_steps"] += 1
                # the anchor alone, carrying the chains laid out: the plain step's token books each one's depth 1
                # (a source that is right but not yet trusted earns its way in; one that is wrong loses its tier)
                return tree.subtree([0]) if tree.meta.get("chains") else None
            c["explore_steps"] += 1
            self._kind = "explore"
        self.streak = 0
        c["fitted_steps"] += 1
        c["nodes_offered"] += n - 1
        c["nodes_kept"] += best_m
        keep = sorted([0, *order[:best_m]])
        c["lead_offered"] += sum(1 for o in tree.origins if o == LEAD)
        c["lead_kept"] += sum(1 for i in keep if tree.origins[i] == LEAD)
        out = tree if best_m == n - 1 else tree.subtree(keep)
        if model is not None:
            self.pending = model.expected_tokens(out)
            self._pending_fitted = self._kind == "fitted"
        return out

    def _continues(self, spine: list[int]) -> tuple[Route, int] | None:
        """(route, K) of the open spine check this step's spine continues (its next unchecked tokens are this
        spine's first ones, K of its tokens committed so far), the one with the most committed; None if none."""
        best = None
        for route, old, i, last in self._open:
            rest = old[i:last]
            n = min(len(rest), len(spine))
            if n and rest[:n] == spine[:n] and (best is None or i > best[1]):
                best = (route, i)
        return best

    def _shifted(self, model: AcceptanceModel, route: Route, k: int) -> AcceptanceModel:
        """``model`` with its spine rates replaced by ``route``'s from depth k + 1 on (a continued chain)."""
        base = self._model(route)
        spine = tuple(base.p(k + d) for d in range(1, max(1, len(base.spine) - k) + 1))
        return AcceptanceModel(spine, model.branch, model.per_origin, model.spine_origin)

    def _may_explore(self, worst: float) -> bool:
        """Explore only if even a total loss of this step keeps exploration within its share."""
        ob = self.observed
        return ob["explore_lost"] + max(0.0, worst) <= EXPLORE_SHARE * (ob["time"] + worst)

    def _model(self, route: Route) -> AcceptanceModel:
        """The route's rates: its counts smoothed toward its start (``_tier_prior``, else ``prior``), or for a
        bypass route toward what its lead source earned on its other routes (``_earned_elsewhere``)."""
        m = self.models.get(route)
        if m is None:
            m = self.models[route] = smoothed(
                self.route_counts[route], self.options.prior, PRIOR_WEIGHT, MAX_SPINE_DEPTH, MAX_RANK,
                toward=self._earned_elsewhere(route), start=self._tier_prior(route))
        return m

    def _tier_prior(self, route: Route) -> tuple[float, float] | None:
        """(p_1, p_deeper) where the route's confidence tier starts its spine rates (``source_priors``); None:
        ``prior``."""
        return self._starts.get((route.lead, route.tier)) if route.tier is not None else None

    def _stale(self, route: Route) -> None:
        """The route's counts changed: drop its cached model, and its source's bypass model that borrows from them."""
        self.models.pop(route, None)
        if route.lead is not None:  # every bypass route of that source borrows from it (_earned_elsewhere)
            for key in [k for k in self.models if k.kind == "bypassed" and k.lead == route.lead]:
                del self.models[key]

    def _earned_elsewhere(self, route: Route) -> tuple[float, ...] | None:
        """For a bypass route (``bypassed@pld^1``), the spine rates its lead source has earned on its other routes,
        pooled and smoothed; None for other routes, or when the others have no spine trials.

        Only the bypass route borrows: it is drafted only when the match is confident, so what its source earned
        elsewhere is a pessimistic start, while the other routes differ by what competes with the spine for
        nodes. Depth 1 pools the same confidence tier only (where a chain starts is what a tier says), deeper
        depths every tier (depth d given d - 1 is much the same in every tier; docs/results.md, section 10)."""
        if route.kind != "bypassed" or route.lead is None:
            return None
        pooled = Counts()
        for r, c in self.route_counts.items():
            if r == route or r.lead != route.lead:
                continue
            for counts, into in ((c.spine_trials, pooled.spine_trials), (c.spine_hits, pooled.spine_hits)):
                for d, v in counts.items():
                    if r.tier == route.tier or d >= 2:
                        into[d] += v
        if not pooled.spine_trials:
            return None
        start = self._tier_prior(route)
        return smoothed(pooled, self.options.prior, PRIOR_WEIGHT, MAX_SPINE_DEPTH, 1, start=start).spine

    def observe(self, verified: Verified) -> None:
        if verified.kind == "tree" and self._step is not None and self._t is not None:
            self._account(verified)
        self._step = None
        tree = verified.tree
        shadow, self._shadow = self._shadow, None
        if verified.kind == "tree" and tree is not None and (shadow is not None or self._open):
            self._learn_past(shadow, verified)
        if verified.kind == "tree" and tree is not None and tree.num_nodes > 1:
            if self.pending is not None:
                self.counts["predicted_tokens"] += self.pending
                self.counts["predicted_steps_tokens"] += len(verified.path)
                if self._pending_fitted:  # exploration trees are not the fit's bet
                    self.observed["calib_pred"] += self.pending - 1.0
                    self.observed["calib_got"] += len(verified.path) - 1.0
                self.pending = None
            try:
                route, view = _per_source(tree, self.priors)
                count_step(self.route_counts[route], view.parents, view.origins, verified.path)
                self._stale(route)
            except ValueError:  # a tree outside the model: its per-class counts below still learn
                pass
            on_path = set(verified.path)
            keys = self._keys(tree)
            for i in range(1, tree.num_nodes):
                if tree.parents[i] in on_path:
                    self.trials[keys[i]] += 1
                    if i in on_path:
                        self.acc[keys[i]] += 1
        self.inner.observe(verified)

    def _learn_past(self, shadow: tuple[Route, list[int]] | None, verified: Verified) -> None:
        """Spine trials past the verified spine, in hindsight: when the walk accepted every spine node kept and
        the inner tree's spine went on, its next tokens are checked against what the target commits there, this
        step and the following ones (up to ``SHADOW_DEPTH`` depths, until the first miss). Each trial is
        conditioned as the rate is (every shallower spine token right), so the estimate stays unbiased while
        deep depths earn evidence at the pace tokens are committed, not one depth per step."""
        tree, path = verified.tree, verified.path
        origins = tree.origins
        committed = [tree.tokens[i] for i in path[1:]]
        if verified.bonus is not None:
            committed.append(verified.bonus)
        still = [trial for trial in self._open if self._check(trial, committed)]  # earlier spines read first
        if shadow is None:
            self._open = still
            return
        route, spine = shadow
        kept = sum(1 for o in origins if o == LEAD)
        if kept < len(spine) and len(path) >= kept + 1 and all(origins[i] == LEAD for i in path[1 : kept + 1]):
            last = min(len(spine), kept + SHADOW_DEPTH)
            trial = [route, spine, kept, last]  # route, spine tokens, next index to check, index to stop at
            if self._check(trial, committed[kept:]):
                still.append(trial)
        self._open = still[-SHADOW_DEPTH :]

    def _check(self, trial: list, tokens: Sequence[int]) -> bool:
        """Book the trial's spine against committed ``tokens``; True while it stays open."""
        route, spine, i, last = trial
        c = None
        for tok in tokens:
            if i >= last:
                break
            if c is None:
                c = self.route_counts[route]
                self._stale(route)
            c.spine_trials[i + 1] += 1
            self.counts["shadow_trials"] += 1
            if tok != spine[i]:
                return False
            c.spine_hits[i + 1] += 1
            i += 1
        trial[2] = i
        return i < last

    def end(self, output) -> None:
        self.inner.end(output)

    def _account(self, verified: Verified) -> None:
        """Book the step's observed time against the curve, and exploration's loss against plain steps."""
        kind, size, t_end = self._step
        if (verified.tree.num_nodes if verified.tree is not None else 1) != size:
            return  # the loop pruned the tree (depth limit): not the step that was planned
        t, pred, ob = self._t, self._cost(size), self.observed
        if self._correcting():
            dt = perf_counter() - t_end
            dt = min(max(dt, 0.25 * pred), 4.0 * pred)  # one stall (or a clock hiccup) moves it little
            key = "single" if size == 1 else "tree"
            ob[key + "_obs"] += dt
            ob[key + "_pred"] += pred
            cost, plain = dt, t[1] * self._ratios()[0]
        else:
            cost, plain = pred, t[1]
        ob["time"] += cost
        if kind == "explore":
            ob["explore_lost"] += max(0.0, cost - len(verified.path) * plain)

    def stats(self) -> dict:
        c, ob = self.counts, self.observed
        single, tree = (round(r, 3) for r in self._ratios()) if self._t is not None else (None, None)
        return {
            **self.inner.stats(),
            **{f"fit_{k}": c[k] for k in ("fallback_steps", "explore_steps")},
            "fit_steps": c["fitted_steps"],
            **{f"fit_{k}": c[k] for k in ("nodes_offered", "nodes_kept", "lead_offered", "lead_kept")},
            "fit_predicted_tokens": round(float(c["predicted_tokens"]), 3),
            **{f"fit_{k}": c[k] for k in ("predicted_steps_tokens", "model_misfits", "shadow_trials",
                                          "continued_steps")},
            "fit_latency_ratio_single": single,
            "fit_latency_ratio_tree": tree,
            "fit_gain_scale": round(self._kappa(), 3),
            "fit_explore_lost_share": round(ob["explore_lost"] / ob["time"], 4) if ob["time"] else 0.0,
        }


_View = namedtuple("_View", "parents origins")  # a tree as the acceptance model reads it, side chains relabelled


def _per_source(tree: DraftTree, priors: dict | None = None) -> tuple[Route, DraftTree | _View]:
    """The rates' key and the tree as the acceptance model reads it, per source: spine rates are
    learned per source leading the spine (route ``spine@suffix``), and per confidence tier of its
    chain where ``priors`` (``FitOptions.source_priors``) has tiers for that source
    (``branched@pld^1``); another source's side chain (origin ``side``) is its own origin group
    (``side:suffix``). A tree without side chains is its own view."""
    if tree.sources is None or tree.num_nodes < 2:
        return Route(tree.route), tree
    lead = next((s[0] for o, s in zip(tree.origins, tree.sources) if o == LEAD and s), None)
    conf = tree.meta.get("confidence")  # the tier: the first (highest) of the lead's priors that it reaches
    floor = next((f for f, _, _ in (priors or {}).get(lead, ()) if conf is not None and conf >= f), None)
    route = Route(tree.route, lead, floor)
    if SIDE not in tree.origins:
        return route, tree
    origins = tuple(f"{SIDE}:{s[0]}" if o == SIDE and s else o for o, s in zip(tree.origins, tree.sources))
    return route, _View(tree.parents, origins)


@hookimpl(trylast=True)
def goose_register_policies(register) -> None:
    register(FitPolicy)
    register(
        FitPolicy,
        name="spine-fit",
        defaults={"inner": "spine"},
        description="GOOSE spine tree fitted to the device's measured forward latency, with automatic fallback",
    )
