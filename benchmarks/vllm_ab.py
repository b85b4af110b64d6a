"""Does Goose's drafting pay inside vLLM at a given concurrency? One engine, its plan switched off in alternate blocks.

Comparing two engines (``benchmarks/vllm_serving.py``) carries their difference in everything else: process to
process, one engine's tokens per second moved by 5-10 % here, and a speculative engine pays its own costs (the
rejection sampler every step) whether or not anything is drafted. This benchmark runs **one** engine with Goose's
proposer and, in alternate blocks of ``--block`` engine steps, keeps the proposer's plan (its drafts) or drafts
nothing; in both kinds of block the sources are asked, the plan is made and the step costs are measured, so the
two differ only in the drafted rows verified. The sources never rest here (the rest would change the proposer's own
time between blocks).

Printed per concurrency and round: the share of the wall time in steps that ran a prompt (a request joining, which
no proposer changes), and over the steps that only decoded with at least ``--min-decoding`` requests: tokens per
second in drafting blocks and in the others, their ratio, the drafted tokens per decoding request and ``propose``'s
milliseconds per step. Prompts: the same closed loop as vllm_serving.py (c requests in flight).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_ab.py --data-dir DATA \\
        --datasets humaneval@1-12,gsm8k@1-12,mt_bench@1-12,spec_bench:summarization@1-12 --concurrency 8,16,32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from time import perf_counter

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from goose.vllm import Proposer  # noqa: E402


class Alternating(Proposer):
    """Goose's proposer, its plan kept in even blocks of ``block`` steps and zeroed in odd ones (it rests as the
    proposer does).
    ``log``: per call, (time, decoding requests, tokens sampled, drafted, prompt steps so far, propose seconds)."""

    block = int(os.environ.get("GOOSE_AB_BLOCK", "8"))

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []

    def plan(self, reaches):
        counts = super().plan(reaches)
        return [0] * len(counts) if (self.counts["steps"] // self.block) % 2 else counts

    def propose(self, sampled_token_ids, *args, **kwargs):
        t = perf_counter()
        out = super().propose(sampled_token_ids, *args, **kwargs)
        self.log.append((t, sum(1 for s in sampled_token_ids if len(s)), sum(len(s) for s in sampled_token_ids),
                         sum(len(r) for r in out), self.cost.skipped, perf_counter() - t))
        return out


def split(log: list[tuple], min_decoding: int) -> dict:
    """Step ``i`` runs between calls ``i`` and ``i + 1``: its drafts were planned at call ``i``; its sampled tokens,
    and whether it ran a prompt, are read at call ``i + 1``."""
    on, off, prompt, wall = [0, 0.0, 0, 0, 0.0, 0], [0, 0.0, 0, 0, 0.0, 0], 0.0, 0.0
    for (t0, dec, _, drafted, skipped0, spent), (t1, _, toks, _, skipped1, _) in zip(log, log[1:]):
        wall += t1 - t0
        if skipped1 > skipped0:
            prompt += t1 - t0
            continue
        if dec < min_decoding:
            continue
        a = on if drafted else off
        a[0] += toks
        a[1] += t1 - t0
        a[2] += 1
        a[3] += drafted
        a[4] += spent
        a[5] += dec

    def rate(a):
        return a[0] / a[1] if a[1] else None

    r_on, r_off = rate(on), rate(off)
    return dict(prompt_share=round(prompt / wall, 3) if wall else None,
                drafting=dict(steps=on[2], tok_s=round(r_on, 1) if r_on else None,
                              drafted_per_request=round(on[3] / max(1, on[5]), 2),
                              propose_ms=round(1e3 * on[4] / max(1, on[2]), 2)),
                plain=dict(steps=off[2], tok_s=round(r_off, 1) if r_off else None,
                           propose_ms=round(1e3 * off[4] / max(1, off[2]), 2)),
                ratio=round(r_on / r_off, 3) if r_on and r_off else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--datasets", default="humaneval@1-12,gsm8k@1-12,mt_bench@1-12,spec_bench:summarization@1-12")
    ap.add_argument("--concurrency", default="8,16,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=8, help="engine steps per block (drafting, then not)")
    ap.add_argument("--min-decoding", type=int, default=0,
                    help="count decoding steps with at least this many requests (default: c - c // 4)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--out", default="vllm-ab.json")
    args = ap.parse_args()
    os.environ["GOOSE_AB_BLOCK"] = str(args.block)

    import vllm

    from goose.verifiers import machine
    from goose.tools import models
    from goose.tools.bench import select_prompts
    from vllm_serving import closed_loop, forget_history

    conc = [int(c) for c in args.concurrency.split(",")]
    llm = vllm.LLM(model=str(models.resolve(args.model)), dtype="float32", max_model_len=4096, seed=0,
                   max_num_seqs=max(conc), enforce_eager=True, enable_prefix_caching=False,
                   speculative_config={"method": "custom_class", "model": "vllm_ab.Alternating",
                                       "num_speculative_tokens": args.k})
    tok = llm.get_tokenizer()
    sets = [[tok.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                     tokenize=True, return_dict=True)["input_ids"]
             for p in select_prompts(spec, args.data_dir)] for spec in args.datasets.split(",")]
    prompts = [[int(t) for t in x] for xs in zip(*sets) for x in xs]  # the datasets interleaved, as a server's mix
    sp = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    prop = next(p for p in Proposer.instances() if type(p).__name__ == "Alternating")  # vLLM imported its own copy
    print(f"vLLM {vllm.__version__}, {args.model} float32, k={args.k}, block {args.block}; CPU: {machine.describe()}",
          flush=True)
    rows = []
    for c in conc:
        closed_loop(llm, prompts[:c], sp, c)  # warm-up at this concurrency (row counts the kernels see)
        for r in range(args.rounds):
            forget_history()
            prop.log.clear()
            t = perf_counter()
            closed_loop(llm, prompts, sp, c)
            row = dict(concurrency=c, round=r, prompts=len(prompts), seconds=round(perf_counter() - t, 2),
                       **split(prop.log, args.min_decoding or c - c // 4))
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"cpu": machine.describe(), "vllm": vllm.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
