"""Method specs: ``SRC+SRC/POLICY{opt=...}`` strings -> :func:`goose.compose` keywords.

A method is a preset name (:data:`PRESETS`) or a spec: draft sources joined by ``+``, then ``/`` and a tree
policy, optionally ``/`` and a verifier, each with options in braces (``pld{max_chain=16}+tr{k=4}/spine-fit``,
``pld+tr/spine-fit/transformers{linear=stock,gqa=false}``). An option value is JSON where it is a dict or a
list (``spine-fit{source_priors={"pld":[[1.0,0.6,0.9]]}}``), else an int, a float, true/false, none, or the
string. Read by ``goose bench``, ``goose generate`` and :func:`goose.vllm.build_sources`.
"""

from __future__ import annotations

import json

from goose.errors import InvalidInputError, did_you_mean

# name -> compose() keyword arguments
PRESETS: dict[str, dict] = {
    "greedy": {"sources": [], "policy": "none"},
    "pld": {"sources": ["pld"], "policy": "chain"},
    "tr": {"sources": ["tr"], "policy": "tr-tree"},
    "tr-original": {"sources": ["tr-original"], "policy": "tr-tree", "budget": 81},
    "iso3": {"sources": ["pld", "tr"], "policy": "iso3"},
    "iso5": {"sources": ["pld", "tr"], "policy": "iso5"},
    "spine": {"sources": ["pld", "tr"], "policy": "spine"},
    "spine-nobypass": {"sources": ["pld", "tr"], "policy": "spine-nobypass"},
    "spine-nobranch": {"sources": ["pld", "tr"], "policy": "spine-nobranch"},
    "spine-nobigram": {"sources": ["pld", ("tr", {"bigram": False})], "policy": "spine"},
    "spine-noprefill": {"sources": ["pld", ("tr", {"prefill_harvest": False})], "policy": "spine"},
    "spine-nopld": {"sources": ["tr"], "policy": "spine"},
    "spine-warm": {"sources": ["pld", ("tr", {"warm": True})], "policy": "spine"},
    "spine-fit": {"sources": ["pld", "tr"], "policy": "spine-fit"},
}
# methods that are not composed decoders (``goose bench`` runs transformers' own generate for them);
# named beside the presets when a method is unknown
BASELINES = ("ar", "hf-pld")


def split_top(text: str, sep: str) -> list[str]:
    """Split at ``sep`` outside braces and brackets (a JSON option value keeps its commas)."""
    out, depth, cur = [], 0, []
    for c in text:
        depth += (c in "{[") - (c in "}]")
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def _value(text: str, key: str = "", name: str = "", method: str = ""):
    """An option value in a method spec: a JSON object or list, int, float, true/false, none, else the string."""
    if text.strip()[:1] in ("{", "["):
        try:
            return json.loads(text)
        except ValueError as exc:
            raise InvalidInputError(
                f"method {method!r}: option {key!r} of {name!r} is not valid JSON ({exc.args[0]}): {text.strip()!r}. "
                'Hint: double-quoted keys, lists for tuples, e.g. source_priors={"pld":[[1.0,0.6,0.9]]}') from None
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text.strip()


def component_spec(spec: str, method: str):
    """``name`` or ``name{key=value,...}`` -> name, or (name, options)."""
    name, brace, rest = spec.partition("{")
    name = name.strip()
    if not name:
        raise InvalidInputError(
            f"method {method!r}: an empty component name. Hint: pld+tr/spine, or pld{{max_chain=16}}/chain")
    if not brace:
        return name
    if not rest.endswith("}") or not _balanced(rest[:-1]):
        raise InvalidInputError(
            f"method {method!r}: options of {name!r} must be written {name}{{key=value,...}}, got {spec!r}. "
            "Hint: pld{max_chain=16}")
    opts = {}
    for item in [x for x in split_top(rest[:-1], ",") if x.strip()]:
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise InvalidInputError(
                f"method {method!r}: option {item!r} of {name!r} is not key=value. Hint: {name}{{key=value}}")
        opts[key.strip()] = _value(val, key.strip(), name, method)
    return (name, opts) if opts else name


def _balanced(text: str) -> bool:
    """Braces and brackets close in order (a JSON value inside a component's options)."""
    stack = []
    for c in text:
        if c in "{[":
            stack.append("}" if c == "{" else "]")
        elif c in "}]":
            if not stack or stack.pop() != c:
                return False
    return not stack


def preset(name: str) -> dict:
    """The compose() keywords of a preset name or a spec: ``sources`` (names, or (name, options) pairs),
    ``policy`` and ``verifier``, each with ``<role>_options`` where given. A preset's dict is returned as it is
    in :data:`PRESETS` (copy it before changing it)."""
    if name in PRESETS:
        return PRESETS[name]
    if "/" in name:
        if not _balanced(name):
            raise InvalidInputError(
                f"method {name!r}: its braces and brackets do not close in order (each component's options in "
                "{...}, a JSON value inside them). Hint: pld+tr/spine-fit{source_priors={\"pld\":[[1.0,0.6,0.9]]}}")
        parts = split_top(name, "/")
        if len(parts) > 3:
            raise InvalidInputError(
                f"method {name!r} has {len(parts)} parts; a method is SRC+SRC/POLICY or SRC+SRC/POLICY/VERIFIER. "
                "Hint: pld+tr/spine-fit/greedy")
        out = {"sources": [component_spec(s, name) for s in split_top(parts[0], "+") if s.strip()]}
        for role, spec in zip(("policy", "verifier"), parts[1:]):
            comp = component_spec(spec, name)
            if isinstance(comp, tuple):
                out[role], out[f"{role}_options"] = comp
            else:
                out[role] = comp
        return out
    raise InvalidInputError(f"Unknown method {name!r}. Available: {', '.join((*BASELINES, *PRESETS))}, or "
                            f"SRC+SRC/POLICY.{did_you_mean(name, (*BASELINES, *PRESETS))}")


def check_method(name: str) -> None:
    """Refuse an unknown method, component or option, or a component that cannot be built, before any model is
    loaded: each component is built as ``compose`` builds it (options validated, ``__init__`` run), short of
    ``bind``, which needs the model."""
    from goose.interfaces import DraftSource, TreePolicy, Verifier
    from goose.manager import build_component

    kw = preset(name)
    for spec in kw.get("sources", []):
        build_component("source", spec, DraftSource, None)
    build_component("policy", kw["policy"], TreePolicy, kw.get("policy_options"))
    build_component("verifier", kw.get("verifier", "transformers"), Verifier, kw.get("verifier_options"))


def split_methods(text: str) -> list[str]:
    """``--methods``: comma-separated, commas inside a component's braces kept (``spine-fit{a=1,b=2}``)."""
    return [m.strip() for m in split_top(text, ",") if m.strip()]
