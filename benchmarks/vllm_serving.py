"""vLLM with and without speculation, Goose's proposer among them, at several concurrencies.

For each engine configuration (no speculation, vLLM's ``ngram``, vLLM's ``suffix`` when this
build has it, ``goose.vllm.Proposer``) one engine is started, and the same prompts are decoded
at each concurrency c with **c requests in flight**: c are submitted, and each time one finishes
the next prompt is submitted (a closed loop, as a serving benchmark's ``--max-concurrency c``),
so a request that finishes early frees its slot for the next one. Prefix caching is off, so every
phase computes its prompts (each phase repeats the same prompts). Before each concurrency's timed
phase the engine serves ``--warmup`` prompts (the tune split's, never the timed ones) untimed at
that concurrency: vLLM's CPU linear layers build a oneDNN primitive the first time they see a
row count, and a server past its first minutes has them. Goose's proposer forgets what it learned
from earlier text (``suffix``'s history, the recycled table) before each warm-up and each phase, so
no timed prompt is drafted from its own answer in an earlier phase; its measured rates and step
costs stay, as in a running server.

Printed per dataset, configuration and concurrency: output tokens per second (wall time of the
phase), the speedup over no speculation at the same concurrency, the mean accepted tokens per
verification step (vLLM's spec-decode metrics), whether every output equals the no-speculation
output, and Goose's proposer's own milliseconds per step. Goose's own loop (one request at a
time) runs on the same prompts for reference. Each engine runs in a process of its own, one after
the other (a third engine started in one process fails in vLLM 0.32's CPU kernel registration);
the engine core runs in that process. With ``--interleave`` each speculative engine shares its
process with a no-speculation engine instead, their timed phases alternating (the order swapped
every round, ``--rounds``), so every ratio is measured interleaved: run to run, one engine's tokens
per second moved by 5-10 % here, more than the differences the targets ask about. ``--configs none,again``
measures that noise: ``again`` is a second engine without speculation. With ``--length-spread F`` each prompt's
``max_tokens`` is drawn from ``max_tokens * [1 - F, 1 + F]`` (the same for every engine), as a server's requests
end at different lengths; with every output the same length the engine without speculation finishes its c
requests at one step and takes the next c prompts together, which speculation breaks.

    python benchmarks/vllm_serving.py --data-dir DATA --datasets humaneval@41-48,gsm8k@41-48 \
        --concurrency 1,4,16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_configs(k: int, have_suffix: bool) -> list[tuple[str, dict | None]]:
    out = [("none", None),
           ("ngram", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2})]
    if have_suffix:
        out.append(("suffix", {"method": "suffix", "num_speculative_tokens": k}))
    out.append(("goose", {"method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": k}))
    # speculation on, nothing ever proposed: what the speculative engine costs by itself (only with --configs)
    out.append(("silent", {"method": "custom_class", "model": "vllm_serving.Silent", "num_speculative_tokens": k}))
    # a second engine without speculation (only with --configs): its ratio to the first is the benchmark's own noise
    out.append(("again", None))
    return out


class Silent:
    """A ``custom_class`` proposer that never drafts: the speculative engine's own cost, with no proposal."""

    def __init__(self, vllm_config=None, *args, **kwargs):
        pass

    def load_model(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, *args, **kwargs) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]


def spec_metrics(llm) -> dict:
    try:
        ms = llm.get_metrics()
    except Exception:  # noqa: BLE001 - a build without metrics: report none
        return {}
    out = {}
    for m in ms:
        if m.name.startswith("vllm:spec_decode"):
            out[m.name] = getattr(m, "value", None) if not hasattr(m, "values") else sum(m.values)
    return out


