"""``goose bench``: methods interleaved per prompt on real models and real prompts.

For every prompt, plain greedy decoding (``ar``, transformers' ``generate``) runs first, then each
method on the same prompt, so drift of the machine hits all methods alike. Speedups are reported
pooled (total greedy time / total method time) and as the median of per-prompt ratios.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from itertools import zip_longest
from pathlib import Path

import torch

import goose
from goose.errors import GooseError, InvalidInputError
from goose.hookspecs import hookimpl
# method specs are parsed in the core (goose.specs); tests and scripts import these names from here too
from goose.specs import BASELINES, PRESETS, check_method, preset, split_methods  # noqa: F401
from goose.tools import datasets, models
from goose.tools.plots import bench_plots
from goose.verifiers import machine

CONTEXT_ORIGINS = ("lead", "pld", "pld-latest", "context")
RECYCLE_ORIGINS = ("branch", "root-branch", "tr", "tr-original")

METHODS_HELP = (
    "comma-separated: ar (transformers greedy, always run first), hf-pld (transformers prompt lookup), "
    + ", ".join(PRESETS)
    + ", or SRC+SRC/POLICY[/VERIFIER] for any registered components (e.g. pld+tr/iso3, pld+tr/spine/greedy), each with options in "
    "braces (e.g. pld{max_chain=16}+tr{k=4}/spine-fit{spine_source=pld}; a dict or list option in JSON, e.g. "
    "spine-fit{source_priors={\"pld\":[[1.0,0.6,0.9]]}})")

# the warm-up's text: Goose's own, never one of the measured prompts
WARMUP_TEXT = "Warm-up: list the first ten prime numbers, then the first ten squares, one per line."

# the settings two runs must share to be compared or merged
COMPARABLE = ("model", "dtype", "threads", "max_new_tokens", "chat", "temperature", "top_k", "top_p", "seed")
# a results.json without the sampling keys was a greedy run
GREEDY_META = {"temperature": 0.0, "top_k": None, "top_p": None, "seed": 0}
# results.json's meta: these arguments of the run, in this order
META_ARGS = ("model", "dtype", "threads", "max_new_tokens", "datasets", "num_prompts", "chat", "repeats", "warmup",
             "warm", "samples", "turns", "greedy_from", "temperature", "top_k", "top_p", "seed")
PROFILE_PARTS = ("forward", "sources", "tree", "mask", "walk", "commit", "harvest", "other")


def method_decoder(name: str, model, tok, budget: int | None = None):
    """A decoder composed from method preset or spec ``name``; ``budget`` overrides its policy's node budget."""
    kw = dict(preset(name))
    if budget is not None:
        kw["budget"] = budget
    return goose.compose(model, tok, **kw)


@dataclass
class Run:
    dataset: str
    prompt_id: str
    method: str
    tokens: list[int]
    seconds: float
    forward_passes: int | None = None
    stats: dict = field(default_factory=dict)
    sample: int | None = None  # with --samples / --turns: the draw or turn of this prompt, 1-based


class Runner:
    def __init__(self, method: str, model, tok, budget: int | None, max_new: int, sampling: dict | None = None):
        self.method, self.model, self.tok, self.max_new, self.budget = method, model, tok, max_new, budget
        self.decoder = None if method in BASELINES else method_decoder(method, model, tok, budget)
        # sampling: {"temperature": T, "top_k": k, "top_p": p} (None entries dropped); None: greedy
        self.sampling = {k: v for k, v in (sampling or {}).items() if v is not None} if sampling else None

    def renew(self) -> None:
        """Compose the decoder afresh, so nothing learned on earlier prompts reaches the next one (the latency
        curve is the process's cached one: no measurement)."""
        if self.decoder is not None:
            self.decoder = method_decoder(self.method, self.model, self.tok, self.budget)

    def run(self, ids, max_new: int | None = None, seed: int = 0) -> tuple[list[int], float, dict]:
        """(tokens, seconds, stats) of one decoding of ``ids``."""
        max_new = self.max_new if max_new is None else max_new
        # greedy said outright: a model whose generation_config samples would sample otherwise
        sample = dict(do_sample=True, **self.sampling) if self.sampling else {"do_sample": False}
        if self.sampling:
            torch.manual_seed(seed)  # every method draws from the same global generator state
        if self.decoder is not None:
            t0 = time.perf_counter()
            out = self.decoder.generate(ids, max_new_tokens=max_new, **sample)
            return out.token_ids, time.perf_counter() - t0, out.stats.to_dict()
        kw = dict(max_new_tokens=max_new, attention_mask=torch.ones_like(ids), **sample)
        if self.method == "hf-pld":
            kw["prompt_lookup_num_tokens"] = 10
        gen_cfg = getattr(self.model, "generation_config", None)
        if getattr(gen_cfg, "pad_token_id", None) is None:
            kw["pad_token_id"] = getattr(gen_cfg, "eos_token_id", None) or 0
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, **kw)
        return out[0, ids.shape[1] :].tolist(), time.perf_counter() - t0, {}


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter one's length if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def top2_gap(model, ids, ref: list[int], pos: int) -> float:
    """Greedy's top-1 minus top-2 logit at generated position ``pos`` (one full forward)."""
    seq = torch.cat([ids[0], torch.tensor(ref[:pos], dtype=torch.long)]).view(1, -1)
    with torch.inference_mode():
        logits = model(input_ids=seq).logits[0, -1].float()
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _rate(per_source: dict, origins) -> float | None:
    """Accepted / drafted tokens of the sources ``origins``; None when they drafted nothing."""
    d = sum(per_source.get(o, {}).get("drafted", 0) for o in origins)
    a = sum(per_source.get(o, {}).get("accepted", 0) for o in origins)
    return a / d if d else None


