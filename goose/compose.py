"""``compose``: resolve names through the registry once, validate options, build a Decoder."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pydantic import ValidationError

from goose.decoding import Decoder
from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, TreePolicy, Verifier
from goose.manager import Entry, get_plugin_manager, get_registry

ComponentSpec = str | tuple[str, Mapping] | object


def component_options(entry: Entry, overrides: Mapping | None):
    """Validate ``overrides`` against a registry entry's Options (defaults applied); clear errors."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise InvalidInputError(
            f"options for {entry.kind} {entry.name!r} must be a dict, got {type(overrides).__name__}"
        )
    try:
        return entry.options(dict(overrides or {}))
    except ValidationError as exc:
        fields = sorted(entry.cls.Options.model_fields)
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or '(options)'}: {e['msg']} (got {e.get('input')!r})"
            for e in exc.errors()
        )
        raise InvalidInputError(
            f"Invalid options for {entry.kind} {entry.name!r}: {problems}. "
            f"Allowed options: {', '.join(fields) or '(none)'}."
        ) from exc


class CompositionWarning(UserWarning):
    """A composed decoder holds a part that will never be used (e.g. a source no policy consults)."""


def build_inner(name: str, options: Mapping | None, inherit: Mapping | None = None, outer: str = "") -> TreePolicy:
    """An inner policy by registry name, for wrapping policies (bypass, fit): options validated.

    ``inherit``: options set on the wrapping policy (e.g. ``spine_source``) that reach the inner
    one where it has that option; the same option set differently in ``options`` is an error."""
    entry = get_registry().get("policy", name)
    options = dict(options or {})
    for key, value in (inherit or {}).items():
        if value is None or key not in entry.cls.Options.model_fields:
            continue
        if key in options and options[key] != value:
            raise InvalidInputError(
                f"policy {outer or 'wrapper'!r}: {key}={value!r} and inner_options {key}={options[key]!r} disagree. "
                f"Hint: set {key} once, on the outer policy; it reaches the policies it wraps."
            )
        options[key] = value
    inst = entry.cls(component_options(entry, options))
    inst.name = entry.alias_of or entry.name
    return inst


def _build(kind: str, spec, base: type, extra_options: Mapping | None):
    """Turn a name, a (name, options) pair or a ready instance into a component instance."""
    if isinstance(spec, base):
        if extra_options:
            raise InvalidInputError(f"options given for a ready-made {kind} instance {spec!r}; set them on it")
        return spec
    opts = None
    if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], str):
        spec, opts = spec
    if not isinstance(spec, str):
        raise InvalidInputError(
            f"a {kind} is given by name (str), (name, options) or a goose.{base.__name__} instance; "
            f"got {spec!r}"
        )
    entry = get_registry().get(kind, spec)
    merged = {**(opts or {}), **(extra_options or {})}
    inst = entry.cls(component_options(entry, merged))
    inst.name = entry.alias_of or entry.name
    return inst


def compose(
    model,
    tokenizer=None,
    *,
    sources: Sequence[ComponentSpec] = ("pld",),
    policy: ComponentSpec = "chain",
    verifier: ComponentSpec = "greedy",
    budget: int = 60,
    source_options: Mapping[str, Mapping] | None = None,
    policy_options: Mapping | None = None,
    verifier_options: Mapping | None = None,
    stop_token_ids: Iterable[int] = (),
) -> Decoder:
    """Build a speculative decoder for ``model``.

    ``sources`` lists draft sources (names, ``(name, options)`` pairs or DraftSource instances);
    ``policy`` shapes their proposals into one tree of at most ``budget`` nodes (root included);
    ``verifier`` runs the model on it. Unknown names fail with the available ones.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidInputError(f"budget must be an int >= 1 (nodes per tree, root included), got {budget!r}")
    if isinstance(sources, (str, DraftSource)):
        sources = [sources]
    source_options = dict(source_options or {})
    built: list[DraftSource] = []
    for spec in sources:
        name = spec if isinstance(spec, str) else spec[0] if isinstance(spec, tuple) else None
        built.append(_build("source", spec, DraftSource, source_options.pop(name, None) if name else None))
    if source_options:
        raise InvalidInputError(
            f"source_options names {sorted(source_options)} but sources are "
            f"{[s.name for s in built]}; options must name a listed source"
        )
    names = [s.name for s in built]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise InvalidInputError(f"draft source(s) {dups} listed twice in sources={names}; list each once")
    pol = _build("policy", policy, TreePolicy, policy_options)
    ver = _build("verifier", verifier, Verifier, verifier_options)
    ver.bind(model)
    pol.bind(built)
    consulted = pol.consulted(built)
    never = [s.name for s in built if consulted is not None and s.name not in consulted]
    if never:
        import warnings

        warnings.warn(
            f"policy {pol.name!r} never consults source(s) {never} of sources={[s.name for s in built]}: it "
            f"drafts from {sorted(consulted)} only. Hint: drop the unused source, or use a policy "
            "that merges every source's chain into its tree (chain, spine, spine-fit, iso3).",
            CompositionWarning,
            stacklevel=2,
        )
    if hasattr(pol, "verifier_setup"):  # a fitted policy trusts the latency curve of the verifier's kernels
        vo = getattr(ver, "options", None)
        pol.verifier_setup = ver.setup() if hasattr(ver, "setup") else {k: getattr(vo, k) for k in ("linear", "gqa") if hasattr(vo, k)}
    pol.attach(model)
    pm = get_plugin_manager()
    eos = _eos_ids(model, tokenizer)
    desc = f"sources={names} policy={pol.name} verifier={ver.name} budget={budget}"
    return Decoder(model, tokenizer, built, pol, ver, budget, stop_token_ids, eos, pm.hook, desc)


def greedy(model, tokenizer=None, *, stop_token_ids: Iterable[int] = ()) -> Decoder:
    """Plain greedy decoding through the same loop and verifier (one token per forward)."""
    return compose(model, tokenizer, sources=[], policy="greedy", budget=1, stop_token_ids=stop_token_ids)


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if e is None:
            continue
        ids.extend([e] if isinstance(e, int) else list(e))
        break
    if not ids and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return ids