def main() -> int:
    args = _arguments()
    import vllm

    from goose.verifiers import machine
    from goose.tools import models
    from goose.tools.bench import select_prompts

    path = str(models.resolve(args.model))
    sets = {}
    for spec in args.datasets.split(","):
        sets[spec] = [[{"role": "user", "content": p.text}] for p in select_prompts(spec, args.data_dir)]
    warm = [[{"role": "user", "content": p.text}] for p in select_prompts(args.warmup, args.data_dir)] if args.warmup else []
    conc = [int(c) for c in args.concurrency.split(",")]
    have_suffix = True
    try:
        import arctic_inference  # noqa: F401  vLLM's suffix method needs it
    except ImportError:
        have_suffix = False
    configs = engine_configs(args.k, have_suffix)
    keep = set(args.configs.split(","))
    configs = [c for c in configs if c[0] in keep]
    print(f"vLLM {vllm.__version__}, model {args.model} float32, k={args.k}, {args.max_tokens} tokens"
          f"{f' (each drawn from x[{1 - args.length_spread:g}, {1 + args.length_spread:g}])' if args.length_spread else ''}; "
          f"CPU: {machine.describe()}; vLLM suffix method: {'yes' if have_suffix else 'no (arctic-inference not installed)'}",
          flush=True)
    if not args.one:  # each engine in a process of its own (a third engine in one process fails to start)
        return _each_in_its_process(args, configs, vllm, machine, sets)
    return _run_one(args, configs, vllm, conc, sets, warm, path)


def _arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data-dir", default=os.environ.get("GOOSE_DATA"))
    ap.add_argument("--datasets", default="demo")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--length-spread", type=float, default=0.0,
                    help="each prompt's max_tokens drawn uniformly from max_tokens * [1 - F, 1 + F] (seeded by its "
                         "place, the same for every engine): requests end at different steps, as a server's do; 0: "
                         "every request max_tokens")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens of every speculative engine")
    ap.add_argument("--configs", default="none,ngram,suffix,goose",
                    help="comma-separated subset of none,ngram,suffix,goose,silent,again (silent: speculation on, nothing "
                         "proposed; again: no speculation again, its ratio to none the benchmark's own noise)")
    ap.add_argument("--c1-prompts", type=int, default=0,
                    help="at concurrency 1, only the first N prompts of each dataset (0: all)")
    ap.add_argument("--goose-loop", default="pld+tr/spine-fit", help="Goose's own loop for reference ('' to skip)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no torch.compile; faster engine start)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature (0: greedy); sampled outputs are seeded per request but not "
                    "expected to equal the no-speculation engine's (vLLM's rejection sampler draws differently)")
    ap.add_argument("--warmup", default="tune",
                    help="prompts served untimed before each concurrency (max(4, c) of them, 32 tokens); '' for none")
    ap.add_argument("--interleave", action="store_true",
                    help="run each speculative engine in one process with a no-speculation engine, their phases "
                    "alternating (the order swapped every round), so each ratio is measured interleaved")
    ap.add_argument("--rounds", type=int, default=1, help="timed phases per engine, dataset and concurrency")
    ap.add_argument("--out", default="vllm-serving.json")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # internal: run one configuration, write --out
    args = ap.parse_args()
    if not 0.0 <= args.length_spread < 1.0:
        ap.error(f"--length-spread must be in [0, 1), got {args.length_spread}: each max_tokens is drawn from "
                 "max_tokens * [1 - F, 1 + F]")
    return args


def _each_in_its_process(args, configs, vllm, machine, sets) -> int:
    """Each engine (or each speculative engine beside a no-speculation one, ``--interleave``) in a process of its
    own, this script again with ``--one``; their rows merged, each ratio against its own process's baseline."""
    names = [name for name, _ in configs]
    if args.interleave:  # no speculation and one other engine per process, their phases alternating
        procs = [f"none+{n}" for n in names if n != "none"]
    else:
        procs = names
    rows, base, prompts, none_tokens, traces = [], {}, {}, {}, {}
    for proc in procs:
        part = f"{args.out}.{proc}.json"
        subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", proc, "--out", part, "--goose-loop", ""],
                       check=True)
        with open(part) as f:
            got = json.load(f)
        prompts.update(got.get("prompts", {}))
        none_tokens.update({k: v for k, v in got["tokens"].items() if k.endswith("|none")})
        stats = read_stats(f"{part}.trace")
        if stats is not None:
            traces[proc] = stats
        for row in sorted(got["rows"], key=lambda r: r["config"] != "none"):  # this process's baseline first
            key = (row["dataset"], row["concurrency"], row["round"])
            toks = got["tokens"][f"{row['dataset']}|{row['concurrency']}|{row['round']}|{row['config']}"]
            if row["config"] == "none":
                base[key] = (toks, row["tok_s"])
            elif key in base:
                row["identical"] = toks == base[key][0]
                row["speedup"] = round(row["tok_s"] / base[key][1], 3)
            rows.append(row)
    print_table(rows)
    rows += goose_loop(args, sets) if args.goose_loop else []
    with open(args.out, "w") as f:
        json.dump({"cpu": machine.describe(), "vllm": vllm.__version__, "k": args.k, "max_tokens": args.max_tokens,
                   "length_spread": args.length_spread, "rows": rows, "prompts": prompts,
                   "none_tokens": none_tokens, "goose_stats": traces}, f, indent=1)
    return 0