def summarize(runs: list[Run], methods: list[str]) -> list[dict]:
    """One row per (dataset, method), and per method over ``ALL`` datasets, with pooled and median speedups
    against ``ar``."""
    by_key = {(r.dataset, r.prompt_id, r.method): r for r in runs}
    rows = []
    for ds in [*dict.fromkeys(r.dataset for r in runs), "ALL"]:
        prompts = list(dict.fromkeys((r.dataset, r.prompt_id) for r in runs if ds in ("ALL", r.dataset)))
        for m in methods:
            mine = [(by_key[(*p, m)], by_key[(*p, "ar")]) for p in prompts
                    if (*p, m) in by_key and (*p, "ar") in by_key]
            if mine:
                rows.append(_summary_row(ds, m, mine))
    return rows


def _summary_row(ds: str, m: str, mine: list[tuple[Run, Run]]) -> dict:
    """The row of method ``m`` over its (run, ``ar`` run) pairs ``mine``."""
    toks, secs = sum(len(x.tokens) for x, _ in mine), sum(x.seconds for x, _ in mine)
    ar_toks, ar_secs = sum(len(a.tokens) for _, a in mine), sum(a.seconds for _, a in mine)
    ratios = [(len(x.tokens) / x.seconds) / (len(a.tokens) / a.seconds)
              for x, a in mine if x.seconds > 0 and a.seconds > 0 and len(a.tokens)]
    fwd = sum((x.stats.get("forward_passes") or 0) for x, _ in mine)
    per_source: dict = {}
    steps = 0
    draft_s = total_s = 0.0
    for x, _ in mine:
        for o, d in x.stats.get("per_source", {}).items():
            ps = per_source.setdefault(o, {"proposed": 0, "drafted": 0, "accepted": 0})
            for k in ps:
                ps[k] += d.get(k, 0)
        steps += x.stats.get("steps", 0)
        t = x.stats.get("time_s", {})
        vt = x.stats.get("extra", {}).get("verifier", {})
        if vt:  # everything that is not a model forward
            draft_s += t.get("total", 0.0) - vt.get("forward", 0.0) - vt.get("prefill_forward", 0.0)
        else:
            draft_s += t.get("draft", 0.0) + t.get("observe", 0.0)
        total_s += t.get("total", 0.0)
    ctx, tr = _rate(per_source, CONTEXT_ORIGINS), _rate(per_source, RECYCLE_ORIGINS)
    accepted = sum(ps["accepted"] for ps in per_source.values())
    return {"dataset": ds, "method": m, "prompts": len(mine), "tokens": toks, "tok_s": toks / secs if secs else 0.0,
            "speedup_pooled": (toks / secs) / (ar_toks / ar_secs) if secs and ar_secs and ar_toks else None,
            "speedup_median": statistics.median(ratios) if ratios else None,
            "identical": sum(x.tokens == a.tokens for x, a in mine), "tau": toks / fwd if fwd else None,
            "mean_accept_len": (accepted / steps + 1) if steps else None, "ctx_acc": ctx, "tr_acc": tr,
            "acc_ratio": ctx / tr if ctx is not None and tr else None,
            "overhead": draft_s / total_s if total_s else None, "per_source": per_source}


def per_sample(runs: list[Run], methods: list[str]) -> list[dict]:
    """Rows of :func:`summarize` per sample index (dataset column ``#s``), pooled over prompts and datasets."""
    rows = []
    for s in sorted({r.sample for r in runs if r.sample is not None}):
        mine = [replace(r, dataset=f"#{s}") for r in runs if r.sample == s]
        rows += [row for row in summarize(mine, methods) if row["dataset"] != "ALL"]
    return rows


def profile(runs: list[Run], methods: list[str]) -> list[dict]:
    """Per Goose method, pooled over every prompt: milliseconds per decoding step in each part of a step
    (:data:`PROFILE_PARTS`), the overhead, the ceiling and the speedup; docs/bench.md says what each column times."""
    ar = {(r.dataset, r.prompt_id): r for r in runs if r.method == "ar"}
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m and (r.dataset, r.prompt_id) in ar]
        if m in BASELINES or not mine or not mine[0].stats.get("time_s"):
            continue
        parts = dict.fromkeys(PROFILE_PARTS, 0.0)
        steps, total, fwd_all = 0, 0.0, 0.0
        for r in mine:
            t, vt = r.stats.get("time_s", {}), r.stats.get("extra", {}).get("verifier", {})
            steps += r.stats.get("steps", 0)
            total += t.get("total", 0.0)
            parts["sources"] += t.get("sources", 0.0)
            parts["tree"] += t.get("draft", 0.0) - t.get("sources", 0.0)
            parts["harvest"] += t.get("observe", 0.0)
            for k in ("forward", "mask", "walk", "commit"):
                parts[k] += vt.get(k, 0.0)
            fwd_all += vt.get("forward", 0.0) + vt.get("prefill_forward", 0.0)
        prefill = fwd_all - parts["forward"]
        parts["other"] = max(0.0, total - sum(v for k, v in parts.items() if k != "other") - prefill)
        row = {"method": m, "prompts": len(mine), "steps": steps, "ms_per_step": 1000 * (total - prefill) / steps if steps else None}
        row.update({k: 1000 * v / steps if steps else None for k, v in parts.items()})
        if not all("sources" in r.stats.get("time_s", {}) for r in mine):
            row["sources"] = None  # a results.json without it holds only the sum, in "tree"
        row["overhead"] = (total - fwd_all) / total if total else None
        ar_s = sum(ar[(r.dataset, r.prompt_id)].seconds for r in mine)
        ar_rate = sum(len(ar[(r.dataset, r.prompt_id)].tokens) for r in mine) / ar_s if ar_s else 0.0  # greedy's tokens/s
        method_s, method_tok = sum(r.seconds for r in mine), sum(len(r.tokens) for r in mine)
        row["ceiling"] = (method_tok / fwd_all) / ar_rate if fwd_all and ar_rate else None
        row["speedup"] = (method_tok / method_s) / ar_rate if method_s and ar_rate else None
        rows.append(row)
    return rows


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)])


