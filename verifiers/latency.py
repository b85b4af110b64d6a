"""A verifier's pass time against tree size, measured through its speed protocol (``time_pass`` in each of its
``pass_forms``), cached under the model, machine, threads and ``timing_key``, checked once per process
(docs/speed.md, "Calibration"). The ``fit`` policy weighs expected accepted tokens against it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from goose.verifiers import machine

# Every size up to 64 (kernels change with the row count), then coarser; beyond the last, in proportion.
SIZES = (*range(1, 25), 28, 32, 40, 48, 56, 64, 80, 96, 128)
FULL_SIZES, FULL_ROUNDS = (*range(1, 65), 80, 96, 128), 5  # goose calibrate --full
# sizes at which every pass form is timed; a size between takes the nearest one's form (forms switch once)
COMPARE = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
# past the walk's end, timed once each in this order while the budget allows (the widest span first)
ANCHORS = (32, 64, 16, 8, 24, 48, 12, 128, 96, 80)
WALK_SHARE = 0.6  # of the time budget, for the walk over SIZES; the rest for the anchors
CURVE_VERSION = 17  # bump when the measuring method or a kernel it times changes: cached curves are measured anew
# A cached curve is checked once per process at these sizes: machines with one CPU name differ in speed and
# fastest form, and a curve measured under load misleads the fit.
CHECK_SIZES = (1, 4)
CHECK_TOLERANCE = 1.3  # now / cached beyond this factor, either way: measured anew
_checked: set[str] = set()  # cache files checked (or measured) in this process
# One lock per cache file: threads needing the same curve wait for the one checking or measuring it (two
# measurements at once would time each other's load); across processes the file is written atomically.
_path_locks: dict[str, threading.Lock] = {}
_path_locks_lock = threading.Lock()
# cache file -> a curve this process measured and did not store, used in place of the file
_process_curves: dict[str, "LatencyCurve"] = {}

log = logging.getLogger("goose")


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per forward at measured tree sizes; linear in between, flat below, in proportion past the last."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    # (rows, seconds) of the LM head alone on that many rows: what the prefill's extra logit rows cost
    head: tuple[tuple[int, float], ...] = ()
    # ((form, sizes), ...): the sizes whose pass runs in each of the verifier's pass_forms (others: its default)
    forms: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def __call__(self, n: int) -> float:
        s, t = self.sizes, self.seconds
        return t[-1] * n / s[-1] if n > s[-1] else _interp(s, t, n)

    def table(self, n_max: int) -> list[float]:
        """``[t(0)=0, t(1), ..., t(n_max)]`` for fast lookups."""
        return [0.0] + [self(n) for n in range(1, n_max + 1)]

    def _head_run(self, k: int) -> tuple[int, float]:
        """(rows run, seconds) for ``k`` wanted rows within the measured range: ``k`` (its time interpolated), or
        the measured count above ``k`` that took least, where it took less."""
        h = self.head
        t = _interp([r for r, _ in h], [s for _, s in h], k)
        return min([(k, t), *((r, s) for r, s in h if r > k)], key=lambda run: run[1])  # the first of equals

    def head_rows(self, k: int) -> int:
        """How many rows the LM head should compute to give ``k``: a measured count above ``k`` that took less (a
        GEMM may take a faster path from some row count on; the extra rows are padding), else ``k``."""
        return k if not self.head or k >= self.head[-1][0] else self._head_run(k)[0]

    def head_rows_within(self, extra_s: float) -> int | None:
        """The most LM-head rows whose cost over one row stays within ``extra_s`` (None: not measured); past the
        last measured count, at the last interval's cost per row."""
        h = self.head
        if len(h) < 2:
            return None
        limit = h[0][1] + extra_s
        (ra, ta), (rb, tb) = h[-2], h[-1]
        if tb > limit:
            return next((k for k in range(rb - 1, 0, -1) if self._head_run(k)[1] <= limit), 1)
        per_row = (tb - ta) / (rb - ra)
        if per_row <= 0:  # rows free at the end of the measured range
            return 1 << 30
        return max(rb, int(rb + (limit - tb) / per_row + 1e-9))  # 1e-9: float rounding of whole rows

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds), "head": [list(x) for x in self.head],
                "forms": {f: list(ns) for f, ns in self.forms}}

    @classmethod
    def from_dict(cls, d: dict) -> LatencyCurve:
        head = tuple((int(r), float(t)) for r, t in d.get("head", ()))
        forms = tuple((str(f), tuple(int(n) for n in ns)) for f, ns in d.get("forms", {}).items())
        return cls(tuple(d["sizes"]), tuple(d["seconds"]), head, forms)

    def sizes_in(self, form: str) -> tuple[int, ...]:
        """The sizes whose pass runs in ``form``."""
        return next((ns for f, ns in self.forms if f == form), ())

    def form(self, n: int) -> str | None:
        """The form a pass of n nodes runs in (None: the verifier's default)."""
        return next((f for f, ns in self.forms if n in ns), None)


