"""``goose tiers``: measure a chain source's acceptance per confidence tier and store it (:mod:`goose.policies.tiers`).

At every position of the model's greedy output of each prompt: what the source proposes, and how many of its
tokens the output continues with. Per confidence tier, p_1 and the rate of depth d >= 2 given d - 1 are stored
as Wilson lower bounds in the user store (``$GOOSE_TIERS_DIR``), where :func:`goose.policies.tiers.load` finds them.
"""

from __future__ import annotations

import math
import os
from collections import Counter

import torch

from goose.errors import InvalidInputError, UnknownComponentError
from goose.interfaces import DraftSource
from goose.manager import build_component
from goose.policies import tiers as tiers_mod
from goose.specs import preset, split_top
from goose.tools import models
from goose.tools.bench import select_prompts


def add_parser(sub) -> None:
    t = sub.add_parser("tiers", help="measure a chain source's acceptance per confidence tier (policies start there)",
                       description="Measure a chain source's acceptance per confidence tier along a model's greedy "
                       "outputs, and store it where goose.policies.tiers.load (and the policies) find it.")
    t.add_argument("--source", required=True, metavar="SPEC",
                   help="one registered chain source, options as in goose bench (pld, pld{max_chain=16})")
    t.add_argument("--model", default="smollm2", help="model name (goose models list) or local HF folder")
    t.add_argument("--datasets", default=None,
                   help="prompts (goose bench's --datasets syntax); default: tune with a data folder, else demo")
    t.add_argument("--data-dir", default=None, help="benchmark data folder (default: $GOOSE_DATA)")
    t.add_argument("--max-new-tokens", type=int, default=64, help="greedy output tokens per prompt")
    t.add_argument("--floors", default="1.0,0.7", help="tier floors, highest first (a proposal joins the first it reaches)")
    t.add_argument("--threads", type=int, default=2, help="torch threads")
    t.add_argument("--z", type=float, default=1.2816, help="the Wilson lower bound's z (1.2816: one-sided 90 %%)")
    t.add_argument("--out", default=None, help="write the record here (default: the user store's <source>@<version>@<model>.json)")
    t.add_argument("--dry-run", action="store_true", help="measure and print, write nothing")
    t.set_defaults(func=run)


def parse_floors(text: str) -> tuple[float, ...]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidInputError(
            f"--floors {text!r}: not a comma-separated list of numbers. Allowed: confidences in [0, 1], highest "
            "first, strictly decreasing. Hint: --floors 1.0,0.7"
        ) from None
    return tiers_mod.check_floors(values, f"--floors {text}")


def build_source(spec: str):
    """The one source of ``--source SPEC`` (a registered name, options in braces), checked to be a chain source."""
    spec = (spec or "").strip()
    hint = "Hint: --source pld, or --source pld{max_chain=16}"
    if not spec:
        raise InvalidInputError(f"--source is empty. Allowed: one registered source name, options in braces. {hint}")
    if len(split_top(spec, "/")) > 1 or len(split_top(spec, "+")) > 1:
        raise InvalidInputError(
            f"--source {spec!r}: tiers are measured one source at a time, not a method or several sources. "
            f"Allowed: one registered source name, options in braces. {hint}")
    (one,) = preset(spec + "/chain")["sources"]
    try:
        src = build_component("source", one, DraftSource, None)
    except UnknownComponentError as exc:
        raise InvalidInputError(f"--source {spec!r}: {exc} {hint}") from None
    tiers_mod.check_chain_source(src)
    return src


def _check_args(args) -> None:
    for flag, value, hint in (("--max-new-tokens", args.max_new_tokens, "64"), ("--threads", args.threads, "2")):
        if value < 1:
            raise InvalidInputError(f"{flag} {value}: must be >= 1. Hint: {flag} {hint}")
    if not math.isfinite(args.z) or args.z < 0:
        raise InvalidInputError(f"--z {args.z}: must be a finite number >= 0. Hint: --z 1.2816 (one-sided 90 %)")


def record_of(src, args, datasets: str, tiers, measured, model_key: str) -> dict:
    """The record ``goose tiers`` stores; ``model_key`` (:func:`goose.policies.tiers.model_key` of the model measured
    on) is what the policies look tiers up by."""
    return {"source": src.name, "version": str(type(src).version), "model": model_key, "datasets": datasets,
            "max_new_tokens": args.max_new_tokens, "options": src.options.model_dump(mode="json"),
            "tiers": [list(t) for t in tiers], "measured": measured, "z": args.z}


def run(args) -> int:
    _check_args(args)
    floors = parse_floors(args.floors)
    src = build_source(args.source)
    version = str(type(src).version)
    datasets = args.datasets or ("tune" if (args.data_dir or os.environ.get("GOOSE_DATA")) else "demo")
    prompts = select_prompts(datasets, args.data_dir)
    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model, "float32")
    rows = tiers_mod.measure(src, model, tok, prompts, args.max_new_tokens, progress=tiers_mod.progress_line)
    if not rows:
        raise InvalidInputError(
            f"source {src.name!r} proposed nothing along {args.model}'s greedy outputs of {len(prompts)} prompts "
            f"(--datasets {datasets}): nothing to store. Hint: more or longer outputs (--datasets, "
            "--max-new-tokens), or prompts where the source has something to copy")
    tiers, measured = tiers_mod.summarize(rows, floors, args.z)
    per = Counter(r["dataset"] for r in rows)
    print(f"{src.name}@{version} proposals along {args.model}'s greedy outputs ({args.max_new_tokens} tokens, "
          f"{len(prompts)} prompts, --datasets {datasets}): {len(rows)} ({dict(per)})")
    print(tiers_mod.table(rows, floors, args.z))
    print(f"(stored: the Wilson lower bound at z = {args.z:g} of each rate, 3 decimals)\n")
    print(tiers_mod.by_depth(rows, floors) + "\n")
    print(f"tiers: {[list(t) for t in tiers]}")
    if not tiers:
        raise InvalidInputError(
            f"every proposal of {src.name!r} fell below the lowest floor {floors[-1]} (confidences "
            f"{min(r['confidence'] for r in rows):.2f}-{max(r['confidence'] for r in rows):.2f}): no tier to store. "
            "Hint: a lower floor, e.g. --floors 1.0,0.7,0.0")
    if args.dry_run:
        print("--dry-run: nothing written")
        return 0
    key = tiers_mod.model_key(model)
    path = tiers_mod.save(record_of(src, args, datasets, tiers, measured, key), args.out)
    print(f"written to {path}")
    _explain(path, src.name, version, key)
    return 0


def _explain(path, name: str, version: str, key: str) -> None:
    here = path.resolve()
    looked = [d.resolve() / tiers_mod.file_name(name, version, key) for d in (tiers_mod.store_dir(), tiers_mod.shipped_dir())]
    if here in looked:
        first = "" if here == looked[0] or not looked[0].exists() else f" ({looked[0]} is read before it)"
        print(f"goose.policies.tiers.load({name!r}, {version!r}, {key!r}) reads it{first}: policies composed on this model "
              f"(model key {key!r}) start a {name!r} chain of each confidence tier at its (p_1, p_deeper); other "
              f"models start at the pessimistic prior until measured; raise {name}'s DraftSource.version when a "
              "change makes these numbers stale")
    else:
        print(f"not where goose.policies.tiers.load looks: copy it to {looked[0]} (the user store, $GOOSE_TIERS_DIR) or "
              f"{looked[1]} (shipped with the package) for policies to find it")
