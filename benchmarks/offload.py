"""Speed of an accelerate-offloaded model: layers in memory and on disk (issue 14).

    python benchmarks/offload.py --cpu-mib 250 --prompts 6 --new 64

SmolLM2 float32 is loaded with ``device_map="auto", max_memory={"cpu": ...}, offload_folder=...``:
the layers that do not fit stay on disk and are read at every forward, so a forward costs about
the same for one token as for sixty and verification is memory-bound. Methods, interleaved per
prompt (HumanEval, GSM8K, MT-Bench, Spec-Bench summarization, round robin): transformers' greedy
``generate`` on the offloaded model (the baseline), Goose ``spine`` and ``spine-fit`` on the same
model (fit measures this layout's latency curve once, with the offloaded forwards), and ``pld``.
Every output is compared with the baseline's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-mib", type=int, default=250)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    import goose
    from goose.verifiers import machine
    from goose.tools import datasets, models

    torch.set_num_threads(a.threads)
    tok = models.load("smollm2")[1]
    model = AutoModelForCausalLM.from_pretrained(
        str(models.resolve("smollm2")), dtype=torch.float32, attn_implementation="sdpa", device_map="auto",
        max_memory={"cpu": f"{a.cpu_mib}MiB"}, offload_folder=tempfile.mkdtemp(),
    ).eval()
    places = {}
    for k, v in model.hf_device_map.items():
        places[v] = places.get(v, 0) + 1
    t0 = time.perf_counter()
    decs = {
        "pld": goose.compose(model, tok, sources=["pld"], policy="chain"),
        "spine": goose.compose(model, tok, sources=["pld", "tr"], policy="spine"),
        "spine-fit": goose.compose(model, tok, sources=["pld", "tr"], policy="spine-fit"),
    }
    print(f"decoders composed in {time.perf_counter() - t0:.1f} s (spine-fit measures the offloaded curve)")
    prompts = []
    for spec in ("humaneval", "gsm8k", "mt_bench", "spec_bench:summarization"):
        prompts += [(spec, p) for p in datasets.load(spec)[: (a.prompts + 3) // 4]]
    prompts = prompts[: a.prompts]

    def hf(ids):
        with torch.inference_mode():
            out = model.generate(ids.view(1, -1), attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                                 max_new_tokens=a.new, do_sample=False)
        return out[0, ids.numel():].tolist()

    ids0 = tok(prompts[0][1].text, return_tensors="pt")["input_ids"][0]
    hf(ids0[:16])  # warm-up
    for d in decs.values():
        d.generate(ids0[:16], max_new_tokens=8)
    times = {m: [] for m in ("ar", *decs)}
    toks = {m: 0 for m in times}
    same = {m: 0 for m in decs}
    for spec, p in prompts:
        ids = tok(p.text, return_tensors="pt")["input_ids"][0]
        t0 = time.perf_counter()
        ref = hf(ids)
        times["ar"].append(time.perf_counter() - t0)
        toks["ar"] += len(ref)
        line = [f"{spec}/{p.id}: ar {times['ar'][-1]:.1f}s"]
        for m, d in decs.items():
            t0 = time.perf_counter()
            out = d.generate(ids, max_new_tokens=a.new)
            times[m].append(time.perf_counter() - t0)
            toks[m] += len(out.token_ids)
            same[m] += out.token_ids == ref
            line.append(f"{m} {times[m][-1]:.1f}s tau {out.stats.tau:.2f}")
        print(", ".join(line), flush=True)
    print(f"\nCPU: {machine.describe()}; SmolLM2 float32, {a.threads} threads, layout {places}, {a.new} new tokens\n")
    print("| method | pooled speedup | median speedup | identical to greedy |\n|---|---|---|---|")
    for m in decs:
        pooled = sum(times["ar"]) / sum(times[m])
        med = statistics.median(x / y for x, y in zip(times["ar"], times[m]))
        print(f"| {m} | {pooled:.2f}x | {med:.2f}x | {same[m]}/{len(prompts)} |")


if __name__ == "__main__":
    main()