def profile_table(rows: list[dict]) -> str:
    return _md_table(["method", "steps", "ms/step", *PROFILE_PARTS, "overhead", "ceiling", "speedup"], [
        [r["method"], str(r["steps"]), _f(r["ms_per_step"], "{:.1f}"), *(_f(r[k], "{:.2f}") for k in PROFILE_PARTS),
         _f(r["overhead"], "{:.1%}"), _f(r["ceiling"], "{:.2f}x"), _f(r["speedup"], "{:.2f}x")] for r in rows])


def table(rows: list[dict]) -> str:
    head = ["dataset", "method", "n", "tokens", "tau", "acc len", "tok/s", "speedup pooled", "speedup median",
            "identical", "ctx acc", "TR acc", "ratio", "overhead"]
    return _md_table(head, [
        [r["dataset"], r["method"], str(r["prompts"]), str(r["tokens"]), _f(r["tau"]), _f(r["mean_accept_len"]),
         _f(r["tok_s"], "{:.1f}"), _f(r["speedup_pooled"]) + "x", _f(r["speedup_median"]) + "x",
         f"{r['identical']}/{r['prompts']}", _f(r["ctx_acc"], "{:.3f}"), _f(r["tr_acc"], "{:.3f}"),
         _f(r["acc_ratio"], "{:.1f}"), _f(r["overhead"], "{:.1%}")] for r in rows])


def _form_sizes(lin: dict, form: str) -> list[int]:
    """The pass sizes at which the verifier's linear layers take ``form``, ascending."""
    return sorted(int(k) for k, f in lin.get("forms", {}).items() if f == form)


def memory_line(runs: list[Run], methods: list[str]) -> str | None:
    """What the packed weights of tree passes take (verifiers/skinny.py), per Goose method, from its last run."""
    last: dict[str, dict] = {}
    for r in runs:
        lin = (r.stats or {}).get("extra", {}).get("verifier", {}).get("linear")
        if lin is not None:
            last[r.method] = lin
    if not last:
        return None
    parts = []
    for m in [m for m in methods if m in last]:
        sizes = _form_sizes(last[m], "packed")
        at = f" at tree sizes {sizes[0]}-{sizes[-1]}" if sizes else ""
        parts.append(f"{m} {last[m]['packed_mib']:,.0f} MiB{at}" if last[m].get("packed") else f"{m} 0 MiB (none made)")
    limit = next(iter(last.values())).get("pack_limit_mib")
    line = ("Memory: packed linear weights of tree passes (one set per model, shared by its decoders; "
            f"limit {limit:,} MiB, verifier option pack_limit_mib): " + ", ".join(parts))
    streaming = [f"{m} at pass sizes {s[0]}-{s[-1]}" for m in methods if (s := _form_sizes(last.get(m, {}), "stream"))]
    if streaming:
        line += ("; the stream kernel (verifiers/stream.py) reads the weights in their own layout, 0 MiB beside them: "
                 + ", ".join(streaming))
    return line


def verifier_line(rows: list[dict]) -> str | None:
    """What the verifier alone gives and what drafting adds: Goose's plain steps (``greedy``: one token per
    pass, no drafts) against transformers' greedy, and each drafting method's speedup over those plain steps
    (pooled over every prompt)."""
    every = {r["method"]: r for r in rows if r["dataset"] == "ALL"}
    plain = every.get("greedy")
    if plain is None or not plain.get("speedup_pooled"):
        return None
    base = plain["speedup_pooled"]
    more = [f"{m} {r['speedup_pooled'] / base:.2f}x" for m, r in every.items()
            if m not in ("ar", "greedy", "hf-pld") and r.get("speedup_pooled")]
    return (f"Verifier alone (greedy: Goose's plain steps, no drafts): {base:.2f}x transformers' greedy, pooled "
            f"({_f(plain.get('speedup_median'))}x median)"
            + (f". Drafting on top of it (each method's speedup / greedy's): " + ", ".join(more) if more else "") + ".")