def _interp(xs, ys, x) -> float:
    """``ys`` at ``x``, linear between the sorted ``xs``; ``ys[0]`` at or below ``xs[0]``; ``x`` at most ``xs[-1]``."""
    i = bisect_left(xs, x)
    if i == 0 or xs[i] == x:
        return ys[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def _between_anchors(timed: dict[int, str | None], last: int, upto: int) -> dict[int, str]:
    """The untimed sizes past ``last`` (the walk's end) up to ``upto`` whose timed neighbours share a form other
    than the default: the curve prices them between those two, so they must run in that form."""
    out = {}
    pts = sorted(n for n in timed if n >= last)
    for a, b in zip(pts, pts[1:]):
        if timed[a] is not None and timed[a] == timed[b]:
            out.update({n: timed[a] for n in range(a + 1, min(b, upto + 1))})
    return out


def first_param(model):
    """The model's first parameter (None: it has none)."""
    try:
        return next(model.parameters())
    except (StopIteration, AttributeError):
        return None


def _key(model, verifier) -> str:
    import torch

    cfg = getattr(model, "config", None)
    p = first_param(model)
    dtype, device = (str(p.dtype), str(p.device)) if p is not None else ("?", "cpu")
    dispatched = getattr(model, "hf_device_map", None) or {}  # accelerate's: layers on other devices or disk
    desc = json.dumps({
        "model": getattr(cfg, "_name_or_path", "") or type(model).__name__, "arch": getattr(cfg, "model_type", ""),
        "hidden": getattr(cfg, "hidden_size", 0), "layers": getattr(cfg, "num_hidden_layers", 0),
        "vocab": getattr(cfg, "vocab_size", 0), "attn": getattr(cfg, "_attn_implementation", ""),
        "dtype": dtype, "device": device, "threads": torch.get_num_threads(),
        "cpu": machine.cpu(), "kernels": machine.kernels(), "torch": torch.__version__, "curve": CURVE_VERSION,
        "verifier": verifier.timing_key(),
        "dispatch": sorted({str(v) for v in dispatched.values()}), "dispatched_modules": len(dispatched),
    }, sort_keys=True)
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("GOOSE_CACHE", Path.home() / ".cache" / "goose")) / "latency"


class _Timer:
    """Passes of n chain tokens timed by ``time_pass`` over a cache of up to ``past_len`` prompt tokens (fewer
    where that prefill alone would spend a fifth of ``budget_s``)."""

    def __init__(self, verifier, past_len: int, budget_s: float):
        import torch

        self.v = v = verifier
        self.g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, v.vocab_size, (past_len,), generator=self.g)
        probe = min(32, past_len)
        t0 = time.perf_counter()
        v.prefill(prompt[:probe], keep=1)
        per_token = (time.perf_counter() - t0) / probe
        past = min(past_len, int(0.2 * budget_s / max(per_token, 1e-9)))
        if past > probe:
            v.prefill(prompt[:past], keep=1)  # a fresh cache
        self.trees: dict = {}

    def once(self, n: int, form: str | None = None) -> float:
        import torch

        from goose.tree import DraftTree

        v, tree = self.v, self.trees.get(n)
        if tree is None:
            toks = torch.randint(0, v.vocab_size, (n,), generator=self.g).tolist()
            tree = self.trees[n] = DraftTree.from_chain(toks[0], toks[1:], "x")
        return v.time_pass(tree, form)


