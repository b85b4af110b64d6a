"""Composing a researcher's cross-request source with pld and tr (issue 21's table), on a real model.

A ``recall`` source (longest earlier match of the current text over the earlier generations of
this decoder, defined here) is composed with the built-in sources in both orders under ``spine``
and ``spine-fit``; each configuration decodes a prompt once, then the same prompt a second time
on the same decoder (the recall source has the first answer by then). Printed per configuration:
tau of the second request, its forward passes, accepted / drafted by source, which sources led
the spine, and whether both outputs equal greedy decoding (``model.generate(do_sample=False)``).
tau is a count, not a timing: it does not depend on the machine's load.

    python benchmarks/composed_sources.py [--model smollm2] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import warnings

import torch

import goose
from goose.tools import models

PROMPTS = {  # Goose's own: no benchmark data needed
    "code": "Write a Python function that returns the n-th Fibonacci number, with a docstring and a test.",
    "text": "Explain in three sentences why the sky is blue.",
}


class Recall(goose.DraftSource):
    """The longest earlier match (2 to 32 tokens) of the current text in earlier generations'
    prompt + answer; drafts up to ``max_len`` tokens that followed it; confidence grows with the match."""

    name = "recall"

    def __init__(self, options=None, max_len: int = 32):
        super().__init__(options)
        self.history: list[list[int]] = []
        self.max_len = max_len

    def propose(self, state):
        toks = state.tokens
        best, where = 0, None
        for seq in self.history:
            for i in range(len(seq) - 1):
                n = 0
                while n < 32 and n < len(toks) and i - n >= 0 and seq[i - n] == toks[len(toks) - 1 - n]:
                    n += 1
                if n >= 2 and n > best and i + 1 < len(seq):
                    best, where = n, (seq, i + 1)
        if where is None:
            return None
        seq, j = where
        return goose.Proposal.chain(self.name, seq[j:j + self.max_len], confidence=min(1.0, best / 16))

    def end(self, output):
        self.history.append([*output.prompt_ids, *output.token_ids])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="run only the configurations whose policy starts with this (e.g. spine-fit)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model, tok = models.load(args.model, "float32")
    configs = [
        (["recall"], "chain", None),
        (["recall", "tr"], "spine", None),
        (["pld", "tr"], "spine", None),
        (["pld", "recall", "tr"], "spine", "pld"),
        (["pld", "recall", "tr"], "spine", "recall"),
        (["pld", "recall", "tr"], "spine", None),
        (["recall", "pld", "tr"], "spine", None),
        (["recall", "tr"], "spine-fit", None),  # the single-spine fits the merged ones are held to
        (["pld", "tr"], "spine-fit", None),
        (["pld", "recall", "tr"], "spine-fit", None),
        (["recall", "pld", "tr"], "spine-fit", None),
        (["pld", "recall", "tr"], "spine-fit{shadow=false}", None),
        (["suffix"], "chain", None),  # the built-in cross-request source (plugins/suffix.py)
        (["pld", "suffix", "tr"], "spine", None),
        (["suffix", "pld", "tr"], "spine", None),
        (["suffix", "tr"], "spine-fit", None),
        (["pld", "suffix", "tr"], "spine-fit", None),
        (["suffix", "pld", "tr"], "spine-fit", None),
    ]
    from goose.verifiers import machine

    print(f"model {args.model} float32, {args.threads} threads, {args.max_new_tokens} new tokens; CPU: {machine.describe()}\n")
    print("| prompt | sources / policy | spine_source | tau (2nd request) | forwards | accepted/drafted by source | spine led by | identical |")
    print("|---|---|---|---|---|---|---|---|")
    if args.only:
        configs = [c for c in configs if c[1].startswith(args.only)]
    for pname, text in PROMPTS.items():
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        ids = tok(chat, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            ref = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                                 attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        for names, policy, spine in configs:
            srcs = [Recall() if n == "recall" else n for n in names]
            opts = {"spine_source": spine} if spine else {}
            name, _, extra = policy.partition("{")  # e.g. spine-fit{shadow=false}: the fit's own options
            for item in filter(None, extra.rstrip("}").split(",")):
                key, _, value = item.partition("=")
                opts[key] = {"true": True, "false": False}.get(value, int(value) if value.isdigit() else value)
            dec = goose.compose(model, tok, sources=srcs, policy=name, policy_options=opts or None)
            a = dec.generate(ids[0], max_new_tokens=args.max_new_tokens, do_sample=False)
            b = dec.generate(ids[0], max_new_tokens=args.max_new_tokens, do_sample=False)
            st = b.stats
            by = ", ".join(f"{k} {v['accepted']}/{v['drafted']}" for k, v in sorted(st.per_source.items()))
            led = st.extra.get("policy", {}).get("spine_leaders", {})
            led = ", ".join(f"{k} {v}" for k, v in sorted(led.items())) or "-"
            same = a.token_ids == ref and b.token_ids == ref
            print(f"| {pname} | `[{', '.join(names)}]` / `{policy}` | {spine or '-'} | {st.tau:.2f} | "
                  f"{st.forward_passes} | {by} | {led} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