def source_lines(rows: list[dict]) -> str | None:
    """Accepted / drafted tokens of every source per method over all datasets, and the tokens it proposed (a node
    two sources proposed counts for both)."""
    lines = []
    for r in rows:
        if r["dataset"] != "ALL" or not r.get("per_source"):
            continue
        parts = [f"{name} {d['accepted']}/{d['drafted']}" + (f" ({d['accepted'] / d['drafted']:.2f})" if d["drafted"] else "")
                 + (f" of {d['proposed']} proposed" if "proposed" in d else "")
                 for name, d in sorted(r["per_source"].items())]
        lines.append(f"- {r['method']}: " + ", ".join(parts))
    return "Accepted / drafted tokens by source, of the tokens it proposed (ALL):\n\n" + "\n".join(lines) if lines else None


def report_md(rows: list[dict], runs: list[Run], methods: list[str], prof: list[dict]) -> str:
    """The results table, the verifier, source and memory lines and the profile, as goose bench and report print them."""
    md = table(rows)
    for line in (verifier_line(rows), source_lines(rows), memory_line(runs, methods)):
        if line:
            md += "\n\n" + line
    if prof:
        md += "\n\nProfile (ms per decoding step, pooled over every prompt; docs/bench.md):\n\n" + profile_table(prof)
    return md


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods interleaved per prompt (see docs/bench.md)")
    b.add_argument("--model", default="smollm2", help="model name (goose models list) or local HF folder")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    b.add_argument("--threads", type=int, default=2, help="torch threads (same for every method)")
    b.add_argument("--datasets", default="demo", help="comma-separated; the splits tune and measure (docs/bench.md; measure@5: 5 prompts of each part), or datasets: demo, humaneval, gsm8k, mt_bench, spec_bench[:CATEGORY], mbpp:PATH, jsonl:PATH; append @N to take the first N prompts of one dataset, @FIRST-LAST for prompts FIRST to LAST (1-based)")
    b.add_argument("--data-dir", default=None, help="benchmark data folder for gsm8k, mt_bench, spec_bench and the splits (default: $GOOSE_DATA; never looked for otherwise; demo and humaneval need none)")
    b.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each dataset")
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--methods", default="ar,greedy,hf-pld,pld,spine,spine-fit", help=METHODS_HELP)
    b.add_argument("--budget", type=int, default=None, help="node budget (default: each policy's own, 60)")
    b.add_argument("--chat", action="store_true", help="apply the chat template instead of raw prompts")
    b.add_argument("--warmup", type=int, default=1, help="untimed runs of each method before timing, on a built-in text that is not measured")
    b.add_argument("--warm", action="store_true",
                   help="keep one decoder per method across all prompts (what it learns on one prompt, e.g. a "
                   "cross-request source's history, helps the next; the report says so); default: each prompt "
                   "gets a freshly composed decoder")
    b.add_argument("--repeats", type=int, default=1, help="timed runs per prompt and method (median kept)")
    b.add_argument("--no-gap", action="store_true", help="skip the top-2 logit gap at mismatches")
    b.add_argument("--out", default="goose-bench", help="folder for results.json, results.md and the PNG plots")
    b.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (0: greedy); every method, transformers' too, draws under "
                   "torch.manual_seed(--seed + prompt index), so 'identical' counts seed-identical outputs")
    b.add_argument("--top-k", type=int, default=None, help="with --temperature: top-k (default: none)")
    b.add_argument("--top-p", type=float, default=None, help="with --temperature: top-p (default: none)")
    b.add_argument("--seed", type=int, default=0, help="with --temperature: seed of the first prompt")
    b.add_argument("--samples", type=int, default=1,
                   help="decode each prompt this many times with every method (repeating workloads: pass@k, "
                   "self-consistency): draw s of prompt i under seed --seed + i * samples + s; all draws of a prompt "
                   "by one decoder, in order; the report adds speedups per sample index")
    b.add_argument("--turns", type=int, default=1,
                   help="multi-turn prompts (MT-Bench, Spec-Bench; needs --chat): ask up to this many turns, each after "
                   "the method's own earlier answers, in one conversation with one decoder; reported per turn")
    b.add_argument(
        "--greedy-from", default=None, metavar="RESULTS",
        help="reuse the greedy (ar) outputs of an earlier run's results.json (same model, dtype, threads, "
        "max_new_tokens, prompt format) instead of decoding them again: for tau and identity checks of "
        "added methods; its speedups then mix two runs' timings")
    b.set_defaults(func=run)


def run(args) -> int:
    """``goose bench``: decode every prompt with every method in turn, print the tables and write results.json,
    results.md and the plots."""
    torch.set_num_threads(args.threads)
    _check_args(args)
    methods = _methods(args.methods)
    prompts = select_prompts(args.datasets, args.data_dir, args.num_prompts)
    reused = load_greedy(args.greedy_from, args, prompts) if args.greedy_from else None
    b = _Bench(args, methods, reused)
    if args.warmup:
        b.warm_up()
    catcher = _TreeCatcher(b.runners)
    goose.register_plugin(catcher, name="goose-bench-tree-catcher")
    try:
        b.interleave(prompts)
    finally:
        goose.unregister_plugin("goose-bench-tree-catcher")
    print(file=sys.stderr)
    runs = b.runs
    rows, prof, by_sample = summarize(runs, methods), profile(runs, methods), per_sample(runs, methods)
    md = report_md(rows, runs, methods, prof)
    if by_sample:
        md += ("\n\nBy " + ("turn" if args.turns > 1 else "sample index") + " (every prompt's draw or turn s, pooled "
               "over prompts; the first has no history of this prompt, the s-th has s - 1 earlier outputs):\n\n"
               + table(by_sample))
    noisy = [r for r in runs if r.stats.get("time_spread", 0) > 0.15]
    _print_results(args, len(prompts), reused, md, b.mismatches, noisy)
    if args.out:
        results = {"meta": _meta(args), "summary": rows, "by_sample": by_sample, "profile": prof,
                   "mismatches": b.mismatches, "runs": [r.__dict__ for r in runs]}
        _write_results(Path(args.out), results, md, rows, catcher.best, args.no_plots)
    return 0


