"""``compose``: build each named component through the registry (goose.manager), bind them, make a Decoder."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence

from goose.decoding import Decoder
from goose.errors import InvalidInputError, call_component
from goose.interfaces import DraftSource, TreePolicy, Verifier
from goose.manager import build_component, get_plugin_manager

ComponentSpec = str | tuple[str, Mapping] | object


class CompositionWarning(UserWarning):
    """A composed decoder holds a part that will never be used (e.g. a source no policy consults)."""


def compose(model, tokenizer=None, *, sources: Sequence[ComponentSpec] = ("pld",), policy: ComponentSpec = "chain",
            verifier: ComponentSpec = "transformers", budget: int = 60,
            source_options: Mapping[str, Mapping] | None = None, policy_options: Mapping | None = None,
            verifier_options: Mapping | None = None, stop_token_ids: Iterable[int] = ()) -> Decoder:
    """Build a speculative decoder for ``model``.

    ``sources`` lists draft sources (names, ``(name, options)`` pairs or DraftSource instances); ``policy``
    shapes their proposals into one tree of at most ``budget`` nodes (root included); ``verifier`` runs the
    model on it. Unknown names fail with the available ones. The verifier is bound to the model and the policy
    to the sources; then each source is attached (model, tokenizer), and the policy (model, bound verifier).
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InvalidInputError(f"budget must be an int >= 1 (nodes per tree, root included), got {budget!r}")
    if isinstance(sources, (str, DraftSource)):
        sources = [sources]
    source_options = dict(source_options or {})
    built: list[DraftSource] = []
    for spec in sources:
        name = spec if isinstance(spec, str) else spec[0] if isinstance(spec, tuple) else None
        built.append(build_component("source", spec, DraftSource, source_options.pop(name, None) if name else None))
    if source_options:
        raise InvalidInputError(f"source_options names {sorted(source_options)} but sources are "
                                f"{[s.name for s in built]}; options must name a listed source")
    names = [s.name for s in built]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise InvalidInputError(f"draft source(s) {dups} listed twice in sources={names}; list each once")
    pol = build_component("policy", policy, TreePolicy, policy_options)
    ver = build_component("verifier", verifier, Verifier, verifier_options)
    call_component("verifier", ver, "bind", model)
    call_component("policy", pol, "bind", built)
    consulted = call_component("policy", pol, "consulted", built)
    never = [s.name for s in built if consulted is not None and s.name not in consulted]
    if never:
        warnings.warn(
            f"policy {pol.name!r} never consults source(s) {never} of sources={[s.name for s in built]}: it "
            f"drafts from {sorted(consulted)} only. Hint: drop the unused source, or use a policy "
            "that merges every source's chain into its tree (chain, spine, spine-fit, iso3).",
            CompositionWarning, stacklevel=2)
    for s in built:
        call_component("source", s, "attach", model, tokenizer)
    call_component("policy", pol, "attach", model, ver)
    desc = f"sources={names} policy={pol.name} verifier={ver.name} budget={budget}"
    return Decoder(model, tokenizer, built, pol, ver, budget, stop_token_ids, _eos_ids(model, tokenizer),
                   get_plugin_manager().hook, desc)


def greedy(model, tokenizer=None, *, stop_token_ids: Iterable[int] = ()) -> Decoder:
    """Plain greedy decoding through the same loop and verifier (one token per forward)."""
    return compose(model, tokenizer, sources=[], policy="none", budget=1, stop_token_ids=stop_token_ids)


def _eos_ids(model, tokenizer) -> list[int]:
    """The eos ids of the model's generation config, else its config, else the tokenizer's."""
    ids: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(cfg, "eos_token_id", None)
        if e is not None:
            ids = [e] if isinstance(e, int) else list(e)
            break
    if not ids and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return ids
