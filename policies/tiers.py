"""A chain source's measured acceptance per confidence tier: where a policy starts its trust in a chain.

Tiers are ``[(floor, p_1, p_deeper), ...]``, highest floor first; a chain belongs to the first floor its
confidence reaches. ``p_1``: how often the first token of a fresh request's first such proposal held;
``p_deeper``: how often depth d >= 2 held given d - 1 held. ``goose tiers --source NAME`` measures them
(:func:`measure`, :func:`summarize`: Wilson lower bounds) and writes the record (:func:`save`); :func:`load`
finds it by source name, ``DraftSource.version`` and :func:`model_key`, in the user store, then in
``goose/data/tiers/``. :func:`for_sources` is the lookup every policy uses; docs/plugins.md, "N sources".

The record ``<source>@<version>@<model>.json`` holds::

    {"source": "pld", "version": "1", "model": "smollm2", "datasets": "...", "max_new_tokens": 64,
     "options": {...the source's options...},
     "tiers": [[1.0, p_1, p_deeper], [0.7, p_1, p_deeper]],
     "measured": [{"floor": 1.0, "proposals": ..., "prompts": ..., "p_1": ..., "p_deeper": ...,
                   "p_deeper_trials": ...}, ...],
     "z": 1.2816}

(``measured``: the raw rates and counts behind each tier, a tier without proposals with zeros and left out
of ``tiers``; ``options``: for the reader only: tiers are looked up by name, version and model.)
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import NamedTuple

from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, DraftState, Request, TokenView, call_source, text_config

Z_DEFAULT = 1.2816  # one-sided 90 %
BANDS = ((2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, 64))  # the depth bands of :func:`by_depth`
BUDGET = 60  # the node budget a source is told (goose.compose's default)


class Tier(NamedTuple):
    """One confidence tier: chains whose confidence reaches ``floor`` start at (p_1, p_deeper)."""

    floor: float
    p_1: float
    p_deeper: float


# -- where tiers are stored ---------------------------------------------------------------------
def store_dir() -> Path:
    """The user store: ``$GOOSE_TIERS_DIR``, else ``$GOOSE_CACHE/tiers``, else ``~/.cache/goose/tiers``."""
    if os.environ.get("GOOSE_TIERS_DIR"):
        return Path(os.environ["GOOSE_TIERS_DIR"]).expanduser()
    return Path(os.environ.get("GOOSE_CACHE", Path.home() / ".cache" / "goose")).expanduser() / "tiers"


def shipped_dir() -> Path:
    """The tiers shipped with the package (``goose/data/tiers/``)."""
    return Path(str(resources.files("goose") / "data" / "tiers"))


def model_key(model) -> str:
    """What tiers are stored under for ``model`` (a model, or a key already): a local folder's name
    (``smollm2``), else the hub id with ``/`` as ``--``, else the architecture and its sizes
    (``ToyCausalLM-v16``); characters other than letters, digits, ``.``, ``_`` and ``-`` become ``-``."""
    if isinstance(model, str):
        key = model
    else:
        cfg = getattr(model, "config", None)
        where = str(getattr(cfg, "name_or_path", "") or getattr(cfg, "_name_or_path", "") or "")
        if where:
            path = Path(where).expanduser()
            key = path.name if (path.is_absolute() or path.exists()) else where.replace("/", "--")
        else:
            text = text_config(cfg)
            parts = [getattr(cfg, "model_type", "") or type(model).__name__]
            for attr, tag in (("vocab_size", "v"), ("hidden_size", "h"), ("num_hidden_layers", "l")):
                value = getattr(text, attr, None)
                if isinstance(value, int):
                    parts.append(f"{tag}{value}")
            key = "-".join(parts)
    key = "".join(c if c.isalnum() or c in "._-" else "-" for c in key.strip()).lstrip(".")
    if not key:
        raise InvalidInputError(
            f"tiers are stored per model, and {model!r} gives no name to store them under. Allowed: a model "
            "with a config (its name_or_path or model_type), or a non-empty key. Hint: load('pld', '1', 'smollm2')"
        )
    return key


def file_name(source: str, version, model=None) -> str:
    """``<source>@<version>@<model>.json``; with no model ``<source>@<version>.json`` (read only where its
    record names the model). A name or version that would leave the folder is refused."""
    for what, value in (("source name", source), ("version", version)):
        text = str(value)
        if not text or text.startswith(".") or any(c in text for c in "/\\@\0") or text != text.strip():
            raise InvalidInputError(
                f"tiers are stored per source name and version; {what} {value!r} cannot name a file. Allowed: "
                "a non-empty name without '/', '\\', '@', leading '.' or surrounding spaces. Hint: a registered "
                "source's name and its DraftSource.version, e.g. load('pld', '1', 'smollm2')"
            )
    return f"{source}@{version}.json" if model is None else f"{source}@{version}@{model_key(model)}.json"


def load(source: str, version, model) -> list[tuple[float, float, float]] | None:
    """The tiers measured for ``source`` at ``version`` with ``model`` (a model or a :func:`model_key`), highest
    floor first, from the user store, else the shipped ones; None when neither has them. Read afresh on every
    call; a malformed file raises :class:`InvalidInputError` naming it."""
    key = model_key(model)
    try:
        names = (file_name(source, version, key), file_name(source, version))
    except InvalidInputError:
        return None  # a name no file can carry: nothing was ever stored for it
    for folder in (store_dir(), shipped_dir()):
        for name in names:
            path = folder / name
            if not path.is_file():
                continue
            try:
                record = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                _bad(path, source, f"it is not readable JSON ({exc})")
            if name == names[1] and (not isinstance(record, dict) or model_key(str(record.get("model", ""))
                                                                             or "?") != key):
                continue  # a file without the model in its name, measured on another model (or none named)
            return check_record(record, source, str(version), path, key)
    return None


def for_sources(sources, model) -> dict[str, list[tuple[float, float, float]]]:
    """``{name: tiers}`` of every chain source among ``sources`` with tiers measured with ``model``: the
    lookup every policy uses."""
    out = {}
    for s in sources:
        if not proposes_chains(type(s)):
            continue
        found = load(s.name, getattr(s, "version", "1"), model)
        if found:
            out[s.name] = found
    return out


def _bad(path, source: str, what: str):
    raise InvalidInputError(
        f"tiers file {str(path)!r}: {what}. Allowed: a JSON object whose \"tiers\" is a list of "
        "[floor, p_1, p_deeper], numbers in [0, 1], floors strictly decreasing. "
        f"Hint: re-run `goose tiers --source {source}` to measure and write it again (or delete the file)"
    )


def check_record(record, source: str, version: str, path="(record)", model: str | None = None
                 ) -> list[tuple[float, float, float]]:
    """The tiers of a record (module docstring) as (floor, p_1, p_deeper) tuples; an
    :class:`InvalidInputError` naming ``path`` where it is malformed."""
    if not isinstance(record, dict):
        _bad(path, source, f"it holds a {type(record).__name__}, not a JSON object")
    looked_up = [("source", source), ("version", version)]
    if model is not None and "model" in record:
        looked_up.append(("model", model))
    for key, want in looked_up:
        if key not in record:
            continue
        got = model_key(str(record[key]) or "?") if key == "model" else str(record[key])
        if got != want:
            _bad(path, source, f"its {key!r} is {record[key]!r}, but the file is looked up as {key} {want!r}")
    tiers = record.get("tiers")
    if not isinstance(tiers, list):
        _bad(path, source, f"its \"tiers\" is {tiers!r}, not a list")
    out = []
    for i, t in enumerate(tiers):
        ok = isinstance(t, (list, tuple)) and len(t) == 3 and all(
            not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and 0.0 <= x <= 1.0 for x in t)
        if not ok:
            _bad(path, source, f"tier {i} is {t!r}, not [floor, p_1, p_deeper] with each a number in [0, 1]")
        if out and not t[0] < out[-1][0]:
            _bad(path, source, f"tier {i}'s floor {t[0]!r} does not fall below the floor before it ({out[-1][0]!r})")
        out.append((float(t[0]), float(t[1]), float(t[2])))
    return out


def save(record: dict, path=None) -> Path:
    """Write ``record`` (checked first) to ``path``, default the user store's ``<source>@<version>@<model>.json``,
    atomically (a temporary file in the same folder, renamed over the old one)."""
    if not isinstance(record, dict) or any(k not in record for k in ("source", "version", "model")):
        raise InvalidInputError(
            f"a tiers record is a dict with at least \"source\", \"version\", \"model\" and \"tiers\"; got "
            f"{record!r:.200}. Hint: the record goose tiers builds (goose.policies.tiers module docstring); \"model\" is "
            "goose.policies.tiers.model_key(model)"
        )
    source, version, model = str(record["source"]), str(record["version"]), model_key(str(record["model"]))
    check_record(record, source, version, path or file_name(source, version, model), model)
    path = Path(path) if path is not None else store_dir() / file_name(source, version, model)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# -- measuring ------------------------------------------------------------------------------------
def check_floors(floors, what: str | None = None) -> tuple[float, ...]:
    """Tier floors as floats: at least one, each in [0, 1], strictly decreasing (highest first); ``what``
    names them in the error (default ``floors [...]``)."""
    try:
        fl = tuple(float(f) for f in floors)
    except (TypeError, ValueError):
        fl = None
    if not fl or any(not math.isfinite(f) or not 0.0 <= f <= 1.0 for f in fl) or any(
            b >= a for a, b in zip(fl, fl[1:])):
        raise InvalidInputError(
            f"{what or f'floors {floors!r}'}: not allowed. Allowed: one or more confidences in [0, 1], highest first, "
            "strictly decreasing (a proposal belongs to the first floor its confidence reaches). Hint: 1.0,0.7"
        )
    return fl


def proposes_chains(cls) -> bool:
    """Whether a source class drafts chains: it overrides ``propose`` (a successor-only source such as ``tr``
    does not)."""
    return cls.propose is not DraftSource.propose


def check_chain_source(source) -> None:
    """Refuse a successor-only source: tiers are measured on a chain source's proposals."""
    if not proposes_chains(type(source)):
        raise InvalidInputError(
            f"source {source.name!r} only gives successors (provides_successors = True, and its propose() "
            "proposes nothing): tiers are measured on a chain source's proposals. Allowed: a source whose "
            "propose() returns chains (pld, suffix, or your own). Hint: goose tiers --source pld"
        )


