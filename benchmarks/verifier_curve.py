"""The verifier's passes against transformers' own one-token step, interleaved (docs/speed.md, issue 40).

For a model: transformers' one-token step (``model.generate`` per token after a ~200-token prompt:
the time of 33 new tokens less that of 1, over 32) and the passes ``goose calibrate`` times (a chain
of n new tokens over a 256-token cache, through the verifier, its mask and position ids) in each
linear-layer form: stock ``F.linear``, ``weight @ x.T`` and the stream kernel. Every round times all
of them in turn; the medians over rounds are printed as milliseconds and as ratios to the step.

    python benchmarks/verifier_curve.py --model smollm2 --sizes 1,2,4,8,16,32 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--forms", default="stock,skinny,stream")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import goose
    from goose.verifiers import machine
    from goose.verifiers.latency import _Timer
    from goose.tools import models

    model, tok = models.load(args.model, "float32")
    sizes = [int(s) for s in args.sizes.split(",")]
    forms = [None if f == "stock" else f for f in args.forms.split(",")]
    # the built-in verifier as a default decoder composes it, timed through its speed protocol (time_pass)
    verifier = goose.compose(model, tok, sources=[], policy="none", budget=1).verifier
    timer = _Timer(verifier, 256, 60.0)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, verifier.vocab_size, (1, 200), generator=g)
    mask = torch.ones_like(prompt)

    def hf_step() -> float:
        def gen(n):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)
            return time.perf_counter() - t0
        return (gen(33) - gen(1)) / 32

    for n in sizes:  # untimed: the first pass of each shape and form (compiling, allocating)
        for f in forms:
            if n > 1 or f in (None, "stream"):
                timer.once(n, f)
    hf_step()
    times: dict = {"hf_step": []}
    for r in range(args.rounds):
        times["hf_step"].append(hf_step())
        for n in sizes:
            for f in forms:
                if n > 1 or f in (None, "stream"):
                    times.setdefault(f"{f or 'stock'}@{n}", []).append(timer.once(n, f))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    verifier.end()
    med = {k: statistics.median(v) for k, v in times.items()}
    step = med["hf_step"]
    print(f"CPU: {machine.describe()}; {args.threads} threads; {args.model} float32")
    print(f"transformers' one-token step: {1000 * step:.1f} ms (median of {args.rounds})")
    names = [f or "stock" for f in forms]
    print("| n | " + " | ".join(f"{f} ms (x step)" for f in names) + " |")
    print("|---|" + "---|" * len(names))
    for n in sizes:
        cells = []
        for f in names:
            k = f"{f}@{n}"
            cells.append(f"{1000 * med[k]:.1f} ({med[k] / step:.2f}x)" if k in med else "-")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": machine.describe(), "model": args.model, "threads": args.threads, "medians_s": med,
                       "rounds": times}, fh, indent=1)


if __name__ == "__main__":
    main()