def _run_one(args, configs, vllm, conc, sets, warm, path) -> int:
    """``--one``: one engine, or two interleaved, through every concurrency and dataset; rows to ``--out``."""
    names = args.one.split("+")  # one engine, or two interleaved (--interleave)
    configs = [c for n in names for c in configs if c[0] == n]
    rows, outputs = [], {}
    trace = f"{args.out}.trace"
    if "goose" in names:  # the proposer appends its steps there (goose.vllm.ENV_TRACE): its own time per step
        if os.path.exists(trace):
            os.remove(trace)
        os.environ["GOOSE_VLLM_TRACE"] = trace
    if len(configs) > 1:  # two engines in one process: each gets a small KV cache (enough for 32 requests here)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "3")
    engines = []
    for name, spec in configs:
        t0 = time.perf_counter()
        kw = {"speculative_config": spec} if spec else {}
        llm = vllm.LLM(model=path, dtype="float32", max_model_len=4096, seed=0, max_num_seqs=max(conc),
                       enforce_eager=args.eager, disable_log_stats=False, enable_prefix_caching=False, **kw)
        engines.append((name, llm, time.perf_counter() - t0))

    def sps(n: int) -> list:  # the sampling parameters of n prompts, in their order
        return [vllm.SamplingParams(temperature=args.temperature, max_tokens=m, seed=0 if args.temperature > 0 else None)
                for m in lengths(n, args.max_tokens, args.length_spread)]
    warm_sp = vllm.SamplingParams(temperature=args.temperature, max_tokens=32, seed=0 if args.temperature > 0 else None)
    tok = engines[0][1].get_tokenizer()
    ids = {}  # chat -> prompt token ids (one template for every engine)
    prompts_by_group = {}  # "dataset|c" -> the prompts' token ids, in the order submitted

    def prompt_ids(chat):
        key = chat[0]["content"]
        if key not in ids:
            ids[key] = [int(t) for t in tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=True)["input_ids"]]
        return ids[key]

    for c in conc:
        for _, llm, _ in engines:
            forget_history([llm])
            if warm:
                closed_loop(llm, [prompt_ids(ch) for ch in warm[: max(4, c)]], warm_sp, c)
        # at concurrency 1 each dataset apart; above it every prompt, the datasets interleaved (a batch
        # mixes datasets, as a server's would)
        if c == 1:
            groups = {ds: chats[: args.c1_prompts or None] for ds, chats in sets.items()}
        else:
            groups = {"ALL": [x for xs in zip(*sets.values()) for x in xs]}
        for ds, chats in groups.items():
            prompts = [prompt_ids(ch) for ch in chats]
            prompts_by_group[f"{ds}|{c}"] = prompts
            for r in range(args.rounds):
                for name, llm, start in engines[:: 1 if r % 2 == 0 else -1]:  # the order alternates per round
                    forget_history([llm])
                    row, toks = phase(llm, prompts, sps(len(prompts)), c, trace)
                    rows.append(dict(dataset=ds, config=name, concurrency=c, round=r, prompts=len(chats),
                                     engine_start_s=round(start, 1), **row))
                    outputs[f"{ds}|{c}|{r}|{name}"] = toks
                    print(json.dumps(rows[-1]), flush=True)
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "tokens": outputs, "prompts": prompts_by_group}, f)
    return 0