def _greedy(model, prompt: list[int], max_new: int) -> list[int]:
    """The model's greedy output after ``prompt``: ``model.generate`` for a transformers model, else an
    argmax loop over full forwards."""
    import torch

    from goose.generation import uses_transformers

    ids = torch.tensor([prompt], dtype=torch.long)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    with torch.inference_mode():
        if uses_transformers(model):
            pad = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
            g = model.generate(ids, max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(ids),
                               pad_token_id=0 if pad is None else pad)
            return g[0, ids.shape[1]:].tolist()
        stops = set(eos if isinstance(eos, (list, tuple)) else () if eos is None else (eos,))
        out: list[int] = []
        while len(out) < max_new:
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            if nxt in stops:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def _prompt_ids(tokenizer, text) -> list[int]:
    if not isinstance(text, str):
        return [int(t) for t in text]  # token ids already
    return tokenizer(text, return_tensors="pt")["input_ids"][0].tolist()


def measure(source, model, tokenizer, prompts, max_new_tokens: int, progress=None) -> list[dict]:
    """Every proposal ``source`` (a chain source, deep-copied per prompt) makes along each prompt's greedy output.

    ``prompts``: objects with ``.text`` (a string, or token ids), ``.dataset`` and ``.id``; a tree proposal counts
    its first chain. One row per proposal: dataset, prompt (id), pos, confidence, n (tokens), accepted (how many
    the output continues with), left (output tokens from pos on). ``progress(k, n, prompt)`` follows each prompt."""
    check_chain_source(source)
    vocab = getattr(text_config(model.config), "vocab_size", None)
    rows = []
    for k, p in enumerate(prompts):
        prompt = _prompt_ids(tokenizer, p.text)
        gen = _greedy(model, prompt, max_new_tokens)
        src = copy.deepcopy(source)
        src.begin(Request(tuple(prompt), vocab, max_new_tokens, BUDGET))
        seq = list(prompt)
        for i in range(len(gen)):
            prev = seq[-2] if len(seq) > 1 else None
            st = DraftState(TokenView(seq), len(prompt), seq[-1], prev, BUDGET, max_new_tokens - i, i)
            prop = call_source(src, st, vocab)
            seq.append(gen[i])
            if prop is None:
                continue
            chain = prop.first_chain()
            if not chain:
                continue
            rest, a = gen[i:], 0
            while a < len(chain) and a < len(rest) and chain[a] == rest[a]:
                a += 1
            rows.append(dict(dataset=p.dataset, prompt=p.id, pos=i, confidence=float(prop.confidence),
                             n=len(chain), accepted=a, left=len(rest)))
        if progress is not None:
            progress(k + 1, len(prompts), p)
    return rows


