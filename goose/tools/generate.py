"""``goose generate``: stream text as it is committed, then print the stats line."""

from __future__ import annotations

import sys

import torch

import goose
from goose.errors import InvalidInputError
from goose.hookspecs import hookimpl
from goose.tools import models
from goose.tools.bench import method_decoder

class _Streamer:
    """A run-time plugin: prints the newly committed text after every verification step."""

    def __init__(self, tokenizer):
        self.tok, self.out = tokenizer, sys.stdout  # sys.stdout as it is now (a test may have replaced it)
        self.ids: list[int] = []
        self.printed = ""

    @hookimpl
    def goose_on_generation_start(self, decoder, request):
        self.ids, self.printed = [], ""

    @hookimpl
    def goose_on_step(self, decoder, step):
        """Print the text the step committed (once the decoded text extends what was printed)."""
        self.ids.extend(step.committed)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed) :])
            self.out.flush()
            self.printed = text


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate text, streamed, with stats")
    g.add_argument("prompt", nargs="?", help="the prompt (default: read --file or stdin)")
    g.add_argument("--file", help="read the prompt from this file")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--model", default="smollm2", help="model name or local Hugging Face folder")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--method", default="spine-fit", help="a method preset (see `goose bench --help`), e.g. spine, "
                   "pld, iso3 (default spine-fit: the fastest measured here)")
    g.add_argument("--budget", type=int, default=None)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--threads", type=int, default=2)
    g.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    g.add_argument("--top-k", type=int, default=None, help="with --temperature: keep the k likeliest tokens")
    g.add_argument("--top-p", type=float, default=None, help="with --temperature: nucleus sampling")
    g.add_argument("--seed", type=int, default=None, help="with --temperature: seed of the draws (default: torch's global generator)")
    g.set_defaults(func=run)


def run(args) -> int:
    torch.set_num_threads(args.threads)
    if args.prompt is not None:
        prompt = args.prompt
    elif args.file:
        prompt = open(args.file, encoding="utf-8").read()
    elif not sys.stdin.isatty():
        prompt = sys.stdin.read()
    else:
        raise InvalidInputError("no prompt: give it as an argument, with --file, or on stdin")
    model, tok = models.load(args.model, args.dtype)
    if args.chat:
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    dec = method_decoder(args.method, model, tok, args.budget)
    streamer = _Streamer(tok)
    goose.register_plugin(streamer, name="goose-cli-streamer")
    try:
        kw = {"do_sample": False}  # greedy unless --temperature, whatever the model's generation_config says
        if args.temperature:
            kw = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        elif args.top_k is not None or args.top_p is not None or args.seed is not None:
            raise InvalidInputError("--top-k, --top-p and --seed need --temperature > 0 (greedy decoding draws nothing)")
        out = dec.generate(prompt, max_new_tokens=args.max_new_tokens, **kw)
    finally:
        goose.unregister_plugin("goose-cli-streamer")
    s, est = out.stats, out.stats.speedup_estimate()
    est_txt = f"{est:.2f}x" if est is not None else "n/a (no single steps to time)"
    print(
        f"\n--- {s.generated_tokens} tokens, {s.forward_passes} forward passes, tau {s.tau:.2f}, "
        f"{s.generated_tokens / max(s.time_s['total'], 1e-9):.1f} tok/s, speedup estimate {est_txt} "
        f"(measure it: goose bench), stopped by {s.stopped_by}",
        file=sys.stderr)
    return 0