def phase(llm, prompts: list[list[int]], sp, c: int, trace: str) -> tuple[dict, list[list[int]]]:
    """One timed phase: ``prompts`` at concurrency ``c``; its numbers and the output tokens."""
    before = spec_metrics(llm)
    seen = len(read_trace(trace))
    t = time.perf_counter()
    toks = closed_loop(llm, prompts, sp, c)
    dt = time.perf_counter() - t
    after = spec_metrics(llm)
    n = sum(len(x) for x in toks)
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts = d.get("vllm:spec_decode_num_drafts") or 0
    acc = d.get("vllm:spec_decode_num_accepted_tokens") or 0
    drafted = d.get("vllm:spec_decode_num_draft_tokens") or 0
    row = dict(tokens=n, seconds=round(dt, 3), tok_s=round(n / dt, 2), speedup=None, identical=None,
               accepted_per_draft=round(acc / drafts, 3) if drafts else None,
               acceptance=round(acc / drafted, 3) if drafted else None,
               accepted_tokens=acc, draft_tokens=drafted, drafts=drafts)
    return {**row, **propose_time(read_trace(trace)[seen:])}, toks


def print_table(rows: list[dict]) -> None:
    """One line per dataset and concurrency: each engine's tokens per second (pooled over rounds) and its
    ratio to no speculation (the median of the rounds' ratios, each against the no-speculation phase it was
    interleaved with; the range when there are several), Goose's ratio to ``ngram``, and the identical count."""
    agg: dict = {}
    for r in rows:
        a = agg.setdefault((r["dataset"], r["concurrency"], r["config"]), {"tokens": 0, "seconds": 0.0, "ratios": [], "same": []})
        a["tokens"] += r["tokens"]
        a["seconds"] += r["seconds"]
        if r.get("speedup"):
            a["ratios"].append(r["speedup"])
        if r.get("identical") is not None:
            a["same"].append(r["identical"])
    names = list(dict.fromkeys(r["config"] for r in rows))
    keys = list(dict.fromkeys((r["dataset"], r["concurrency"]) for r in rows))
    print("\n| prompts | c | " + " | ".join(names) + " | goose / ngram | identical |")
    print("|---|---|" + "---|" * (len(names) + 2))
    med = {}
    for ds, c in keys:
        cells, same = [], []
        for n in names:
            a = agg.get((ds, c, n))
            if a is None:
                cells.append("-")
                continue
            cell = f"{a['tokens'] / a['seconds']:.1f}"
            if a["ratios"]:
                m = med[ds, c, n] = statistics.median(a["ratios"])
                spread = f", {min(a['ratios']):.2f}-{max(a['ratios']):.2f}" if len(a["ratios"]) > 1 else ""
                cell += f" ({m:.3f}x{spread})"
            cells.append(cell)
            if a["same"]:
                same.append(f"{n} {sum(a['same'])}/{len(a['same'])}")
        g, ng = med.get((ds, c, "goose")), med.get((ds, c, "ngram"))
        ratio = f"{g / ng:.2f}x" if g and ng else "-"
        print(f"| {ds} | {c} | " + " | ".join(cells) + f" | {ratio} | {', '.join(same)} |")


_ids = iter(range(1 << 62))


def lengths(n: int, max_tokens: int, spread: float) -> list[int]:
    """``max_tokens`` of each of ``n`` prompts: ``max_tokens`` each, or with ``spread`` F drawn uniformly from
    ``max_tokens * [1 - F, 1 + F]`` by a generator seeded by nothing but the prompt's place (every engine, phase and
    run gets the same lengths)."""
    import random

    rng = random.Random(0)
    return [max(1, round(max_tokens * (1 - spread + 2 * spread * rng.random()))) for _ in range(n)]


