"""One decoder shared between threads, on a real model: every policy, compared with the same calls in sequence.

    python benchmarks/threads.py --threads-list 2,4,8 --out threads.json

For each policy (default: every built-in one) and each source list (``pld+tr``, ``pld+suffix+tr``), one decoder
is composed; the same (prompt, max_new_tokens) calls are made on it one after another, then by T threads at
once (started together, each thread its share of the calls), for each T in ``--threads-list``. Greedy calls
are also compared with plain greedy decoding; with ``--sample`` every call samples (temperature 0.7, each call
its own generator seeded by its index) and the threaded calls are compared with the sequential ones. Prints,
per row, how many calls were identical and how many raised. Prompts: the demo set, and with a data folder
(GOOSE_DATA; never looked for otherwise, docs/bench.md) the first of HumanEval, GSM8K, MT-Bench and Spec-Bench summarization.
"""

from __future__ import annotations

import argparse
import json
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads (per Python thread)")
    ap.add_argument("--threads-list", default="2,4,8")
    ap.add_argument("--policies", default=None, help="comma-separated; default: every built-in policy")
    ap.add_argument("--sources", default="pld+tr,pld+suffix+tr")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--sample", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    import goose
    from goose.verifiers import machine
    from goose.manager import get_registry
    from goose.tools import datasets, models

    torch.set_num_threads(a.torch_threads)
    model, tok = models.load(a.model, a.dtype)
    pool = list(datasets.demo())
    for spec in ("humaneval", "gsm8k", "mt_bench", "spec_bench:summarization"):
        try:
            pool += datasets.load(spec)[:2]
        except Exception:  # noqa: BLE001 - no data folder: the demo prompts only
            pass
    calls = [(tok(pool[i % len(pool)].text, return_tensors="pt")["input_ids"][0], a.max_new_tokens - 8 * (i % 3))
             for i in range(a.calls)]
    reg = get_registry()
    policies = a.policies.split(",") if a.policies else sorted(
        n for n, e in reg.entries["policy"].items() if e.origin == "builtin" and e.alias_of is None)
    greedy = goose.greedy(model, tok)
    plain = [greedy.generate(ids, max_new_tokens=n).token_ids for ids, n in calls]

    def run(dec, i):
        ids, n = calls[i]
        if not a.sample:
            return dec.generate(ids, max_new_tokens=n).token_ids
        return dec.generate(ids, max_new_tokens=n, do_sample=True, temperature=0.7,
                            generator=torch.Generator().manual_seed(i)).token_ids

    print(f"CPU: {machine.describe()}; {a.model} {a.dtype}; torch threads {a.torch_threads}; "
          f"{len(calls)} calls of {a.max_new_tokens - 16}-{a.max_new_tokens} tokens; "
          f"{'sampling (T 0.7)' if a.sample else 'greedy'}", flush=True)
    rows = []
    for policy in policies:
        for sources in a.sources.split(","):
            opts = {"latency": {1: 1.0, 128: 1.0}} if "latency" in reg.get("policy", policy).cls.Options.model_fields else None
            dec = goose.compose(model, tok, sources=sources.split("+"), policy=policy, policy_options=opts, budget=32)
            t0 = time.perf_counter()
            seq = [run(dec, i) for i in range(len(calls))]
            seq_s = time.perf_counter() - t0
            row = {"policy": policy, "sources": sources, "sequence_s": round(seq_s, 2),
                   "sequence_equals_greedy": None if a.sample else sum(s == p for s, p in zip(seq, plain))}
            for nt in (int(x) for x in a.threads_list.split(",")):
                got, errors = {}, []
                start = threading.Barrier(nt)

                def work(t):
                    try:
                        start.wait()
                        for i in range(t, len(calls), nt):
                            got[i] = run(dec, i)
                    except BaseException as exc:  # noqa: BLE001 - counted
                        errors.append(f"{type(exc).__name__}: {exc}")

                ths = [threading.Thread(target=work, args=(t,)) for t in range(nt)]
                t0 = time.perf_counter()
                for th in ths:
                    th.start()
                for th in ths:
                    th.join()
                row[f"t{nt}"] = {"identical": sum(got.get(i) == seq[i] for i in range(len(calls))),
                                 "errors": len(errors), "first_error": errors[0] if errors else None,
                                 "s": round(time.perf_counter() - t0, 2)}
            rows.append(row)
            cells = "  ".join(f"{k}: {v['identical']}/{len(calls)} identical, {v['errors']} errors"
                              for k, v in row.items() if k.startswith("t") and isinstance(v, dict))
            eq = "" if a.sample else f"sequence = greedy {row['sequence_equals_greedy']}/{len(calls)}; "
            print(f"{policy:>16} {sources:>14}: {eq}{cells}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": machine.describe(), "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