# -- summarizing ----------------------------------------------------------------------------------
def tier_index(confidence: float, floors: Sequence[float]) -> int | None:
    """The index of the first floor ``confidence`` reaches (floors highest first); None below the lowest."""
    return next((i for i, f in enumerate(floors) if confidence >= f), None)


def first_proposals(rows: list[dict]) -> list[dict]:
    """Each prompt's earliest proposal among ``rows`` (what a fresh decoder meets first)."""
    first: dict = {}
    for r in rows:
        key = (r["dataset"], r["prompt"])
        if key not in first or r["pos"] < first[key]["pos"]:
            first[key] = r
    return list(first.values())


def deeper(rows: list[dict], lo: int = 2, hi: int | None = None) -> tuple[int, int]:
    """(hits, trials) of depth d given d - 1, for d in [lo, hi]: a trial where the chain reaches d, the
    output reaches d and depth d - 1 held."""
    t = h = 0
    for r in rows:
        top = min(r["n"], r["left"]) if hi is None else min(hi, r["n"], r["left"])
        for d in range(lo, top + 1):
            if r["accepted"] >= d - 1:
                t += 1
                h += r["accepted"] >= d
    return h, t


def wilson_lower(hits: int, trials: int, z: float = Z_DEFAULT) -> float:
    """The Wilson score interval's lower bound of ``hits / trials`` (0 without trials)."""
    if trials <= 0:
        return 0.0
    p = hits / trials
    z2 = z * z
    centre = p + z2 / (2 * trials)
    spread = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    return max(0.0, (centre - spread) / (1 + z2 / trials))


