"""The engine step's measured cost, which the proposer's plan prices drafted rows with (:class:`StepCost`), and
the small numerics behind it: a 3 x 3 least squares in closed form, and pooling to a non-decreasing curve.

Plain Python floats throughout, not numpy: this runs once a step between the engine's forward passes, where
numpy's per-call overhead on a few numbers exceeds the arithmetic (docs/vllm.md, "Its own time")."""

from __future__ import annotations

from math import acos, cos, log, pi, sqrt


class StepCost:
    """The engine step's time against its decoding requests and drafted rows, measured as the engine runs
    (docs/vllm.md, "The step cost"): each ``propose`` call ends the step the previous call's drafts went into.
    Old steps are decayed; a step that carried prompt tokens is not counted (its time is the prompt's). Kept: per
    (request bucket, drafted-rows bucket) the decayed mean time, requests and drafted rows; a decayed
    least-squares plane ``a + b_req * requests + b_row * drafted``; and a line ``a + b * rows`` (rows: requests
    plus drafted). :meth:`cost` reads them (:meth:`curve`, :meth:`_costs`)."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8, outlier_factor: float = 3.0):
        self.decay, self.min_steps, self.outlier_factor = decay, min_steps, outlier_factor
        self.s = [0.0] * 6  # rows line: sum w, w*x, w*x^2, w*y, w*x*y, w*tokens
        self.p = [[0.0] * 4 for _ in range(4)]  # plane: decayed sum of v v^T with v = (1, requests, drafted, seconds)
        self.steps = 0
        # (request bucket, drafted-rows bucket) -> decayed [weight, sum of seconds, sum of requests, sum of drafted]
        self.buckets: dict[tuple[int, int], list[float]] = {}
        self._last: tuple[float, int, int] | None = None
        # until the next step: costs by requests (first rows, [cost of each rows from there]), the pooled curve by
        # requests (None: by rows), and the plane (False: not solved yet)
        self._spans: dict = {}
        self._curves: dict = {}
        self._plane: tuple | None | bool = False
        self.skipped = 0  # steps not counted because they carried prompt tokens
        self.outliers = 0  # steps not counted because they took more than outlier_factor times the measured cost

    @staticmethod
    def bucket(n: int) -> int:
        """Exact up to 8, then a quarter wider each."""
        return n if n <= 8 else 8 + int(log(n / 8.0) / log(1.25))

    def step(self, now: float, rows: int, tokens_now: int, left: int = 0, prompt: bool = False,
             requests: int | None = None, left_requests: int = 0) -> None:
        """A call at ``now`` plans ``rows`` rows for the coming step, ``requests`` of them decoding requests' own
        (None: every row is a request's); the step just run verified the rows and requests the last call planned,
        less ``left`` rows and ``left_requests`` requests (of requests that left the batch before it ran), and
        carried prompt tokens if ``prompt`` (then it is not counted)."""
        last, self._last = self._last, (now, rows, rows if requests is None else requests)
        if last is None or last[1] - left <= 0 or prompt:
            self.skipped += prompt
            return
        dt = now - last[0]
        x = float(last[1] - left)
        n = float(max(1, min(x, last[2] - left_requests)))
        m = x - n
        if self.outlier(dt, int(x), int(n)):
            self.outliers += 1
            return
        d = self.decay
        self.s = [d * a + b for a, b in zip(self.s, (1.0, x, x * x, dt, x * dt, float(tokens_now)))]
        v = (1.0, n, m, dt)
        self.p = [[d * a + vi * vj for a, vj in zip(row, v)] for row, vi in zip(self.p, v)]
        for k, e in list(self.buckets.items()):
            e[:] = [d * x for x in e]
            if e[0] < 1e-4:  # decayed away (read above 0.05): dropped, so this loop stays as long as the load's
                del self.buckets[k]
        e = self.buckets.setdefault((self.bucket(int(n)), self.bucket(int(m))), [0.0, 0.0, 0.0, 0.0])
        e[:] = [a + b for a, b in zip(e, (1.0, dt, n, m))]
        self.steps += 1
        self._spans.clear()
        self._curves.clear()
        self._plane = False

    def ready(self) -> bool:
        return self.steps >= self.min_steps

    def outlier(self, seconds: float, rows: int, requests: int) -> bool:
        """Whether a step of ``rows`` rows (``requests`` of them requests') that took ``seconds`` is over
        ``outlier_factor`` times the measured cost (a pause, a kernel built for a new row count): counted, it
        would raise every cost read from its bucket. Judged only once steps of that request bucket were
        measured, or a batch far costlier than the guess from other sizes would never be measured."""
        if not self.ready():
            return False
        rb = self.bucket(requests)
        if not any(k[0] == rb and e[0] >= 1.0 for k, e in self.buckets.items()):
            return False
        return seconds > self.outlier_factor * self.cost(rows, requests)

    def weight(self, requests: int, drafted: int) -> float:
        """The decayed count of steps measured in the bucket of ``requests`` decoding requests and ``drafted``
        drafted rows."""
        e = self.buckets.get((self.bucket(requests), self.bucket(drafted)))
        return 0.0 if e is None else e[0]

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds of the line over rows, b at least 0; None while unmeasured or degenerate."""
        w, sx, sxx, sy, sxy, _ = self.s
        if not self.ready():
            return None
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(1.0, w * sxx):
            return None  # every step verified the same number of rows: no slope to read
        b = (w * sxy - sx * sy) / var
        a = (sy - b * sx) / w
        return float(a), float(max(b, 0.0))

    def plane(self) -> tuple[float, float, float] | None:
        """(a, b_req, b_row) in seconds, slopes at least 0; None while unmeasured, or while the steps do not
        vary in both requests and drafted rows."""
        if self._plane is False:
            beta = solve_normal3(self.p, max_cond=1e6) if self.ready() else None
            self._plane = None if beta is None else (float(beta[0]), float(max(beta[1], 0.0)), float(max(beta[2], 0.0)))
        return self._plane

    def curve(self, requests: int | None = None) -> list[tuple[float, float]]:
        """``[(x, seconds), ...]`` by x, made non-decreasing by :func:`pool_non_decreasing` (weighted by the
        buckets' decayed steps): x is drafted rows at ``requests`` requests, read from that request bucket's
        buckets (every bucket's while it has none), each moved to ``requests`` along the request slope; while
        ``requests`` is None, x is rows and every bucket is read."""
        if requests in self._curves:
            return self._curves[requests]
        live = [(k, e) for k, e in self.buckets.items() if e[0] > 0.05]
        if requests is None:
            pts = [((e[2] + e[3]) / e[0], e[1] / e[0], e[0]) for _, e in live]
        else:
            own = [(k, e) for k, e in live if k[0] == self.bucket(requests)] or live
            b_req = self._slopes(requests)[0] or 0.0
            pts = [(e[3] / e[0], e[1] / e[0] + b_req * (requests - e[2] / e[0]), e[0]) for _, e in own]
        self._curves[requests] = curve = pool_non_decreasing(sorted(pts))
        return curve

    def costs(self, lo: int, hi: int, requests: int | None = None) -> list[float]:
        """``[cost(rows, requests) for rows in lo..hi]`` (call once :meth:`ready`), kept until the next step per
        ``requests`` over the span asked for so far (a call to ``propose`` reads one batch size several times)."""
        span = self._spans.get(requests)
        if span is None or lo < span[0] or hi >= span[0] + len(span[1]):
            lo0, hi0 = (lo, hi) if span is None else (min(lo, span[0]), max(hi, span[0] + len(span[1]) - 1))
            span = self._spans[requests] = (lo0, self._costs(lo0, hi0, requests))
        return span[1][lo - span[0] : hi - span[0] + 1]

    def _costs(self, lo: int, hi: int, requests: int | None) -> list[float]:
        """As :meth:`costs`, worked out: the curve interpolated; past its last point along the slope (at least the
        points' chord; in proportion to the rows while no slope can be read), below its first along it too (at
        most the first point's time)."""
        xs, ys = ([float(x) for x in v] for v in zip(*self.curve(requests)))
        slope = self._slopes(requests)[1]
        if requests is not None and xs[-1] - xs[0] >= 2.0:  # past the most drafted rows measured at this batch size,
            chord = (ys[-1] - ys[0]) / (xs[-1] - xs[0])  # a row costs at least what the measured ones did on average
            slope = chord if slope is None else max(slope, chord)
        f = self.fit() if requests is None else None
        off = 0 if requests is None else requests
        out = []
        j = 0
        for rows in range(lo, hi + 1):
            q = float(rows - off)
            if q > xs[-1]:  # past the most rows measured: along the slope (in proportion to the rows without one)
                c = ys[-1] + slope * (q - xs[-1]) if slope is not None else ys[-1] * rows / max(1.0, xs[-1] + off)
            elif q < xs[0]:  # below the fewest: along the slope, at most that point's time
                if requests is None:
                    c = min(ys[0], f[0] + f[1] * rows) if f is not None else ys[0]
                else:
                    c = ys[0] - (slope or 0.0) * (xs[0] - q)
            else:  # between two measured points: linear
                while j + 1 < len(xs) and xs[j + 1] <= q:
                    j += 1
                if q == xs[j]:
                    c = ys[j]
                else:
                    c = ys[j] + (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (q - xs[j])
            out.append(max(c, 1e-9))
        return out

    def _slopes(self, requests: int | None) -> tuple[float | None, float | None]:
        """Seconds per request and per row past the measured points: the plane's (with ``requests``), else the
        line's slope for both; None where neither can be read."""
        pl = self.plane() if requests is not None else None
        if pl is not None:
            return pl[1], pl[2]
        f = self.fit()
        return (None, None) if f is None else (f[1], f[1])

    def cost(self, rows: int, requests: int | None = None) -> float:
        """Seconds of a step verifying ``rows`` rows, ``requests`` of them decoding requests' own (None: read by
        rows alone); call once :meth:`ready`."""
        return self.costs(rows, rows, requests)[0]

    def table(self) -> dict:
        """``{requests: {drafted rows: mean ms}}`` of the buckets measured, for the stats."""
        out: dict = {}
        for _, e in sorted(self.buckets.items()):
            if e[0] > 0.05:
                out.setdefault(round(e[2] / e[0], 1), {})[round(e[3] / e[0], 1)] = round(1e3 * e[1] / e[0], 2)
        return out

    def min_reach(self, default: float) -> float:
        """The reach a drafted token needs to pay in the linear view: ``b * tokens / time`` (its acceptance per
        second of its cost against the tokens per second the steps give), within [0.02, 0.95]; ``default``
        while the line cannot be read. The proposer plans with :meth:`cost` instead."""
        f = self.fit()
        if f is None:
            return default
        _, _, _, sy, _, tok = self.s
        if sy <= 0 or tok <= 0:
            return default
        return float(min(0.95, max(0.02, f[1] * tok / sy)))


def _det3(m) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def solve_normal3(p: list[list[float]], max_cond: float) -> tuple[float, float, float] | None:
    """Least squares from the normal equations ``p[:3][:3] beta = p[:3][3]`` (``p``: the decayed sums of ``v v^T``,
    ``v = (x0, x1, x2, y)``), or None where the matrix, scaled to a unit diagonal, has a condition number above
    ``max_cond``."""
    sc = [sqrt(p[i][i]) + 1e-12 for i in range(3)]
    m = [[p[i][j] / (sc[i] * sc[j]) for j in range(3)] for i in range(3)]
    y = [p[i][3] / sc[i] for i in range(3)]
    # eigenvalues of the symmetric m (closed form: Smith, CACM 1961); the condition number: largest over smallest
    q = (m[0][0] + m[1][1] + m[2][2]) / 3.0
    off = m[0][1] ** 2 + m[0][2] ** 2 + m[1][2] ** 2
    r2 = ((m[0][0] - q) ** 2 + (m[1][1] - q) ** 2 + (m[2][2] - q) ** 2 + 2.0 * off) / 6.0
    if r2 <= 0.0:  # a multiple of the identity
        lo = hi = q
    else:
        r = sqrt(r2)
        b = [[(m[i][j] - (q if i == j else 0.0)) / r for j in range(3)] for i in range(3)]
        phi = acos(min(1.0, max(-1.0, _det3(b) / 2.0))) / 3.0
        hi, lo = q + 2.0 * r * cos(phi), q + 2.0 * r * cos(phi + 2.0 * pi / 3.0)
    if lo <= 0.0 or hi > max_cond * lo:
        return None
    det = _det3(m)  # Cramer's rule: column c replaced by y
    z = [_det3([[y[i] if jj == c else m[i][jj] for jj in range(3)] for i in range(3)]) / det for c in range(3)]
    return z[0] / sc[0], z[1] / sc[1], z[2] / sc[2]


def pool_non_decreasing(points) -> list[tuple[float, float]]:
    """``[(x, y), ...]`` from ``(x, y, weight)`` points sorted by x, made non-decreasing in y: a point above the
    next is pooled with it, and points at the same x are pooled (pool-adjacent-violators; each pool at its
    weighted mean x and y)."""
    blocks: list[list[float]] = []  # [weight, weighted x, weighted y]
    for x, y, w in points:
        blocks.append([w, w * x, w * y])
        while len(blocks) > 1 and (blocks[-2][2] / blocks[-2][0] > blocks[-1][2] / blocks[-1][0]
                                   or blocks[-2][1] / blocks[-2][0] >= blocks[-1][1] / blocks[-1][0] - 1e-9):
            top = blocks.pop()
            blocks[-1] = [a + b for a, b in zip(blocks[-1], top)]
    return [(x / w, y / w) for w, x, y in blocks]