def measure(model, verifier, sizes=SIZES, past_len: int = 256, repeats: int = 3, budget_s: float = 25.0,
            stop_ratio: float = 12.0, progress=None, compare_forms: bool = True,
            measure_head: bool = True) -> LatencyCurve:
    """Median forward time of a chain of n new tokens over a ``past_len`` cache, for each n in ``sizes``
    (docs/speed.md, "Calibration": the walk, the anchors, up to ``repeats`` rounds within ``budget_s``). With
    ``compare_forms`` each size runs in its fastest pass form (the curve's ``forms``, told to the verifier through
    ``forms_kept``); with ``measure_head`` the LM head alone is timed too. ``progress(text)`` is called as it goes.
    """
    t_start = time.perf_counter()
    timer = _Timer(verifier, past_len, budget_s)
    v = verifier
    sizes = sorted(set(int(n) for n in sizes))
    forms = list(v.pass_forms()) if compare_forms else []
    max_rows = max((n for n in range(1, sizes[-1] + 1) if any(v.form_serves(f, n) for f in forms)), default=0)
    w = _Walk(timer.once, forms, max_rows, progress or (lambda text: None), t_start, budget_s, stop_ratio,
              v.form_serves)
    w.warm_up(min(8, sizes[-1]))
    last = w.walk(sizes)  # the size round 1 stopped at for the time budget (None: it did not)
    if last is not None:
        w.anchors(last, sizes[-1])
    kept = sorted(w.times)
    w.rounds(kept, repeats)
    med = [statistics.median(w.times[n]) for n in kept]
    head = _measure_head(model, med[0], w.say, t_start, timer.g) if measure_head else ()
    v.end()
    form = w.form
    filled = _between_anchors(form, last, max_rows) if last is not None else {}
    every = {**filled, **{n: form[n] for n in kept}}  # sizes between anchors run in the anchors' form
    used = sorted({f for f in every.values() if f is not None})
    v.forms_kept(frozenset(used))
    return LatencyCurve(tuple(kept), tuple(med), head, tuple((f, tuple(n for n in sorted(every) if every[n] == f))
                                                             for f in used))