def _groups(rows: list[dict], floors: Sequence[float]) -> list[list[dict]]:
    """``rows`` per floor, then those below the lowest floor."""
    groups: list[list[dict]] = [[] for _ in range(len(floors) + 1)]
    for r in rows:
        i = tier_index(r["confidence"], floors)
        groups[len(floors) if i is None else i].append(r)
    return groups


def _tally(rows: list[dict], floors: Sequence[float]) -> list[dict]:
    """Per floor, then one entry for below the lowest floor: the counts behind a tier."""
    out = []
    for rs in _groups(rows, floors):
        fs = first_proposals(rs)
        h, t = deeper(rs)
        out.append(dict(proposals=len(rs), prompts=len(fs), p_1_hits=sum(r["accepted"] >= 1 for r in fs),
                        deeper_hits=h, deeper_trials=t))
    return out


def summarize(rows: list[dict], floors: Sequence[float], z: float = Z_DEFAULT) -> tuple[list[Tier], list[dict]]:
    """(tiers, measured) from :func:`measure`'s rows. Per floor (highest first; a proposal belongs to the
    first floor its confidence reaches, to none below the lowest): p_1 over each prompt's first proposal of
    that tier, p_deeper pooled over all its proposals; each stored as the Wilson lower bound at ``z``,
    rounded to 3 decimals. A tier without proposals is left out of ``tiers`` (zeros in ``measured``)."""
    floors = check_floors(floors)
    if not (isinstance(z, (int, float)) and math.isfinite(z) and z >= 0):
        raise InvalidInputError(f"z {z!r}: not allowed. Allowed: a finite number >= 0. Hint: 1.2816 (one-sided 90 %)")
    tiers, measured = [], []
    for floor, c in zip(floors, _tally(rows, floors)):
        n1, t = c["prompts"], c["deeper_trials"]
        measured.append(dict(floor=floor, proposals=c["proposals"], prompts=n1,
                             p_1=round(c["p_1_hits"] / n1, 4) if n1 else 0.0,
                             p_deeper=round(c["deeper_hits"] / t, 4) if t else 0.0, p_deeper_trials=t))
        if n1:
            tiers.append(Tier(floor, round(wilson_lower(c["p_1_hits"], n1, z), 3),
                              round(wilson_lower(c["deeper_hits"], t, z), 3)))
    return tiers, measured