def _check_args(args) -> None:
    """Refuse contradictory sampling, --samples, --turns and --greedy-from settings."""
    if args.temperature < 0:
        raise InvalidInputError(f"--temperature {args.temperature}: must be >= 0 (0: greedy). Hint: --temperature 0.7")
    if not args.temperature and (args.top_k is not None or args.top_p is not None):
        raise InvalidInputError("--top-k and --top-p need --temperature > 0 (greedy decoding draws nothing). Hint: --temperature 0.7 --top-p 0.9")
    samples, turns = args.samples, args.turns
    if samples < 1 or turns < 1:
        raise InvalidInputError(f"--samples {samples} / --turns {turns}: each must be >= 1. Hint: --samples 10")
    if samples > 1 and turns > 1:
        raise InvalidInputError("--samples and --turns cannot be combined. Hint: run them as two benchmarks")
    if turns > 1 and not args.chat:
        raise InvalidInputError(f"--turns {turns} needs --chat: the turns are a conversation. Hint: add --chat")
    if (samples > 1 or turns > 1) and args.greedy_from:
        raise InvalidInputError("--greedy-from keeps one greedy output per prompt; it cannot serve --samples or --turns")


def _methods(text: str) -> list[str]:
    """The ``--methods`` list, each checked before any model is loaded (its components built short of ``bind``),
    with ``ar`` first (added if absent)."""
    methods = split_methods(text)
    for m in methods:
        if m not in BASELINES:
            with _naming_method(m):
                check_method(m)
    return ["ar", *[m for m in methods if m != "ar"]]


@contextmanager
def _naming_method(method: str):
    """A :class:`GooseError` raised inside names ``method`` (``goose: error: method 'pld/chain': ...``), on one line."""
    try:
        yield
    except GooseError as exc:
        msg = " ".join(str(exc).split())
        named = f"method {method!r}" in msg
        if named and msg == str(exc):
            raise
        raise InvalidInputError(msg if named else f"method {method!r}: {msg}") from exc


class _Bench:
    """One ``goose bench`` run: the model, one :class:`Runner` per method (none for ``ar`` when its runs are reused
    from --greedy-from), and the runs and mismatches so far."""

    def __init__(self, args, methods: list[str], reused: dict | None):
        self.args, self.methods, self.reused = args, methods, reused  # reused: (dataset, prompt id) -> ar Run
        self.runs: list[Run] = []
        self.mismatches: list[dict] = []
        t_phase = time.perf_counter()
        self.model, self.tok = models.load(args.model, args.dtype)
        _note(f"model loaded in {time.perf_counter() - t_phase:.1f}s")
        t_phase = time.perf_counter()
        sampling = None
        if args.temperature:
            sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}
            args.no_gap = True  # a top-2 gap says nothing about a draw
        self.runners = {}
        for m in methods:
            if not (reused and m == "ar"):
                with _naming_method(m):
                    self.runners[m] = Runner(m, self.model, self.tok, args.budget, args.max_new_tokens, sampling)
        _note(f"decoders composed in {time.perf_counter() - t_phase:.1f}s (includes measuring the latency curve "
              "once per machine)")

    def encode(self, text: str, earlier: tuple = (), answers: tuple = ()):
        """Prompt ids of ``text``; with --chat, the chat template over the earlier turns and answers, then ``text``."""
        if self.args.chat:
            chat = []
            for q, a in zip(earlier, answers):
                chat += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            chat.append({"role": "user", "content": text})
            text = self.tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return self.tok(text, return_tensors="pt")["input_ids"]

    def warm_up(self) -> None:
        """--warmup short untimed runs of every runner on :data:`WARMUP_TEXT` (they only prepare kernels and caches)."""
        t_phase = time.perf_counter()
        ids = self.encode(WARMUP_TEXT)
        for _ in range(self.args.warmup):
            for r in self.runners.values():
                r.run(ids, max_new=min(self.args.max_new_tokens, 24))
        _note(f"warm-up in {time.perf_counter() - t_phase:.1f}s")

    def interleave(self, prompts: list) -> None:
        """Every prompt in turn, decoded by every method in turn (each by a freshly composed decoder unless --warm);
        with --out, the runs so far saved after each prompt."""
        t_start = time.time()
        for k, p in enumerate(prompts):
            if not self.args.warm:
                for r in self.runners.values():
                    r.renew()
            self.decode_prompt(k, p, len(prompts), t_start)
            if self.args.out:  # an interrupted run keeps every finished prompt
                meta = {"partial": True, "prompts_done": k + 1, "prompts": len(prompts),
                        "machine": {"cpu_line": machine.describe()}}
                _save(Path(self.args.out), {"meta": meta, "runs": [r.__dict__ for r in self.runs],
                                            "mismatches": self.mismatches})

    def decode_prompt(self, k: int, p, total: int, t_start: float) -> None:
        """Prompt ``p`` (the k-th of ``total``) decoded by every method: once, or each draw (--samples) or turn
        (--turns) in order; records the runs, and each output's first difference from ``ar``'s."""
        samples, turns = self.args.samples, self.args.turns
        subs = samples if samples > 1 else min(turns, max(1, len(p.turns)))
        answers: dict = {m: [] for m in self.methods}
        for s in range(subs):
            pid = p.id if subs == 1 and samples == 1 and turns == 1 else f"{p.id}#{s + 1}"
            first = len(self.runs)
            for m in self.methods:
                # with --turns, the conversation so far, with this method's own answers
                ids = self.encode(p.turns[s], p.turns[:s], tuple(answers[m])) if turns > 1 else self.encode(p.text)
                if self.reused and m == "ar":
                    self.runs.append(self.reused[(p.dataset, p.id)])
                    continue
                _progress(k, total, p, m, t_start)
                self.runs.append(self.timed_run(m, ids, p, pid, s, seed=self.args.seed + k * samples + s))
                if turns > 1:
                    answers[m].append(self.tok.decode(self.runs[-1].tokens, skip_special_tokens=True))
            self.add_mismatches(self.runs[first:], p, pid, ids)

    def timed_run(self, m: str, ids, p, pid: str, s: int, seed: int) -> Run:
        """--repeats timed runs of method ``m`` on ``ids``: the last run's tokens and stats, the median time, and
        the spread of the times (``stats["time_spread"]``)."""
        times, toks, st = [], None, {}
        for _ in range(max(1, self.args.repeats)):
            toks, dt, st = self.runners[m].run(ids, seed=seed)
            times.append(dt)
        st["time_spread"] = (max(times) - min(times)) / statistics.median(times) if len(times) > 1 else 0.0
        return Run(p.dataset, pid, m, toks, statistics.median(times), st.get("forward_passes"), st,
                   None if pid == p.id else s + 1)

    def add_mismatches(self, group: list[Run], p, pid: str, ids) -> None:
        """Where each run of ``group[1:]`` first differs from ``group[0]`` (``ar``'s), with greedy's top-2 logit gap
        there unless --no-gap, sampling or --turns."""
        ref = group[0].tokens
        for r in group[1:]:
            pos = first_mismatch(r.tokens, ref)
            if pos is not None:
                gap = None
                if not self.args.no_gap and pos < len(ref) and self.args.turns == 1:
                    gap = top2_gap(self.model, ids, ref, pos)
                self.mismatches.append(
                    {"dataset": p.dataset, "prompt_id": pid, "method": r.method, "position": pos, "top2_gap": gap})