class _Walk:
    """The timings of one :func:`measure` call. ``times``: size -> seconds of each round; ``form``: size -> its
    fastest form (None: "stock", the verifier's default); ``t1``: the one-token forward, the unit of
    ``stop_ratio``. A timing that decides much is taken twice and the lower kept: one stall must not shape it."""

    def __init__(self, once, forms: list[str], max_rows: int, say, t_start: float, budget_s: float,
                 stop_ratio: float, serves):
        self.once, self.forms, self.say, self.serves = once, forms, say, serves
        self.compared = [c for c in COMPARE if c <= max_rows]  # sizes at which every form is timed
        self.max_rows = max_rows  # the largest tree a form other than stock runs
        self.t_start, self.budget_s, self.stop_ratio = t_start, budget_s, stop_ratio
        self.times: dict[int, list[float]] = {}
        self.form: dict[int, str | None] = {}
        self.stock_compared = True  # False: stock was far slower than a form at the warm-up's size
        self.t1 = 0.0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def nearest(self, n: int) -> str | None:
        """The form of the compared size nearest ``n`` (the smaller of two as near); None: stock."""
        if n == 1:  # one row: the form timed there (only forms that serve one row are)
            return self.form.get(1)
        known = [c for c in self.compared if c in self.form and c > 1]
        if not self.forms or not known or not (2 <= n <= self.max_rows):
            return None
        return self.form[min(known, key=lambda c: (abs(c - n), c))]

    def again_over(self, dt: float, limit: float, n: int, f: str | None) -> float:
        """``dt``, or the lower of it and a second timing where it is over ``limit``."""
        return min(dt, self.once(n, f)) if dt > limit else dt

    def warm_up(self, mid: int) -> None:
        """Untimed first forwards (a process's first are slow); then each form (stock included) that two timings
        put over 1.5x the fastest at the mid size is dropped from the comparisons."""
        for n in (1, 1, 1):
            self.once(n)
        stock_mid = self.once(mid)
        if mid >= 2:
            mids: dict[str | None, float] = {None: stock_mid}
            for f in self.forms:
                if not self.serves(f, mid):  # compared only where it serves; kept for the sizes it does
                    continue
                self.once(mid, f)  # untimed: a form's first pass (packing the weights, loading compiled code)
                mids[f] = self.once(mid, f)
            best = min(mids.values())
            for f, dt in mids.items():
                if self.again_over(dt, 1.5 * best, mid, f) > 1.5 * best:
                    if f is None:
                        self.stock_compared = False
                    else:
                        self.forms.remove(f)

    def fastest(self, n: int, serve: list[str]) -> tuple[str | None, float]:
        """The fastest of stock (where still compared) and the ``serve`` forms at ``n`` rows: each timed once,
        the two fastest once more, the lower of each kept."""
        timed = {f: self.once(n, f) for f in ([None] if self.stock_compared or not serve or n == 1 else []) + serve}
        for f in sorted(timed, key=timed.get)[:2] if len(timed) > 1 else ():
            timed[f] = min(timed[f], self.once(n, f))
        f = min(timed, key=timed.get)
        return f, timed[f]

    def walk(self, sizes: list[int]) -> int | None:
        """Round 1: each size upward, in its fastest form (else the nearest compared size's), until a forward
        costs ``stop_ratio`` x t(1) (returns None) or, past size 4, the walk's share of the budget is spent
        (returns the size it stopped at)."""
        self.t1 = t1 = min(self.once(1) for _ in range(3))
        for n in sizes:
            if self.forms and n in self.compared:
                serve = [f for f in self.forms if self.serves(f, n)]
                self.form[n], dt = self.fastest(n, serve)
                if n == 1:  # a tree's price is in units of the one-token step as the verifier will run it
                    self.t1 = t1 = min(dt, t1) if self.form[1] is None else dt
            else:
                self.form[n] = self.nearest(n)
                dt = self.once(n, self.form[n])
            if n > 1:
                dt = self.again_over(dt, self.stop_ratio * t1, n, self.form[n])
            self.times[n] = [dt]
            f = self.form[n]
            self.say(f"size {n}: {1000 * dt:.1f} ms{f' ({f})' if f else ''} ({self.elapsed():.1f} s)")
            if n > 1 and dt > self.stop_ratio * t1:
                return None
            if n >= 4 and self.elapsed() + dt > WALK_SHARE * self.budget_s:  # the next size costs at least dt
                return n
        return None

    def anchors(self, last: int, top: int) -> None:
        """The :data:`ANCHORS` past ``last`` up to ``top``, once each where the rest of the budget allows (the
        curve then interpolates instead of extending in proportion); each timed again where over 1.5x its guess."""
        t1 = self.t1
        cap = top + 1  # anchors at or above it are skipped: one over stop_ratio x t(1) lowers it
        for a in (a for a in ANCHORS if last < a <= top):
            if a >= cap:
                continue
            # whether it fits: its time guessed on the line through t(1) and the largest size timed so far
            prev = max(self.times)
            guess = self.times[prev][0] + (a - prev) * max(0.0, self.times[prev][0] - t1) / (prev - 1)
            if self.elapsed() + guess > self.budget_s:
                continue  # a smaller anchor after it may still fit
            self.form[a] = self.nearest(a)
            self.times[a] = [self.again_over(self.once(a, self.form[a]), 1.5 * guess, a, self.form[a])]
            self.say(f"size {a}: {1000 * self.times[a][0]:.1f} ms ({self.elapsed():.1f} s)")
            if self.times[a][0] > self.stop_ratio * t1:  # no tree that large pays: nor does a larger anchor
                cap = a
        timed = sorted(a for a in ANCHORS if a > last and a in self.times)
        self.say(f"time budget reached at size {last}" + (f", then sizes {', '.join(map(str, timed))}" if timed else "")
                 + ": sizes between are interpolated, larger ones extended in proportion")

    def rounds(self, kept: list[int], repeats: int) -> None:
        """Rounds 2 to ``repeats`` over the ``kept`` sizes, each in its form, while the budget allows a whole round."""
        for r in range(1, repeats):
            if self.elapsed() + sum(self.times[n][0] for n in kept) > self.budget_s:
                break
            for n in kept:
                self.times[n].append(self.once(n, self.form[n]))
            self.say(f"round {r + 1}/{repeats} ({self.elapsed():.1f} s)")


