"""Calibration: estimate ``p_d`` and ``q_r`` from logged verification steps (records), predict tau
and compare it with the measured one. docs/theory.md, "Calibration on real runs", gives the record
format, the estimators and the prediction."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from goose.hookspecs import hookimpl
from goose.policies.rates import shrunk
from goose.theory.model import (
    LEAD,
    AcceptanceModel,
    _depths,
    _layout,
    _spine_child,
    independent_ranks,
    path_to,
    simulate_walks,
)


@dataclass(frozen=True)
class Record:
    """One logged verification step (docs/theory.md, "Records", gives its JSON form)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    origins: tuple[str, ...]
    path: tuple[int, ...]
    dataset: str = "default"
    request: int | str = 0
    step: int = 0
    committed: int | None = None
    argmax: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        n, where = len(self.parents), f"record {self.dataset}/{self.request}/{self.step}"
        if not (len(self.tokens) == len(self.origins) == n) or n == 0 or self.parents[0] != -1:
            raise ValueError(f"{where}: malformed tree")
        if not self.path or self.path[0] != 0:
            raise ValueError(f"{where}: path must start at the root 0")
        for a, b in zip(self.path[:-1], self.path[1:], strict=True):
            if not (0 < b < n) or self.parents[b] != a:
                raise ValueError(f"{where}: path {list(self.path)} is not a root-to-node path of the tree "
                                 f"(node {b} is not a child of {a})")
        if self.argmax is not None and len(self.argmax) != n:
            raise ValueError(f"{where}: argmax needs one entry per node")

    @property
    def tokens_committed(self) -> int:
        return len(self.path) if self.committed is None else int(self.committed)

    @property
    def cut(self) -> bool:
        return self.tokens_committed < len(self.path)

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in ("dataset", "request", "step", "tokens", "parents", "origins", "path")}
        d.update({k: getattr(self, k) for k in ("committed", "argmax") if getattr(self, k) is not None})
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    @classmethod
    def from_json(cls, d: dict) -> Record:
        missing = [k for k in ("tokens", "parents", "origins", "path") if k not in d]
        if missing:
            raise ValueError(f"record is missing {missing}; required: tokens, parents, origins, path")
        return cls(
            tuple(int(t) for t in d["tokens"]),
            tuple(int(p) for p in d["parents"]),
            tuple(str(o) for o in d["origins"]),
            tuple(int(i) for i in d["path"]),
            str(d.get("dataset", "default")),
            d.get("request", 0),
            int(d.get("step", 0)),
            None if d.get("committed") is None else int(d["committed"]),
            None if d.get("argmax") is None else tuple(int(a) for a in d["argmax"]),
        )


def record_from_step(step, dataset: str = "default", request: int | str = 0) -> Record:
    """A :class:`Record` from a :class:`goose.StepRecord` (``goose_on_step``'s argument)."""
    tree, v = step.tree, step.verified
    argmax = tuple(v.argmax) if getattr(v, "argmax", None) else None
    return Record(
        tuple(tree.tokens), tuple(tree.parents), tuple(tree.origins), tuple(v.path),
        dataset, request, int(step.step), len(step.committed), argmax,
    )


class Recorder:
    """A goose plugin (``goose.register_plugin(Recorder("gsm8k"))``) that logs every verification step
    as a :class:`Record`, one request per ``generate`` call. The last step's commit is re-derived from
    the output's ``generated_tokens`` as a guard, so the records reproduce ``Stats.tau`` exactly."""

    def __init__(self, dataset: str = "default") -> None:
        self.dataset = dataset
        self.records: list[Record] = []
        self.request = -1
        self._first = 0

    def set_dataset(self, dataset: str) -> None:
        self.dataset = dataset

    @hookimpl
    def goose_on_generation_start(self, decoder, request) -> None:
        self.request += 1
        self._first = len(self.records)

    @hookimpl
    def goose_on_step(self, decoder, step) -> None:
        self.records.append(record_from_step(step, self.dataset, self.request))

    @hookimpl
    def goose_on_generation_end(self, decoder, output) -> None:
        mine = self.records[self._first :]
        if not mine:
            return
        earlier = sum(r.tokens_committed for r in mine[:-1])
        last = output.stats.generated_tokens - 1 - earlier  # the prefill committed one token
        self.records[-1] = replace(mine[-1], committed=last)


def as_record(obj, dataset: str = "default", request: int | str = 0) -> Record:
    """Accept a Record, a StepRecord-like object (``.tree``, ``.verified.path``) or a JSON dict."""
    if isinstance(obj, Record):
        return obj
    if isinstance(obj, dict):
        return Record.from_json(obj)
    if hasattr(obj, "tree") and hasattr(obj, "verified"):
        return record_from_step(obj, dataset, request)
    raise TypeError(f"cannot read a step record from {type(obj).__name__}")