def _meta(args) -> dict:
    """results.json's ``meta``: the command, the machine, the versions and every setting of the run."""
    import transformers

    return {
        "command": "goose " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("goose") else " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
                    "cpu": machine.cpu(), "cpu_line": machine.describe()},
        "versions": {"goose": goose.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        **{k: getattr(args, k) for k in META_ARGS}}


def _print_results(args, n_prompts: int, reused: dict | None, md: str, mismatches: list[dict], noisy: list[Run]) -> None:
    """The run's header (model, settings, CPU), the tables, the outputs that differ from ``ar``'s and
    a note on noisy timings, on stdout."""
    samples, turns = args.samples, args.turns
    print(
        f"\nGoose bench: model {args.model}, {args.dtype}, {args.threads} threads, {n_prompts} prompts, "
        f"max_new_tokens {args.max_new_tokens}; methods interleaved per prompt; speedup vs ar (transformers "
        + (f"sampling at temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}, seed {args.seed} + prompt index; "
           "hf-pld samples too; 'identical' = seed-identical to transformers' sampling)\n" if args.temperature else "greedy)\n")
        + f"CPU: {machine.describe()}\n"
        + (f"{samples} draws of every prompt per method, in order, by one decoder per prompt and method.\n" if samples > 1 else "")
        + (f"Up to {turns} turns of every prompt, each after the method's own answers, by one decoder per prompt and method.\n"
           if turns > 1 else "")
        + ("WARM: one decoder per method across all prompts (state learned on earlier prompts, and the "
           "warm-up's, is kept)\n" if args.warm else "Each prompt decoded by a freshly composed decoder.\n"))
    if reused:
        print(f"Greedy (ar) outputs and timings reused from {args.greedy_from}: compare tau and identity; "
              "speedups mix two runs' timings.\n")
    print(md)
    print()
    if mismatches:
        print(f"Outputs that differ from greedy ({len(mismatches)}):")
        for mm in mismatches:
            gap = "-" if mm["top2_gap"] is None else f"{mm['top2_gap']:.4g}"
            print(f"  {mm['dataset']}/{mm['prompt_id']} {mm['method']}: first mismatch at token {mm['position']}, greedy top-2 logit gap {gap}")
    elif args.temperature:
        print("Every method's output is identical to transformers' sampling under the same seed on every prompt.")
    else:
        print("Every method's output is identical to greedy decoding on every prompt.")
    if noisy:
        print(f"Note: {len(noisy)} runs varied by more than 15% across repeats: the machine was noisy.")


def _write_results(out: Path, results: dict, md: str, rows: list[dict], best, no_plots: bool) -> None:
    """results.json, results.md and, unless ``no_plots``, the PNG plots (``best``: the tree drawn) in ``out``."""
    _save(out, results)
    (out / "results.md").write_text(md + "\n")
    print(f"Wrote {out / 'results.json'} and {out / 'results.md'}")
    if not no_plots:
        pngs = bench_plots(rows, out, best)
        if pngs:
            print("Plots: " + ", ".join(str(x) for x in pngs))
        else:
            print("Plots skipped: matplotlib is not installed (pip install 'goose-spec[plots]')")