def _labels(floors: Sequence[float]) -> list[str]:
    out = [f"conf >= {floors[0]}"] + [f"{f} <= conf < {hi}" for hi, f in zip(floors, floors[1:])]
    return out + [f"conf < {floors[-1]} (no tier)"]


def table(rows: list[dict], floors: Sequence[float], z: float = Z_DEFAULT) -> str:
    """The per-tier table (Markdown): counts, raw rates (hits/trials) and the stored lower bounds."""
    floors = check_floors(floors)
    tiers = {t.floor: t for t in summarize(rows, floors, z)[0]}
    out = ["| confidence tier | proposals | prompts | p_1 of the first (hits/trials) | p_1 stored "
           "| p_deeper, all (hits/trials) | p_deeper stored |", "|---|---|---|---|---|---|---|"]
    for i, (label, c) in enumerate(zip(_labels(floors), _tally(rows, floors))):
        n1, t = c["prompts"], c["deeper_trials"]
        p1 = f"{c['p_1_hits'] / n1:.3f} ({c['p_1_hits']}/{n1})" if n1 else "-"
        pd = f"{c['deeper_hits'] / t:.3f} ({c['deeper_hits']}/{t})" if t else "-"
        stored = tiers.get(floors[i]) if i < len(floors) else None
        s1, sd = (f"{stored.p_1:.3f}", f"{stored.p_deeper:.3f}") if stored else ("-", "-")
        out.append(f"| {label} | {c['proposals']} | {n1} | {p1} | {s1} | {pd} | {sd} |")
    return "\n".join(out)


def by_depth(rows: list[dict], floors: Sequence[float] = (1.0, 0.7)) -> str:
    """Per tier, the rate of depth d given d - 1 in bands of d, over all proposals (Markdown): does a chain
    that has held longer hold on likelier?"""
    floors = check_floors(floors)
    head = " | ".join(f"p_d, d {a}-{b}" if a != b else f"p_{a}" for a, b in BANDS)
    out = [f"| confidence tier | {head} |", "|---" * (len(BANDS) + 1) + "|"]
    for label, rs in zip(_labels(floors), _groups(rows, floors)):
        cells = [f"{h / t:.3f} ({t})" if t else "-" for h, t in (deeper(rs, lo, hi) for lo, hi in BANDS)]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def progress_line(k: int, n: int, prompt) -> None:
    """A ``progress`` for :func:`measure`: one line per prompt on stderr."""
    print(f"goose tiers: {k}/{n} {prompt.dataset} {prompt.id}", file=sys.stderr, flush=True)