def check(verifier, curve: LatencyCurve, tolerance: float = CHECK_TOLERANCE, sizes=CHECK_SIZES, past_len: int = 256,
          budget_s: float = 25.0) -> list[tuple[int, float, float]]:
    """``(n, cached seconds, seconds now)`` for each of ``sizes`` off by more than ``tolerance`` either way on
    this machine (empty: the curve holds); each the median of three passes in its form after an untimed one."""
    timer = _Timer(verifier, past_len, budget_s)
    off = []
    try:
        for n in sizes:
            form = curve.form(n)
            timer.once(n, form)
            now = statistics.median(timer.once(n, form) for _ in range(3))
            then = curve(n)
            if not (then / tolerance <= now <= then * tolerance):
                off.append((n, then, now))
    finally:
        timer.v.end()
    return off


HEAD_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _measure_head(model, t1: float, say, t_start: float, g) -> tuple[tuple[int, float], ...]:
    """Seconds of the LM head alone on ``HEAD_ROWS`` rows, until the extra rows cost over one forward (``t1``) at
    two counts in a row (a GEMM path slow at one count may be fast at the next). ``g`` seeds the inputs without
    moving torch's global generator (calibration may run inside a seeded generate)."""
    import torch

    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    weight = getattr(head, "weight", None)
    if head is None or weight is None or weight.dim() != 2 or weight.device.type == "meta":
        return ()
    hidden = weight.shape[1]
    out = []
    with torch.inference_mode():
        for r in HEAD_ROWS:
            x = torch.randn(1, r, hidden, generator=g).to(dtype=weight.dtype, device=weight.device)
            head(x)  # untimed: the first call of a shape
            ts = []
            for _ in range(2):
                t0 = time.perf_counter()
                head(x)
                ts.append(time.perf_counter() - t0)
            out.append((r, min(ts)))
            if len(out) > 2 and out[-1][1] - out[0][1] > t1 and out[-2][1] - out[0][1] > t1:
                break
    say(f"LM head: {1000 * out[0][1]:.1f} ms for 1 row, {1000 * out[-1][1]:.1f} ms for {out[-1][0]} "
        f"({time.perf_counter() - t_start:.1f} s)")
    return tuple(out)


def _progress_printer(label: str):
    """A progress line on stderr (rewritten in place on a terminal) and in the ``goose`` log."""
    tty = sys.stderr.isatty()

    def say(text: str) -> None:
        line = f"goose: measuring forward latency for {label}: {text}"
        log.info(line)
        if tty:
            sys.stderr.write("\r" + line[:118].ljust(118))
            sys.stderr.flush()

    def done(text: str) -> None:
        _line(f"goose: forward latency for {label} {text}", "\r" if tty else "", 118 if tty else 0)

    return say, done


def describe(model) -> str:
    """The model's name, dtype and device, for progress lines."""
    cfg = getattr(model, "config", None)
    name = getattr(cfg, "_name_or_path", "") or type(model).__name__
    p = first_param(model)
    if p is None:
        return str(name)
    return f"{Path(str(name)).name or name} ({str(p.dtype).replace('torch.', '')}, {p.device})"


def curve_path(model, verifier) -> Path:
    return cache_dir() / f"{_key(model, verifier)}.json"


def cached_curve(model, verifier) -> LatencyCurve | None:
    """The curve this process uses for ``verifier`` (bound to ``model``): one it measured and did not store, else
    the stored one, or None (never measures)."""
    path = curve_path(model, verifier)
    mine = _process_curves.get(str(path))
    if mine is not None:
        return mine
    try:
        return LatencyCurve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):  # none stored, or unreadable
        return None