def _save(out: Path, obj: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(out / "results.json")


def _results_file(path: str) -> Path:
    """``DIR/results.json`` for an output folder, the path itself otherwise."""
    f = Path(path)
    return f / "results.json" if f.is_dir() else f


def load_greedy(path: str, args, prompts: list) -> dict:
    """The ``ar`` runs of an earlier results.json for ``prompts``, checked to be comparable."""
    f = _results_file(path)
    if not f.is_file():
        raise InvalidInputError(f"--greedy-from {path}: no results file at {f}. Hint: the --out folder of an earlier goose bench")
    data = json.loads(f.read_text())
    meta = {**GREEDY_META, **{k: v for k, v in data.get("meta", {}).items() if v is not None or k not in GREEDY_META}}
    differ = {k: (meta.get(k), getattr(args, k)) for k in COMPARABLE if meta.get(k) != getattr(args, k)}
    if differ:
        what = ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differ.items())
        raise InvalidInputError(
            f"--greedy-from {path}: that run is not comparable ({what}); greedy outputs are reused only from a run "
            "with the same model, dtype, threads, max_new_tokens and prompt format")
    ar = {(r["dataset"], r["prompt_id"]): Run(**r) for r in data.get("runs", []) if r.get("method") == "ar"}
    missing = [f"{p.dataset}/{p.id}" for p in prompts if (p.dataset, p.id) not in ar]
    if missing:
        raise InvalidInputError(
            f"--greedy-from {path}: no greedy output there for {len(missing)} selected prompt(s), e.g. {missing[:3]}. "
            "Hint: select prompts that run covered, or drop --greedy-from")
    for r in ar.values():
        r.stats = {**r.stats, "reused_from": str(f)}
    return ar


def _count(text: str, what: str, example: str) -> int:
    """A prompt count given on the command line: a whole number >= 1, or a clear error."""
    if not text.strip().isdigit() or int(text) < 1:
        raise InvalidInputError(f"{what}: {text!r} is not a prompt count; it must be a whole number >= 1 (e.g. {example})")
    return int(text)


def select_prompts(spec: str, data_dir: str | None = None, num_prompts: int | None = None) -> list:
    """The prompts of ``--datasets``, interleaved round-robin: comma-separated ``name``, ``name@N`` (its first N
    prompts) or ``name@FIRST-LAST`` (1-based, inclusive); a split (``tune``, ``measure``) stands for its datasets,
    ``measure@5`` for the first 5 prompts of each."""
    if num_prompts is not None:
        _count(str(num_prompts), "--num-prompts", "--num-prompts 20")
    items = []
    for item in [d.strip() for d in spec.split(",") if d.strip()]:
        name, at, count = item.partition("@")
        if name not in datasets.SPLITS:
            items.append(item)
            continue
        for part in datasets.SPLITS[name].split(","):
            if at:
                base, _, rng = part.partition("@")
                lo = int(rng.split("-")[0])
                n = _count(count, f"--datasets {item}", f"{name}@5")
                part = f"{base}@{lo}-{lo + n - 1}"
            items.append(part)
    prompts = []
    for item in items:
        name, at, count = item.partition("@")
        first, dash, last = count.partition("-") if at else ("", "", "")
        if dash and first:
            start = _count(first, f"--datasets {item} (first prompt of the range)", f"{name}@8-20")
            end = _count(last, f"--datasets {item} (last prompt of the range)", f"{name}@8-20")
            if end < start:
                raise InvalidInputError(
                    f"--datasets {item}: the range {start}-{end} ends before it starts; "
                    f"give FIRST-LAST with FIRST <= LAST (e.g. {name}@8-20)")
            lo, hi = start - 1, end
        else:
            lo, hi = 0, _count(count, f"--datasets {item}", f"{name}@3") if at else num_prompts
        ps = datasets.load(name, data_dir)
        if lo >= len(ps):
            raise InvalidInputError(
                f"--datasets {item}: {name} has {len(ps)} prompts, so a range cannot start at prompt {lo + 1}. "
                f"Hint: {name}@1-{len(ps)}")
        prompts.extend(ps[lo:hi] if hi else ps[lo:])
    if not prompts:
        raise InvalidInputError(f"no prompts selected by --datasets {spec!r}. Hint: --datasets demo")
    return _round_robin(prompts)


def _round_robin(prompts: list) -> list:
    """Interleave datasets (first prompt of each, then the second, ...): partial runs stay balanced."""
    groups: dict[str, list] = {}
    for p in prompts:
        groups.setdefault(p.dataset, []).append(p)
    return [p for row in zip_longest(*groups.values()) for p in row if p is not None]