def load_records(path: str | Path) -> list[Record]:
    out = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    out.append(Record.from_json(json.loads(line)))
                except (ValueError, TypeError, KeyError) as exc:
                    raise ValueError(f"{path}:{n}: {exc}") from exc
    return out


def dump_records(records: Iterable[Record], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r.to_json()) + "\n")


# ---- Estimation ----
@dataclass
class Counts:
    """Trials and hits behind each estimated rate."""

    spine_trials: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    spine_hits: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    rank_trials: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))
    rank_hits: dict[str, dict[int, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def scaled(self, share: float) -> Counts:
        """A copy with every count multiplied by ``share`` (counts carried into a new request)."""
        out = Counts()
        for src, dst in ((self.spine_trials, out.spine_trials), (self.spine_hits, out.spine_hits)):
            dst.update({d: v * share for d, v in src.items()})
        for src, dst in ((self.rank_trials, out.rank_trials), (self.rank_hits, out.rank_hits)):
            for o, vec in src.items():
                dst[o].update({r: v * share for r, v in vec.items()})
        return out

    def spine_counts(self, d: int, pool_from: int) -> tuple[int, int]:
        """(trials, hits) of spine nodes at depth ``d``; ``d = pool_from`` pools every deeper depth too."""
        if d < pool_from:
            return self.spine_trials.get(d, 0), self.spine_hits.get(d, 0)
        return (sum(v for k, v in self.spine_trials.items() if k >= pool_from),
                sum(v for k, v in self.spine_hits.items() if k >= pool_from))


def count_step(c: Counts, parents: Sequence[int], origins: Sequence[str], path: Sequence[int],
               spine_origin: str = LEAD) -> None:
    """Add one verified step's trials and hits to ``c`` (the estimators of docs/theory.md)."""
    depth = _depths(parents)
    spine, groups = _layout(parents, origins, spine_origin)
    nxt = dict(zip(path[:-1], path[1:], strict=True))
    for u in path:
        taken, s = nxt.get(u), _spine_child(spine, u)
        if s >= 0:
            c.spine_trials[depth[s]] += 1
            if taken == s:
                c.spine_hits[depth[s]] += 1
                continue
        for origin, group in groups[u].items():
            for r, k in enumerate(group, 1):
                c.rank_trials[origin][r] += 1
                if taken == k:
                    c.rank_hits[origin][r] += 1
            if taken in group:
                break


def count(records: Iterable[Record], spine_origin: str = LEAD) -> Counts:
    c = Counts()
    for rec in records:
        try:
            count_step(c, rec.parents, rec.origins, rec.path, spine_origin)
        except ValueError as exc:
            raise ValueError(f"record {rec.dataset}/{rec.request}/{rec.step}: {exc}") from None
    return c


def smoothed(
    c: Counts, prior: float, weight: float, pool_from: int = 8, ranks: int = 16, spine_origin: str = LEAD,
    toward: Sequence[float] | None = None, start: tuple[float, float] | None = None,
) -> AcceptanceModel:
    """The online form of :func:`estimate`: every rate shrunk toward a target with ``weight`` pseudo-trials.

    ``p_1`` toward ``prior`` and ``p_d`` toward the estimate of ``p_{d-1}`` (deep nodes are tried far
    less often, and a match that held to depth d - 1 tends to hold on); ``toward`` (depth 1 first, its
    last entry for deeper depths) replaces those targets; ``start = (a, b)``: ``p_1`` toward ``a``,
    ``p_d`` toward the larger of ``b`` and the estimate of ``p_{d-1}``. Depths >= ``pool_from`` share
    one rate. ``q^o_r`` toward ``prior (1 - prior)^(r - 1)``, r <= ``ranks``, made non-increasing (the
    likeliest nodes keep rank prefixes) and scaled to sum to at most 1; unseen origins use the prior.
    """
    spine = []
    for d in range(1, pool_from + 1):
        t, h = c.spine_counts(d, pool_from)
        if toward:
            target = toward[min(d, len(toward)) - 1]
        elif start is not None:
            target = max(start[1], spine[-1]) if spine else start[0]
        else:
            target = spine[-1] if spine else prior
        spine.append(shrunk(h, t, target, weight))
    base = np.asarray(independent_ranks(prior, ranks))

    def vector(trials: dict[int, int], hits: dict[int, int]) -> tuple[float, ...]:
        t = np.asarray([trials.get(r, 0) for r in range(1, ranks + 1)], dtype=float)
        h = np.asarray([hits.get(r, 0) for r in range(1, ranks + 1)], dtype=float)
        v = np.minimum.accumulate(shrunk(h, t, base, weight))
        s = v.sum()
        return tuple(float(x) for x in (v / s if s > 1.0 else v))

    per_origin = {o: vector(c.rank_trials[o], c.rank_hits[o]) for o in c.rank_trials}
    return AcceptanceModel(tuple(spine), tuple(float(x) for x in base), per_origin, spine_origin)


def _rank_vector(trials: dict[int, int], hits: dict[int, int]) -> tuple[float, ...]:
    if not trials:
        return ()
    K = max(trials)
    v = np.asarray([hits.get(r, 0) / trials[r] if trials.get(r) else 0.0 for r in range(1, K + 1)])
    s = v.sum()
    if s > 1.0:
        v = v / s
    return tuple(float(x) for x in v)


def estimate(records: Iterable[Record], pool_from: int = 8, spine_origin: str = LEAD) -> tuple[AcceptanceModel, Counts]:
    """Fit the model to records: ``p_1..p_{pool_from}`` (the last pooled over deeper depths), a
    pooled branch vector over every non-spine origin, and one vector per non-spine origin."""
    c = count(records, spine_origin)
    spine: list[float] = []
    if c.spine_trials:
        deepest = max(c.spine_trials)
        for d in range(1, min(pool_from, deepest) + 1):
            t, h = c.spine_counts(d, pool_from)
            spine.append(h / t if t else (spine[-1] if spine else 0.0))
    pooled_t: dict[int, int] = defaultdict(int)
    pooled_h: dict[int, int] = defaultdict(int)
    per_origin = {}
    for o in c.rank_trials:
        per_origin[o] = _rank_vector(c.rank_trials[o], c.rank_hits[o])
        for r, t in c.rank_trials[o].items():
            pooled_t[r] += t
            pooled_h[r] += c.rank_hits[o].get(r, 0)
    model = AcceptanceModel(tuple(spine), _rank_vector(pooled_t, pooled_h), per_origin, spine_origin)
    return model, c


# ---- Prediction and the per-dataset error ----
@dataclass(frozen=True)
class TauComparison:
    dataset: str
    requests: int
    steps: int
    tau_measured: float
    tau_predicted: float

    @property
    def error(self) -> float:
        """Relative error of the predicted tau: (predicted - measured) / measured."""
        return (self.tau_predicted - self.tau_measured) / self.tau_measured


def compare_tau(records: Sequence[Record], model: AcceptanceModel, dataset: str = "all") -> TauComparison:
    """Measured vs predicted tau (prefill included) over ``records``."""
    requests = {(r.dataset, r.request) for r in records}
    R, S = len(requests), len(records)
    measured = sum(r.tokens_committed for r in records)
    predicted = sum(float(r.tokens_committed) if r.cut else model.expected_tokens(r) for r in records)
    return TauComparison(dataset, R, S, (R + measured) / (R + S), (R + predicted) / (R + S))


@dataclass(frozen=True)
class DatasetCalibration:
    own: TauComparison  # model fitted on this dataset's records
    pooled: TauComparison  # model fitted on all records


def calibration_report(records: Sequence[Record], pool_from: int = 8) -> dict[str, DatasetCalibration]:
    """Per dataset: tau measured, predicted from its own fit and from the pooled fit."""
    pooled_model, _ = estimate(records, pool_from)
    by: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by[r.dataset].append(r)
    out = {}
    for name in sorted(by):
        recs = by[name]
        own_model, _ = estimate(recs, pool_from)
        out[name] = DatasetCalibration(compare_tau(recs, own_model, name), compare_tau(recs, pooled_model, name))
    return out


# ---- Synthetic records (tests, and the CLI's self-check of the estimators) ----
def synthetic_records(
    trees: Sequence, model: AcceptanceModel, steps_per_tree: int, rng: np.random.Generator,
    dataset: str = "synthetic", steps_per_request: int = 50,
) -> list[Record]:
    """Records of greedy walks simulated under ``model`` on each tree, with a consistent argmax
    (the next path node's token along the path, a token no child carries elsewhere)."""
    out: list[Record] = []
    step = 0
    for tree in trees:
        fresh = max(tree.tokens) + 1
        for last in simulate_walks(tree, model, steps_per_tree, rng):
            path = path_to(tree.parents, int(last))
            argmax = [fresh] * len(tree.parents)
            for a, b in zip(path[:-1], path[1:], strict=True):
                argmax[a] = tree.tokens[b]
            out.append(Record(
                tuple(tree.tokens), tuple(tree.parents), tuple(tree.origins), path,
                dataset, step // steps_per_request, step, None, tuple(argmax),
            ))
            step += 1
    return out