def curve_for(model, verifier, use_cache: bool = True, force: bool = False, check_cached: bool = True,
              **measure_kw) -> LatencyCurve:
    """The latency curve of ``verifier`` (bound to ``model``) on this machine and thread count, measured on first
    use (a progress line on stderr and in the ``goose`` log) and cached under its ``timing_key``. With
    ``check_cached``, a cached curve is checked once per process (:func:`check`) and measured anew where it is
    off; the new curve replaces it only where the cached one still disagrees and the new one holds.
    """
    path = curve_path(model, verifier)
    with _path_locks_lock:
        lock = _path_locks.setdefault(str(path), threading.Lock())
    with lock:
        return _curve_at(model, verifier, path, use_cache, force, check_cached, measure_kw)


def _curve_at(model, verifier, path: Path, use_cache: bool, force: bool, check_cached: bool,
              measure_kw: dict) -> LatencyCurve:
    import torch

    where = str(path)
    check_kw = {"past_len": measure_kw.get("past_len", 256), "budget_s": min(25.0, measure_kw.get("budget_s", 25.0))}
    stored = None
    if use_cache and not force:
        if where in _process_curves:
            return _process_curves[where]
        stored = cached_curve(model, verifier)
        if stored is not None:
            if not check_cached or where in _checked:
                return stored
            off = check(verifier, stored, **check_kw)
            if not off:
                _checked.add(where)
                return stored
            _line(f"goose: a check of the cached forward latency curve for {describe(model)} disagrees ({_offs(off)}; "
                  f"{path}): measuring it anew, then checking the cached one again before replacing it")
    _checked.add(where)
    threads = torch.get_num_threads()
    say, done = _progress_printer(describe(model))
    t0 = time.perf_counter()
    curve = measure(model, verifier, progress=say, **measure_kw)
    done(f"measured in {time.perf_counter() - t0:.1f} s: t(1) = {1000 * curve(1):.1f} ms, "
         f"t(16) = {1000 * curve(16):.1f} ms, sizes 1-{curve.sizes[-1]}"
         + "".join(f"; {f} fastest at {len(ns)} sizes" for f, ns in curve.forms)
         + ("; the default form everywhere" if not curve.forms else ""))
    if not use_cache:
        return curve
    if torch.get_num_threads() != threads:  # the curve's key says `threads`: it was not all measured with them
        _line(f"goose: torch's thread count changed from {threads} to {torch.get_num_threads()} while the curve was "
              f"measured; this process uses it, and it is not stored ({path})")
        _process_curves[where] = curve
        return curve
    if stored is not None:  # the stored curve disagreed: only a disagreement that lasts replaces it
        again = check(verifier, stored, **check_kw)
        if not again:
            _line(f"goose: the cached forward latency curve for {describe(model)} holds again: the disagreement was "
                  f"passing (the machine was busy); keeping it, the new measurement is not stored ({path})")
            return stored
        new_off = check(verifier, curve, **check_kw)
        if new_off:
            _line(f"goose: neither the cached forward latency curve for {describe(model)} ({_offs(again)}) nor the one "
                  f"just measured ({_offs(new_off)}) holds now; this process uses the new one and the cached one "
                  f"stays ({path})")
            _process_curves[where] = curve
            return curve
        _line(f"goose: the cached forward latency curve for {describe(model)} still disagrees ({_offs(again)}) and "
              f"the one just measured holds: stored in its place ({path})")
    write_atomic(path, json.dumps(curve.to_dict()))
    log.info(f"goose: forward latency curve cached in {path}")
    return curve


def _offs(off: list[tuple[int, float, float]]) -> str:
    return ", ".join(f"t({n}) {1000 * a:.1f} ms cached, {1000 * b:.1f} ms now" for n, a, b in off)


def _line(text: str, prefix: str = "", width: int = 0) -> None:
    """A line on stderr (after ``prefix``, padded to ``width``) and in the ``goose`` log."""
    log.info(text)
    sys.stderr.write(prefix + text.ljust(width) + "\n")
    sys.stderr.flush()


def write_atomic(path: Path, text: str) -> None:
    """``path`` holds ``text`` or what it held before, whoever reads it meanwhile (a temporary file renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # as an ordinary write leaves it (mkstemp makes the file private)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
