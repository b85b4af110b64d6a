"""Where a tree pass's time goes, against transformers' own one-token step (docs/speed.md, issue 58).

For a model in float32: transformers' one-token step (``model.generate`` per token after a 200-token
prompt, as benchmarks/verifier_curve.py times it) and the verifier's chain passes of n new tokens
over a 256-token cache in the stream form, split by timing wrappers into

- the linear layers by role (attention projections, MLP, LM head): ms, the rate at which the
  weights were read (GB/s) and the arithmetic rate (GFLOP/s);
- the attention (transformers' ``sdpa`` entry, the tree mask applied);
- the cache append (the key/value layers' ``update``);
- the rest: norms, rotary embeddings, residual adds, transformers' Python per layer, the mask.

It then runs the same linear layers alone, outside the model, on the model's own weights and inputs
of the same shapes: what the kernel costs when nothing runs between its calls. Rounds interleave the step and every size;
medians are printed. The wrappers add a few microseconds a call, so the split's pass is a little
slower than the unwrapped one (both are printed).

    python benchmarks/pass_profile.py --model smollm2 --sizes 1,8,16,32 --rounds 5
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

ROLES = (("attention proj", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")))


def role_of(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    for role, leaves in ROLES:
        if leaf in leaves:
            return role
    return "lm head" if leaf in ("lm_head", "embed_out") else "other linear"


class Split:
    """Timing wrappers on the stream kernel, transformers' sdpa entry and the cache layers' update."""

    def __init__(self, model):
        import torch
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from goose.verifiers import cache as cache_mod
        from goose.verifiers import stream

        self.acc: dict = collections.defaultdict(float)
        self.role = {m.weight.data_ptr(): role_of(n) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.shapes: dict = collections.defaultdict(list)  # role -> [(out, in)] per call
        self._stream, self._sdpa, self._update = stream.linear, ALL_ATTENTION_FUNCTIONS["sdpa"], cache_mod.HeadroomLayer.update
        acc, role, shapes, orig_linear, orig_sdpa, orig_update = (
            self.acc, self.role, self.shapes, self._stream, self._sdpa, self._update)

        def linear(x, w, b=None):
            t0 = time.perf_counter()
            out = orig_linear(x, w, b)
            r = role.get(w.data_ptr(), "other linear")
            acc[r] += time.perf_counter() - t0
            shapes[r].append((x.shape[0], w))
            return out

        def sdpa(*a, **k):
            t0 = time.perf_counter()
            out = orig_sdpa(*a, **k)
            acc["attention"] += time.perf_counter() - t0
            return out

        def update(self_, *a, **k):
            t0 = time.perf_counter()
            out = orig_update(self_, *a, **k)
            acc["cache append"] += time.perf_counter() - t0
            return out

        stream.linear, ALL_ATTENTION_FUNCTIONS["sdpa"], cache_mod.HeadroomLayer.update = linear, sdpa, update
        self._mods = (stream, ALL_ATTENTION_FUNCTIONS, cache_mod)

    def close(self) -> None:
        stream, table, cache_mod = self._mods
        stream.linear, table["sdpa"], cache_mod.HeadroomLayer.update = self._stream, self._sdpa, self._update


def alone(calls, reps: int = 3) -> float:
    """Seconds of the given (rows, weight) stream-kernel calls run back to back on the model's own weights,
    outside the model (best of reps): the linear layers with nothing between them."""
    import torch

    from goose.verifiers import stream

    g = torch.Generator().manual_seed(0)
    xs = {(rows, w.shape[1]): torch.randn(rows, w.shape[1], generator=g) for rows, w in calls}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(reps):
            t0 = time.perf_counter()
            for rows, w in calls:
                stream.linear(xs[(rows, w.shape[1])], w)
            best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,8,16,32")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import goose
    from goose.verifiers import machine
    from goose.verifiers.latency import _Timer
    from goose.tools import models
    from goose.verifiers import stream

    model, tok = models.load(args.model, "float32")
    sizes = [int(s) for s in args.sizes.split(",")]
    # the built-in verifier as a default decoder composes it, timed through its speed protocol (time_pass)
    verifier = goose.compose(model, tok, sources=[], policy="none", budget=1).verifier
    timer = _Timer(verifier, 256, 60.0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, verifier.vocab_size, (1, 200), generator=g)

    def hf_step() -> float:
        def gen(n):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, pad_token_id=0)
            return time.perf_counter() - t0
        return (gen(33) - gen(1)) / 32

    for n in sizes:
        timer.once(n, "stream")
    hf_step()
    plain: dict = collections.defaultdict(list)
    parts: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    calls: dict = {}
    for r in range(args.rounds):
        plain["step"].append(hf_step())
        for n in sizes:
            plain[n].append(timer.once(n, "stream"))
            split = Split(model)
            try:
                total = timer.once(n, "stream")
            finally:
                split.close()
            for k, v in split.acc.items():
                parts[n][k].append(v)
            parts[n]["pass (wrapped)"].append(total)
            calls[n] = {k: list(v) for k, v in split.shapes.items()}
        for n in sizes:
            parts[n]["linear layers alone"].append(alone([c for cs in calls[n].values() for c in cs], 1))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    verifier.end()

    med = lambda xs: statistics.median(xs)  # noqa: E731
    step = med(plain["step"])
    print(f"\nCPU: {machine.describe()}; {args.threads} threads; {args.model} float32; stream kernel vector width: "
          f"{stream.vector_width()}")
    print(f"transformers' one-token step: {1000 * step:.1f} ms (median of {args.rounds})\n")
    lin_roles = ["attention proj", "mlp", "lm head", "other linear"]
    cols = ["pass", "x step"] + lin_roles + ["attention", "cache append", "rest", "linear alone"]
    print("| n | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for n in sizes:
        p = parts[n]
        wrapped = med(p["pass (wrapped)"])
        known = sum(med(p[k]) for k in lin_roles + ["attention", "cache append"] if k in p)
        cells = [f"{1000 * med(plain[n]):.1f}", f"{med(plain[n]) / step:.2f}"]
        cells += [f"{1000 * med(p[k]):.1f}" if k in p else "-" for k in lin_roles]
        cells += [f"{1000 * med(p['attention']):.1f}" if "attention" in p else "-",
                  f"{1000 * med(p['cache append']):.1f}" if "cache append" in p else "-",
                  f"{1000 * (wrapped - known):.1f}", f"{1000 * med(p['linear layers alone']):.1f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("\nlinear layers in the pass: weights read (GB/s) and arithmetic (GFLOP/s)")
    for n in sizes:
        line = []
        for k, cs in calls[n].items():
            t = med(parts[n][k])
            nbytes = sum(w.numel() * w.element_size() for _, w in cs)
            flops = sum(2 * r * w.numel() for r, w in cs)
            line.append(f"{k} {nbytes / t / 1e9:.1f} GB/s, {flops / t / 1e9:.0f} GFLOP/s")
        print(f"n={n}: " + "; ".join(line))


if __name__ == "__main__":
    main()