def merge_runs(paths: list[str]) -> list[Run]:
    """The runs of several results.json files, each (prompt, method) from the first file that has it. The files
    must come from comparable runs and agree on every greedy output they share; otherwise a clear error."""
    merged: dict[tuple[str, str, str], Run] = {}
    where: dict[tuple[str, str, str], str] = {}
    meta0, path0 = None, None
    for path in paths:
        data = json.loads(Path(path).read_text())
        meta = {k: data.get("meta", {}).get(k, GREEDY_META.get(k)) for k in COMPARABLE}
        if meta0 is None:
            meta0, path0 = meta, path
        elif any(meta[k] is not None and meta0[k] is not None and meta[k] != meta0[k] for k in COMPARABLE):
            what = ", ".join(f"{k} {meta0[k]!r} in {path0}, {meta[k]!r} in {path}" for k in COMPARABLE if meta[k] != meta0[k])
            raise InvalidInputError(f"goose report: {path} is not comparable with {path0} ({what}); merge only runs of one setting")
        for r in (Run(**x) for x in data["runs"]):
            key = (r.dataset, r.prompt_id, r.method)
            if key not in merged:
                merged[key], where[key] = r, path
            elif r.method == "ar" and r.tokens != merged[key].tokens:
                raise InvalidInputError(
                    f"goose report: the greedy outputs of {r.dataset}/{r.prompt_id} differ between {where[key]} and "
                    f"{path} (first mismatch at token {first_mismatch(r.tokens, merged[key].tokens)}); these runs are "
                    "not comparable")
    return list(merged.values())


def summarize_file(paths: list[str], first: dict[str, int] | None,
                   methods: list[str] | None) -> tuple[str, list[dict], list[Run]]:
    """The table of one or more (possibly partial) results.json files, over the prompts every method finished;
    ``first`` keeps the first N prompts per dataset, ``methods`` the given methods (``ar`` always)."""
    runs = merge_runs(paths)
    wanted = None
    if methods:
        have = list(dict.fromkeys(r.method for r in runs))
        absent = [m for m in methods if m not in have]
        if absent:
            raise InvalidInputError(f"goose report --methods: no runs of {absent} in these results; they have {have}")
        wanted = ["ar", *[m for m in methods if m != "ar"]]
        runs = [r for r in runs if r.method in wanted]
    if first:
        order: dict[str, dict] = {}  # prompt ids per dataset, in order
        for r in runs:
            order.setdefault(r.dataset, {})[r.prompt_id] = None
        keep = {(d, i) for d, ids in order.items() if d in first for i in list(ids)[: first[d]]}
        runs = [r for r in runs if (r.dataset, r.prompt_id) in keep]
    methods = wanted or list(dict.fromkeys(r.method for r in runs))
    done = {}
    for r in runs:
        done.setdefault((r.dataset, r.prompt_id), set()).add(r.method)
    runs = [r for r in runs if done[(r.dataset, r.prompt_id)] == set(methods)]
    rows = summarize(runs, methods)
    return report_md(rows, runs, methods, profile(runs, methods)), rows, runs


def add_report_parser(sub) -> None:
    r = sub.add_parser("report", help="the table of goose bench results.json files (also partial ones)")
    r.add_argument(
        "results", nargs="+",
        help="path(s) to results.json; several comparable runs are merged, each (prompt, method) from the first "
        "file that has it, greedy outputs checked equal")
    r.add_argument("--first", default=None, help="keep the first N prompts per dataset, e.g. humaneval=3,gsm8k=3")
    r.add_argument("--methods", default=None, help="keep these methods (comma-separated; ar always), in this order")
    r.set_defaults(func=_report)


def _report(args) -> int:
    paths = []
    for res in args.results:
        f = _results_file(res)
        if not f.exists():
            raise InvalidInputError(f"{res} does not exist; goose bench --out DIR writes DIR/results.json")
        paths.append(str(f))
    first = None
    if args.first:
        first = {}
        for item in [x.strip() for x in args.first.split(",") if x.strip()]:
            name, eq, count = item.partition("=")
            if not eq or not name:
                raise InvalidInputError(f"--first {item!r}: expected DATASET=N, e.g. --first humaneval=3,gsm8k=3")
            first[name] = _count(count, f"--first {item}", f"{name}=3")
    methods = split_methods(args.methods) if args.methods else None
    md, rows, runs = summarize_file(paths, first, methods)
    print(f"{len({(r.dataset, r.prompt_id) for r in runs})} prompts with every method finished\n")
    cpus = [json.loads(Path(f).read_text()).get("meta", {}).get("machine", {}).get("cpu_line") for f in paths]
    for c in dict.fromkeys(c or "not recorded (a run from before the CPU was recorded)" for c in cpus):
        print(f"CPU: {c}")
    print()
    if len(paths) > 1:
        print(f"Merged from {len(paths)} runs: tau and identity to greedy compare; speedups mix the runs' timings.\n")
    print(md)
    return 0


class _TreeCatcher:
    """Keeps one verified tree worth drawing: a real tree (with branches) before a plain chain,
    then the most accepted tokens among the largest trees."""

    def __init__(self, runners):
        self.runners = runners  # decoders are renewed per prompt: look them up when a step comes
        self.best = None
        self.key = (False, -1, -1)

    @hookimpl
    def goose_on_step(self, decoder, step):
        if step.tree.num_nodes < 3 or not any(r.decoder is decoder for r in self.runners.values()):
            return
        tree = step.tree
        key = (not tree.is_chain, min(tree.num_nodes, 40) * (1 + len(step.verified.path)), tree.num_nodes)
        if key > self.key:
            self.key, self.best = key, step


def _note(msg: str) -> None:
    print(f"goose bench: {msg}", file=sys.stderr, flush=True)


def _progress(k, n, p, m, t0) -> None:
    if not sys.stderr.isatty():
        return
    sys.stderr.write(f"\r[{k + 1}/{n}] {p.dataset}/{p.id} {m:<16} {time.time() - t0:6.0f}s elapsed   ")
    sys.stderr.flush()
