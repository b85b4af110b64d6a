"""What the loop's check of a verifier's report costs per step, on a real model.

    python benchmarks/report_check.py --threads 2

After every pass the loop checks what the verifier reported against the tree it sent (goose/decoding.py,
``_check_report``: the path a root-to-node walk, the accepted tokens the walk's, in a greedy request each the
argmax of its parent's row) and the prefill's first token (``_check_first``). The loop times both apart from
the verification and reports the seconds as ``stats.time_s["check"]``. This decodes the demo prompts with
``pld`` + ``tr`` under ``spine`` (greedy; with ``--sample`` also sampled at temperature 0.7) and prints, per
prompt and in all, the check's time per step (every check's time, the prefill's included, over the steps), the
time of a step (the generation's time less the prefill's forward, over the steps) and the first as a
percentage of the second.
"""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=None, help="the first N demo prompts (default: all)")
    ap.add_argument("--sources", default="pld,tr")
    ap.add_argument("--policy", default="spine")
    ap.add_argument("--sample", action="store_true", help="also decode each prompt sampling (temperature 0.7)")
    a = ap.parse_args()
    import torch

    import goose
    from goose.verifiers import machine
    from goose.tools import datasets, models

    torch.set_num_threads(a.threads)
    model, tok = models.load(a.model, a.dtype)
    prompts = datasets.demo()[: a.prompts]
    dec = goose.compose(model, tok, sources=a.sources.split(","), policy=a.policy)
    dec.generate(prompts[0].text, max_new_tokens=8)  # warm-up: first-call costs stay out of the figures
    modes = [("greedy", {})] + ([("sample", {"do_sample": True, "temperature": 0.7})] if a.sample else [])
    print(f"CPU: {machine.describe()}; {a.model} {a.dtype}; torch threads {a.threads}; {a.sources} / {a.policy}; "
          f"max_new_tokens {a.max_new_tokens}", flush=True)
    print(f"{'prompt':<16} {'mode':<7} {'steps':>5} {'tau':>5} {'check/step us':>14} {'step ms':>8} {'check %':>8}")
    totals = {}
    for mode, kw in modes:
        tot = totals[mode] = {"steps": 0, "check": 0.0, "step": 0.0}
        for i, p in enumerate(prompts):
            if mode == "sample":
                kw = {**kw, "generator": torch.Generator().manual_seed(i)}
            st = dec.generate(p.text, max_new_tokens=a.max_new_tokens, **kw).stats
            t = st.time_s
            prefill = st.extra.get("verifier", {}).get("prefill_forward", 0.0)
            steps, step_s = max(st.steps, 1), t["total"] - prefill
            tot["steps"] += st.steps
            tot["check"] += t["check"]
            tot["step"] += step_s
            print(f"{p.id:<16} {mode:<7} {st.steps:>5} {st.tau:>5.2f} {t['check'] / steps * 1e6:>14.1f} "
                  f"{step_s / steps * 1e3:>8.2f} {100 * t['check'] / step_s:>7.3f}%", flush=True)
    for mode, tot in totals.items():
        n = max(tot["steps"], 1)
        print(f"{'all':<16} {mode:<7} {tot['steps']:>5} {'':>5} {tot['check'] / n * 1e6:>14.1f} "
              f"{tot['step'] / n * 1e3:>8.2f} {100 * tot['check'] / tot['step']:>7.3f}%")


if __name__ == "__main__":
    main()
