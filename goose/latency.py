"""Forward latency against tree size, measured once per (model, dtype, device, threads) and cached.

Verifying a tree costs one forward whose time grows with the number of nodes, differently per
device and dtype (on these CPUs a bfloat16 forward over 16 tokens costs about one token's; in
float32 2-3x more). The ``fit`` policy weighs expected accepted tokens against this curve.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 100, 128)


@dataclass(frozen=True)
class LatencyCurve:
    """Seconds per forward at measured tree sizes; piecewise-linear in between, flat-extended."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __call__(self, n: int) -> float:
        s, t = self.sizes, self.seconds
        if n <= s[0]:
            return t[0]
        if n >= s[-1]:
            return t[-1] * n / s[-1] if n > s[-1] else t[-1]
        i = bisect_left(s, n)
        if s[i] == n:
            return t[i]
        a, b = s[i - 1], s[i]
        return t[i - 1] + (t[i] - t[i - 1]) * (n - a) / (b - a)

    def table(self, n_max: int) -> list[float]:
        """``[t(0)=0, t(1), ..., t(n_max)]`` for fast lookups."""
        return [0.0] + [self(n) for n in range(1, n_max + 1)]

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}


def _key(model) -> str:
    import torch

    cfg = getattr(model, "config", None)
    try:
        p = next(model.parameters())
        dtype, device = str(p.dtype), str(p.device)
    except (StopIteration, AttributeError):
        dtype, device = "?", "cpu"
    desc = json.dumps(
        {
            "model": getattr(cfg, "_name_or_path", "") or type(model).__name__,
            "arch": getattr(cfg, "model_type", ""),
            "hidden": getattr(cfg, "hidden_size", 0),
            "layers": getattr(cfg, "num_hidden_layers", 0),
            "vocab": getattr(cfg, "vocab_size", 0),
            "attn": getattr(cfg, "_attn_implementation", ""),
            "dtype": dtype,
            "device": device,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("GOOSE_CACHE", Path.home() / ".cache" / "goose")) / "latency"


def measure(model, sizes=SIZES, past_len: int = 256, repeats: int = 5) -> LatencyCurve:
    """Median forward time of a chain of n new tokens over a ``past_len`` cache, for each n.

    The first forwards of a process are slow (kernels are prepared per shape), so every size is
    run once untimed first; then ``repeats`` rounds time every size in turn (drift hits all sizes
    alike) and the median is kept. A forward over fewer tokens never costs more, so a noisy
    small size is capped by the larger sizes' times (a running minimum from the right).
    """
    import torch

    from goose.tree import DraftTree
    from goose.verifiers.greedy import GreedyTreeVerifier

    v = GreedyTreeVerifier()
    v.bind(model)
    vocab = v.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (past_len,), generator=g)
    v.prefill(prompt)
    trees = {}
    for n in sizes:
        toks = torch.randint(0, vocab, (n,), generator=g).tolist()
        trees[n] = DraftTree.from_chain(toks[0], toks[1:], "x")

    def once(n: int) -> float:
        tree = trees[n]
        mask = tree.attention_mask(v.past_len, dtype=v.dtype, device=v.device) if n > 1 else None
        pos = tree.position_ids(v.past_len, device=v.device)
        ids = torch.tensor([tree.tokens], device=v.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            v._forward(ids, mask, pos)
        dt = time.perf_counter() - t0
        v.cache.crop(-n)
        return dt

    for n in sizes:  # warm-up: prepare every shape once
        once(n)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            times[n].append(once(n))
    v.end()
    med = [statistics.median(times[n]) for n in sizes]
    for i in range(len(med) - 2, -1, -1):
        med[i] = min(med[i], med[i + 1])
    return LatencyCurve(tuple(sizes), tuple(med))


def curve_for(model, use_cache: bool = True) -> LatencyCurve:
    """The cached curve for this (model, dtype, device, threads), measured on first use."""
    path = cache_dir() / f"{_key(model)}.json"
    if use_cache and path.exists():
        d = json.loads(path.read_text())
        return LatencyCurve(tuple(d["sizes"]), tuple(d["seconds"]))
    curve = measure(model)
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(curve.to_dict()))
    return curve
