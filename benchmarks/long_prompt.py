"""Peak memory and prefill time of long prompts: Goose against transformers' generate.

    python benchmarks/long_prompt.py --model smollm2 --lengths 1000,4000,8000 --data-dir DATA --out long.json

Each (model, length, method) runs in a fresh process: load the model, warm up on a short prompt,
reset the peak resident memory (/proc/self/clear_refs), then generate ``--new`` tokens from a
prompt of real text (Spec-Bench summarization articles, concatenated and cut to the length).
"Extra" is the peak resident memory during that generation minus the resident memory before it;
"held" is that peak minus the resident memory right after the model was loaded (what the method
keeps beside the model: the packed weights, made at the warm-up's prefill, show here and not in
"extra"); "time" is the wall time of that generation (prefill and ``--new`` tokens). Methods:

- ``hf``: ``model.generate(do_sample=False)`` (logits of the last position only);
- ``goose``: the default decoder (``pld`` + ``tr`` under ``spine-fit``), whose token-recycling
  harvest computes the logits of the last positions only (``tr.prefill_window``, ``prefill_max_mib``);
- ``goose-all``: the same with ``prefill_window=None``: the reference harvest of every prompt position;
- ``goose-nopack``: the default decoder with the verifier option ``pack_limit_mib=0`` (no packed weights);
- ``goose-stock``: the default decoder with ``linear="stock"``;
- ``goose-packed``: the default decoder with ``linear="packed"`` (packed weights at every tree size,
  where ``"auto"`` would use them only where the calibration measured them faster).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def _text_prompt(tok, n: int) -> list[int]:
    from goose.tools import datasets

    ids: list[int] = []
    for p in datasets.load("spec_bench:summarization"):
        ids.extend(tok(p.text)["input_ids"])
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"not enough text for {n} tokens")


def child(model_name: str, dtype: str, threads: int, n: int, method: str, new: int) -> dict:
    import torch

    import goose
    from goose.tools import models

    torch.set_num_threads(threads)
    model, tok = models.load(model_name, dtype)
    loaded = _rss_kib("VmRSS")
    ids = torch.tensor(_text_prompt(tok, n))
    if method == "hf":
        def run(x, k):
            with torch.inference_mode():
                out = model.generate(x.view(1, -1), attention_mask=torch.ones(1, x.numel(), dtype=torch.long),
                                     max_new_tokens=k, min_new_tokens=k, do_sample=False)
            return out[0, x.numel():].tolist()
    else:
        tr = ("tr", {"prefill_window": None}) if method == "goose-all" else "tr"
        vo = {"goose-nopack": {"pack_limit_mib": 0}, "goose-stock": {"linear": "stock"},
              "goose-packed": {"linear": "packed"}}.get(method, {})
        dec = goose.compose(model, tok, sources=["pld", tr], policy="spine-fit", verifier_options=vo)

        def run(x, k):
            out = dec.generate(x, max_new_tokens=k)
            info["linear"] = out.stats.extra.get("verifier", {}).get("linear")
            return out.token_ids
    info: dict = {}
    run(ids[:64], 4)  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak resident set size (VmHWM) to the current one
    before = _rss_kib("VmRSS")
    t0 = time.perf_counter()
    toks = run(ids, new)
    dt = time.perf_counter() - t0
    peak = _rss_kib("VmHWM")
    return {"model": model_name, "dtype": dtype, "threads": threads, "prompt_tokens": n, "method": method,
            "extra_mib": (peak - before) / 1024, "held_mib": (peak - loaded) / 1024, "time_s": dt, "tokens": toks,
            "packed_mib": (info.get("linear") or {}).get("packed_mib", 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="1000,4000,8000")
    ap.add_argument("--methods", default="hf,goose,goose-all")
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--data-dir", default=None, help="benchmark data folder holding spec_bench/ (default: $GOOSE_DATA)")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.data_dir:
        import os

        os.environ["GOOSE_DATA"] = a.data_dir  # the children read the prompts from it
    if a.child:
        m, dt, th, n, meth = a.child
        print(json.dumps(child(m, dt, int(th), int(n), meth, a.new)))
        return
    from goose.verifiers import machine

    rows = []
    for n in [int(x) for x in a.lengths.split(",")]:
        for meth in a.methods.split(","):  # interleaved per length
            cmd = [sys.executable, __file__, "--new", str(a.new), "--child", a.model, a.dtype, str(a.threads), str(n), meth]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            r = json.loads(out)
            rows.append(r)
            print(f"{a.model} {n:>5} {meth:<12} extra {r['extra_mib']:8.1f} MiB  held {r['held_mib']:8.1f} MiB  "
                  f"time {r['time_s']:7.2f} s  packs {r['packed_mib']:.0f} MiB", flush=True)
    print(f"\nCPU: {machine.describe()}; {a.model} {a.dtype}, {a.threads} threads, {a.new} new tokens\n")
    print("| prompt tokens | method | extra peak MiB | x hf | held beside the model MiB | time s | x hf | same tokens as hf |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["prompt_tokens"] == r["prompt_tokens"] and b["method"] == "hf")
        print(f"| {r['prompt_tokens']} | {r['method']} | {r['extra_mib']:.0f} | {r['extra_mib'] / base['extra_mib']:.2f} | {r['held_mib']:.0f} | "
              f"{r['time_s']:.2f} | {r['time_s'] / base['time_s']:.2f} | {r['tokens'] == base['tokens']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cpu": machine.describe(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
