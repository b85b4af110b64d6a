"""Benchmark prompt loaders: Spec-Bench / MT-Bench format, HumanEval, GSM8K, MBPP, any JSONL.

Data files are never shipped with Goose (except its own demo prompts): give their folder with
``--data-dir`` or the ``GOOSE_DATA`` environment variable (the layout of the benchmark data
folder: ``humaneval/HumanEval.jsonl.gz``, ``gsm8k/test.jsonl``, ``mt_bench/question.jsonl``,
``spec_bench/question.jsonl``). Prompts follow the GOOSE paper's raw-prompt protocol by default.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from goose.errors import InvalidInputError


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str
    category: str = ""


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def data_dir(explicit: str | None = None) -> Path:
    cands = [explicit, os.environ.get("GOOSE_DATA")]
    for c in cands:
        if c:
            p = Path(c).expanduser()
            if not p.is_dir():
                raise InvalidInputError(f"data folder {p} does not exist. Hint: --data-dir or GOOSE_DATA")
            return p
    for base in (Path.cwd(), *Path.cwd().parents):
        p = base / "shared" / "data"
        if p.is_dir():
            return p
        p = base.parent / "shared" / "data"
        if p.is_dir():
            return p
    raise InvalidInputError(
        "no benchmark data folder found. Give it with --data-dir or the GOOSE_DATA environment "
        "variable (a folder holding humaneval/, gsm8k/, mt_bench/, spec_bench/)."
    )


def demo() -> list[Prompt]:
    """Goose's own demo prompts (written for this project), shipped with the package."""
    text = resources.files("goose.tools").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    return [Prompt("demo", r["id"], r["prompt"], r.get("category", "")) for r in rows]


def humaneval(root: Path) -> list[Prompt]:
    return [Prompt("humaneval", r["task_id"], r["prompt"]) for r in _jsonl(root / "humaneval" / "HumanEval.jsonl.gz")]


def gsm8k(root: Path) -> list[Prompt]:
    return [
        Prompt("gsm8k", str(i), f"Question: {r['question']}\n\nAnswer: Let me solve step by step.\n")
        for i, r in enumerate(_jsonl(root / "gsm8k" / "test.jsonl"))
    ]


def _turns(name: str, path: Path, category: str | None) -> list[Prompt]:
    rows = _jsonl(path)
    cats = sorted({r.get("category", "") for r in rows})
    if category and category not in cats:
        raise InvalidInputError(f"{name} has no category {category!r}. Available: {', '.join(cats)}")
    return [
        Prompt(name if not category else f"{name}:{category}", str(r["question_id"]), r["turns"][0], r.get("category", ""))
        for r in rows
        if not category or r.get("category") == category
    ]


def mbpp(path: Path) -> list[Prompt]:
    return [Prompt("mbpp", str(r.get("task_id", i)), f"# {r['text']}\n") for i, r in enumerate(_jsonl(path))]


def any_jsonl(path: Path) -> list[Prompt]:
    out = []
    for i, r in enumerate(_jsonl(path)):
        for key in ("prompt", "turns", "question", "text", "instruction"):
            if key in r:
                v = r[key][0] if key == "turns" else r[key]
                out.append(Prompt(path.stem, str(r.get("id", r.get("question_id", i))), v))
                break
        else:
            raise InvalidInputError(f"{path}:{i + 1}: no prompt field (prompt, turns, question, text, instruction)")
    return out


DATASETS = "demo, humaneval, gsm8k, mt_bench, spec_bench[:CATEGORY], mbpp:PATH, jsonl:PATH"

# Tune on one part of the data, judge on the other. Every tuned default so far (fit's estimator,
# priors, the spine's thresholds) was measured on `tune`; `measure` holds prompts no tuning has
# seen: later prompts of the same four datasets, and two other Spec-Bench kinds.
SPLITS = {
    "tune": "humaneval@1-20,gsm8k@1-20,mt_bench@1-20,spec_bench:summarization@1-20",
    "measure": "humaneval@41-60,gsm8k@41-60,mt_bench@41-60,spec_bench:summarization@41-60,"
    "spec_bench:qa@41-60,spec_bench:translation@41-60",
}


def load(spec: str, root: str | None = None) -> list[Prompt]:
    """Load a dataset by spec: one of ``DATASETS``."""
    name, _, arg = spec.partition(":")
    if name == "demo":
        return demo()
    if name in ("mbpp", "jsonl"):
        if not arg:
            raise InvalidInputError(f"{name} needs a path: {name}:PATH")
        p = Path(arg).expanduser()
        if not p.exists():
            raise InvalidInputError(f"{p} does not exist")
        return mbpp(p) if name == "mbpp" else any_jsonl(p)
    if name not in ("humaneval", "gsm8k", "mt_bench", "spec_bench"):
        from goose.errors import did_you_mean

        raise InvalidInputError(
            f"Unknown dataset {spec!r}. Available: {DATASETS}.{did_you_mean(name, ['demo', 'humaneval', 'gsm8k', 'mt_bench', 'spec_bench'])}"
        )
    d = data_dir(root)
    if name == "humaneval":
        return humaneval(d)
    if name == "gsm8k":
        return gsm8k(d)
    if name == "mt_bench":
        return _turns("mt_bench", d / "mt_bench" / "question.jsonl", arg or None)
    return _turns("spec_bench", d / "spec_bench" / "question.jsonl", arg or None)
