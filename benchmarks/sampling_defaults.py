"""Goose's own ``generate`` against ``model.generate`` with only the arguments a user gives both.

    python benchmarks/sampling_defaults.py --datasets measure@1 --data-dir DATA

For each prompt and seed: ``model.generate(do_sample=True, temperature=T, top_p=P)``, Goose's
``Decoder.generate`` with the same arguments, and ``custom_generate=goose.hf_generate``, each under
``torch.manual_seed(seed)``; prints how many are seed-identical. transformers fills what is unset
(its ``top_k=50`` among others) and so must Goose (goose/generation.py).
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--datasets", default="measure@1")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--policy", default="spine-fit")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import goose
    from goose.verifiers import machine
    from goose.tools import bench, models

    torch.set_num_threads(a.threads)
    model, tok = models.load(a.model, "float32")
    dec = goose.compose(model, tok, sources=["pld", "tr"], policy=a.policy)
    kw = dict(do_sample=True, temperature=a.temperature, top_p=a.top_p)
    same = same_hf = n = 0
    for p in bench.select_prompts(a.datasets, a.data_dir):
        enc = tok(p.text, return_tensors="pt")
        cut = enc["input_ids"].shape[1]
        for seed in [int(s) for s in a.seeds.split(",")]:
            torch.manual_seed(seed)
            want = model.generate(**enc, max_new_tokens=a.max_new_tokens, **kw)[0, cut:].tolist()
            torch.manual_seed(seed)
            got = dec.generate(enc["input_ids"], max_new_tokens=a.max_new_tokens, **kw).token_ids
            torch.manual_seed(seed)
            via = model.generate(**enc, max_new_tokens=a.max_new_tokens, custom_generate=goose.hf_generate, **kw)[0, cut:].tolist()
            n += 1
            same += got == want
            same_hf += via == want
            print(f"{p.dataset}/{p.id} seed {seed}: Goose {got == want}, custom_generate {via == want}", flush=True)
    print(f"\nCPU: {machine.describe()}; {a.model} float32, {a.threads} threads, {kw}, {a.max_new_tokens} new tokens")
    print(f"Goose's own generate: {same}/{n} seed-identical to model.generate; custom_generate: {same_hf}/{n}")


if __name__ == "__main__":
    main()