def closed_loop(llm, prompts: list[list[int]], sp, c: int) -> list[list[int]]:
    """Decode ``prompts`` with ``c`` requests in flight: each one that finishes is replaced by the next prompt.
    ``sp``: one sampling parameters for every prompt, or a list of one per prompt. The output tokens, in the
    prompts' order."""
    eng = llm.llm_engine
    sp_of = sp if isinstance(sp, list) else [sp] * len(prompts)
    todo = iter(enumerate(prompts))
    out: dict[str, tuple[int, list[int]]] = {}
    names: dict[str, int] = {}

    def submit() -> int:
        nxt = next(todo, None)
        if nxt is None:
            return 0
        rid = f"b{next(_ids)}"
        names[rid] = nxt[0]
        eng.add_request(rid, {"prompt_token_ids": nxt[1]}, sp_of[nxt[0]])
        return 1

    flying = sum(submit() for _ in range(c))
    while flying:
        for o in eng.step():
            if o.finished:
                out[o.request_id] = (names[o.request_id], list(o.outputs[0].token_ids))
                flying += submit() - 1
    return [t for _, t in sorted(out.values())]


def forget_history(llms=()) -> None:
    """The proposers in this process forget what they learned from earlier text: Goose's (its ``suffix`` source's
    history, the recycled table) and, in each engine of ``llms`` that runs vLLM's ``suffix`` method, that method's
    cache of responses, so no engine drafts a timed prompt from its own answer in an earlier phase. Called between
    phases, when no request is in flight."""
    try:
        from goose.vllm import Proposer
    except ImportError:
        proposers = []
    else:
        proposers = Proposer.instances()
    for p in proposers:
        p.forget()
    for llm in llms:
        cache = getattr(drafter(llm), "suffix_cache", None)
        if cache is None:
            continue
        for req in list(cache.active_requests):
            cache.stop_request(req)
        for req in list(cache.cached_requests):
            cache.evict_cached_response(req)


def drafter(llm):
    """The engine's proposer object (vLLM 0.32, the engine core in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
    or None."""
    try:
        worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker
        return getattr(getattr(worker, "worker", worker).model_runner, "drafter", None)
    except AttributeError:
        return None


def _trace_lines(path: str) -> list:
    """The lines of the proposer's trace (goose.vllm.Proposer._trace: JSON lines), [] while there is none."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def read_trace(path: str) -> list:
    """The proposer's calls written so far, ``[(decoding requests, rows planned, propose ms, ...), ...]``."""
    return [e for e in _trace_lines(path) if isinstance(e, list)]


def read_stats(path: str) -> dict | None:
    """The proposer's stats as its trace last wrote them (step costs, rates, counts); None without a trace."""
    stats = [e["stats"] for e in _trace_lines(path) if isinstance(e, dict) and "stats" in e]
    return stats[-1] if stats else None


def propose_time(steps: list) -> dict:
    """Goose's proposer in one phase: its ms per step (mean, and at the steps' largest batch), the batch,
    and the drafted rows per decoding request."""
    if not steps:
        return {}
    ms = [s[2] for s in steps]
    top = max(s[0] for s in steps)
    full = [s[2] for s in steps if s[0] == top]
    return dict(propose_ms=round(sum(ms) / len(ms), 3), propose_ms_full_batch=round(sum(full) / len(full), 3),
                batch_max=top, drafted_per_request=round(sum(s[1] - s[0] for s in steps) / max(1, sum(s[0] for s in steps)), 3))


def goose_loop(args, sets) -> list[dict]:
    """Goose's own loop, one request at a time, on the same chats: greedy and ``--goose-loop``."""
    import torch

    import goose
    from goose.tools import models
    from goose.tools.bench import preset

    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model, "float32")
    rows = []
    for ds, chats in sets.items():
        for meth in ("greedy", args.goose_loop):
            n, dt = 0, 0.0
            for chat in chats:
                ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
                dec = goose.greedy(model, tok) if meth == "greedy" else goose.compose(model, tok, **preset(meth))
                t = time.perf_counter()
                o = dec.generate(ids[0], max_new_tokens=args.max_tokens, do_sample=False)
                dt += time.perf_counter() - t
                n += len(o.token_ids)
            row = dict(dataset=ds, config=f"goose loop {meth}", concurrency=1, tokens=n, seconds=round(dt, 3),
                       tok_s=round(n / dt, 2))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
